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
//! **The open path never takes the planner lock.** What a client's open tells the
//! planner (the store's policy: a file used, a file cached or dropped; the jobs: a read
//! that may move a job's position) is [deferred](Plans::defer) into a short-lock queue,
//! and applied, in order, by whoever takes the planner lock next ([`Plans::planner`]):
//! the prefetcher every round (an open wakes it), the store's policy when it chooses
//! victims (outside the store's index lock), the jobs' status. A read applied to a job is handed back to the jobs for
//! their accounting ([`Plans::take_applied`]). The queue is bounded: past
//! [`MAX_DEFERRED`] entries the thread that adds one applies them itself (the
//! prefetcher drains it every round, so only an idle or absent prefetcher lets it
//! fill).
//!
//! This module imports the planner, the store's policy seam and the roots; nothing of
//! the peers, the fill engine, the jobs or the server.

pub mod ownership;
pub mod planned;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use std::time::Instant;

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

/// A shuffle's slots on this node: how much of it this node's cache holds (told to
/// peers for the cluster placement), fixed when first computed. With every file's size
/// in the manifest, the capacity ÷ the number of shuffles in bytes; else in files, that
/// ÷ the files' mean size over a sample.
#[derive(Debug, Clone, Copy)]
pub struct Slots {
    /// Files, or bytes.
    pub units: u64,
    /// Bytes per unit: 1 when the slots are bytes, else the files' sampled mean size.
    pub unit_bytes: u64,
    /// The slots are bytes (the placement has every file's size).
    pub bytes: bool,
}

/// Most planner updates queued before the thread adding one applies them itself.
pub const MAX_DEFERRED: usize = 4096;

/// Most applied reads kept for the jobs to account (past it they are dropped, counted
/// as nothing: only the per-job open counts and lead times miss them).
const MAX_APPLIED: usize = 1 << 16;

/// A planner update the open path leaves for the next holder of the planner lock.
#[derive(Debug)]
pub enum Deferred {
    /// The store cached (`true`) or dropped a file.
    Resident(FileRef, bool),
    /// The store's copy of a file was used.
    Touch(FileRef),
    /// A client opened a file (`hit`: cached whole) at `at`: a job whose next reads
    /// include it moves past it.
    Access {
        /// The file.
        file: FileRef,
        /// Cached whole when opened.
        hit: bool,
        /// When.
        at: Instant,
    },
}

/// A read that moved a job's position, for the jobs' accounting.
#[derive(Debug)]
pub struct Applied {
    /// The job.
    pub job: String,
    /// The file read.
    pub file: FileRef,
    /// Cached whole when opened.
    pub hit: bool,
    /// When it was opened.
    pub at: Instant,
}

/// The registered plans as the rest of the daemon sees them (see the module doc).
#[derive(Debug)]
pub struct Plans {
    roots: Arc<Roots>,
    /// Root index by root name (store entries and peers name their root).
    root_index: HashMap<String, usize>,
    planner: Mutex<Planner>,
    slots: Mutex<HashMap<String, Slots>>,
    /// Updates waiting for the planner lock, in the order they happened.
    deferred: Mutex<Vec<Deferred>>,
    /// Reads applied and not yet accounted by the jobs.
    applied: Mutex<Vec<Applied>>,
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
            deferred: Mutex::new(Vec::new()),
            applied: Mutex::new(Vec::new()),
        }
    }

    /// The planner, locked, with every deferred update applied first. Lock order: the
    /// store's policy lock (the policy is called under it), then this one; never the
    /// other way round, and never under the store's index lock. Never called on a
    /// client's open (see the module doc).
    pub fn planner(&self) -> MutexGuard<'_, Planner> {
        let mut p = self.planner.lock();
        self.apply(&mut p);
        p
    }

    /// Leaves `d` for the next holder of the planner lock (see the module doc): a short
    /// lock of a queue, unless the queue is full. Must not be called with the planner
    /// lock held.
    pub fn defer(&self, d: Deferred) {
        let full = {
            let mut q = self.deferred.lock();
            q.push(d);
            q.len() >= MAX_DEFERRED
        };
        if full {
            drop(self.planner());
        }
    }

    /// The reads applied since the last call, oldest first.
    pub fn take_applied(&self) -> Vec<Applied> {
        std::mem::take(&mut *self.applied.lock())
    }

    fn apply(&self, p: &mut Planner) {
        let ops = std::mem::take(&mut *self.deferred.lock());
        if ops.is_empty() {
            return;
        }
        let mut applied = Vec::new();
        for op in ops {
            match op {
                Deferred::Resident(f, on) => p.set_resident(&f, on),
                Deferred::Touch(f) => p.touch(&f),
                Deferred::Access { file, hit, at } => {
                    if let Some(job) = p.on_access(&file, crate::planner::READ_WINDOW) {
                        applied.push(Applied {
                            job: job.to_owned(),
                            file,
                            hit,
                            at,
                        });
                    }
                }
            }
        }
        if !applied.is_empty() {
            let mut a = self.applied.lock();
            if a.len() + applied.len() <= MAX_APPLIED {
                a.extend(applied);
            }
        }
    }

    /// The slots of every shuffle that has them, locked.
    pub fn slots(&self) -> MutexGuard<'_, HashMap<String, Slots>> {
        self.slots.lock()
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
            path: path.into(),
        })
    }
}
