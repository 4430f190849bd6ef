//! The cluster placement a shuffle runs, by scheme (configuration key `placement`):
//! [`Placement`], every node simulating the whole cluster's reads (`simulate`, the
//! default), or [`Forward`], each copy handed to its next reader (`forward`). The
//! planner asks both the same questions.

use std::sync::Arc;

use super::forward::Forward;
use super::placement::{Layout, Placement, SimStats, Walk};

/// Which cluster placement shuffles run (configuration key `placement`).
pub use crate::config::Scheme;

/// A shuffle's cluster placement, of either scheme.
#[derive(Debug)]
pub enum Cluster {
    /// [`Scheme::Simulate`].
    Sim(Placement),
    /// [`Scheme::Forward`].
    Fwd(Forward),
}

/// Calls the same method on either scheme.
macro_rules! each {
    ($self:expr, $p:ident => $e:expr) => {
        match $self {
            Cluster::Sim($p) => $e,
            Cluster::Fwd($p) => $e,
        }
    };
}

impl Cluster {
    /// A placement of `scheme` for node `me` under `layout`, counting bytes with
    /// `sizes` when the layout does.
    pub fn new(
        scheme: Scheme,
        walk: Walk,
        layout: Layout,
        me: &str,
        lookahead: u64,
        sizes: Option<Arc<[u64]>>,
    ) -> Self {
        match scheme {
            Scheme::Simulate => {
                Self::Sim(Placement::with_sizes(walk, layout, me, lookahead, sizes))
            }
            Scheme::Forward => Self::Fwd(Forward::new(walk, layout, me, lookahead, sizes)),
        }
    }

    /// Its scheme.
    pub fn scheme(&self) -> Scheme {
        match self {
            Self::Sim(_) => Scheme::Simulate,
            Self::Fwd(_) => Scheme::Forward,
        }
    }

    /// The same placement back at the start of the plan.
    pub fn restarted(&self) -> Self {
        match self {
            Self::Sim(p) => Self::Sim(p.restarted()),
            Self::Fwd(p) => Self::Fwd(p.restarted()),
        }
    }

    /// The shuffle it places.
    pub fn walk(&self) -> Walk {
        each!(self, p => p.walk())
    }

    /// This node's name.
    pub fn me(&self) -> &str {
        each!(self, p => p.me())
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        each!(self, p => p.layout())
    }

    /// Rounds placed.
    pub fn placed(&self) -> u64 {
        each!(self, p => p.placed())
    }

    /// Rounds it runs ahead of the readers.
    pub fn lookahead(&self) -> u64 {
        each!(self, p => p.lookahead())
    }

    /// Places rounds until `round` (exclusive).
    pub fn advance(&mut self, round: u64) {
        each!(self, p => p.advance(round))
    }

    /// The node the cluster's copy of `f` is on, if any.
    pub fn holder(&self, f: u32) -> Option<&str> {
        each!(self, p => p.holder(f))
    }

    /// The nodes that held `f` before, most recent first (up to 3).
    pub fn earlier(&self, f: u32) -> Vec<&str> {
        match self {
            Self::Sim(p) => p.earlier(f).collect(),
            Self::Fwd(p) => p.earlier(f),
        }
    }

    /// True when the cluster's copy of `f` is on this node.
    pub fn is_mine(&self, f: u32) -> bool {
        each!(self, p => p.is_mine(f))
    }

    /// True when the cluster's copy of `f` is this node's to keep (a fetch of it takes
    /// the copy over from its giver): for forwarding, not a copy brought here only for
    /// a read within the lookahead.
    pub fn keeps(&self, f: u32) -> bool {
        match self {
            Self::Sim(p) => p.is_mine(f),
            Self::Fwd(p) => p.keeps(f),
        }
    }

    /// True when this node keeps its copy of `f` for the node it moved to.
    pub fn is_owed(&self, f: u32) -> bool {
        each!(self, p => p.is_owed(f))
    }

    /// The copies this node keeps for the nodes they moved to.
    pub fn departing(&self) -> Vec<u32> {
        each!(self, p => p.departing().collect())
    }

    /// This node's copy of `f` is gone.
    pub fn discharge(&mut self, f: u32) {
        each!(self, p => p.discharge(f))
    }

    /// Another node took this node's copy of `f` to keep.
    pub fn taken(&mut self, f: u32) {
        each!(self, p => p.taken(f))
    }

    /// Another node says it has its own copy of `f`.
    pub fn released(&mut self, f: u32) {
        each!(self, p => p.released(f))
    }

    /// True when the placement places `f`.
    pub fn places(&self, f: u32) -> bool {
        each!(self, p => p.places(f))
    }

    /// Files moved onto this node to fetch (see `Placement::incoming`).
    pub fn incoming(
        &mut self,
        max: usize,
        fetch: &dyn Fn(u32) -> bool,
        claimed: &mut Vec<u32>,
    ) -> Vec<u32> {
        each!(self, p => p.incoming(max, fetch, claimed))
    }

    /// This node's slots and the files placed on it now.
    pub fn mine(&self) -> (u64, usize) {
        each!(self, p => p.mine())
    }

    /// The slots file `f` takes.
    pub fn slots_of(&self, f: u32) -> u64 {
        each!(self, p => p.slots_of(f))
    }

    /// What its placed reads found (the whole cluster's for [`Scheme::Simulate`], this
    /// node's own for [`Scheme::Forward`]).
    pub fn stats(&self) -> SimStats {
        each!(self, p => p.stats)
    }
}
