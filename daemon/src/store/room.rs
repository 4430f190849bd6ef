//! Making room: the loop that, under the index lock, evicts whole files in the order the
//! [`EvictionPolicy`](super::evict::EvictionPolicy) gave until one more block fits under
//! the capacity and above the free-space floor — or refuses the block (`NoSpace`) when
//! the policy does not admit it, or names nothing that may go (every candidate is being
//! filled or pinned).
//!
//! The policy is asked outside the index lock ([`choose`], under the store's policy
//! lock): a plan-aware policy's look takes the planner's lock and may scan thousands of
//! files, and every open of a cached file waits for the index lock. So a fill that must
//! evict goes back and forth: [`make_room`] under the index lock evicts from the victims
//! it was handed, checking each again (present, no fill running, not pinned), and says
//! when it needs more ([`Made::Look`]); [`choose`] gets them, with the policy's verdicts
//! on each for this fill. Victims come several from one look, and a fill that had to
//! evict frees a little room ahead from them ([`room_ahead`]), so that a full cache looks
//! at its policy once per several fills.
//!
//! The numbers are [`super::space`]'s, the order is the policy's, taking an entry out is
//! [`super::index`]'s. Nothing here does I/O: the files it evicts come back as
//! [`Evicted`]s, whose journal records and unlinks the store does after the lock.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use super::StoreError;
use super::evict::{EvictionPolicy, Verdict};
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

/// Most looks at the policy for one fill before it is refused (`NoSpace`): each look
/// leaves out what the ones before named and the index refused (pinned, being filled,
/// gone), so a fill is refused only when the policy named [`VICTIMS`] × this many files
/// none of which could go, or when a look names nothing.
pub(super) const MAX_LOOKS: usize = 8;

/// A fill's progress in making room, across its passes under the index lock.
#[derive(Debug, Default)]
pub(super) struct Making {
    /// Victims the policy chose for it, in its order, with its verdicts.
    chosen: VecDeque<(Key, Verdict)>,
    /// Victims the index refused (left out of the next look).
    refused: HashSet<Key>,
    /// Bytes evicted for it whose data files are unlinked after the lock (counted as
    /// free: the file system's free space does not show them yet).
    freed: u64,
    /// It evicted something (room ahead is freed too).
    evicting: bool,
    /// Looks at the policy so far.
    pub(super) looks: usize,
}

/// What a pass of [`make_room`] came to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Made {
    /// `w` fits.
    Room,
    /// It needs victims (none chosen yet, or every one chosen is spent): [`choose`]
    /// more, outside the index lock, and come back.
    Look,
}

/// Asks `policy` (not under the index lock) for the next victims for `w`, with its
/// verdicts on each, leaving out `w`'s own file and what the index refused before.
/// False when it named nothing: then nothing may go.
pub(super) fn choose(policy: &mut dyn EvictionPolicy, w: &Wanted<'_>, m: &mut Making) -> bool {
    m.looks += 1;
    let refused = &m.refused;
    let victims = policy.victims(VICTIMS, &|k: &Key| k != w.key && !refused.contains(k));
    let verdicts = policy.verdicts(w.root, w.path, &victims, w.prefetch);
    m.chosen = victims.into_iter().zip(verdicts).collect();
    !m.chosen.is_empty()
}

/// Evicts from the victims chosen until `w` fits (its reservation is the caller's); the
/// evicted files are pushed onto `evicted`. `NoSpace` (counted) when the policy does not
/// admit `w` over the next victim. Having evicted for it, evicts on while
/// [`room_ahead`] is not free yet, the next victim already chosen fits in it, and the
/// policy admits `w` over it.
pub(super) fn make_room(
    idx: &mut Index,
    space: &Space,
    stats: &Stats,
    w: &Wanted<'_>,
    m: &mut Making,
    evicted: &mut Vec<Evicted>,
) -> Result<Made, StoreError> {
    // The free space before this fill's evictions (whose files are unlinked after the
    // lock: counted in `m.freed`).
    let fs_free = idx.fs.free_now(idx.used + m.freed);
    // Evicting past what `w` needs (after evicting for it).
    let mut ahead = false;
    loop {
        let wanted = idx.used + idx.reserved + w.len;
        let over_cap = wanted > space.capacity;
        let short = (space.min_free + idx.reserved + w.len).saturating_sub(fs_free + m.freed);
        if !over_cap && short == 0 {
            if !m.evicting || wanted + room_ahead(space) <= space.capacity {
                return Ok(Made::Room);
            }
            ahead = true;
        }
        let now = Instant::now();
        let evictable = |idx: &Index, k: &Key| {
            k != w.key
                && idx.files.get(k).is_some_and(|e| e.filling == 0)
                && !idx.pins.holds(k, now)
        };
        // The next victim chosen that may still go (checked again here: it may have
        // been pinned, filled or evicted since the policy named it).
        let next = loop {
            match m.chosen.pop_front() {
                Some((k, v)) if evictable(idx, &k) => break Some((k, v)),
                Some((k, _)) => {
                    m.refused.insert(k);
                }
                None => break None,
            }
        };
        let Some((victim, verdict)) = next else {
            // Room ahead only from victims already chosen.
            return Ok(if ahead { Made::Room } else { Made::Look });
        };
        if ahead
            && idx.files.get(&victim).is_some_and(|e| {
                space.capacity.saturating_sub(wanted) + e.bytes > room_ahead(space)
            })
        {
            // Never past the room ahead: a cache whose files are each more than 1/256
            // of it evicts only what its fills need.
            return Ok(Made::Room);
        }
        // Two nodes exchanging the cluster's copies each need a file's room
        // before the other lets go of its copy: the cache may go over its
        // capacity by the copies it keeps until other nodes take them (a
        // bounded number, for a bounded time), never past the free-space floor.
        if !ahead && short == 0 && wanted <= space.capacity + verdict.overcommit {
            tracing::debug!(path = %w.path, over = wanted - space.capacity, "over capacity for an exchange");
            return Ok(Made::Room);
        }
        if !verdict.admits {
            if ahead {
                return Ok(Made::Room);
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
            m.freed += ev.bytes;
            evicted.push(ev);
        }
        m.evicting = true;
    }
}
