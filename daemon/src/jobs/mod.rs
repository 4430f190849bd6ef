//! Registered jobs: their manifests feed the planner (in the [`Plans`] cell they share
//! with the store's eviction policy, `crate::policy::planned`, and the peers), which
//! then decides eviction and prefetch.
//!
//! By role: `registry.rs` turns a manifest into a plan and decides who may change a
//! job; `lease.rs` keeps a leased job while its readers live or renew it; `usage.rs` attributes reads to jobs (reads move a job's position, and so does an
//! explicit progress report), measures rates and answers status; `prefetcher.rs` is the
//! prefetch task ([`Jobs::start_prefetcher`]); `layouts.rs` hands the peers' cluster
//! layouts to the planner. This file holds the state they share.
//!
//! A registration acts with its registrant's rights, never the daemon's: a glob lists
//! only directories the registrant may list, the prefetcher fetches (from the backing
//! store or a peer) only files the registrant may read, and `immutable` holds only
//! what the registrant may vouch for ([`crate::meta::Voucher`]). Root and the daemon's
//! user (operators) vouch for the node's data and are not checked. What was left out
//! is counted per job (status, metrics).
//!
//! Locking: the planner lock is never held while the store's index lock is taken by
//! this module; the store calls into the planner (through the policy) with its own lock
//! held, so the order is always store → planner.

use std::collections::BTreeMap;

// Keyed by paths from manifests of any user: seeded per process, and fast on strings.
use foldhash::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};
use std::time::{Duration, Instant};

use shardcache_plan::manifest::{Files, Item, Manifest, Plan};
use shardcache_proto::local::v1 as pb;

use crate::access::{self, Creds, Decision};
use crate::backing::Stat;
use crate::clock::{Clock, SystemClock};
use crate::fill::{FillOutcome, Filler, Flight, Priority, Scheduled, Target};
use crate::lifecycle::{Stop, Task, Wake};
use crate::meta::{Hold, Meta, Roots, Voucher};
use crate::metrics::PrefetchInstruments;

use crate::planner::{FileRef, Planner, Source};
use crate::policy::{Applied, Deferred, Plans, Slots};
use crate::ratelimit::TokenBucket;
use crate::store::{Key, Store};

/// Upcoming files the round looks up sizes of; before the rates are measured, the
/// missing files the prefetcher fetches as early as the rules allow.
const LOOKAHEAD: usize = 1024;
/// Most upcoming files of a job walked for one decision, resident ones included. At
/// half cache an epoch opens with as many hits as the cache holds, and the missing
/// files past them are urgent only as a whole (10 000 files at 2 ms each of link time,
/// while the reader takes 8 s to pass the hits): a fixed window of 1 024 upcoming or
/// missing files saw nothing urgent and left the link idle for the first seconds of
/// every epoch.
const MAX_WALK: usize = 1 << 17;
/// Most files in a job's readiness window (status, `shardcache prefetch --wait`).
const STATUS_WINDOW: usize = 4096;
/// Files of the readiness window whose sizes the status asks at once ([`Jobs::sizes_of`]):
/// the window ends where the cache is full, often well before [`STATUS_WINDOW`].
const STATUS_SIZES: usize = 256;
/// Most read files noted for the prefetcher between two of its rounds (past it, the
/// notes are dropped: the files then count as ahead until the watermark passes them).
const MAX_READ_NOTES: usize = 1 << 16;
/// How often consumption rates are measured.
const RATE_PERIOD: Duration = Duration::from_millis(500);
/// How fast the fastest rate a job was measured at is forgotten (see [`Rate`]).
const PEAK_HALF_LIFE: Duration = Duration::from_secs(120);

/// A job's consumption rate: the mean of its measurements (steps per second; for
/// status), and what the planner plans with, the fastest it was measured at lately if
/// that is faster. Readers waiting on the backing store read at the store's pace, and
/// over hits at their own: at half cache an epoch ends waiting on the link and the next
/// opens with thousands of hits, and a plan at the last epoch's pace saw nothing
/// urgent until the mean caught up (the link ran at a third of its rate for the first
/// 2-3 s of each epoch). The peak halves every [`PEAK_HALF_LIFE`]: a job that slows
/// for good is planned at its new pace within minutes, and planning a job as faster
/// than it is only fetches earlier what it reads in this epoch.
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    mean: Option<f64>,
    peak: f64,
}

impl Rate {
    /// Takes a measurement of `r` steps per second over the last `dt`; what the
    /// planner plans with now.
    fn measured(&mut self, r: f64, dt: Duration) -> f64 {
        let mean = self.mean.map_or(r, |old| old + 0.5 * (r - old));
        self.mean = Some(mean);
        let decay = 0.5f64.powf(dt.as_secs_f64() / PEAK_HALF_LIFE.as_secs_f64());
        self.peak = (self.peak * decay).max(r);
        mean.max(self.peak)
    }
}

/// A prefetched file not yet opened by its job.
#[derive(Debug, Clone, Copy)]
enum Prefetched {
    /// Its blocks are being fetched.
    InFlight,
    /// Every block became resident at this time.
    Resident(Instant),
}

/// Reads of one job, as clients reported them and as the daemon saw them.
#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    /// Bytes the daemon read from the backing store for the job's files.
    backing_bytes: u64,
    hit_bytes: u64,
    filled_bytes: u64,
    fallback_bytes: u64,
    wait_ns: u64,
    fallback_ns: u64,
    opens: u64,
    opens_hit: u64,
}

#[derive(Debug)]
struct JobInfo {
    /// Who registered it: only that user, root and the daemon's user may replace,
    /// unregister or move it; its prefetches are what this user may read.
    creds: Creds,
    /// The registrant is root or the daemon's user: it vouches for the node's data.
    operator: bool,
    files: usize,
    /// Files held immutable in the metadata cache (an immutable manifest), how many of
    /// them were held, and the hold (in the registrant's name).
    immutable: Option<(Arc<Vec<FileRef>>, usize, Arc<Hold>)>,
    /// Directories its glob did not list (the registrant may not).
    dirs_denied: u64,
    /// Its files (indices) the registrant may not read, as the prefetcher last checked.
    denied: HashSet<u32>,
    /// Names this registration in Opened replies and client reports (a job registered
    /// again gets a new tag, so late reports of the old one are not mixed in).
    tag: u64,
    usage: Usage,
    /// A shuffle's manifest apart from its ranks (a hash), and its ranks on this node:
    /// a registration of the same shuffle for other ranks adds them (see
    /// [`Jobs::register`]).
    shape: Option<(u64, Vec<u64>)>,
    /// The epochs its plan covers, `[first, end)`.
    span: (u64, u64),
    /// The manifest as registered (ranks merged), as JSON: what is kept on disk.
    manifest: serde_json::Value,
    /// The reply its registration got (repeated to a registration that adds nothing).
    registered: Registered,
    /// Steps done at the last rate measurement, and when.
    rate_mark: (u64, Instant),
    /// Steps per second, once measured.
    rate: Rate,
    /// Its lease (`None`: it lives until unregistered).
    lease: Option<lease::Lease>,
}

/// The registered jobs and their planner.
#[derive(Debug)]
pub struct Jobs {
    roots: Arc<Roots>,
    meta: Arc<Meta>,
    /// The planner and what it says, shared with the store's policy and the peers.
    plans: Arc<Plans>,
    info: Mutex<BTreeMap<String, JobInfo>>,
    next_tag: AtomicU64,
    /// Files being prefetched now (for status).
    prefetching: AtomicU64,
    /// Sizes of planned files, as declared by manifests or stat'ed by the prefetcher
    /// and the status (bounded: cleared when it grows past a million entries).
    sizes: Mutex<HashMap<FileRef, u64>>,
    /// The peers, when this node shares with others: the cluster layouts come from
    /// them, and claimed copies are released through them.
    peers: Option<Arc<crate::peer::Peers>>,
    wake: Arc<Wake>,
    /// Files the prefetcher fetched, until their first open: the open then records the
    /// prefetch lead time (or a late prefetch).
    prefetched: Mutex<HashMap<FileRef, Prefetched>>,
    instruments: PrefetchInstruments,
    /// Files read since the prefetcher last looked (it stops counting them as fetched
    /// ahead of their readers, who read out of order, ahead of the job's watermark).
    read: Mutex<Vec<FileRef>>,
    /// False once the prefetch thread has ended (for the liveness probe).
    prefetcher_alive: Arc<AtomicBool>,
    /// Simulated reads of the cluster placement per taking of the planner lock, fitted
    /// to [`layouts::PLACEMENT_CHUNK_TIME`] (see [`Jobs::sync_placements`]).
    placement_chunk: AtomicU64,
    /// The tag of the job an open of each planned file is reported under (the first
    /// registered job that plans it): answered without the planner lock.
    tags: RwLock<HashMap<FileRef, u64>>,
    /// The time leases run on.
    clock: Arc<dyn Clock>,
    /// Whether a lease's holders are alive.
    procs: Arc<dyn Processes>,
    /// Where registrations are kept across restarts (`durable.rs`; none in tests that
    /// do not ask).
    durable: Option<durable::Durable>,
    /// The positions last saved there.
    saved_positions: Mutex<HashMap<String, (u64, u64)>>,
    /// Held through a registration's check of the jobs registered and its change to
    /// them (one registration at a time: two ranks of one job registering at once each
    /// found no job under the id, and the later replaced the other).
    registering: Mutex<()>,
}

impl Jobs {
    /// No jobs yet: they are planned in `plans`; with `peers`, cluster layouts come
    /// from them. The prefetcher records its lead times into `instruments`, and sleeps
    /// on `wake` between events (the fill engine notifies it when a fetch it asked for
    /// ends).
    pub fn new(
        meta: Arc<Meta>,
        plans: Arc<Plans>,
        peers: Option<Arc<crate::peer::Peers>>,
        instruments: PrefetchInstruments,
        wake: Arc<Wake>,
    ) -> Self {
        Self {
            roots: meta.roots().clone(),
            meta,
            plans,
            info: Mutex::new(BTreeMap::new()),
            next_tag: AtomicU64::new(1),
            prefetching: AtomicU64::new(0),
            sizes: Mutex::new(HashMap::default()),
            peers,
            wake,
            prefetched: Mutex::new(HashMap::default()),
            read: Mutex::new(Vec::new()),
            instruments,
            prefetcher_alive: Arc::new(AtomicBool::new(false)),
            placement_chunk: AtomicU64::new(crate::planner::PLACEMENT_CHUNK_READS),
            tags: RwLock::new(HashMap::default()),
            clock: Arc::new(SystemClock),
            procs: Arc::new(ProcFs),
            durable: None,
            saved_positions: Mutex::new(HashMap::default()),
            registering: Mutex::new(()),
        }
    }

    /// The same, its leases on `clock` and the holders' processes as `procs` says
    /// (tests: a manual clock and made-up processes).
    pub fn with_lease_seams(mut self, clock: Arc<dyn Clock>, procs: Arc<dyn Processes>) -> Self {
        self.clock = clock;
        self.procs = procs;
        self
    }

    /// False when the prefetcher was started and its thread has ended since.
    pub fn prefetcher_alive(&self) -> bool {
        self.prefetcher_alive.load(Ordering::Acquire)
    }
    /// Applies the reads opens left for the planner, and accounts them.
    fn settle(&self) {
        drop(self.plans.planner());
        self.account(self.plans.take_applied());
    }
    fn poke(&self) {
        self.wake.notify();
    }
    /// The ids of the registered jobs, sorted.
    pub fn ids(&self) -> Vec<String> {
        self.info.lock().keys().cloned().collect()
    }

    /// The files of job `id`, in manifest order; `None` when no such job is registered.
    pub fn files_of(&self, id: &str) -> Option<Arc<Vec<FileRef>>> {
        self.plans.planner().job_files(id)
    }

    /// The size of `f` when a manifest declared it or the daemon stat'ed it since
    /// (never goes to the backing store).
    pub fn known_size(&self, f: &FileRef) -> Option<u64> {
        self.sizes.lock().get(f).copied()
    }

    /// Which of `files` some registered job plans (one planner lock for all).
    pub fn planned(&self, files: &[FileRef]) -> Vec<bool> {
        let p = self.plans.planner();
        files.iter().map(|f| p.is_planned(f)).collect()
    }

    /// True when some job is registered.
    fn any(&self) -> bool {
        !self.info.lock().is_empty()
    }
    /// The sizes of planned `files`, in order: known, or stat'ed now (not under the
    /// planner lock) and remembered; those not known are stat'ed in one batch per root
    /// ([`Meta::stat_many`]), not one after another (the status's window of up to 4 096
    /// files, the prefetcher's look ahead). `None` for a file that cannot be stat'ed.
    pub fn sizes_of(&self, files: &[FileRef]) -> Vec<Option<u64>> {
        let mut out: Vec<Option<u64>> = {
            let sizes = self.sizes.lock();
            files.iter().map(|f| sizes.get(f).copied()).collect()
        };
        let mut roots: Vec<usize> = files
            .iter()
            .zip(&out)
            .filter(|(_, s)| s.is_none())
            .map(|(f, _)| f.root)
            .collect();
        roots.sort_unstable();
        roots.dedup();
        for root in roots {
            let at: Vec<usize> = (0..files.len())
                .filter(|&i| out[i].is_none() && files[i].root == root)
                .collect();
            let rels: Vec<&str> = at.iter().map(|&i| &*files[i].path).collect();
            let got = self.meta.stat_many(root, &rels);
            let mut sizes = self.sizes.lock();
            if sizes.len() > 1 << 20 {
                sizes.clear();
            }
            for (i, r) in at.into_iter().zip(got) {
                match r {
                    Ok(st) => {
                        sizes.insert(files[i].clone(), st.version.size);
                        out[i] = Some(st.version.size);
                    }
                    Err(e) => tracing::debug!(path = %files[i].path, "size unknown: {e}"),
                }
            }
        }
        out
    }

    /// The size of planned file `f` ([`Jobs::sizes_of`] of one file).
    pub fn size_of(&self, f: &FileRef) -> Option<u64> {
        self.sizes_of(std::slice::from_ref(f)).pop().flatten()
    }
}

mod durable;
mod layouts;
mod lease;
mod prefetcher;
mod registry;
mod usage;

pub use lease::{LeaseRequest, ProcFs, Processes};
pub use prefetcher::PrefetchConfig;
pub use registry::{JobError, Registered};

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::access::test_support::creds;
    use crate::backing::mem::MemBacking;
    use crate::meta::test_support::one_root;

    pub(super) fn jobs() -> Arc<Jobs> {
        let (meta, _) = one_root(Arc::new(MemBacking::new()));
        let plans = Arc::new(Plans::new(meta.roots().clone(), false));
        let metrics = crate::metrics::Metrics::new();
        Arc::new(Jobs::new(
            meta,
            plans,
            None,
            metrics.prefetch(),
            Arc::new(Wake::default()),
        ))
    }

    /// The sizes of many files, asked in one batch, are what each file's own lookup
    /// gives (a file that cannot be stat'ed has none), and are remembered.
    #[test]
    fn sizes_of_many_files_are_each_files_size() {
        let mem = Arc::new(MemBacking::new());
        for i in 0..20 {
            mem.put(
                &format!("f{i}"),
                vec![0; 100 + i],
                crate::backing::Owner {
                    mode: 0o644,
                    ..Default::default()
                },
            );
        }
        let (meta, _) = one_root(mem.clone());
        let plans = Arc::new(Plans::new(meta.roots().clone(), false));
        let metrics = crate::metrics::Metrics::new();
        let jobs = Jobs::new(
            meta,
            plans,
            None,
            metrics.prefetch(),
            Arc::new(Wake::default()),
        );
        let f = |p: &str| FileRef {
            root: 0,
            path: p.into(),
        };
        let mut files: Vec<FileRef> = (0..20).map(|i| f(&format!("f{i}"))).collect();
        files.insert(3, f("missing"));
        let want: Vec<Option<u64>> = files.iter().map(|x| jobs.size_of(x)).collect();
        assert_eq!(want[4], Some(103));
        assert_eq!(want[3], None);
        jobs.sizes.lock().clear();
        assert_eq!(jobs.sizes_of(&files), want);
        assert_eq!(jobs.sizes.lock().len(), 20, "remembered");
    }

    /// A job measured fast over hits and then slow while it waits on the backing store
    /// is planned at the fast pace (the next epoch opens with hits again); the mean
    /// follows the slow one, and the peak is forgotten over minutes.
    #[test]
    fn a_job_slowed_by_the_backing_store_is_planned_at_its_pace_over_hits() {
        let period = Duration::from_millis(500);
        let mut rate = Rate::default();
        assert_eq!(rate.measured(1300.0, period), 1300.0);
        for _ in 0..40 {
            // 20 s waiting on the link.
            rate.measured(460.0, period);
        }
        let planned = rate.measured(460.0, period);
        assert!((rate.mean.unwrap() - 460.0).abs() < 1.0, "{rate:?}");
        assert!(planned > 1100.0, "planned at {planned}");
        for _ in 0..(8 * 120 * 2) {
            // Eight half-lives at the slow pace: planned at it.
            rate.measured(460.0, period);
        }
        assert!(rate.measured(460.0, period) < 470.0);
    }

    /// Issue 13, step 4: an open never waits for the prefetcher's planning. With the
    /// planner lock held (as the prefetcher holds it while it decides), opens of planned
    /// files still answer, with their job's tag; the reads move the job and are counted
    /// once the lock is free.
    #[test]
    fn an_open_does_not_wait_for_the_planner_lock() {
        let jobs = jobs();
        let files: Vec<String> = (0..8).map(|i| format!("\"f{i}\"")).collect();
        let m = format!(
            r#"{{"version": 1, "job": "j", "root": "/r", "files": [{}],
                "plan": {{"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1",
                          "seed": 3, "epochs": 2, "world_size": 1, "ranks": [0]}}}}"#,
            files.join(",")
        );
        jobs.register(&m, &creds(0), true).unwrap();
        let order = shardcache_plan::shuffle::rank_order(8, 3, 0, 1, 0, false);
        // As if the prefetcher ran (it applies the reads opens leave).
        jobs.prefetcher_alive.store(true, Ordering::Release);
        let planning = jobs.plans.planner();
        let (tx, rx) = mpsc::channel();
        let j = jobs.clone();
        let first = order[0];
        std::thread::spawn(move || {
            let tag = j.on_open(0, &format!("f{first}"), true);
            let _ = tx.send(tag);
        });
        let tag = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the open answered while the planner lock was held");
        assert_ne!(tag, 0, "tagged with the job that plans the file");
        assert_eq!(planning.position("j"), Some((0, 0)), "not applied yet");
        drop(planning);
        let st = jobs.status(&|_, _| false, 1 << 30);
        assert_eq!(
            st[0].step, 1,
            "applied at the next lock: the job moved past it"
        );
        assert_eq!((st[0].opens, st[0].opens_hit), (1, 1), "and counted");
        // A file no job plans: no tag, nothing counted.
        assert_eq!(jobs.on_open(0, "other", false), 0);
        assert_eq!(jobs.status(&|_, _| false, 1 << 30)[0].opens, 1);
    }

    pub(super) fn shuffle(job: &str, seed: u64, ranks: &[u64]) -> String {
        let files: Vec<String> = (0..12).map(|i| format!("\"f{i}\"")).collect();
        let ranks: Vec<String> = ranks.iter().map(u64::to_string).collect();
        format!(
            r#"{{"version": 1, "job": "{job}", "root": "/r", "files": [{}],
                "plan": {{"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1",
                          "seed": {seed}, "epochs": 2, "world_size": 4, "ranks": [{}]}}}}"#,
            files.join(","),
            ranks.join(",")
        )
    }

    /// Issue 15: a manifest that gives every file's size hands the sizes to the planner
    /// (the cluster placement then counts bytes); one that leaves a size out does not.
    /// A shuffle manifest of job `job` whose files give their sizes, but for `missing`.
    pub(super) fn sized_shuffle(job: &str, missing: Option<usize>) -> String {
        let files: Vec<String> = (0..12)
            .map(|i| {
                if Some(i) == missing {
                    format!("\"f{i}\"")
                } else {
                    format!("{{\"path\": \"f{i}\", \"size\": {}}}", 1000 * (i + 1))
                }
            })
            .collect();
        format!(
            r#"{{"version": 1, "job": "{job}", "root": "/r", "files": [{}],
                "plan": {{"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1",
                          "seed": 1, "epochs": 2, "world_size": 4, "ranks": [0]}}}}"#,
            files.join(",")
        )
    }

    #[test]
    fn every_size_in_the_manifest_makes_the_placement_count_bytes() {
        let jobs = jobs();
        let sized = |missing| sized_shuffle("s", missing);
        jobs.register(&sized(None), &creds(1000), false).unwrap();
        assert!(jobs.plans.planner().has_sizes("s"));
        jobs.register(&sized(Some(5)), &creds(1000), false).unwrap();
        assert!(!jobs.plans.planner().has_sizes("s"), "one size left out");
        jobs.register(&shuffle("t", 7, &[0]), &creds(1000), false)
            .unwrap();
        assert!(!jobs.plans.planner().has_sizes("t"));
    }

    /// Issue 14: two ranks of one job on one node register the same shuffle under one
    /// id, each with its own rank: the node's plan reads both (before, the second
    /// replaced the first). A registration adding no rank changes nothing (the position
    /// stays); another shuffle under the id replaces it, as before.
    #[test]
    fn ranks_of_one_job_on_one_node_share_one_plan() {
        let jobs = jobs();
        let ranks = |j: &Jobs| j.plans.planner().shuffles();
        jobs.register(&shuffle("j", 7, &[2]), &creds(1000), false)
            .unwrap();
        let tag = jobs.tags.read().values().next().copied().unwrap();
        jobs.register(&shuffle("j", 7, &[0]), &creds(1000), false)
            .unwrap();
        assert_eq!(ranks(&jobs), vec![("j".to_owned(), 4, vec![0, 2])]);
        assert!(
            jobs.tags.read().values().all(|&t| t == tag),
            "the same job: its tag (and usage) kept"
        );
        // The node plan is the two ranks' reads, interleaved.
        let want: Vec<FileRef> = shardcache_plan::shuffle::node_order(12, 7, 0, 4, &[0, 2], false)
            .into_iter()
            .map(|i| FileRef {
                root: 0,
                path: format!("f{i}").into(),
            })
            .collect();
        assert_eq!(jobs.plans.planner().upcoming_of("j", 6), want);
        // Nothing new: the position stays where reads moved it.
        jobs.progress("j", 0, 2).unwrap();
        jobs.register(&shuffle("j", 7, &[2]), &creds(1000), false)
            .unwrap();
        assert_eq!(jobs.plans.planner().position("j"), Some((0, 2)));
        // Another user may not add ranks to it; another shuffle replaces it.
        assert!(matches!(
            jobs.register(&shuffle("j", 7, &[1]), &creds(1001), false),
            Err(JobError::NotYours { .. })
        ));
        jobs.register(&shuffle("j", 8, &[1]), &creds(1000), false)
            .unwrap();
        assert_eq!(ranks(&jobs), vec![("j".to_owned(), 4, vec![1])]);
    }

    /// Issue 15: the ranks of one job on one node register at the same moment (torchrun
    /// starts them together): every rank is in the node's plan. Before, a registration
    /// that came while another was being planned found no job under its id, and the
    /// later of the two replaced the other (docs/PYTHON.md's example on 4 nodes of the
    /// testbed: a node plan of one rank, and no cluster layout ever).
    #[test]
    fn ranks_registering_at_once_all_join_the_plan() {
        let files: Vec<String> = (0..20_000).map(|i| format!("\"f{i}\"")).collect();
        let manifest = |rank: u64| {
            shuffle("j", 7, &[rank]).replacen(
                &(0..12)
                    .map(|i| format!("\"f{i}\""))
                    .collect::<Vec<_>>()
                    .join(","),
                &files.join(","),
                1,
            )
        };
        for round in 0..8 {
            let jobs = jobs();
            let start = std::sync::Barrier::new(4);
            std::thread::scope(|s| {
                for rank in 0..4 {
                    let (jobs, start, m) = (&jobs, &start, manifest(rank));
                    s.spawn(move || {
                        start.wait();
                        jobs.register(&m, &creds(1000), false).unwrap();
                    });
                }
            });
            assert_eq!(
                jobs.plans.planner().shuffles(),
                vec![("j".to_owned(), 4, vec![0, 1, 2, 3])],
                "round {round}"
            );
        }
    }

    /// A rank that registers again from the epoch it is at (the daemon restarted, or its
    /// lease ran out in a pause) while another rank's registration from epoch 0 stands:
    /// the two add up (before, the differing first epoch made it another shuffle, which
    /// replaced the other rank's plan). The merged plan starts at the job's current epoch.
    #[test]
    fn a_rank_registering_again_later_joins_the_plan() {
        let jobs = jobs();
        let ranks = |j: &Jobs| j.plans.planner().shuffles();
        let later = |job: &str, rank: u64, first: u64| {
            shuffle(job, 7, &[rank]).replace(
                r#""epochs": 2,"#,
                &format!(r#""epochs": 2, "first_epoch": {first},"#),
            )
        };
        jobs.register(&shuffle("j", 7, &[2]), &creds(1000), false)
            .unwrap();
        jobs.progress("j", 1, 3).unwrap();
        jobs.register(&later("j", 0, 1), &creds(1000), false)
            .unwrap();
        assert_eq!(ranks(&jobs), vec![("j".to_owned(), 4, vec![0, 2])]);
        assert_eq!(
            jobs.plans.planner().position("j"),
            Some((1, 0)),
            "the merged plan starts at the epoch the job was at"
        );
        let want: Vec<FileRef> = shardcache_plan::shuffle::node_order(12, 7, 1, 4, &[0, 2], false)
            .into_iter()
            .map(|i| FileRef {
                root: 0,
                path: format!("f{i}").into(),
            })
            .collect();
        assert_eq!(jobs.plans.planner().upcoming_of("j", 6), want);
        // Another seed is still another shuffle: it replaces.
        jobs.register(
            &later("j", 1, 1).replace(r#""seed": 7"#, r#""seed": 9"#),
            &creds(1000),
            false,
        )
        .unwrap();
        assert_eq!(ranks(&jobs), vec![("j".to_owned(), 4, vec![1])]);
    }
}
