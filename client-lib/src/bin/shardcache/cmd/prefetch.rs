//! `shardcache prefetch`: register a prefetch manifest (under another job id if asked),
//! say what the registration left out, and optionally wait until the job is ready.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args as ClapArgs;
use shardcache_client::Registered;

use super::wait::{parse_fraction, wait_ready};
use super::{Ctx, count};
use crate::output::{Failure, daemon_failure};

// (The subcommand's help is its variant's doc comment on `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
pub struct Args {
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
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args {
        manifest,
        job,
        wait,
        timeout,
    } = args;
    let client = &ctx.client;
    let socket = ctx.socket.as_path();
    let mut text =
        std::fs::read_to_string(&manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    if let Some(id) = job {
        text = with_job_id(&text, id).map_err(|e| format!("{}: {e}", manifest.display()))?;
    }
    let r = client.register(&text).map_err(|e| match e.kind() {
        io::ErrorKind::InvalidInput => Failure::Error(format!("{}: {e}", manifest.display())),
        _ => daemon_failure(socket, &e),
    })?;
    outln!("registered job {} ({} files)", r.job, r.files);
    for line in registration_notes(&r) {
        outln!("  {line}");
    }
    if let Some(fraction) = wait {
        wait_ready(
            client,
            socket,
            &r.job,
            fraction,
            Duration::from_secs(timeout),
        )?;
    }
    Ok(())
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

/// The manifest `text` with its `job` field set to `id` (the daemon validates the rest).
fn with_job_id(text: &str, id: String) -> Result<String, String> {
    let mut v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let obj = v
        .as_object_mut()
        .ok_or("a manifest is a JSON object (docs/MANIFEST.md)")?;
    obj.insert("job".into(), serde_json::Value::String(id));
    Ok(v.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
}
