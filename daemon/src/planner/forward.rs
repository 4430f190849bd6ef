//! Cluster placement by next-reader forwarding: after a node reads a file, the cluster's
//! copy goes to the node whose rank reads it next (`placement = forward`; issue 15's
//! scale work). The alternative to [`super::placement`]'s simulation of the whole
//! cluster, which every node runs over every rank's reads.
//!
//! Every node computes the same epoch orders from the manifest, so each file's readers
//! are known to all: the rank reading it at each world position, and so its node. What
//! a node does is a function of those orders, the layout and its own position only:
//!
//! - **What a node keeps of an epoch.** A node keeps copies of its first reads of an
//!   epoch (a repeat of the sampler's padding reads its first reader's copy) in order
//!   while they fit its slots (files, or bytes when the manifest gives the sizes): its
//!   *kept prefix*, the reads before its *cut*. At an aggregate cache of the dataset or
//!   more that is every read; at `a < 1` about the first `a` of them. The reads past the
//!   cuts go, in order, to the nodes that keep all their own while they have room (the
//!   *spill*: reads do not fall evenly on the nodes in bytes). Every node computes every
//!   node's cut and the spill (two passes over the epoch's order).
//! - **Where a copy is.** From a file's first read of an epoch on, its copy is kept for
//!   the node that keeps its first read of the next epoch: the reader keeps it when that
//!   is itself, else keeps it *owed* until that node took it (or a bound ran out, as with
//!   the simulation), and that node fetches it (it *arrives*, parked until its read). A
//!   read no node keeps, a spilled one or a repeat is brought to its node `lookahead`
//!   rounds before it from wherever a copy is, else from the backing store.
//! - **Room.** At round `t` of an epoch of `E` reads per node a node holds its kept
//!   reads not yet made (`K − t`, when it keeps `K ≤ E`) and the next epoch's kept reads
//!   whose read this epoch was made already (about `K · t / E`): at most `K` — its slots —
//!   give or take the spread of where those reads fall (a hypergeometric count: about
//!   `√K`), plus copies in flight.
//!
//! Hence about `(M − 1) / M` copies move per read (a next reader on another node), the
//! backing store is read `max(0, 1 − a)` of the dataset per epoch (the reads past the
//! cuts), and a node's work per epoch is one pass over each epoch's order (to index it
//! and to find the cuts and the spill) plus its own reads and arrivals — not a simulation of the
//! cluster's reads. There is nothing to replay: a new layout, or a position that moved
//! back, starts from the current round.
//!
//! Pure logic: no I/O, no clock.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::EpochIndex;
use super::placement::{Layout, SimStats, Walk};

/// Lookaheads a copy owed to its next reader is kept at least (as the simulation's).
const OWED_LOOKAHEADS: u64 = 4;

/// Past [`OWED_LOOKAHEADS`], owed copies take at most this share of the node's slots.
const DEPARTING_SHARE: u64 = 4;

/// One epoch of the world's order, as forwarding reads it.
#[derive(Debug)]
pub struct View {
    ix: Arc<EpochIndex>,
    /// Per node, the first world position of the epoch whose read by it keeps no copy
    /// (its reads before it fit its slots); the epoch's length when it keeps them all.
    cut: Vec<u64>,
    /// The first reads past their node's cut that a node with room to spare (one that
    /// keeps all its own) keeps instead: file → that node. Reads are not spread evenly
    /// over the nodes in bytes (sizes, the padding's repeats, nodes running more ranks
    /// than others), and at an aggregate cache of the dataset the room one node lacks
    /// another has.
    spill: HashMap<u32, u16>,
}

impl View {
    /// The node that keeps the copy for the read at position `p` of `f` (a first read):
    /// its reader's node within its cut, else the node it spilled to, if any.
    fn keeper(&self, f: u32, p: u64, node: Option<u16>) -> Option<u16> {
        let n = node?;
        if p < self.cut[n as usize] {
            Some(n)
        } else {
            self.spill.get(&f).copied()
        }
    }
}

/// A node's forwarding state (see the module documentation).
#[derive(Debug)]
pub struct Forward {
    walk: Walk,
    layout: Layout,
    me: Option<u16>,
    me_name: String,
    lookahead: u64,
    sizes: Option<Arc<[u64]>>,
    /// This node's ranks.
    my_ranks: Vec<u64>,
    /// The next round to place (the position plus the lookahead; absolute: 0 is the first
    /// epoch's first round).
    next: u64,
    /// The epochs' views in use (relative epoch, view), a few at a time.
    views: Vec<(u64, Arc<View>)>,
    /// Files whose copy comes here for this node's reads, with the round of the read it
    /// comes for, in round order (but after a jump, which queues the rest of the epoch's
    /// kept reads at once, before the lookahead's next rounds).
    incoming: VecDeque<(u32, u64)>,
    /// The copies parked here for the next epoch, in the order they came.
    parked: VecDeque<u32>,
    /// The kept reads of this node in epoch `arrivals_for` whose copy is read the epoch
    /// before by another node, by (the round of that read, file); `arrived` of them are
    /// in `incoming` already.
    arrivals: Vec<(u64, u32)>,
    arrivals_for: u64,
    arrived: usize,
    /// Copies this node read that it keeps for their next reader: the round until which.
    owed: HashMap<u32, u64>,
    /// The moves away from this node per keeper, as (round kept until, round of this
    /// node's read, file), in order (an entry is live while `owed` of its file is its
    /// round).
    departures: Vec<VecDeque<(u64, u64, u32)>>,
    /// The slots of the live owed copies.
    departing: u64,
    /// Files another node took from this node before this node read them: not owed
    /// after that read.
    pretaken: HashSet<u32>,
    /// The round being placed.
    at: u64,
    /// What this node's own reads found (the cluster's: the sum over the nodes).
    pub stats: SimStats,
}

impl Forward {
    /// This node's (`me`) forwarding under `layout`, counting files, or bytes with
    /// `sizes` (when `layout.bytes`).
    pub fn new(
        walk: Walk,
        layout: Layout,
        me: &str,
        lookahead: u64,
        sizes: Option<Arc<[u64]>>,
    ) -> Self {
        let me_i = layout.nodes.iter().position(|n| n == me).map(|i| i as u16);
        let my_ranks = match me_i {
            Some(m) => (0..walk.world)
                .filter(|&r| layout.node_of_rank.get(r as usize).copied().flatten() == Some(m))
                .collect(),
            None => Vec::new(),
        };
        let m = layout.nodes.len();
        Self {
            walk,
            me: me_i,
            me_name: me.to_owned(),
            lookahead,
            sizes: sizes.filter(|_| layout.bytes),
            my_ranks,
            next: 0,
            views: Vec::new(),
            incoming: VecDeque::new(),
            parked: VecDeque::new(),
            arrivals: Vec::new(),
            arrivals_for: u64::MAX,
            arrived: 0,
            owed: HashMap::new(),
            departures: vec![VecDeque::new(); m],
            departing: 0,
            pretaken: HashSet::new(),
            at: 0,
            stats: SimStats::default(),
            layout,
        }
    }

    /// The same forwarding with nothing placed yet but the copies owed (a jump to any
    /// round costs one pass over this node's reads, not a replay).
    pub fn restarted(&self) -> Self {
        let mut f = Self::new(
            self.walk,
            self.layout.clone(),
            &self.me_name,
            self.lookahead,
            self.sizes.clone(),
        );
        f.views = self.views.clone();
        // The copies this node read and keeps for their keepers stay owed: they are
        // this node's past reads, which a restart does not place again when they are
        // older than the rounds a jump places (an owed copy may be kept two epochs).
        f.owed = self.owed.clone();
        f.departures = self.departures.clone();
        f.departing = self.departing;
        f
    }

    /// The shuffle it follows.
    pub fn walk(&self) -> Walk {
        self.walk
    }

    /// This node's name.
    pub fn me(&self) -> &str {
        &self.me_name
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Rounds placed (the position plus the lookahead).
    pub fn placed(&self) -> u64 {
        self.next
    }

    /// Rounds it runs ahead of the readers.
    pub fn lookahead(&self) -> u64 {
        self.lookahead
    }

    fn size(&self, f: u32) -> u64 {
        self.sizes.as_ref().map_or(1, |s| s[f as usize])
    }

    /// The slots file `f` takes: one, or its bytes.
    pub fn slots_of(&self, f: u32) -> u64 {
        self.size(f)
    }

    fn per(&self) -> u64 {
        self.walk.rounds() * self.walk.world
    }

    fn node_of(&self, rank: u64) -> Option<u16> {
        self.layout
            .node_of_rank
            .get(rank as usize)
            .copied()
            .flatten()
    }

    fn node(&self, i: u16) -> Option<&str> {
        self.layout.nodes.get(i as usize).map(String::as_str)
    }

    fn trim_views(&mut self) {
        while self.views.len() > 4 {
            let oldest = self.views.iter().map(|(e, _)| *e).min().unwrap_or(0);
            self.views.retain(|(e, _)| *e != oldest);
        }
    }

    /// The view of relative epoch `rel` if built already (the queries that take `&self`
    /// see the views `advance` built).
    fn built(&self, rel: u64) -> Option<&Arc<View>> {
        self.views.iter().find(|(e, _)| *e == rel).map(|(_, v)| v)
    }

    /// The view of relative epoch `rel`, built when first asked (one pass over its
    /// order to index it and another to find every node's cut).
    fn view(&mut self, rel: u64) -> Option<Arc<View>> {
        if rel >= self.walk.epochs {
            return None;
        }
        if let Some(v) = self.built(rel) {
            return Some(v.clone());
        }
        let w = self.walk;
        let ix = Arc::new(EpochIndex::world(
            w.files,
            w.seed,
            w.first + rel,
            w.world,
            w.drop_last,
        ));
        let (cut, spill) = self.cuts(&ix, rel > 0);
        let v = Arc::new(View { ix, cut, spill });
        self.views.push((rel, v.clone()));
        self.trim_views();
        Some(v)
    }

    /// Every node's cut in an epoch: the position of its first read that, added to its
    /// reads before it, no longer fits its slots. Only a file's first read in the epoch
    /// counts: a repeat (the padding of a `DistributedSampler` without `drop_last`
    /// repeats up to `world − 1` files) is read from the copy its first reader keeps.
    /// Then the reads past the cuts, in order, go to the nodes that keep all their own
    /// reads, while they have room (first fit, one pass): the spill (not in the plan's
    /// first epoch: no copy of it is in the cluster to keep).
    fn cuts(&self, ix: &EpochIndex, spills: bool) -> (Vec<u64>, HashMap<u32, u16>) {
        let per = self.per();
        let world = self.walk.world;
        let m = self.layout.nodes.len();
        let mut cut = vec![per; m];
        let mut used = vec![0u64; m];
        for (p, &f) in ix.order.iter().enumerate() {
            let p = p as u64;
            let Some(n) = self.node_of(p % world) else {
                continue;
            };
            let n = n as usize;
            if cut[n] == per && ix.next(f, 0) == Some(p) {
                let size = self.size(f);
                if used[n] + size > self.layout.slots[n] {
                    cut[n] = p;
                } else {
                    used[n] += size;
                }
            }
        }
        let mut spill = HashMap::new();
        let spare: Vec<(usize, u64)> = (0..m)
            .filter(|&n| cut[n] == per)
            .map(|n| (n, self.layout.slots[n].saturating_sub(used[n])))
            .filter(|&(_, s)| s > 0)
            .collect();
        if !spills || spare.is_empty() || cut.iter().all(|&c| c == per) {
            return (cut, spill);
        }
        let (mut at, mut room) = (0, spare[0].1);
        for (p, &f) in ix.order.iter().enumerate() {
            let p = p as u64;
            let Some(n) = self.node_of(p % world) else {
                continue;
            };
            if p < cut[n as usize] || ix.next(f, 0) != Some(p) {
                continue;
            }
            let size = self.size(f);
            while room < size && at + 1 < spare.len() {
                at += 1;
                room = spare[at].1;
            }
            if room < size {
                break;
            }
            room -= size;
            spill.insert(f, spare[at].0 as u16);
        }
        (cut, spill)
    }

    /// The node that keeps the copy of `f` for its first read of the epoch after the
    /// one of absolute world position `pos` (a repeat later in this one reads the copy
    /// its first reader keeps); `None` when no node keeps it.
    /// (That node, the absolute round of that read.)
    fn next_keeper(&mut self, f: u32, pos: u64) -> Option<(u16, u64)> {
        let rel = pos / self.per();
        let v = self.view(rel + 1)?;
        let p = v.ix.next(f, 0)?;
        let n = v.keeper(f, p, self.node_of(p % self.walk.world))?;
        Some((n, (rel + 1) * self.walk.rounds() + p / self.walk.world))
    }

    /// The position the readers are at (in world positions): reads before it were made.
    fn read_pos(&self) -> u64 {
        self.next.saturating_sub(self.lookahead) * self.walk.world
    }

    /// The node holding the cluster's copy of `f` now: the node of its next first read
    /// of an epoch (this epoch's, when still to come, else the next one's) when that node
    /// keeps it; `None` when it does not. (A repeat later in an epoch reads a copy
    /// brought from its first reader; a read past its node's cut, one brought from
    /// wherever a copy is: see [`Forward::reads_soon`].)
    fn holder_of(&self, f: u32) -> Option<u16> {
        let per = self.per();
        let world = self.walk.world;
        let pos = self.read_pos();
        let rel = pos / per;
        let v = self.built(rel)?;
        let (v, p) = match v.ix.next(f, 0) {
            Some(p) if p >= pos % per => (v, p),
            _ => {
                let w = self.built(rel + 1)?;
                (w, w.ix.next(f, 0)?)
            }
        };
        v.keeper(f, p, self.node_of(p % world))
    }

    /// True when this node reads `f` within the lookahead (it is brought here for the
    /// read, whoever keeps the cluster's copy).
    fn reads_soon(&self, f: u32) -> bool {
        let Some(me) = self.me else { return false };
        let per = self.per();
        let world = self.walk.world;
        let (from, to) = (self.read_pos(), self.next * world);
        let rel = from / per;
        for e in [rel, rel + 1] {
            let Some(v) = self.built(e) else {
                continue;
            };
            let lo = (e * per).max(from);
            let hi = ((e + 1) * per).min(to);
            if lo >= hi {
                continue;
            }
            if v.ix
                .from(f, lo - e * per)
                .take_while(|&p| p < hi - e * per)
                .any(|p| self.node_of(p % world) == Some(me))
            {
                return true;
            }
        }
        false
    }

    /// The node the cluster's copy of `f` is on, if any.
    pub fn holder(&self, f: u32) -> Option<&str> {
        self.node(self.holder_of(f)?)
    }

    /// The nodes that read `f` before, latest epoch first, in each its first reader
    /// (who keeps the copy for the holder until it took it) before any repeat's (up to 3).
    pub fn earlier(&self, f: u32) -> Vec<&str> {
        let per = self.per();
        let pos = self.read_pos();
        let rel = pos / per;
        let mut out: Vec<u16> = Vec::new();
        for e in [Some(rel), rel.checked_sub(1)].into_iter().flatten() {
            let Some(v) = self.built(e) else {
                continue;
            };
            let end = if e == rel { pos % per } else { per };
            for p in v.ix.positions(f).take_while(|&p| p < end) {
                if let Some(n) = self.node_of(p % self.walk.world)
                    && !out.contains(&n)
                {
                    out.push(n);
                }
            }
        }
        out.truncate(3);
        out.into_iter().filter_map(|n| self.node(n)).collect()
    }

    /// True when the cluster's copy of `f` is on this node, or this node reads it within
    /// the lookahead.
    pub fn is_mine(&self, f: u32) -> bool {
        self.me.is_some() && (self.holder_of(f) == self.me || self.reads_soon(f))
    }

    /// True when the cluster's copy of `f` is on this node (not only brought here for a
    /// read within the lookahead): a fetch of it takes the copy over from its giver.
    pub fn keeps(&self, f: u32) -> bool {
        self.me.is_some() && self.holder_of(f) == self.me
    }

    /// True when this node read `f` and keeps its copy for the next reader, which has
    /// not taken it yet.
    pub fn is_owed(&self, f: u32) -> bool {
        self.owed.get(&f).is_some_and(|&u| u > self.next)
    }

    /// The copies this node keeps for their next readers.
    pub fn departing(&self) -> impl Iterator<Item = u32> + '_ {
        self.owed
            .iter()
            .filter(|&(_, &u)| u > self.next)
            .map(|(&f, _)| f)
    }

    /// True when a node keeps, or kept, a copy of `f` (its next read is kept, or a
    /// read of it was made).
    pub fn places(&self, f: u32) -> bool {
        self.holder_of(f).is_some() || !self.earlier(f).is_empty()
    }

    fn set_owed(&mut self, f: u32, until: u64) {
        let size = self.size(f);
        let old = if until == 0 {
            self.owed.remove(&f)
        } else {
            self.owed.insert(f, until)
        };
        if old.is_some() {
            self.departing -= size;
        }
        if until != 0 {
            self.departing += size;
        }
    }

    /// This node's copy of `f` is gone: it owes no other node a copy.
    pub fn discharge(&mut self, f: u32) {
        self.set_owed(f, 0);
    }

    /// Another node took this node's copy of `f` to keep: owed no more (and not after
    /// this node's own read, when that is still to come).
    pub fn taken(&mut self, f: u32) {
        match self.owed.get(&f).copied() {
            Some(_) => self.set_owed(f, 0),
            None => {
                if self.is_mine(f) && self.pretaken.len() < 1 << 20 {
                    self.pretaken.insert(f);
                }
            }
        }
    }

    /// Another node says it has its own copy of `f`: owed no more.
    pub fn released(&mut self, f: u32) {
        self.discharge(f);
    }

    /// Rounds a copy is kept for its next reader at most: an epoch, four lookaheads at
    /// least (see `Placement::owed_rounds`).
    fn owed_rounds(&self) -> u64 {
        (OWED_LOOKAHEADS * self.lookahead.max(1)).max(self.walk.rounds())
    }

    fn owed_base(&self) -> u64 {
        OWED_LOOKAHEADS * self.lookahead.max(1)
    }

    /// Drops owed copies whose time ran out (the read they are kept for, and some), and
    /// past four lookaheads the oldest first while the owed copies take more than
    /// [`DEPARTING_SHARE`] of the node's slots.
    fn expire(&mut self) {
        let share = self
            .me
            .map_or(0, |m| self.layout.slots[m as usize] / DEPARTING_SHARE);
        let (base, at) = (self.owed_base(), self.at);
        for n in 0..self.departures.len() {
            while let Some(&(u, _, f)) = self.departures[n].front() {
                let live = self.owed.get(&f) == Some(&u);
                if live && u > at {
                    break;
                }
                self.departures[n].pop_front();
                if live {
                    self.set_owed(f, 0);
                }
            }
        }
        while self.departing > share {
            let mut oldest: Option<(u64, usize)> = None;
            for (n, q) in self.departures.iter_mut().enumerate() {
                while q
                    .front()
                    .is_some_and(|&(u, _, f)| self.owed.get(&f) != Some(&u))
                {
                    q.pop_front();
                }
                if let Some(&(_, made, _)) = q.front()
                    && made + base <= at
                    && oldest.is_none_or(|(o, _)| made < o)
                {
                    oldest = Some((made, n));
                }
            }
            let Some((_, n)) = oldest else { break };
            let (_, _, f) = self.departures[n].pop_front().expect("a front");
            self.set_owed(f, 0);
        }
    }

    /// Builds the arrivals of relative epoch `rel`: this node's kept reads in it whose
    /// copy another node reads in the epoch before, by the round of that read.
    fn build_arrivals(&mut self, rel: u64) {
        self.arrivals.clear();
        self.arrived = 0;
        self.arrivals_for = rel;
        let Some(me) = self.me else { return };
        let (Some(v), Some(prev)) = (
            self.view(rel),
            rel.checked_sub(1).and_then(|e| self.view(e)),
        ) else {
            return;
        };
        let world = self.walk.world;
        for k in 0..v.cut[me as usize].div_ceil(world) {
            for &r in &self.my_ranks {
                if k * world + r >= v.cut[me as usize] {
                    continue;
                }
                let f = v.ix.order[(k * world + r) as usize];
                if v.ix.next(f, 0) != Some(k * world + r) {
                    continue; // a repeat: the copy is here from its first read
                }
                // Its first read in the epoch before: that reader keeps the copy.
                let Some(p) = prev.ix.next(f, 0) else {
                    continue;
                };
                if self.node_of(p % world) != Some(me) {
                    self.arrivals.push((p / world, f));
                }
            }
        }
        // And the copies spilled here.
        for (&f, &n) in &v.spill {
            if n == me
                && let Some(p) = prev.ix.next(f, 0)
                && self.node_of(p % world) != Some(me)
            {
                self.arrivals.push((p / world, f));
            }
        }
        self.arrivals.sort_unstable();
    }

    /// Places rounds until `round` (exclusive): this node's reads within the lookahead
    /// come here; reads made (`lookahead` rounds behind) leave their copies owed to
    /// their next readers; copies of this node's next-epoch reads arrive as their readers
    /// of this epoch read them. A jump (a restart, a new layout, a position far ahead)
    /// starts from the current round.
    pub fn advance(&mut self, round: u64) {
        let rounds = self.walk.rounds();
        let end = round.min(rounds * self.walk.epochs);
        if end <= self.next {
            return;
        }
        let span = self.owed_rounds() + self.lookahead;
        if end - self.next > span {
            self.resync(end - span);
        }
        while self.next < end {
            let k = self.next;
            self.at = k;
            self.place_window(k);
            if let Some(j) = k.checked_sub(self.lookahead) {
                self.place_read(j);
            }
            self.expire();
            self.next += 1;
        }
    }

    /// Jumps to round `start` without placing the rounds before it: what those would
    /// have moved here is queued at once (this node's kept reads of the epoch not yet
    /// read, and the arrivals so far).
    fn resync(&mut self, start: u64) {
        let rounds = self.walk.rounds();
        let world = self.walk.world;
        self.incoming.clear();
        self.parked.clear();
        self.next = start;
        let read = start.saturating_sub(self.lookahead);
        let rel = read / rounds;
        if let (Some(me), Some(v)) = (self.me, self.view(rel)) {
            let from = read % rounds;
            for k in from..v.cut[me as usize].div_ceil(world).max(from) {
                for &r in &self.my_ranks {
                    if k * world + r >= v.cut[me as usize] {
                        continue;
                    }
                    let f = v.ix.order[(k * world + r) as usize];
                    self.incoming.push_back((f, rel * rounds + k));
                }
            }
            // The copies spilled here, still to be read, in the order of their reads.
            let mut spilled: Vec<(u64, u32)> = v
                .spill
                .iter()
                .filter(|&(_, &n)| n == me)
                .filter_map(|(&f, _)| Some((v.ix.next(f, 0)? / world, f)))
                .filter(|&(k, _)| k >= from)
                .collect();
            spilled.sort_unstable();
            for (k, f) in spilled {
                self.incoming.push_back((f, rel * rounds + k));
            }
            self.incoming.make_contiguous().sort_by_key(|&(_, k)| k);
        }
        self.build_arrivals(rel + 1);
        let upto = read % rounds;
        while self.arrived < self.arrivals.len() && self.arrivals[self.arrived].0 < upto {
            let f = self.arrivals[self.arrived].1;
            self.parked.push_back(f);
            self.arrived += 1;
        }
    }

    /// Round `k` enters the lookahead: this node's reads in it that no node keeps for it
    /// (past its cut, the first epoch, or repeats) are brought here.
    fn place_window(&mut self, k: u64) {
        let Some(me) = self.me else { return };
        let (rounds, world) = (self.walk.rounds(), self.walk.world);
        let rel = k / rounds;
        let Some(v) = self.view(rel) else { return };
        for &r in &self.my_ranks {
            let p = (k % rounds) * world + r;
            let kept = p < v.cut[me as usize] && rel > 0;
            let f = v.ix.order[p as usize];
            // A kept first read arrived (or is here) already.
            if !kept || v.ix.next(f, 0) != Some(p) {
                self.incoming.push_back((f, k));
            }
        }
    }

    /// Round `j` was read: this node's reads in it leave their copies to their next
    /// readers, and copies read by others that this node reads next epoch arrive.
    fn place_read(&mut self, j: u64) {
        let (rounds, world) = (self.walk.rounds(), self.walk.world);
        let rel = j / rounds;
        if j.is_multiple_of(rounds) || self.arrivals_for != rel + 1 {
            self.build_arrivals(rel + 1);
        }
        let Some(me) = self.me else { return };
        let Some(v) = self.view(rel) else { return };
        let per = self.per();
        let prev = rel.checked_sub(1).and_then(|e| self.view(e));
        let ranks = self.my_ranks.clone();
        for r in ranks {
            let p = (j % rounds) * world + r;
            let f = v.ix.order[p as usize];
            let first = v.ix.next(f, 0) == Some(p);
            let kept_here = p < v.cut[me as usize];
            // What the read found: a repeat, or a read past the cut, is brought from a
            // node that read it before (else the backing store); a kept read arrived
            // from its first reader of the epoch before (or was here already).
            let from = if !first {
                v.ix.next(f, 0).and_then(|q| self.node_of(q % world))
            } else if kept_here {
                prev.as_ref()
                    .and_then(|w| w.ix.next(f, 0))
                    .and_then(|q| self.node_of(q % world))
            } else {
                // Spilled: brought from the node that kept it.
                v.spill.get(&f).copied()
            };
            if self.size(f) > self.layout.slots[me as usize] {
                self.stats.remote += 1;
            } else {
                self.stats.local += 1;
                match from {
                    Some(n) if n != me => self.stats.moves += 1,
                    Some(_) => {}
                    None => self.stats.backing += 1,
                }
            }
            // Where its copy goes: its first reader keeps it for the first reader of
            // the next epoch.
            if !first {
                continue;
            }
            if self.pretaken.remove(&f) {
                continue;
            }
            // A repeat later in this epoch by another node reads this copy too: kept
            // until then at least.
            let repeat =
                v.ix.from(f, p + 1)
                    .map(|q| (q, self.node_of(q % world)))
                    .find(|&(_, n)| n != Some(me));
            // Kept past the read it is kept for (a keeper with no room for it yet takes
            // it as its own reads make room, up to that read), by half an epoch more for
            // a keeper whose ranks are behind this node's.
            let keeper = self.next_keeper(f, rel * per + p);
            let repeat = repeat.and_then(|(q, n)| Some((n?, rel * rounds + q / world)));
            let slack = 2 * self.lookahead + 1 + rounds / 2;
            let to = keeper.or(repeat);
            if let Some((n, read)) = to.filter(|&(n, _)| n != me) {
                let mut until = (j + self.owed_rounds()).max(read + slack);
                if let Some((_, r)) = repeat {
                    until = until.max(r + slack);
                }
                self.set_owed(f, until);
                self.departures[n as usize].push_back((until, j, f));
            }
        }
        let upto = j % rounds;
        while self.arrived < self.arrivals.len() && self.arrivals[self.arrived].0 <= upto {
            let f = self.arrivals[self.arrived].1;
            self.parked.push_back(f);
            self.arrived += 1;
        }
    }

    /// Files whose copy comes here, at most `max`, that `fetch` says are to be fetched
    /// (not here yet): this node's reads first, soonest first, then the copies parked
    /// here for the next epoch, in the order they came. Those here already go to
    /// `claimed` and leave the queues, as do those no longer placed here. Each queue is
    /// looked at from its front until `max` are found: a call costs what it finds and
    /// drops, not the queues' length (up to this node's share of an epoch).
    pub fn incoming(
        &mut self,
        max: usize,
        fetch: &dyn Fn(u32) -> bool,
        claimed: &mut Vec<u32>,
    ) -> Vec<u32> {
        let mut out: Vec<u32> = Vec::new();
        let mut seen = HashSet::new();
        let mut i = 0;
        while i < self.incoming.len() && out.len() < max {
            let f = self.incoming[i].0;
            if !seen.insert(f) || !self.is_mine(f) {
                self.incoming.remove(i);
            } else if !fetch(f) {
                claimed.push(f);
                self.incoming.remove(i);
            } else {
                out.push(f);
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.parked.len() && out.len() < max {
            let f = self.parked[i];
            if !seen.insert(f) || !self.is_mine(f) {
                self.parked.remove(i);
            } else if !fetch(f) {
                claimed.push(f);
                self.parked.remove(i);
            } else {
                out.push(f);
                i += 1;
            }
        }
        out
    }

    /// This node's slots and the files whose copy is placed here now (its kept reads
    /// still to come and the arrivals so far; 0, 0 when it runs no rank).
    pub fn mine(&self) -> (u64, usize) {
        let Some(me) = self.me else { return (0, 0) };
        let rounds = self.walk.rounds();
        let read = self.next.saturating_sub(self.lookahead);
        let rel = read / rounds;
        let ahead = self.built(rel).map_or(0, |v| {
            (v.cut[me as usize].div_ceil(self.walk.world)).saturating_sub(read % rounds)
        });
        let here = ahead as usize * self.my_ranks.len() + self.arrived;
        (self.layout.slots[me as usize], here)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(world: u64, files: u64, epochs: u64) -> Walk {
        Walk {
            files,
            seed: 3,
            first: 0,
            epochs,
            world,
            drop_last: false,
        }
    }

    fn layout(m: usize, ranks_per_node: usize, slots: u64) -> Layout {
        Layout {
            nodes: (0..m).map(|i| format!("n{i}")).collect(),
            node_of_rank: (0..m * ranks_per_node)
                .map(|r| Some((r / ranks_per_node) as u16))
                .collect(),
            slots: vec![slots; m],
            bytes: false,
        }
    }

    /// Per epoch: (backing reads ÷ files, local reads ÷ reads, copies moved ÷ reads, peak
    /// copies on a node ÷ its slots), from M nodes' forwarding driven as the daemon
    /// drives it: each round every node fetches what comes to it from the first earlier
    /// reader that has a copy (else the backing store), the giver is told it was taken,
    /// the node reads its round, and drops every copy it neither holds nor owes.
    struct Run {
        backing: Vec<f64>,
        local: Vec<f64>,
        moves: Vec<f64>,
        peak: Vec<f64>,
    }

    fn run(w: Walk, l: &Layout, lookahead: u64, sizes: Option<Arc<[u64]>>) -> Run {
        let m = l.nodes.len();
        let mut nodes: Vec<Forward> = l
            .nodes
            .iter()
            .map(|n| Forward::new(w, l.clone(), n, lookahead, sizes.clone()))
            .collect();
        let size = |f: u32| sizes.as_ref().map_or(1, |s| s[f as usize]);
        let mut copies: Vec<HashSet<u32>> = vec![HashSet::new(); m];
        let rounds = w.rounds();
        let mut out = Run {
            backing: vec![0.0; w.epochs as usize],
            local: vec![0.0; w.epochs as usize],
            moves: vec![0.0; w.epochs as usize],
            peak: vec![0.0; w.epochs as usize],
        };
        let mut reads = vec![0.0; w.epochs as usize];
        for k in 0..rounds * w.epochs {
            let e = (k / rounds) as usize;
            for n in 0..m {
                nodes[n].advance(k + lookahead);
                let mut claimed = Vec::new();
                let held = copies[n].clone();
                let want = nodes[n].incoming(usize::MAX, &|f| !held.contains(&f), &mut claimed);
                for f in want {
                    // The holder, then the nodes that read it before (`Planner::sources`).
                    let from = nodes[n]
                        .holder(f)
                        .into_iter()
                        .chain(nodes[n].earlier(f))
                        .filter_map(|s| l.nodes.iter().position(|x| x == s))
                        .find(|&s| s != n && copies[s].contains(&f));
                    match from {
                        Some(s) => {
                            // Only the keeper takes the copy over (`Peers::fetch`).
                            if nodes[n].keeps(f) {
                                nodes[s].taken(f);
                            }
                            out.moves[e] += 1.0;
                        }
                        None => out.backing[e] += 1.0,
                    }
                    copies[n].insert(f);
                }
                for f in claimed {
                    for (s, node) in nodes.iter_mut().enumerate() {
                        if s != n {
                            node.released(f);
                        }
                    }
                }
            }
            // Every rank reads its round.
            let v = nodes[0].view(k / rounds).unwrap();
            for r in 0..w.world {
                let n = l.node_of_rank[r as usize].unwrap() as usize;
                let f = v.ix.order[((k % rounds) * w.world + r) as usize];
                reads[e] += 1.0;
                if copies[n].contains(&f) {
                    out.local[e] += 1.0;
                } else {
                    out.backing[e] += 1.0;
                    copies[n].insert(f);
                }
            }
            // Copies neither held nor owed go (after the round's reads).
            for n in 0..m {
                nodes[n].advance(k + lookahead + 1);
                let p = &nodes[n];
                copies[n].retain(|&f| p.is_mine(f) || p.is_owed(f));
                let used: u64 = copies[n].iter().map(|&f| size(f)).sum();
                let r = used as f64 / l.slots[n] as f64;
                if r > out.peak[e] {
                    out.peak[e] = r;
                }
            }
        }
        for (e, &r) in reads.iter().enumerate() {
            out.backing[e] /= w.files as f64;
            out.local[e] /= r;
            out.moves[e] /= r;
        }
        out
    }

    #[test]
    fn at_a_1_every_read_after_the_first_epoch_is_local_and_a_copy_moves_at_most_once() {
        let (m, r, files) = (4, 2, 4000u64);
        let w = walk((m * r) as u64, files, 5);
        let l = layout(m, r, files / m as u64 + 40);
        let out = run(w, &l, 8, None);
        assert!((out.backing[0] - 1.0).abs() < 1e-9, "{:?}", out.backing);
        for e in 1..5 {
            assert!(out.backing[e] <= 0.01, "epoch {e}: {:?}", out.backing);
            assert!(out.local[e] >= 0.99, "epoch {e}: {:?}", out.local);
            assert!(out.moves[e] <= 1.0, "epoch {e}: {:?}", out.moves);
            assert!(out.peak[e] <= 1.05, "epoch {e}: {:?}", out.peak);
        }
    }

    /// A `DistributedSampler` without `drop_last` pads each epoch with repeats (here 56
    /// of 1 056 reads): a repeat reads the copy its first reader keeps, so a node's
    /// slots need hold only its first reads, and nothing is read from the backing store
    /// at an aggregate cache of the dataset.
    #[test]
    fn repeats_of_the_padding_read_the_first_readers_copy() {
        let (m, r, files) = (4, 24, 1000u64);
        let w = walk((m * r) as u64, files, 4);
        assert_eq!(w.rounds() * w.world, 1056);
        let slots = files / m as u64;
        let out = run(w, &layout(m, r, slots), 2, None);
        // The padding falls on the last ranks, so nodes 0 and 1 make more first reads
        // than their slots hold (264 and 256 of 250): nodes 2 and 3, with room to spare,
        // keep those (the spill).
        let mut f = Forward::new(w, layout(m, r, slots), "n0", 2, None);
        for e in 1..4usize {
            let v = f.view(e as u64).unwrap();
            assert_eq!(v.cut[2..], [1056, 1056]);
            assert_eq!(v.spill.len(), 20, "{:?}", v.cut);
            assert!(out.backing[e] <= 0.005, "epoch {e}: {:?}", out.backing);
            assert!(out.local[e] >= 0.99, "epoch {e}: {:?}", out.local);
        }
    }

    /// A copy owed to the node that keeps it next is kept until that node's read of it
    /// (and some), not an epoch of rounds from this node's read: a keeper with no room
    /// for it yet takes it as its own reads make room, up to its read, which may come
    /// nearly two epochs after this node's (read early here, late there). Kept only an
    /// epoch of rounds, such copies were gone when their keepers came
    /// (`peers::spread_sizes...` with `--placement forward`: 0.014–0.020 of the dataset
    /// from the backing store in 4 of 9 runs).
    #[test]
    fn an_owed_copy_is_kept_until_the_read_it_is_kept_for() {
        let (m, files) = (4usize, 400u64);
        let w = walk(m as u64, files, 3);
        // Room for the whole dataset on each node: the share of the slots owed copies may
        // take is not what is tested (nobody takes them here).
        let l = layout(m, 1, files);
        let lookahead = 4;
        let mut f = Forward::new(w, l, "n0", lookahead, None);
        let rounds = w.rounds();
        let (v1, v2) = (f.view(1).unwrap(), f.view(2).unwrap());
        // A file node 0 reads early in epoch 1 that node 1 reads late in epoch 2.
        let (x, j, read) = (0..rounds)
            .filter_map(|k| {
                let x = v1.ix.order[(k * m as u64) as usize];
                let p = v2.ix.next(x, 0)?;
                (p % m as u64 != 0 && p / m as u64 > k + 2 * lookahead + 2).then_some((
                    x,
                    rounds + k,
                    2 * rounds + p / m as u64,
                ))
            })
            .next()
            .expect("such a file");
        let epoch_later = j + rounds + lookahead + 1;
        assert!(epoch_later < read, "{j} {read}");
        f.advance(epoch_later);
        assert!(
            f.is_owed(x),
            "kept past an epoch of rounds, for the read at {read}"
        );
        f.advance(read + lookahead);
        assert!(f.is_owed(x), "kept at the read");
        // A restart (a new layout, the position moved back) keeps it: the rounds it
        // places again are an epoch's, and this read is older.
        let mut g = f.restarted();
        g.advance(read + lookahead);
        assert!(g.is_owed(x), "kept across a restart");
        f.advance(read + 2 * lookahead + 1 + rounds / 2 + lookahead + 1);
        assert!(!f.is_owed(x), "and not for ever");
    }

    #[test]
    fn below_the_dataset_the_backing_store_is_read_at_its_floor() {
        let (m, r, files) = (4, 2, 4000u64);
        for a in [0.5f64, 0.75] {
            let w = walk((m * r) as u64, files, 5);
            let slots = (a * files as f64 / m as f64) as u64;
            let out = run(w, &layout(m, r, slots), 8, None);
            for e in 1..5 {
                assert!(
                    out.backing[e] <= 1.0 - a + 0.02,
                    "a = {a}, epoch {e}: {:?}",
                    out.backing
                );
                assert!(out.peak[e] <= 1.10, "a = {a}, epoch {e}: {:?}", out.peak);
            }
        }
    }

    #[test]
    fn spread_sizes_in_bytes_fit_their_nodes_and_reach_the_floor() {
        let (m, r, files) = (4, 2, 4000u64);
        // Log-normal-ish: one in ten eight times larger.
        let sizes: Arc<[u64]> = (0..files)
            .map(|i| {
                if i % 10 == 0 {
                    800_000
                } else {
                    100_000 + (i * 7919 % 50_000)
                }
            })
            .collect();
        let total: u64 = sizes.iter().sum();
        for a in [0.5f64, 1.0, 2.0] {
            let mut l = layout(m, r, (a * total as f64 / m as f64) as u64);
            l.bytes = true;
            let w = walk((m * r) as u64, files, 4);
            let out = run(w, &l, 8, Some(sizes.clone()));
            for e in 1..4 {
                let floor = (1.0 - a).max(0.0);
                assert!(
                    out.backing[e] <= floor + 0.01,
                    "a = {a}, epoch {e}: {:?}",
                    out.backing
                );
                assert!(out.peak[e] <= 1.10, "a = {a}, epoch {e}: {:?}", out.peak);
            }
        }
    }

    #[test]
    fn a_jump_starts_from_the_current_round_and_queues_what_is_placed_here() {
        let (m, r, files) = (4, 2, 4000u64);
        let w = walk((m * r) as u64, files, 4);
        let l = layout(m, r, files / m as u64 + 40);
        let mut f = Forward::new(w, l.clone(), "n1", 8, None);
        let rounds = w.rounds();
        // Half way into the third epoch at once.
        let target = 2 * rounds + rounds / 2;
        f.advance(target);
        assert_eq!(f.placed(), target);
        let mut claimed = Vec::new();
        // A few at a time: the soonest reads first, and asking again gives them again
        // (until fetched) with the rest of the queues untouched.
        let few = f.incoming(4, &|_| true, &mut claimed);
        let inc = f.incoming(usize::MAX, &|_| true, &mut claimed);
        assert_eq!(few[..], inc[..4]);
        // Its reads still to come this epoch, and its next epoch's reads whose readers
        // read them already this epoch.
        assert!(inc.iter().all(|&x| f.is_mine(x)));
        let (_, here) = f.mine();
        assert!(
            inc.len() + 64 >= here && inc.len() <= here + 64,
            "{} vs {here}",
            inc.len()
        );
        assert!(here as u64 > files / m as u64 * 8 / 10, "{here}");
    }
}
