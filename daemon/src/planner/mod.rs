//! The planner: what each registered job will read and in which order, hence when
//! every file is needed next; and from that, eviction (the file needed farthest in the
//! future goes first — Belady's MIN), admission (a file needed later than everything
//! cached is not admitted), and prefetch (the missing files, in order of need).
//!
//! Pure logic: no I/O, no clock. Positions are plan steps; each job's consumption rate
//! (steps per second, measured by the daemon) turns step distances into comparable
//! times across jobs. The daemon's registered jobs (`crate::jobs`) feed it, and the
//! store's eviction policy and the prefetch thread consult it.
//!
//! Prefetch may run as far ahead as it likes, under one rule
//! ([`Planner::may_evict_for_prefetch`]): the file it evicts must be next read in a
//! later epoch than the file it fetches. Belady keeps the files read first in the next
//! epoch, so an epoch opens with a run of hits; every hit read there is next needed an
//! epoch later, so it makes room for the next miss and the backing store works through
//! the run instead of idling (bunched hits cost no stall). Evicting a file still due in
//! the same epoch would fetch it twice; the rule forbids exactly that. The simulation in
//! `tests.rs` reaches the C/N hit ceiling for every window from 1 to C files, and the
//! property test shows the victim is always the file needed farthest in the future.
//!
//! How far ahead to run is paced by deadlines ([`prefetch::Pace`]): the next missing
//! file is fetched only when the backing store must start now for some upcoming missing
//! file to arrive in time. When the store is the bottleneck it never idles; when it is
//! fast, prefetch stays close to the reader and files kept for the next epoch stay
//! cached longer. The policy benchmark (`shardcache-bench policy`) shows both the hit
//! ceiling and the stall floor across cache sizes and rates.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

// Keyed by paths from manifests of any user: seeded per process, and fast on strings
// (the prefetcher looks up thousands of files per decision).
use foldhash::{HashMap, HashSet};
use std::sync::Arc;

use shardcache_plan::shuffle;

pub mod cluster;
pub mod forward;
pub mod placement;
pub mod prefetch;
pub mod ring;

/// A file the planner knows: (root index, path relative to the root). The path is shared:
/// a clone (the planner's index of files keeps one of each manifest entry) costs a
/// reference count, not a copy of the path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileRef {
    /// Index of the backing root.
    pub root: usize,
    /// Path relative to the root.
    pub path: Arc<str>,
}

/// Where a job's per-epoch order comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Explicit orders (file indices), `epochs[i]` being epoch `first + i`.
    Sequence {
        /// First epoch number.
        first: u64,
        /// Orders.
        epochs: Vec<Arc<Vec<u32>>>,
    },
    /// A named shuffle of all files, sliced for this node's ranks.
    Shuffle {
        /// Seed.
        seed: u64,
        /// First epoch number and number of epochs.
        first: u64,
        /// Number of epochs.
        count: u64,
        /// World size.
        world: u64,
        /// This node's ranks.
        ranks: Vec<u64>,
        /// `DistributedSampler(drop_last)`.
        drop_last: bool,
    },
}

/// One epoch's order with, per file, its sorted positions: the first in `first` (4 bytes
/// per file of the manifest), the rest, rare (a shuffle's padding repeats a few files,
/// an explicit order may list a file twice), in `more`. Offsets into one list of every
/// position took 4 bytes per file and 4 per position more.
#[derive(Debug)]
struct EpochIndex {
    order: Arc<Vec<u32>>,
    first: Vec<u32>,
    more: HashMap<u32, Vec<u32>>,
}

/// No position: the file is not in the order.
const ABSENT: u32 = u32::MAX;

/// Set in `first` when the file has more positions (in `more`): a file listed once is
/// answered without a lookup there.
const MORE: u32 = 1 << 31;

impl EpochIndex {
    fn new(order: Arc<Vec<u32>>, nfiles: usize) -> Self {
        assert!(
            order.len() < MORE as usize,
            "an epoch of 2^31 reads or more"
        );
        let mut first = vec![ABSENT; nfiles];
        let mut more: HashMap<u32, Vec<u32>> = HashMap::default();
        for (p, &f) in order.iter().enumerate() {
            let slot = &mut first[f as usize];
            if *slot == ABSENT {
                *slot = p as u32;
            } else {
                *slot |= MORE;
                more.entry(f).or_default().push(p as u32);
            }
        }
        Self { order, first, more }
    }

    /// The whole world's order of a `DistributedSampler` shuffle of `files` in epoch
    /// `epoch` (position `k · world + rank` is rank `rank`'s `k`-th read), indexed:
    /// the padding repeats the permutation from its start, as `shuffle::rank_order`
    /// does. Built by the job (its eviction keys), the simulation and forwarding alike.
    fn world(files: u64, seed: u64, epoch: u64, world: u64, drop_last: bool) -> Self {
        let perm = shuffle::permutation(files, seed, epoch);
        let total = shuffle::samples_per_rank(files, world, drop_last) * world;
        let order: Vec<u32> = (0..total)
            .map(|pos| perm[(pos % files) as usize] as u32)
            .collect();
        Self::new(Arc::new(order), files as usize)
    }

    /// Every position of `f`, in order.
    fn positions(&self, f: u32) -> impl Iterator<Item = u64> + '_ {
        let first = self.first.get(f as usize).copied().unwrap_or(ABSENT);
        let rest = if first != ABSENT && first & MORE != 0 {
            self.more.get(&f).map(Vec::as_slice)
        } else {
            None
        };
        (first != ABSENT)
            .then_some(first & !MORE)
            .into_iter()
            .chain(rest.into_iter().flatten().copied())
            .map(u64::from)
    }

    /// First position of `f` at or after `from`.
    fn next(&self, f: u32, from: u64) -> Option<u64> {
        self.positions(f).find(|&p| p >= from)
    }

    /// Last position of `f` before `before`.
    fn prev(&self, f: u32, before: u64) -> Option<u64> {
        self.positions(f).take_while(|&p| p < before).last()
    }

    /// Positions of `f` at or after `from`, in order.
    fn from(&self, f: u32, from: u64) -> impl Iterator<Item = u64> + '_ {
        self.positions(f).skip_while(move |&p| p < from)
    }
}

/// A registered job.
#[derive(Debug)]
struct Job {
    id: String,
    files: Arc<Vec<FileRef>>,
    source: Source,
    epoch: u64,
    /// The low watermark: every position of the current epoch before it was read (or
    /// skipped as a hole, see [`MAX_READ_AHEAD`]).
    step: u64,
    /// Positions of the current epoch after `step` already read: readers read out of
    /// order and far ahead of the slowest (a DataLoader's workers each read their own
    /// batch, `prefetch_factor` batches ahead). At most [`MAX_READ_AHEAD`].
    consumed: BTreeSet<u64>,
    /// The widest the readers have spread past the watermark so far (the fastest read's
    /// distance from it): the readers' window, which a prefetch must stay ahead of.
    spread: u64,
    /// The widest spread seen in the current epoch: at the next epoch it becomes
    /// `spread`, so that one stray read far ahead inflates it for two epochs at most.
    spread_now: u64,
    /// The first step of the current epoch whose other ranks' reads have not re-keyed
    /// the resident files yet ([`Job::rerank_remote`], M × R world positions a round:
    /// left to [`Planner::sync_placements`], never an open); `None`: none pending.
    remote_from: Option<u64>,
    /// Steps per second (1.0 until measured).
    rate: f64,
    /// Steps read so far (every epoch).
    done: u64,
    epochs: Vec<(u64, Arc<EpochIndex>)>,
    /// The eviction index: this job's resident files by the absolute step (in `done`
    /// terms) of their next use, `u64::MAX` when not within the current and next epoch.
    /// A key changes only when the file is read, when the position jumps, or (for
    /// `u64::MAX` keys) when the job enters a new epoch, so keeping it costs O(log n) per
    /// read instead of a scan of the cache per eviction.
    ranked: BTreeSet<(u64, u32)>,
    /// The key of each file in `ranked`.
    rank_of: HashMap<u32, u64>,
    /// Cluster mode ([`Planner::set_cluster`]): keys count the reads of the other ranks
    /// of a shuffle's world too (other nodes read them, and may fetch this node's copy).
    cluster: bool,
    /// Resident files some other node has fetched a copy of to keep: their reads by
    /// other ranks no longer depend on this node's copy.
    handed: HashSet<u32>,
    /// While the cluster placement replays the plan from its start: the round the
    /// replay began for (see [`Job::discharge_replayed`]).
    replaying: Option<u64>,
    /// A shuffle's whole-world order of a few epochs (position `k · world + rank` is
    /// rank `rank`'s `k`-th read), indexed by file.
    world_epochs: Vec<(u64, Arc<EpochIndex>)>,
    /// The owners of this job's files among the last member list asked about
    /// ([`Planner::plan_owner`]).
    owners: parking_lot::Mutex<Option<Owners>>,
    /// The cluster placement of a shuffle, once every rank's node and every node's
    /// room are known ([`Planner::set_layout`]).
    placement: Option<cluster::Cluster>,
    /// Every file's size in bytes, when the manifest gave them all
    /// ([`Planner::set_sizes`]): the cluster placement then counts bytes.
    sizes: Option<Arc<[u64]>>,
}

/// Most reads a job records ahead of its low watermark. Past it, the positions before
/// the first read ahead are taken as holes (a read never reported, a reader that died)
/// and the watermark moves over them: twice the largest in-flight window of a
/// DataLoader (8 workers × 256-file batches × 2 batches each), so that a loader's
/// legitimate out-of-order reads never count as holes.
pub const MAX_READ_AHEAD: usize = 8192;

/// How far past a job's low watermark a read may be and still count as one of its reads:
/// twice [`MAX_READ_AHEAD`], so that reads past a hole can pile up beyond the allowance
/// and pass it.
pub const READ_WINDOW: u64 = 2 * MAX_READ_AHEAD as u64;

/// Most simulated reads of the cluster placement per taking of the planner lock
/// ([`Planner::sync_placements`]): about 10–50 ms of the simulation at 1.28 M files
/// (`shardcache-bench placement-scale`), every round of a small cluster's epoch. The
/// daemon's prefetcher fits its chunks below it to hold the lock about 5 ms each
/// (`jobs::layouts::PLACEMENT_CHUNK_TIME`): with 4 nodes a chunk of this many held it
/// for seconds.
pub const PLACEMENT_CHUNK_READS: u64 = 1 << 16;

/// Rounds the cluster placement runs ahead of the job's position, at most: the moves it
/// decides for a round start this many rounds before the round is read.
pub const PLACEMENT_LOOKAHEAD: u64 = 16;

/// The lookahead for a layout: [`PLACEMENT_LOOKAHEAD`], less when the files a node reads
/// within it (which stay where they are read) would take more than a quarter of the
/// smallest node's slots; 2 at least.
pub(crate) fn lookahead_for(l: &placement::Layout, sizes: Option<&[u64]>) -> u64 {
    // Ranks per node, in one pass over the world.
    let mut ranks = vec![0u64; l.nodes.len()];
    for n in l.node_of_rank.iter().flatten() {
        if let Some(c) = ranks.get_mut(usize::from(*n)) {
            *c += 1;
        }
    }
    let per_node = ranks.into_iter().max().unwrap_or(1).max(1);
    let mut slots = l.slots.iter().copied().min().unwrap_or(0);
    if l.bytes
        && let Some(s) = sizes.filter(|s| !s.is_empty())
    {
        // In files of the mean size.
        let mean = (s.iter().sum::<u64>() / s.len() as u64).max(1);
        slots /= mean;
    }
    (slots / (4 * per_node)).clamp(2, PLACEMENT_LOOKAHEAD)
}

/// A member list and the index in it of each file's owner.
type Owners = (Vec<String>, Arc<Vec<u16>>);

impl Job {
    fn range(&self) -> (u64, u64) {
        match &self.source {
            Source::Sequence { first, epochs } => (*first, epochs.len() as u64),
            Source::Shuffle { first, count, .. } => (*first, *count),
        }
    }

    fn has_epoch(&self, e: u64) -> bool {
        let (first, count) = self.range();
        e >= first && e < first + count
    }

    fn index(&mut self, e: u64) -> Option<Arc<EpochIndex>> {
        if !self.has_epoch(e) {
            return None;
        }
        if let Some((_, ix)) = self.epochs.iter().find(|(x, _)| *x == e) {
            return Some(ix.clone());
        }
        let order: Arc<Vec<u32>> = match &self.source {
            Source::Sequence { first, epochs } => epochs[(e - first) as usize].clone(),
            Source::Shuffle {
                seed,
                world,
                ranks,
                drop_last,
                ..
            } => Arc::new(
                shuffle::node_order(self.files.len() as u64, *seed, e, *world, ranks, *drop_last)
                    .into_iter()
                    .map(|f| f as u32)
                    .collect(),
            ),
        };
        let ix = Arc::new(EpochIndex::new(order, self.files.len()));
        // Keep the few epochs around the position.
        if self.epochs.len() >= 3 {
            self.epochs.remove(0);
        }
        self.epochs.push((e, ix.clone()));
        Some(ix)
    }

    /// The whole world's order in epoch `e` (shuffles only).
    fn world_index(&mut self, e: u64) -> Option<Arc<EpochIndex>> {
        let Source::Shuffle {
            seed,
            world,
            drop_last,
            ..
        } = &self.source
        else {
            return None;
        };
        if !self.has_epoch(e) {
            return None;
        }
        if let Some((_, ix)) = self.world_epochs.iter().find(|(x, _)| *x == e) {
            return Some(ix.clone());
        }
        let n = self.files.len() as u64;
        let ix = Arc::new(EpochIndex::world(n, *seed, e, *world, *drop_last));
        if self.world_epochs.len() >= 3 {
            self.world_epochs.remove(0);
        }
        self.world_epochs.push((e, ix.clone()));
        Some(ix)
    }

    /// The walk of a shuffle (for its cluster placement).
    fn walk(&self) -> Option<placement::Walk> {
        match &self.source {
            Source::Shuffle {
                seed,
                first,
                count,
                world,
                drop_last,
                ..
            } => Some(placement::Walk {
                files: self.files.len() as u64,
                seed: *seed,
                first: *first,
                epochs: *count,
                world: *world,
                drop_last: *drop_last,
            }),
            Source::Sequence { .. } => None,
        }
    }

    /// The job's position in rounds (every rank's reads so far, ranks in lockstep).
    fn round(&self) -> u64 {
        let Some(w) = self.walk() else { return 0 };
        let nr = self.world().map_or(1, |(_, r)| r.len().max(1) as u64);
        (self.epoch.saturating_sub(w.first)) * w.rounds() + self.step / nr
    }

    /// Brings the placement to the position (plus its lookahead); back to the start and
    /// forward again when the position went back.
    fn sync_placement(&mut self) {
        self.sync_placement_by(u64::MAX);
    }

    /// [`Job::sync_placement`] by at most `max` rounds: true when the placement is at
    /// the position plus its lookahead (or at the end of the plan).
    fn sync_placement_by(&mut self, max: u64) -> bool {
        let round = self.round();
        let Some(p) = &mut self.placement else {
            return true;
        };
        let target = round + p.lookahead();
        if target < p.placed() {
            *p = p.restarted();
            self.replaying = Some(target);
        }
        let before = p.placed();
        // A simulation replays the cluster's reads, `max` rounds at a time; forwarding
        // goes to the target at once (its cost is this node's own reads, an epoch's at
        // most after a jump).
        match p {
            cluster::Cluster::Sim(_) => p.advance(target.min(before.saturating_add(max.max(1)))),
            cluster::Cluster::Fwd(_) => p.advance(target),
        }
        let after = p.placed();
        self.discharge_replayed();
        after >= target || after == before
    }

    /// A placement started over replays the plan and moves away from this node again
    /// copies other nodes took already ([`Planner::set_handed`]): they will not take
    /// them again, so the replayed placement owes them nothing (see `Placement::taken`),
    /// up to the round the replay began for.
    fn discharge_replayed(&mut self) {
        let (Some(until), Some(p)) = (self.replaying, &mut self.placement) else {
            return;
        };
        for &i in &self.handed {
            p.discharge(i);
        }
        if p.placed() >= until {
            self.replaying = None;
        }
    }

    /// (world, this node's ranks) of a shuffle.
    fn world(&self) -> Option<(u64, &[u64])> {
        match &self.source {
            Source::Shuffle { world, ranks, .. } => Some((*world, ranks)),
            Source::Sequence { .. } => None,
        }
    }

    /// Steps (of this node's order) until another node's rank reads `f`, this epoch or
    /// the next: the ranks of one job read in lockstep, so this node's position is
    /// every rank's.
    fn remote_distance(&mut self, f: u32) -> Option<u64> {
        let (world, ranks) = self.world()?;
        let (nr, ranks) = (ranks.len() as u64, ranks.to_vec());
        let (e, s) = (self.epoch, self.step);
        let remote = |p: u64| !ranks.contains(&(p % world));
        let cur = self.world_index(e)?;
        if let Some(p) = cur.from(f, (s / nr) * world).find(|&p| remote(p)) {
            return Some(((p / world) * nr).saturating_sub(s));
        }
        let len = cur.order.len() as u64 / world * nr;
        let next = self.world_index(e + 1)?;
        let p = next.from(f, 0).find(|&p| remote(p))?;
        Some(len.saturating_sub(s) + (p / world) * nr)
    }

    /// Steps until `f` is needed next by this node, or — in cluster mode, while no other
    /// node has taken a copy — by another node's rank.
    fn need_distance(&mut self, f: u32) -> Option<u64> {
        let local = self.distance(f);
        if !self.cluster || self.handed.contains(&f) {
            return local;
        }
        match (local, self.remote_distance(f)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The ranks likely to hold `f` now, most likely first: the last to read it before
    /// the position, the next ones to read it (they may have prefetched it), then the
    /// earlier ones (over this epoch and the ones either side).
    fn holders(&mut self, f: u32) -> Vec<u64> {
        let Some((world, ranks)) = self.world() else {
            return Vec::new();
        };
        let nr = ranks.len() as u64;
        let (e, s) = (self.epoch, self.step);
        let at = (s / nr) * world;
        let (mut past, mut next) = (Vec::new(), Vec::new()); // most recent / soonest first
        if let Some(cur) = self.world_index(e) {
            let mut before = at;
            while let Some(p) = cur.prev(f, before) {
                past.push(p % world);
                before = p;
            }
            next.extend(cur.from(f, at).map(|p| p % world));
        }
        if let Some(ix) = e.checked_sub(1).and_then(|x| self.world_index(x)) {
            let mut before = u64::MAX;
            while let Some(p) = ix.prev(f, before) {
                past.push(p % world);
                before = p;
            }
        }
        if let Some(ix) = self.world_index(e + 1) {
            next.extend(ix.from(f, 0).map(|p| p % world));
        }
        let mut out = Vec::new();
        let rest = past.iter().skip(1).copied();
        for r in past.first().copied().into_iter().chain(next).chain(rest) {
            if !out.contains(&r) {
                out.push(r);
            }
        }
        out
    }

    /// Re-keys the resident files other ranks read at this node's steps `from..to` of
    /// the current epoch (their keys pointed at those reads).
    fn rerank_remote(&mut self, from: u64, to: u64) {
        if !self.cluster {
            return;
        }
        let Some((world, ranks)) = self.world() else {
            return;
        };
        let nr = ranks.len() as u64;
        let Some(ix) = self.world_index(self.epoch) else {
            return;
        };
        let (a, b) = (
            (from / nr) * world,
            (to.div_ceil(nr) * world).min(ix.order.len() as u64),
        );
        for pos in a..b {
            let g = ix.order[pos as usize];
            if self.rank_of.contains_key(&g) {
                self.rank(g);
            }
        }
    }

    /// (Re)computes the eviction key of resident file `f`.
    fn rank(&mut self, f: u32) {
        let k = self.need_distance(f).map_or(u64::MAX, |d| self.done + d);
        if let Some(old) = self.rank_of.insert(f, k) {
            self.ranked.remove(&(old, f));
        }
        self.ranked.insert((k, f));
    }

    fn unrank(&mut self, f: u32) {
        self.handed.remove(&f);
        if let Some(old) = self.rank_of.remove(&f) {
            self.ranked.remove(&(old, f));
        }
    }

    /// [`Job::rerank_remote`] of the steps read since `remote_from`, at most
    /// `max_steps` of them: true when none is left pending.
    fn rerank_remote_pending(&mut self, max_steps: u64) -> bool {
        let Some(from) = self.remote_from.take() else {
            return true;
        };
        let to = self.step.min(from.saturating_add(max_steps.max(1)));
        self.rerank_remote(from, to);
        if to < self.step {
            self.remote_from = Some(to);
            return false;
        }
        true
    }

    /// Recomputes every key (after the position jumped).
    fn rerank_all(&mut self) {
        self.remote_from = None;
        let fs: Vec<u32> = self.rank_of.keys().copied().collect();
        for f in fs {
            self.rank(f);
        }
    }

    /// Recomputes the keys of files not needed within the current and next epoch (after
    /// entering a new epoch, the one after it comes into view).
    fn rerank_never(&mut self) {
        let fs: Vec<u32> = self
            .ranked
            .range((u64::MAX, 0)..)
            .map(|&(_, f)| f)
            .collect();
        for f in fs {
            self.rank(f);
        }
    }

    /// The first position of `f` in the current epoch (`cur`) at or after `from`, at
    /// most `window` after the watermark, that was not read yet.
    fn unread(&self, cur: &EpochIndex, f: u32, from: u64, window: u64) -> Option<u64> {
        cur.from(f, from)
            .take_while(|&p| p - self.step <= window)
            .find(|p| !self.consumed.contains(p))
    }

    /// Records a read of file `f` at its first unread position within `window` of the
    /// watermark, in any order: the watermark moves over every position read since; a
    /// read of the next epoch while only the last reads of this one (at most
    /// [`MAX_READ_AHEAD`]) are missing ends this one. `None` when the read is no read
    /// of this plan's current or next epoch within the window; else the steps the
    /// watermark moved.
    fn on_read(&mut self, f: u32, window: u64) -> Option<u64> {
        let mut cur = self.index(self.epoch)?;
        let mut passed = 0;
        let p = match self.unread(&cur, f, self.step, window) {
            Some(p) => p,
            None => {
                let len = cur.order.len() as u64;
                let missing = len - self.step.min(len) - self.consumed.len() as u64;
                // The last reads of an epoch still out (at most as many as the readers
                // run ahead, or a quarter of the epoch): a file read again earlier in
                // the epoch is no sign the next one began.
                let tail = self.spread.max(len / 4).min(MAX_READ_AHEAD as u64);
                if missing > tail || !self.has_epoch(self.epoch + 1) {
                    return None;
                }
                let next = self.index(self.epoch + 1)?;
                let q = next.next(f, 0).filter(|&q| q <= window)?;
                passed += self.advance_to(len, &cur);
                cur = next;
                q
            }
        };
        // This node read it: its copy is the one the next reader will ask for.
        self.handed.remove(&f);
        if p == self.step {
            passed += self.advance_to(p + 1, &cur);
        } else {
            self.consumed.insert(p);
            self.spread = self.spread.max(p + 1 - self.step);
            self.spread_now = self.spread_now.max(p + 1 - self.step);
            if self.consumed.len() > MAX_READ_AHEAD {
                // Reads far ahead of positions never read: those are holes.
                let first = self.consumed.first().copied().unwrap_or(p);
                passed += self.advance_to(first, &cur);
            }
            // Read: next needed later.
            if self.rank_of.contains_key(&f) {
                self.rank(f);
            }
        }
        // The placement follows the watermark, but not here: a read only moves the
        // position, and the prefetcher brings the placement after it
        // ([`Planner::sync_placements`]): an open never runs the simulation of the
        // cluster's reads (M simulated reads per round of this node's ranks).
        Some(passed)
    }

    /// Moves the watermark to `to` (the positions before it read or skipped) and over
    /// the reads recorded right after it, re-keys the files passed, and rolls into the
    /// next epoch at the end of one. Returns the steps moved.
    fn advance_to(&mut self, to: u64, cur: &EpochIndex) -> u64 {
        let from = self.step;
        let mut step = to.max(from);
        self.consumed = self.consumed.split_off(&step);
        while self.consumed.remove(&step) {
            step += 1;
        }
        self.step = step;
        let passed = step - from;
        self.done += passed;
        // Files other ranks read meanwhile are next needed later too: re-keyed later,
        // off the open path (`sync_placements`), or now if the epoch ends.
        self.remote_from.get_or_insert(from);
        let len = cur.order.len() as u64;
        let rolled = step >= len && self.has_epoch(self.epoch + 1);
        if rolled {
            self.rerank_remote_pending(u64::MAX);
            self.epoch += 1;
            self.step = 0;
            self.consumed.clear();
            self.spread = std::mem::take(&mut self.spread_now);
        }
        // The files read (or skipped) are next needed later: new keys.
        for q in from..step.min(len) {
            let g = cur.order[q as usize];
            if self.rank_of.contains_key(&g) {
                self.rank(g);
            }
        }
        if rolled {
            self.rerank_never();
        }
        passed
    }

    /// Steps from the position until file `f` is read next (this epoch or the next).
    fn distance(&mut self, f: u32) -> Option<u64> {
        let (e, s) = (self.epoch, self.step);
        let cur = self.index(e)?;
        if let Some(p) = self.unread(&cur, f, s, u64::MAX) {
            return Some(p - s);
        }
        let next = self.index(e + 1)?;
        let left = (cur.order.len() as u64).saturating_sub(s);
        next.next(f, 0).map(|p| left + p)
    }
}

/// When a file is needed next, comparable across jobs.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub enum Need {
    /// In about this many seconds (steps ÷ rate).
    In(f64),
    /// Not by any registered plan within its next epoch.
    Never,
}

impl Need {
    fn key(self) -> f64 {
        match self {
            Need::In(t) => t,
            Need::Never => f64::INFINITY,
        }
    }

    /// True when `self` is needed strictly later than `other`.
    pub fn later_than(self, other: Need) -> bool {
        self.key() > other.key()
    }
}

/// Errors of registration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A sequence names a file index that is not listed.
    #[error("epoch {epoch}: file index {index} is not listed")]
    UnknownFile {
        /// Epoch number.
        epoch: u64,
        /// Offending index.
        index: u32,
    },
    /// A shuffle over no files, or ranks outside the world.
    #[error("{0}")]
    Invalid(&'static str),
}

/// The (job, index in its manifest) of each job that reads a file: almost always one,
/// held inline (no allocation per file of a manifest; cheap to copy out on an open).
type Refs = smallvec::SmallVec<[(usize, u32); 1]>;

/// Every registered job and the file → (job, index) map.
#[derive(Debug, Default)]
pub struct Planner {
    jobs: Vec<Job>,
    files: HashMap<FileRef, Refs>,
    /// Planned reads so far, over all jobs (grows by one per read that advanced a job).
    reads: u64,
    /// Files with a cache entry ([`Planner::set_resident`]), with the tick of their
    /// last use.
    resident: HashMap<FileRef, u64>,
    /// Resident files no registered job reads, by last use: the first to evict.
    unplanned: BTreeSet<(u64, FileRef)>,
    tick: u64,
    /// See [`Planner::set_cluster`].
    cluster: bool,
    /// The cluster placement shuffles run ([`Planner::set_scheme`]).
    scheme: cluster::Scheme,
}

/// Candidates taken from each job's eviction index before the exact comparison (a file
/// several jobs read can be far for one and near for another).
const CANDIDATES_PER_JOB: usize = 16;
/// Most entries of one index examined for one eviction choice.
const SCAN: usize = 4096;

impl Planner {
    /// An empty planner.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers (or replaces) job `id`, positioned at the start of its first epoch.
    pub fn register(
        &mut self,
        id: &str,
        files: Vec<FileRef>,
        source: Source,
    ) -> Result<(), PlanError> {
        match &source {
            Source::Sequence { first, epochs } => {
                for (i, e) in epochs.iter().enumerate() {
                    if let Some(&bad) = e.iter().find(|&&f| f as usize >= files.len()) {
                        return Err(PlanError::UnknownFile {
                            epoch: first + i as u64,
                            index: bad,
                        });
                    }
                }
            }
            Source::Shuffle { world, ranks, .. } => {
                if files.is_empty()
                    || *world == 0
                    || ranks.is_empty()
                    || ranks.iter().any(|r| r >= world)
                {
                    return Err(PlanError::Invalid(
                        "shuffle needs files, a world and ranks inside it",
                    ));
                }
            }
        }
        self.unregister(id);
        let first = match &source {
            Source::Sequence { first, .. } | Source::Shuffle { first, .. } => *first,
        };
        self.jobs.push(Job {
            id: id.to_owned(),
            files: Arc::new(files),
            source,
            epoch: first,
            step: 0,
            consumed: BTreeSet::new(),
            spread: 0,
            spread_now: 0,
            remote_from: None,
            rate: 1.0,
            done: 0,
            epochs: Vec::new(),
            ranked: BTreeSet::new(),
            rank_of: HashMap::default(),
            cluster: self.cluster,
            handed: HashSet::default(),
            replaying: None,
            world_epochs: Vec::new(),
            owners: parking_lot::Mutex::new(None),
            placement: None,
            sizes: None,
        });
        self.reindex();
        // The new job's files already cached enter its index (and leave the unplanned).
        let j = self.jobs.len() - 1;
        let cached: Vec<(u32, FileRef, u64)> = self.jobs[j]
            .files
            .iter()
            .enumerate()
            .filter_map(|(i, f)| self.resident.get(f).map(|&t| (i as u32, f.clone(), t)))
            .collect();
        for (i, f, t) in cached {
            self.jobs[j].rank(i);
            self.unplanned.remove(&(t, f));
        }
        Ok(())
    }

    /// Forgets job `id`; true if it was registered.
    pub fn unregister(&mut self, id: &str) -> bool {
        let Some(j) = self.jobs.iter().position(|j| j.id == id) else {
            return false;
        };
        let job = self.jobs.remove(j);
        self.reindex();
        // Its cached files that no other job reads join the unplanned.
        for &i in job.rank_of.keys() {
            let f = &job.files[i as usize];
            if !self.files.contains_key(f)
                && let Some(&t) = self.resident.get(f)
            {
                self.unplanned.insert((t, f.clone()));
            }
        }
        true
    }

    /// Records that `f` has (or no longer has) a cache entry. The eviction policy calls
    /// this for every entry it is told of, so that [`Planner::victim_indexed`] needs no
    /// scan.
    pub fn set_resident(&mut self, f: &FileRef, resident: bool) {
        if resident {
            if self.resident.contains_key(f) {
                return;
            }
            self.tick += 1;
            self.resident.insert(f.clone(), self.tick);
            match self.files.get(f).cloned() {
                Some(refs) => {
                    for (j, i) in refs {
                        let job = &mut self.jobs[j];
                        job.rank(i);
                        // A copy arriving here that the placement gives this node is
                        // the cluster's; so is one the placement moved on from this
                        // node before it landed (the simulation runs ahead of the
                        // fetches): the new holder takes it from here, and it is kept
                        // for it (see `Placement::is_owed`). Any other is a local one,
                        // owing nothing (a move from here is discharged when the copy
                        // goes: the next one is fetched anew).
                    }
                }
                None => {
                    self.unplanned.insert((self.tick, f.clone()));
                }
            }
        } else if let Some(t) = self.resident.remove(f) {
            match self.files.get(f).cloned() {
                Some(refs) => {
                    for (j, i) in refs {
                        let job = &mut self.jobs[j];
                        job.unrank(i);
                        // A copy gone owes nothing (the next one is fetched anew).
                        if let Some(p) = &mut job.placement {
                            p.discharge(i);
                        }
                    }
                }
                None => {
                    self.unplanned.remove(&(t, f.clone()));
                }
            }
        }
    }

    /// Records a use of resident file `f` (LRU order among files no plan needs).
    pub fn touch(&mut self, f: &FileRef) {
        let planned = self.files.contains_key(f);
        let Some(t) = self.resident.get_mut(f) else {
            return;
        };
        self.tick += 1;
        if !planned {
            self.unplanned.remove(&(*t, f.clone()));
            self.unplanned.insert((self.tick, f.clone()));
        }
        *t = self.tick;
    }

    /// How many files have a cache entry (see [`Planner::set_resident`]).
    pub fn resident_len(&self) -> usize {
        self.resident.len()
    }

    /// True when `f` has a cache entry (see [`Planner::set_resident`]).
    pub fn is_resident(&self, f: &FileRef) -> bool {
        self.resident.contains_key(f)
    }

    /// Cluster mode (peers on): a resident file of a shuffle is also needed when another
    /// node's rank reads it next, until that node has fetched a copy
    /// ([`Planner::set_handed`]). Every node computes every rank's order from the same
    /// manifest, so the cluster keeps the files its readers need soonest, wherever they
    /// are, instead of each node keeping only what it reads itself and dropping the last
    /// copy of what the others read next.
    pub fn set_cluster(&mut self, on: bool) {
        self.cluster = on;
        for job in &mut self.jobs {
            job.cluster = on;
            job.rerank_all();
        }
    }

    /// Which cluster placement shuffles run from their next layout on (see
    /// [`cluster::Scheme`]).
    pub fn set_scheme(&mut self, scheme: cluster::Scheme) {
        self.scheme = scheme;
    }

    /// The cluster placement shuffles run ([`Planner::set_scheme`]).
    pub fn scheme(&self) -> cluster::Scheme {
        self.scheme
    }

    /// Records that another node fetched resident file `f` to keep: this node's copy is
    /// now needed only for this node's own reads, and a cluster placement that moved it
    /// away from here owes its new holder nothing more (see `Placement::taken`).
    pub fn set_handed(&mut self, f: &FileRef) {
        self.hand_over(f, cluster::Cluster::taken);
    }

    /// Records that another node said it has its own copy of resident file `f` (a
    /// release: the placement moved the file to it and it found a copy there), as
    /// [`Planner::set_handed`] does, but without taking it for a sign of how far that
    /// node's readers came (see `Placement::released`).
    pub fn set_released(&mut self, f: &FileRef) {
        self.hand_over(f, cluster::Cluster::released);
    }

    /// [`Planner::set_handed`] or [`Planner::set_released`]: `discharge` tells the
    /// placement.
    fn hand_over(&mut self, f: &FileRef, discharge: fn(&mut cluster::Cluster, u32)) {
        if !self.resident.contains_key(f) {
            return;
        }
        for (j, i) in self.files.get(f).cloned().unwrap_or_default() {
            let job = &mut self.jobs[j];
            if let Some(p) = &mut job.placement {
                discharge(p, i);
            }
            if job.handed.insert(i) && job.rank_of.contains_key(&i) {
                job.rank(i);
            }
        }
    }

    /// The owner of `f` among `members` (the healthy nodes, sorted) when a shuffle plans
    /// it: the job's files are spread over the members with balanced loads
    /// ([`ring::balanced`], over `id` of each file), so that every node owns
    /// its share of the dataset to within one file. `None` for files no shuffle plans
    /// (plain rendezvous hashing decides those).
    pub fn plan_owner<'a>(
        &self,
        f: &FileRef,
        members: &'a [String],
        id: &dyn Fn(&FileRef) -> Vec<u8>,
    ) -> Option<&'a str> {
        let &(j, i) = self
            .files
            .get(f)?
            .iter()
            .find(|&&(j, _)| self.jobs[j].world().is_some())?;
        let job = &self.jobs[j];
        let owners = {
            let mut cache = job.owners.lock();
            match &*cache {
                Some((m, o)) if m == members => o.clone(),
                _ => {
                    let peers: Vec<&str> = members.iter().map(String::as_str).collect();
                    let o = Arc::new(ring::balanced(&peers, job.files.iter().map(id)));
                    *cache = Some((members.to_vec(), o.clone()));
                    o
                }
            }
        };
        members
            .get(*owners.get(i as usize)? as usize)
            .map(String::as_str)
    }

    /// Sets (or clears) the cluster layout of shuffle `id` — which node runs each rank
    /// and how many of the job's files each node's cache holds — as every node computes
    /// it; `me` is this node. A new layout starts the placement over from the start of
    /// the plan (every node does the same) and brings it to the job's position.
    pub fn set_layout(&mut self, id: &str, layout: Option<placement::Layout>, me: &str) {
        let Some(layout) = layout else {
            if let Some(job) = self.job_mut(id)
                && job.placement.take().is_some()
            {
                tracing::debug!(job = %id, "cluster placement off");
            }
            return;
        };
        if let Some((p, _)) = self.placement_for(id, layout, me) {
            self.install_placement(id, p);
        }
    }

    /// A new placement for shuffle `id` under `layout` (see [`Planner::set_layout`]),
    /// with the round to bring it to: `None` when the job has that placement already (or
    /// is not a shuffle). The replay ([`placement::Placement::advance`]) may take a while
    /// for a long plan: callers run it without the planner lock, then
    /// [`Planner::install_placement`].
    pub fn placement_for(
        &self,
        id: &str,
        layout: placement::Layout,
        me: &str,
    ) -> Option<(cluster::Cluster, u64)> {
        let job = self.jobs.iter().find(|j| j.id == id)?;
        let walk = job.walk()?;
        if job
            .placement
            .as_ref()
            .is_some_and(|p| *p.layout() == layout && p.me() == me && p.scheme() == self.scheme)
        {
            return None;
        }
        let lookahead = lookahead_for(&layout, job.sizes.as_deref());
        let target = job.round() + lookahead;
        let sizes = job.sizes.clone();
        Some((
            cluster::Cluster::new(self.scheme, walk, layout, me, lookahead, sizes),
            target,
        ))
    }

    /// Gives job `id` every file's size (in manifest order; `None`: not all known): its
    /// cluster placement then counts bytes (see [`placement`]).
    pub fn set_sizes(&mut self, id: &str, sizes: Option<Arc<[u64]>>) {
        if let Some(j) = self.job_mut(id) {
            j.sizes = sizes.filter(|s| s.len() == j.files.len());
        }
    }

    /// True when job `id` has every file's size ([`Planner::set_sizes`]).
    pub fn has_sizes(&self, id: &str) -> bool {
        self.jobs.iter().any(|j| j.id == id && j.sizes.is_some())
    }

    /// Installs a placement made by [`Planner::placement_for`] (and brought forward) for
    /// shuffle `id`, and brings it to the job's position.
    pub fn install_placement(&mut self, id: &str, p: cluster::Cluster) {
        let Some(job) = self.job_mut(id) else { return };
        if job.walk() != Some(p.walk()) {
            return; // registered again meanwhile, with another plan
        }
        tracing::debug!(job = %id, layout = ?p.layout(), "cluster placement layout");
        job.replaying = Some(job.round() + p.lookahead());
        job.placement = Some(p);
        job.sync_placement();
    }

    /// Brings every job's cluster placement toward its position (plus its lookahead) by
    /// at most about `max_reads` simulated reads each (whole rounds, one at least), and
    /// the eviction keys of the resident files other ranks read since (as many world
    /// positions), and the orders of the next two epochs: true when all are there.
    /// Reads and position reports only move positions; the daemon's
    /// prefetcher calls this between its rounds, taking the planner lock for each call,
    /// so that neither an open nor an eviction ever waits for the simulation of the
    /// cluster's reads for long ([`PLACEMENT_CHUNK_READS`] per taking).
    pub fn sync_placements(&mut self, max_reads: u64) -> bool {
        let mut done = true;
        for j in &mut self.jobs {
            let world = j.walk().map_or(1, |w| w.world.max(1));
            let nr = j.world().map_or(1, |(_, r)| r.len().max(1) as u64);
            // The next two epochs' orders (each a shuffle of the whole dataset, kept
            // three at a time), so that the open entering an epoch builds none.
            for e in [j.epoch + 1, j.epoch + 2] {
                j.index(e);
                if j.cluster {
                    j.world_index(e);
                }
            }
            // The other ranks' reads re-key this node's resident files, then the
            // placement moves: each about `max_reads` world positions at most.
            done &= j.rerank_remote_pending((max_reads / world).saturating_mul(nr));
            done &= j.sync_placement_by(max_reads / world);
        }
        done
    }

    /// What job `id`'s cluster placement found in its simulated reads so far (local,
    /// remote and backing reads, copies moved); `None` when it has none.
    pub fn placement_stats(&self, id: &str) -> Option<placement::SimStats> {
        let job = self.jobs.iter().find(|j| j.id == id)?;
        Some(job.placement.as_ref()?.stats())
    }

    /// The cluster placement of job `id` as `shardcache status` shows it: (nodes, this
    /// node's slots, files placed here, copies kept for other nodes, whether the slots
    /// are bytes); `None` when off.
    pub fn placement_status(&self, id: &str) -> Option<(u64, u64, u64, u64, bool)> {
        let job = self.jobs.iter().find(|j| j.id == id)?;
        let p = job.placement.as_ref()?;
        let (slots, here) = p.mine();
        let (departing, _) = self.departing_of(job)?;
        Some((
            p.layout().nodes.len() as u64,
            slots,
            here as u64,
            departing as u64,
            p.layout().bytes,
        ))
    }

    /// The cluster layout a shuffle's placement uses, if any.
    pub fn layout(&self, id: &str) -> Option<&placement::Layout> {
        self.jobs
            .iter()
            .find(|j| j.id == id)
            .and_then(|j| j.placement.as_ref())
            .map(|p| p.layout())
    }

    /// Whether this node must keep its copy of `f` for the cluster, when a shuffle's
    /// placement decides it (`None`: no placement places `f`): the placement put the
    /// cluster's copy here, or put it here before and no node has taken it since.
    pub fn protects(&self, f: &FileRef) -> Option<bool> {
        let mut out = None;
        for &(j, i) in self.files.get(f)? {
            let job = &self.jobs[j];
            let Some(p) = &job.placement else { continue };
            if !p.places(i) {
                continue;
            }
            let keep = p.is_mine(i) || (p.is_owed(i) && !job.handed.contains(&i));
            out = Some(out.unwrap_or(false) || keep);
        }
        out
    }

    /// The slots (files, or bytes when the placement counts bytes) of the resident
    /// copies this node keeps for other nodes now, per job (files the placement moved
    /// away from it that their new holder has not taken yet).
    pub fn departing(&self) -> Vec<(String, u64)> {
        self.jobs
            .iter()
            .filter_map(|j| Some((j.id.clone(), self.departing_of(j)?.1)))
            .collect()
    }

    /// The resident copies job `j`'s placement moved away from this node that their new
    /// holders have not taken yet, and their slots (`None`: no placement).
    fn departing_of(&self, j: &Job) -> Option<(usize, u64)> {
        let p = j.placement.as_ref()?;
        Some(
            p.departing()
                .into_iter()
                .filter(|&i| {
                    !j.handed.contains(&i) && self.resident.contains_key(&j.files[i as usize])
                })
                .fold((0, 0), |(n, s), i| (n + 1, s + p.slots_of(i))),
        )
    }

    /// Where the cluster placements put `f`, for debug logs.
    pub fn describe_placement(&self, f: &FileRef) -> String {
        let mut out = String::new();
        for &(j, i) in self.files.get(f).into_iter().flatten() {
            let job = &self.jobs[j];
            if let Some(p) = &job.placement {
                out += &format!(
                    "{}: round {} holder {:?} before {:?} mine {} owed {} handed {}; ",
                    job.id,
                    p.placed(),
                    p.holder(i),
                    p.earlier(i),
                    p.is_mine(i),
                    p.is_owed(i),
                    job.handed.contains(&i)
                );
            }
        }
        out
    }

    /// True when a shuffle's placement gives this node the cluster's copy of `f` to keep:
    /// a fetch of it takes the copy over from the node it comes from (see
    /// `cluster::Cluster::keeps`).
    pub fn keeps(&self, f: &FileRef) -> bool {
        self.any_placement(f, cluster::Cluster::keeps)
    }

    /// True when some shuffle's cluster placement answers `ask` for `f` with yes.
    fn any_placement(&self, f: &FileRef, ask: fn(&cluster::Cluster, u32) -> bool) -> bool {
        self.files.get(f).is_some_and(|refs| {
            refs.iter()
                .any(|&(j, i)| self.jobs[j].placement.as_ref().is_some_and(|p| ask(p, i)))
        })
    }

    /// True when a shuffle's placement put the cluster's copy of `f` on this node (or,
    /// forwarding, brings a copy here for a read within the lookahead).
    pub fn is_mine(&self, f: &FileRef) -> bool {
        self.any_placement(f, cluster::Cluster::is_mine)
    }

    /// Where to fetch `f` from when a shuffle's placement places it (`None` when none
    /// does): the node holding the cluster's copy and the one that held it before (it
    /// keeps its copy until the holder took it), not this node. An empty list: the
    /// placement has the backing store read, by this node.
    pub fn sources(&self, f: &FileRef) -> Option<Vec<String>> {
        let mut out: Option<Vec<String>> = None;
        for &(j, i) in self.files.get(f)? {
            let Some(p) = &self.jobs[j].placement else {
                continue;
            };
            let v = out.get_or_insert_with(Vec::new);
            for n in p.holder(i).into_iter().chain(p.earlier(i)) {
                if n != p.me() && !v.iter().any(|x| x == n) {
                    v.push(n.to_owned());
                }
            }
        }
        out
    }

    /// Files the placements moved onto this node that are not resident, the reads of
    /// this node first, at most `max`; and those that were resident already (their
    /// earlier holders may let go of their copies: see [`crate::peer::Peers::release`]).
    pub fn incoming(&mut self, max: usize) -> (Vec<FileRef>, Vec<FileRef>) {
        let (mut out, mut claimed) = (Vec::new(), Vec::new());
        let resident = &self.resident;
        for job in &mut self.jobs {
            let files = job.files.clone();
            let Some(p) = &mut job.placement else {
                continue;
            };
            let want = max.saturating_sub(out.len());
            let mut here = Vec::new();
            for i in p.incoming(
                want,
                &|i| !resident.contains_key(&files[i as usize]),
                &mut here,
            ) {
                out.push(files[i as usize].clone());
            }
            // This node's copy is the cluster's again: a node that took it before took
            // it for an earlier move, not for the next one away from here.
            for &i in &here {
                if job.handed.remove(&i) && job.rank_of.contains_key(&i) {
                    job.rank(i);
                }
            }
            claimed.extend(here.into_iter().map(|i| files[i as usize].clone()));
        }
        (out, claimed)
    }

    /// The files of job `id`, in manifest order (shared: cloning is cheap, so callers
    /// walk them without the planner lock).
    pub fn job_files(&self, id: &str) -> Option<Arc<Vec<FileRef>>> {
        self.jobs
            .iter()
            .find(|j| j.id == id)
            .map(|j| j.files.clone())
    }

    /// The jobs that read `f` (their ids), each with `f`'s index in its files: whose
    /// registrants' rights a prefetch of `f` is checked against.
    pub fn readers_of(&self, f: &FileRef) -> Vec<(String, u32)> {
        self.files.get(f).map_or_else(Vec::new, |refs| {
            refs.iter()
                .map(|&(j, i)| (self.jobs[j].id.clone(), i))
                .collect()
        })
    }

    /// True when some job is registered.
    pub fn has_jobs(&self) -> bool {
        !self.jobs.is_empty()
    }

    /// True when some registered job reads `f`.
    pub fn is_planned(&self, f: &FileRef) -> bool {
        self.files.contains_key(f)
    }

    /// The (job, rank)s of shuffles likely to hold `f` now, most likely first (see
    /// `Job::holders`): the nodes running those ranks are asked before its owner.
    pub fn holders(&mut self, f: &FileRef) -> Vec<(String, u64)> {
        let Some(refs) = self.files.get(f).cloned() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (j, i) in refs {
            let job = &mut self.jobs[j];
            out.extend(job.holders(i).into_iter().map(|r| (job.id.clone(), r)));
        }
        out
    }

    /// Every registered shuffle: (job id, world size, this node's ranks).
    pub fn shuffles(&self) -> Vec<(String, u64, Vec<u64>)> {
        self.jobs
            .iter()
            .filter_map(|j| j.world().map(|(w, r)| (j.id.clone(), w, r.to_vec())))
            .collect()
    }

    /// The resident file to evict among those `ok` accepts: a file no plan needs (least
    /// recently used first), else the one needed farthest in the future. Each job's
    /// index gives its farthest resident files; the exact need (over every job, through
    /// their rates) decides among them. The same choice as [`Planner::victim`] over all
    /// resident files whenever each job's 16 farthest accepted files include the answer
    /// (always, for a file only one job reads), at O(jobs · log n) instead of O(n).
    pub fn victim_indexed(&mut self, ok: &dyn Fn(&FileRef) -> bool) -> Option<FileRef> {
        self.victim_indexed_with(&|_, f| ok(f))
    }

    /// [`Planner::victim_indexed`] with a test that may consult the planner.
    pub fn victim_indexed_with(
        &mut self,
        ok: &dyn Fn(&Planner, &FileRef) -> bool,
    ) -> Option<FileRef> {
        self.victims_indexed_with(ok, 1).into_iter().next()
    }

    /// Up to `max` resident files to evict, in order, among those `ok` accepts, from one
    /// look at the indexes: files no plan needs (least recently used first), then each
    /// job's farthest accepted files ordered by their exact need, farthest first (the
    /// first is [`Planner::victim_indexed_with`]'s choice). One look costs up to
    /// `SCAN` (4 096) calls of `ok` per index: a store that evicts several files takes them
    /// from one look, not one look each.
    pub fn victims_indexed_with(
        &mut self,
        ok: &dyn Fn(&Planner, &FileRef) -> bool,
        max: usize,
    ) -> Vec<FileRef> {
        // Bounded scans: `ok` may turn down many files in a row (files this node owns
        // for the cluster, when looking for a local copy to evict first).
        let mut out: Vec<FileRef> = self
            .unplanned
            .iter()
            .take(SCAN)
            .filter(|(_, f)| ok(self, f))
            .take(max)
            .map(|(_, f)| f.clone())
            .collect();
        if out.len() >= max {
            return out;
        }
        let mut candidates: Vec<FileRef> = Vec::new();
        for job in &self.jobs {
            let mut taken = 0;
            for &(_, i) in job.ranked.iter().rev().take(SCAN) {
                let f = &job.files[i as usize];
                if ok(self, f) {
                    candidates.push(f.clone());
                    taken += 1;
                    if taken >= CANDIDATES_PER_JOB.max(max) {
                        break;
                    }
                }
            }
        }
        let mut needs: Vec<(Need, FileRef)> =
            candidates.into_iter().map(|f| (self.need(&f), f)).collect();
        // Farthest first; a stable sort keeps the first of equals first (as `victim`).
        needs.sort_by(|(a, _), (b, _)| b.key().total_cmp(&a.key()));
        for (_, f) in needs {
            if out.len() >= max {
                break;
            }
            if !out.contains(&f) {
                out.push(f);
            }
        }
        out
    }

    fn reindex(&mut self) {
        self.files.clear();
        for (j, job) in self.jobs.iter().enumerate() {
            for (i, f) in job.files.iter().enumerate() {
                self.files.entry(f.clone()).or_default().push((j, i as u32));
            }
        }
    }

    fn job_mut(&mut self, id: &str) -> Option<&mut Job> {
        self.jobs.iter_mut().find(|j| j.id == id)
    }

    /// Sets a job's position (the next step it will read) explicitly. `Ok(false)`: no
    /// such job; an error names what is wrong with the position (an epoch outside the
    /// plan, a step past the epoch's end) and changes nothing. The end of an epoch is
    /// the start of the next one when the plan has it. Within the epoch the job reads
    /// now, a position never moves back (the reads recorded stay).
    pub fn set_position(&mut self, id: &str, epoch: u64, step: u64) -> Result<bool, String> {
        let Some(j) = self.job_mut(id) else {
            return Ok(false);
        };
        let (first, count) = j.range();
        let Some(ix) = j.index(epoch) else {
            return Err(format!(
                "epoch {epoch} is outside the plan (epochs {first}..{})",
                first + count
            ));
        };
        let len = ix.order.len() as u64;
        if step > len {
            return Err(format!(
                "step {step} is past the end of epoch {epoch} ({len} steps)"
            ));
        }
        let (epoch, step) = if step == len && j.has_epoch(epoch + 1) {
            (epoch + 1, 0)
        } else {
            (epoch, step)
        };
        if epoch == j.epoch {
            // Within the epoch the job reads, a position only moves forward: a report
            // behind the reads (a rank that starts the epoch after another rank of the
            // node plan has read some of it) would forget them.
            if step > j.step {
                j.advance_to(step, &ix);
            }
            return Ok(true);
        }
        (j.epoch, j.step) = (epoch, step);
        j.consumed.clear();
        j.rerank_all();
        // (The placement follows in the prefetcher: [`Planner::sync_placements`].)
        Ok(true)
    }

    /// Sets a job's measured consumption rate (steps per second, > 0).
    pub fn set_rate(&mut self, id: &str, steps_per_sec: f64) {
        if let Some(j) = self.job_mut(id)
            && steps_per_sec > 0.0
        {
            j.rate = steps_per_sec;
        }
    }

    /// Steps in a job's current epoch.
    pub fn epoch_len(&mut self, id: &str) -> Option<usize> {
        let job = self.job_mut(id)?;
        let e = job.epoch;
        job.index(e).map(|ix| ix.order.len())
    }

    /// The next `max` files one job reads, in order.
    pub fn upcoming_of(&mut self, id: &str, max: usize) -> Vec<FileRef> {
        let Some(job) = self.job_mut(id) else {
            return Vec::new();
        };
        let (e, s) = (job.epoch, job.step);
        let mut out = Vec::with_capacity(max);
        for ep in [e, e + 1] {
            let Some(ix) = job.index(ep) else { break };
            let start = if ep == e { s as usize } else { 0 };
            for (k, &f) in ix.order.iter().enumerate().skip(start) {
                if out.len() >= max {
                    return out;
                }
                // Read already, ahead of the watermark.
                if ep == e && job.consumed.contains(&(k as u64)) {
                    continue;
                }
                out.push(job.files[f as usize].clone());
            }
        }
        out
    }

    /// Planned steps read so far, over all jobs: a file that is `d` steps away (by
    /// [`Planner::need`] at rate 1) has been read once this passes its value plus `d`.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// A job's position.
    pub fn position(&self, id: &str) -> Option<(u64, u64)> {
        self.jobs
            .iter()
            .find(|j| j.id == id)
            .map(|j| (j.epoch, j.step))
    }

    /// Steps a job has read so far, over all epochs (for measuring its rate).
    pub fn steps_done(&self, id: &str) -> Option<u64> {
        self.jobs.iter().find(|j| j.id == id).map(|j| j.done)
    }

    /// Records that `file` was read: every job that reads it in its current epoch at a
    /// position not read yet, at most `window` steps past its low watermark (or in its
    /// next epoch, when only the last reads of the current one are missing), records
    /// that read; a job's watermark moves over every position read since (rolling into
    /// the next epoch at the end of one). Reads may come in any order and far ahead of
    /// the watermark (see [`MAX_READ_AHEAD`]). Returns the id of the first job that
    /// recorded the read, if any.
    pub fn on_access(&mut self, file: &FileRef, window: u64) -> Option<&str> {
        let refs = self.files.get(file).cloned()?;
        let mut first = None;
        for (j, f) in refs {
            if let Some(passed) = self.jobs[j].on_read(f, window) {
                self.reads += passed;
                first.get_or_insert(j);
            }
        }
        first.map(|j| self.jobs[j].id.as_str())
    }

    /// When `file` is needed next by any job.
    pub fn need(&mut self, file: &FileRef) -> Need {
        let Some(refs) = self.files.get(file).cloned() else {
            return Need::Never;
        };
        let mut best = Need::Never;
        for (j, f) in refs {
            let job = &mut self.jobs[j];
            if let Some(d) = job.need_distance(f) {
                let t = Need::In(d as f64 / job.rate);
                if best.later_than(t) {
                    best = t;
                }
            }
        }
        best
    }

    /// Steps until `file` is read next by the job that reads it soonest (in that job's
    /// steps), if any plan reads it in its current or next epoch.
    pub fn steps_until(&mut self, file: &FileRef) -> Option<u64> {
        let refs = self.files.get(file).cloned()?;
        refs.into_iter()
            .filter_map(|(j, f)| self.jobs[j].distance(f))
            .min()
    }

    /// The epoch in which `file` is needed next (the earliest over jobs), if any: read by
    /// this node, or in cluster mode by another node (see [`Planner::set_cluster`]).
    pub fn use_epoch(&mut self, file: &FileRef) -> Option<u64> {
        let refs = self.files.get(file).cloned()?;
        let mut best: Option<u64> = None;
        for (j, f) in refs {
            let job = &mut self.jobs[j];
            let (e, s) = (job.epoch, job.step);
            let Some(d) = job.need_distance(f) else {
                continue;
            };
            let left = job
                .index(e)
                .map_or(0, |ix| (ix.order.len() as u64).saturating_sub(s));
            let x = if d < left { e } else { e + 1 };
            best = Some(best.map_or(x, |b| b.min(x)));
        }
        best
    }

    /// Whether a prefetch of a file read in epoch `incoming` may evict `victim`: only
    /// when the victim is next read in a later epoch (or never). Evicting a file still
    /// due in the same epoch to prefetch another would fetch the victim twice; evicting
    /// one already read this epoch is what a demand miss would do anyway, only earlier.
    pub fn may_evict_for_prefetch(&mut self, victim: &FileRef, incoming: Option<u64>) -> bool {
        match (self.use_epoch(victim), incoming) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(v), Some(i)) => v > i,
        }
    }

    /// Among `resident`, the one to evict: needed farthest in the future (files no plan
    /// needs first). Ties go to the earliest in `resident`, so a caller listing files
    /// least recently used first gets LRU among equals.
    pub fn victim(&mut self, resident: &[FileRef]) -> Option<usize> {
        let mut best: Option<(usize, Need)> = None;
        for (i, f) in resident.iter().enumerate() {
            let n = self.need(f);
            if best.is_none_or(|(_, b)| n.later_than(b)) {
                best = Some((i, n));
            }
        }
        best.map(|(i, _)| i)
    }

    /// The files every job reads next, merged in order of need, at most `max`. Not
    /// those of a shuffle under a cluster placement: what it reads next is moved here by
    /// the placement ([`Planner::incoming`]).
    pub fn upcoming(&mut self, max: usize) -> Vec<(FileRef, Need)> {
        self.upcoming_except(max, max, &|_, _| false)
    }

    /// [`Planner::upcoming`] passing over the files `skip` names (resident, being
    /// fetched) without counting them: the first `max` others in order of need, looking
    /// at most `max_walk` upcoming files of each job. At half cache a job's next
    /// thousands of files may all be resident; what must be fetched lies past them.
    pub fn upcoming_except(
        &mut self,
        max: usize,
        max_walk: usize,
        skip: &dyn Fn(&Planner, &FileRef) -> bool,
    ) -> Vec<(FileRef, Need)> {
        let mut all: Vec<(FileRef, Need)> = Vec::new();
        // A file read twice in one epoch (a sequence plan may) counts at its first need.
        let mut seen = HashSet::default();
        self.walk_upcoming(max_walk, &mut |p, f, need, _| {
            if !skip(p, f) && seen.insert(f.clone()) {
                all.push((f.clone(), need));
            }
            if all.len() >= max {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        all
    }

    /// Visits the files every job reads next, merged in order of need, each once (at its
    /// first need), looking at most `max_walk` upcoming files of each job, until `visit`
    /// breaks. Nothing is cloned for the files passed over: a caller looking for the
    /// few files that matter among thousands of resident ones pays a lookup for each.
    /// Not the files of a shuffle under a cluster placement (see [`Planner::upcoming`]).
    /// A file two jobs read may be visited once for each. `visit` is also told whether
    /// the file has a cache entry ([`Planner::set_resident`]), from the job's own index
    /// of its resident files: no lookup by path for the thousands passed over.
    pub fn walk_upcoming(
        &mut self,
        max_walk: usize,
        visit: &mut dyn FnMut(&Planner, &FileRef, Need, bool) -> ControlFlow<()>,
    ) {
        // The epochs' orders first (building one needs `&mut`), then the walk over a
        // shared planner, which `visit` may look at.
        struct Cursor {
            job: usize,
            ixs: [Option<Arc<EpochIndex>>; 2],
            /// 0: the current epoch, 1: the next.
            ep: usize,
            k: usize,
            walked: usize,
        }
        let mut cursors: Vec<Cursor> = self
            .jobs
            .iter_mut()
            .enumerate()
            .filter(|(_, job)| job.placement.is_none())
            .map(|(j, job)| {
                let e = job.epoch;
                Cursor {
                    job: j,
                    ixs: [job.index(e), job.index(e + 1)],
                    ep: 0,
                    k: job.step as usize,
                    walked: 0,
                }
            })
            .collect();
        let this = &*self;
        // The next file of a cursor that is due (not read already, not visited in the
        // current epoch before), with its need; moves the cursor onto it.
        let peek = |c: &mut Cursor| -> Option<(u32, Need, bool)> {
            let job = &this.jobs[c.job];
            let s = job.step;
            loop {
                if c.walked >= max_walk {
                    return None;
                }
                let ix = c.ixs[c.ep].as_ref()?;
                let Some(&f) = ix.order.get(c.k) else {
                    if c.ep == 1 {
                        return None;
                    }
                    c.ep = 1;
                    c.k = 0;
                    continue;
                };
                let k = c.k as u64;
                let seen = if c.ep == 0 {
                    // Read already, ahead of the watermark.
                    job.consumed.contains(&k)
                } else {
                    // Visited at a position of the current epoch still to be read.
                    c.ixs[0]
                        .as_ref()
                        .is_some_and(|e| e.from(f, s).any(|p| !job.consumed.contains(&p)))
                };
                if seen {
                    c.k += 1;
                    continue;
                }
                let left = c.ixs[0]
                    .as_ref()
                    .map_or(0, |e| (e.order.len() as u64).saturating_sub(s));
                let d = if c.ep == 0 { k - s } else { left + k };
                let d = d.saturating_sub(job.spread);
                return Some((
                    f,
                    Need::In(d as f64 / job.rate),
                    job.rank_of.contains_key(&f),
                ));
            }
        };
        let mut next: Vec<Option<(u32, Need, bool)>> = cursors.iter_mut().map(&peek).collect();
        loop {
            // The cursor whose next file is needed first (jobs are few).
            let Some((i, (f, need, entry))) = next
                .iter()
                .enumerate()
                .filter_map(|(i, n)| n.map(|n| (i, n)))
                .min_by(|(_, a), (_, b)| a.1.key().total_cmp(&b.1.key()))
            else {
                return;
            };
            let c = &mut cursors[i];
            let file = &this.jobs[c.job].files[f as usize];
            if visit(this, file, need, entry).is_break() {
                return;
            }
            c.walked += 1;
            c.k += 1;
            next[i] = peek(c);
        }
    }
}

#[cfg(test)]
mod tests;
