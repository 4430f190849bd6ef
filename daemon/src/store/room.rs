//! Making room: the loop that, under the index lock, evicts whole files in the order the
//! [`EvictionPolicy`](super::evict::EvictionPolicy) gives until one more block fits under
//! the capacity and above the free-space floor — or refuses the block (`NoSpace`) when
//! nothing may go (every candidate is being filled or pinned) or the policy does not
//! admit it.
//!
//! The numbers are [`super::space`]'s, the order is the policy's, taking an entry out is
//! [`super::index`]'s. Nothing here does I/O: the files it evicts come back as
//! [`Evicted`]s, whose journal records and unlinks the store does after the lock.

use std::time::Instant;

use super::StoreError;
use super::index::{Evicted, Index, evict_locked};
use super::key::Key;
use super::space::Space;
use crate::stats::{Stats, inc};

/// The block that wants room.
#[derive(Debug)]
pub(super) struct Wanted<'a> {
    /// The file version it belongs to (never evicted for itself).
    pub(super) key: &'a Key,
    pub(super) root: &'a str,
    pub(super) path: &'a str,
    /// The block's length.
    pub(super) len: u64,
    /// A prefetch (the policy may admit it less readily than a read).
    pub(super) prefetch: bool,
    /// The store's directory (for the log: several stores may run in one process).
    pub(super) dir: &'a std::path::Path,
}

/// Evicts until `w` fits (its reservation is the caller's); the evicted files are pushed
/// onto `evicted`. `NoSpace` (counted) when it cannot fit.
pub(super) fn make_room(
    idx: &mut Index,
    space: &Space,
    stats: &Stats,
    w: &Wanted<'_>,
    evicted: &mut Vec<Evicted>,
) -> Result<(), StoreError> {
    // Victims evicted below are unlinked after the lock: count them as freed.
    let fs_free = idx.fs.free_now(idx.used);
    let mut freed = 0u64;
    loop {
        let wanted = idx.used + idx.reserved + w.len;
        let over_cap = wanted > space.capacity;
        let short = (space.min_free + idx.reserved + w.len).saturating_sub(fs_free + freed);
        if !over_cap && short == 0 {
            break;
        }
        let Index {
            files,
            policy,
            pins,
            ..
        } = idx;
        let now = Instant::now();
        let victim = policy.victim(&|k| {
            k != w.key && files.get(k).is_some_and(|e| e.filling == 0) && !pins.holds(k, now)
        });
        let Some(victim) = victim else {
            inc(&stats.fills_no_space);
            return Err(StoreError::NoSpace);
        };
        // Two nodes exchanging the cluster's copies each need a file's room
        // before the other lets go of its copy: the cache may go over its
        // capacity by the copies it keeps until other nodes take them (a
        // bounded number, for a bounded time), never past the free-space floor.
        if short == 0 && wanted <= space.capacity + policy.overcommit(w.root, w.path, &victim) {
            tracing::debug!(path = %w.path, over = wanted - space.capacity, "over capacity for an exchange");
            break;
        }
        if !policy.admits(w.root, w.path, &victim, w.prefetch) {
            // Everything cached is needed sooner than this file: bypass.
            tracing::debug!(path = %w.path, prefetch = w.prefetch, "not admitted: everything cached is needed sooner");
            inc(&stats.fills_no_space);
            return Err(StoreError::NoSpace);
        }
        if let Some(e) = idx.files.get(&victim) {
            tracing::debug!(dir = %w.dir.display(), path = %e.path, to_admit = %w.path, prefetch = w.prefetch, "evicting");
        }
        if let Some(ev) = evict_locked(idx, &victim) {
            freed += ev.bytes;
            evicted.push(ev);
        }
    }
    Ok(())
}
