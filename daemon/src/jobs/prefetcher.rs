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
use crate::fill::Declined;
use crate::planner::Need;
use crate::planner::prefetch::{self, CacheView, Pace};
use std::collections::VecDeque;

/// How long a prefetch the store declined (no room worth making) is not retried.
const DECLINED_BACKOFF: Duration = Duration::from_secs(1);
/// The same for a copy the cluster placement gives this node (turned away while
/// exchanges were under way: the room comes back as peers take their copies), and for
/// a file the placement moved elsewhere while it was fetched (nothing is wrong with it).
const PLACED_BACKOFF: Duration = Duration::from_millis(50);
/// How long the files of a backing root that stopped answering are not asked for
/// again (the fill engine declines them at once while the root is stalled).
const STALLED_BACKOFF: Duration = Duration::from_secs(2);
/// A fetch that failed (a backing or store error) is retried after this, doubled with
/// each failure of the same file in a row, up to [`MAX_FAILED_BACKOFF`].
const FAILED_BACKOFF: Duration = Duration::from_secs(1);
/// The longest a file that keeps failing waits between attempts.
const MAX_FAILED_BACKOFF: Duration = Duration::from_secs(60);
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
/// When nothing upcoming is urgent, the prefetcher looks again after half the slack the
/// planner reports (how long until something would be, at the readers' measured rates),
/// at most this: a decision walks the upcoming files past every resident one, and
/// rounds run on every read.
const QUIET: Duration = Duration::from_millis(100);

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

    /// The prefetcher: a [`Jobs::prefetch_round`] each time it wakes — on a read, a
    /// registration, the end of a fetch it started, or a backoff or budget running out;
    /// at the latest after [`HEARTBEAT`].
    fn prefetch_loop(
        &self,
        store: &Store,
        filler: &Filler,
        meta: &Meta,
        stop: &Stop,
        cfg: PrefetchConfig,
    ) {
        let mut r = Rounds::new(cfg);
        let mut saved = Instant::now();
        while !stop.is_stopped() {
            // A fetch that already ended (declined at once) is collected now.
            if !r.any_ended() {
                self.wake.wait(r.sleep(Instant::now()));
            }
            self.prefetch_round(&mut r, store, filler, meta, cfg, Instant::now());
            if saved.elapsed() >= durable::SAVE_EVERY {
                self.save_positions();
                saved = Instant::now();
            }
        }
        // A clean stop keeps where every job is.
        self.save_positions();
    }

    /// One round at `now`: measure rates, collect finished fetches (each outcome
    /// deciding when the file may be asked for again, [`Backoffs`]), then start fetches
    /// the planner asks for ([`prefetch::next_prefetch`]) while under the concurrency,
    /// lead and bandwidth bounds. Pacing: once the consumption rates and the backing
    /// store's throughput are measured, a file is fetched only when some upcoming missing
    /// file needs the backing store to start now ([`Pace`]); before, as early as the rules
    /// allow.
    fn prefetch_round(
        &self,
        r: &mut Rounds,
        store: &Store,
        filler: &Filler,
        meta: &Meta,
        cfg: PrefetchConfig,
        now: Instant,
    ) {
        // The reads opens left for the planner, before planning on it (they renew
        // leases, which then run out or not).
        self.settle();
        self.expire_leases();
        if !self.any() {
            r.flights.clear();
            r.ahead.clear();
            r.denied.clear();
            self.prefetched.lock().clear();
            self.prefetching.store(0, Ordering::Relaxed);
            return;
        }
        self.measure_rates();
        self.update_layouts(store);
        self.sync_placements();
        let Rounds {
            flights, declined, ..
        } = &mut *r;
        flights.retain(|f, fl| {
            let outcomes: Vec<Option<FillOutcome>> = fl.iter().map(|x| x.outcome()).collect();
            if outcomes.iter().any(Option::is_none) {
                return true;
            }
            let outcomes: Vec<FillOutcome> = outcomes.into_iter().flatten().collect();
            let mine = self.plans.planner().is_mine(f);
            let mut prefetched = self.prefetched.lock();
            if declined.ended(f, &outcomes, mine, now) {
                if let Some(p) = prefetched.get_mut(f) {
                    // Resident now (the fill engine woke this round as the last block
                    // landed). Not when the job already opened it: that open counted a
                    // late prefetch.
                    *p = Prefetched::Resident(now);
                }
            } else {
                // Still counted ahead of the readers until they read or pass it: were
                // it not, a file declined for want of room would let the prefetcher
                // run on through the plan, asking for files that find no room either
                // (the policy benchmark's live run at C/N 0.5, R/B 2 stalled 0.020
                // instead of 0.005 that way).
                prefetched.remove(f);
            }
            false
        });
        r.declined.expire(now);
        let now_registered = self.next_tag.load(Ordering::Relaxed);
        if now_registered != r.registrations {
            // A new registrant may read what the others may not.
            r.registrations = now_registered;
            r.denied.clear();
            r.quiet_until = None;
            r.sized = None;
        }
        r.denied.expire(now);
        self.prefetching
            .store(r.flights.len() as u64, Ordering::Relaxed);
        if r.flights.len() >= cfg.concurrency {
            return;
        }
        // Sizes of the upcoming files, looked up without the planner lock (a stat
        // may go to the backing store), and their mean; again only once the readers
        // moved on by SIZES_EVERY reads (or a job was registered): a round comes with
        // every landed fetch, and the lookups cost more than its decisions.
        let reads_now = self.plans.planner().reads();
        let mean_size = match r.sized {
            Some((at, mean)) if (at..at + SIZES_EVERY).contains(&reads_now) => mean,
            _ => {
                let upcoming = self.plans.planner().upcoming(LOOKAHEAD);
                let files: Vec<FileRef> = upcoming.iter().map(|(f, _)| f.clone()).collect();
                let total: u64 = self
                    .sizes_of(&files)
                    .into_iter()
                    .map(|s| s.unwrap_or(u64::from(store.block_size())))
                    .sum();
                let mean = (!upcoming.is_empty()).then(|| total as f64 / upcoming.len() as f64);
                r.sized = Some((reads_now, mean));
                mean
            }
        };
        let room = store.room();
        let sizes = self.sizes.lock();
        let mut view = Snapshot {
            evicted: HashSet::default(),
            busy: r
                .flights
                .keys()
                .chain(r.declined.waiting())
                .chain(r.denied.waiting())
                .cloned()
                .collect(),
            room,
            sizes: &sizes,
            default_size: store.block_size() as u64,
        };
        let pace = match (filler.service(), mean_size) {
            (Some(s), Some(mean)) if self.rates_known() => {
                Pace {
                    max_ahead: MAX_WALK,
                    max_walk: MAX_WALK,
                    secs_per_file: mean / s.throughput,
                    // Room for the measurement to be off, and for a burst of reads.
                    margin: 0.25 + 4.0 * s.latency,
                }
            }
            _ => Pace {
                max_ahead: LOOKAHEAD,
                max_walk: MAX_WALK,
                secs_per_file: f64::INFINITY,
                margin: 0.0,
            },
        };
        let mut fetches = Vec::new();
        let mut claims: Vec<FileRef> = Vec::new();
        // Read (in any order), or passed by the job's watermark: no longer ahead.
        for f in std::mem::take(&mut *self.read.lock()) {
            r.ahead.remove(&f);
        }
        let reads = {
            let mut p = self.plans.planner();
            let reads = p.reads();
            r.ahead.retain(|_, due| reads < *due);
            // First what the cluster placement moved here (the reads of the next
            // rounds, and copies parked here), from the nodes that hold them.
            let (moved, here) = p.incoming(cfg.concurrency);
            claims.extend(here);
            for f in moved {
                if r.flights.len() + fetches.len() >= cfg.concurrency {
                    break;
                }
                if view.busy.insert(f.clone()) {
                    fetches.push(f);
                }
            }
            reads
        };
        // `ahead` already counts this round's decisions (the placement's moves are
        // bounded by the concurrency only).
        let quiet = r.quiet_until.is_some_and(|t| now < t);
        // Files due now from the last walk, not yet decided on.
        let mut due: VecDeque<(FileRef, Need)> = VecDeque::new();
        while !quiet
            && r.ahead.len() < cfg.ahead
            && r.flights.len() + fetches.len() < cfg.concurrency
            && r.budget.as_ref().is_none_or(TokenBucket::allows)
            && r.ops.as_ref().is_none_or(TokenBucket::allows)
        {
            // The planner lock for one decision at a time: a fill that needs it (under
            // the store's index lock, which opens take) waits for one decision, never
            // for the whole round.
            let mut p = self.plans.planner();
            if due.is_empty() {
                let free = (cfg.ahead - r.ahead.len())
                    .min(cfg.concurrency - r.flights.len() - fetches.len());
                let (files, slack) = prefetch::urgent_missing(&mut p, &view, pace, free);
                if files.is_empty() {
                    // Infinite when nothing is missing: then nothing to wait for either.
                    r.quiet_until = (slack > 0.0)
                        .then(|| Duration::try_from_secs_f64(slack / 2.0).ok())
                        .flatten()
                        .map(|d| now + d.min(QUIET));
                    break;
                }
                due.extend(files);
            }
            let Some((file, need)) = due.pop_front() else {
                break;
            };
            if view.in_flight(&file) || view.is_resident(&p, &file) {
                continue;
            }
            let Some(fx) = prefetch::admit_prefetch(&mut p, &view, file, need) else {
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
            if let Some(b) = &r.budget {
                b.charge(size);
            }
            if let Some(o) = &r.ops {
                o.charge(1);
            }
            r.ahead.insert(fx.file.clone(), reads + steps + 1);
            fetches.push(fx.file);
        }
        drop(view);
        drop(sizes);
        if let Some(peers) = &self.peers {
            for f in claims {
                let root = &self.roots.get(f.root).name;
                if !store.is_cached(root, &f.path) {
                    // Part of it only: the rest is fetched now.
                    if !r.flights.contains_key(&f) && !fetches.contains(&f) {
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
                r.ahead.remove(&f);
                r.denied.hold(f, DENIED_BACKOFF, now);
                continue;
            };
            let root_name = &self.roots.get(f.root).name;
            let key = Key::of(root_name, &stat.path, &stat.version);
            let nblocks = stat.version.size.div_ceil(store.block_size() as u64) as usize;
            let target = Arc::new(Target {
                peer_ok: true,
                root: f.root,
                rel: f.path.to_string(),
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
                r.flights.insert(f, fl);
            }
        }
    }
}

/// The prefetcher's state from one round to the next.
struct Rounds {
    /// Files being fetched, with their blocks' flights.
    flights: HashMap<FileRef, Vec<Arc<Flight>>>,
    /// Files not asked for again before a time, by how their last fetch ended.
    declined: Backoffs,
    /// Files no registrant of a job reading them may read: looked at again after a
    /// while, or when a job is registered (its registrant may read them).
    denied: Backoffs,
    /// Registrations seen (a new one clears `denied`).
    registrations: u64,
    /// Prefetched (or being prefetched) and not yet read: the planner's read count at
    /// which each will have been read.
    ahead: HashMap<FileRef, u64>,
    budget: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    /// Nothing was urgent: no decision is looked for before this (see [`QUIET`]).
    quiet_until: Option<Instant>,
    /// The planner's read count when the upcoming files' sizes were last looked up,
    /// and their mean (see [`SIZES_EVERY`]).
    sized: Option<(u64, Option<f64>)>,
}

/// Reads after which the prefetcher looks up the sizes of the upcoming files again.
const SIZES_EVERY: u64 = 64;

impl Rounds {
    fn new(cfg: PrefetchConfig) -> Self {
        Self {
            flights: HashMap::default(),
            declined: Backoffs::default(),
            denied: Backoffs::default(),
            registrations: 0,
            ahead: HashMap::default(),
            budget: cfg.bandwidth.map(prefetch_budget),
            ops: cfg.ops.map(prefetch_budget),
            quiet_until: None,
            sized: None,
        }
    }

    /// Some fetch started here has ended and is not collected yet.
    fn any_ended(&self) -> bool {
        self.flights
            .values()
            .flatten()
            .any(|f| f.outcome().is_some())
    }

    /// How long to sleep at `now` when no event comes: until the first backoff or budget
    /// runs out, at most [`HEARTBEAT`], at least a millisecond (never spin).
    fn sleep(&self, now: Instant) -> Duration {
        let mut sleep = HEARTBEAT;
        for b in [&self.declined, &self.denied] {
            if let Some(d) = b.next_due(now) {
                sleep = sleep.min(d);
            }
        }
        for b in [&self.budget, &self.ops].into_iter().flatten() {
            sleep = sleep.min(b.until_allowed());
        }
        sleep.max(Duration::from_millis(1))
    }
}

/// When files may be asked for again: what the prefetcher decides after a fetch ends,
/// by its outcome, apart from the loop (unit-tested on a manual clock).
///
/// | outcome | asked for again after |
/// |---|---|
/// | landed | (resident; a run of failures is forgotten) |
/// | declined: no room worth making | [`DECLINED_BACKOFF`]; [`PLACED_BACKOFF`] for a file the cluster placement gives this node |
/// | declined: the placement moved it | [`PLACED_BACKOFF`] |
/// | declined: its root stopped answering | [`STALLED_BACKOFF`] |
/// | declined: the fill engine is closing | not held (nothing more is fetched) |
/// | failed | [`FAILED_BACKOFF`], doubled per failure in a row, at most [`MAX_FAILED_BACKOFF`] |
///
/// A file whose blocks ended differently is judged by the worst: failed, then stalled,
/// no room, moved, closed.
#[derive(Debug, Default)]
pub(super) struct Backoffs {
    /// Files not asked for before a time.
    until: HashMap<FileRef, Instant>,
    /// Failed fetches of a file in a row (bounded: cleared past [`MAX_PREFETCHED`]).
    failures: HashMap<FileRef, u32>,
}

impl Backoffs {
    /// Records at `now` how the fetch of `f` ended, one outcome per block asked for;
    /// `mine`: the cluster placement gives `f` to this node. True when every block
    /// landed.
    pub(super) fn ended(
        &mut self,
        f: &FileRef,
        outcomes: &[FillOutcome],
        mine: bool,
        now: Instant,
    ) -> bool {
        let rank = |o: &FillOutcome| match o {
            FillOutcome::Landed => 0,
            FillOutcome::Declined(Declined::Closed) => 1,
            FillOutcome::Declined(Declined::Moved) => 2,
            FillOutcome::Declined(Declined::NoSpace) => 3,
            FillOutcome::Declined(Declined::Stalled) => 4,
            FillOutcome::Failed => 5,
        };
        let worst = outcomes
            .iter()
            .copied()
            .max_by_key(rank)
            .unwrap_or(FillOutcome::Landed);
        let wait = match worst {
            FillOutcome::Landed => {
                self.failures.remove(f);
                self.until.remove(f);
                return true;
            }
            FillOutcome::Declined(Declined::Closed) => return false,
            FillOutcome::Declined(Declined::Moved) => PLACED_BACKOFF,
            FillOutcome::Declined(Declined::NoSpace) if mine => PLACED_BACKOFF,
            FillOutcome::Declined(Declined::NoSpace) => DECLINED_BACKOFF,
            FillOutcome::Declined(Declined::Stalled) => STALLED_BACKOFF,
            FillOutcome::Failed => {
                if self.failures.len() >= MAX_PREFETCHED {
                    self.failures.clear();
                }
                let n = self.failures.entry(f.clone()).or_insert(0);
                *n = n.saturating_add(1);
                FAILED_BACKOFF
                    .saturating_mul(1 << (*n - 1).min(16))
                    .min(MAX_FAILED_BACKOFF)
            }
        };
        self.hold(f.clone(), wait, now);
        false
    }

    /// Holds `f` back for `d` from `now`.
    pub(super) fn hold(&mut self, f: FileRef, d: Duration, now: Instant) {
        self.until.insert(f, now + d);
    }

    /// Forgets every hold whose time has come.
    pub(super) fn expire(&mut self, now: Instant) {
        self.until.retain(|_, t| *t > now);
    }

    /// The files held back now.
    pub(super) fn waiting(&self) -> impl Iterator<Item = &FileRef> {
        self.until.keys()
    }

    /// Whether `f` is held back at `now`.
    #[cfg(test)]
    pub(super) fn holds(&self, f: &FileRef, now: Instant) -> bool {
        self.until.get(f).is_some_and(|t| *t > now)
    }

    /// How long from `now` until the first hold runs out; `None` when none is held.
    pub(super) fn next_due(&self, now: Instant) -> Option<Duration> {
        self.until
            .values()
            .map(|t| t.saturating_duration_since(now))
            .min()
    }

    /// Forgets every hold (failure counts stay).
    pub(super) fn clear(&mut self) {
        self.until.clear();
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
    fn is_resident_given(&self, _: &Planner, f: &FileRef, entry: bool) -> bool {
        entry && (self.evicted.is_empty() || !self.evicted.contains(f))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::test_support::creds;
    use crate::backing::Owner;
    use crate::backing::fault::{Faults, FaultyBacking};
    use crate::backing::mem::MemBacking;
    use crate::blocks::Sources;
    use crate::clock::{Clock, ManualClock};
    use crate::meta::test_support::one_root;
    use crate::policy::planned::PlannedPolicy;
    use crate::store::test_config;

    const BS: u32 = 4096;

    fn file(i: usize) -> FileRef {
        FileRef {
            root: 0,
            path: format!("f{i}").into(),
        }
    }

    /// Every outcome holds a file back for its own time, on a manual clock.
    #[test]
    fn each_outcome_holds_a_file_back_for_its_own_time() {
        let clock = ManualClock::new();
        let t0 = clock.now();
        let mut b = Backoffs::default();
        let cases = [
            (
                FillOutcome::Declined(Declined::NoSpace),
                false,
                DECLINED_BACKOFF,
            ),
            (
                FillOutcome::Declined(Declined::NoSpace),
                true,
                PLACED_BACKOFF,
            ),
            (
                FillOutcome::Declined(Declined::Moved),
                false,
                PLACED_BACKOFF,
            ),
            (
                FillOutcome::Declined(Declined::Stalled),
                false,
                STALLED_BACKOFF,
            ),
            (FillOutcome::Failed, false, FAILED_BACKOFF),
        ];
        for (i, (outcome, mine, wait)) in cases.iter().enumerate() {
            let f = file(i);
            assert!(!b.ended(&f, &[*outcome], *mine, t0), "{outcome:?}");
            assert!(
                b.holds(&f, t0 + *wait - Duration::from_millis(1)),
                "{outcome:?}"
            );
            assert!(!b.holds(&f, t0 + *wait), "{outcome:?} held for {wait:?}");
        }
        assert_eq!(b.next_due(t0), Some(PLACED_BACKOFF), "the first to run out");
        // Closing holds nothing; landing ends a hold.
        assert!(!b.ended(
            &file(9),
            &[FillOutcome::Declined(Declined::Closed)],
            false,
            t0
        ));
        assert!(!b.holds(&file(9), t0));
        assert!(b.ended(
            &file(0),
            &[FillOutcome::Landed, FillOutcome::Landed],
            false,
            t0
        ));
        assert!(!b.holds(&file(0), t0));
        // Expiry forgets what ran out, and only that.
        clock.advance(DECLINED_BACKOFF);
        b.expire(clock.now());
        let left: HashSet<&FileRef> = b.waiting().collect();
        assert_eq!(
            left,
            HashSet::from_iter([&file(3)]),
            "only the stalled root's file"
        );
        assert_eq!(
            b.next_due(clock.now()),
            Some(STALLED_BACKOFF - DECLINED_BACKOFF)
        );
        b.clear();
        assert_eq!(b.next_due(clock.now()), None);
    }

    /// A file that keeps failing is retried later each time (doubling, capped); once it
    /// lands, its next failure starts over. A file whose blocks ended differently is
    /// judged by the worst of them.
    #[test]
    fn failures_in_a_row_double_the_wait_up_to_a_cap_and_a_landing_resets_it() {
        let clock = ManualClock::new();
        let mut b = Backoffs::default();
        let f = file(1);
        let mut waits = Vec::new();
        for _ in 0..10 {
            let now = clock.now();
            b.ended(&f, &[FillOutcome::Failed], false, now);
            let wait = b.next_due(now).unwrap();
            waits.push(wait.as_secs());
            clock.advance(wait);
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60, 60]);
        assert!(b.ended(&f, &[FillOutcome::Landed], false, clock.now()));
        b.ended(&f, &[FillOutcome::Failed], false, clock.now());
        assert_eq!(b.next_due(clock.now()), Some(FAILED_BACKOFF));
        // Worst of the blocks: one failed block makes the file a failure.
        let g = file(2);
        let mixed = [
            FillOutcome::Landed,
            FillOutcome::Declined(Declined::NoSpace),
            FillOutcome::Failed,
            FillOutcome::Declined(Declined::Stalled),
        ];
        let now = clock.now();
        assert!(!b.ended(&g, &mixed, false, now));
        assert_eq!(b.failures.get(&g), Some(&1), "counted as a failure");
        assert!(b.holds(&g, now + FAILED_BACKOFF - Duration::from_millis(1)));
        assert!(
            !b.holds(&g, now + FAILED_BACKOFF),
            "held as long as a failure"
        );
    }

    /// A prefetcher over an in-memory backing store: the real planner, store (with the
    /// plan-aware policy) and fill engine, driven one round at a time on manual time.
    struct Rig {
        _dir: tempfile::TempDir,
        faults: Arc<Faults>,
        meta: Arc<Meta>,
        store: Arc<Store>,
        filler: Arc<Filler>,
        jobs: Arc<Jobs>,
        cfg: PrefetchConfig,
        rounds: Rounds,
        clock: ManualClock,
    }

    impl Rig {
        fn new(files: usize, order: &[usize], ahead: usize) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let mem = Arc::new(MemBacking::new());
            let (faulty, faults) = FaultyBacking::new(mem.clone());
            let (meta, stats) = one_root(Arc::new(faulty));
            let plans = Arc::new(Plans::new(meta.roots().clone(), false));
            let store = Arc::new(
                Store::open_with_policy(
                    &test_config(dir.path(), 1 << 30, BS),
                    stats.clone(),
                    Box::new(PlannedPolicy::new(plans.clone(), None)),
                )
                .unwrap(),
            );
            let wake = Arc::new(Wake::default());
            let filler = Arc::new(
                Filler::new(
                    store.clone(),
                    meta.clone(),
                    stats.clone(),
                    Sources::backing(&meta, &stats),
                    4,
                    64,
                    wake.clone(),
                )
                .unwrap(),
            );
            let jobs = Arc::new(Jobs::new(
                meta.clone(),
                plans,
                None,
                crate::metrics::Metrics::new().prefetch(),
                wake,
            ));
            for i in 0..files {
                mem.put(
                    &format!("f{i}"),
                    vec![i as u8; 2 * BS as usize],
                    Owner {
                        mode: 0o644,
                        ..Owner::default()
                    },
                );
            }
            let names: Vec<String> = (0..files).map(|i| format!("\"f{i}\"")).collect();
            let order: Vec<String> = order.iter().map(usize::to_string).collect();
            let m = format!(
                r#"{{"version": 1, "job": "j", "root": "/r", "files": [{}],
                    "plan": {{"kind": "sequence", "epochs": [[{}]]}}}}"#,
                names.join(","),
                order.join(",")
            );
            jobs.register(&m, &creds(0), true).unwrap();
            let cfg = PrefetchConfig {
                ahead,
                concurrency: 16,
                bandwidth: None,
                ops: None,
            };
            Self {
                _dir: dir,
                faults,
                meta,
                store,
                filler,
                jobs,
                cfg,
                rounds: Rounds::new(cfg),
                clock: ManualClock::new(),
            }
        }

        /// One round at the manual clock's now; the files it started fetching.
        fn round(&mut self) -> Vec<FileRef> {
            let before: HashSet<FileRef> = self.rounds.flights.keys().cloned().collect();
            self.jobs.prefetch_round(
                &mut self.rounds,
                &self.store,
                &self.filler,
                &self.meta,
                self.cfg,
                self.clock.now(),
            );
            let mut started: Vec<FileRef> = self
                .rounds
                .flights
                .keys()
                .filter(|f| !before.contains(*f))
                .cloned()
                .collect();
            started.sort_by_key(|f| self.jobs.plans.planner().steps_until(f));
            started
        }

        /// Waits (bounded, on the flights' own condition) until every fetch started
        /// has ended.
        fn settle_fills(&self) {
            let deadline = Instant::now() + Duration::from_secs(20);
            for f in self.rounds.flights.values().flatten() {
                assert!(f.wait_until(deadline).is_some(), "a fill ended");
            }
        }

        fn cached(&self, i: usize) -> bool {
            self.store.is_cached("/r", &format!("f{i}"))
        }

        /// Rounds (at most `max`), each waited out, until one starts nothing; the
        /// fetches started in all.
        fn rounds_until_idle(&mut self, max: usize) -> usize {
            let mut started = 0;
            for _ in 0..max {
                let n = self.round().len();
                self.settle_fills();
                started += n;
                if n == 0 {
                    break;
                }
            }
            started
        }
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            self.filler.close();
        }
    }

    /// The prefetcher fetches the plan's next files in plan order, as far ahead as its
    /// bound, and one more for each file read.
    #[test]
    fn it_fetches_the_plan_in_order_as_far_ahead_as_its_bound() {
        let order = [5, 2, 7, 0, 1, 3, 4, 6];
        let mut r = Rig::new(8, &order, 3);
        assert_eq!(r.round(), vec![file(5), file(2), file(7)]);
        r.settle_fills();
        assert!(r.round().is_empty(), "three ahead, none read");
        assert!(r.rounds.flights.is_empty(), "collected");
        assert!(r.cached(5) && r.cached(2) && r.cached(7));
        assert!(!r.cached(0));
        // The job reads its first file: one more is fetched.
        r.jobs.on_open(0, "f5", true);
        assert_eq!(r.round(), vec![file(0)]);
        r.settle_fills();
        r.jobs.on_open(0, "f2", true);
        r.jobs.on_open(0, "f7", true);
        assert_eq!(r.round(), vec![file(1), file(3)]);
        r.settle_fills();
    }

    /// Past a run of resident files longer than [`LOOKAHEAD`] (at half cache a reader
    /// races through thousands of hits), the prefetcher still finds the next missing
    /// file: it passes over the resident ones instead of looking at a fixed window.
    #[test]
    fn it_looks_past_more_resident_files_than_its_lookahead() {
        let k = LOOKAHEAD + 10;
        let order: Vec<usize> = (0..k + 2).collect();
        let mut r = Rig::new(k + 2, &order, k);
        let started = r.rounds_until_idle(4 * k);
        assert_eq!(started, k, "as far ahead as its bound");
        assert!(r.cached(k - 1) && !r.cached(k));
        // The reader reads the first: the next file is past k - 1 resident ones.
        r.jobs.on_open(0, "f0", true);
        assert_eq!(r.round(), vec![file(k)]);
        r.settle_fills();
        assert!(r.cached(k));
    }

    /// With the default bound, the prefetcher runs past more than a thousand files
    /// when the cache has room: at half cache an epoch opens with the kept half, and the
    /// missing files behind it must all be fetched while the readers pass the hits (a
    /// bound of 1 024 files left the link idle for seconds of every epoch).
    #[test]
    fn the_default_bound_fetches_more_than_a_thousand_files_ahead() {
        let n = 1100;
        let order: Vec<usize> = (0..n).collect();
        let mut r = Rig::new(n, &order, crate::config::Config::default().prefetch_ahead);
        let started = r.rounds_until_idle(4 * n);
        assert_eq!(started, n, "every file, none read yet");
        assert!((0..n).all(|i| r.cached(i)));
    }

    /// A fetch that fails is not asked for again until its backoff ran out; it fails
    /// again and waits twice as long; once the backing store answers, it lands.
    #[test]
    fn a_failed_fetch_is_retried_after_its_backoff_doubling() {
        let mut r = Rig::new(2, &[0, 1], 8);
        r.faults.fail_reads.store(true, Ordering::Relaxed);
        assert_eq!(r.round(), vec![file(0), file(1)]);
        r.settle_fills();
        assert!(r.round().is_empty(), "both failed: held back");
        assert!(r.rounds.declined.holds(&file(0), r.clock.now()));
        assert_eq!(r.rounds.sleep(r.clock.now()), FAILED_BACKOFF.min(HEARTBEAT));
        r.clock.advance(FAILED_BACKOFF - Duration::from_millis(1));
        assert!(r.round().is_empty(), "not before its backoff ran out");
        r.clock.advance(Duration::from_millis(1));
        assert_eq!(r.round(), vec![file(0), file(1)], "retried");
        r.settle_fills();
        assert!(r.round().is_empty(), "failed again");
        r.faults.fail_reads.store(false, Ordering::Relaxed);
        r.clock
            .advance(2 * FAILED_BACKOFF - Duration::from_millis(1));
        assert!(r.round().is_empty(), "held twice as long");
        r.clock.advance(Duration::from_millis(1));
        assert_eq!(r.round(), vec![file(0), file(1)], "retried again");
        r.settle_fills();
        r.round();
        assert!(r.cached(0) && r.cached(1), "landed");
        assert!(!r.rounds.declined.holds(&file(0), r.clock.now()));
        assert_eq!(r.rounds.sleep(r.clock.now()), HEARTBEAT, "nothing held");
    }

    /// A file whose fetch failed still counts as ahead of the readers until they read
    /// it: the prefetcher does not run further through the plan for it (a file declined
    /// for want of room would make it churn). Once the readers pass it, the next file
    /// is fetched.
    #[test]
    fn a_failed_file_counts_ahead_until_the_readers_pass_it() {
        let mut r = Rig::new(6, &[0, 1, 2, 3, 4, 5], 2);
        r.faults.fail_reads.store(true, Ordering::Relaxed);
        assert_eq!(r.round(), vec![file(0), file(1)]);
        r.settle_fills();
        r.faults.fail_reads.store(false, Ordering::Relaxed);
        assert!(r.round().is_empty(), "two ahead (failed, held back)");
        // The reader reads the first itself (a fallback): one slot frees.
        r.jobs.on_open(0, "f0", false);
        assert_eq!(r.round(), vec![file(2)]);
        r.settle_fills();
        assert!(r.cached(2) && !r.cached(0));
    }
}
