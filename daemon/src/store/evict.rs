//! Which cached file goes first when space is needed.
//!
//! The store asks an [`EvictionPolicy`] for victims and tells it about inserts, uses and
//! removals; it never orders entries itself. [`Lru`] is the policy for data without a
//! plan. The plan-aware policy (evict what is needed farthest in the future) is
//! `crate::policy::planned`; this module knows no plans, peers or clients.
//!
//! A policy sees keys and (root, path) names only, and is called under the store's
//! policy lock, never under its index lock: it hears of inserts, uses and removals a
//! little after they happen (the index logs them; they are applied, in order, before
//! each look), so what it names may have been used, pinned, filled or dropped since.
//! It must not call back into the store, and touches no data file, journal or index
//! entry: the store takes its choices and verdicts to the index, checks each victim
//! there again (present, no fill running, not pinned) and evicts what still holds.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;
use std::fmt;

use super::Key;

/// A policy's word on evicting one victim for one fill ([`EvictionPolicy::admits`],
/// [`EvictionPolicy::overcommit`]), given before the store takes the index lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The fill may evict the victim.
    pub admits: bool,
    /// How far the fill may take the store over its capacity instead, in bytes.
    pub overcommit: u64,
}

/// Orders cached files for eviction.
pub trait EvictionPolicy: Send + fmt::Debug {
    /// A file entered the cache: `path` under the backing root named `root`.
    fn insert(&mut self, key: Key, root: &str, path: &str);
    /// A file was used (opened or read).
    fn touch(&mut self, key: Key);
    /// A file left the cache.
    fn remove(&mut self, key: &Key);
    /// The file to evict next among those `evictable` accepts, if any.
    fn victim(&mut self, evictable: &dyn Fn(&Key) -> bool) -> Option<Key>;

    /// Up to `max` files to evict next, in order, among those `evictable` accepts: what
    /// one look at the policy's order finds, for a policy whose look is costly (the
    /// store evicts them in turn, checking each again, and past the room a fill needs
    /// evicts a few more of them, never looking again for those: see
    /// `store::room::make_room`). The first is [`EvictionPolicy::victim`]'s choice. The
    /// default: that one alone.
    fn victims(&mut self, max: usize, evictable: &dyn Fn(&Key) -> bool) -> Vec<Key> {
        let _ = max;
        self.victim(evictable).into_iter().collect()
    }

    /// Whether a fill of `path` under `root` may evict `victim` (false: bypass the
    /// cache); `prefetch` when no reader asked for it yet. The default admits everything.
    fn admits(&mut self, _root: &str, _path: &str, _victim: &Key, _prefetch: bool) -> bool {
        true
    }

    /// How far a fill of `path` under `root` may take the store over its capacity
    /// instead of evicting `victim`, in bytes (0: not at all; never past the free-space
    /// floor). A policy that lets two caches swap files uses it: each needs the room
    /// before the other lets go. The default: 0.
    fn overcommit(&mut self, _root: &str, _path: &str, _victim: &Key) -> u64 {
        0
    }

    /// [`EvictionPolicy::admits`] and [`EvictionPolicy::overcommit`] of a fill of
    /// `path` under `root` over each of `victims`, in order: what the store decides by
    /// once it holds the index lock. A policy whose answers cost a lock of their own
    /// takes it once here.
    fn verdicts(
        &mut self,
        root: &str,
        path: &str,
        victims: &[Key],
        prefetch: bool,
    ) -> Vec<Verdict> {
        victims
            .iter()
            .map(|v| Verdict {
                admits: self.admits(root, path, v, prefetch),
                overcommit: self.overcommit(root, path, v),
            })
            .collect()
    }

    /// Every file, least recently used first.
    fn order(&self) -> Vec<Key>;
}

/// Least recently used first.
#[derive(Debug, Default)]
pub struct Lru {
    tick: u64,
    by_tick: BTreeMap<u64, Key>,
    ticks: HashMap<Key, u64>,
}

impl EvictionPolicy for Lru {
    fn insert(&mut self, key: Key, _root: &str, _path: &str) {
        self.touch(key);
    }

    fn touch(&mut self, key: Key) {
        self.tick += 1;
        if let Some(old) = self.ticks.insert(key, self.tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.tick, key);
    }

    fn remove(&mut self, key: &Key) {
        if let Some(t) = self.ticks.remove(key) {
            self.by_tick.remove(&t);
        }
    }

    fn victim(&mut self, evictable: &dyn Fn(&Key) -> bool) -> Option<Key> {
        self.by_tick.values().find(|k| evictable(k)).copied()
    }

    fn order(&self) -> Vec<Key> {
        self.by_tick.values().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_goes_first_skipping_pinned() {
        let k = |i: u8| Key([i; 16]);
        let mut lru = Lru::default();
        lru.insert(k(1), "/r", "a");
        lru.insert(k(2), "/r", "b");
        lru.insert(k(3), "/r", "c");
        lru.touch(k(1));
        assert_eq!(lru.victim(&|_| true), Some(k(2)));
        assert_eq!(lru.victim(&|x| *x != k(2)), Some(k(3)));
        lru.remove(&k(2));
        lru.remove(&k(3));
        assert_eq!(lru.victim(&|_| true), Some(k(1)));
        assert_eq!(lru.victim(&|_| false), None);
    }
}
