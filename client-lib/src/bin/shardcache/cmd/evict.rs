//! `shardcache evict`: drop cached copies of paths, of a job's files, or of everything
//! (root and the daemon's user only).

use std::io;
use std::path::PathBuf;

use clap::Args as ClapArgs;
use shardcache_client::EvictTarget;

use super::{Ctx, LONG_CALL};
use crate::output::{Failure, daemon_failure};
use crate::render;

// (The subcommand's help is its variant's doc comment on `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["paths", "job", "all"])))]
pub struct Args {
    /// Files, or directories (everything cached under them).
    paths: Vec<PathBuf>,
    /// Every cached file of this registered job.
    #[arg(long)]
    job: Option<String>,
    /// Everything cached.
    #[arg(long)]
    all: bool,
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args { paths, job, all } = args;
    let client = &ctx.client;
    let socket = ctx.socket.as_path();
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
    Ok(())
}
