//! Registered jobs: their manifests feed the planner (in the [`Plans`] cell they share
//! with the store's eviction policy, `crate::policy::planned`, and the peers), which
//! then decides eviction and prefetch (the task in `prefetcher.rs`, started by
//! [`Jobs::start_prefetcher`]).
//! Reads move a job's position (`on_open`), and so does an explicit progress report.
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use shardcache_plan::manifest::{Files, Item, Manifest, Plan};
use shardcache_proto::local::v1 as pb;

use crate::access::{self, Creds, Decision};
use crate::backing::Stat;
use crate::fill::{FillOutcome, Filler, Flight, Priority, Scheduled, Target};
use crate::lifecycle::{Stop, Task, Wake};
use crate::meta::{Hold, Meta, Roots, Voucher};
use crate::metrics::PrefetchInstruments;

use crate::planner::{FileRef, Planner, Source};
use crate::policy::{Applied, Deferred, Plans, Slots};
use crate::ratelimit::TokenBucket;
use crate::store::{Key, Store};

/// Upcoming files the prefetcher and the status look at.
const LOOKAHEAD: usize = 256;
/// Most files in a job's readiness window (status, `shardcache prefetch --wait`).
const STATUS_WINDOW: usize = 4096;
/// How often consumption rates are measured.
const RATE_PERIOD: Duration = Duration::from_millis(500);

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
    /// Steps done at the last rate measurement, and when.
    rate_mark: (u64, Instant),
    /// Steps per second, once measured.
    rate: Option<f64>,
}

/// Why a job could not be registered, changed or moved. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    /// Another user's job: only its registrant and operators may change it.
    #[error(
        "job {job:?} was registered by uid {owner}; only that user, root or the daemon's user may change it (run as them, or pick another job id)"
    )]
    NotYours {
        /// The job.
        job: String,
        /// Its registrant.
        owner: u32,
    },
    /// The manifest does not parse or breaks a rule (the message names the field).
    #[error("{0}")]
    Manifest(String),
    /// The manifest's root is under no backing root of this daemon.
    #[error("root: {0} is not under a backing root of this daemon")]
    RootNotServed(String),
    /// The glob could not be expanded (the message says why).
    #[error("{0}")]
    Glob(String),
    /// The glob matched no file the registrant may list.
    #[error("files.glob: {glob:?} matches no regular file under {root}{}", skipped_text(*.skipped_dirs, *.uid))]
    NothingMatched {
        /// The pattern.
        glob: String,
        /// The manifest's root.
        root: String,
        /// Directories skipped because the registrant may not list them.
        skipped_dirs: usize,
        /// The registrant.
        uid: u32,
    },
    /// An epoch of a sequence plan names a file the manifest does not list.
    #[error("plan.epochs[{epoch}][{item}]: {path:?} is not one of the manifest's files")]
    UnknownFile {
        /// Epoch index in the manifest.
        epoch: usize,
        /// Item index in that epoch.
        item: usize,
        /// The path named.
        path: String,
    },
    /// The planner refused the plan.
    #[error("plan: {0}")]
    Plan(crate::planner::PlanError),
    /// A position outside the job's plan.
    #[error("{0}")]
    Position(String),
}

fn skipped_text(dirs: usize, uid: u32) -> String {
    match dirs {
        0 => String::new(),
        n => format!(" (uid {uid} may not list {n} of its directories, which were skipped)"),
    }
}

/// What a registration did (the reply to it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registered {
    /// The job id.
    pub job: String,
    /// Files in the job.
    pub files: usize,
    /// Directories its glob did not list: the registrant may not.
    pub dirs_denied: usize,
    /// Files held as immutable (an immutable manifest): for everyone when an operator
    /// registered it, else for the registrant's own lookups of its own files (decided
    /// at each file's first stat).
    pub immutable_held: usize,
    /// Files not held: the daemon holds [`crate::meta::MAX_IMMUTABLE`] already.
    pub immutable_over_limit: usize,
    /// The registrant vouches only for its own files (it is not an operator).
    pub immutable_owner_only: bool,
}

/// What a job's registrant's rights left out of it (for status).
#[derive(Debug, Clone, Copy)]
struct Left {
    files_denied: u64,
    dirs_denied: u64,
    immutable_not_owned: u64,
    immutable_over_limit: u64,
}

impl Left {
    fn of(j: &JobInfo) -> Self {
        let (not_owned, over) = j.immutable.as_ref().map_or((0, 0), |(f, held, hold)| {
            (hold.not_owned(), (f.len() - held) as u64)
        });
        Self {
            files_denied: j.denied.len() as u64,
            dirs_denied: j.dirs_denied,
            immutable_not_owned: not_owned,
            immutable_over_limit: over,
        }
    }
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
    /// False once the prefetch thread has ended (for the liveness probe).
    prefetcher_alive: Arc<AtomicBool>,
    /// The tag of the job an open of each planned file is reported under (the first
    /// registered job that plans it): answered without the planner lock.
    tags: std::sync::RwLock<HashMap<FileRef, u64>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
            sizes: Mutex::new(HashMap::new()),
            peers,
            wake,
            prefetched: Mutex::new(HashMap::new()),
            instruments,
            prefetcher_alive: Arc::new(AtomicBool::new(false)),
            tags: std::sync::RwLock::new(HashMap::new()),
        }
    }

    /// False when the prefetcher was started and its thread has ended since.
    pub fn prefetcher_alive(&self) -> bool {
        self.prefetcher_alive.load(Ordering::Acquire)
    }

    /// A job opened `f` at `at`: if the prefetcher fetched it, record how long before the
    /// open it became resident, or that the prefetch was late.
    fn record_lead(&self, f: &FileRef, at: Instant) {
        match lock(&self.prefetched).remove(f) {
            Some(Prefetched::Resident(done)) if done <= at => {
                self.instruments.lead.record((at - done).as_secs_f64());
            }
            Some(Prefetched::Resident(_) | Prefetched::InFlight) => {
                self.instruments.late.increment(1);
            }
            None => {}
        }
    }

    /// Accounts the reads the planner applied since the last call (per-job opens, lead
    /// times).
    fn account(&self, applied: Vec<Applied>) {
        if applied.is_empty() {
            return;
        }
        for a in &applied {
            self.record_lead(&a.file, a.at);
        }
        let mut info = lock(&self.info);
        for a in applied {
            if let Some(j) = info.get_mut(&a.job) {
                j.usage.opens += 1;
                j.usage.opens_hit += a.hit as u64;
            }
        }
    }

    /// Applies the reads opens left for the planner, and accounts them.
    fn settle(&self) {
        drop(self.plans.planner());
        self.account(self.plans.take_applied());
    }

    /// Rebuilds the tag index from the registered jobs (the first registered job that
    /// plans a file names it).
    fn rebuild_tags(&self) {
        let mut jobs: Vec<(String, u64)> = lock(&self.info)
            .iter()
            .map(|(id, j)| (id.clone(), j.tag))
            .collect();
        jobs.sort_by_key(|(_, tag)| *tag);
        let mut tags = HashMap::new();
        for (id, tag) in jobs {
            if let Some(files) = self.files_of(&id) {
                for f in files.iter() {
                    tags.entry(f.clone()).or_insert(tag);
                }
            }
        }
        *self.tags.write().unwrap_or_else(|e| e.into_inner()) = tags;
    }

    fn poke(&self) {
        self.wake.notify();
    }

    /// Registers a manifest for the user `creds` (`operator`: root or the daemon's
    /// user), replacing a job with the same id. The error names the field and nothing
    /// changes.
    pub fn register(
        &self,
        json: &str,
        creds: &Creds,
        operator: bool,
    ) -> Result<Registered, JobError> {
        let m = Manifest::from_json(json).map_err(|e| JobError::Manifest(e.to_string()))?;
        self.may_change(&m.job, creds.uid, operator)?;
        let (root, prefix) = self
            .locate(&m.root)
            .ok_or_else(|| JobError::RootNotServed(m.root.clone()))?;
        let rel = |p: &str| {
            if prefix.is_empty() {
                p.to_owned()
            } else {
                format!("{prefix}/{p}")
            }
        };
        let mut dirs_denied = 0;
        let names: Vec<String> = match &m.files {
            Files::List(list) => list.iter().map(|f| f.path().to_owned()).collect(),
            Files::Glob { glob } => {
                let backing = &*self.roots.get(root).backing;
                // The registrant's rights, not the daemon's: a directory it may not list
                // (or reach) is not listed.
                let mut may_list = |dir: &str| {
                    Ok(operator
                        || access::may_walk(&backing.dir_owners(dir)?, creds) == Decision::Allow)
                };
                let found = crate::glob::expand(
                    backing,
                    &prefix,
                    glob,
                    shardcache_plan::manifest::MAX_FILES,
                    &mut may_list,
                )
                .map_err(JobError::Glob)?;
                dirs_denied = found.skipped_dirs;
                if found.files.is_empty() {
                    return Err(JobError::NothingMatched {
                        glob: glob.clone(),
                        root: m.root.clone(),
                        skipped_dirs: found.skipped_dirs,
                        uid: creds.uid,
                    });
                }
                found.files
            }
        };
        let files: Vec<FileRef> = names
            .iter()
            .map(|p| FileRef { root, path: rel(p) })
            .collect();
        let index: HashMap<&str, u32> = names
            .iter()
            .enumerate()
            .map(|(i, p)| (p.as_str(), i as u32))
            .collect();
        let lookup = |p: &str, e: usize, i: usize| {
            index.get(p).copied().ok_or_else(|| JobError::UnknownFile {
                epoch: e,
                item: i,
                path: p.to_owned(),
            })
        };
        let source = match &m.plan {
            Plan::Shuffle {
                seed,
                epochs,
                world_size,
                ranks,
                drop_last,
                first_epoch,
                ..
            } => Source::Shuffle {
                seed: *seed,
                first: *first_epoch,
                count: *epochs,
                world: *world_size,
                ranks: ranks.clone(),
                drop_last: *drop_last,
            },
            Plan::Sequence {
                epochs,
                first_epoch,
            } => {
                let mut orders = Vec::with_capacity(epochs.len());
                for (e, items) in epochs.iter().enumerate() {
                    let mut order = Vec::with_capacity(items.len());
                    for (i, it) in items.iter().enumerate() {
                        use shardcache_plan::manifest::FileRef as F;
                        order.push(match it {
                            Item::Index(x)
                            | Item::Range {
                                file: F::Index(x), ..
                            } => *x as u32,
                            Item::Path(p)
                            | Item::Range {
                                file: F::Path(p), ..
                            } => lookup(p, e, i)?,
                        });
                    }
                    orders.push(Arc::new(order));
                }
                Source::Sequence {
                    first: *first_epoch,
                    epochs: orders,
                }
            }
        };
        if let Files::List(list) = &m.files {
            let mut sizes = lock(&self.sizes);
            for (f, spec) in files.iter().zip(list) {
                if let Some(size) = spec.size() {
                    sizes.insert(f.clone(), size);
                }
            }
        }
        let n = files.len();
        let immutable = m.immutable.then(|| Arc::new(files.clone()));
        self.plans
            .planner()
            .register(&m.job, files, source)
            .map_err(JobError::Plan)?;
        let immutable = immutable.map(|f| {
            let hold = Hold::new(if operator {
                Voucher::Operator
            } else {
                Voucher::User(creds.uid)
            });
            let held = self
                .meta
                .hold(f.iter().map(|x| (x.root, x.path.as_str())), &hold);
            (f, held, hold)
        });
        let registered = Registered {
            job: m.job.clone(),
            files: n,
            dirs_denied,
            immutable_held: immutable.as_ref().map_or(0, |i| i.1),
            immutable_over_limit: immutable.as_ref().map_or(0, |i| n - i.1),
            immutable_owner_only: immutable.is_some() && !operator,
        };
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let done = self.plans.planner().steps_done(&m.job).unwrap_or(0);
        let old = lock(&self.info).insert(
            m.job.clone(),
            JobInfo {
                creds: creds.clone(),
                operator,
                files: n,
                immutable,
                dirs_denied: dirs_denied as u64,
                denied: HashSet::new(),
                tag,
                usage: Usage::default(),
                rate_mark: (done, Instant::now()),
                rate: None,
            },
        );
        if let Some(old) = old {
            self.release(&old);
        }
        self.rebuild_tags();
        tracing::info!(
            job = %m.job,
            files = n,
            uid = creds.uid,
            dirs_denied,
            "prefetch manifest registered"
        );
        self.poke();
        Ok(registered)
    }

    /// The root containing directory `abs` and the path of `abs` inside it.
    fn locate(&self, abs: &str) -> Option<(usize, String)> {
        let abs = abs.trim_end_matches('/');
        self.roots.all().iter().enumerate().find_map(|(i, r)| {
            let root = r.name.trim_end_matches('/');
            if abs == root {
                Some((i, String::new()))
            } else {
                abs.strip_prefix(root)?
                    .strip_prefix('/')
                    .map(|p| (i, p.to_owned()))
            }
        })
    }

    /// Forgets a job; true if it was registered.
    /// Whether user `uid` (`operator`: root or the daemon's user) may replace, unregister
    /// or move job `job`: its registrant and operators may; a job not registered may be
    /// registered by anyone. The error says who may.
    pub fn may_change(&self, job: &str, uid: u32, operator: bool) -> Result<(), JobError> {
        match lock(&self.info).get(job) {
            Some(j) if !access::may_change_job(j.creds.uid, uid, operator) => {
                Err(JobError::NotYours {
                    job: job.to_owned(),
                    owner: j.creds.uid,
                })
            }
            _ => Ok(()),
        }
    }

    pub fn unregister(&self, job: &str) -> bool {
        self.plans.slots().remove(job);
        if let Some(old) = lock(&self.info).remove(job) {
            self.release(&old);
        }
        let found = self.plans.planner().unregister(job);
        self.rebuild_tags();
        if found {
            tracing::info!(job, "prefetch manifest unregistered");
        }
        found
    }

    /// Computes this node's slots for every shuffle that has none yet, and gives each
    /// its cluster layout as the peers report it (none until every rank's node and
    /// every node's slots are known: eviction and fetches then go by ownership).
    fn update_layouts(&self, store: &Store) {
        let Some(peers) = &self.peers else {
            return;
        };
        let shuffles = self.plans.planner().shuffles();
        let n = shuffles.len() as u64;
        let me = peers.view().1;
        for (job, world, _) in shuffles {
            if !self.plans.slots().contains_key(&job) {
                let Some(files) = self.files_of(&job) else {
                    continue;
                };
                // The mean size over up to 16 files spread over the manifest.
                let every = (files.len() / 16).max(1);
                let sizes: Vec<u64> = files
                    .iter()
                    .step_by(every)
                    .take(16)
                    .filter_map(|f| self.size_of(f))
                    .collect();
                if sizes.is_empty() {
                    continue;
                }
                let mean = (sizes.iter().sum::<u64>() / sizes.len() as u64).max(1);
                let slots = (store.capacity() / n.max(1) / mean).max(1);
                tracing::debug!(job = %job, slots, mean, "cluster placement: this node's slots");
                self.plans.slots().insert(
                    job.clone(),
                    Slots {
                        files: slots,
                        mean_size: mean,
                    },
                );
            }
            let Some(layout) = peers.layout(&job, world) else {
                self.plans.planner().set_layout(&job, None, &me);
                continue;
            };
            let made = self.plans.planner().placement_for(&job, layout, &me);
            if let Some((mut p, target)) = made {
                // The replay from the start of the plan, without the planner lock.
                p.advance(target);
                self.plans.planner().install_placement(&job, p);
            }
        }
    }

    fn release(&self, job: &JobInfo) {
        if let Some((files, held, hold)) = &job.immutable {
            self.meta
                .release(files.iter().map(|x| (x.root, x.path.as_str())), *held, hold);
        }
    }

    /// The metadata of planned file `f` as a registrant of a job reading it sees it, if
    /// one of them may read it (an operator's job always may): what a prefetch of `f`
    /// may fetch. Each job whose registrant may not read it counts it (and stops
    /// counting it once it may). `None`: no fetch.
    fn stat_for_plan(&self, meta: &Meta, f: &FileRef) -> Option<Arc<Stat>> {
        let readers = self.plans.planner().readers_of(f);
        let who: Vec<(String, u32, Creds, bool)> = {
            let info = lock(&self.info);
            readers
                .into_iter()
                .filter_map(|(job, i)| {
                    let j = info.get(&job)?;
                    Some((job, i, j.creds.clone(), j.operator))
                })
                .collect()
        };
        // Stat'ed without a lock held (it may go to the backing store).
        let mut allowed = None;
        let mut verdicts = Vec::with_capacity(who.len());
        for (job, i, creds, operator) in who {
            let ok = if operator {
                allowed = allowed.or_else(|| meta.stat(f.root, &f.path).ok());
                true
            } else {
                match meta.stat_for(f.root, &f.path, creds.uid) {
                    Ok(st) if access::check(&st, &creds) == Decision::Allow => {
                        allowed = allowed.or(Some(st));
                        true
                    }
                    Ok(_) => false,
                    // Gone or unreadable for the daemon itself: not the registrant's
                    // denial.
                    Err(_) => true,
                }
            };
            verdicts.push((job, i, ok));
        }
        let mut info = lock(&self.info);
        for (job, i, ok) in verdicts {
            if let Some(j) = info.get_mut(&job) {
                if ok {
                    j.denied.remove(&i);
                } else if j.denied.insert(i) {
                    tracing::debug!(job, path = %f.path, uid = j.creds.uid, "not prefetched: its registrant may not read it");
                }
            }
        }
        allowed
    }

    /// Sets a job's position explicitly: `Ok(false)` when no such job is registered; an
    /// error when the position is not in its plan (nothing changes).
    pub fn progress(&self, job: &str, epoch: u64, step: u64) -> Result<bool, JobError> {
        let found = self
            .plans
            .planner()
            .set_position(job, epoch, step)
            .map_err(JobError::Position)?;
        self.poke();
        Ok(found)
    }

    /// The ids of the registered jobs, sorted.
    pub fn ids(&self) -> Vec<String> {
        lock(&self.info).keys().cloned().collect()
    }

    /// The files of job `id`, in manifest order; `None` when no such job is registered.
    pub fn files_of(&self, id: &str) -> Option<Arc<Vec<FileRef>>> {
        self.plans.planner().job_files(id)
    }

    /// The size of `f` when a manifest declared it or the daemon stat'ed it since
    /// (never goes to the backing store).
    pub fn known_size(&self, f: &FileRef) -> Option<u64> {
        lock(&self.sizes).get(f).copied()
    }

    /// Which of `files` some registered job plans (one planner lock for all).
    pub fn planned(&self, files: &[FileRef]) -> Vec<bool> {
        let p = self.plans.planner();
        files.iter().map(|f| p.is_planned(f)).collect()
    }

    /// True when some job is registered.
    fn any(&self) -> bool {
        !lock(&self.info).is_empty()
    }

    /// A client opened `rel` under root `root` (`hit`: cached whole). Returns the tag of
    /// the job whose plan names the file (0: none), under which the client reports the
    /// read. Takes no planner lock: the read is left for the planner
    /// ([`Deferred::Access`]), which the prefetcher (woken here) applies and accounts
    /// before it plans again; without a running prefetcher, it is applied here.
    pub fn on_open(&self, root: usize, rel: &str, hit: bool) -> u64 {
        if !self.any() {
            return 0;
        }
        let f = FileRef {
            root,
            path: rel.to_owned(),
        };
        let tag = self
            .tags
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&f)
            .copied()
            .unwrap_or(0);
        self.plans.defer(Deferred::Access {
            file: f,
            hit,
            at: Instant::now(),
        });
        if self.prefetcher_alive() {
            self.poke();
        } else {
            self.settle();
        }
        tag
    }

    /// Adds what a client reported about its reads, per job tag.
    pub fn add_usage(&self, reports: &[pb::JobUsage]) {
        if reports.is_empty() {
            return;
        }
        let mut info = lock(&self.info);
        for r in reports {
            if let Some(j) = info.values_mut().find(|j| j.tag == r.job_tag) {
                let u = &mut j.usage;
                u.hit_bytes += r.hit_bytes;
                u.filled_bytes += r.filled_bytes;
                u.fallback_bytes += r.fallback_bytes;
                u.wait_ns += r.wait_ns;
                u.fallback_ns += r.fallback_ns;
            }
        }
    }

    /// Measures every job's consumption rate (steps per second) and hands it to the
    /// planner, which then compares needs across jobs in seconds. A job that read
    /// nothing in a period keeps its last rate (a pause is not a slowdown).
    fn measure_rates(&self) {
        let mut p = self.plans.planner();
        let mut info = lock(&self.info);
        for (id, j) in info.iter_mut() {
            let (done0, at) = j.rate_mark;
            let dt = at.elapsed();
            if dt < RATE_PERIOD {
                continue;
            }
            let done = p.steps_done(id).unwrap_or(done0);
            if done > done0 {
                let r = (done - done0) as f64 / dt.as_secs_f64();
                let r = j.rate.map_or(r, |old| old + 0.5 * (r - old));
                j.rate = Some(r);
                p.set_rate(id, r);
            }
            j.rate_mark = (done, Instant::now());
        }
    }

    /// The size of planned file `f`: known, or stat'ed now (not under the planner lock)
    /// and remembered.
    pub fn size_of(&self, f: &FileRef) -> Option<u64> {
        if let Some(&s) = lock(&self.sizes).get(f) {
            return Some(s);
        }
        let size = self.meta.stat(f.root, &f.path).ok()?.version.size;
        let mut sizes = lock(&self.sizes);
        if sizes.len() > 1 << 20 {
            sizes.clear();
        }
        sizes.insert(f.clone(), size);
        Some(size)
    }

    /// Status of every job; `cached(root, path)` says whether a file is cached whole and
    /// `capacity` is the cache's. A job's readiness window is what it reads next, to the
    /// end of its current epoch (the next epoch, at a job's start), as far as the cache
    /// can hold it, at most 4096 files.
    pub fn status(
        &self,
        cached: &dyn Fn(usize, &str) -> bool,
        capacity: u64,
    ) -> Vec<pb::JobStatus> {
        self.settle();
        let info: Vec<(String, usize, Usage, Option<f64>, Left)> = lock(&self.info)
            .iter()
            .map(|(k, v)| (k.clone(), v.files, v.usage, v.rate, Left::of(v)))
            .collect();
        let prefetching = self.prefetching.load(Ordering::Relaxed);
        let mut out = Vec::new();
        for (job, files, u, rate, left) in info {
            let (pos, len, upcoming, placed) = {
                let mut p = self.plans.planner();
                let placed = p.placement_status(&job).unwrap_or_default();
                let pos = p.position(&job).unwrap_or_default();
                let len = p.epoch_len(&job).unwrap_or_default();
                let left = (len as u64).saturating_sub(pos.1).max(1) as usize;
                (
                    pos,
                    len,
                    p.upcoming_of(&job, left.min(STATUS_WINDOW)),
                    placed,
                )
            };
            let (mut window, mut window_bytes, mut resident, mut resident_bytes) = (0, 0, 0, 0);
            for f in &upcoming {
                let size = self.size_of(f).unwrap_or(0);
                if window > 0 && window_bytes + size > capacity {
                    break;
                }
                window += 1;
                window_bytes += size;
                if cached(f.root, &f.path) {
                    resident += 1;
                    resident_bytes += size;
                }
            }
            out.push(pb::JobStatus {
                job,
                epoch: pos.0,
                step: pos.1,
                epoch_len: len as u64,
                files: files as u64,
                window,
                window_resident: resident,
                window_bytes,
                window_resident_bytes: resident_bytes,
                hit_bytes: u.hit_bytes,
                filled_bytes: u.filled_bytes,
                fallback_bytes: u.fallback_bytes,
                opens: u.opens,
                opens_hit: u.opens_hit,
                wait_seconds: u.wait_ns as f64 / 1e9,
                fallback_seconds: u.fallback_ns as f64 / 1e9,
                rate: rate.unwrap_or(0.0),
                prefetching,
                placement_nodes: placed.0,
                placement_slots: placed.1,
                placement_here: placed.2,
                placement_departing: placed.3,
                files_denied: left.files_denied,
                dirs_denied: left.dirs_denied,
                immutable_not_owned: left.immutable_not_owned,
                immutable_over_limit: left.immutable_over_limit,
            });
        }
        out
    }

    /// True when every registered job's rate has been measured.
    fn rates_known(&self) -> bool {
        lock(&self.info).values().all(|j| j.rate.is_some())
    }
}
mod prefetcher;
pub use prefetcher::PrefetchConfig;

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::backing::mem::MemBacking;
    use crate::meta::test_support::one_root;

    fn jobs() -> Arc<Jobs> {
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
        let creds = Creds {
            pid: 1,
            uid: 0,
            gid: 0,
            groups: Vec::new(),
        };
        jobs.register(&m, &creds, true).unwrap();
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
}
