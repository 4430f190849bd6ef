//! `shardcache cat`: print files, read through the cache like any reader would, and
//! optionally where each one's bytes came from.

use std::io::{self, Read, Write};
use std::path::PathBuf;

use clap::Args as ClapArgs;

use super::Ctx;
use crate::output::Failure;

// (The subcommand's help is its variant's doc comment on `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Files (absolute, or relative to the current directory).
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Print where each file's bytes came from to standard error.
    #[arg(long)]
    stats: bool,
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args { paths, stats } = args;
    let client = &ctx.client;
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
    Ok(())
}
