//! Cluster placement of a shuffle: which node keeps the cluster's copy of each file, as
//! a deterministic simulation that every node runs over the same inputs (the manifest,
//! which node runs which rank, how many files each node's cache holds) and so agrees
//! on without talking.
//!
//! The simulation walks the job's world order round by round (round `k`: every rank's
//! `k`-th read, the ranks of one job moving in lockstep) and treats the nodes' caches as
//! one cache of `Σ slots` with a placement constraint. A slot is a file, or a byte when
//! the manifest gives every file's size ([`Placement::with_sizes`]): the simulation then
//! fills each node to the bytes its store holds, which the stores agree with whatever the
//! spread of sizes (counted in files, a node of small files has room to spare and one of
//! large files overflows, and the stores' own evictions undo the placement):
//!
//! - a file read in round `k` is placed on the reader's node for that read (it is
//!   prefetched there, so the read is local);
//! - the reader's node, when full, gives up the file it holds that the cluster needs
//!   last (Belady over the whole world's order) — not dropping it but handing it to the
//!   node the incoming file came from, whose slot that just freed (a swap); a file read
//!   from the backing store instead grows the cluster's set, so the file the whole
//!   cluster needs last is dropped (Belady's MIN over the union of the caches);
//! - files read in the last `lookahead` rounds stay where they were read: the
//!   simulation runs `lookahead` rounds ahead of the readers (to start the moves in
//!   time), so those are the files the real readers are about to read.
//!
//! Hence at an aggregate cache of at least the dataset nothing is dropped after the
//! first epoch and (almost) every read is local; below it, the cluster keeps the files
//! it needs soonest and the backing store is read close to its floor of `1 − a` of the
//! dataset per epoch. The daemon keeps what the simulation places on its node, keeps a
//! file it placed elsewhere until that node has taken it (the copy is never lost in
//! transit), and fetches what it is given from the node that held it.
//!
//! Pure logic: no I/O, no clock.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use shardcache_plan::shuffle;

use super::EpochIndex;

/// No node.
const NONE: u16 = u16::MAX;

/// Which node runs which rank, and how many of the job's files each node's cache holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The nodes that run ranks of the job, sorted (the same list on every node).
    pub nodes: Vec<String>,
    /// For each rank of the world, its node (index into `nodes`), if known.
    pub node_of_rank: Vec<Option<u16>>,
    /// For each node, the job's files its cache holds, or its bytes when the placement
    /// has the files' sizes (the same on every node: see [`Layout::bytes`]).
    pub slots: Vec<u64>,
    /// `slots` are bytes, not files (every node must say the same).
    pub bytes: bool,
}

/// The shuffle the simulation walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk {
    /// Files in the manifest.
    pub files: u64,
    /// Shuffle seed.
    pub seed: u64,
    /// First epoch number.
    pub first: u64,
    /// Epochs in the plan.
    pub epochs: u64,
    /// World size.
    pub world: u64,
    /// `DistributedSampler(drop_last)`.
    pub drop_last: bool,
}

impl Walk {
    /// Rounds per epoch (each rank's reads per epoch).
    pub fn rounds(&self) -> u64 {
        shuffle::samples_per_rank(self.files, self.world, self.drop_last)
    }
}

/// The simulation's state (see the module documentation).
#[derive(Debug)]
pub struct Placement {
    walk: Walk,
    layout: Layout,
    /// This node's index in `layout.nodes`, if it runs ranks, and its name.
    me: Option<u16>,
    me_name: String,
    lookahead: u64,
    /// The next round to place (absolute: 0 is the first epoch's first round).
    next: u64,
    holder: Vec<u16>,
    /// The nodes that held each file before, most recent first.
    prev: Vec<[u16; 3]>,
    /// For files the placement moved away from this node: the round until which this
    /// node keeps its copy unless the new holder took it first (0: none; see
    /// [`Placement::is_owed`]).
    owed: Vec<u64>,
    /// The round being placed.
    at: u64,
    /// The moves away from this node per new holder, as (the round its copy is kept
    /// until, file), in the order they were made: the copies it may still keep for
    /// their new holders (an entry is live while `owed` of its file is its round; at
    /// most twice as many entries as live ones, plus a few, are kept).
    departures: Vec<VecDeque<(u64, u32)>>,
    /// Per node, the latest round of a move away from this node whose copy that node
    /// took ([`Placement::taken`]): how far its readers have come, as this node sees it.
    progress: Vec<u64>,
    /// The slots of the live entries of `departures`, and their number.
    departing: u64,
    live_departures: usize,
    /// Each held file's key: the absolute world position of its next read.
    key: Vec<u64>,
    /// The round after each file's last read (0: not read yet).
    read_at: Vec<u64>,
    held: Vec<BTreeSet<(u64, u32)>>,
    /// The held files whose next reader is another node than their holder, by (holder,
    /// that reader, key, file) packed into one `u128` ([`by_reader`]): a swap's victim is
    /// found in O(log n), not by a scan of the holder's files (which was about four
    /// fifths of the simulation's time).
    by_reader: BTreeSet<u128>,
    /// Slots taken on each node: files, or bytes with `sizes`.
    used: Vec<u64>,
    /// Each file's size in bytes, when slots are bytes.
    sizes: Option<Arc<[u64]>>,
    all: BTreeSet<(u64, u32)>,
    epochs: Vec<(u64, Arc<EpochIndex>)>,
    /// Files moved onto this node, in the order they were, for the prefetcher.
    /// With the round of this node's read it came for (`u64::MAX`: parked here).
    incoming: VecDeque<(u32, u64)>,
    /// Set while placing a read by this node (the round), for `set_holder`.
    reading: u64,
    /// What the placed reads found.
    pub stats: SimStats,
}

/// What the simulated reads found, counted since the start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// The file is on the reader's node for the read (it was, or it was moved there
    /// `lookahead` rounds ahead).
    pub local: u64,
    /// It stays on another node (or in the backing store) and is read from there.
    pub remote: u64,
    /// No node held it: it is read from the backing store (once, by the reader's node).
    pub backing: u64,
    /// Copies moved from one node to another (reads' and swaps').
    pub moves: u64,
}

/// Lookaheads a node keeps a copy the placement moved away from it, at least, when the
/// new holder neither took it nor said it has one (longer within [`DEPARTING_SHARE`]:
/// see [`Placement::owed_rounds`]).
const OWED_LOOKAHEADS: u64 = 4;

/// The copies a node keeps for their new holders past [`OWED_LOOKAHEADS`] take at most
/// this share of its slots (1/4): past it, the oldest of them go first.
const DEPARTING_SHARE: u64 = 4;

/// Key of a file not read again within the current and next epoch.
const NEVER: u64 = u64::MAX;

/// The entry of [`Placement::by_reader`] for file `f` of key `k`, held by node `n` and
/// read next by node `r`: ordered by holder, reader, key, file.
fn by_reader(n: u16, r: u16, k: u64, f: u32) -> u128 {
    (u128::from(n) << 112) | (u128::from(r) << 96) | (u128::from(k) << 32) | u128::from(f)
}

impl Placement {
    /// A simulation at the start of the plan, in files. `me`: this node's name.
    pub fn new(walk: Walk, layout: Layout, me_name: &str, lookahead: u64) -> Self {
        Self::with_sizes(walk, layout, me_name, lookahead, None)
    }

    /// A simulation at the start of the plan; with `sizes` (each file's, in bytes; the
    /// layout's slots in bytes), a node holds files up to its bytes.
    pub fn with_sizes(
        walk: Walk,
        layout: Layout,
        me_name: &str,
        lookahead: u64,
        sizes: Option<Arc<[u64]>>,
    ) -> Self {
        let sizes = sizes.filter(|s| layout.bytes && s.len() as u64 == walk.files);
        let n = walk.files as usize;
        let me = layout
            .nodes
            .iter()
            .position(|x| x == me_name)
            .map(|i| i as u16);
        let nodes = layout.nodes.len();
        Self {
            walk,
            me,
            me_name: me_name.to_owned(),
            lookahead,
            next: 0,
            holder: vec![NONE; n],
            prev: vec![[NONE; 3]; n],
            owed: vec![0; n],
            at: 0,
            departures: vec![VecDeque::new(); nodes],
            progress: vec![0; nodes],
            departing: 0,
            live_departures: 0,
            key: vec![NEVER; n],
            read_at: vec![0; n],
            held: vec![BTreeSet::new(); nodes],
            by_reader: BTreeSet::new(),
            used: vec![0; nodes],
            sizes,
            all: BTreeSet::new(),
            epochs: Vec::new(),
            incoming: VecDeque::new(),
            reading: u64::MAX,
            stats: SimStats::default(),
            layout,
        }
    }

    /// The same simulation back at the start of the plan.
    pub fn restarted(&self) -> Self {
        Self::with_sizes(
            self.walk,
            self.layout.clone(),
            &self.me_name,
            self.lookahead,
            self.sizes.clone(),
        )
    }

    /// The slots file `f` takes: one, or its bytes.
    fn size(&self, f: u32) -> u64 {
        self.sizes.as_ref().map_or(1, |s| s[f as usize])
    }

    /// True when node `n` has room for `size` more, counting `leaving` as gone.
    fn fits(&self, n: u16, size: u64, leaving: u64) -> bool {
        self.used[n as usize].saturating_sub(leaving) + size <= self.layout.slots[n as usize]
    }

    /// The shuffle it walks.
    pub fn walk(&self) -> Walk {
        self.walk
    }

    /// This node's name.
    pub fn me(&self) -> &str {
        &self.me_name
    }

    /// The layout it simulates.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Rounds already placed (the simulation's position).
    pub fn placed(&self) -> u64 {
        self.next
    }

    /// Rounds the simulation runs ahead of the readers.
    pub fn lookahead(&self) -> u64 {
        self.lookahead
    }

    fn world_order(&mut self, rel: u64) -> Option<Arc<EpochIndex>> {
        if rel >= self.walk.epochs {
            return None;
        }
        if let Some((_, ix)) = self.epochs.iter().find(|(e, _)| *e == rel) {
            return Some(ix.clone());
        }
        let w = self.walk;
        let ix = Arc::new(EpochIndex::world(
            w.files,
            w.seed,
            w.first + rel,
            w.world,
            w.drop_last,
        ));
        if self.epochs.len() >= 3 {
            self.epochs.remove(0);
        }
        self.epochs.push((rel, ix.clone()));
        Some(ix)
    }

    /// The absolute world position of `f`'s first read after position `pos` (absolute),
    /// within `pos`'s epoch and the next.
    fn next_use(&mut self, f: u32, pos: u64) -> u64 {
        let per = self.walk.rounds() * self.walk.world;
        let rel = pos / per;
        if let Some(ix) = self.world_order(rel)
            && let Some(p) = ix.next(f, pos % per + 1)
        {
            return rel * per + p;
        }
        match self.world_order(rel + 1).and_then(|ix| ix.next(f, 0)) {
            Some(p) => (rel + 1) * per + p,
            None => NEVER,
        }
    }

    fn rekey(&mut self, f: u32, k: u64) {
        let h = self.holder[f as usize];
        let old = self.key[f as usize];
        self.key[f as usize] = k;
        if h != NONE {
            self.unhold(h, old, f);
            self.hold(h, k, f);
        }
    }

    /// Records `f`, of key `k`, as held by node `n`.
    fn hold(&mut self, n: u16, k: u64, f: u32) {
        self.held[n as usize].insert((k, f));
        self.all.insert((k, f));
        if let Some(r) = self.reader(k).filter(|&r| r != n) {
            self.by_reader.insert(by_reader(n, r, k, f));
        }
    }

    /// Forgets that node `n` holds `f`, of key `k`.
    fn unhold(&mut self, n: u16, k: u64, f: u32) {
        self.held[n as usize].remove(&(k, f));
        self.all.remove(&(k, f));
        if let Some(r) = self.reader(k).filter(|&r| r != n) {
            self.by_reader.remove(&by_reader(n, r, k, f));
        }
    }

    fn set_holder(&mut self, f: u32, to: u16) {
        let from = self.holder[f as usize];
        if from == to {
            return;
        }
        let k = self.key[f as usize];
        let size = self.size(f);
        if from != NONE {
            self.unhold(from, k, f);
            self.used[from as usize] -= size;
        }
        if to != NONE {
            self.hold(to, k, f);
            self.used[to as usize] += size;
            if Some(to) == self.me {
                self.incoming.push_back((f, self.reading));
            }
        }
        if from != NONE && to != NONE {
            self.stats.moves += 1;
        }
        if to == NONE || Some(to) == self.me {
            // Dropped (nobody will take a copy), or this node's own.
            self.set_owed(f, 0);
        } else if Some(from) == self.me {
            // The new holder fetches it (or says it has it) when its readers are where
            // this node's are (see `owed_rounds`).
            let until = self.at + self.owed_rounds();
            self.set_owed(f, until);
            self.departures[to as usize].push_back((until, f));
        }
        let p = &mut self.prev[f as usize];
        *p = [from, p[0], p[1]];
        self.holder[f as usize] = to;
    }

    /// Sets the round until which this node keeps its copy of `f` for its new holder (0:
    /// not kept), keeping `departing` the slots of the live departures.
    fn set_owed(&mut self, f: u32, until: u64) {
        let size = self.size(f);
        let o = &mut self.owed[f as usize];
        if *o != 0 {
            self.departing -= size;
            self.live_departures -= 1;
        }
        if until != 0 {
            self.departing += size;
            self.live_departures += 1;
        }
        *o = until;
    }

    /// Rounds a node keeps a copy the placement moved away from it, at most, unless its
    /// new holder takes it first: an epoch of rounds, at least four lookaheads. The new
    /// holder takes it when its own readers get there, which is as soon as this node's
    /// readers only when the ranks move in lockstep: ranks out of lockstep (each at its
    /// own pace through an epoch, `shardcache-bench placement --drift 0.3`) are up to an
    /// epoch apart, and a copy dropped after four lookaheads was gone when the slower
    /// new holder came for it (0.10 of the dataset per epoch read again from the backing
    /// store at a = 1). Past four lookaheads a copy goes sooner (`expire_departures`):
    /// once its new holder took a copy moved after it (it fetches them in the order its
    /// readers come to them: its readers went past this one, which it read some other
    /// way, or will not), and the oldest first
    /// while the copies kept that long take more than [`DEPARTING_SHARE`] of the node's
    /// slots.
    fn owed_rounds(&self) -> u64 {
        (OWED_LOOKAHEADS * self.lookahead.max(1)).max(self.walk.rounds())
    }

    /// Four lookaheads: how long a copy is kept for its new holder at least.
    fn owed_base(&self) -> u64 {
        OWED_LOOKAHEADS * self.lookahead.max(1)
    }

    /// Drops the departures whose time ran out (see [`Placement::owed_rounds`]), and
    /// forgets dead entries when they are more than the live ones.
    fn expire_departures(&mut self) {
        let share = self
            .me
            .map_or(0, |m| self.layout.slots[m as usize] / DEPARTING_SHARE);
        let (base, rounds) = (self.owed_base(), self.owed_rounds());
        let at = self.at;
        // The round a departure was made, and whether it has been kept past the base.
        let made = |u: u64| u - rounds;
        for n in 0..self.departures.len() {
            while let Some(&(u, f)) = self.departures[n].front() {
                let live = self.owed[f as usize] == u;
                let passed = made(u) + base <= at && self.progress[n] > made(u);
                if live && u > at && !passed {
                    break;
                }
                self.departures[n].pop_front();
                if live {
                    self.set_owed(f, 0);
                }
            }
        }
        // Over the share: the oldest of those kept past the base go first.
        while self.departing > share {
            let mut oldest: Option<(u64, usize)> = None;
            for (n, q) in self.departures.iter_mut().enumerate() {
                while q.front().is_some_and(|&(u, f)| self.owed[f as usize] != u) {
                    q.pop_front();
                }
                if let Some(&(u, _)) = q.front()
                    && made(u) + base <= at
                    && oldest.is_none_or(|(o, _)| u < o)
                {
                    oldest = Some((u, n));
                }
            }
            let Some((_, n)) = oldest else { break };
            let (_, f) = self.departures[n].pop_front().expect("a front");
            self.set_owed(f, 0);
        }
        let len: usize = self.departures.iter().map(VecDeque::len).sum();
        if len > 2 * self.live_departures + 64 {
            let owed = &self.owed;
            for q in &mut self.departures {
                q.retain(|&(u, f)| owed[f as usize] == u);
            }
        }
    }

    /// True when `f` may leave its node in round `round`: not read within the
    /// lookahead (the readers are about to read those).
    fn movable(&self, f: u32, round: u64) -> bool {
        self.read_at[f as usize] + self.lookahead <= round
    }

    /// The node whose rank reads at absolute world position `key`.
    fn reader(&self, key: u64) -> Option<u16> {
        if key == NEVER {
            return None;
        }
        let r = (key % self.walk.world) as usize;
        self.layout.node_of_rank.get(r).copied().flatten()
    }

    /// The file node `n` gives up to make room, among those that may move: the one it
    /// needs last that node `to` reads next (the swap then brings it to its reader, where
    /// it stays), else the one it needs last (Belady).
    fn victim(&self, n: u16, to: u16, round: u64) -> Option<u32> {
        if to != NONE && to != n {
            let lo = by_reader(n, to, 0, 0);
            let hi = by_reader(n, to, u64::MAX, u32::MAX);
            let swap = self
                .by_reader
                .range(lo..=hi)
                .rev()
                .map(|&e| e as u32)
                .find(|&f| self.movable(f, round));
            if swap.is_some() {
                return swap;
            }
        }
        self.held[n as usize]
            .iter()
            .rev()
            .map(|&(_, f)| f)
            .find(|&f| self.movable(f, round))
    }

    /// A node other than `not` with room for `size`, if any.
    fn free_node(&self, size: u64, not: u16) -> Option<u16> {
        (0..self.held.len() as u16).find(|&i| i != not && self.fits(i, size, 0))
    }

    /// Places the read of `f` by node `n` at absolute world position `pos`.
    fn place(&mut self, f: u32, n: u16, pos: u64, round: u64) {
        let after = self.next_use(f, pos);
        self.read_at[f as usize] = round + 1;
        let h = self.holder[f as usize];
        if h == NONE {
            self.stats.backing += 1;
        }
        if h == n {
            self.stats.local += 1;
            self.rekey(f, after);
            return;
        }
        let need = self.size(f);
        if need > self.layout.slots[n as usize] {
            // Larger than the node's whole share: read where it is.
            self.stats.remote += 1;
            self.rekey(f, after);
            return;
        }
        // Room for `f` on `n`: files there give way, one after another (one, counted
        // in files), each to the node `f` leaves when it has room there, else to one
        // with room, else out of the cluster (or in place of the file it needs last).
        while !self.fits(n, need, 0) {
            let Some(v) = self.victim(n, h, round) else {
                // Everything there is about to be read: the read goes to `h` (or the
                // backing store) and the copy stays where it is.
                self.stats.remote += 1;
                self.rekey(f, after);
                return;
            };
            let sv = self.size(v);
            if h != NONE && self.fits(h, sv, need) {
                // A swap: `v` takes the room `f` frees.
                self.set_holder(v, h);
            } else if let Some(x) = self.free_node(sv, n) {
                self.set_holder(v, x);
            } else {
                // The cluster grows by `f`: the file it needs last goes.
                let vk = self.key[v as usize];
                let w = self
                    .all
                    .iter()
                    .rev()
                    .take(4096)
                    .map(|&(_, g)| g)
                    .find(|&g| self.movable(g, round));
                match w {
                    Some(w) if w != v && self.key[w as usize] > vk => {
                        let x = self.holder[w as usize];
                        self.set_holder(w, NONE);
                        if x == n {
                            // `w` was on `n`: `v` stays, in the room `w` left.
                        } else if self.fits(x, sv, 0) {
                            self.set_holder(v, x);
                        } else {
                            // Larger than the room `w` left.
                            self.set_holder(v, NONE);
                        }
                    }
                    _ => self.set_holder(v, NONE),
                }
            }
        }
        self.stats.local += 1;
        self.reading = round;
        self.set_holder(f, n);
        self.reading = u64::MAX;
        self.rekey(f, after);
    }

    /// Places rounds until `round` (exclusive). Files not read again within the
    /// current and next epoch get their keys when an epoch begins.
    pub fn advance(&mut self, round: u64) {
        let rounds = self.walk.rounds();
        let end = round.min(rounds * self.walk.epochs);
        while self.next < end {
            let k = self.next;
            self.at = k;
            if k.is_multiple_of(rounds) && k > 0 {
                self.rekey_never(k * self.walk.world);
            }
            let base = k * self.walk.world;
            let per = rounds * self.walk.world;
            let Some(ix) = self.world_order(base / per) else {
                break;
            };
            for r in 0..self.walk.world {
                let pos = base + r;
                let f = ix.order[(pos % per) as usize];
                match self.layout.node_of_rank.get(r as usize).copied().flatten() {
                    Some(n) => self.place(f, n, pos, k),
                    None => {
                        // A rank no node runs: its read only moves the file's next use.
                        let after = self.next_use(f, pos);
                        self.rekey(f, after);
                    }
                }
            }
            self.expire_departures();
            self.next += 1;
        }
    }

    /// New keys for the held files not read within the last horizon (a new epoch comes
    /// into view at absolute position `pos`).
    fn rekey_never(&mut self, pos: u64) {
        let fs: Vec<u32> = self.all.range((NEVER, 0)..).map(|&(_, f)| f).collect();
        for f in fs {
            // Its next read after the start of the epoch (`pos − 1` is before it).
            let k = self.next_use(f, pos.saturating_sub(1));
            let k = if k < pos { NEVER } else { k };
            self.rekey(f, k);
        }
    }

    /// The node the cluster's copy of `f` is on, if any.
    pub fn holder(&self, f: u32) -> Option<&str> {
        self.node(self.holder.get(f as usize).copied()?)
    }

    /// The node that held `f` before it moved to its holder.
    pub fn prev(&self, f: u32) -> Option<&str> {
        self.node(self.prev.get(f as usize)?[0])
    }

    /// The nodes that held `f` before, most recent first (up to 3).
    pub fn earlier(&self, f: u32) -> impl Iterator<Item = &str> {
        self.prev
            .get(f as usize)
            .into_iter()
            .flatten()
            .filter_map(|&i| self.node(i))
    }

    fn node(&self, i: u16) -> Option<&str> {
        self.layout.nodes.get(i as usize).map(String::as_str)
    }

    /// True when this node holds the cluster's copy of `f`.
    pub fn is_mine(&self, f: u32) -> bool {
        self.me
            .is_some_and(|m| self.holder.get(f as usize) == Some(&m))
    }

    /// True when the placement moved `f` from this node to another that has not taken
    /// it yet ([`Placement::discharge`]): this node keeps its copy (the cluster's only
    /// one, perhaps) until then, or until the readers are an epoch past the move (a new
    /// holder that had gone, say); sooner, four lookaheads past it at least, when the new
    /// holder's readers went past it or the copies kept that long pass their share of the
    /// node's slots (see `Placement::owed_rounds`).
    pub fn is_owed(&self, f: u32) -> bool {
        self.owed.get(f as usize).is_some_and(|&u| u > self.next)
    }

    /// The files moved away from this node that it may still keep for their new
    /// holders (see [`Placement::is_owed`]; some may have been taken already).
    pub fn departing(&self) -> impl Iterator<Item = u32> + '_ {
        self.departures
            .iter()
            .flatten()
            .filter(|&&(u, f)| u > self.next && self.owed[f as usize] == u)
            .map(|&(_, f)| f)
    }

    /// This node's copy of `f` is gone: it owes no other node a copy.
    pub fn discharge(&mut self, f: u32) {
        if (f as usize) < self.owed.len() {
            self.set_owed(f, 0);
        }
    }

    /// Another node took this node's copy of `f` to keep (or said it has one): owed no
    /// more, and its holder's readers have come as far as the move (see
    /// `Placement::owed_rounds`).
    pub fn taken(&mut self, f: u32) {
        let Some(&u) = self.owed.get(f as usize) else {
            return;
        };
        if u != 0 {
            let h = self.holder[f as usize];
            if h != NONE {
                let made = u - self.owed_rounds();
                let p = &mut self.progress[h as usize];
                *p = (*p).max(made);
            }
        }
        self.set_owed(f, 0);
    }

    /// Another node says it has its own copy of `f` (a release: the placement moved the
    /// file onto it and it found a copy there): owed no more. Unlike
    /// [`Placement::taken`], it says nothing of how far that node's readers came: a node
    /// claims every copy it finds at once, ahead of its reads, and a copy moved there
    /// earlier that it has still to fetch must stay.
    pub fn released(&mut self, f: u32) {
        self.discharge(f);
    }

    /// True when the simulation places `f` (some node holds, or held, its copy).
    pub fn places(&self, f: u32) -> bool {
        self.holder.get(f as usize).is_some_and(|&h| h != NONE)
            || self.prev.get(f as usize).is_some_and(|h| h[0] != NONE)
    }

    /// Files moved onto this node, at most `max`, that `fetch` says are to be fetched
    /// (not here yet): the ones this node reads first, soonest first, then the copies
    /// parked here, in the order they came (a read has a deadline, a parked copy only
    /// frees its sender's room). Those already here go to `claimed` (their earlier
    /// holders are told to let go of theirs) and leave the queue, as do the files the
    /// placement moved on since.
    pub fn incoming(
        &mut self,
        max: usize,
        fetch: &dyn Fn(u32) -> bool,
        claimed: &mut Vec<u32>,
    ) -> Vec<u32> {
        let mut wanted: Vec<(u64, usize, u32)> = Vec::new();
        let mut i = 0;
        while i < self.incoming.len() {
            let (f, round) = self.incoming[i];
            if !self.is_mine(f) || wanted.iter().any(|w| w.2 == f) {
                self.incoming.remove(i);
            } else if !fetch(f) {
                claimed.push(f);
                self.incoming.remove(i);
            } else {
                wanted.push((round, i, f));
                i += 1;
            }
        }
        wanted.sort_unstable();
        wanted.into_iter().take(max).map(|w| w.2).collect()
    }

    /// This node's slots (files or bytes, see [`Layout::slots`]) and the files placed
    /// on it now (0, 0 when it runs no rank).
    pub fn mine(&self) -> (u64, usize) {
        self.me.map_or((0, 0), |m| {
            (self.layout.slots[m as usize], self.held[m as usize].len())
        })
    }

    /// Files held per node (for tests and status).
    pub fn counts(&self) -> Vec<usize> {
        self.held.iter().map(BTreeSet::len).collect()
    }

    /// Slots taken per node: files, or bytes when slots are bytes.
    pub fn used(&self) -> &[u64] {
        &self.used
    }

    /// The slots file `f` takes: one, or its bytes when slots are bytes (to count the
    /// room of [`Placement::departing`] copies).
    pub fn slots_of(&self, f: u32) -> u64 {
        self.size(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(m: usize, slots: u64) -> Layout {
        Layout {
            nodes: (0..m).map(|i| format!("n{i}")).collect(),
            node_of_rank: (0..m).map(|i| Some(i as u16)).collect(),
            slots: vec![slots; m],
            bytes: false,
        }
    }

    /// (backing ÷ dataset per epoch after the first, local fraction after the first).
    use crate::planner::PLACEMENT_LOOKAHEAD;

    /// The shuffle the simulation tests walk: `files` over `m` ranks, seed 3.
    fn walk(m: usize, files: u64, epochs: u64) -> Walk {
        Walk {
            files,
            seed: 3,
            first: 0,
            epochs,
            world: m as u64,
            drop_last: false,
        }
    }

    /// What [`Placement::victim`] chose by scanning every file node `n` holds, needed
    /// last first: the first that may move and that node `to` reads next, else the first
    /// that may move.
    fn victim_by_scan(p: &Placement, n: u16, to: u16, round: u64) -> Option<u32> {
        let movable: Vec<(u64, u32)> = p.held[n as usize]
            .iter()
            .rev()
            .copied()
            .filter(|&(_, f)| p.movable(f, round))
            .collect();
        movable
            .iter()
            .find(|&&(k, _)| to != NONE && to != n && p.reader(k) == Some(to))
            .or(movable.first())
            .map(|&(_, f)| f)
    }

    #[test]
    fn the_victim_index_agrees_with_a_scan_of_the_held_files_every_round() {
        // Sizes spread, a below and above the dataset, a rank no node runs: swaps, drops,
        // growth of the cluster and keys of every kind are exercised.
        for (a, bytes) in [(0.5, false), (1.0, false), (0.7, true), (2.0, true)] {
            let (m, files, epochs) = (4usize, 120u64, 4u64);
            let mut w = walk(m + 1, files, epochs);
            w.world = m as u64 + 1;
            let mut l = layout(m, 0);
            l.node_of_rank.push(None);
            let sizes: Arc<[u64]> = (0..files).map(|f| 1 + (f * 7919) % 13).collect();
            let total: u64 = if bytes { sizes.iter().sum() } else { files };
            l.slots = vec![(a * total as f64 / m as f64) as u64; m];
            l.bytes = bytes;
            let mut p = Placement::with_sizes(w, l, "n0", 3, bytes.then(|| sizes.clone()));
            for round in 1..=w.rounds() * epochs {
                p.advance(round);
                let mut expect = BTreeSet::new();
                for (n, held) in p.held.iter().enumerate() {
                    for &(k, f) in held {
                        if let Some(r) = p.reader(k).filter(|&r| r != n as u16) {
                            expect.insert(by_reader(n as u16, r, k, f));
                        }
                    }
                }
                assert_eq!(p.by_reader, expect, "a = {a}, round {round}: the index");
                for n in 0..m as u16 {
                    for to in (0..m as u16).chain([NONE]) {
                        assert_eq!(
                            p.victim(n, to, round),
                            victim_by_scan(&p, n, to, round),
                            "a = {a}, round {round}: the victim of {n} for {to}"
                        );
                    }
                }
            }
            assert!(p.stats.moves > 0, "a = {a}: copies moved");
        }
    }

    fn run(m: usize, files: u64, a: f64, epochs: u64, lookahead: u64) -> (f64, f64) {
        let walk = walk(m, files, epochs);
        let slots = (a * files as f64 / m as f64).round() as u64;
        let mut p = Placement::new(walk, layout(m, slots), "n0", lookahead);
        p.advance(walk.rounds());
        let s0 = p.stats;
        p.advance(walk.rounds() * epochs);
        let s = p.stats;
        for (i, c) in p.counts().iter().enumerate() {
            assert!(*c as u64 <= slots, "node {i} holds {c} > {slots}");
        }
        let reads = (s.local + s.remote - s0.local - s0.remote) as f64;
        eprintln!("moves per read {:.2}", (s.moves - s0.moves) as f64 / reads);
        (
            (s.backing - s0.backing) as f64 / (files * (epochs - 1)) as f64,
            (s.local - s0.local) as f64 / reads,
        )
    }

    #[test]
    fn reaches_the_floor_and_local_reads() {
        for (a, floor) in [(0.5, 0.5), (1.0, 0.0), (1.5, 0.0), (2.0, 0.0)] {
            let (backing, local) = run(4, 240, a, 5, PLACEMENT_LOOKAHEAD);
            eprintln!("a={a}: backing {backing:.3} local {local:.3}");
            assert!(backing <= floor + 0.01, "a={a}: backing {backing}");
            if a >= 1.0 {
                assert!(local >= 0.95, "a={a}: local {local}");
            }
        }
    }

    /// Sizes spread as JPEGs are (log-normal, σ 0.5 of the log) around 128 KiB, and
    /// one file in ten eight times larger: the same for the same `files`.
    fn spread_sizes(files: u64) -> Arc<[u64]> {
        (0..files)
            .map(|i| {
                let u = |x: u64| {
                    (xxhash_rust::xxh3::xxh3_64(&x.to_le_bytes()) >> 11) as f64
                        / (1u64 << 53) as f64
                        + 1e-9
                };
                let z =
                    (-2.0 * u(2 * i).ln()).sqrt() * (std::f64::consts::TAU * u(2 * i + 1)).cos();
                let mean = if i % 10 == 9 { 1024.0 } else { 128.0 } * 1024.0;
                (mean * 0.88 * (0.5 * z).exp()).clamp(4096.0, 16.0 * mean) as u64
            })
            .collect()
    }

    /// The simulation in bytes with spread sizes: (backing ÷ the dataset's bytes per
    /// epoch after the first, worst epoch; local reads after the first); no node ever
    /// holds more bytes than its slots.
    fn run_bytes(m: usize, files: u64, a: f64, epochs: u64) -> (f64, f64) {
        let walk = walk(m, files, epochs);
        let sizes = spread_sizes(files);
        let total: u64 = sizes.iter().sum();
        let slots = (a * total as f64 / m as f64) as u64;
        let mut l = layout(m, slots);
        l.bytes = true;
        let lookahead = crate::planner::lookahead_for(&l, Some(&sizes));
        let mut p = Placement::with_sizes(walk, l, "n0", lookahead, Some(sizes.clone()));
        let (mut worst, mut local, mut reads) = (0.0f64, 0u64, 0u64);
        for e in 0..epochs {
            let s0 = p.stats;
            let mut from_backing = 0u64;
            for r in 0..walk.rounds() {
                let round = e * walk.rounds() + r;
                // The files read this round that no node held.
                let base = round * walk.world;
                let per = walk.rounds() * walk.world;
                let ix = p.world_order(base / per).expect("in the plan");
                let read: Vec<u32> = (0..walk.world)
                    .map(|k| ix.order[((base + k) % per) as usize])
                    .collect();
                let before = p.stats.backing;
                let unheld: Vec<u32> = read
                    .iter()
                    .copied()
                    .filter(|&f| p.holder[f as usize] == NONE)
                    .collect();
                p.advance(round + 1);
                assert_eq!(p.stats.backing - before, unheld.len() as u64);
                from_backing += unheld.iter().map(|&f| sizes[f as usize]).sum::<u64>();
                for (n, u) in p.used().iter().enumerate() {
                    assert!(
                        *u <= slots,
                        "a={a} round {round}: node {n} holds {u} > {slots} bytes"
                    );
                }
            }
            if e > 0 {
                worst = worst.max(from_backing as f64 / total as f64);
                local += p.stats.local - s0.local;
                reads += p.stats.local + p.stats.remote - s0.local - s0.remote;
            }
        }
        (worst, local as f64 / reads as f64)
    }

    #[test]
    fn in_bytes_spread_sizes_fit_their_nodes_and_reach_the_floor_every_epoch() {
        for (a, floor) in [(0.5, 0.5), (1.0, 0.0), (2.0, 0.0)] {
            let (backing, local) = run_bytes(4, 2000, a, 10);
            eprintln!("a={a}: worst epoch backing {backing:.3}, local {local:.3}");
            assert!(backing <= floor + 0.02, "a={a}: backing {backing}");
            if a >= 1.0 {
                assert!(local >= 0.95, "a={a}: local {local}");
            }
        }
    }

    #[test]
    fn a_copy_moved_away_is_kept_until_taken_or_four_lookaheads_later() {
        let walk = Walk {
            files: 40,
            seed: 5,
            first: 0,
            epochs: 4,
            world: 2,
            drop_last: false,
        };
        let l = 2;
        let mut a = Placement::new(walk, layout(2, 20), "n0", l);
        let mut checked = 0;
        for round in 1..70 {
            let before: Vec<Option<String>> =
                (0..40).map(|f| a.holder(f).map(str::to_owned)).collect();
            a.advance(round);
            for f in 0..40u32 {
                let moved_away = before[f as usize].as_deref() == Some("n0")
                    && a.holder(f).is_some_and(|h| h != "n0");
                if moved_away {
                    assert!(a.is_owed(f), "file {f} moved away in round {round}");
                    assert!(a.departing().any(|x| x == f));
                    checked += 1;
                }
                if a.is_owed(f) {
                    assert!(!a.is_mine(f), "a file held here is not owed");
                }
            }
        }
        assert!(checked > 10, "only {checked} moves away seen");
        // Copies moved away an epoch ago are not kept any more.
        let owed_now: Vec<u32> = (0..40).filter(|&f| a.is_owed(f)).collect();
        a.advance(70 + a.owed_rounds());
        for f in owed_now {
            assert!(
                !a.is_owed(f) || a.departing().any(|x| x == f),
                "file {f} still kept"
            );
        }
        // Taken: nothing is owed any more.
        for f in 0..40 {
            a.discharge(f);
            assert!(!a.is_owed(f));
        }
        assert_eq!((a.departing, a.live_departures), (0, 0));
    }

    /// The shuffle of the tests of copies kept for their new holders: 4 ranks, 6 epochs
    /// (an epoch is `files / 4` rounds, much longer than four lookaheads).
    fn four_ranks_six_epochs(files: u64) -> Walk {
        Walk {
            files,
            seed: 9,
            first: 0,
            epochs: 6,
            world: 4,
            drop_last: false,
        }
    }

    /// Ranks out of lockstep are up to an epoch apart: a copy moved away from a node is
    /// kept longer than four lookaheads for its slower new holder, an epoch at most, as
    /// long as the copies kept that long take at most a quarter of the node's slots (the
    /// oldest go first past it); in bytes as in files.
    #[test]
    fn a_copy_moved_away_is_kept_an_epoch_within_its_share_of_the_slots() {
        for bytes in [false, true] {
            let files = 400u64;
            let walk = four_ranks_six_epochs(files);
            let sizes: Arc<[u64]> = (0..files).map(|f| 1000 + (f * 7919) % 3000).collect();
            let total: u64 = sizes.iter().sum();
            let mut lay = layout(2, if bytes { total / 2 } else { files / 2 });
            lay.bytes = bytes;
            let l = 4;
            let mut a = Placement::with_sizes(walk, lay, "n0", l, bytes.then(|| sizes.clone()));
            let share = a.layout.slots[0] / DEPARTING_SHARE;
            let base = OWED_LOOKAHEADS * l;
            assert!(
                a.owed_rounds() > base,
                "an epoch is longer than four lookaheads"
            );
            // The round of each file's last move away from n0.
            let mut moved_at: Vec<Option<u64>> = vec![None; files as usize];
            let (mut longest, mut moves, mut peak) = (0, 0, 0);
            for round in 1..walk.rounds() * walk.epochs {
                let before: Vec<bool> = (0..files as u32).map(|f| a.is_mine(f)).collect();
                a.advance(round);
                let at = round - 1;
                let mut old = 0;
                for f in 0..files as u32 {
                    let i = f as usize;
                    if before[i] && !a.is_mine(f) && a.holder(f).is_some() {
                        moved_at[i] = Some(at);
                        moves += 1;
                    }
                    if a.is_mine(f) {
                        moved_at[i] = None;
                    }
                    let Some(m) = moved_at[i] else {
                        assert!(!a.is_owed(f), "file {f} is owed, never moved away");
                        continue;
                    };
                    let age = at - m;
                    if age < base {
                        assert!(a.is_owed(f), "file {f} moved away {age} rounds ago: kept");
                    }
                    if a.is_owed(f) {
                        assert!(age < a.owed_rounds(), "file {f} kept {age} rounds");
                        if age >= base {
                            old += a.slots_of(f);
                            longest = longest.max(age);
                        }
                    }
                }
                assert!(
                    old <= share,
                    "bytes {bytes}, round {round}: {old} slots kept past four lookaheads, share {share}"
                );
                peak = peak.max(old);
            }
            assert!(
                peak > share / 2,
                "bytes {bytes}: the share ({share}) never came near ({peak}): not tested"
            );
            assert!(moves > 50, "only {moves} moves away");
            assert!(
                longest > 2 * base,
                "bytes {bytes}: copies kept {longest} rounds at most, four lookaheads are {base}"
            );
        }
    }

    /// Node n0 of two (half the files each) walks `walk` with lookahead `l`; every copy
    /// the placement moves away from it is given to `hand` (its new holder takes or
    /// releases it) but every fifth, which its new holder passes by: (the copies passed
    /// by, the longest one was kept, in rounds).
    fn keep_passed_by(walk: Walk, l: u64, hand: fn(&mut Placement, u32)) -> (u32, u64) {
        let files = walk.files;
        let mut a = Placement::new(walk, layout(2, files / 2), "n0", l);
        let mut moved_at: Vec<Option<u64>> = vec![None; files as usize];
        let (mut skipped, mut oldest) = (0, 0);
        for round in 1..walk.rounds() * walk.epochs {
            let before: Vec<bool> = (0..files as u32).map(|f| a.is_mine(f)).collect();
            a.advance(round);
            let at = round - 1;
            for f in 0..files as u32 {
                let i = f as usize;
                if before[i] && !a.is_mine(f) && a.holder(f).is_some() {
                    if f % 5 == 0 {
                        // Passed by.
                        moved_at[i] = Some(at);
                        skipped += 1;
                    } else {
                        hand(&mut a, f);
                        assert!(!a.is_owed(f));
                    }
                }
                if a.is_mine(f) {
                    moved_at[i] = None;
                }
                if let Some(m) = moved_at[i]
                    && a.is_owed(f)
                {
                    oldest = oldest.max(at - m);
                }
            }
        }
        (skipped, oldest)
    }

    /// A new holder that takes its copies as its readers come to them (in lockstep) and
    /// passes some by (read some other way): those are kept four lookaheads after their
    /// move, a lookahead more at most, not an epoch (the room they would hold is room
    /// this node's own files need).
    #[test]
    fn a_copy_its_new_holder_went_past_is_kept_four_lookaheads() {
        let walk = four_ranks_six_epochs(400);
        let l = 4;
        let base = OWED_LOOKAHEADS * l;
        assert!(
            Placement::new(walk, layout(2, 200), "n0", l).owed_rounds() > 2 * base,
            "an epoch is much longer than the base"
        );
        let (skipped, oldest) = keep_passed_by(walk, l, Placement::taken);
        assert!(skipped > 20, "only {skipped} copies passed by");
        assert!(
            (base - 1..=base + l).contains(&oldest),
            "copies passed by kept {oldest} rounds; four lookaheads are {base}"
        );
    }

    /// A new holder that says it has copies (releases) as the placement moves them to
    /// it, ahead of its readers, tells nothing of how far its readers came: a copy moved
    /// there earlier and not taken is kept past four lookaheads (within the share of
    /// the slots), where copies taken by fetches (in reading order) let it go at four.
    #[test]
    fn a_release_does_not_say_the_new_holders_readers_went_past_a_copy() {
        let walk = four_ranks_six_epochs(400);
        let l = 4;
        let base = OWED_LOOKAHEADS * l;
        let (_, fetched) = keep_passed_by(walk, l, Placement::taken);
        assert!(fetched <= base + l, "taken: kept {fetched} rounds");
        let (_, released) = keep_passed_by(walk, l, Placement::released);
        assert!(
            released > 2 * base,
            "released: kept {released} rounds at most, four lookaheads are {base}"
        );
    }

    #[test]
    fn incoming_lists_this_nodes_reads_first_and_claims_what_is_here() {
        let walk = Walk {
            files: 60,
            seed: 1,
            first: 0,
            epochs: 3,
            world: 3,
            drop_last: false,
        };
        let mut p = Placement::new(walk, layout(3, 20), "n1", 4);
        p.advance(walk.rounds() + 6);
        let queued: Vec<(u32, u64)> = p.incoming.iter().copied().collect();
        assert!(queued.iter().any(|q| q.1 == u64::MAX), "no parked copy");
        assert!(queued.iter().any(|q| q.1 != u64::MAX), "no read");
        // Pretend the first queued file is here already: it is claimed, not fetched.
        let here = queued.iter().find(|q| p.is_mine(q.0)).unwrap().0;
        let mut claimed = Vec::new();
        let got = p.incoming(usize::MAX, &|f| f != here, &mut claimed);
        assert_eq!(claimed, vec![here]);
        assert!(!got.contains(&here));
        assert!(got.iter().all(|&f| p.is_mine(f)));
        let rounds: Vec<u64> = got
            .iter()
            .map(|f| queued.iter().find(|q| q.0 == *f).unwrap().1)
            .collect();
        let mut sorted = rounds.clone();
        sorted.sort_unstable();
        assert_eq!(rounds, sorted, "reads first, soonest first, then parked");
    }

    #[test]
    fn every_node_computes_the_same_placement() {
        let walk = Walk {
            files: 100,
            seed: 9,
            first: 0,
            epochs: 3,
            world: 3,
            drop_last: false,
        };
        let mut a = Placement::new(walk, layout(3, 30), "n0", 2);
        let mut b = Placement::new(walk, layout(3, 30), "n2", 2);
        a.advance(70);
        b.advance(70);
        for f in 0..100 {
            assert_eq!(a.holder(f), b.holder(f));
            assert_eq!(a.prev(f), b.prev(f));
        }
    }
}
