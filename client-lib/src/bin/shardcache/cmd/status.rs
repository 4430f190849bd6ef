//! `shardcache status`: the cache, registered jobs, peers, reads and counters as
//! tables, or the daemon's status message as JSON (`--json`, every field).

use clap::Args as ClapArgs;
use shardcache_client::proto as pb;
use shardcache_client::{FallbackReason, JobStatus, Status};

use super::{Ctx, count};
use crate::output::{Failure, daemon_failure};
use crate::render::{self, Align, Table};

// (The subcommand's help is on its variant of `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Print JSON (every field the daemon reports) instead of tables.
    #[arg(long)]
    json: bool,
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args { json } = args;
    let client = &ctx.client;
    let socket = ctx.socket.as_path();
    let s = client.status().map_err(|e| daemon_failure(socket, &e))?;
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&pb::StatusReply::from(s)).map_err(|e| e.to_string())?
        );
    } else {
        out!("{}", status_text(&s));
    }
    Ok(())
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
            ("FROM BACKING", Align::Right),
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
                // What the job cost the shared file system from this node: the daemon's
                // fills and its readers' own fallback reads.
                b(j.backing_bytes + j.fallback_bytes),
                format!("{:.1}", j.rate),
                format!("{:.2}s", j.wait_seconds + j.fallback_seconds),
                j.prefetching.to_string(),
            ]);
        }
        out.push_str(&t.render());
        for j in s.jobs.iter().filter(|j| j.lease_seconds > 0) {
            out.push_str(&format!(
                "  job {}: lease {} s, {} of {} alive; {:.0} s before it runs out unless renewed or a holder lives\n",
                j.job,
                j.lease_seconds,
                count(j.lease_holders_alive.into(), "holder", "holders"),
                j.lease_holders,
                j.lease_remaining_seconds
            ));
        }
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
                // Slots are files, or bytes when the manifest gave every file's size.
                let room = if j.placement_slots > 0 {
                    format!("of {} slots", j.placement_slots)
                } else {
                    format!("in {} of room", render::bytes(j.placement_room_bytes))
                };
                out.push_str(&format!(
                    "  job {}: placed over {} nodes; here {} files {room}, {} copies kept until other nodes take them\n",
                    j.job, j.placement_nodes, j.placement_here, j.placement_departing
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
                "{} blocks ({} syncs), {} errors, {} no space, {} shed, {} backlog full; {} waits ({} timed out, {} handed over)",
                c.blocks_filled,
                c.data_syncs,
                c.fill_errors,
                c.fills_no_space,
                c.queue_shed,
                c.backlog_full,
                c.waits,
                c.wait_timeouts,
                c.handoffs
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use shardcache_client::PeerStatus;

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
                "  job resnet: placed over 4 nodes; here 58 files of 60 slots, 2 copies kept until other nodes take them\n"
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
}
