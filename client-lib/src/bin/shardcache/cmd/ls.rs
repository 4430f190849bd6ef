//! `shardcache ls`: what the cache holds (the datasets, a job's files, the files under
//! a path) as tables, or the listings as JSON (`--json`).

use std::io;
use std::path::Path;

use clap::Args as ClapArgs;
use shardcache_client::proto as pb;
use shardcache_client::{Client, ListQuery, ListTarget, Listing};

use super::{Ctx, LONG_CALL};
use crate::output::{Failure, daemon_failure};
use crate::render::{self, Align, Table};

// (The subcommand's help is its variant's doc comment on `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
pub struct Args {
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
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args {
        targets,
        json,
        all,
        limit,
    } = args;
    let client = &ctx.client;
    let socket = ctx.socket.as_path();
    if targets.is_empty() {
        let r = client
            .list(ListQuery::default(), LONG_CALL)
            .map_err(|e| daemon_failure(socket, &e))?;
        if json {
            outln!(
                "{}",
                serde_json::to_string_pretty(&pb::ListReply::from(r)).map_err(|e| e.to_string())?
            );
        } else {
            out!("{}", datasets_text(&r));
        }
        return Ok(());
    }
    let mut out = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        let (is_path, r) = list_one(client, socket, target, all, limit)?;
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
    Ok(())
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
}
