//! `shardcache`: the operator's and the test suite's view of the local daemon.
//!
//! Exit codes (docs/OPERATIONS.md): 0 done; 1 failed (no daemon, refused, unknown job,
//! I/O); 2 usage (bad flags or values); 3 not ready (`wait`/`prefetch --wait` timed out).

mod render;

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use render::{Align, Table};
use shardcache_client::proto as pb;
use shardcache_client::{
    Client, ClientConfig, EvictTarget, FallbackReason, JobStatus, ListQuery, ListTarget, Listing,
    Registered, Status, Verified,
};

/// Talk to the local shardcached.
#[derive(Debug, Parser)]
#[command(
    name = "shardcache",
    version,
    after_help = "Exit codes: 0 done, 1 failed, 2 usage error, 3 not ready (a wait timed out)."
)]
struct Cli {
    /// The daemon's socket.
    #[arg(long, global = true, env = "SHARDCACHE_SOCKET", default_value = shardcache_client::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The cache, registered jobs, peers and counters.
    Status {
        /// Print JSON (every field the daemon reports) instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// What the cache holds: datasets, a job's files, or files under a path.
    ///
    /// Without arguments: every registered job (files, bytes, bytes cached, resident
    /// fraction) and, per backing root, the cached files no job plans. An argument with a
    /// `/` in it is a path (a file, or a directory: its entries, not recursively);
    /// anything else is a job id (its files in manifest order). Users other than root
    /// and the daemon's see only the files they may read.
    Ls {
        /// Job ids or paths (write ./NAME for a file in the current directory).
        targets: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// List every file, not the first --limit.
        #[arg(long, conflicts_with = "limit")]
        all: bool,
        /// Files listed per job or directory.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
    },
    /// Drop cached copies (the backing store is never touched). Root and the daemon's
    /// user only.
    ///
    /// Readers that have a file open keep reading it; later reads fetch it again. Files
    /// a registered job still needs are prefetched again: unregister the job first to
    /// keep them out.
    #[command(group(clap::ArgGroup::new("what").required(true).args(["paths", "job", "all"])))]
    Evict {
        /// Files, or directories (everything cached under them).
        paths: Vec<PathBuf>,
        /// Every cached file of this registered job.
        #[arg(long)]
        job: Option<String>,
        /// Everything cached.
        #[arg(long)]
        all: bool,
    },
    /// Print files to standard output, reading them through the cache.
    Cat {
        /// Files (absolute, or relative to the current directory).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Print where each file's bytes came from to standard error.
        #[arg(long)]
        stats: bool,
    },
    /// Register a prefetch manifest (docs/MANIFEST.md) for a job on this node.
    Prefetch {
        /// The manifest (JSON file).
        manifest: PathBuf,
        /// Register under this job id instead of the manifest's `job` (e.g. a scheduler's
        /// job id, so that two runs of one manifest on a node stay apart).
        #[arg(long)]
        job: Option<String>,
        /// Then wait until this fraction (0–1) of the bytes of the job's readiness
        /// window is cached (as `shardcache wait` does).
        #[arg(long, value_parser = parse_fraction)]
        wait: Option<f64>,
        /// Give up waiting after this many seconds (exit code 3).
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Wait until a registered job's next reads are cached (for Slurm prologs and init
    /// containers when the job was registered elsewhere).
    ///
    /// The readiness window is what the job reads next, to the end of its current epoch,
    /// as far as the cache can hold it (at most 4096 files). Exits 0 when ready, 3 when
    /// the timeout passes first, 1 when the job is not registered.
    Wait {
        /// The job id.
        job: String,
        /// Fraction (0–1) of the window's bytes that must be cached.
        #[arg(long, default_value_t = 1.0, value_parser = parse_fraction)]
        fraction: f64,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Forget a registered job.
    Unregister {
        /// The job id.
        job: String,
    },
    /// Re-check every cached block's checksum; corrupt blocks are dropped and refetched
    /// when next needed.
    Verify {
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{f} is not between 0 and 1"))
    }
}

/// How a command failed, which decides the exit code.
#[derive(Debug)]
enum Failure {
    /// Exit 1.
    Error(String),
    /// Exit 2 (clap reports its own usage errors with 2 as well).
    Usage(String),
    /// Exit 3: a wait ran out of time.
    NotReady(String),
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::Error(_) => 1,
            Failure::Usage(_) => 2,
            Failure::NotReady(_) => 3,
        }
    }

    fn message(&self) -> &str {
        match self {
            Failure::Error(m) | Failure::Usage(m) | Failure::NotReady(m) => m,
        }
    }
}

impl From<String> for Failure {
    fn from(m: String) -> Self {
        Failure::Error(m)
    }
}

/// Writes `text` to standard output. A reader that went away (`shardcache ls | head`)
/// ends the program quietly, as it would a C tool; other write errors fail the command.
fn emit(text: &str) -> Result<(), Failure> {
    let mut o = io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(Failure::Error(format!("writing output: {e}"))),
    }
}

/// `print!` through [`emit`] (in functions returning `Result<_, Failure>`).
macro_rules! out {
    ($($t:tt)*) => {
        emit(&format!($($t)*))?
    };
}

/// `println!` through [`emit`].
macro_rules! outln {
    () => {
        emit("\n")?
    };
    ($($t:tt)*) => {
        emit(&(format!($($t)*) + "\n"))?
    };
}

/// `n` and the noun, singular or plural.
fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// What a registration left out or narrowed, one line each (docs/SEMANTICS.md, "What a
/// registration may change").
fn registration_notes(r: &Registered) -> Vec<String> {
    let mut out = Vec::new();
    if r.dirs_denied > 0 {
        out.push(format!(
            "skipped {} you may not list (their files are not part of the job)",
            count(r.dirs_denied, "directory", "directories")
        ));
    }
    if r.immutable_owner_only {
        out.push(
            "immutable: held only for the files you own (below directories only you, root or the daemon's user own), and only for your own reads; the others follow metadata_ttl (`shardcache status` counts them once looked up)"
                .into(),
        );
    }
    if r.immutable_over_limit > 0 {
        out.push(format!(
            "immutable: {} not held, the daemon holds its most already (they follow metadata_ttl)",
            count(r.immutable_over_limit, "file", "files")
        ));
    }
    out
}

/// What a job's registrant's rights left out of it, if anything.
fn left_out(j: &JobStatus) -> Option<String> {
    let mut parts = Vec::new();
    if j.files_denied > 0 {
        parts.push(format!(
            "{} its registrant may not read (not prefetched)",
            count(j.files_denied, "file", "files")
        ));
    }
    if j.dirs_denied > 0 {
        parts.push(format!(
            "{} its glob could not list",
            count(j.dirs_denied, "directory", "directories")
        ));
    }
    if j.immutable_not_owned > 0 {
        parts.push(format!(
            "{} not held as immutable (not its registrant's own)",
            count(j.immutable_not_owned, "file", "files")
        ));
    }
    if j.immutable_over_limit > 0 {
        parts.push(format!(
            "{} not held as immutable (over the daemon's limit)",
            count(j.immutable_over_limit, "file", "files")
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// What a failed exchange with the daemon means, and what to do about it.
fn daemon_failure(socket: &Path, e: &io::Error) -> Failure {
    Failure::Error(match e.kind() {
        // The client library reports every failure to connect as refused; the socket
        // itself tells a daemon that is down from a caller that is kept out.
        io::ErrorKind::ConnectionRefused
            if rustix::fs::access(socket, rustix::fs::Access::WRITE_OK)
                == Err(rustix::io::Errno::ACCESS) =>
        {
            format!(
                "cannot reach shardcached at {}: permission denied\n  the socket's mode or a directory above it keeps this user out (ls -l {0}; the daemon's socket_mode setting)",
                socket.display()
            )
        }
        io::ErrorKind::ConnectionRefused => format!(
            "cannot reach shardcached at {}: {e}\n  is the daemon running? (systemctl status shardcached; or pass --socket / set SHARDCACHE_SOCKET)",
            socket.display()
        ),
        io::ErrorKind::TimedOut => format!(
            "shardcached at {} did not answer in time: it may be overloaded or hung (journalctl -u shardcached; SHARDCACHE_TIMEOUT_MS raises the limit)",
            socket.display()
        ),
        _ => e.to_string(),
    })
}

/// The status as tables: cache, jobs, peers, reads, counters.
fn status_text(s: &Status) -> String {
    use render::{bytes as b, pairs, percent};
    let c = &s.counters;
    let mut out = format!(
        "shardcached {}, up {}\n",
        s.daemon_version,
        render::duration(s.uptime_seconds)
    );

    out.push_str("\ncache\n");
    let mut cache = vec![
        ("directory", s.cache_dir.clone()),
        ("roots", s.backing_roots.join(", ")),
    ];
    for h in s
        .backing_health
        .iter()
        .filter(|h| h.stalled || h.calls_stuck > 0)
    {
        let state = if h.stalled { "stalled" } else { "stuck calls" };
        cache.push((
            state,
            format!(
                "{}: {} calls stuck, oldest {:.1} s, {} refused (clients read it directly)",
                h.root, h.calls_stuck, h.oldest_call_seconds, h.calls_refused
            ),
        ));
    }
    if !s.metrics_addr.is_empty() {
        cache.push(("metrics", format!("http://{}/metrics", s.metrics_addr)));
    }
    cache.extend([
        (
            "capacity",
            format!(
                "{} used of {} ({})",
                b(s.used_bytes),
                b(s.capacity_bytes),
                percent(s.used_bytes, s.capacity_bytes)
            ),
        ),
        (
            "file system",
            format!(
                "{} free of {} (keeps {} free)",
                b(s.fs_free_bytes),
                b(s.fs_size_bytes),
                b(s.min_free_bytes)
            ),
        ),
        (
            "contents",
            format!(
                "{} files, {} blocks of {}, {} unverified",
                s.files,
                s.blocks,
                b(s.block_size as u64),
                s.unverified_blocks
            ),
        ),
    ]);
    out.push_str(&pairs(2, &cache));

    out.push_str("\njobs\n");
    if s.jobs.is_empty() {
        out.push_str("  none registered (shardcache prefetch MANIFEST)\n");
    } else {
        let mut t = Table::new(&[
            ("JOB", Align::Left),
            ("EPOCH", Align::Right),
            ("STEP", Align::Right),
            ("FILES", Align::Right),
            ("NEXT READS CACHED", Align::Right),
            ("READY", Align::Right),
            ("HIT RATIO", Align::Right),
            ("STEPS/S", Align::Right),
            ("WAITED", Align::Right),
            ("PREFETCHING", Align::Right),
        ])
        .indent(2);
        for j in &s.jobs {
            let read = j.hit_bytes + j.filled_bytes + j.fallback_bytes;
            t.row(vec![
                j.job.clone(),
                j.epoch.to_string(),
                format!("{}/{}", j.step, j.epoch_len),
                j.files.to_string(),
                format!(
                    "{} of {} ({}/{} files)",
                    b(j.window_resident_bytes),
                    b(j.window_bytes),
                    j.window_resident,
                    j.window
                ),
                percent(j.window_resident_bytes, j.window_bytes),
                percent(j.hit_bytes, read),
                format!("{:.1}", j.rate),
                format!("{:.2}s", j.wait_seconds + j.fallback_seconds),
                j.prefetching.to_string(),
            ]);
        }
        out.push_str(&t.render());
        for j in &s.jobs {
            if let Some(left) = left_out(j) {
                out.push_str(&format!(
                    "  job {}: {left}
",
                    j.job
                ));
            }
        }
    }

    out.push_str("\npeers\n");
    if s.peer_id.is_empty() {
        out.push_str("  off (this node shares nothing)\n");
    } else {
        let healthy = s.peers.iter().filter(|p| p.healthy).count();
        out.push_str(&format!(
            "  this node {}; {healthy} of {} members healthy\n",
            s.peer_id,
            s.peers.len()
        ));
        for j in &s.jobs {
            if j.placement_nodes > 0 {
                out.push_str(&format!(
                    "  job {}: placed over {} nodes; here {} of {} slots, {} copies kept until other nodes take them\n",
                    j.job, j.placement_nodes, j.placement_here, j.placement_slots, j.placement_departing
                ));
            }
        }
        let mut t = Table::new(&[
            ("PEER", Align::Left),
            ("STATE", Align::Left),
            ("FAILURES", Align::Right),
            ("LAST OK", Align::Right),
        ])
        .indent(2);
        for p in s.peers.iter().filter(|p| p.id != s.peer_id) {
            t.row(vec![
                p.id.clone(),
                if p.healthy { "healthy" } else { "DOWN" }.into(),
                p.failures.to_string(),
                if p.last_ok_seconds < 0.0 {
                    "never".into()
                } else {
                    format!("{} ago", render::duration(p.last_ok_seconds as u64))
                },
            ]);
        }
        if !t.is_empty() {
            out.push_str(&t.render());
        }
    }

    out.push_str("\nreads (as clients report them)\n");
    let reads = c.hit_reads + c.filled_reads + c.fallback_reads;
    let total = c.hit_bytes + c.filled_bytes + c.fallback_bytes;
    let mut t = Table::new(&[
        ("SOURCE", Align::Left),
        ("BYTES", Align::Right),
        ("READS", Align::Right),
        ("SHARE", Align::Right),
    ])
    .indent(2);
    for (name, by, r) in [
        ("local hit", c.hit_bytes, c.hit_reads),
        ("local fill", c.filled_bytes, c.filled_reads),
        ("backing", c.fallback_bytes, c.fallback_reads),
        ("total", total, reads),
    ] {
        t.row(vec![name.into(), b(by), r.to_string(), percent(by, total)]);
    }
    out.push_str(&t.render());

    out.push_str("\ncounters\n");
    let mut items = vec![(
        "opens",
        format!(
            "{} (complete {}, partial {}, empty {}); direct opens by clients {}",
            c.opens, c.opens_full, c.opens_partial, c.opens_empty, c.fallback_opens
        ),
    )];
    let fallbacks: Vec<String> = s
        .fallbacks
        .iter()
        .filter(|f| f.opens + f.reads > 0)
        .map(|f| {
            // The same names as the metric's `reason` label.
            let why = match f.reason {
                FallbackReason::Unspecified => "unknown",
                r => r.as_str(),
            };
            format!("{why} {} opens {} reads", f.opens, f.reads)
        })
        .collect();
    if !fallbacks.is_empty() {
        items.push(("fallbacks", fallbacks.join(", ")));
    }
    items.extend([
        (
            "refused",
            format!(
                "denied {}, bad path {}, not found {}, other {}",
                c.refused_denied, c.refused_path, c.refused_not_found, c.refused_other
            ),
        ),
        (
            "backing",
            format!(
                "{} reads, {}, {} metadata lookups",
                c.backing_reads,
                b(c.backing_bytes),
                c.backing_stats
            ),
        ),
        (
            "fills",
            format!(
                "{} blocks, {} errors, {} no space, {} shed; {} waits ({} timed out)",
                c.blocks_filled,
                c.fill_errors,
                c.fills_no_space,
                c.queue_shed,
                c.waits,
                c.wait_timeouts
            ),
        ),
    ]);
    if !s.peer_id.is_empty() {
        items.push((
            "peer blocks",
            format!(
                "in {} ({}), out {} ({}); {} failed fetches, {} refused callers, {} forged messages",
                c.peer_blocks_in,
                b(c.peer_bytes_in),
                c.peer_blocks_out,
                b(c.peer_bytes_out),
                c.peer_errors,
                c.peer_refused,
                c.peer_forged
            ),
        ));
    }
    items.push((
        "integrity",
        format!(
            "{} blocks verified, {} corrupt; evicted {} files ({})",
            c.blocks_verified,
            c.corrupt_blocks,
            c.evicted_files,
            b(c.evicted_bytes)
        ),
    ));
    out.push_str(&pairs(2, &items));
    out
}

/// The `ls` table of datasets.
fn datasets_text(r: &Listing) -> String {
    use render::{bytes as b, percent};
    let mut t = Table::new(&[
        ("JOB", Align::Left),
        ("ROOT", Align::Left),
        ("FILES", Align::Right),
        ("SIZE", Align::Right),
        ("CACHED", Align::Right),
        ("RESIDENT", Align::Right),
        ("WHOLE FILES", Align::Right),
    ]);
    let mut sizeless = 0;
    for d in &r.datasets {
        sizeless += d.unsized_files;
        t.row(vec![
            if d.job.is_empty() {
                "(no job)".into()
            } else {
                d.job.clone()
            },
            d.root.clone(),
            d.files.to_string(),
            if d.unsized_files > 0 {
                format!(">= {}", b(d.bytes))
            } else {
                b(d.bytes)
            },
            b(d.resident_bytes),
            percent(d.resident_bytes, d.bytes),
            d.resident_files.to_string(),
        ]);
    }
    let mut out = t.render();
    if sizeless > 0 {
        out.push_str(&format!(
            "note: {sizeless} planned files have not been seen yet; their sizes are not in SIZE (shardcache ls JOB shows them)\n"
        ));
    }
    out
}

/// The `ls` table of files; `limited`: only a first page was asked for.
fn files_text(r: &Listing, limited: bool) -> String {
    use render::{bytes as b, percent};
    let mut t = Table::new(&[
        ("SIZE", Align::Right),
        ("CACHED", Align::Right),
        ("RESIDENT", Align::Right),
        ("PATH", Align::Left),
    ]);
    for f in &r.files {
        if f.is_dir {
            t.row(vec![
                "-".into(),
                "-".into(),
                "dir".into(),
                format!("{}/", f.path),
            ]);
        } else if !f.size_known {
            t.row(vec![
                "?".into(),
                b(f.resident_bytes),
                "-".into(),
                f.path.clone(),
            ]);
        } else {
            t.row(vec![
                b(f.size),
                b(f.resident_bytes),
                percent(f.resident_bytes, f.size),
                f.path.clone(),
            ]);
        }
    }
    let mut out = t.render();
    let listed = r.files.len() as u64 + r.hidden;
    if limited && listed < r.total {
        out.push_str(&format!(
            "... {} more not shown (--all lists every one, --limit N more per page)\n",
            r.total - listed
        ));
    }
    if r.hidden > 0 {
        out.push_str(&format!(
            "{} entries hidden: you may not read them (root or the daemon's user sees all)\n",
            r.hidden
        ));
    }
    out
}

/// Lists `target` (a job or a path), every page when `all`.
fn list_one(
    client: &Client,
    socket: &Path,
    target: &str,
    all: bool,
    limit: u32,
) -> Result<(bool, Listing), Failure> {
    let is_path = target.contains('/') || target == "." || target == "..";
    let target = if is_path {
        let abs = std::path::absolute(target).map_err(|e| format!("{target}: {e}"))?;
        ListTarget::Path(
            abs.to_str()
                .ok_or_else(|| format!("{target}: not valid UTF-8"))?
                .to_owned(),
        )
    } else {
        ListTarget::Job(target.to_owned())
    };
    let mut req = ListQuery {
        target,
        limit: if all { 10_000 } else { limit },
        offset: 0,
    };
    let mut merged = Listing::default();
    loop {
        let r = client
            .list(req.clone(), LONG_CALL)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound
                | io::ErrorKind::InvalidInput
                | io::ErrorKind::PermissionDenied => Failure::Error(e.to_string()),
                _ => daemon_failure(socket, &e),
            })?;
        let n = (r.files.len() as u64 + r.hidden).max(1);
        merged.files.extend(r.files);
        merged.hidden += r.hidden;
        merged.total = r.total;
        req.offset += n;
        if !all || req.offset >= r.total {
            return Ok((is_path, merged));
        }
    }
}

/// Longest wait for a listing or an eviction (they walk the index, a directory, a
/// page of stats).
const LONG_CALL: Duration = Duration::from_secs(60);

fn run(cli: Cli) -> Result<(), Failure> {
    let client = Client::with_config(ClientConfig {
        socket: cli.socket.clone(),
        ..ClientConfig::default()
    });
    let socket = cli.socket.as_path();
    match cli.cmd {
        Cmd::Status { json } => {
            let s = client.status().map_err(|e| daemon_failure(socket, &e))?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&pb::StatusReply::from(s))
                        .map_err(|e| e.to_string())?
                );
            } else {
                out!("{}", status_text(&s));
            }
        }
        Cmd::Ls {
            targets,
            json,
            all,
            limit,
        } => {
            if targets.is_empty() {
                let r = client
                    .list(ListQuery::default(), LONG_CALL)
                    .map_err(|e| daemon_failure(socket, &e))?;
                if json {
                    outln!(
                        "{}",
                        serde_json::to_string_pretty(&pb::ListReply::from(r))
                            .map_err(|e| e.to_string())?
                    );
                } else {
                    out!("{}", datasets_text(&r));
                }
                return Ok(());
            }
            let mut out = Vec::new();
            for (i, target) in targets.iter().enumerate() {
                let (is_path, r) = list_one(&client, socket, target, all, limit)?;
                if json {
                    out.push(serde_json::json!({
                        "target": target,
                        "kind": if is_path { "path" } else { "job" },
                        "files": r.files.into_iter().map(pb::FileEntry::from).collect::<Vec<_>>(),
                        "total": r.total,
                        "hidden": r.hidden,
                    }));
                    continue;
                }
                if targets.len() > 1 {
                    if i > 0 {
                        outln!();
                    }
                    outln!("{target}:");
                }
                out!("{}", files_text(&r, !all));
            }
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
                );
            }
        }
        Cmd::Evict { paths, job, all } => {
            let mut abs_paths = Vec::new();
            for p in &paths {
                let abs = std::path::absolute(p).map_err(|e| format!("{}: {e}", p.display()))?;
                abs_paths.push(
                    abs.to_str()
                        .ok_or_else(|| format!("{}: not valid UTF-8", p.display()))?
                        .to_owned(),
                );
            }
            let job = job.unwrap_or_default();
            let target = match (abs_paths.is_empty(), job.is_empty(), all) {
                (false, true, false) => EvictTarget::Paths(abs_paths),
                (true, false, false) => EvictTarget::Job(job),
                (true, true, true) => EvictTarget::All,
                _ => {
                    return Err(Failure::Usage(
                        "evict: give paths, --job ID or --all (one of them)".into(),
                    ));
                }
            };
            let r = client
                .evict(target, LONG_CALL)
                .map_err(|e| match e.kind() {
                    io::ErrorKind::NotFound
                    | io::ErrorKind::InvalidInput
                    | io::ErrorKind::PermissionDenied => Failure::Error(e.to_string()),
                    _ => daemon_failure(socket, &e),
                })?;
            outln!("evicted {} files ({})", r.files, render::bytes(r.bytes));
            if r.busy > 0 {
                outln!(
                    "{} files left in place: blocks of them are being written now (run evict again)",
                    r.busy
                );
            }
            for p in &r.unmatched {
                eprintln!("shardcache: nothing cached at {p}");
            }
        }
        Cmd::Cat { paths, stats } => {
            let stdout = io::stdout();
            let mut out = stdout.lock();
            let mut buf = vec![0u8; 1 << 20];
            for p in paths {
                let mut r = client
                    .open(&p)
                    .map_err(|e| format!("{}: {e}", p.display()))?;
                loop {
                    let n = r
                        .read(&mut buf)
                        .map_err(|e| format!("{}: {e}", p.display()))?;
                    if n == 0 {
                        break;
                    }
                    out.write_all(&buf[..n])
                        .map_err(|e| format!("writing output: {e}"))?;
                }
                if stats {
                    let s = r.stats();
                    eprintln!(
                        "{}: hit {} B, filled {} B, backing {} B{}",
                        p.display(),
                        s.hit_bytes,
                        s.filled_bytes,
                        s.fallback_bytes,
                        r.fallback_reason()
                            .map(|w| format!(" ({w})"))
                            .unwrap_or_default()
                    );
                }
            }
            out.flush().map_err(|e| format!("writing output: {e}"))?;
        }
        Cmd::Prefetch {
            manifest,
            job,
            wait,
            timeout,
        } => {
            let mut text = std::fs::read_to_string(&manifest)
                .map_err(|e| format!("{}: {e}", manifest.display()))?;
            if let Some(id) = job {
                text =
                    with_job_id(&text, id).map_err(|e| format!("{}: {e}", manifest.display()))?;
            }
            let r = client.register(&text).map_err(|e| match e.kind() {
                io::ErrorKind::InvalidInput => {
                    Failure::Error(format!("{}: {e}", manifest.display()))
                }
                _ => daemon_failure(socket, &e),
            })?;
            outln!("registered job {} ({} files)", r.job, r.files);
            for line in registration_notes(&r) {
                outln!("  {line}");
            }
            if let Some(fraction) = wait {
                wait_ready(
                    &client,
                    socket,
                    &r.job,
                    fraction,
                    Duration::from_secs(timeout),
                )?;
            }
        }
        Cmd::Wait {
            job,
            fraction,
            timeout,
        } => {
            let s = client.status().map_err(|e| daemon_failure(socket, &e))?;
            if !s.jobs.iter().any(|j| j.job == job) {
                return Err(Failure::Error(unknown_job(&job, &s)));
            }
            wait_ready(
                &client,
                socket,
                &job,
                fraction,
                Duration::from_secs(timeout),
            )?;
            outln!("job {job}: ready");
        }
        Cmd::Unregister { job } => {
            let found = client
                .unregister(&job)
                .map_err(|e| daemon_failure(socket, &e))?;
            if !found {
                let known = client
                    .status()
                    .map(|s| unknown_job(&job, &s))
                    .unwrap_or_else(|_| format!("no job `{job}` is registered"));
                return Err(Failure::Error(known));
            }
            outln!("job {job} unregistered");
        }
        Cmd::Verify { timeout } => {
            let v = client
                .verify(Duration::from_secs(timeout))
                .map_err(|e| daemon_failure(socket, &e))?;
            out!("{}", verify_text(&v));
        }
    }
    Ok(())
}

/// "No such job", with the ones that are registered.
fn unknown_job(job: &str, s: &Status) -> String {
    if s.jobs.is_empty() {
        format!(
            "no job `{job}` is registered on this node (none is; shardcache prefetch MANIFEST registers one)"
        )
    } else {
        let ids: Vec<&str> = s.jobs.iter().map(|j| j.job.as_str()).collect();
        format!(
            "no job `{job}` is registered on this node (registered: {})",
            ids.join(", ")
        )
    }
}

/// What `verify` checked and found.
fn verify_text(v: &Verified) -> String {
    let mut out = format!(
        "checked {} blocks ({}) of {} cached files: {} corrupt, {} data files missing\n",
        v.blocks_checked,
        render::bytes(v.bytes_checked),
        v.files_checked,
        v.corrupt_blocks,
        v.missing_files
    );
    if v.corrupt_blocks + v.missing_files > 0 {
        out.push_str(
            "dropped from the cache; they are fetched again from the backing store when next read\n",
        );
    }
    out
}

/// The manifest `text` with its `job` field set to `id` (the daemon validates the rest).
fn with_job_id(text: &str, id: String) -> Result<String, String> {
    let mut v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let obj = v
        .as_object_mut()
        .ok_or("a manifest is a JSON object (docs/MANIFEST.md)")?;
    obj.insert("job".into(), serde_json::Value::String(id));
    Ok(v.to_string())
}

/// Waits until `fraction` of the bytes of the job's readiness window is cached, drawing
/// a progress bar (on a terminal). For Slurm prologs and Kubernetes init containers:
/// [`Failure::NotReady`] on timeout.
fn wait_ready(
    client: &Client,
    socket: &Path,
    job: &str,
    fraction: f64,
    timeout: Duration,
) -> Result<(), Failure> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} of the next reads cached",
        )
        .map_err(|e| e.to_string())?,
    );
    bar.set_message(job.to_owned());
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let s = client.status().map_err(|e| daemon_failure(socket, &e))?;
        let Some(j) = s.jobs.iter().find(|j| j.job == job) else {
            return Err(Failure::Error(format!(
                "job `{job}` is no longer registered (unregistered, or the daemon restarted)"
            )));
        };
        bar.set_length(j.window_bytes);
        bar.set_position(j.window_resident_bytes);
        if j.window == 0 || j.window_resident_bytes as f64 >= fraction * j.window_bytes as f64 {
            bar.finish();
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bar.abandon();
            return Err(Failure::NotReady(format!(
                "job `{job}` not ready after {}s: {} of {} cached ({} of {} files), {} wanted; is prefetch on (prefetch_ahead > 0)? is the backing store slow? (shardcache status)",
                timeout.as_secs(),
                render::bytes(j.window_resident_bytes),
                render::bytes(j.window_bytes),
                j.window_resident,
                j.window,
                render::percent((fraction * 1000.0) as u64, 1000),
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shardcache: {}", e.message());
            ExitCode::from(e.code())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use shardcache_client::PeerStatus;

    #[test]
    fn job_replaces_the_manifests_id_and_keeps_the_rest() {
        let t = with_job_id(
            r#"{"version": 1, "job": "resnet", "root": "/d"}"#,
            "slurm-7".into(),
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&t).unwrap();
        assert_eq!(v["job"], "slurm-7");
        assert_eq!(v["root"], "/d");
        assert_eq!(v["version"], 1);
        assert!(with_job_id("[1]", "x".into()).is_err());
        assert!(with_job_id("{", "x".into()).is_err());
    }

    #[test]
    fn fractions_are_checked_as_usage_errors() {
        assert_eq!(parse_fraction("0.5").unwrap(), 0.5);
        assert_eq!(parse_fraction("1").unwrap(), 1.0);
        assert!(parse_fraction("1.5").is_err());
        assert!(parse_fraction("-0.1").is_err());
        assert!(parse_fraction("half").is_err());
        let e = Cli::try_parse_from(["shardcache", "wait", "j", "--fraction", "2"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn exit_codes_tell_failure_usage_and_not_ready_apart() {
        assert_eq!(Failure::Error(String::new()).code(), 1);
        assert_eq!(Failure::Usage(String::new()).code(), 2);
        assert_eq!(Failure::NotReady(String::new()).code(), 3);
        let refused = io::Error::new(io::ErrorKind::ConnectionRefused, "refused");
        let m = daemon_failure(Path::new("/run/x.sock"), &refused);
        assert!(
            m.message()
                .contains("cannot reach shardcached at /run/x.sock")
        );
        assert!(m.message().contains("systemctl status shardcached"));
        assert_eq!(m.code(), 1);
    }

    #[test]
    fn evict_needs_exactly_one_selection() {
        assert!(Cli::try_parse_from(["shardcache", "evict"]).is_err());
        assert!(Cli::try_parse_from(["shardcache", "evict", "--all"]).is_ok());
        assert!(Cli::try_parse_from(["shardcache", "evict", "/a", "--all"]).is_err());
        assert!(Cli::try_parse_from(["shardcache", "evict", "--job", "j", "--all"]).is_err());
    }

    fn status() -> Status {
        Status {
            daemon_version: "0.1.0".into(),
            uptime_seconds: 3700,
            cache_dir: "/var/cache/shardcache".into(),
            backing_roots: vec!["/lustre/data".into()],
            capacity_bytes: 10 << 30,
            used_bytes: 1 << 30,
            block_size: 4 << 20,
            jobs: vec![JobStatus {
                job: "resnet".into(),
                epoch: 2,
                step: 10,
                epoch_len: 100,
                files: 1000,
                window: 90,
                window_resident: 45,
                window_bytes: 2 << 30,
                window_resident_bytes: 1 << 30,
                hit_bytes: 3,
                filled_bytes: 1,
                placement_nodes: 4,
                placement_slots: 60,
                placement_here: 58,
                placement_departing: 2,
                ..Default::default()
            }],
            peer_id: "node-a".into(),
            peers: vec![
                PeerStatus {
                    id: "node-a".into(),
                    healthy: true,
                    failures: 0,
                    last_ok_seconds: 0.0,
                },
                PeerStatus {
                    id: "node-b".into(),
                    healthy: false,
                    failures: 3,
                    last_ok_seconds: -1.0,
                },
            ],
            counters: shardcache_client::Counters {
                hit_bytes: 3 << 20,
                hit_reads: 3,
                fallback_bytes: 1 << 20,
                fallback_reads: 1,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn status_has_sections_and_aligned_tables() {
        let text = status_text(&status());
        assert!(text.starts_with("shardcached 0.1.0, up 1h 01m\n"), "{text}");
        for section in [
            "\ncache\n",
            "\njobs\n",
            "\npeers\n",
            "\nreads (as clients report them)\n",
            "\ncounters\n",
        ] {
            assert!(text.contains(section), "{section:?} missing:\n{text}");
        }
        assert!(
            text.contains("  capacity     1.0 GiB used of 10.0 GiB (10.0%)"),
            "{text}"
        );
        let job = text.lines().find(|l| l.starts_with("  resnet")).unwrap();
        assert!(
            job.contains("1.0 GiB of 2.0 GiB (45/90 files)") && job.contains("50.0%"),
            "{job}"
        );
        assert!(job.contains("75.0%"), "hit ratio: {job}");
        assert!(
            text.contains(
                "  job resnet: placed over 4 nodes; here 58 of 60 slots, 2 copies kept until other nodes take them\n"
            ),
            "{text}"
        );
        let down = text.lines().find(|l| l.contains("node-b")).unwrap();
        assert!(down.contains("DOWN") && down.contains("never"), "{down}");
        // The reads table: numbers right-aligned in one column.
        let hit = text.lines().find(|l| l.starts_with("  local hit")).unwrap();
        let back = text.lines().find(|l| l.starts_with("  backing ")).unwrap();
        assert_eq!(
            hit.find("3.0 MiB").unwrap() + 7,
            back.find("1.0 MiB").unwrap() + 7
        );
        assert!(
            hit.ends_with("75.0%") && back.ends_with("25.0%"),
            "{hit}\n{back}"
        );
        assert!(
            text.lines().all(|l| l == l.trim_end()),
            "no trailing blanks"
        );
    }

    #[test]
    fn status_without_jobs_or_peers_says_so() {
        let mut s = status();
        s.jobs.clear();
        s.peer_id.clear();
        s.peers.clear();
        let text = status_text(&s);
        assert!(text.contains("jobs\n  none registered"), "{text}");
        assert!(text.contains("peers\n  off"), "{text}");
        assert!(!text.contains("peer blocks"), "{text}");
    }

    #[test]
    fn listings_show_fractions_and_what_was_left_out() {
        let r = Listing {
            datasets: vec![
                shardcache_client::Dataset {
                    job: "resnet".into(),
                    root: "/d".into(),
                    files: 4,
                    bytes: 4 << 20,
                    resident_bytes: 1 << 20,
                    resident_files: 1,
                    unsized_files: 0,
                },
                shardcache_client::Dataset {
                    job: String::new(),
                    root: "/d".into(),
                    files: 2,
                    bytes: 2 << 20,
                    unsized_files: 3,
                    ..Default::default()
                },
            ],
            total: 2,
            ..Default::default()
        };
        let text = datasets_text(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("JOB"), "{text}");
        assert!(
            lines[1].starts_with("resnet") && lines[1].contains("25.0%"),
            "{text}"
        );
        assert!(
            lines[2].starts_with("(no job)") && lines[2].contains(">= 2.0 MiB"),
            "{text}"
        );
        assert!(
            text.contains("3 planned files have not been seen yet"),
            "{text}"
        );

        let files = Listing {
            files: vec![
                shardcache_client::FileEntry {
                    path: "/d/a".into(),
                    size: 2 << 20,
                    size_known: true,
                    resident_bytes: 1 << 20,
                    is_dir: false,
                },
                shardcache_client::FileEntry {
                    path: "/d/sub".into(),
                    is_dir: true,
                    ..Default::default()
                },
            ],
            total: 10,
            hidden: 1,
            ..Default::default()
        };
        let text = files_text(&files, true);
        assert!(text.contains("1.0 MiB     50.0%  /d/a"), "{text}");
        assert!(text.contains("dir  /d/sub/"), "{text}");
        assert!(text.contains("... 7 more not shown"), "{text}");
        assert!(text.contains("1 entries hidden"), "{text}");
        assert!(!files_text(&files, false).contains("more not shown"));
    }

    #[test]
    fn verify_says_what_it_checked_and_what_happens_to_bad_blocks() {
        let clean = verify_text(&Verified {
            blocks_checked: 4,
            bytes_checked: 4 << 20,
            files_checked: 1,
            ..Default::default()
        });
        assert_eq!(
            clean,
            "checked 4 blocks (4.0 MiB) of 1 cached files: 0 corrupt, 0 data files missing\n"
        );
        let bad = verify_text(&Verified {
            blocks_checked: 4,
            corrupt_blocks: 1,
            ..Default::default()
        });
        assert!(
            bad.contains("1 corrupt") && bad.contains("fetched again"),
            "{bad}"
        );
    }
}
