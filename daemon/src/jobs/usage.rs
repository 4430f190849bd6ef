//! What jobs read: opens and client reports attributed to jobs, prefetch lead times,
//! explicit positions, consumption rates, and each job's status (position, readiness
//! window, usage, what its registrant's rights left out).

use super::*;
use crate::status::JobStatus;

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

impl Jobs {
    /// A job opened `f` at `at`: if the prefetcher fetched it, record how long before the
    /// open it became resident, or that the prefetch was late.
    fn record_lead(&self, f: &FileRef, at: Instant) {
        match self.prefetched.lock().remove(f) {
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
    pub(super) fn account(&self, applied: Vec<Applied>) {
        if applied.is_empty() {
            return;
        }
        for a in &applied {
            self.record_lead(&a.file, a.at);
        }
        if self.prefetcher_alive() {
            // For the prefetcher: these files are read, whatever the watermark says.
            let mut read = self.read.lock();
            if read.len() + applied.len() > MAX_READ_NOTES {
                read.clear();
            }
            read.extend(applied.iter().map(|a| a.file.clone()));
        }
    }
    /// Sets a job's position explicitly, and renews its lease: `Ok(false)` when no such
    /// job is registered; an error when the position is not in its plan (nothing
    /// changes).
    pub fn progress(&self, job: &str, epoch: u64, step: u64) -> Result<bool, JobError> {
        let found = self
            .plans
            .planner()
            .set_position(job, epoch, step)
            .map_err(JobError::Position)?;
        if found {
            self.renew(job);
        }
        self.poke();
        Ok(found)
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
            path: rel.into(),
        };
        let tag = self.tags.read().get(&f).copied().unwrap_or(0);
        if tag != 0 {
            // Every open of a job's file counts for it (and renews its lease), whether
            // or not the read moves its position.
            let now = self.clock.now();
            let mut info = self.info.lock();
            if let Some(j) = info.values_mut().find(|j| j.tag == tag) {
                j.usage.opens += 1;
                j.usage.opens_hit += u64::from(hit);
                if let Some(l) = j.lease.as_mut() {
                    l.renew(now);
                }
            }
        }
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

    /// Charges `bytes` the daemon read from the backing store for `rel` under `root`
    /// to the job whose plan holds it (the one whose tag names the file).
    pub fn charge_backing(&self, root: usize, rel: &str, bytes: u64) {
        if !self.any() {
            return;
        }
        let f = FileRef {
            root,
            path: rel.into(),
        };
        let Some(tag) = self.tags.read().get(&f).copied() else {
            return;
        };
        if let Some(j) = self.info.lock().values_mut().find(|j| j.tag == tag) {
            j.usage.backing_bytes += bytes;
        }
    }

    /// Where a fill's backing reads are charged (see [`crate::stats::Charge`]): this
    /// job table, as long as it lives.
    pub fn charger(self: &Arc<Self>) -> Arc<dyn crate::stats::ChargeReads> {
        Arc::new(Charger(Arc::downgrade(self)))
    }

    /// Adds what a client reported about its reads, per job tag.
    pub fn add_usage(&self, reports: &[pb::JobUsage]) {
        if reports.is_empty() {
            return;
        }
        let mut info = self.info.lock();
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
    pub(super) fn measure_rates(&self) {
        let mut p = self.plans.planner();
        let mut info = self.info.lock();
        for (id, j) in info.iter_mut() {
            let (done0, at) = j.rate_mark;
            let dt = at.elapsed();
            if dt < RATE_PERIOD {
                continue;
            }
            let done = p.steps_done(id).unwrap_or(done0);
            if done > done0 {
                let r = (done - done0) as f64 / dt.as_secs_f64();
                p.set_rate(id, j.rate.measured(r, dt));
            }
            j.rate_mark = (done, Instant::now());
        }
    }
    /// Status of every job; `cached(root, path)` says whether a file is cached whole and
    /// `capacity` is the cache's. A job's readiness window is what it reads next, to the
    /// end of its current epoch (the next epoch, at a job's start), as far as the cache
    /// can hold it, at most 4096 files.
    pub fn status(&self, cached: &dyn Fn(usize, &str) -> bool, capacity: u64) -> Vec<JobStatus> {
        self.settle();
        self.expire_leases();
        let now = self.clock.now();
        type Row = (
            String,
            usize,
            Usage,
            Option<f64>,
            Left,
            Option<lease::Lease>,
        );
        let info: Vec<Row> = self
            .info
            .lock()
            .iter()
            .map(|(k, v)| {
                let l = v.lease.clone();
                (k.clone(), v.files, v.usage, v.rate.mean, Left::of(v), l)
            })
            .collect();
        let mut out = Vec::new();
        for (job, files, u, rate, left, lease) in info {
            // Looked at without a lock held (it reads /proc).
            let (lease_seconds, lease_remaining, lease_holders, lease_holders_alive) =
                lease.map_or((0, Duration::ZERO, 0, 0), |l| l.status(now, &*self.procs));
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
            // Sizes a batch at a time (one batch of stats each), until the window is full.
            'window: for chunk in upcoming.chunks(STATUS_SIZES) {
                for (f, size) in chunk.iter().zip(self.sizes_of(chunk)) {
                    let size = size.unwrap_or(0);
                    if window > 0 && window_bytes + size > capacity {
                        break 'window;
                    }
                    window += 1;
                    window_bytes += size;
                    if cached(f.root, &f.path) {
                        resident += 1;
                        resident_bytes += size;
                    }
                }
            }
            // Bytes per slot: 1 when the placement counts bytes.
            let unit_bytes = if placed.4 {
                1
            } else {
                self.plans.slots().get(&job).map_or(0, |s| s.unit_bytes)
            };
            out.push(JobStatus {
                job,
                epoch: pos.0,
                step: pos.1,
                epoch_len: len as u64,
                files: files as u64,
                window,
                window_resident: resident,
                window_bytes,
                window_resident_bytes: resident_bytes,
                backing_bytes: u.backing_bytes,
                hit_bytes: u.hit_bytes,
                filled_bytes: u.filled_bytes,
                fallback_bytes: u.fallback_bytes,
                opens: u.opens,
                opens_hit: u.opens_hit,
                wait: Duration::from_nanos(u.wait_ns),
                fallback: Duration::from_nanos(u.fallback_ns),
                rate,
                placement_nodes: placed.0,
                placement_slots: if placed.4 { 0 } else { placed.1 },
                placement_room_bytes: placed.1 * unit_bytes,
                placement_here: placed.2,
                placement_departing: placed.3,
                files_denied: left.files_denied,
                dirs_denied: left.dirs_denied,
                immutable_not_owned: left.immutable_not_owned,
                immutable_over_limit: left.immutable_over_limit,
                lease_seconds,
                lease_remaining,
                lease_holders,
                lease_holders_alive,
            });
        }
        out
    }

    /// Files being prefetched now, for every job together.
    pub fn prefetching(&self) -> u64 {
        self.prefetching.load(Ordering::Relaxed)
    }

    /// True when every registered job's rate has been measured.
    pub(super) fn rates_known(&self) -> bool {
        self.info.lock().values().all(|j| j.rate.mean.is_some())
    }
}

/// [`Jobs::charger`]: weak, so that the counters it is set in do not keep the jobs alive.
struct Charger(std::sync::Weak<Jobs>);

impl crate::stats::ChargeReads for Charger {
    fn backing_read(&self, root: usize, rel: &str, bytes: u64) {
        if let Some(j) = self.0.upgrade() {
            j.charge_backing(root, rel, bytes);
        }
    }
}
