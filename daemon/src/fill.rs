//! The fill engine: reads blocks from the backing store into the NVMe store, once per
//! block however many clients want it.
//!
//! Requests go into one bounded priority queue (a client waiting on a block first, then
//! read-ahead, each in arrival order) served by a fixed pool of worker threads, which
//! bounds the concurrency toward the backing store. A block has at most one fill in
//! flight ([`Flight`]): every later request for it waits on the same flight
//! (single-flight). When the queue is full, read-ahead is dropped and counted, and a
//! waiting client falls back to the backing store itself.
//!
//! A fill reads the block through a descriptor opened for the exact version the client
//! was told about, and checks the version again after reading: a file changed
//! underneath is never cached under the old version's key.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap as HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::backing::{BackingError, BackingFile, BackingFileExt, Stat};
use crate::meta::Meta;
use crate::stats::{Stats, add, inc};
use crate::store::{Key, Store, StoreError};

/// How urgently a block is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// Planned ahead of any reader (the prefetcher): admitted only without harm to
    /// files kept for a later epoch.
    Prefetch = 0,
    /// Ahead of a reader within the file it opened.
    Readahead = 1,
    /// A client is blocked on it.
    Demand = 2,
}

/// The file a fill is for.
#[derive(Debug)]
pub struct Target {
    /// Root index (for metadata invalidation).
    pub root: usize,
    /// The path as the client named it, relative to the root (metadata cache key).
    pub rel: String,
    /// The version to fill.
    pub stat: Arc<Stat>,
    /// The store key of that version.
    pub key: Key,
    /// The block may come from a peer (false when filling for a peer: the owner reads the
    /// backing store itself).
    pub peer_ok: bool,
}

/// One block fill in progress; waiters block on it.
#[derive(Debug, Default)]
pub struct Flight {
    done: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Flight {
    /// `Some(ok)` once the fill ended, without waiting.
    pub fn outcome(&self) -> Option<bool> {
        *self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the fill ends or `deadline`; `Some(ok)` when it ended.
    pub fn wait_until(&self, deadline: Instant) -> Option<bool> {
        let mut g = self.done.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(ok) = *g {
                return Some(ok);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn finish(&self, ok: bool) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = Some(ok);
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

#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Job>,
    /// Blocks queued and not yet taken by a worker, with their current priority.
    queued: HashMap<(Key, usize), Priority>,
    seq: u64,
    closed: bool,
}

impl Queue {
    /// Queues block `index` of `target` at `prio` (a block queued again at a higher
    /// priority leaves a stale heap entry that workers skip).
    fn enqueue(&mut self, target: &Arc<Target>, index: usize, prio: Priority) {
        self.queued.insert((target.key, index), prio);
        self.seq += 1;
        let seq = self.seq;
        self.heap.push(Job {
            prio,
            seq,
            target: target.clone(),
            index,
        });
    }
}

struct Inner {
    queue: Mutex<Queue>,
    cv: Condvar,
    flights: Mutex<HashMap<(Key, usize), Arc<Flight>>>,
    store: Arc<Store>,
    meta: Arc<Meta>,
    stats: Arc<Stats>,
    limit: usize,
    workers: usize,
    meter: Mutex<Meter>,
    peers: OnceLock<Arc<crate::peer::Peers>>,
    handles: moka::sync::Cache<Key, Arc<dyn BackingFile>>,
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

/// The fill engine.
pub struct Filler {
    inner: Arc<Inner>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Filler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filler")
            .field("limit", &self.inner.limit)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Filler {
    /// Starts `workers` fill threads with a queue of at most `limit` read-ahead jobs.
    pub fn new(
        store: Arc<Store>,
        meta: Arc<Meta>,
        stats: Arc<Stats>,
        workers: usize,
        limit: usize,
    ) -> std::io::Result<Self> {
        let inner = Arc::new(Inner {
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            flights: Mutex::new(HashMap::default()),
            store,
            meta,
            stats,
            limit,
            workers,
            meter: Mutex::new(Meter::default()),
            peers: OnceLock::new(),
            handles: moka::sync::Cache::builder()
                .max_capacity(256)
                .time_to_idle(std::time::Duration::from_secs(30))
                .build(),
        });
        let mut hs = Vec::with_capacity(workers);
        for i in 0..workers {
            let inner = inner.clone();
            hs.push(
                std::thread::Builder::new()
                    .name(format!("sc-fill-{i}"))
                    .spawn(move || worker(&inner))?,
            );
        }
        Ok(Self {
            inner,
            workers: Mutex::new(hs),
        })
    }

    /// Asks for block `index` of `target` at `prio`. Not blocking.
    pub fn request(&self, target: &Arc<Target>, index: usize, prio: Priority) -> Scheduled {
        let inner = &self.inner;
        if inner.store.is_present(&target.key, index) {
            return Scheduled::Present;
        }
        let mut flights = lock(&inner.flights);
        let id = (target.key, index);
        let mut q = lock(&inner.queue);
        if q.closed {
            return Scheduled::Shed;
        }
        if let Some(f) = flights.get(&id) {
            // Raise a queued read-ahead to demand.
            if q.queued.get(&id).is_some_and(|queued| *queued < prio) {
                q.enqueue(target, index, prio);
                inner.cv.notify_one();
            }
            return Scheduled::InFlight(f.clone());
        }
        let cap = match prio {
            Priority::Prefetch | Priority::Readahead => inner.limit,
            Priority::Demand => inner.limit * 2,
        };
        if q.queued.len() >= cap {
            inc(&inner.stats.queue_shed);
            return Scheduled::Shed;
        }
        let f = Arc::new(Flight::default());
        flights.insert(id, f.clone());
        q.enqueue(target, index, prio);
        inner.cv.notify_one();
        Scheduled::InFlight(f)
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
        let theirs = {
            let mut flights = lock(&inner.flights);
            let theirs = flights.get(&(target.key, index)).cloned();
            if theirs.is_none() {
                flights.insert((target.key, index), Arc::new(Flight::default()));
            }
            theirs
        };
        match theirs {
            Some(f) => f.wait_until(deadline).unwrap_or(false),
            None => fill_and_land(inner, target, index, false),
        }
    }

    /// Lets fills ask peers before the backing store.
    pub fn use_peers(&self, peers: Arc<crate::peer::Peers>) {
        let _ = self.inner.peers.set(peers);
    }

    /// The backing store's measured latency and throughput, once a few reads are in.
    pub fn service(&self) -> Option<Service> {
        let m = *lock(&self.inner.meter);
        (m.n >= 4 && m.secs > 0.0).then(|| Service {
            latency: m.secs,
            throughput: self.inner.workers as f64 * m.bytes / m.secs,
        })
    }

    /// Fill worker threads still running (all of them, unless one died).
    pub fn workers_alive(&self) -> usize {
        lock(&self.workers)
            .iter()
            .filter(|h| !h.is_finished())
            .count()
    }

    /// The number of fill worker threads started.
    pub fn workers(&self) -> usize {
        self.inner.workers
    }

    /// Stops the workers after their current fill; queued fills end unfinished (their
    /// waiters are released and fall back).
    pub fn close(&self) {
        {
            let mut q = lock(&self.inner.queue);
            q.closed = true;
            q.heap.clear();
            q.queued.clear();
        }
        self.inner.cv.notify_all();
        for h in lock(&self.workers).drain(..) {
            let _ = h.join();
        }
        for (_, f) in lock(&self.inner.flights).drain() {
            f.finish(false);
        }
    }
}

fn worker(inner: &Inner) {
    loop {
        let job = {
            let mut q = lock(&inner.queue);
            loop {
                if q.closed {
                    return;
                }
                match q.heap.pop() {
                    Some(job) => {
                        let id = (job.target.key, job.index);
                        // A stale duplicate (raised to demand, or already taken).
                        if q.queued.get(&id) != Some(&job.prio) {
                            continue;
                        }
                        q.queued.remove(&id);
                        break job;
                    }
                    None => q = inner.cv.wait(q).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        fill_and_land(
            inner,
            &job.target,
            job.index,
            job.prio == Priority::Prefetch,
        );
    }
}

/// Fills one block whose flight is registered, counts a failure, and ends the flight
/// (releasing its waiters). True when the block landed.
fn fill_and_land(inner: &Inner, target: &Target, index: usize, prefetch: bool) -> bool {
    let ok = match fill(inner, target, index, prefetch) {
        Ok(()) => true,
        Err(e) => {
            if !matches!(
                e,
                FillError::Store(StoreError::NoSpace) | FillError::Store(StoreError::Gone)
            ) {
                inc(&inner.stats.fill_errors);
            }
            tracing::debug!(path = %target.stat.path, block = index, error = %e, "fill failed");
            false
        }
    };
    if let Some(f) = lock(&inner.flights).remove(&(target.key, index)) {
        f.finish(ok);
    }
    ok
}

#[derive(Debug, thiserror::Error)]
enum FillError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Backing(#[from] BackingError),
    #[error("backing read failed: {0}")]
    Read(#[from] std::io::Error),
}

thread_local! {
    /// A fill thread's buffer for blocks from peers (one block, kept between fills).
    static PEER_BUF: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

fn fill(inner: &Inner, t: &Target, index: usize, prefetch: bool) -> Result<(), FillError> {
    let root = &inner.meta.roots().get(t.root).name;
    let Some(permit) = inner.store.begin_fill(root, &t.stat, index, prefetch)? else {
        return Ok(());
    };
    if t.peer_ok
        && let Some(peers) = inner.peers.get()
    {
        // This thread's block buffer, kept from one peer fetch to the next.
        let mut buf = PEER_BUF.take();
        let got = peers.fetch(root, &t.stat, index, permit.len(), true, &mut buf);
        if got {
            let r = inner.store.commit_fill(permit, &buf);
            PEER_BUF.set(buf);
            r?;
            inc(&inner.stats.blocks_filled);
            return Ok(());
        }
        PEER_BUF.set(buf);
        if prefetch && peers.placed_elsewhere(root, &t.stat.path) {
            // The cluster placement moved the file on (or dropped it) since this
            // prefetch started: reading the backing store for it would be a read the
            // cluster does not need.
            inner.store.abort_fill(permit);
            return Err(FillError::Store(StoreError::Gone));
        }
    }
    let started = Instant::now();
    match read_block(inner, t, permit.offset(), permit.len()) {
        Ok(data) => {
            lock(&inner.meter).add(started.elapsed().as_secs_f64(), data.len() as f64);
            inner.store.commit_fill(permit, &data)?;
            inc(&inner.stats.blocks_filled);
            Ok(())
        }
        Err(e) => {
            inner.store.abort_fill(permit);
            Err(e)
        }
    }
}

fn read_block(inner: &Inner, t: &Target, offset: u64, len: usize) -> Result<Vec<u8>, FillError> {
    let changed = |inner: &Inner| {
        inner.meta.invalidate(t.root, &t.rel);
        inner.handles.invalidate(&t.key);
        FillError::Backing(BackingError::Changed(t.stat.path.clone()))
    };
    let file = match inner.handles.get(&t.key) {
        Some(f) => f,
        None => {
            let f: Arc<dyn BackingFile> = match inner.meta.roots().get(t.root).backing.open(&t.stat)
            {
                Ok(f) => Arc::from(f),
                Err(BackingError::Changed(_)) => return Err(changed(inner)),
                Err(e) => return Err(e.into()),
            };
            inner.handles.insert(t.key, f.clone());
            f
        }
    };
    let mut buf = vec![0u8; len];
    let n = file.read_full_at(&mut buf, offset)?;
    inc(&inner.stats.backing_reads);
    add(&inner.stats.backing_bytes, n as u64);
    if n != len || file.version()? != t.stat.version {
        return Err(changed(inner));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::fault::{Faults, FaultyBacking};
    use crate::backing::mem::MemBacking;
    use crate::backing::{Backing, Owner};
    use crate::config::SizeSpec;
    use crate::meta::{Root, Roots};
    use crate::store::StoreConfig;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    const BS: u32 = 4096;

    struct Rig {
        _dir: tempfile::TempDir,
        mem: Arc<MemBacking>,
        faults: Arc<Faults>,
        meta: Arc<Meta>,
        store: Arc<Store>,
        stats: Arc<Stats>,
        filler: Filler,
    }

    fn rig() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemBacking::new());
        let (faulty, faults) = FaultyBacking::new(mem.clone());
        let backing: Arc<dyn Backing> = Arc::new(faulty);
        let roots = Arc::new(Roots::new(vec![Root {
            path: "/r".into(),
            name: "/r".into(),
            backing,
        }]));
        let stats = Arc::new(Stats::default());
        let meta = Arc::new(Meta::new(
            roots,
            Duration::from_secs(3600),
            1000,
            stats.clone(),
        ));
        let cfg = StoreConfig {
            dir: dir.path().to_owned(),
            capacity: SizeSpec::Bytes(1 << 30),
            min_free: SizeSpec::Bytes(0),
            block_size: BS,
        };
        let store = Arc::new(Store::open(&cfg, stats.clone()).unwrap());
        let filler = Filler::new(store.clone(), meta.clone(), stats.clone(), 4, 64).unwrap();
        Rig {
            _dir: dir,
            mem,
            faults,
            meta,
            store,
            stats,
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
                Scheduled::InFlight(f) => f.wait_until(Instant::now() + Duration::from_secs(20)),
                Scheduled::Shed => None,
            }
        }
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
}
