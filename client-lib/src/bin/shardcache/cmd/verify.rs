//! `shardcache verify`: have the daemon re-check every cached block's checksum, and say
//! what it found.

use std::time::Duration;

use clap::Args as ClapArgs;
use shardcache_client::Verified;

use super::Ctx;
use crate::output::{Failure, daemon_failure};
use crate::render;

// (The subcommand's help is its variant's doc comment on `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args { timeout } = args;
    let client = &ctx.client;
    let socket = ctx.socket.as_path();
    let v = client
        .verify(Duration::from_secs(timeout))
        .map_err(|e| daemon_failure(socket, &e))?;
    out!("{}", verify_text(&v));
    Ok(())
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
