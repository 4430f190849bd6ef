//! The prefetch task: it fetches what the planner says is needed next, as far ahead as
//! the planner's rules and its bounds allow (files ahead, fetches in flight, bytes and
//! files per second), paced by the jobs' measured rates and the backing store's
//! throughput. Event-driven: it sleeps on a [`Wake`] that reads, registrations and the
//! end of every fetch it started notify, else until a backoff or budget runs out.
//!
//! Owns: the prefetch loop and its per-round view of the store ([`Snapshot`]). Decides
//! nothing the planner decides (what is needed when, what may be evicted for it); asks
//! the fill engine for blocks and nothing of the store's internals.

use super::*;
use crate::planner::prefetch::{self, CacheView, Pace};

/// How long a prefetch the store declined (no room worth making) is not retried.
const DECLINED_BACKOFF: Duration = Duration::from_secs(1);
/// The same for a copy the cluster placement gives this node.
const PLACED_BACKOFF: Duration = Duration::from_millis(50);
/// Most prefetched files remembered until their first open (for the lead time); past it
/// the record is cleared (files prefetched and evicted unread would pile up otherwise).
const MAX_PREFETCHED: usize = 1 << 16;
/// How long a file no registrant of a job reading it may read is not looked at again
/// (a chmod that grants access is noticed this late by prefetch; reads are unaffected).
const DENIED_BACKOFF: Duration = Duration::from_secs(10);
/// Longest the prefetcher sleeps without an event (a read, a registration, the end of
/// a fetch it started, a backoff or budget running out): a heartbeat for what has no
/// event of its own (the peers' layouts, pins expiring, free space coming back).
const HEARTBEAT: Duration = Duration::from_millis(250);

/// How the prefetcher runs (from the daemon's configuration).
#[derive(Debug, Clone, Copy)]
pub struct PrefetchConfig {
    /// Most files fetched ahead of their readers and not yet read.
    pub ahead: usize,
    /// Most files being fetched at once.
    pub concurrency: usize,
    /// Most bytes per second prefetch reads from the backing store.
    pub bandwidth: Option<u64>,
    /// Most files per second prefetch opens on the backing store.
    pub ops: Option<u64>,
}

impl Jobs {
    /// Starts the prefetch thread: it fetches what the planner says is needed next, as
    /// far ahead as the planner's rules and `cfg` allow. Stopping the task wakes it.
    pub fn start_prefetcher(
        self: &Arc<Self>,
        store: Arc<Store>,
        filler: Arc<Filler>,
        meta: Arc<Meta>,
        cfg: PrefetchConfig,
    ) -> std::io::Result<Task> {
        let jobs = self.clone();
        let task = Task::spawn("sc-prefetch", self.prefetcher_alive.clone(), move |stop| {
            jobs.prefetch_loop(&store, &filler, &meta, stop, cfg);
        })?;
        let jobs = Arc::downgrade(self);
        Ok(task.with_wake(move || {
            if let Some(j) = jobs.upgrade() {
                j.poke();
            }
        }))
    }

    /// The prefetcher. Every round (woken by a read, a registration, the end of a fetch
    /// it started, or a backoff or budget running out; at the latest after
    /// [`HEARTBEAT`]): measure rates,
    /// collect finished fetches, then start fetches the planner asks for
    /// ([`prefetch::next_prefetch`]) while under the concurrency, lead and bandwidth
    /// bounds. Pacing: once the consumption rates and the backing store's throughput are
    /// measured, a file is fetched only when some upcoming missing file needs the
    /// backing store to start now ([`Pace`]); before, as early as the rules allow.
    fn prefetch_loop(
        &self,
        store: &Store,
        filler: &Filler,
        meta: &Meta,
        stop: &Stop,
        cfg: PrefetchConfig,
    ) {
        let mut flights: HashMap<FileRef, Vec<Arc<Flight>>> = HashMap::new();
        let mut declined: HashMap<FileRef, Instant> = HashMap::new();
        // Files no registrant of a job reading them may read, and since when; checked
        // again after a while, or when a job is registered (its registrant may read them).
        let mut denied: HashMap<FileRef, Instant> = HashMap::new();
        let mut registrations = 0;
        // Prefetched (or being prefetched) and not yet read: the planner's read count at
        // which each will have been read.
        let mut ahead: HashMap<FileRef, u64> = HashMap::new();
        let budget = cfg.bandwidth.map(prefetch_budget);
        let ops = cfg.ops.map(prefetch_budget);
        while !stop.is_stopped() {
            // Sleep until an event: a read or registration (`poke`), the end of a fetch
            // started here (the fill engine), or the first backoff or budget that runs
            // out; a fetch that already ended (declined at once) is collected now.
            if !flights.values().flatten().any(|f| f.outcome().is_some()) {
                let mut sleep = HEARTBEAT;
                for at in declined.values() {
                    sleep = sleep.min(DECLINED_BACKOFF.saturating_sub(at.elapsed()));
                }
                for at in denied.values() {
                    sleep = sleep.min(DENIED_BACKOFF.saturating_sub(at.elapsed()));
                }
                for b in [&budget, &ops].into_iter().flatten() {
                    sleep = sleep.min(b.until_allowed());
                }
                if sleep.is_zero() {
                    // Something is due now: collect it, but never spin.
                    sleep = Duration::from_millis(1);
                }
                self.wake.wait(sleep);
            }
            // The reads opens left for the planner, before planning on it.
            self.settle();
            if !self.any() {
                flights.clear();
                ahead.clear();
                denied.clear();
                self.prefetched.lock().clear();
                self.prefetching.store(0, Ordering::Relaxed);
                continue;
            }
            self.measure_rates();
            self.update_layouts(store);
            flights.retain(|f, fl| {
                let outcomes: Vec<Option<FillOutcome>> = fl.iter().map(|x| x.outcome()).collect();
                if outcomes.iter().any(Option::is_none) {
                    return true;
                }
                let mut prefetched = self.prefetched.lock();
                // Declined (no room worth making, moved, stalled) or failed: backed off
                // alike, and asked for again later.
                if outcomes.iter().flatten().any(|o| !o.landed()) {
                    // A copy the cluster placement gives this node is asked for again
                    // soon (it was turned away while exchanges were under way: the
                    // room comes back as peers take their copies).
                    let now = Instant::now();
                    let at = if self.plans.planner().is_mine(f) {
                        now.checked_sub(DECLINED_BACKOFF - PLACED_BACKOFF)
                            .unwrap_or(now)
                    } else {
                        now
                    };
                    declined.insert(f.clone(), at);
                    prefetched.remove(f);
                } else if let Some(p) = prefetched.get_mut(f) {
                    // Resident now (the fill engine woke this round as the last block
                    // landed). Not when the job already opened it: that open counted a
                    // late prefetch.
                    *p = Prefetched::Resident(Instant::now());
                }
                false
            });
            declined.retain(|_, at| at.elapsed() < DECLINED_BACKOFF);
            let now_registered = self.next_tag.load(Ordering::Relaxed);
            if now_registered != registrations {
                registrations = now_registered;
                denied.clear();
            }
            denied.retain(|_, at| at.elapsed() < DENIED_BACKOFF);
            self.prefetching
                .store(flights.len() as u64, Ordering::Relaxed);
            if flights.len() >= cfg.concurrency {
                continue;
            }
            // Sizes of the upcoming files, looked up without the planner lock (a stat
            // may go to the backing store).
            let upcoming = self.plans.planner().upcoming(LOOKAHEAD);
            for (f, _) in &upcoming {
                self.size_of(f);
            }
            let room = store.room();
            let sizes = self.sizes.lock();
            let mut view = Snapshot {
                evicted: HashSet::new(),
                busy: flights
                    .keys()
                    .chain(declined.keys())
                    .chain(denied.keys())
                    .cloned()
                    .collect(),
                room,
                sizes: &sizes,
                default_size: store.block_size() as u64,
            };
            let pace = match filler.service() {
                Some(s) if self.rates_known() && !upcoming.is_empty() => {
                    let mean = upcoming
                        .iter()
                        .map(|(f, _)| view.size(f) as f64)
                        .sum::<f64>()
                        / upcoming.len() as f64;
                    Pace {
                        max_ahead: LOOKAHEAD,
                        secs_per_file: mean / s.throughput,
                        // Room for the measurement to be off, and for a burst of reads.
                        margin: 0.25 + 4.0 * s.latency,
                    }
                }
                _ => Pace {
                    max_ahead: LOOKAHEAD,
                    secs_per_file: f64::INFINITY,
                    margin: 0.0,
                },
            };
            let mut fetches = Vec::new();
            let mut claims: Vec<FileRef> = Vec::new();
            let reads = {
                let mut p = self.plans.planner();
                let reads = p.reads();
                ahead.retain(|_, due| reads < *due);
                // First what the cluster placement moved here (the reads of the next
                // rounds, and copies parked here), from the nodes that hold them.
                let (moved, here) = p.incoming(cfg.concurrency);
                claims.extend(here);
                for f in moved {
                    if flights.len() + fetches.len() >= cfg.concurrency {
                        break;
                    }
                    if view.busy.insert(f.clone()) {
                        fetches.push(f);
                    }
                }
                reads
            };
            while ahead.len() + fetches.len() < cfg.ahead
                && flights.len() + fetches.len() < cfg.concurrency
                && budget.as_ref().is_none_or(TokenBucket::allows)
                && ops.as_ref().is_none_or(TokenBucket::allows)
            {
                // The planner lock for one decision at a time: a fill that needs it (under
                // the store's index lock, which opens take) waits for one decision, never
                // for the whole round.
                let mut p = self.plans.planner();
                let Some(fx) = prefetch::next_prefetch(&mut p, &view, pace) else {
                    break;
                };
                let steps = p.steps_until(&fx.file).unwrap_or(0);
                drop(p);
                let size = view.size(&fx.file);
                if let Some(v) = &fx.evict {
                    view.room += view.size(v);
                    view.evicted.insert(v.clone());
                }
                view.room = view.room.saturating_sub(size);
                view.busy.insert(fx.file.clone());
                if let Some(b) = &budget {
                    b.charge(size);
                }
                if let Some(o) = &ops {
                    o.charge(1);
                }
                ahead.insert(fx.file.clone(), reads + steps + 1);
                fetches.push(fx.file);
            }
            drop(view);
            drop(sizes);
            if let Some(peers) = &self.peers {
                for f in claims {
                    let root = &self.roots.get(f.root).name;
                    if !store.is_cached(root, &f.path) {
                        // Part of it only: the rest is fetched now.
                        if !flights.contains_key(&f) && !fetches.contains(&f) {
                            fetches.push(f);
                        }
                    } else if let Ok(stat) = meta.stat(f.root, &f.path) {
                        peers.release(root, &stat);
                    }
                }
            }
            for f in fetches {
                // Fetched (from the backing store or a peer) only if a registrant of a
                // job reading it could read it.
                let Some(stat) = self.stat_for_plan(meta, &f) else {
                    ahead.remove(&f);
                    denied.insert(f, Instant::now());
                    continue;
                };
                let root_name = &self.roots.get(f.root).name;
                let key = Key::of(root_name, &stat.path, &stat.version);
                let nblocks = stat.version.size.div_ceil(store.block_size() as u64) as usize;
                let target = Arc::new(Target {
                    peer_ok: true,
                    root: f.root,
                    rel: f.path.clone(),
                    stat,
                    key,
                });
                tracing::debug!(path = %f.path, "prefetching");
                let mut fl = Vec::new();
                for i in 0..nblocks.max(1) {
                    match filler.request(&target, i, Priority::Prefetch) {
                        Scheduled::InFlight(x) => fl.push(x),
                        Scheduled::Present => {}
                        Scheduled::Shed => break,
                    }
                }
                if !fl.is_empty() {
                    let mut prefetched = self.prefetched.lock();
                    if prefetched.len() >= MAX_PREFETCHED {
                        prefetched.clear();
                    }
                    prefetched.insert(f.clone(), Prefetched::InFlight);
                    drop(prefetched);
                    flights.insert(f, fl);
                }
            }
        }
    }
}

/// A prefetch budget (over bytes, or over files): prefetch may start a file while the
/// bucket is not in debt, and the file's cost is then charged (so one large file may
/// overdraw it). At most a tenth of a second's worth (and one unit) is saved up: bursts
/// stay short.
fn prefetch_budget(per_sec: u64) -> TokenBucket {
    TokenBucket::new(per_sec, (per_sec as f64 / 10.0).max(1.0), 0.0)
}

/// The store as the prefetcher sees it this round: what the planner knows to be
/// resident, less what this round plans to evict, plus what it plans to fetch.
struct Snapshot<'a> {
    /// Planned for eviction this round.
    evicted: HashSet<FileRef>,
    /// Being fetched (or planned this round), or declined a moment ago.
    busy: HashSet<FileRef>,
    room: u64,
    sizes: &'a HashMap<FileRef, u64>,
    default_size: u64,
}

impl Snapshot<'_> {
    fn size(&self, f: &FileRef) -> u64 {
        self.sizes.get(f).copied().unwrap_or(self.default_size)
    }
}

impl CacheView for Snapshot<'_> {
    fn is_resident(&self, p: &Planner, f: &FileRef) -> bool {
        p.is_resident(f) && !self.evicted.contains(f)
    }
    fn victim(&self, p: &mut Planner) -> Option<FileRef> {
        p.victim_indexed(&|f| !self.busy.contains(f) && !self.evicted.contains(f))
    }
    fn in_flight(&self, f: &FileRef) -> bool {
        self.busy.contains(f)
    }
    fn has_room(&self, f: &FileRef) -> bool {
        self.size(f) <= self.room
    }
}
