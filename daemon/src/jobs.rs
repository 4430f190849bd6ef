//! Registered jobs: their manifests feed the [`Planner`], which then decides eviction
//! (through [`PlannedPolicy`], the store's eviction policy) and prefetch (the thread
//! started by [`Jobs::start_prefetcher`]). Reads move a job's position (`on_open`), and
//! so does an explicit progress report.
//!
//! Locking: the planner lock is never held while the store's index lock is taken by
//! this module; the store calls into the planner (through the policy) with its own lock
//! held, so the order is always store → planner.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use shardcache_plan::manifest::{Files, Item, Manifest, Plan};
use shardcache_proto::local::v1 as pb;

use crate::fill::{Filler, Priority, Target};
use crate::meta::{Meta, Roots};
use crate::planner::prefetch::{self, CacheView, Pace};
use crate::planner::{FileRef, Planner, Source};
use crate::store::evict::{EvictionPolicy, Lru};
use crate::store::{Key, Store};

/// How far ahead of a job's position a read may be and still count as its next read.
const READ_WINDOW: u64 = 64;
/// Upcoming files the prefetcher and the status look at.
const LOOKAHEAD: usize = 256;
/// Files shown as a job's "next window" in status.
const STATUS_WINDOW: usize = 64;

#[derive(Debug)]
struct JobInfo {
    files: usize,
}

/// The registered jobs and their planner.
#[derive(Debug)]
pub struct Jobs {
    roots: Arc<Roots>,
    /// Root index by root name (store entries name their root).
    root_index: HashMap<String, usize>,
    planner: Mutex<Planner>,
    info: Mutex<BTreeMap<String, JobInfo>>,
    wake: (Mutex<bool>, Condvar),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Jobs {
    /// No jobs yet.
    pub fn new(roots: Arc<Roots>) -> Self {
        let root_index = roots
            .all()
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.clone(), i))
            .collect();
        Self {
            roots,
            root_index,
            planner: Mutex::new(Planner::new()),
            info: Mutex::new(BTreeMap::new()),
            wake: (Mutex::new(false), Condvar::new()),
        }
    }

    fn poke(&self) {
        *lock(&self.wake.0) = true;
        self.wake.1.notify_all();
    }

    /// Registers a manifest (replacing a job with the same id). The error names the
    /// field and nothing changes.
    pub fn register(&self, json: &str) -> Result<(String, usize), String> {
        let m = Manifest::from_json(json).map_err(|e| e.to_string())?;
        let (root, prefix) = self.locate(&m.root).ok_or_else(|| {
            format!(
                "root: {} is not under a backing root of this daemon",
                m.root
            )
        })?;
        let Files::List(list) = &m.files else {
            return Err("files.glob: not supported by this daemon yet; list the files".into());
        };
        let rel = |p: &str| {
            if prefix.is_empty() {
                p.to_owned()
            } else {
                format!("{prefix}/{p}")
            }
        };
        let files: Vec<FileRef> = list
            .iter()
            .map(|f| FileRef {
                root,
                path: rel(f.path()),
            })
            .collect();
        let index: HashMap<&str, u32> = list
            .iter()
            .enumerate()
            .map(|(i, f)| (f.path(), i as u32))
            .collect();
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
            } => Source::Sequence {
                first: *first_epoch,
                epochs: epochs
                    .iter()
                    .map(|items| {
                        Arc::new(
                            items
                                .iter()
                                .map(|it| match it {
                                    Item::Index(i) => *i as u32,
                                    Item::Path(p) => index[p.as_str()],
                                    Item::Range { file, .. } => match file {
                                        shardcache_plan::manifest::FileRef::Index(i) => *i as u32,
                                        shardcache_plan::manifest::FileRef::Path(p) => {
                                            index[p.as_str()]
                                        }
                                    },
                                })
                                .collect(),
                        )
                    })
                    .collect(),
            },
        };
        let n = files.len();
        lock(&self.planner)
            .register(&m.job, files, source)
            .map_err(|e| format!("plan: {e}"))?;
        lock(&self.info).insert(m.job.clone(), JobInfo { files: n });
        tracing::info!(job = %m.job, files = n, "prefetch manifest registered");
        self.poke();
        Ok((m.job, n))
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
    pub fn unregister(&self, job: &str) -> bool {
        lock(&self.info).remove(job);
        lock(&self.planner).unregister(job)
    }

    /// Sets a job's position explicitly.
    pub fn progress(&self, job: &str, epoch: u64, step: u64) -> bool {
        let found = lock(&self.planner).set_position(job, epoch, step);
        self.poke();
        found
    }

    /// A client opened `rel` under root `root`.
    pub fn on_open(&self, root: usize, rel: &str) {
        if lock(&self.info).is_empty() {
            return;
        }
        lock(&self.planner).on_access(
            &FileRef {
                root,
                path: rel.to_owned(),
            },
            READ_WINDOW,
        );
        self.poke();
    }

    /// Status of every job; `cached(root, path)` says whether a file is cached.
    pub fn status(&self, cached: &dyn Fn(usize, &str) -> bool) -> Vec<pb::JobStatus> {
        let info: Vec<(String, usize)> = lock(&self.info)
            .iter()
            .map(|(k, v)| (k.clone(), v.files))
            .collect();
        let mut out = Vec::new();
        for (job, files) in info {
            let (pos, len, window) = {
                let mut p = lock(&self.planner);
                let pos = p.position(&job).unwrap_or_default();
                let len = p.epoch_len(&job).unwrap_or_default();
                (pos, len, p.upcoming_of(&job, STATUS_WINDOW))
            };
            let resident = window.iter().filter(|f| cached(f.root, &f.path)).count();
            out.push(pb::JobStatus {
                job,
                epoch: pos.0,
                step: pos.1,
                epoch_len: len as u64,
                files: files as u64,
                window: window.len() as u64,
                window_resident: resident as u64,
            });
        }
        out
    }

    /// Starts the prefetch thread: it fetches what the planner says is needed next, as
    /// far ahead as the planner's rules allow. Stop it with the returned flag.
    pub fn start_prefetcher(
        self: &Arc<Self>,
        store: Arc<Store>,
        filler: Arc<Filler>,
        meta: Arc<Meta>,
        ahead: usize,
    ) -> std::io::Result<(Arc<AtomicBool>, JoinHandle<()>)> {
        let stop = Arc::new(AtomicBool::new(false));
        let (jobs, s) = (self.clone(), stop.clone());
        let h = std::thread::Builder::new()
            .name("sc-prefetch".into())
            .spawn(move || jobs.prefetch_loop(&store, &filler, &meta, &s, ahead))?;
        Ok((stop, h))
    }

    /// Wakes the prefetch thread so that it sees `stop`.
    pub fn stop_prefetcher(&self) {
        self.poke();
    }

    /// Keeps at most `ahead` files prefetched and not yet read.
    fn prefetch_loop(
        &self,
        store: &Store,
        filler: &Filler,
        meta: &Meta,
        stop: &AtomicBool,
        ahead_max: usize,
    ) {
        let mut in_flight: HashMap<FileRef, Instant> = HashMap::new();
        // Prefetched (or being prefetched) and not yet read: the planner's read count at
        // which each will have been read.
        let mut ahead: HashMap<FileRef, u64> = HashMap::new();
        while !stop.load(Ordering::Acquire) {
            {
                let mut woken = lock(&self.wake.0);
                if !*woken {
                    woken = self
                        .wake
                        .1
                        .wait_timeout(woken, Duration::from_millis(20))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                *woken = false;
            }
            if lock(&self.info).is_empty() {
                continue;
            }
            // A snapshot of the store, taken without the planner lock.
            let resident: Vec<FileRef> = store
                .cached_files()
                .into_iter()
                .filter_map(|(root, path, _)| {
                    self.root_index
                        .get(&root)
                        .map(|&r| FileRef { root: r, path })
                })
                .collect();
            in_flight
                .retain(|f, at| at.elapsed() < Duration::from_secs(30) && !resident.contains(f));
            let mut view = Snapshot {
                resident: resident.iter().cloned().collect(),
                order: resident,
                in_flight: in_flight.keys().cloned().collect(),
                room: store.room(),
                meta,
            };
            let mut fetches = Vec::new();
            {
                let mut p = lock(&self.planner);
                let reads = p.reads();
                ahead.retain(|_, due| reads < *due);
                let pace = Pace {
                    max_ahead: LOOKAHEAD,
                    secs_per_file: f64::INFINITY,
                    margin: 0.0,
                };
                while ahead.len() + fetches.len() < ahead_max {
                    let Some(fx) = prefetch::next_prefetch(&mut p, &view, pace) else {
                        break;
                    };
                    if let Some(v) = &fx.evict {
                        view.resident.remove(v);
                        view.order.retain(|x| x != v);
                        view.room += view.size(v);
                    }
                    view.room = view.room.saturating_sub(view.size(&fx.file));
                    view.in_flight.insert(fx.file.clone());
                    let steps = match fx.need {
                        crate::planner::Need::In(t) => t.ceil() as u64,
                        crate::planner::Need::Never => 0,
                    };
                    ahead.insert(fx.file.clone(), p.reads() + steps + 1);
                    fetches.push(fx.file);
                }
            }
            for f in fetches {
                let Ok(stat) = meta.stat(f.root, &f.path) else {
                    continue;
                };
                let root_name = &self.roots.get(f.root).name;
                let key = Key::of(root_name, &stat.path, &stat.version);
                let nblocks = stat.version.size.div_ceil(store.block_size() as u64) as usize;
                let target = Arc::new(Target {
                    root: f.root,
                    rel: f.path.clone(),
                    stat,
                    key,
                });
                tracing::debug!(path = %f.path, "prefetching");
                for i in 0..nblocks.max(1) {
                    filler.request(&target, i, Priority::Prefetch);
                }
                in_flight.insert(f, Instant::now());
            }
        }
    }
}

/// The store as the prefetcher saw it this round.
struct Snapshot<'a> {
    resident: HashSet<FileRef>,
    order: Vec<FileRef>,
    in_flight: HashSet<FileRef>,
    room: u64,
    meta: &'a Meta,
}

impl Snapshot<'_> {
    fn size(&self, f: &FileRef) -> u64 {
        self.meta
            .stat(f.root, &f.path)
            .map(|s| s.version.size)
            .unwrap_or(u64::MAX / 4)
    }
}

impl CacheView for Snapshot<'_> {
    fn resident(&self) -> Vec<FileRef> {
        self.order.clone()
    }
    fn is_resident(&self, f: &FileRef) -> bool {
        self.resident.contains(f)
    }
    fn in_flight(&self, f: &FileRef) -> bool {
        self.in_flight.contains(f)
    }
    fn has_room(&self, f: &FileRef) -> bool {
        self.size(f) <= self.room
    }
}

/// The store's eviction policy when jobs are registered: the planner's choice (the file
/// needed farthest in the future; files no plan needs go first, least recently used
/// first) and its admission rule. Without jobs it is plain LRU.
#[derive(Debug)]
pub struct PlannedPolicy {
    lru: Lru,
    files: HashMap<Key, FileRef>,
    jobs: Arc<Jobs>,
}

impl PlannedPolicy {
    /// A policy consulting `jobs`.
    pub fn new(jobs: Arc<Jobs>) -> Self {
        Self {
            lru: Lru::default(),
            files: HashMap::new(),
            jobs,
        }
    }

    fn planned(&self) -> bool {
        !lock(&self.jobs.info).is_empty()
    }
}

impl EvictionPolicy for PlannedPolicy {
    fn insert(&mut self, key: Key, root: &str, path: &str) {
        self.lru.insert(key, root, path);
        if let Some(&r) = self.jobs.root_index.get(root) {
            self.files.insert(
                key,
                FileRef {
                    root: r,
                    path: path.to_owned(),
                },
            );
        }
    }

    fn touch(&mut self, key: Key) {
        self.lru.touch(key);
    }

    fn remove(&mut self, key: &Key) {
        self.lru.remove(key);
        self.files.remove(key);
    }

    fn victim(&mut self, evictable: &dyn Fn(&Key) -> bool) -> Option<Key> {
        if !self.planned() {
            return self.lru.victim(evictable);
        }
        let candidates: Vec<Key> = self
            .lru
            .order()
            .into_iter()
            .filter(|k| evictable(k))
            .collect();
        let refs: Vec<FileRef> = candidates
            .iter()
            .map(|k| {
                self.files.get(k).cloned().unwrap_or(FileRef {
                    root: usize::MAX,
                    path: String::new(),
                })
            })
            .collect();
        let i = lock(&self.jobs.planner).victim(&refs)?;
        Some(candidates[i])
    }

    fn admits(&mut self, root: &str, path: &str, victim: &Key, prefetch: bool) -> bool {
        if !self.planned() {
            return true;
        }
        let (Some(&r), Some(v)) = (self.jobs.root_index.get(root), self.files.get(victim)) else {
            return true;
        };
        let mut p = lock(&self.jobs.planner);
        let f = FileRef {
            root: r,
            path: path.to_owned(),
        };
        let incoming = p.need(&f);
        if !p.need(v).later_than(incoming) {
            return false; // everything cached is needed sooner: bypass
        }
        // A prefetch decided a moment ago is checked again against the epoch rule.
        !prefetch || {
            let epoch = p.use_epoch(&f);
            p.may_evict_for_prefetch(v, epoch)
        }
    }

    fn order(&self) -> Vec<Key> {
        self.lru.order()
    }
}
