//! The subcommands, one file each: its flags (`Args`), what it asks the daemon
//! (`run`), and how it renders the answer, with the rendering's tests. What they share
//! is here: the client and socket they run with ([`Ctx`]), the longest call, and the
//! wording of counts and of an unknown job.

use std::path::PathBuf;
use std::time::Duration;

use shardcache_client::{Client, Status};

pub mod cat;
pub mod evict;
pub mod ls;
pub mod prefetch;
pub mod status;
pub mod unregister;
pub mod verify;
pub mod wait;

/// What every subcommand runs with.
#[derive(Debug)]
pub struct Ctx {
    pub client: Client,
    /// The daemon's socket (named in messages about reaching it).
    pub socket: PathBuf,
}

/// Longest wait for a listing or an eviction (they walk the index, a directory, a
/// page of stats).
pub const LONG_CALL: Duration = Duration::from_secs(60);
/// `n` and the noun, singular or plural.
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// "No such job", with the ones that are registered.
pub fn unknown_job(job: &str, s: &Status) -> String {
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
