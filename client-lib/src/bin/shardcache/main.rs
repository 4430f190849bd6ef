//! `shardcache`: the operator's and the test suite's view of the local daemon.
//!
//! Exit codes (docs/OPERATIONS.md): 0 done; 1 failed (no daemon, refused, unknown job,
//! I/O); 2 usage (bad flags or values); 3 not ready (`wait`/`prefetch --wait` timed out).

#[macro_use]
mod output;
mod cmd;
mod render;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use shardcache_client::{Client, ClientConfig};

use cmd::Ctx;
use output::Failure;

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
    Status(cmd::status::Args),
    /// What the cache holds: datasets, a job's files, or files under a path.
    ///
    /// Without arguments: every registered job (files, bytes, bytes cached, resident
    /// fraction) and, per backing root, the cached files no job plans. An argument with a
    /// `/` in it is a path (a file, or a directory: its entries, not recursively);
    /// anything else is a job id (its files in manifest order). Users other than root
    /// and the daemon's see only the files they may read.
    Ls(cmd::ls::Args),
    /// Drop cached copies (the backing store is never touched). Root and the daemon's
    /// user only.
    ///
    /// Readers that have a file open keep reading it; later reads fetch it again. Files
    /// a registered job still needs are prefetched again: unregister the job first to
    /// keep them out.
    Evict(cmd::evict::Args),
    /// Print files to standard output, reading them through the cache.
    Cat(cmd::cat::Args),
    /// Register a prefetch manifest (docs/MANIFEST.md) for a job on this node.
    Prefetch(cmd::prefetch::Args),
    /// Wait until a registered job's next reads are cached (for Slurm prologs and init
    /// containers when the job was registered elsewhere).
    ///
    /// The readiness window is what the job reads next, to the end of its current epoch,
    /// as far as the cache can hold it (at most 4096 files). Exits 0 when ready, 3 when
    /// the timeout passes first, 1 when the job is not registered.
    Wait(cmd::wait::Args),
    /// Forget a registered job.
    Unregister(cmd::unregister::Args),
    /// Re-check every cached block's checksum; corrupt blocks are dropped and refetched
    /// when next needed.
    Verify(cmd::verify::Args),
}

fn run(cli: Cli) -> Result<(), Failure> {
    let ctx = Ctx {
        client: Client::with_config(ClientConfig {
            socket: cli.socket.clone(),
            ..ClientConfig::default()
        }),
        socket: cli.socket,
    };
    match cli.cmd {
        Cmd::Status(a) => cmd::status::run(&ctx, a),
        Cmd::Ls(a) => cmd::ls::run(&ctx, a),
        Cmd::Evict(a) => cmd::evict::run(&ctx, a),
        Cmd::Cat(a) => cmd::cat::run(&ctx, a),
        Cmd::Prefetch(a) => cmd::prefetch::run(&ctx, a),
        Cmd::Wait(a) => cmd::wait::run(&ctx, a),
        Cmd::Unregister(a) => cmd::unregister::run(&ctx, a),
        Cmd::Verify(a) => cmd::verify::run(&ctx, a),
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
    use cmd::wait::parse_fraction;

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
    fn evict_needs_exactly_one_selection() {
        assert!(Cli::try_parse_from(["shardcache", "evict"]).is_err());
        assert!(Cli::try_parse_from(["shardcache", "evict", "--all"]).is_ok());
        assert!(Cli::try_parse_from(["shardcache", "evict", "/a", "--all"]).is_err());
        assert!(Cli::try_parse_from(["shardcache", "evict", "--job", "j", "--all"]).is_err());
    }
}
