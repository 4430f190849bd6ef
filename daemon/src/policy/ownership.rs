//! Which node keeps which file for the cluster, as the plans say: the placement view the
//! peers fetch by and tell each other about, and the owner every node computes for a
//! file (the plan's balanced owner for a file a shuffle plans, rendezvous hashing
//! otherwise: [`crate::planner::ring`]).
//!
//! Pure reads (and one write, [`Plans::handed`]) of the [`Plans`] cell; no I/O.

use super::Plans;
use crate::meta::Roots;
use crate::planner::{FileRef, Planner, ring};

/// A shuffle registered on this node, as peers are told of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shuffle {
    /// Job id (the same on every node of the job).
    pub job: String,
    /// World size.
    pub world: u64,
    /// The ranks this node runs.
    pub ranks: Vec<u64>,
    /// How many of the job's files this node's cache holds (0: not known yet), or its
    /// bytes when `bytes`.
    pub slots: u64,
    /// `slots` are bytes (see [`crate::policy::Slots`]).
    pub bytes: bool,
    /// This node places by next-reader forwarding (`placement = forward`).
    pub forward: bool,
}

/// The owner of `f` among `healthy` (sorted), as every node computes it: for a file a
/// shuffle plans, the plan's balanced owner ([`Planner::plan_owner`]); else by
/// rendezvous hashing.
pub fn owner_of<'a>(
    p: &Planner,
    roots: &Roots,
    f: &FileRef,
    healthy: &'a [String],
) -> Option<&'a str> {
    let root = &roots.get(f.root).name;
    let id = |f: &FileRef| ring::file_id(&roots.get(f.root).name, &f.path);
    p.plan_owner(f, healthy, &id)
        .or_else(|| ring::file_owner(healthy.iter().map(String::as_str), root, &f.path))
}

impl Plans {
    /// Every registered shuffle, with this node's slots for it.
    pub fn shuffles(&self) -> Vec<Shuffle> {
        let (list, forward) = {
            let p = self.planner();
            (
                p.shuffles(),
                p.scheme() == crate::planner::cluster::Scheme::Forward,
            )
        };
        let slots = self.slots.lock();
        list.into_iter()
            .map(|(job, world, ranks)| Shuffle {
                slots: slots.get(&job).map_or(0, |s| s.units),
                bytes: slots.get(&job).is_some_and(|s| s.bytes),
                forward,
                job,
                world,
                ranks,
            })
            .collect()
    }

    /// True when the cluster placement gave this node the cluster's copy of the file.
    pub fn keeps(&self, root: &str, path: &str) -> bool {
        self.file_ref(root, path)
            .is_some_and(|f| self.planner().keeps(&f))
    }

    /// Where to fetch `path` under `root` from when a shuffle's cluster placement places
    /// it: the nodes holding the cluster's copy (empty: this node reads the backing
    /// store). `None` when no placement places it.
    pub fn placed(&self, root: &str, path: &str) -> Option<Vec<String>> {
        let f = self.file_ref(root, path)?;
        self.planner().sources(&f)
    }

    /// True when the cluster placement places the file and not on this node, nor
    /// brings a copy here for a read (a prefetch of it is no longer wanted).
    pub fn placed_elsewhere(&self, root: &str, path: &str) -> bool {
        let Some(f) = self.file_ref(root, path) else {
            return false;
        };
        let p = self.planner();
        p.sources(&f).is_some() && !p.is_mine(&f)
    }

    /// The (job, rank)s likely to hold `path` under backing root `root` now, by the
    /// plans, most likely first.
    pub fn holders(&self, root: &str, path: &str) -> Vec<(String, u64)> {
        match self.file_ref(root, path) {
            Some(f) => self.planner().holders(&f),
            None => Vec::new(),
        }
    }

    /// The file's owner among `members` (healthy, sorted): by the plan that places it,
    /// else by rendezvous hashing; `None` for a path outside the backing roots.
    pub fn owner(&self, root: &str, path: &str, members: &[String]) -> Option<String> {
        let f = self.file_ref(root, path)?;
        let p = self.planner();
        owner_of(&p, &self.roots, &f, members).map(str::to_owned)
    }

    /// Another node fetched every block of the file to keep it.
    pub fn handed(&self, root: &str, path: &str) {
        if let Some(f) = self.file_ref(root, path) {
            self.planner().set_handed(&f);
        }
    }

    /// Another node has its own copy of the file and keeps it (a release).
    pub fn released(&self, root: &str, path: &str) {
        if let Some(f) = self.file_ref(root, path) {
            self.planner().set_released(&f);
        }
    }
}
