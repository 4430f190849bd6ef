//! The store's eviction policy when plans are known: which cached file goes first, and
//! whether a fill may displace it at all.
//!
//! The planner's choice when jobs are registered (a file no plan needs, least recently
//! used first, else the file needed farthest in the future, from the planner's eviction
//! index) and its admission rule; plain LRU without jobs. Every entry is reported to
//! the planner either way, so that its index is complete when a job registers. With
//! peers, local copies of files other nodes own go before the files this node owns for
//! the cluster, and the copies a cluster placement moves between nodes may take the
//! store over its capacity while they are exchanged ([`EvictionPolicy::overcommit`]).
//!
//! Called by the store under its policy lock, never its index lock (the store logs what
//! happens to its entries and tells the policy at its next look). What a client's open
//! causes (a file used, cached or dropped) is deferred ([`Plans::defer`]: no planner
//! lock on the open path); choosing victims or judging them for a fill takes the
//! planner lock inside the policy lock (the lock order is store → planner), applying
//! the deferred updates first, once per look ([`EvictionPolicy::verdicts`]). No I/O.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Deferred, Members, Plans, ownership::owner_of};
use crate::planner::{FileRef, Need, Planner};
use crate::store::Key;
use crate::store::evict::{EvictionPolicy, Lru, Verdict};

/// See the module doc.
#[derive(Debug)]
pub struct PlannedPolicy {
    lru: Lru,
    files: HashMap<Key, FileRef>,
    keys: HashMap<FileRef, Key>,
    plans: Arc<Plans>,
    /// The cluster's members, when peers are on: eviction then keeps the files this
    /// node owns for the cluster before its local copies of files others own.
    members: Option<Arc<dyn Members>>,
}

impl PlannedPolicy {
    /// A policy consulting `plans`, and `members` when peers are on.
    pub fn new(plans: Arc<Plans>, members: Option<Arc<dyn Members>>) -> Self {
        Self {
            lru: Lru::default(),
            files: HashMap::new(),
            keys: HashMap::new(),
            plans,
            members,
        }
    }

    /// "This node owns the file for the cluster", when peers are on (see [`owner_of`]).
    fn owner_test(&self) -> Option<impl Fn(&Planner, &FileRef) -> bool + use<>> {
        let (healthy, me) = self.members.as_ref()?.view();
        let roots = self.plans.roots().clone();
        Some(move |p: &Planner, f: &FileRef| {
            p.protects(f)
                .unwrap_or_else(|| owner_of(p, &roots, f, &healthy) == Some(me.as_str()))
        })
    }
}

impl EvictionPolicy for PlannedPolicy {
    fn insert(&mut self, key: Key, root: &str, path: &str) {
        self.lru.insert(key, root, path);
        if let Some(f) = self.plans.file_ref(root, path) {
            self.plans.defer(Deferred::Resident(f.clone(), true));
            self.keys.insert(f.clone(), key);
            self.files.insert(key, f);
        }
    }

    fn touch(&mut self, key: Key) {
        self.lru.touch(key);
        if let Some(f) = self.files.get(&key) {
            self.plans.defer(Deferred::Touch(f.clone()));
        }
    }

    fn remove(&mut self, key: &Key) {
        self.lru.remove(key);
        if let Some(f) = self.files.remove(key)
            && self.keys.get(&f) == Some(key)
        {
            // (Another version of the same path may have taken its place already.)
            self.keys.remove(&f);
            self.plans.defer(Deferred::Resident(f, false));
        }
    }

    fn victim(&mut self, evictable: &dyn Fn(&Key) -> bool) -> Option<Key> {
        self.victims(1, evictable).into_iter().next()
    }

    fn victims(&mut self, max: usize, evictable: &dyn Fn(&Key) -> bool) -> Vec<Key> {
        // With peers, local copies of files other nodes own go before the files this
        // node owns (the cluster's copy: evicting it sends a peer to the backing store).
        let owned = self.owner_test();
        let Self {
            lru,
            files,
            keys,
            plans,
            ..
        } = self;
        if let Some(owned) = owned {
            let local =
                |p: &Planner, k: &Key| evictable(k) && files.get(k).is_none_or(|f| !owned(p, f));
            let v = choose(lru, keys, plans, &local, max);
            if let Some(first) = v.first() {
                if let Some(f) = files.get(first) {
                    tracing::trace!(path = %f.path, placement = %plans.planner().describe_placement(f), "victim");
                }
                return v;
            }
        }
        choose(lru, keys, plans, &|_, k| evictable(k), max)
    }

    fn admits(&mut self, root: &str, path: &str, victim: &Key, prefetch: bool) -> bool {
        let (Some(f), Some(v)) = (self.plans.file_ref(root, path), self.files.get(victim)) else {
            return true;
        };
        let owned = self.owner_test();
        admits_with(&mut self.plans.planner(), owned.as_ref(), &f, v, prefetch)
    }

    /// When both are copies a cluster placement keeps here: the copies this node keeps
    /// for other nodes until they take them (two nodes exchanging the cluster's copies
    /// each need a file's room before the other lets go of its copy; see
    /// `crate::planner::placement`).
    fn overcommit(&mut self, root: &str, path: &str, victim: &Key) -> u64 {
        let (Some(f), Some(v)) = (self.plans.file_ref(root, path), self.files.get(victim)) else {
            return 0;
        };
        {
            let p = self.plans.planner();
            if p.protects(&f) != Some(true) || p.protects(v) != Some(true) {
                return 0;
            }
        }
        self.departing_bytes()
    }

    /// One planner lock for every victim of a look (two when some may go over the
    /// capacity instead), not two per victim.
    fn verdicts(
        &mut self,
        root: &str,
        path: &str,
        victims: &[Key],
        prefetch: bool,
    ) -> Vec<Verdict> {
        let free = Verdict {
            admits: true,
            overcommit: 0,
        };
        let Some(f) = self.plans.file_ref(root, path) else {
            return vec![free; victims.len()];
        };
        let owned = self.owner_test();
        let mut both_kept = false;
        let mut out: Vec<(Verdict, bool)> = {
            let mut p = self.plans.planner();
            let incoming_kept = p.protects(&f) == Some(true);
            victims
                .iter()
                .map(|victim| match self.files.get(victim) {
                    None => (free, false),
                    Some(v) => {
                        let kept = incoming_kept && p.protects(v) == Some(true);
                        both_kept |= kept;
                        let admits = admits_with(&mut p, owned.as_ref(), &f, v, prefetch);
                        (Verdict { admits, ..free }, kept)
                    }
                })
                .collect()
        };
        if both_kept {
            let departing = self.departing_bytes();
            for (v, kept) in &mut out {
                if *kept {
                    v.overcommit = departing;
                }
            }
        }
        out.into_iter().map(|(v, _)| v).collect()
    }

    fn order(&self) -> Vec<Key> {
        self.lru.order()
    }
}

impl PlannedPolicy {
    /// The bytes of the copies this node keeps for other nodes until they take them
    /// (the slots lock is taken after the planner's, not inside it).
    fn departing_bytes(&self) -> u64 {
        let departing = self.plans.planner().departing();
        let slots = self.plans.slots();
        departing
            .iter()
            .map(|(job, n)| n * slots.get(job).map_or(0, |s| s.unit_bytes))
            .sum()
    }
}

/// Whether a fill of `f` may evict `v` (see [`EvictionPolicy::admits`]), with the
/// planner locked and `owned` the owner test when peers are on.
fn admits_with(
    p: &mut Planner,
    owned: Option<&impl Fn(&Planner, &FileRef) -> bool>,
    f: &FileRef,
    v: &FileRef,
    prefetch: bool,
) -> bool {
    if let Some(owned) = owned {
        let placed = p.protects(f).is_some() && p.protects(v).is_some();
        match (owned(p, f), owned(p, v)) {
            // Under a cluster placement, its copies never displace each other (the
            // store goes over capacity by the copies leaving, see `overcommit`).
            (true, true) if placed => return false,
            // A local copy never displaces the cluster's copy of another file.
            (false, true) => return false,
            // The cluster's copy displaces a local copy; and a local copy displaces
            // another: refetching one from its owner costs a transfer between nodes,
            // not reading the shared file system (which is what a client turned away
            // here would do).
            (true, false) | (false, false) => return true,
            (true, true) => {}
        }
    }
    if !p.has_jobs() {
        return true;
    }
    let (incoming, needed) = (p.need(f), p.need(v));
    if incoming == Need::Never && needed == Need::Never {
        return true; // neither is planned: least recently used goes
    }
    if !needed.later_than(incoming) {
        return false; // everything cached is needed sooner: bypass
    }
    // A prefetch decided a moment ago is checked again against the epoch rule.
    !prefetch || {
        let epoch = p.use_epoch(f);
        p.may_evict_for_prefetch(v, epoch)
    }
}

/// Up to `max` victims among files `ok` accepts, in order: the planner's choice with
/// jobs registered, least recently used without (one, then: a look at the LRU order is
/// cheap).
fn choose(
    lru: &mut Lru,
    keys: &HashMap<FileRef, Key>,
    plans: &Plans,
    ok: &dyn Fn(&Planner, &Key) -> bool,
    max: usize,
) -> Vec<Key> {
    let mut p = plans.planner();
    if !p.has_jobs() {
        return lru.victim(&|k| ok(&p, k)).into_iter().collect();
    }
    let named = p.victims_indexed_with(&|p, f| keys.get(f).is_some_and(|k| ok(p, k)), max);
    if named.is_empty() {
        // Entries the planner cannot name (none in practice): least recently used.
        return lru.victim(&|k| ok(&p, k)).into_iter().collect();
    }
    named.iter().filter_map(|f| keys.get(f).copied()).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::backing::mem::MemBacking;
    use crate::meta::{Root, Roots};

    /// What an open causes in the policy (a file used; a file cached, a version dropped)
    /// does not wait for the planner lock; the planner sees it at its next lock.
    #[test]
    fn an_open_does_not_wait_for_the_planner_lock() {
        let roots = Arc::new(Roots::new(vec![Root {
            path: "/r".into(),
            name: "/r".into(),
            backing: Arc::new(MemBacking::new()),
        }]));
        let plans = Arc::new(Plans::new(roots, false));
        let mut policy = PlannedPolicy::new(plans.clone(), None);
        let (k1, k2) = (Key([1; 16]), Key([2; 16]));
        policy.insert(k1, "/r", "a");
        let held = plans.planner();
        let (tx, rx) = mpsc::channel();
        let t = std::thread::spawn(move || {
            policy.touch(k1);
            policy.insert(k2, "/r", "b");
            policy.remove(&k1);
            let _ = tx.send(());
            policy
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("answered while the planner lock was held");
        let f = |p: &str| FileRef {
            root: 0,
            path: p.into(),
        };
        assert!(held.is_resident(&f("a")), "applied up to the lock only");
        drop(held);
        let p = plans.planner();
        assert!(
            !p.is_resident(&f("a")) && p.is_resident(&f("b")),
            "then in order"
        );
        drop(p);
        drop(t.join().unwrap());
    }
}
