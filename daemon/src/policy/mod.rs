//! Plan-aware decisions the store, the peers and the prefetcher consult: the one place
//! where the registered plans meet the cluster.
//!
//! [`Plans`] is the cell the daemon creates first: the planner (behind its lock), this
//! node's slots per shuffle, and the root names, shared by everything that asks what the
//! plans say. The jobs (`crate::jobs`) write into it (registrations, reads, layouts);
//! the store's eviction policy ([`planned::PlannedPolicy`]), the peers (who holds a
//! file, which ranks run here) and the prefetcher read it. Because it exists before any
//! of them, each is handed it at construction: nothing is set later.
//!
//! - [`planned`]: the store's eviction policy (`impl store::evict::EvictionPolicy`);
//! - [`ownership`]: which node keeps which file for the cluster (the placement view the
//!   peers fetch by).
//!
//! This module imports the planner, the store's policy seam and the roots; nothing of
//! the peers, the fill engine, the jobs or the server.

pub mod ownership;
pub mod planned;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::meta::Roots;
use crate::planner::{FileRef, Planner};

pub use ownership::Shuffle;

/// The healthy members of the cluster as every node computes owners over them (sorted),
/// and this node's id. The real one is `peer::membership::Membership`; the policy
/// reads it through this trait, so that it imports nothing of the peers.
pub trait Members: Send + Sync + fmt::Debug {
    /// (healthy members, sorted; this node's id).
    fn view(&self) -> (Vec<String>, String);
}

/// A fixed member list (tests, benchmarks).
#[derive(Debug, Clone)]
pub struct FixedMembers {
    /// Every member, this one included.
    pub members: Vec<String>,
    /// This node.
    pub me: String,
}

impl Members for FixedMembers {
    fn view(&self) -> (Vec<String>, String) {
        let mut m = self.members.clone();
        m.sort_unstable();
        (m, self.me.clone())
    }
}

/// A shuffle's slots on this node: how many of its files this node's cache holds (told
/// to peers for the cluster placement) — the capacity ÷ the number of shuffles ÷ the
/// files' mean size (over a sample), fixed when first computed — and that mean size.
#[derive(Debug, Clone, Copy)]
pub struct Slots {
    /// Files.
    pub files: u64,
    /// Their mean size in bytes.
    pub mean_size: u64,
}

/// The registered plans as the rest of the daemon sees them (see the module doc).
#[derive(Debug)]
pub struct Plans {
    roots: Arc<Roots>,
    /// Root index by root name (store entries and peers name their root).
    root_index: HashMap<String, usize>,
    planner: Mutex<Planner>,
    slots: Mutex<HashMap<String, Slots>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Plans {
    /// No plans yet, over `roots`; `cluster`: peers are on (see
    /// [`Planner::set_cluster`]).
    pub fn new(roots: Arc<Roots>, cluster: bool) -> Self {
        let root_index = roots
            .all()
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.clone(), i))
            .collect();
        let mut planner = Planner::new();
        planner.set_cluster(cluster);
        Self {
            roots,
            root_index,
            planner: Mutex::new(planner),
            slots: Mutex::new(HashMap::new()),
        }
    }

    /// The planner, locked. Lock order: the store's index lock (the policy is called
    /// under it), then this one; never the other way round.
    pub fn planner(&self) -> MutexGuard<'_, Planner> {
        lock(&self.planner)
    }

    /// The slots of every shuffle that has them, locked.
    pub fn slots(&self) -> MutexGuard<'_, HashMap<String, Slots>> {
        lock(&self.slots)
    }

    /// The backing roots.
    pub fn roots(&self) -> &Arc<Roots> {
        &self.roots
    }

    /// The index of the backing root named `root`.
    pub fn root_index(&self, root: &str) -> Option<usize> {
        self.root_index.get(root).copied()
    }

    /// `path` under the backing root named `root`, as the planner names it.
    pub fn file_ref(&self, root: &str, path: &str) -> Option<FileRef> {
        self.root_index(root).map(|r| FileRef {
            root: r,
            path: path.to_owned(),
        })
    }
}
