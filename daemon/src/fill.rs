//! The fill engine: reads blocks from the backing store into the NVMe store, once per
//! block however many clients want it.
//!
//! Requests go into a bounded priority queue (a client waiting on a block first, then
//! read-ahead, then prefetch, then fills behind readers who read the backing store
//! themselves, each in arrival order), one heap per backing root, each served by the
//! root's own pool of `fill_workers` threads, which bounds the concurrency toward that
//! store (fills behind readers: a quarter of it, [`Priority::Behind`]). A block has at most
//! one fill in flight ([`Flight`]): every later request for it waits on the same flight
//! (single-flight). When the queue is full, read-ahead is
//! dropped and counted, and a waiting client falls back to the backing store itself.
//!
//! **A root that stops answering costs the others nothing.** Its fills block only its
//! own workers. A watchdog thread releases the waiters of a fill that is stuck — a
//! backing call of it stuck by the watch's judgement (the stall bound,
//! `backing_stall_timeout`, stretched on a store slow for everyone), its root stalled,
//! or running past four of the watch's bounds (the client falls back at once) — and
//! starts a stand-in worker for it (at most `fill_workers` per root: a stuck thread
//! cannot be cancelled, so its count is what is bounded); while the root is stalled
//! ([`crate::backing::watch`]) its queued fills are released and new ones declined at
//! once, until a call on it completes again. Shutdown waits a few seconds for workers,
//! then leaves the stuck ones behind.
//!
//! Read-ahead and prefetch fills of one file land in batches when the workers are all
//! busy: a worker takes the file's next queued blocks along with the one it popped (up
//! to 8 MiB, 16 blocks, and never blocks an idle worker would take) and lands them with
//! one `fdatasync` and one journal group ([`Store::commit_fills`]); a block a client
//! waits on is filled alone, at once. Small files (one block each) queued at one
//! priority other than demand go along the same way, up to 16 per worker: their data
//! files are created and written, then synced together with one `syncfs` (see
//! `store::io::psync`), and their records go in one journal group
//! ([`Store::commit_new_files`]); a reader already waiting on one of them gets its
//! bytes as soon as they are read. A small file read for a waiting reader while the
//! store lands all it may is landed behind its readers by the root's lander thread, in
//! batches of the same kind (`Backlog`).
//!
//! A fill asks its root's sources in order ([`crate::blocks::Sources`], handed over at
//! construction: the peers when this node shares, then the backing store), and the
//! first that has the block supplies it; the backing store's source checks the version
//! again after reading, so a file changed underneath is never cached under the old
//! version's key. The engine is also what the peer server serves from
//! ([`BlockProvider`]). It imports neither the peers nor the server.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::backing::watch::file_id;
use crate::blocks::{BlockProvider, BlockRequest, Fetched, SourceError, Sources};
use crate::lifecycle::{Task, Wake};
use crate::meta::Meta;
use crate::stats::{Stats, inc};
use crate::store::{Key, Store, StoreError};

pub use crate::blocks::Target;

/// How urgently a block is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// Behind a reader that reads the block from the backing store itself (a cold small
    /// file on a `cold_reads = direct` root): nobody waits for it, so it yields to every
    /// other fill, runs on at most a quarter (at least one) of a root's workers at once (the
    /// rest of the machine stays with the readers), and has a queue of its own
    /// (8 times `fill_queue`): a cold pass outrunning its fills leaves
    /// them queued, not dropped, and the cache catches up behind it.
    Behind = 0,
    /// Planned ahead of any reader (the prefetcher): admitted only without harm to
    /// files kept for a later epoch.
    Prefetch = 1,
    /// Ahead of a reader within the file it opened.
    Readahead = 2,
    /// A client is blocked on it.
    Demand = 3,
}

/// How many times `fill_queue` the fills behind readers may queue (see
/// [`Priority::Behind`]): a queued fill holds its target (a path and a stat), a few
/// hundred bytes.
const BEHIND_QUEUE: usize = 8;

/// Workers of one root that fill behind readers at once: a quarter of the pool, at
/// least one (one of the four by default). On the development VM (2 cores, 20 000 ×
/// 100 KiB on local disk, 8 readers opening 64 files per exchange) all four default
/// workers filling behind the readers took a fifth of the readers' speed, and two kept
/// them within a few percent of plain reads while each small file landed with syncs of
/// its own. Since a worker's batch of small files is synced once (`syncfs`), one worker
/// lands them faster than two did: with two, the readers of a cold pass one file per
/// exchange lost a fifth to a third of their speed to the fills behind them; with one,
/// they read as fast as before and the cache held every file 1.4–2.4 s after a pass of
/// 4 000 instead of 3.9–4.3 s (README.md, "Benchmark").
fn behind_workers(workers: usize) -> usize {
    (workers / 4).max(1)
}

/// How a block fill ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillOutcome {
    /// The block is in the store (it landed, or was there already).
    Landed,
    /// Not filled, for a reason that is no fault: the reader reads the backing store
    /// (or a peer) itself.
    Declined(Declined),
    /// A source or the store failed (counted in `fill_errors`).
    Failed,
}

/// Why a fill was declined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declined {
    /// No room worth making (the store would evict something needed sooner).
    NoSpace,
    /// The file's entry went away meanwhile, or the cluster placement moved the file
    /// elsewhere while a prefetch of it ran.
    Moved,
    /// The backing root has stopped answering (its waiters released by the watchdog,
    /// or the call refused at once).
    Stalled,
    /// The fill engine is shutting down.
    Closed,
}

impl FillOutcome {
    /// True when the block landed.
    pub fn landed(self) -> bool {
        self == Self::Landed
    }
}

/// One block fill in progress; waiters block on it.
#[derive(Debug, Default)]
pub struct Flight {
    state: Mutex<FlightState>,
    cv: Condvar,
    /// The prefetcher waits on it: its end wakes the prefetcher.
    prefetch: AtomicBool,
    /// A reader waits on it: its bytes are handed over as soon as they are read
    /// ([`Flight::wait_ready_until`]), before they land.
    wanted: AtomicBool,
}

#[derive(Debug, Default)]
struct FlightState {
    outcome: Option<FillOutcome>,
    /// The block's bytes, once read, for a flight a reader waits on (until it ends).
    bytes: Option<Arc<[u8]>>,
}

/// What a reader waiting on a flight gets first.
#[derive(Debug, Clone)]
pub enum Ready {
    /// The block's bytes, read from its source and not yet landed: the same bytes the
    /// store will hold. What a reader may read at once; the store makes them visible to
    /// others (and across restarts) only once they are durable.
    Bytes(Arc<[u8]>),
    /// The fill ended.
    Done(FillOutcome),
}

impl Flight {
    /// How the fill ended, once it has, without waiting.
    pub fn outcome(&self) -> Option<FillOutcome> {
        self.state.lock().outcome
    }

    /// Waits until the fill ends or `deadline`; its outcome when it ended.
    pub fn wait_until(&self, deadline: Instant) -> Option<FillOutcome> {
        let mut g = self.state.lock();
        loop {
            if let Some(o) = g.outcome {
                return Some(o);
            }
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return g.outcome;
            }
        }
    }

    /// Marks the flight as one a reader waits on, then waits until its bytes are read
    /// or it ends, or `deadline`: whichever comes first.
    pub fn wait_ready_until(&self, deadline: Instant) -> Option<Ready> {
        self.wanted.store(true, Ordering::Release);
        let mut g = self.state.lock();
        loop {
            // Bytes first: a block handed over lands behind its readers, who take the
            // bytes meanwhile.
            if let Some(b) = &g.bytes {
                return Some(Ready::Bytes(b.clone()));
            }
            if let Some(o) = g.outcome {
                return Some(Ready::Done(o));
            }
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return g.outcome.map(Ready::Done);
            }
        }
    }

    /// Marks the flight as one a reader is about to wait on: its bytes are kept for
    /// the reader once read (see [`Flight::wait_ready_until`]).
    pub fn want(&self) {
        self.wanted.store(true, Ordering::Release);
    }

    /// True once a reader waits on the flight.
    fn wanted(&self) -> bool {
        self.wanted.load(Ordering::Acquire)
    }

    /// Hands the block's bytes to the readers waiting on the flight.
    fn read(&self, bytes: &[u8]) {
        self.state.lock().bytes = Some(Arc::from(bytes));
        self.cv.notify_all();
    }

    fn finish(&self, outcome: FillOutcome) {
        let mut g = self.state.lock();
        g.outcome = Some(outcome);
        // The block is in the store now, or its bytes were never right.
        g.bytes = None;
        drop(g);
        self.cv.notify_all();
    }
}

/// What [`Filler::request`] did.
#[derive(Debug)]
pub enum Scheduled {
    /// The block is already present.
    Present,
    /// A fill is queued or running; wait on it.
    InFlight(Arc<Flight>),
    /// The queue is full: nothing was scheduled.
    Shed,
}

struct Job {
    prio: Priority,
    seq: u64,
    target: Arc<Target>,
    index: usize,
    /// The flight its waiters wait on.
    flight: Arc<Flight>,
}

impl PartialEq for Job {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == CmpOrdering::Equal
    }
}
impl Eq for Job {}
impl PartialOrd for Job {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Job {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        // Max-heap: higher priority first, then lower sequence (older) first.
        self.prio.cmp(&o.prio).then_with(|| o.seq.cmp(&self.seq))
    }
}

/// A fill a worker is running: blocks of one file, or single blocks of several small
/// files, with their flights.
struct Busy {
    worker: u64,
    started: Instant,
    /// The backing file it reads now (the watch's id of its path).
    file: u64,
    blocks: Vec<((Key, usize), Arc<Flight>)>,
    /// Running for longer than the root's stall bound (its waiters were released and a
    /// replacement worker started).
    stuck: bool,
}

/// The workers of one root.
#[derive(Default)]
struct Pool {
    /// Worker threads running, stuck ones included.
    threads: usize,
    /// Of those, the ones filling behind readers ([`Priority::Behind`]).
    behind: usize,
    /// Of those, the ones stuck in the backing store.
    stuck: usize,
    busy: Vec<Busy>,
}

#[derive(Default)]
struct Queue {
    /// One heap of jobs per root: each root's workers serve only its own.
    heaps: Vec<BinaryHeap<Job>>,
    /// Blocks queued and not yet taken by a worker, with their current priority and
    /// flight (a worker taking the blocks after one it popped, for one batch, finds
    /// their flights here).
    queued: HashMap<(Key, usize), (Priority, Arc<Flight>)>,
    /// Of `queued`, those at [`Priority::Behind`] (their own bound).
    behind: usize,
    pools: Vec<Pool>,
    seq: u64,
    closed: bool,
}

impl Queue {
    /// Takes block `id` off the queued set (its heap entry, if any, becomes stale).
    fn take(&mut self, id: &(Key, usize)) -> Option<(Priority, Arc<Flight>)> {
        let taken = self.queued.remove(id);
        if let Some((Priority::Behind, _)) = taken {
            self.behind -= 1;
        }
        taken
    }

    /// Queued blocks that count against `fill_queue` (all but the fills behind readers).
    fn ahead_of_readers(&self) -> usize {
        self.queued.len() - self.behind
    }

    /// Queues block `index` of `target` at `prio` (a block queued again at a higher
    /// priority leaves a stale heap entry that workers skip).
    fn enqueue(&mut self, target: &Arc<Target>, index: usize, prio: Priority, f: &Arc<Flight>) {
        if let Some((was, _)) = self.queued.insert((target.key, index), (prio, f.clone()))
            && was == Priority::Behind
        {
            self.behind -= 1;
        }
        if prio == Priority::Behind {
            self.behind += 1;
        }
        self.seq += 1;
        let seq = self.seq;
        self.heaps[target.root].push(Job {
            prio,
            seq,
            target: target.clone(),
            index,
            flight: f.clone(),
        });
    }
}

struct Inner {
    queue: Mutex<Queue>,
    /// One per root: its idle workers wait on it.
    cvs: Vec<Condvar>,
    /// The watchdog's sleep (woken by `close`).
    tick: Condvar,
    flights: Mutex<HashMap<(Key, usize), Arc<Flight>>>,
    /// Notified when the last flight ends (see [`Filler::settle`]).
    settled: Condvar,
    store: Arc<Store>,
    meta: Arc<Meta>,
    stats: Arc<Stats>,
    limit: usize,
    /// Workers per root kept running; up to [`max_workers`] run while readers wait.
    workers: usize,
    /// Blocks being landed now, per root (see [`Landing`]).
    landing: Vec<AtomicUsize>,
    /// Small files handed to their readers while the store landed all it may, waiting
    /// for their root's lander (see [`Backlog`]).
    backlogs: Vec<Backlog>,
    /// Most bytes a root's backlog holds ([`BACKLOG_BYTES`]; less in tests).
    backlog_bytes: AtomicU64,
    meter: Mutex<Meter>,
    /// Each root's sources, in the order a fill asks them.
    sources: Sources,
    /// The workers and the watchdog, each a [`Task`] (their stop signal is the queue's
    /// `closed`, which one notification reaches): what `close` joins.
    tasks: Mutex<Vec<Task>>,
    /// What the prefetcher sleeps on: the end of a flight it asked for wakes it.
    prefetch_wake: Arc<Wake>,
    next_worker: AtomicU64,
    /// Workers that ended by a panic.
    died: AtomicUsize,
    /// Times requests took the engine's locks (what a batch's one taking is tested by).
    #[cfg(test)]
    lockings: AtomicUsize,
}

/// Moving averages of block reads from the backing store (what the prefetcher paces
/// itself by).
#[derive(Debug, Default, Clone, Copy)]
struct Meter {
    /// Seconds per block read.
    secs: f64,
    /// Bytes per block read.
    bytes: f64,
    /// Reads measured (the averages mean nothing until a few are in).
    n: u64,
}

impl Meter {
    fn add(&mut self, secs: f64, bytes: f64) {
        // An exponential average over about the last 32 reads.
        let a = if self.n < 32 {
            1.0 / (self.n + 1) as f64
        } else {
            1.0 / 32.0
        };
        self.secs += a * (secs - self.secs);
        self.bytes += a * (bytes - self.bytes);
        self.n += 1;
    }
}

/// What the fill engine measured of the backing store.
#[derive(Debug, Clone, Copy)]
pub struct Service {
    /// Seconds one block read takes (under the current load).
    pub latency: f64,
    /// Bytes per second all workers together read.
    pub throughput: f64,
}

/// How long [`Filler::close`] waits for workers before leaving the stuck ones behind.
const CLOSE_WAIT: Duration = Duration::from_secs(3);

/// Most workers per root while readers wait (unless `fill_workers` is more): a
/// reader's fill is never queued behind other fills while fewer run, so that the number
/// of reads from the backing store in flight follows the readers, as it would without
/// the cache.
const MAX_WORKERS: usize = 64;

/// A worker above `fill_workers` that had nothing to do for this long ends.
const IDLE_RETIRE: Duration = Duration::from_secs(2);

/// Most workers of a pool of `workers`.
fn max_workers(workers: usize) -> usize {
    workers.max(MAX_WORKERS)
}

/// Blocks one root lands at once for each of its `fill_workers`, before a block read
/// for a waiting reader is handed over and landed behind its readers (see [`Backlog`]).
const LANDING_PER_WORKER: usize = 2;

/// A block being landed: counted in its root's `landing` while it lives.
struct Landing<'a>(&'a AtomicUsize);

impl<'a> Landing<'a> {
    /// Starts landing a block of `root`, unless the block was `handed` to its readers
    /// already and the root lands as many blocks as it may (then the root's lander may
    /// land it behind them: its readers have it, and its worker is free for the next
    /// fill).
    fn enter(inner: &'a Inner, root: usize, handed: bool) -> Option<Self> {
        let n = &inner.landing[root];
        let limit = inner.workers * LANDING_PER_WORKER;
        // Counted first, then judged: two workers cannot both pass the last place.
        if n.fetch_add(1, Ordering::Relaxed) >= limit && handed {
            n.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Self(n))
    }
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Most bytes of small files one root's backlog holds (see [`Backlog`]): about 600
/// files of 100 KiB, landed in a second or so.
const BACKLOG_BYTES: u64 = 64 << 20;

/// Most bytes one root's backlog holds in a store of `capacity`: [`BACKLOG_BYTES`], at
/// most an eighth of the capacity (a file waiting to land holds its room in the store,
/// which other files were evicted for). A sixteenth was measured too: under
/// docs/PYTHON.md's example on the testbed (caches of 539 MiB, 34 MiB of backlog) each
/// node did not keep 7 800–10 600 cold files, against 3 800–6 700 with 64 MiB.
fn backlog_bytes(capacity: u64) -> u64 {
    BACKLOG_BYTES.min(capacity / 8)
}

/// Most files a lander lands as one batch ([`Store::commit_new_files`]).
const LANDER_BATCH: usize = 32;

/// Small files read for readers who took their bytes while the store landed as many
/// blocks as it may: rather than make the next reader wait for the store's writes, the
/// fill hands them here and its worker moves on; the root's lander thread lands them in
/// batches, one [`Store::commit_new_files`] each (durable before visible, as any fill).
/// Their flights stay registered until they land: a reader who opens such a file
/// meanwhile takes the bytes from the flight. Bounded in bytes: past the bound the
/// fill's worker lands the file itself (`backlog_full`), together with up to 31
/// (`LANDER_BATCH - 1`) of the files waiting there as one batch (one sync for all: one
/// lander does not keep up with many workers), and the store's writes set the pace of
/// the fills. It used to drop it instead: under docs/PYTHON.md's example each
/// node dropped 8 000–10 000 cold files, and later epochs read them from the backing
/// store again (2.3–2.6 × the dataset over 4 epochs; 1.8–1.9 with every file kept).
#[derive(Default)]
struct Backlog {
    q: Mutex<Pending>,
    cv: Condvar,
}

#[derive(Default)]
struct Pending {
    files: std::collections::VecDeque<Deferred>,
    bytes: u64,
    /// The engine is closing: land what is here, then end.
    closed: bool,
}

/// A small file read and handed to its readers, waiting to land.
struct Deferred {
    target: Arc<Target>,
    permit: crate::store::Permit,
    buf: Vec<u8>,
    flight: Arc<Flight>,
}

impl Inner {
    /// Hands a read small file to its root's backlog; gives it back when the backlog
    /// is full or closed (the caller does not keep it).
    fn defer(&self, d: Deferred) -> Result<(), Deferred> {
        let b = &self.backlogs[d.target.root];
        let mut q = b.q.lock();
        let len = d.buf.len() as u64;
        if q.closed || q.bytes + len > self.backlog_bytes.load(Ordering::Relaxed) {
            return Err(d);
        }
        q.bytes += len;
        q.files.push_back(d);
        drop(q);
        b.cv.notify_one();
        Ok(())
    }

    /// Takes up to `n` files waiting in root `root`'s backlog (the oldest first), for a
    /// worker to land along with its own when the backlog is full: with their bytes,
    /// which stay counted in the backlog until they have landed ([`land_deferred`]).
    fn take_backlog(&self, root: usize, n: usize) -> (Vec<Deferred>, u64) {
        let mut q = self.backlogs[root].q.lock();
        let n = n.min(q.files.len());
        let taken: Vec<Deferred> = q.files.drain(..n).collect();
        let bytes = taken.iter().map(|d| d.buf.len() as u64).sum();
        (taken, bytes)
    }
}

/// Lands root `root`'s backlog in batches until the engine closes and the backlog is
/// empty.
fn lander(inner: &Inner, root: usize) {
    let b = &inner.backlogs[root];
    loop {
        let batch: Vec<Deferred> = {
            let mut q = b.q.lock();
            while q.files.is_empty() && !q.closed {
                b.cv.wait(&mut q);
            }
            if q.files.is_empty() {
                return;
            }
            let n = q.files.len().min(LANDER_BATCH);
            q.files.drain(..n).collect()
        };
        let bytes = batch.iter().map(|d| d.buf.len() as u64).sum();
        land_deferred(inner, root, batch, bytes);
    }
}

/// Lands `batch`, small files of root `root` read and handed to their readers, as one
/// [`Store::commit_new_files`] (one sync for all), gives back the `bytes` of them the
/// backlog counted, and ends their flights.
fn land_deferred(inner: &Inner, root: usize, batch: Vec<Deferred>, bytes: u64) {
    let b = &inner.backlogs[root];
    let (mut permits, mut rest) = (Vec::new(), Vec::new());
    for d in batch {
        permits.push(d.permit);
        rest.push((d.target, d.buf, d.flight));
    }
    let blocks = permits
        .into_iter()
        .zip(rest.iter().map(|(_, buf, _)| buf.as_slice()))
        .collect();
    let targets: Vec<&Target> = rest.iter().map(|(t, _, _)| &**t).collect();
    let outcomes = land_new_files(inner, root, blocks, &targets);
    // Its room in the backlog first: what waits for the flights to end (`settle`) finds
    // the backlog as the landing left it.
    b.q.lock().bytes -= bytes;
    for ((t, _, flight), outcome) in rest.into_iter().zip(outcomes) {
        end_flight(inner, (t.key, 0), &flight, outcome);
    }
}

/// The fill engine.
pub struct Filler {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Filler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filler")
            .field("limit", &self.inner.limit)
            .finish()
    }
}

/// A flight that has already ended without the block (for a root that is not answering).
fn declined() -> Arc<Flight> {
    let f = Arc::new(Flight::default());
    f.finish(FillOutcome::Declined(Declined::Stalled));
    f
}

impl Filler {
    /// Starts `workers` fill threads per backing root, with a queue of at most `limit`
    /// read-ahead jobs; each root's fills ask its `sources` in order. The end of every
    /// fill the prefetcher asked for notifies `prefetch_wake`.
    pub fn new(
        store: Arc<Store>,
        meta: Arc<Meta>,
        stats: Arc<Stats>,
        sources: Sources,
        workers: usize,
        limit: usize,
        prefetch_wake: Arc<Wake>,
    ) -> std::io::Result<Self> {
        let nroots = meta.roots().all().len();
        if sources.roots() != nroots {
            return Err(std::io::Error::other(format!(
                "fill sources for {} roots, {nroots} roots",
                sources.roots()
            )));
        }
        let queue = Queue {
            heaps: (0..nroots).map(|_| BinaryHeap::new()).collect(),
            pools: (0..nroots).map(|_| Pool::default()).collect(),
            ..Queue::default()
        };
        let backlog = backlog_bytes(store.capacity());
        let inner = Arc::new(Inner {
            queue: Mutex::new(queue),
            cvs: (0..nroots).map(|_| Condvar::new()).collect(),
            tick: Condvar::new(),
            flights: Mutex::new(HashMap::default()),
            settled: Condvar::new(),
            store,
            meta,
            stats,
            limit,
            workers,
            landing: (0..nroots).map(|_| AtomicUsize::new(0)).collect(),
            backlogs: (0..nroots).map(|_| Backlog::default()).collect(),
            backlog_bytes: AtomicU64::new(backlog),
            meter: Mutex::new(Meter::default()),
            sources,
            prefetch_wake,
            tasks: Mutex::new(Vec::new()),
            next_worker: AtomicU64::new(0),
            died: AtomicUsize::new(0),
            #[cfg(test)]
            lockings: AtomicUsize::new(0),
        });
        let filler = Self { inner };
        for root in 0..nroots {
            for _ in 0..workers {
                filler.inner.queue.lock().pools[root].threads += 1;
                if let Err(e) = spawn_worker(&filler.inner, root) {
                    filler.close();
                    return Err(e);
                }
            }
        }
        for root in 0..nroots {
            let inner = filler.inner.clone();
            let task = Task::spawn(
                &format!("sc-land-{root}"),
                Arc::new(AtomicBool::new(false)),
                move |_| lander(&inner, root),
            );
            match task {
                Ok(t) => filler.inner.tasks.lock().push(t),
                Err(e) => {
                    filler.close();
                    return Err(e);
                }
            }
        }
        let watched = (0..nroots).any(|r| !filler.inner.meta.roots().watch(r).stall().is_zero());
        if watched {
            let inner = filler.inner.clone();
            let task = Task::spawn(
                "sc-fill-watch",
                Arc::new(AtomicBool::new(false)),
                move |_| watchdog(&inner),
            );
            match task {
                Ok(t) => filler.inner.tasks.lock().push(t),
                Err(e) => {
                    filler.close();
                    return Err(e);
                }
            }
        }
        Ok(filler)
    }

    /// Asks for block `index` of `target` at `prio`. Not blocking. A block of a root (or
    /// file) that is not answering is declined at once: the flight returned has ended.
    pub fn request(&self, target: &Arc<Target>, index: usize, prio: Priority) -> Scheduled {
        self.request_many(&[(target, index, prio)])
            .pop()
            .expect("one answer per request")
    }

    /// [`Filler::request`] for several blocks at once, in order, with one taking of the
    /// engine's locks for all of them (a loader's batch of 64 files is one acquisition,
    /// not 64: on a node whose cores are all busy every acquisition the engine's workers
    /// contend for can cost a scheduler's time slice).
    pub fn request_many(&self, asks: &[(&Arc<Target>, usize, Priority)]) -> Vec<Scheduled> {
        let inner = &self.inner;
        // What needs no lock of the engine's is judged first.
        let mut out: Vec<Option<Scheduled>> = asks
            .iter()
            .map(|&(target, index, _)| {
                if inner.store.is_present(&target.key, index) {
                    Some(Scheduled::Present)
                } else if refused(inner, target) {
                    Some(Scheduled::InFlight(declined()))
                } else {
                    None
                }
            })
            .collect();
        if out.iter().all(Option::is_some) {
            return out.into_iter().flatten().collect();
        }
        let mut grown = Vec::new();
        {
            // The queue first, then the flights: every other holder of the flights takes
            // nothing else, so none waits behind this request's wait for the queue (the
            // workers' ends of their fills, above all).
            let mut q = inner.queue.lock();
            let mut flights = inner.flights.lock();
            #[cfg(test)]
            inner.lockings.fetch_add(1, Ordering::Relaxed);
            for (slot, &(target, index, prio)) in out.iter_mut().zip(asks) {
                if slot.is_none() {
                    let (scheduled, more) =
                        schedule(inner, &mut flights, &mut q, target, index, prio);
                    *slot = Some(scheduled);
                    if more {
                        grown.push(target.root);
                    }
                }
            }
        }
        for root in grown {
            self.add_worker(root);
        }
        out.into_iter().flatten().collect()
    }

    /// Sets the most bytes a root's backlog holds.
    #[cfg(test)]
    fn set_backlog_bytes(&self, n: u64) {
        self.inner.backlog_bytes.store(n, Ordering::Relaxed);
    }

    /// Times requests took the engine's locks.
    #[cfg(test)]
    pub(crate) fn lockings(&self) -> usize {
        self.inner.lockings.load(Ordering::Relaxed)
    }

    /// Starts a worker for `root` whose pool already counts it.
    fn add_worker(&self, root: usize) {
        if let Err(e) = spawn_worker(&self.inner, root) {
            tracing::warn!(error = %e, "cannot start another fill worker; readers wait for the running ones");
        }
    }

    /// Fills block `index` of `target` on the calling thread (for a peer that asked this
    /// node, the block's owner): single flight with every other request for the block,
    /// but not queued behind workers that may themselves be waiting on peers. True when
    /// the block is present afterwards.
    pub fn fill_here(&self, target: &Arc<Target>, index: usize, deadline: Instant) -> bool {
        let inner = &self.inner;
        if inner.store.is_present(&target.key, index) {
            return true;
        }
        let (flight, theirs) = {
            let mut flights = inner.flights.lock();
            match flights.get(&(target.key, index)) {
                Some(f) => (f.clone(), true),
                None => {
                    let f = Arc::new(Flight::default());
                    flights.insert((target.key, index), f.clone());
                    (f, false)
                }
            }
        };
        if theirs {
            flight.wait_until(deadline).is_some_and(FillOutcome::landed)
        } else {
            match fill_and_land(inner, target, index, false, &flight) {
                Some(outcome) => outcome.landed(),
                // Landing behind its readers (a reader who joined this flight made it
                // one whose bytes are handed over): landed when the lander says so.
                None => flight.wait_until(deadline).is_some_and(FillOutcome::landed),
            }
        }
    }

    /// Waits until no fill is in flight, or `deadline`; true when none is. A reader's
    /// wait may end before the blocks it got have landed: this is when they have (or
    /// were not kept).
    pub fn settle(&self, deadline: Instant) -> bool {
        let mut f = self.inner.flights.lock();
        while !f.is_empty() {
            if self.inner.settled.wait_until(&mut f, deadline).timed_out() {
                return f.is_empty();
            }
        }
        true
    }

    /// The backing store's measured latency and throughput, once a few reads are in.
    pub fn service(&self) -> Option<Service> {
        let m = *self.inner.meter.lock();
        (m.n >= 4 && m.secs > 0.0).then(|| Service {
            latency: m.secs,
            throughput: self.inner.workers as f64 * m.bytes / m.secs,
        })
    }

    /// Fill workers not ended by a failure (all of them, unless one died).
    pub fn workers_alive(&self) -> usize {
        self.workers()
            .saturating_sub(self.inner.died.load(Ordering::Relaxed))
    }

    /// The number of fill workers: `workers` per backing root (not counting the ones
    /// started to stand in for workers stuck in a backing store).
    pub fn workers(&self) -> usize {
        self.inner.workers * self.inner.cvs.len()
    }

    /// Stops the workers after their current fill; queued fills end unfinished (their
    /// waiters are released and fall back). Waits at most a few seconds: a worker stuck
    /// in a backing store that does not answer is left behind (it cannot be cancelled;
    /// the process exits without it).
    pub fn close(&self) {
        {
            let mut q = self.inner.queue.lock();
            q.closed = true;
            for h in &mut q.heaps {
                h.clear();
            }
            q.queued.clear();
            q.behind = 0;
        }
        for cv in &self.inner.cvs {
            cv.notify_all();
        }
        // Each lander lands what its backlog holds, then ends.
        for b in &self.inner.backlogs {
            b.q.lock().closed = true;
            b.cv.notify_all();
        }
        self.inner.tick.notify_all();
        // Each task ends after its current fill; one stuck in a backing store is left
        // behind (and logged) once the shared deadline passed. A stand-in the watchdog
        // started meanwhile is taken in the second pass.
        let deadline = Instant::now() + CLOSE_WAIT;
        let mut stuck = 0;
        for _ in 0..2 {
            for mut t in std::mem::take(&mut *self.inner.tasks.lock()) {
                if !t.join(deadline.saturating_duration_since(Instant::now())) {
                    stuck += 1;
                }
            }
        }
        if stuck > 0 {
            tracing::warn!(
                stuck,
                "fill workers still blocked in a backing store at shutdown; leaving them behind"
            );
        }
        for (_, f) in self.inner.flights.lock().drain() {
            f.finish(FillOutcome::Declined(Declined::Closed));
        }
    }
}

/// Schedules block `index` of `target` at `prio` under the engine's locks (see
/// [`Filler::request`]); true with it when the root needs another worker (counted in
/// its pool already: the caller starts it once the locks are let go).
fn schedule(
    inner: &Inner,
    flights: &mut HashMap<(Key, usize), Arc<Flight>>,
    q: &mut Queue,
    target: &Arc<Target>,
    index: usize,
    prio: Priority,
) -> (Scheduled, bool) {
    if q.closed {
        return (Scheduled::Shed, false);
    }
    let id = (target.key, index);
    if let Some(f) = flights.get(&id) {
        if prio == Priority::Prefetch {
            f.prefetch.store(true, Ordering::Release);
        }
        // Raise a queued read-ahead to demand.
        let f = f.clone();
        let mut more = false;
        if q.queued.get(&id).is_some_and(|(queued, _)| *queued < prio) {
            q.enqueue(target, index, prio, &f);
            inner.cvs[target.root].notify_one();
            more = prio == Priority::Demand && grow(inner, q, target.root);
        }
        return (Scheduled::InFlight(f), more);
    }
    let full = match prio {
        Priority::Behind => q.behind >= inner.limit * BEHIND_QUEUE,
        Priority::Prefetch | Priority::Readahead => q.ahead_of_readers() >= inner.limit,
        Priority::Demand => q.ahead_of_readers() >= inner.limit * 2,
    };
    if full {
        inc(&inner.stats.queue_shed);
        return (Scheduled::Shed, false);
    }
    let f = Arc::new(Flight::default());
    f.prefetch
        .store(prio == Priority::Prefetch, Ordering::Release);
    flights.insert(id, f.clone());
    q.enqueue(target, index, prio, &f);
    inner.cvs[target.root].notify_one();
    let more = prio == Priority::Demand && grow(inner, q, target.root);
    (Scheduled::InFlight(f), more)
}

/// Whether `root` needs another worker for a reader's block just queued: every worker
/// is busy (none would take it now), none is stuck in the backing store (a store that
/// does not answer gets no more threads than its stand-ins), and the pool is below its
/// most. Counts the new worker in the pool when so (the caller starts it).
fn grow(inner: &Inner, q: &mut Queue, root: usize) -> bool {
    let pool = &mut q.pools[root];
    let idle = pool.threads.saturating_sub(pool.busy.len());
    let queued = q.heaps[root].len();
    if pool.stuck == 0 && queued > idle && pool.threads < max_workers(inner.workers) {
        pool.threads += 1;
        true
    } else {
        false
    }
}

/// Whether fills for `target` are declined at once: its root (or file) is not answering
/// and no peer could supply the block instead.
fn refused(inner: &Inner, target: &Target) -> bool {
    (!target.peer_ok || !inner.sources.any_remote(target.root))
        && inner
            .meta
            .roots()
            .watch(target.root)
            .refuses(file_id(&target.stat.path))
}

/// Starts one worker for `root` (its pool's thread count already includes it).
fn spawn_worker(inner: &Arc<Inner>, root: usize) -> std::io::Result<()> {
    let n = inner.next_worker.fetch_add(1, Ordering::Relaxed);
    let me = inner.clone();
    let task = Task::spawn(
        &format!("sc-fill-{root}-{n}"),
        Arc::new(AtomicBool::new(false)),
        move |_| worker(&me, root, n),
    );
    match task {
        Ok(t) => {
            let mut tasks = inner.tasks.lock();
            // Stand-ins that retired (and workers that died) have ended their body:
            // nothing is left to wait for.
            tasks.retain(Task::alive);
            tasks.push(t);
            Ok(())
        }
        Err(e) => {
            inner.queue.lock().pools[root].threads -= 1;
            Err(e)
        }
    }
}

/// Counts a worker that ends by a panic (the liveness probe reads it).
struct Died<'a>(&'a Inner);

impl Drop for Died<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.died.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn worker(inner: &Inner, root: usize, me: u64) {
    let _died = Died(inner);
    // Held from one fill's bookkeeping into the next one's taking (one acquisition of
    // the queue per fill, not two).
    let mut q = inner.queue.lock();
    loop {
        let (job, blocks, others) = {
            loop {
                let pool = &q.pools[root];
                // Closing, or more workers than a pool may have (a stuck worker came
                // back to a pool that grew meanwhile).
                if q.closed || pool.threads - pool.stuck > max_workers(inner.workers) {
                    q.pools[root].threads -= 1;
                    return;
                }
                // Only fills behind readers are left, and enough workers run them.
                let behind_full = q.heaps[root]
                    .peek()
                    .is_some_and(|j| j.prio == Priority::Behind)
                    && q.pools[root].behind >= behind_workers(inner.workers);
                match if behind_full {
                    None
                } else {
                    q.heaps[root].pop()
                } {
                    Some(job) => {
                        let id = (job.target.key, job.index);
                        // A stale duplicate (raised to demand, or already taken).
                        if q.queued.get(&id).map(|(p, _)| *p) != Some(job.prio) {
                            continue;
                        }
                        q.take(&id);
                        if job.prio == Priority::Behind {
                            q.pools[root].behind += 1;
                        }
                        let mut blocks = vec![(job.index, job.flight.clone())];
                        // Read-ahead and prefetch take the file's next queued blocks
                        // along, to land them as one durable batch — but only blocks no
                        // idle worker would take now: a batch trades one `fdatasync`
                        // per block for reading its blocks one after another, which is
                        // a loss whenever they could be read in parallel (a
                        // latency-bound source: a peer, a network file system). A client
                        // waiting on a block gets that block alone, at once.
                        let pool = &q.pools[root];
                        // Workers waiting for a job, this one aside (`busy` counts the
                        // stuck ones too, as `threads` does).
                        let idle = pool.threads.saturating_sub(pool.busy.len() + 1);
                        let spare = q.queued.len().saturating_sub(idle);
                        if job.prio != Priority::Demand && spare > 0 {
                            let max = batch_blocks(inner.store.block_size()).min(1 + spare);
                            let n = job
                                .target
                                .stat
                                .version
                                .size
                                .div_ceil(u64::from(inner.store.block_size()))
                                as usize;
                            let mut next = job.index + 1;
                            while blocks.len() < max && next < n {
                                let id = (job.target.key, next);
                                // Up to a block some client waits on: it goes alone.
                                match q.queued.get(&id) {
                                    Some((p, _)) if *p != Priority::Demand => {}
                                    _ => break,
                                }
                                if let Some((_, f)) = q.take(&id) {
                                    blocks.push((next, f));
                                }
                                next += 1;
                            }
                        }
                        // Small files (one block each) queued at the same priority
                        // go along, under the same rule, to land as one batch: their
                        // files created and synced together, one journal group.
                        let mut others: Vec<(Arc<Target>, Arc<Flight>)> = Vec::new();
                        if job.prio != Priority::Demand
                            && spare > 0
                            && blocks.len() == 1
                            && one_block(inner, &job.target)
                        {
                            let max = BATCH_FILES.min(1 + spare) - 1;
                            while others.len() < max {
                                let Some(next) = q.heaps[root].peek() else {
                                    break;
                                };
                                if next.prio != job.prio || !one_block(inner, &next.target) {
                                    break;
                                }
                                let next = q.heaps[root].pop().expect("peeked");
                                let id = (next.target.key, next.index);
                                if q.queued.get(&id).map(|(p, _)| *p) != Some(next.prio) {
                                    continue; // stale
                                }
                                // (A worker counts once against the bound on fills
                                // behind readers, however many files it lands.)
                                q.take(&id);
                                others.push((next.target.clone(), next.flight.clone()));
                            }
                        }
                        let mut ids: Vec<((Key, usize), Arc<Flight>)> = blocks
                            .iter()
                            .map(|(i, f)| ((job.target.key, *i), f.clone()))
                            .collect();
                        ids.extend(others.iter().map(|(t, f)| ((t.key, 0), f.clone())));
                        q.pools[root].busy.push(Busy {
                            worker: me,
                            started: Instant::now(),
                            file: file_id(&job.target.stat.path),
                            blocks: ids,
                            stuck: false,
                        });
                        break (job, blocks, others);
                    }
                    None => {
                        // A worker above `fill_workers` (started for waiting readers,
                        // or to stand in for a stuck one) ends once idle for a while.
                        let idle = inner.cvs[root].wait_for(&mut q, IDLE_RETIRE).timed_out();
                        let pool = &mut q.pools[root];
                        if idle && pool.threads - pool.stuck > inner.workers {
                            pool.threads -= 1;
                            return;
                        }
                    }
                }
            }
        };
        let prefetch = job.prio == Priority::Prefetch;
        parking_lot::MutexGuard::unlocked(&mut q, || {
            if !others.is_empty() {
                let mut files = vec![(job.target.clone(), blocks[0].1.clone())];
                files.extend(others.iter().cloned());
                fill_files_and_land(inner, root, &files, prefetch, me);
            } else if let [(index, flight)] = &blocks[..] {
                fill_and_land(inner, &job.target, *index, prefetch, flight);
            } else {
                fill_batch_and_land(inner, &job.target, &blocks, prefetch, me);
            }
        });
        let pool = &mut q.pools[root];
        if let Some(i) = pool.busy.iter().position(|b| b.worker == me)
            && pool.busy.swap_remove(i).stuck
        {
            pool.stuck -= 1;
        }
        if job.prio == Priority::Behind {
            // The next fills behind readers may run (a worker may be waiting for this).
            pool.behind -= 1;
            inner.cvs[root].notify_one();
        }
    }
}

/// Watches the workers: a stuck fill (see the module documentation) releases its
/// waiters (they fall back) and gets a stand-in worker (at most `workers` per root), so
/// that a store that never answers holds no more than its own workers; the queue of a
/// stalled root is emptied (its waiters released) as soon as the root is stalled.
fn watchdog(inner: &Arc<Inner>) {
    let roots = inner.meta.roots();
    let tick = (0..roots.all().len())
        .map(|r| roots.watch(r).stall())
        .filter(|s| !s.is_zero())
        .min()
        .map_or(Duration::from_millis(100), |s| {
            (s / 4).clamp(Duration::from_millis(10), Duration::from_millis(100))
        });
    let mut q = inner.queue.lock();
    loop {
        inner.tick.wait_for(&mut q, tick);
        if q.closed {
            return;
        }
        let now = Instant::now();
        let (mut release, mut spawn) = (Vec::new(), Vec::new());
        let Queue {
            heaps,
            queued,
            behind,
            pools,
            ..
        } = &mut *q;
        for (r, (pool, heap)) in pools.iter_mut().zip(heaps.iter_mut()).enumerate() {
            let watch = roots.watch(r);
            let stall = watch.stall();
            if stall.is_zero() {
                continue;
            }
            // A fill is stuck when a backing call of it is (the watch's judgement: the
            // stall bound, or four times what the root's calls take when the store is
            // slow for everyone), when the root is stalled, or — stuck anywhere else, in
            // the store's own writes say — past four of the watch's bounds. A fill on a
            // congested link, reading its block piece by piece, is slow, not stuck.
            let stalled = watch.stalled();
            let backstop = watch.bound_now() * 4;
            for b in &mut pool.busy {
                let running = now.duration_since(b.started);
                if !b.stuck
                    && running >= stall
                    && (stalled || running >= backstop || watch.file_stuck(b.file))
                {
                    tracing::debug!(
                        root = r,
                        blocks = b.blocks.len(),
                        running_ms = now.duration_since(b.started).as_millis() as u64,
                        bound_ms = stall.as_millis() as u64,
                        "fill stuck: its waiters are released"
                    );
                    b.stuck = true;
                    pool.stuck += 1;
                    for (id, f) in &b.blocks {
                        release.push((*id, f.clone()));
                    }
                }
            }
            while pool.threads - pool.stuck < inner.workers && pool.stuck <= inner.workers {
                pool.threads += 1;
                spawn.push(r);
            }
            if !inner.sources.any_remote(r) && !heap.is_empty() && watch.stalled() {
                for job in heap.drain() {
                    let id = (job.target.key, job.index);
                    if queued.get(&id).map(|(p, _)| *p) == Some(job.prio) {
                        queued.remove(&id);
                        if job.prio == Priority::Behind {
                            *behind -= 1;
                        }
                        release.push((id, job.flight));
                    }
                }
            }
        }
        if release.is_empty() && spawn.is_empty() {
            continue;
        }
        drop(q);
        for (id, f) in release {
            end_flight(inner, id, &f, FillOutcome::Declined(Declined::Stalled));
        }
        for r in spawn {
            if let Err(e) = spawn_worker(inner, r) {
                tracing::warn!(error = %e, "cannot start a fill worker to stand in for a stuck one");
            }
        }
        q = inner.queue.lock();
    }
}

/// Ends flight `f` of block `id` with `outcome` (releasing its waiters), and forgets it
/// if it is still the block's flight (a later request may have started another).
fn end_flight(inner: &Inner, id: (Key, usize), f: &Arc<Flight>, outcome: FillOutcome) {
    {
        let mut flights = inner.flights.lock();
        if flights.get(&id).is_some_and(|g| Arc::ptr_eq(g, f)) {
            flights.remove(&id);
            if flights.is_empty() {
                inner.settled.notify_all();
            }
        }
    }
    f.finish(outcome);
    if f.prefetch.load(Ordering::Acquire) {
        inner.prefetch_wake.notify();
    }
}

/// Most bytes one worker reads before landing them as one durable batch.
const BATCH_BYTES: u64 = 8 << 20;
/// Most blocks in one batch.
const BATCH_BLOCKS: usize = 16;

/// How many blocks of `block_size` one batch takes at most.
fn batch_blocks(block_size: u32) -> usize {
    ((BATCH_BYTES / u64::from(block_size.max(1))) as usize).clamp(1, BATCH_BLOCKS)
}

/// Most small files (one block each) one worker reads before landing them as one batch
/// ([`Store::commit_new_files`]).
const BATCH_FILES: usize = 16;

/// True when `t` is a file of one block (a small file).
fn one_block(inner: &Inner, t: &Target) -> bool {
    t.stat.version.size <= u64::from(inner.store.block_size())
}

/// Lands small files (one block each, of root `root`; `targets` theirs, in order) as one
/// batch ([`Store::commit_new_files`]), counted as a landing of the root: each one's
/// outcome, a failure counted.
fn land_new_files(
    inner: &Inner,
    root: usize,
    blocks: Vec<(crate::store::Permit, &[u8])>,
    targets: &[&Target],
) -> Vec<FillOutcome> {
    let landing = Landing::enter(inner, root, false);
    let landed = inner.store.commit_new_files(blocks);
    drop(landing);
    landed
        .into_iter()
        .zip(targets)
        .map(|(r, t)| match r {
            Ok(()) => {
                inc(&inner.stats.blocks_filled);
                FillOutcome::Landed
            }
            Err(e) => outcome_of(inner, t, 0, &FillError::Store(e)),
        })
        .collect()
}

/// Fills small files (one block each, all of root `root`) one after another and lands
/// them as one batch: their data files created and synced together, their records in
/// one journal group. A reader already waiting on a file gets its bytes as soon as they
/// are read, as [`fill`] hands them; a file whose read fails ends alone, the others land.
fn fill_files_and_land(
    inner: &Inner,
    root: usize,
    files: &[(Arc<Target>, Arc<Flight>)],
    prefetch: bool,
    me: u64,
) {
    let root_name = &inner.meta.roots().get(root).name;
    let mut outcomes: Vec<Option<FillOutcome>> = vec![None; files.len()];
    let mut permits = Vec::new();
    let mut read: Vec<usize> = Vec::new();
    let mut bufs = BUFS.take();
    let mut used: Vec<Vec<u8>> = Vec::new();
    for (pos, (t, flight)) in files.iter().enumerate() {
        if pos > 0 {
            next_file(inner, root, me, file_id(&t.stat.path));
        }
        let permit = match inner.store.begin_fill(root_name, &t.stat, 0, prefetch) {
            Ok(None) => {
                outcomes[pos] = Some(FillOutcome::Landed);
                continue;
            }
            Ok(Some(p)) => p,
            Err(e) => {
                outcomes[pos] = Some(outcome_of(inner, t, 0, &e.into()));
                continue;
            }
        };
        let req = BlockRequest {
            target: t,
            root: root_name,
            index: 0,
            offset: permit.offset(),
            len: permit.len(),
            prefetch,
        };
        let mut buf = bufs.pop().unwrap_or_default();
        match read_from_sources(inner, &req, &mut buf) {
            Ok(_) => {
                // A reader waiting on it takes the bytes now (one that comes later
                // waits for the batch to land).
                if flight.wanted() {
                    flight.read(&buf);
                }
                permits.push(permit);
                used.push(buf);
                read.push(pos);
            }
            Err(e) => {
                inner.store.abort_fill(permit);
                bufs.push(buf);
                outcomes[pos] = Some(outcome_of(inner, t, 0, &e));
            }
        }
    }
    if !read.is_empty() {
        let batch = permits
            .into_iter()
            .zip(used.iter().map(Vec::as_slice))
            .collect();
        let targets: Vec<&Target> = read.iter().map(|&pos| &*files[pos].0).collect();
        for (&pos, o) in read
            .iter()
            .zip(land_new_files(inner, root, batch, &targets))
        {
            outcomes[pos] = Some(o);
        }
    }
    bufs.extend(used);
    BUFS.set(bufs);
    for ((t, flight), o) in files.iter().zip(outcomes) {
        let o = o.expect("every file has an outcome");
        end_flight(inner, (t.key, 0), flight, o);
    }
}

/// [`restart_stall_clock`] for the next file of a batch of small files: the watchdog
/// judges the file being read now.
fn next_file(inner: &Inner, root: usize, me: u64, file: u64) {
    let mut q = inner.queue.lock();
    if let Some(b) = q.pools[root]
        .busy
        .iter_mut()
        .find(|b| b.worker == me && !b.stuck)
    {
        b.started = Instant::now();
        b.file = file;
    }
}

/// What a fill that did not land means for its waiters (a failure is counted).
fn outcome_of(inner: &Inner, t: &Target, index: usize, e: &FillError) -> FillOutcome {
    let outcome = match e {
        FillError::Store(StoreError::NoSpace) => FillOutcome::Declined(Declined::NoSpace),
        FillError::Store(StoreError::Gone) => FillOutcome::Declined(Declined::Moved),
        FillError::Store(StoreError::Io(_)) => FillOutcome::Failed,
        FillError::Source(e) if e.is_stall() => FillOutcome::Declined(Declined::Stalled),
        FillError::Source(_) => FillOutcome::Failed,
    };
    if outcome == FillOutcome::Failed {
        inc(&inner.stats.fill_errors);
    }
    tracing::debug!(path = %t.stat.path, block = index, error = %e, ?outcome, "fill not landed");
    outcome
}

/// Fills one block whose flight `flight` is registered, counts a failure, and ends the
/// flight (releasing its waiters) with the outcome it returns; `None` when the block
/// went to its root's lander, which ends the flight once the block has landed.
fn fill_and_land(
    inner: &Inner,
    target: &Arc<Target>,
    index: usize,
    prefetch: bool,
    flight: &Arc<Flight>,
) -> Option<FillOutcome> {
    let outcome = match fill(inner, target, index, prefetch, Some(flight)) {
        Ok(Filled::Landed) => FillOutcome::Landed,
        // The lander ends the flight.
        Ok(Filled::Deferred) => return None,
        Err(e) => outcome_of(inner, target, index, &e),
    };
    end_flight(inner, (target.key, index), flight, outcome);
    Some(outcome)
}

/// Fills blocks of one file, each with its registered flight, as one durable batch
/// (their bytes, one `fdatasync`, one journal group: [`Store::commit_fills`]), and ends
/// each flight with its outcome. The blocks read before a block that could not be read
/// (or given room) land together; that block ends with its own outcome, and the blocks
/// after it are filled one by one, so that each waiter gets its own block's outcome.
fn fill_batch_and_land(
    inner: &Inner,
    t: &Arc<Target>,
    blocks: &[(usize, Arc<Flight>)],
    prefetch: bool,
    me: u64,
) {
    let root = &inner.meta.roots().get(t.root).name;
    let mut outcomes: Vec<Option<FillOutcome>> = vec![None; blocks.len()];
    let mut permits = Vec::new();
    let mut read: Vec<usize> = Vec::new();
    let mut bufs = BUFS.take();
    let mut used: Vec<Vec<u8>> = Vec::new();
    let mut stopped = blocks.len();
    for (pos, (index, _)) in blocks.iter().enumerate() {
        if pos > 0 {
            restart_stall_clock(inner, t.root, me);
        }
        let permit = match inner.store.begin_fill(root, &t.stat, *index, prefetch) {
            Ok(None) => {
                outcomes[pos] = Some(FillOutcome::Landed);
                continue;
            }
            Ok(Some(p)) => p,
            Err(e) => {
                outcomes[pos] = Some(outcome_of(inner, t, *index, &e.into()));
                stopped = pos + 1;
                break;
            }
        };
        let req = BlockRequest {
            target: t,
            root,
            index: *index,
            offset: permit.offset(),
            len: permit.len(),
            prefetch,
        };
        let mut buf = bufs.pop().unwrap_or_default();
        match read_from_sources(inner, &req, &mut buf) {
            Ok(_) => {
                permits.push(permit);
                used.push(buf);
                read.push(pos);
            }
            Err(e) => {
                inner.store.abort_fill(permit);
                bufs.push(buf);
                outcomes[pos] = Some(outcome_of(inner, t, *index, &e));
                stopped = pos + 1;
                break;
            }
        }
    }
    if !read.is_empty() {
        let batch = permits
            .into_iter()
            .zip(used.iter().map(Vec::as_slice))
            .collect();
        let landing = Landing::enter(inner, t.root, false);
        let landed = inner.store.commit_fills(batch);
        drop(landing);
        match landed {
            Ok(()) => {
                for pos in read {
                    inc(&inner.stats.blocks_filled);
                    outcomes[pos] = Some(FillOutcome::Landed);
                }
            }
            Err(e) => {
                // Each block's waiters see (and each block counts) the batch's failure.
                let e = FillError::Store(e);
                for pos in read {
                    outcomes[pos] = Some(outcome_of(inner, t, blocks[pos].0, &e));
                }
            }
        }
    }
    bufs.extend(used);
    BUFS.set(bufs);
    for (pos, (index, flight)) in blocks.iter().enumerate() {
        match outcomes[pos] {
            Some(o) => end_flight(inner, (t.key, *index), flight, o),
            // After a block that stopped the batch: on its own.
            None if pos >= stopped => {
                restart_stall_clock(inner, t.root, me);
                fill_and_land(inner, t, *index, prefetch, flight);
            }
            None => unreachable!("every block before the stop has an outcome"),
        }
    }
}

/// Restarts the watchdog's clock of worker `me`'s fill on root `root`, as the worker
/// starts the next block of a batch: the stall bound is for one call into the backing
/// store, and a batch makes one per block, one after another (a healthy batch must not
/// look stuck for taking several calls' time).
fn restart_stall_clock(inner: &Inner, root: usize, me: u64) {
    let mut q = inner.queue.lock();
    if let Some(b) = q.pools[root]
        .busy
        .iter_mut()
        .find(|b| b.worker == me && !b.stuck)
    {
        b.started = Instant::now();
    }
}

#[derive(Debug, thiserror::Error)]
enum FillError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Source(#[from] SourceError),
}

thread_local! {
    /// A fill thread's block buffers (one per block of a batch, kept from one fill to
    /// the next).
    static BUFS: std::cell::Cell<Vec<Vec<u8>>> = const { std::cell::Cell::new(Vec::new()) };
}

/// How a fill that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Filled {
    /// The block is in the store.
    Landed,
    /// Handed to its readers and to the root's lander, which ends its flight when the
    /// block has landed ([`Backlog`]).
    Deferred,
}

/// Fills block `index` of `t`: reads it from the first source that has it, hands its
/// bytes to the readers waiting on `flight` (if any waits), and lands it — unless it
/// was handed over and the root lands as many blocks as it may already: then the root's
/// lander lands it behind ([`Filled::Deferred`]) if its backlog has room.
fn fill(
    inner: &Inner,
    t: &Arc<Target>,
    index: usize,
    prefetch: bool,
    flight: Option<&Arc<Flight>>,
) -> Result<Filled, FillError> {
    let root = &inner.meta.roots().get(t.root).name;
    let Some(permit) = inner.store.begin_fill(root, &t.stat, index, prefetch)? else {
        return Ok(Filled::Landed);
    };
    let req = BlockRequest {
        target: t,
        root,
        index,
        offset: permit.offset(),
        len: permit.len(),
        prefetch,
    };
    let mut bufs = BUFS.take();
    let mut buf = bufs.pop().unwrap_or_default();
    let r = match read_from_sources(inner, &req, &mut buf) {
        Ok(xxh3) => 'land: {
            // A file of one block (a small file) is handed to its readers as soon as it
            // is read: its reader is about to wait (or waits), and takes the bytes at
            // once rather than wait for the landing. Blocks of larger files are waited
            // for as they land (their readers read ahead of the fills).
            let small = t.stat.version.size <= u64::from(inner.store.block_size());
            if let Some(f) = flight.filter(|_| small) {
                f.read(&buf);
            }
            let handed = small && flight.is_some_and(|f| f.wanted());
            let (_landing, permit) = match Landing::enter(inner, t.root, handed) {
                Some(l) => (l, permit),
                None => {
                    // Its readers have the bytes: the lander lands them behind, or, with
                    // its backlog full, this worker does (kept either way: dropped, the
                    // file would be read from the backing store again).
                    let flight = flight.expect("handed to a flight's readers").clone();
                    let d = Deferred {
                        target: t.clone(),
                        permit,
                        buf: std::mem::take(&mut buf),
                        flight,
                    };
                    match inner.defer(d) {
                        Ok(()) => break 'land Ok(Filled::Deferred),
                        Err(d) => {
                            inc(&inner.stats.backlog_full);
                            // The lander does not keep up: this worker lands its file
                            // with the oldest waiting there, as one batch (one sync for
                            // all, not two for its file alone).
                            let (waiting, bytes) = inner.take_backlog(t.root, LANDER_BATCH - 1);
                            if !waiting.is_empty() {
                                let mut batch = vec![d];
                                batch.extend(waiting);
                                land_deferred(inner, t.root, batch, bytes);
                                break 'land Ok(Filled::Deferred);
                            }
                            buf = d.buf;
                            let landing = Landing::enter(inner, t.root, false);
                            (landing.expect("entered when not handed"), d.permit)
                        }
                    }
                }
            };
            let r = match xxh3 {
                Some(sum) => inner.store.commit_fill_summed(permit, &buf, sum),
                None => inner.store.commit_fill(permit, &buf),
            };
            if r.is_ok() {
                inc(&inner.stats.blocks_filled);
            }
            r.map(|()| Filled::Landed).map_err(FillError::from)
        }
        Err(e) => {
            inner.store.abort_fill(permit);
            Err(e)
        }
    };
    bufs.push(buf);
    BUFS.set(bufs);
    r
}

/// Reads the block `req` names into `buf`, asking the root's sources in order: the
/// first that has the block supplies it. `Ok(Some(xxh3))`: a peer's block with its
/// checksum, which the sender checked its bytes against.
fn read_from_sources(
    inner: &Inner,
    req: &BlockRequest<'_>,
    buf: &mut Vec<u8>,
) -> Result<Option<u64>, FillError> {
    for source in inner.sources.of(req.target.root) {
        // For a peer, the owner reads the backing store itself.
        if source.remote() && !req.target.peer_ok {
            continue;
        }
        let started = Instant::now();
        match source.fetch(req, buf) {
            Ok(Fetched::Got { xxh3 }) => {
                if !source.remote() {
                    // What the prefetcher paces itself by: the backing store's speed.
                    inner
                        .meter
                        .lock()
                        .add(started.elapsed().as_secs_f64(), buf.len() as f64);
                }
                return Ok(xxh3);
            }
            Ok(Fetched::Miss) => {}
            // The cluster placement moved the file on (or dropped it) since this
            // prefetch started: reading the backing store for it would be a read the
            // cluster does not need.
            Ok(Fetched::Declined) => return Err(FillError::Store(StoreError::Gone)),
            Err(e) => return Err(e.into()),
        }
    }
    // No source had it (none is configured to always answer: a misconfiguration).
    Err(FillError::Store(StoreError::Gone))
}

impl BlockProvider for Filler {
    fn block_size(&self) -> u32 {
        self.inner.store.block_size()
    }

    fn read(&self, key: &Key, index: usize, buf: &mut Vec<u8>) -> Option<u64> {
        self.inner.store.read_block_into(key, index, buf)
    }

    fn fill(&self, target: &Arc<Target>, index: usize, deadline: Instant) -> bool {
        self.fill_here(target, index, deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::Owner;
    use crate::backing::fault::{Faults, FaultyBacking};
    use crate::backing::mem::MemBacking;
    use crate::blocks::conformance::{self, ProviderFixture};
    use crate::blocks::fault::FaultySource;
    use crate::blocks::mem::MemSource;
    use crate::blocks::{BlockSource, Sources};
    use crate::meta::test_support::one_root;
    use crate::meta::{Root, Roots};
    use crate::store::evict::Lru;
    use crate::store::io::failing::{FailingIo, Fault, IoFaults};
    use crate::store::io::psync::Psync;
    use crate::store::test_config;

    const BS: u32 = 4096;

    struct Rig {
        _dir: tempfile::TempDir,
        mem: Arc<MemBacking>,
        faults: Arc<Faults>,
        meta: Arc<Meta>,
        store: Arc<Store>,
        stats: Arc<Stats>,
        /// The store's I/O, observed and failed on demand.
        io: Arc<IoFaults>,
        filler: Filler,
    }

    fn rig() -> Rig {
        rig_with(None)
    }

    /// A rig whose fills ask `first` (a stand-in for the peers) before the backing store.
    fn rig_with(first: Option<Arc<dyn BlockSource>>) -> Rig {
        rig_full(first, 4)
    }

    /// A rig with `workers` fill workers whose fills ask `first`, if given, before the
    /// backing store; the store writes through a [`FailingIo`] over psync.
    fn rig_full(first: Option<Arc<dyn BlockSource>>, workers: usize) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemBacking::new());
        let (faulty, faults) = FaultyBacking::new(mem.clone());
        let (meta, stats) = one_root(Arc::new(faulty));
        let cfg = test_config(dir.path(), 1 << 30, BS);
        let io = Arc::new(IoFaults::default());
        let engine_faults = io.clone();
        let store = Arc::new(
            Store::open_with(&cfg, stats.clone(), Box::new(Lru::default()), &|d| {
                Ok(Arc::new(FailingIo::with(
                    Arc::new(Psync::new(d)),
                    engine_faults.clone(),
                )))
            })
            .unwrap(),
        );
        let mut sources = Sources::backing(&meta, &stats);
        if let Some(first) = first {
            sources = sources.ask_first(first);
        }
        let filler = Filler::new(
            store.clone(),
            meta.clone(),
            stats.clone(),
            sources,
            workers,
            64,
            Arc::new(Wake::default()),
        )
        .unwrap();
        Rig {
            _dir: dir,
            mem,
            faults,
            meta,
            store,
            stats,
            io,
            filler,
        }
    }

    impl Rig {
        fn put(&self, path: &str, len: usize) {
            let data = (0..len).map(|i| (i % 251) as u8).collect();
            self.mem.put(
                path,
                data,
                Owner {
                    mode: 0o644,
                    ..Owner::default()
                },
            );
        }

        fn target(&self, path: &str) -> Arc<Target> {
            let stat = self.meta.stat(0, path).unwrap();
            let view = self.store.view("/r", &stat).unwrap();
            Arc::new(Target {
                peer_ok: true,
                root: 0,
                rel: path.to_owned(),
                stat,
                key: view.key,
            })
        }

        fn wait(&self, t: &Arc<Target>, i: usize) -> Option<bool> {
            match self.filler.request(t, i, Priority::Demand) {
                Scheduled::Present => Some(true),
                Scheduled::InFlight(f) => f
                    .wait_until(Instant::now() + Duration::from_secs(20))
                    .map(FillOutcome::landed),
                Scheduled::Shed => None,
            }
        }
    }

    /// Requests `paths` (one block each) at demand priority, marks each flight as one a
    /// reader waits on, and returns the flights, once all their reads hang in the
    /// backing store (which the caller then releases).
    fn demand_while_hung(r: &Rig, paths: &[&str]) -> Vec<Arc<Flight>> {
        let targets: Vec<_> = paths.iter().map(|p| r.target(p)).collect();
        r.faults.hang();
        let flights: Vec<_> = targets
            .iter()
            .map(|t| match r.filler.request(t, 0, Priority::Demand) {
                Scheduled::InFlight(f) => f,
                s => panic!("not in flight: {s:?}"),
            })
            .collect();
        for f in &flights {
            assert!(f.wait_ready_until(Instant::now()).is_none());
        }
        until(Duration::from_secs(10), "every read under way", || {
            r.faults.hung.load(Ordering::Relaxed) == paths.len() as u64
        });
        flights
    }

    /// A batch of requests is answered as the same requests one by one would be, in
    /// order: a block present, one asked twice (one flight), read-ahead raised to demand
    /// by a later ask in the batch, a worker for each reader's block; with the engine's
    /// locks taken once for the batch.
    #[test]
    fn a_batch_of_requests_is_answered_as_each_alone_with_one_locking() {
        let r = rig_full(None, 1);
        for p in ["a", "b", "c", "d"] {
            r.put(p, 100);
        }
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|p| r.target(p));
        assert_eq!(r.wait(&b, 0), Some(true));
        assert!(r.filler.settle(Instant::now() + Duration::from_secs(10)));
        r.faults.hang();
        let before = r.filler.lockings();
        let answers = r.filler.request_many(&[
            (&a, 0, Priority::Demand),
            (&b, 0, Priority::Demand),
            (&a, 0, Priority::Demand),
            (&c, 0, Priority::Readahead),
            (&c, 0, Priority::Demand),
            (&d, 0, Priority::Prefetch),
        ]);
        assert_eq!(r.filler.lockings(), before + 1, "one taking for the batch");
        let flight = |s: &Scheduled| match s {
            Scheduled::InFlight(f) => f.clone(),
            s => panic!("not in flight: {s:?}"),
        };
        assert!(matches!(answers[1], Scheduled::Present));
        assert!(Arc::ptr_eq(&flight(&answers[0]), &flight(&answers[2])));
        assert!(Arc::ptr_eq(&flight(&answers[3]), &flight(&answers[4])));
        assert!(flight(&answers[5]).prefetch.load(Ordering::Acquire));
        until(
            Duration::from_secs(10),
            "a worker on each reader's block",
            || r.faults.hung.load(Ordering::Relaxed) >= 2,
        );
        {
            let q = r.filler.inner.queue.lock();
            // Two readers' blocks: a second worker was started for the second.
            assert!(q.pools[0].threads >= 2, "{}", q.pools[0].threads);
            let running: Vec<Key> = q.pools[0]
                .busy
                .iter()
                .flat_map(|b| b.blocks.iter().map(|((k, _), _)| *k))
                .collect();
            assert!(running.contains(&c.key), "c raised to demand and taken");
        }
        r.faults.release();
        let deadline = Instant::now() + Duration::from_secs(20);
        for i in [0, 3, 5] {
            assert_eq!(
                flight(&answers[i]).wait_until(deadline),
                Some(FillOutcome::Landed)
            );
        }
        assert!(r.filler.settle(deadline));
    }

    #[test]
    fn readers_waiting_get_workers_of_their_own() {
        // One worker configured; four readers each wait on a file: four reads at once.
        let r = rig_full(None, 1);
        let paths = ["a", "b", "c", "d"];
        for p in paths {
            r.put(p, 100);
        }
        let flights = demand_while_hung(&r, &paths);
        r.faults.release();
        let deadline = Instant::now() + Duration::from_secs(10);
        for f in &flights {
            assert!(matches!(
                f.wait_ready_until(deadline),
                Some(Ready::Bytes(_))
            ));
        }
        assert!(r.filler.settle(deadline));
    }

    /// Fills behind readers (who read the backing store themselves) run on a quarter
    /// of the workers at most, and a reader's fill still finds a worker at once.
    #[test]
    fn fills_behind_readers_take_a_quarter_of_the_workers_and_yield_to_a_reader() {
        let r = rig_full(None, 8);
        let behind: Vec<String> = (0..6).map(|i| format!("b{i}")).collect();
        for p in &behind {
            r.put(p, 100);
        }
        r.put("d", 100);
        let targets: Vec<_> = behind.iter().map(|p| r.target(p)).collect();
        let demand = r.target("d");
        r.faults.hang();
        let flights: Vec<_> = targets
            .iter()
            .map(|t| match r.filler.request(t, 0, Priority::Behind) {
                Scheduled::InFlight(f) => f,
                s => panic!("not in flight: {s:?}"),
            })
            .collect();
        until(
            Duration::from_secs(10),
            "two behind fills under way",
            || r.faults.hung.load(Ordering::Relaxed) >= 2,
        );
        let Scheduled::InFlight(d) = r.filler.request(&demand, 0, Priority::Demand) else {
            panic!("a reader's fill is scheduled");
        };
        until(
            Duration::from_secs(10),
            "the reader's fill under way",
            || r.faults.hung.load(Ordering::Relaxed) >= 3,
        );
        assert_eq!(
            r.faults.hung.load(Ordering::Relaxed),
            3,
            "two behind, one for the reader: the other five workers idle"
        );
        {
            // (The other four are queued, or some were taken along by a worker that
            // found them queued, as a batch of small files: the count depends on timing.)
            let q = r.filler.inner.queue.lock();
            assert_eq!(q.pools[0].behind, 2, "two workers on fills behind readers");
            let along: usize = q.pools[0].busy.iter().map(|b| b.blocks.len()).sum();
            assert_eq!(q.behind + along, 4 + 3, "the rest queued or taken along");
        }
        r.faults.release();
        let deadline = Instant::now() + Duration::from_secs(20);
        assert_eq!(d.wait_until(deadline), Some(FillOutcome::Landed));
        for f in &flights {
            assert_eq!(f.wait_until(deadline), Some(FillOutcome::Landed));
        }
        assert!(r.filler.settle(deadline));
        assert_eq!(r.filler.inner.queue.lock().behind, 0);
        assert!(behind.iter().all(|p| r.store.is_cached("/r", p)));
    }

    /// A cold pass that outruns the fills behind it leaves them queued, not dropped:
    /// past `fill_queue` (64 here) they have a bound of their own, which read-ahead does
    /// not share; a reader who later waits on one raises it.
    #[test]
    fn fills_behind_readers_queue_past_fill_queue_and_are_raised_by_a_reader() {
        let r = rig_full(None, 2);
        let paths: Vec<String> = (0..200).map(|i| format!("f{i}")).collect();
        for p in &paths {
            r.put(p, 100);
        }
        r.put("ra", 2 * BS as usize);
        let targets: Vec<_> = paths.iter().map(|p| r.target(p)).collect();
        let ra = r.target("ra");
        r.faults.hang();
        let flights: Vec<_> = targets
            .iter()
            .map(|t| match r.filler.request(t, 0, Priority::Behind) {
                Scheduled::InFlight(f) => f,
                s => panic!("queued, not {s:?}"),
            })
            .collect();
        assert!(matches!(
            r.filler.request(&ra, 1, Priority::Readahead),
            Scheduled::InFlight(_)
        ));
        // The last one queued: a reader now waits on it.
        let last = targets.last().unwrap();
        let Scheduled::InFlight(raised) = r.filler.request(last, 0, Priority::Demand) else {
            panic!("in flight");
        };
        assert!(Arc::ptr_eq(&raised, flights.last().unwrap()), "one flight");
        assert_eq!(r.stats.snapshot().queue_shed, 0);
        r.faults.release();
        let deadline = Instant::now() + Duration::from_secs(30);
        for f in &flights {
            assert_eq!(f.wait_until(deadline), Some(FillOutcome::Landed));
        }
        assert!(r.filler.settle(deadline));
        assert!(paths.iter().all(|p| r.store.is_cached("/r", p)));
        assert_eq!(r.filler.inner.queue.lock().behind, 0);
    }

    /// Small files queued while the worker is busy land as one batch: one durable
    /// write (files created and synced together) and one journal group for all.
    #[test]
    fn small_files_queued_behind_a_busy_worker_land_as_one_batch() {
        let r = rig_full(None, 1);
        let paths: Vec<String> = (0..9).map(|i| format!("s{i}")).collect();
        for p in &paths {
            r.put(p, 100 + p.len());
        }
        let targets: Vec<_> = paths.iter().map(|p| r.target(p)).collect();
        let request = |t: &Arc<Target>| match r.filler.request(t, 0, Priority::Prefetch) {
            Scheduled::InFlight(f) => f,
            s => panic!("not in flight: {s:?}"),
        };
        r.faults.hang();
        // The first is taken alone (nothing else queued), and hangs in its read.
        let mut flights = vec![request(&targets[0])];
        until(Duration::from_secs(10), "the first read under way", || {
            r.faults.hung.load(Ordering::Relaxed) == 1
        });
        flights.extend(targets[1..].iter().map(request));
        let before = r.io.durable_writes.load(Ordering::Relaxed);
        r.faults.release();
        let deadline = Instant::now() + Duration::from_secs(20);
        for f in &flights {
            assert_eq!(f.wait_until(deadline), Some(FillOutcome::Landed));
        }
        assert!(r.filler.settle(deadline));
        assert!(paths.iter().all(|p| r.store.is_cached("/r", p)));
        assert_eq!(
            r.io.durable_writes.load(Ordering::Relaxed) - before,
            2,
            "the first alone, the other eight as one batch"
        );
    }

    #[test]
    fn a_waiting_reader_gets_the_bytes_before_they_land() {
        let r = rig_full(None, 2);
        r.put("a", 3000);
        let t = r.target("a");
        r.io.hold();
        let Scheduled::InFlight(f) = r.filler.request(&t, 0, Priority::Demand) else {
            panic!("not in flight");
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let Some(Ready::Bytes(b)) = f.wait_ready_until(deadline) else {
            panic!("no bytes handed over");
        };
        let want: Vec<u8> = (0..3000).map(|i| (i % 251) as u8).collect();
        assert_eq!(&b[..], &want[..]);
        // Handed over, not landed: no one else sees the block yet.
        until(Duration::from_secs(10), "the landing under way", || {
            r.io.writes.held.load(Ordering::Relaxed) == 1
        });
        assert!(!r.store.is_present(&t.key, 0));
        assert_eq!(f.outcome(), None);
        r.io.release();
        assert_eq!(f.wait_until(deadline), Some(FillOutcome::Landed));
        assert!(r.store.is_present(&t.key, 0));
        assert!(r.filler.settle(deadline));
    }

    /// Small files `paths` read for readers waiting on them while the store's writes are
    /// held: returns their flights, once every reader has its bytes, and a deadline 10 s
    /// on (the caller releases `r.io`).
    fn handed_while_landings_hold(r: &Rig, paths: &[&str]) -> (Vec<Arc<Flight>>, Instant) {
        for p in paths {
            r.put(p, 1000);
        }
        let flights = demand_while_hung(r, paths);
        r.io.hold();
        r.faults.release();
        let deadline = Instant::now() + Duration::from_secs(10);
        for f in &flights {
            assert!(matches!(
                f.wait_ready_until(deadline),
                Some(Ready::Bytes(_))
            ));
        }
        (flights, deadline)
    }

    /// A small file read for its readers while the store lands all it may goes to the
    /// root's lander, which lands it behind them: kept, not dropped (under
    /// docs/PYTHON.md's example each node dropped about 12 700 cold files this way, and
    /// later epochs read them from the backing store again). Its flight lasts until it
    /// has landed; a reader meanwhile takes the bytes from it.
    #[test]
    fn a_handed_block_lands_behind_its_readers_while_the_store_lands_all_it_may() {
        // One worker: the store lands at most two blocks at once.
        let r = rig_full(None, 1);
        let paths = ["a", "b", "c"];
        let (flights, deadline) = handed_while_landings_hold(&r, &paths);
        // Two landings by their workers and the lander's batch, all held in the store's
        // writes; none dropped, no flight ended.
        until(Duration::from_secs(10), "three landings under way", || {
            r.io.writes.held.load(Ordering::Relaxed) == 3
        });
        assert_eq!(r.stats.backlog_full.load(Ordering::Relaxed), 0);
        assert!(flights.iter().all(|f| f.outcome().is_none()));
        // A reader opening the files meanwhile joins their flights and takes the bytes;
        // none is visible in the store before it is durable.
        for (p, f) in paths.iter().zip(&flights) {
            let t = r.target(p);
            let Scheduled::InFlight(g) = r.filler.request(&t, 0, Priority::Demand) else {
                panic!("{p} is still in flight");
            };
            assert!(Arc::ptr_eq(f, &g));
            assert!(matches!(
                g.wait_ready_until(deadline),
                Some(Ready::Bytes(_))
            ));
            assert!(!r.store.is_present(&t.key, 0));
        }
        r.io.release();
        for f in &flights {
            assert_eq!(f.wait_until(deadline), Some(FillOutcome::Landed));
        }
        assert!(r.filler.settle(deadline));
        assert!(
            paths
                .iter()
                .all(|p| r.store.is_present(&r.target(p).key, 0))
        );
        assert_eq!(r.stats.blocks_filled.load(Ordering::Relaxed), 3);
        assert_eq!(r.filler.inner.backlogs[0].q.lock().bytes, 0);
    }

    /// A worker that finds the backlog full lands its file with the files waiting
    /// there, as one batch (one sync for all, where alone its file cost two and the
    /// waiting ones were left to a lander that did not keep up): they are read for
    /// their readers one after another, two landed by their workers and one by the
    /// lander, all held in the store's writes; the fourth waits in the backlog, which
    /// has room for two; the fifth finds it full.
    #[test]
    fn a_worker_past_a_full_backlog_lands_its_file_with_those_waiting_there() {
        let r = rig_full(None, 1);
        r.filler.set_backlog_bytes(2000);
        let paths = ["a", "b", "c", "d", "e"];
        for p in paths {
            r.put(p, 1000);
        }
        r.io.hold();
        let deadline = Instant::now() + Duration::from_secs(10);
        let waiting = || r.filler.inner.backlogs[0].q.lock().files.len();
        let held = || r.io.writes.held.load(Ordering::Relaxed);
        let targets: Vec<_> = paths.iter().map(|p| r.target(p)).collect();
        let mut flights = Vec::new();
        for (n, (p, t)) in paths.iter().zip(&targets).enumerate() {
            // Its reader waits before the read ends: the bytes are handed over.
            r.faults.hang();
            let before = r.faults.hung.load(Ordering::Relaxed);
            let Scheduled::InFlight(f) = r.filler.request(t, 0, Priority::Demand) else {
                panic!("{p} not in flight");
            };
            f.want();
            until(Duration::from_secs(10), "the read under way", || {
                r.faults.hung.load(Ordering::Relaxed) > before
            });
            r.faults.release();
            assert!(matches!(
                f.wait_ready_until(deadline),
                Some(Ready::Bytes(_))
            ));
            let (landing, in_backlog) = [(1, 0), (2, 0), (3, 0), (3, 1), (4, 0)][n];
            until(Duration::from_secs(10), "landing or waiting", || {
                held() == landing && waiting() == in_backlog
            });
            flights.push(f);
        }
        assert_eq!(r.stats.backlog_full.load(Ordering::Relaxed), 1);
        // "d" left the backlog with "e"'s worker; its room is given back once it lands.
        assert_eq!(r.filler.inner.backlogs[0].q.lock().bytes, 2000);
        assert!(flights.iter().all(|f| f.outcome().is_none()));
        r.io.release();
        for f in &flights {
            assert_eq!(f.wait_until(deadline), Some(FillOutcome::Landed));
        }
        assert!(r.filler.settle(deadline));
        assert!(targets.iter().all(|t| r.store.is_present(&t.key, 0)));
        assert_eq!(r.stats.blocks_filled.load(Ordering::Relaxed), 5);
        assert_eq!(r.filler.inner.backlogs[0].q.lock().bytes, 0);
    }

    /// With the backlog full too, a small file read for its readers is still kept: its
    /// worker lands it (before, it was dropped, and a later epoch read it from the
    /// backing store again: 8 000-10 000 files per node under docs/PYTHON.md's example).
    #[test]
    fn a_handed_block_is_landed_by_its_worker_when_the_store_lands_all_it_may_and_the_backlog_is_full()
     {
        // One worker: the store lands at most two blocks at once; no backlog.
        let r = rig_full(None, 1);
        r.filler.set_backlog_bytes(0);
        let paths = ["a", "b", "c"];
        let (flights, deadline) = handed_while_landings_hold(&r, &paths);
        // All three wait in the store's writes: two within the bound, the third landed
        // by its worker past it; none dropped, no flight ended.
        until(
            Duration::from_secs(10),
            "three landings under way, one past the bound",
            || {
                r.io.writes.held.load(Ordering::Relaxed) == 3
                    && r.stats.backlog_full.load(Ordering::Relaxed) == 1
            },
        );
        assert!(flights.iter().all(|f| f.outcome().is_none()));
        // Their readers take the bytes meanwhile; none is visible before it is durable.
        for (p, f) in paths.iter().zip(&flights) {
            assert!(matches!(
                f.wait_ready_until(deadline),
                Some(Ready::Bytes(_))
            ));
            assert!(!r.store.is_present(&r.target(p).key, 0));
        }
        r.io.release();
        for f in &flights {
            assert_eq!(f.wait_until(deadline), Some(FillOutcome::Landed));
        }
        assert!(r.filler.settle(deadline));
        assert!(
            paths
                .iter()
                .all(|p| r.store.is_present(&r.target(p).key, 0))
        );
        assert_eq!(r.stats.blocks_filled.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn concurrent_requests_for_a_block_cause_one_backing_read() {
        let r = Arc::new(rig());
        r.put("f", 4 * BS as usize);
        let t = r.target("f");
        let threads: Vec<_> = (0..16)
            .map(|_| {
                let (r, t) = (r.clone(), t.clone());
                std::thread::spawn(move || (0..4).all(|i| r.wait(&t, i) == Some(true)))
            })
            .collect();
        for th in threads {
            assert!(th.join().unwrap());
        }
        assert_eq!(
            r.faults.reads.load(Ordering::Relaxed),
            4,
            "one read per block"
        );
        assert!((0..4).all(|i| r.store.is_present(&t.key, i)));
        r.filler.close();
    }

    #[test]
    fn a_failing_backing_store_leaves_nothing_behind_and_recovers() {
        let r = rig();
        r.put("f", 2 * BS as usize);
        let t = r.target("f");
        r.faults.fail_reads.store(true, Ordering::Relaxed);
        assert_eq!(r.wait(&t, 0), Some(false));
        assert!(!r.store.is_present(&t.key, 0));
        assert_eq!(r.store.status().used, 0, "the reservation was returned");
        assert_eq!(r.stats.fill_errors.load(Ordering::Relaxed), 1);
        r.faults.fail_reads.store(false, Ordering::Relaxed);
        assert_eq!(r.wait(&t, 0), Some(true), "a later request succeeds");
        r.filler.close();
    }

    #[test]
    fn a_file_changed_underneath_is_not_cached_under_the_old_version() {
        let r = rig();
        r.put("f", BS as usize);
        let t = r.target("f");
        r.put("f", BS as usize); // a new version (new inode), same size
        assert_eq!(r.wait(&t, 0), Some(false));
        assert!(!r.store.is_present(&t.key, 0));
        assert_ne!(
            r.meta.stat(0, "f").unwrap().version,
            t.stat.version,
            "metadata was invalidated"
        );
        r.filler.close();
    }

    #[test]
    fn close_releases_waiters() {
        let r = rig();
        r.put("f", BS as usize);
        let t = r.target("f");
        r.faults.fail_reads.store(true, Ordering::Relaxed);
        r.filler.close();
        assert!(
            matches!(r.filler.request(&t, 0, Priority::Demand), Scheduled::Shed),
            "closed: nothing scheduled"
        );
    }

    /// Fills `path`'s `blocks` blocks at prefetch priority queued behind one fill that
    /// hangs in the backing store (the one worker is busy: they are all queued when it
    /// comes back), and returns their outcomes.
    fn queued_behind_a_hung_fill(r: &Rig, path: &str, blocks: usize) -> Vec<FillOutcome> {
        r.put("first", BS as usize);
        r.put(path, blocks * BS as usize);
        let (first, t) = (r.target("first"), r.target(path));
        r.faults.hang();
        let Scheduled::InFlight(f0) = r.filler.request(&first, 0, Priority::Prefetch) else {
            panic!("queued")
        };
        until(
            Duration::from_secs(10),
            "the worker hangs in a read",
            || r.faults.hung.load(Ordering::Relaxed) >= 1,
        );
        let flights: Vec<Arc<Flight>> = (0..blocks)
            .map(|i| match r.filler.request(&t, i, Priority::Prefetch) {
                Scheduled::InFlight(f) => f,
                other => panic!("block {i}: {other:?}"),
            })
            .collect();
        r.faults.release();
        let deadline = Instant::now() + Duration::from_secs(20);
        f0.wait_until(deadline).expect("the first fill ended");
        flights
            .iter()
            .map(|f| f.wait_until(deadline).expect("a batch fill ended"))
            .collect()
    }

    /// Blocks of one file queued together land as one durable batch: one `fdatasync`
    /// (one `write_durable`) for them all, each waiter released with its block present.
    #[test]
    fn blocks_of_one_file_queued_together_land_as_one_durable_batch() {
        let r = rig_full(None, 1);
        let outcomes = queued_behind_a_hung_fill(&r, "f", 8);
        assert_eq!(outcomes, vec![FillOutcome::Landed; 8]);
        let t = r.target("f");
        assert!((0..8).all(|i| r.store.is_present(&t.key, i)));
        assert_eq!(
            r.io.durable_writes.load(Ordering::Relaxed),
            2,
            "one for the first file, one for the batch of 8"
        );
        assert_eq!(r.stats.blocks_filled.load(Ordering::Relaxed), 9);
        // What landed reads back right.
        let mut buf = Vec::new();
        for i in 0..8 {
            r.store.read_block_into(&t.key, i, &mut buf).unwrap();
            let want: Vec<u8> = (i * BS as usize..(i + 1) * BS as usize)
                .map(|x| (x % 251) as u8)
                .collect();
            assert_eq!(buf, want, "block {i}");
        }
        r.filler.close();
    }

    /// A batch whose `fdatasync` fails lands none of its blocks: every waiter gets a
    /// failure, nothing is visible or reserved, each failure is counted; the next fill
    /// of the file lands.
    #[test]
    fn a_batch_whose_sync_fails_lands_nothing_and_fails_every_waiter() {
        let r = rig_full(None, 1);
        r.io.arm(Fault::SyncEio); // the first file's fill
        r.io.arm(Fault::SyncEio); // the batch
        let outcomes = queued_behind_a_hung_fill(&r, "f", 4);
        assert_eq!(outcomes, vec![FillOutcome::Failed; 4]);
        let t = r.target("f");
        assert!((0..4).all(|i| !r.store.is_present(&t.key, i)));
        assert_eq!(r.store.status().used, 0, "every reservation was returned");
        assert_eq!(r.stats.fill_errors.load(Ordering::Relaxed), 5);
        assert_eq!(r.wait(&t, 0), Some(true), "a later fill lands");
        r.filler.close();
    }

    /// A batch whose backing reads fail: every block ends failed (the first in the
    /// batch, the rest one by one), nothing is left reserved.
    #[test]
    fn a_batch_whose_reads_fail_fails_each_block_and_leaves_nothing() {
        let r = rig_full(None, 1);
        r.faults.fail_reads.store(true, Ordering::Relaxed);
        let outcomes = queued_behind_a_hung_fill(&r, "f", 4);
        assert_eq!(outcomes, vec![FillOutcome::Failed; 4]);
        assert_eq!(r.store.status().used, 0);
        assert_eq!(r.io.durable_writes.load(Ordering::Relaxed), 0);
        r.filler.close();
    }

    /// A fill engine of `workers` over one root `/r` holding file `f` of `blocks` blocks
    /// of 256 KiB, read through a throttle of `rate` bytes per second (after a 1 MiB
    /// burst) and watched with the stall bound `stall`; the target of `f`.
    fn throttled(
        dir: &std::path::Path,
        blocks: usize,
        rate: u64,
        stall: Duration,
        workers: usize,
    ) -> (Filler, Arc<Target>) {
        use crate::backing::throttle::ThrottledBacking;
        const BLOCK: u32 = 256 << 10;
        let mem = Arc::new(MemBacking::new());
        mem.put(
            "f",
            vec![3; blocks * BLOCK as usize],
            Owner {
                mode: 0o644,
                ..Owner::default()
            },
        );
        let roots = Arc::new(Roots::watched(
            vec![Root {
                path: "/r".into(),
                name: "/r".into(),
                backing: Arc::new(ThrottledBacking::new(mem, rate)),
            }],
            stall,
        ));
        let (meta, store, filler) = engine_over(roots, dir, BLOCK, workers);
        let stat = meta.stat(0, "f").unwrap();
        let key = store.view("/r", &stat).unwrap().key;
        let t = Arc::new(Target {
            peer_ok: true,
            root: 0,
            rel: "f".into(),
            stat,
            key,
        });
        (filler, t)
    }

    /// Requests read-ahead fills of `blocks` of `t` and waits for them all: the first
    /// outcome each flight ends with (a release by the watchdog ends it early, before the
    /// block lands).
    fn fill_all(
        filler: &Filler,
        t: &Arc<Target>,
        blocks: std::ops::Range<usize>,
    ) -> Vec<FillOutcome> {
        let flights: Vec<Arc<Flight>> = blocks
            .map(|i| match filler.request(t, i, Priority::Readahead) {
                Scheduled::InFlight(f) => f,
                other => panic!("block {i}: {other:?}"),
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        std::thread::scope(|s| {
            let waits: Vec<_> = flights
                .iter()
                .map(|f| s.spawn(move || f.wait_until(deadline).expect("ended")))
                .collect();
            waits.into_iter().map(|w| w.join().unwrap()).collect()
        })
    }

    /// A batch makes one backing call per block, one after another: the watchdog's
    /// stall bound is for one call, so a healthy batch that takes longer than the bound
    /// in all is not taken for a stuck fill (its waiters are not released).
    #[test]
    fn a_batch_longer_than_the_stall_bound_in_all_is_not_stuck() {
        let dir = tempfile::tempdir().unwrap();
        // 1 MiB/s after a 1 MiB burst: a 256 KiB block every 250 ms, four times within
        // the 1 s bound; the batch as a whole takes about 2 s.
        let (filler, t) = throttled(dir.path(), 12, 1 << 20, Duration::from_secs(1), 1);
        assert_eq!(fill_all(&filler, &t, 0..12), vec![FillOutcome::Landed; 12]);
        filler.close();
    }

    #[test]
    fn fills_on_a_store_slow_for_everyone_are_not_released_as_stuck() {
        let dir = tempfile::tempdir().unwrap();
        // 2 MiB/s after a 1 MiB burst: one reader gets a block in 125 ms, two at once in
        // about 250 ms each — longer than the 200 ms stall bound, well under four times
        // what the root's calls take.
        let (filler, t) = throttled(dir.path(), 16, 2 << 20, Duration::from_millis(200), 2);
        // The burst, then blocks one at a time: the root's calls take about 125 ms.
        for i in 0..6 {
            assert_eq!(
                fill_all(&filler, &t, i..i + 1),
                [FillOutcome::Landed],
                "block {i}"
            );
        }
        // Now two at a time, each past the stall bound: slow, not stuck.
        assert_eq!(fill_all(&filler, &t, 6..16), vec![FillOutcome::Landed; 10]);
        filler.close();
    }

    /// Waits (bounded) until `cond` holds.
    /// A fill engine of `workers` per root over `roots` (the backing store its only
    /// source), with a store of `block` blocks in `dir`.
    fn engine_over(
        roots: Arc<Roots>,
        dir: &std::path::Path,
        block: u32,
        workers: usize,
    ) -> (Arc<Meta>, Arc<Store>, Filler) {
        let stats = Arc::new(Stats::default());
        let meta = Arc::new(Meta::new(
            roots,
            Duration::from_secs(3600),
            1000,
            stats.clone(),
        ));
        let store =
            Arc::new(Store::open(&test_config(dir, 1 << 30, block), stats.clone()).unwrap());
        let filler = Filler::new(
            store.clone(),
            meta.clone(),
            stats.clone(),
            Sources::backing(&meta, &stats),
            workers,
            64,
            Arc::new(Wake::default()),
        )
        .unwrap();
        (meta, store, filler)
    }

    fn until(limit: Duration, what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + limit;
        while !cond() {
            assert!(Instant::now() < deadline, "{what}: not after {limit:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Two roots, one of which hangs every call (as a hung FUSE or NFS mount does).
    struct TwoRoots {
        _dir: tempfile::TempDir,
        faults: Arc<Faults>,
        meta: Arc<Meta>,
        store: Arc<Store>,
        filler: Filler,
    }

    const STALL: Duration = Duration::from_millis(300);

    fn two_roots() -> TwoRoots {
        let dir = tempfile::tempdir().unwrap();
        let good = Arc::new(MemBacking::new());
        let bad = Arc::new(MemBacking::new());
        let owner = Owner {
            mode: 0o644,
            ..Owner::default()
        };
        for i in 0..8 {
            good.put(&format!("g{i}"), vec![1; 4 * BS as usize], owner);
            bad.put(&format!("h{i}"), vec![2; 8 * BS as usize], owner);
        }
        let (faulty, faults) = FaultyBacking::new(bad);
        let roots = Arc::new(Roots::watched(
            vec![
                Root {
                    path: "/g".into(),
                    name: "/g".into(),
                    backing: good,
                },
                Root {
                    path: "/h".into(),
                    name: "/h".into(),
                    backing: Arc::new(faulty),
                },
            ],
            STALL,
        ));
        let (meta, store, filler) = engine_over(roots, dir.path(), BS, 4);
        TwoRoots {
            _dir: dir,
            faults,
            meta,
            store,
            filler,
        }
    }

    impl TwoRoots {
        fn target(&self, root: usize, path: &str) -> Arc<Target> {
            let stat = self.meta.stat(root, path).unwrap();
            let name = &self.meta.roots().get(root).name;
            let view = self.store.view(name, &stat).unwrap();
            Arc::new(Target {
                peer_ok: true,
                root,
                rel: path.to_owned(),
                stat,
                key: view.key,
            })
        }
    }

    #[test]
    fn a_failing_backing_read_is_a_counted_failure_and_the_next_fill_lands() {
        let r = rig();
        r.put("f", 2 * BS as usize);
        let t = r.target("f");
        r.faults.fail_reads.store(true, Ordering::SeqCst);
        let got = match r.filler.request(&t, 0, Priority::Demand) {
            Scheduled::InFlight(f) => f.wait_until(Instant::now() + Duration::from_secs(20)),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            got,
            Some(FillOutcome::Failed),
            "a backing error is a failure"
        );
        assert_eq!(
            r.stats.fill_errors.load(Ordering::Relaxed),
            1,
            "and counted"
        );
        r.faults.fail_reads.store(false, Ordering::SeqCst);
        let got = match r.filler.request(&t, 0, Priority::Demand) {
            Scheduled::InFlight(f) => f.wait_until(Instant::now() + Duration::from_secs(20)),
            other => panic!("{other:?}"),
        };
        assert_eq!(got, Some(FillOutcome::Landed));
        assert!(r.store.is_present(&t.key, 0));
    }

    fn outcome(s: Scheduled, deadline: Instant) -> Option<bool> {
        match s {
            Scheduled::Present => Some(true),
            Scheduled::InFlight(f) => f.wait_until(deadline).map(FillOutcome::landed),
            Scheduled::Shed => None,
        }
    }

    /// Issue 12, point 6, without FUSE: a root whose calls never return holds no worker
    /// that another root needs, its waiters are released within the stall bound, new
    /// requests for it are declined at once, and it serves again once it answers.
    #[test]
    fn a_hung_root_costs_other_roots_nothing_and_its_waiters_are_released() {
        let r = two_roots();
        let hung: Vec<_> = (0..8).map(|i| r.target(1, &format!("h{i}"))).collect();
        let good: Vec<_> = (0..8).map(|i| r.target(0, &format!("g{i}"))).collect();
        r.faults.hang();
        let t0 = Instant::now();
        let mut waiting = Vec::new();
        for t in &hung {
            for i in 0..8 {
                if let Scheduled::InFlight(f) = r.filler.request(t, i, Priority::Demand) {
                    waiting.push(f);
                }
            }
        }
        until(
            Duration::from_secs(5),
            "workers blocked in the hung store",
            || r.faults.hung.load(Ordering::Relaxed) >= 4,
        );
        // The healthy root: every block lands, promptly.
        let t = Instant::now();
        for g in &good {
            for i in 0..4 {
                let got = outcome(
                    r.filler.request(g, i, Priority::Demand),
                    Instant::now() + Duration::from_secs(5),
                );
                assert_eq!(got, Some(true), "healthy block {i} of {}", g.rel);
            }
        }
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "32 healthy fills took {took:?} while another root hangs"
        );
        // Waiters on the hung root are released, declined, within about the bound.
        for f in &waiting {
            assert_eq!(
                f.wait_until(t0 + 10 * STALL),
                Some(FillOutcome::Declined(Declined::Stalled)),
                "released, declined as stalled"
            );
        }
        eprintln!(
            "healthy fills: {took:?} for 32 blocks; hung waiters released after {:?}",
            t0.elapsed()
        );
        // A new request for the stalled root is declined at once.
        let t = Instant::now();
        let got = outcome(
            r.filler.request(&hung[0], 0, Priority::Demand),
            Instant::now() + Duration::from_secs(5),
        );
        assert_ne!(got, Some(true));
        assert!(t.elapsed() < STALL, "declined at once: {:?}", t.elapsed());
        // The store answers again: so does the root.
        r.faults.release();
        until(Duration::from_secs(5), "the root serves again", || {
            let got = outcome(
                r.filler.request(&hung[1], 7, Priority::Demand),
                Instant::now() + Duration::from_secs(5),
            );
            got == Some(true)
        });
        r.filler.close();
    }

    #[test]
    fn close_does_not_wait_for_a_worker_stuck_in_the_store() {
        let r = two_roots();
        let t = r.target(1, "h0");
        r.faults.hang();
        let Scheduled::InFlight(f) = r.filler.request(&t, 0, Priority::Demand) else {
            panic!("not scheduled")
        };
        until(Duration::from_secs(5), "a worker blocked", || {
            r.faults.hung.load(Ordering::Relaxed) >= 1
        });
        let started = Instant::now();
        r.filler.close();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "close took {:?}",
            started.elapsed()
        );
        assert!(
            matches!(f.outcome(), Some(FillOutcome::Declined(_))),
            "its waiter was released: {:?}",
            f.outcome()
        );
        r.faults.release();
    }

    impl ProviderFixture for Rig {
        fn provider(&self) -> &dyn BlockProvider {
            &self.filler
        }
        fn put(&self, path: &str, data: &[u8]) -> Arc<Target> {
            let owner = Owner {
                mode: 0o644,
                ..Owner::default()
            };
            self.mem.put(path, data.to_vec(), owner);
            self.meta.invalidate(0, path);
            self.target(path)
        }
    }

    /// The fill engine is the peer server's provider: the suite its in-memory twin
    /// passes.
    #[test]
    fn the_fill_engine_conforms_as_a_provider() {
        assert_eq!(BS as usize, conformance::BS);
        conformance::providers(&rig);
    }

    /// The order of a fill's sources: the peers first, the backing store when they miss,
    /// nothing from either when a prefetch is declined, and never the peers for a fill
    /// on a peer's behalf.
    #[test]
    fn fills_ask_their_sources_in_order() {
        let peers = Arc::new(MemSource::new(true));
        let (faulty, sf) = FaultySource::new(peers.clone());
        let r = rig_with(Some(Arc::new(faulty)));
        r.put("f", 2 * BS as usize);
        r.put("g", BS as usize);
        r.put("h", BS as usize);
        let t = r.target("f");
        let data: Vec<u8> = (0..2 * BS as usize).map(|i| (i % 251) as u8).collect();
        peers.insert(t.key, data);
        // The peers have it: the backing store is not read.
        assert_eq!(r.wait(&t, 0), Some(true));
        assert_eq!(r.faults.reads.load(Ordering::Relaxed), 0);
        assert_eq!(sf.fetches.load(Ordering::Relaxed), 1);
        // They miss: the backing store is.
        let g = r.target("g");
        assert_eq!(r.wait(&g, 0), Some(true));
        assert_eq!(r.faults.reads.load(Ordering::Relaxed), 1);
        assert_eq!(sf.fetches.load(Ordering::Relaxed), 2);
        // Declined (a prefetch the placement moved away): neither supplies it.
        sf.decline.store(true, Ordering::Relaxed);
        let h = r.target("h");
        let got = match r.filler.request(&h, 0, Priority::Prefetch) {
            Scheduled::InFlight(f) => f.wait_until(Instant::now() + Duration::from_secs(20)),
            other => panic!("{other:?}"),
        };
        assert_eq!(got, Some(FillOutcome::Declined(Declined::Moved)));
        assert!(!r.store.is_present(&h.key, 0));
        assert_eq!(r.faults.reads.load(Ordering::Relaxed), 1, "no backing read");
        assert_eq!(
            r.stats.fill_errors.load(Ordering::Relaxed),
            0,
            "not an error"
        );
        // A fill for a peer (peer_ok false) never asks the peers.
        sf.decline.store(false, Ordering::Relaxed);
        let asked = sf.fetches.load(Ordering::Relaxed);
        let f = r.target("f");
        let mine = Arc::new(Target {
            peer_ok: false,
            root: f.root,
            rel: f.rel.clone(),
            stat: f.stat.clone(),
            key: f.key,
        });
        assert!(
            r.filler
                .fill_here(&mine, 1, Instant::now() + Duration::from_secs(20))
        );
        assert_eq!(
            sf.fetches.load(Ordering::Relaxed),
            asked,
            "the peers not asked"
        );
        assert_eq!(r.faults.reads.load(Ordering::Relaxed), 2);
        r.filler.close();
    }
}
