//! `shardcache`: the operator's and the test suite's view of the local daemon.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use shardcache_client::proto as pb;
use shardcache_client::{Client, ClientConfig};

/// Talk to the local shardcached.
#[derive(Debug, Parser)]
#[command(name = "shardcache", version)]
struct Cli {
    /// The daemon's socket.
    #[arg(long, global = true, env = "SHARDCACHE_SOCKET", default_value = shardcache_client::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Capacity, contents, and hits and misses by source.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
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
        /// Then wait until this fraction (0–1) of the bytes of the job's next epoch (as
        /// far as the cache holds it) is cached.
        #[arg(long)]
        wait: Option<f64>,
        /// Give up waiting after this many seconds.
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

fn human(b: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn print_status(s: &pb::StatusReply) {
    let c = s.counters.unwrap_or_default();
    let pct = if s.capacity_bytes > 0 {
        100.0 * s.used_bytes as f64 / s.capacity_bytes as f64
    } else {
        0.0
    };
    let reads = c.hit_reads + c.filled_reads + c.fallback_reads;
    let bytes = c.hit_bytes + c.filled_bytes + c.fallback_bytes;
    let ratio = |n: u64, d: u64| {
        if d > 0 {
            format!("{:.1}%", 100.0 * n as f64 / d as f64)
        } else {
            "-".into()
        }
    };
    println!(
        "shardcached {}   up {}s",
        s.daemon_version, s.uptime_seconds
    );
    println!("{:<12}{}", "cache dir", s.cache_dir);
    if !s.metrics_addr.is_empty() {
        println!("{:<12}http://{}/metrics", "metrics", s.metrics_addr);
    }
    println!("{:<12}{}", "roots", s.backing_roots.join(", "));
    println!(
        "{:<12}{} of {} ({pct:.1}%), file system free {} (floor {})",
        "capacity",
        human(s.used_bytes),
        human(s.capacity_bytes),
        human(s.fs_free_bytes),
        human(s.min_free_bytes)
    );
    println!(
        "{:<12}{} files, {} blocks of {}, {} unverified",
        "contents",
        s.files,
        s.blocks,
        human(s.block_size as u64),
        s.unverified_blocks
    );
    println!();
    println!(
        "{:<12}{:>14}{:>14}{:>10}",
        "source", "bytes", "reads", "bytes %"
    );
    for (name, b, r) in [
        ("local hit", c.hit_bytes, c.hit_reads),
        ("local fill", c.filled_bytes, c.filled_reads),
        ("backing", c.fallback_bytes, c.fallback_reads),
    ] {
        println!("{name:<12}{:>14}{r:>14}{:>10}", human(b), ratio(b, bytes));
    }
    println!("{:<12}{:>14}{reads:>14}", "total", human(bytes));
    println!();
    println!(
        "{:<12}{} (complete {}, partial {}, empty {}); direct opens by clients {}",
        "opens", c.opens, c.opens_full, c.opens_partial, c.opens_empty, c.fallback_opens
    );
    let fallbacks: Vec<String> = s
        .fallbacks
        .iter()
        .filter(|f| f.opens + f.reads > 0)
        .map(|f| {
            // The same names as the metric's `reason` label.
            let why = match pb::FallbackReason::try_from(f.reason) {
                Ok(pb::FallbackReason::Unspecified) | Err(_) => "unknown".to_owned(),
                Ok(r) => r
                    .as_str_name()
                    .trim_start_matches("FALLBACK_REASON_")
                    .to_ascii_lowercase(),
            };
            format!("{why} {} opens {} reads", f.opens, f.reads)
        })
        .collect();
    if !fallbacks.is_empty() {
        println!("{:<12}{}", "fallbacks", fallbacks.join(", "));
    }
    println!(
        "{:<12}denied {}, bad path {}, not found {}, other {}",
        "refused", c.refused_denied, c.refused_path, c.refused_not_found, c.refused_other
    );
    println!(
        "{:<12}{} reads, {}, {} metadata lookups",
        "backing",
        c.backing_reads,
        human(c.backing_bytes),
        c.backing_stats
    );
    println!(
        "{:<12}{} blocks, {} errors, {} no space, {} shed; {} waits ({} timed out)",
        "fills",
        c.blocks_filled,
        c.fill_errors,
        c.fills_no_space,
        c.queue_shed,
        c.waits,
        c.wait_timeouts
    );
    for j in &s.jobs {
        let read = j.hit_bytes + j.filled_bytes + j.fallback_bytes;
        println!(
            "{:<12}{}: epoch {} step {}/{} ({:.1} steps/s), {} files; readiness window {} of {} cached ({}/{} files)",
            "job",
            j.job,
            j.epoch,
            j.step,
            j.epoch_len,
            j.rate,
            j.files,
            human(j.window_resident_bytes),
            human(j.window_bytes),
            j.window_resident,
            j.window
        );
        println!(
            "{:<12}hit ratio {} (local {}, filled {}, backing {}); opens {} ({} cached whole); waited {:.2}s, read backing {:.2}s; {} files prefetching",
            "",
            ratio(j.hit_bytes, read),
            human(j.hit_bytes),
            human(j.filled_bytes),
            human(j.fallback_bytes),
            j.opens,
            j.opens_hit,
            j.wait_seconds,
            j.fallback_seconds,
            j.prefetching
        );
    }
    if !s.peer_id.is_empty() {
        let healthy = s.peers.iter().filter(|p| p.healthy).count();
        println!(
            "{:<12}this node {}; {} of {} members healthy; from peers {} blocks ({}), to peers {} blocks ({}); {} failed fetches, {} refused callers",
            "peers",
            s.peer_id,
            healthy,
            s.peers.len(),
            c.peer_blocks_in,
            human(c.peer_bytes_in),
            c.peer_blocks_out,
            human(c.peer_bytes_out),
            c.peer_errors,
            c.peer_refused
        );
        for p in s.peers.iter().filter(|p| p.id != s.peer_id) {
            let last = if p.last_ok_seconds < 0.0 {
                "no exchange yet".to_owned()
            } else {
                format!("last ok {:.0}s ago", p.last_ok_seconds)
            };
            println!(
                "{:<12}{} {} ({} failures in a row, {last})",
                "",
                p.id,
                if p.healthy { "healthy" } else { "DOWN" },
                p.failures
            );
        }
    }
    println!(
        "{:<12}{} verified, {} corrupt; evicted {} files ({})",
        "integrity",
        c.blocks_verified,
        c.corrupt_blocks,
        c.evicted_files,
        human(c.evicted_bytes)
    );
}

fn unreachable_hint(socket: &std::path::Path, e: &io::Error) -> String {
    format!(
        "cannot reach shardcached at {}: {e}\n  is the daemon running? (systemctl status shardcached; or pass --socket / set SHARDCACHE_SOCKET)",
        socket.display()
    )
}

fn run(cli: Cli) -> Result<(), String> {
    let client = Client::with_config(ClientConfig {
        socket: cli.socket.clone(),
        ..ClientConfig::default()
    });
    match cli.cmd {
        Cmd::Status { json } => {
            let s = client
                .status()
                .map_err(|e| unreachable_hint(&cli.socket, &e))?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&s).map_err(|e| e.to_string())?
                );
            } else {
                print_status(&s);
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
                io::ErrorKind::InvalidInput => format!("{}: {e}", manifest.display()),
                _ => unreachable_hint(&cli.socket, &e),
            })?;
            println!("registered job {} ({} files)", r.job, r.files);
            if let Some(fraction) = wait {
                wait_ready(&client, &r.job, fraction, Duration::from_secs(timeout))?;
            }
        }
        Cmd::Unregister { job } => {
            let found = client
                .unregister(&job)
                .map_err(|e| unreachable_hint(&cli.socket, &e))?;
            if !found {
                return Err(format!("no job `{job}` is registered"));
            }
            println!("job {job} unregistered");
        }
        Cmd::Verify { timeout } => {
            let v = client
                .verify(Duration::from_secs(timeout))
                .map_err(|e| unreachable_hint(&cli.socket, &e))?;
            println!(
                "checked {} blocks: {} corrupt (dropped, refetched on next use), {} data files missing",
                v.blocks_checked, v.corrupt_blocks, v.missing_files
            );
        }
    }
    Ok(())
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
/// a progress bar.
/// For Slurm prologs and Kubernetes init containers: exits non-zero on timeout.
fn wait_ready(client: &Client, job: &str, fraction: f64, timeout: Duration) -> Result<(), String> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(format!("--wait {fraction}: must be between 0 and 1"));
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} of the next epoch's readiness window cached",
        )
        .map_err(|e| e.to_string())?,
    );
    bar.set_message(job.to_owned());
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let s = client.status().map_err(|e| e.to_string())?;
        let Some(j) = s.jobs.iter().find(|j| j.job == job) else {
            return Err(format!("job `{job}` is no longer registered"));
        };
        bar.set_length(j.window_bytes);
        bar.set_position(j.window_resident_bytes);
        if j.window == 0 || j.window_resident_bytes as f64 >= fraction * j.window_bytes as f64 {
            bar.finish();
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bar.abandon();
            return Err(format!(
                "job `{job}`: {} of {} ready ({} of {} files) after {}s; is prefetch on (prefetch_ahead > 0)? is the backing store slow?",
                human(j.window_resident_bytes),
                human(j.window_bytes),
                j.window_resident,
                j.window,
                timeout.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shardcache: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn job_replaces_the_manifests_id_and_keeps_the_rest() {
        let t = super::with_job_id(
            r#"{"version": 1, "job": "resnet", "root": "/d"}"#,
            "slurm-7".into(),
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&t).unwrap();
        assert_eq!(v["job"], "slurm-7");
        assert_eq!(v["root"], "/d");
        assert_eq!(v["version"], 1);
        assert!(super::with_job_id("[1]", "x".into()).is_err());
        assert!(super::with_job_id("{", "x".into()).is_err());
    }
}
