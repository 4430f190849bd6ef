//! Making room: the loop that, under the index lock, evicts whole files in the order the
//! [`EvictionPolicy`](super::evict::EvictionPolicy) gives until one more block fits under
//! the capacity and above the free-space floor — or refuses the block (`NoSpace`) when
//! nothing may go (every candidate is being filled or pinned) or the policy does not
//! admit it. Victims come several from one look at the policy, and a fill that had to
//! evict frees a little room ahead from them ([`room_ahead`]), so that a full cache looks
//! at its policy once per several fills.
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

/// Most victims taken from one look at the policy ([`EvictionPolicy::victims`]).
const VICTIMS: usize = 16;

/// The room past a fill's own that a fill which had to evict frees as well, from the
/// victims already chosen (none chosen for it alone): up to 1/256 of the capacity, never
/// a file past it (a cache of a few hundred files evicts only what its fills need: one
/// file more there cost the planner's tests a point of their hit ceiling). A full
/// cache then asks its policy for victims once per several fills, not once per fill:
/// under a cluster placement each look scans up to thousands of files under the index
/// lock (`PlannedPolicy::victim`: 27 % of the daemons' CPU under docs/PYTHON.md's example
/// on the testbed, with every open waiting on the lock behind it).
fn room_ahead(space: &Space) -> u64 {
    space.capacity / 256
}

/// Evicts until `w` fits (its reservation is the caller's); the evicted files are pushed
/// onto `evicted`. `NoSpace` (counted) when it cannot fit. Having evicted for it, evicts
/// on while [`room_ahead`] is not free yet, the next victim already chosen fits in it,
/// and the policy admits `w` over it.
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
    // Chosen by the policy's last look, in its order.
    let mut chosen: std::collections::VecDeque<Key> = Default::default();
    // Evicting past what `w` needs (after evicting for it).
    let mut ahead = false;
    let mut evicting = false;
    loop {
        let wanted = idx.used + idx.reserved + w.len;
        let over_cap = wanted > space.capacity;
        let short = (space.min_free + idx.reserved + w.len).saturating_sub(fs_free + freed);
        if !over_cap && short == 0 {
            if !evicting || wanted + room_ahead(space) <= space.capacity {
                break;
            }
            ahead = true;
        }
        let Index {
            files,
            policy,
            pins,
            ..
        } = idx;
        let now = Instant::now();
        let evictable = |k: &Key| {
            k != w.key && files.get(k).is_some_and(|e| e.filling == 0) && !pins.holds(k, now)
        };
        let mut looked = false;
        let victim = loop {
            match chosen.pop_front() {
                // (Checked again: an earlier eviction's bookkeeping may have changed it.)
                Some(k) if evictable(&k) => break Some(k),
                Some(_) => {}
                // Room ahead only from victims already chosen.
                None if ahead || looked => break None,
                None => {
                    chosen = policy.victims(VICTIMS, &evictable).into();
                    looked = true;
                }
            }
        };
        let Some(victim) = victim else {
            if ahead {
                break;
            }
            inc(&stats.fills_no_space);
            return Err(StoreError::NoSpace);
        };
        if ahead
            && files.get(&victim).is_some_and(|e| {
                space.capacity.saturating_sub(wanted) + e.bytes > room_ahead(space)
            })
        {
            // Never past the room ahead: a cache whose files are each more than 1/256
            // of it evicts only what its fills need.
            break;
        }
        // Two nodes exchanging the cluster's copies each need a file's room
        // before the other lets go of its copy: the cache may go over its
        // capacity by the copies it keeps until other nodes take them (a
        // bounded number, for a bounded time), never past the free-space floor.
        if !ahead
            && short == 0
            && wanted <= space.capacity + policy.overcommit(w.root, w.path, &victim)
        {
            tracing::debug!(path = %w.path, over = wanted - space.capacity, "over capacity for an exchange");
            break;
        }
        if !policy.admits(w.root, w.path, &victim, w.prefetch) {
            if ahead {
                break;
            }
            // Everything cached is needed sooner than this file: bypass.
            tracing::debug!(path = %w.path, prefetch = w.prefetch, "not admitted: everything cached is needed sooner");
            inc(&stats.fills_no_space);
            return Err(StoreError::NoSpace);
        }
        if let Some(e) = idx.files.get(&victim) {
            tracing::debug!(dir = %w.dir.display(), path = %e.path, to_admit = %w.path, prefetch = w.prefetch, ahead, "evicting");
        }
        if let Some(ev) = evict_locked(idx, &victim) {
            freed += ev.bytes;
            evicted.push(ev);
        }
        evicting = true;
    }
    Ok(())
}
