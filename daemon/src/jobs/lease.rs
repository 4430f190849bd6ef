//! Leases: a job registered by its readers (the Python sampler, the Rust client's
//! leased registrations) lives while one of the processes that registered
//! it (its holders) is alive, or while it was renewed within its lease; one that
//! neither holds is unregistered (prefetch stops, the plan is dropped), with one log
//! line saying why. A job registered without a lease (a Slurm prolog, `shardcache
//! prefetch --job`) keeps its explicit lifetime.
//!
//! A holder is known by the pid the socket's credentials name (`SO_PEERCRED`) and that
//! process's start time, read from `/proc` at registration: a pid reused by another
//! process later does not count, nor does a pid the daemon cannot see (0, from another
//! pid namespace) — such a job lives by its renewals only. Renewals are a registration
//! again, a progress report, and an open the daemon attributes to the job.
//!
//! Expiry runs on the daemon's [`Clock`] (tests move a manual one): the prefetcher
//! checks every round (at most a heartbeat apart) and status before it answers. The
//! holders' processes are looked at only once the lease has run out since the last
//! renewal; one found alive renews it. So a job outlives its last holder by at most
//! one lease.
//!
//! Owns: [`Lease`], the [`Processes`] seam (the real `/proc` and a map for tests).
//! Does not touch the planner: expiry goes through [`Jobs::unregister`].

use std::fmt::Debug;

use super::*;

/// Where the daemon learns whether a process is still the one that registered.
pub trait Processes: Send + Sync + Debug {
    /// The start time of live process `pid` (any monotonic per-boot value; `/proc`'s
    /// is in clock ticks since boot), `None` when no such process is alive (gone, a
    /// zombie, or not visible to the daemon).
    fn start_time(&self, pid: i32) -> Option<u64>;
}

/// The processes `/proc` shows.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcFs;

impl Processes for ProcFs {
    fn start_time(&self, pid: i32) -> Option<u64> {
        if pid <= 0 {
            return None;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        parse_stat(&stat)
    }
}

/// The start time in a `/proc/PID/stat` line, `None` for a zombie or a dead process.
/// The command name (field 2) may hold spaces and parentheses: the fields after it
/// start after its last `)`.
fn parse_stat(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    // Field 3, the state; then field 22, the start time (19 fields after the state).
    let state = fields.next()?;
    if matches!(state, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// One process holding a leased job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Holder {
    /// Names the holder in an unregister: the client's own name for itself, else
    /// `pid:START` (empty when the daemon cannot see the process either).
    key: String,
    /// The registering process and its start time, when the daemon can see it.
    process: Option<(i32, u64)>,
}

impl Holder {
    /// The holder a registration or unregister from `pid` names (`key` as the client
    /// sent it, maybe empty).
    pub(super) fn of(procs: &dyn Processes, pid: i32, key: &str) -> Self {
        let process = procs.start_time(pid).map(|s| (pid, s));
        let key = match (key, process) {
            ("", Some((pid, start))) => format!("pid:{pid}:{start}"),
            (k, _) => k.to_owned(),
        };
        Self { key, process }
    }

    fn alive(&self, procs: &dyn Processes) -> bool {
        self.process
            .is_some_and(|(pid, start)| procs.start_time(pid) == Some(start))
    }
}

/// A job's lease: how long it lives unrenewed, when it was last renewed, who holds it.
#[derive(Debug, Clone)]
pub(super) struct Lease {
    period: Duration,
    renewed: Instant,
    holders: Vec<Holder>,
}

impl Lease {
    pub(super) fn new(period: Duration, now: Instant, holder: Holder) -> Self {
        Self {
            period,
            renewed: now,
            holders: vec![holder],
        }
    }

    /// Renewed at `now` (never moved back: reads are applied late).
    pub(super) fn renew(&mut self, now: Instant) {
        self.renewed = self.renewed.max(now);
    }

    /// Another registration: its holder joins (once) and the lease is renewed; the
    /// longest period asked for holds.
    pub(super) fn join(&mut self, period: Duration, now: Instant, holder: Holder) {
        self.period = self.period.max(period);
        self.renew(now);
        if !self.holders.iter().any(|h| h.key == holder.key) {
            self.holders.push(holder);
        }
    }

    /// Whether `holder` holds the lease.
    fn holds(&self, holder: &Holder) -> bool {
        !holder.key.is_empty() && self.holders.iter().any(|h| h.key == holder.key)
    }

    /// Removes `holder`, and holders found dead on the way; true when no holder is left
    /// (the job should go).
    fn leave(&mut self, holder: &Holder, procs: &dyn Processes) -> bool {
        self.holders
            .retain(|h| h.key != holder.key && (h.process.is_none() || h.alive(procs)));
        self.holders.is_empty()
    }

    /// `None` while the lease holds at `now` (renewed within it, or a holder found
    /// alive, which renews it); else why it ran out.
    pub(super) fn expired(&mut self, now: Instant, procs: &dyn Processes) -> Option<String> {
        let idle = now.saturating_duration_since(self.renewed);
        if idle <= self.period {
            return None;
        }
        if self.holders.iter().any(|h| h.alive(procs)) {
            self.renewed = now;
            return None;
        }
        let seen: Vec<String> = self
            .holders
            .iter()
            .filter_map(|h| h.process.map(|(pid, _)| pid.to_string()))
            .collect();
        let holders = if seen.is_empty() {
            "no holder process the daemon can see".to_owned()
        } else {
            format!("holder process(es) {} gone", seen.join(", "))
        };
        Some(format!(
            "not renewed for {:.0} s (lease {} s) and {holders}",
            idle.as_secs_f64(),
            self.period.as_secs()
        ))
    }

    /// For status: (lease seconds, time left before the holders are looked at, holders,
    /// holders alive).
    pub(super) fn status(&self, now: Instant, procs: &dyn Processes) -> (u32, Duration, u32, u32) {
        let left = (self.renewed + self.period).saturating_duration_since(now);
        let alive = self.holders.iter().filter(|h| h.alive(procs)).count();
        (
            u32::try_from(self.period.as_secs()).unwrap_or(u32::MAX),
            left,
            self.holders.len() as u32,
            alive as u32,
        )
    }
}

/// A lease as kept on disk with its job's registration (`durable.rs`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedLease {
    period_s: u64,
    /// Each holder's key and process (pid, start time), when the daemon saw it.
    holders: Vec<(String, Option<(i32, u64)>)>,
}

impl Lease {
    pub(super) fn saved(&self) -> SavedLease {
        SavedLease {
            period_s: self.period.as_secs(),
            holders: self
                .holders
                .iter()
                .map(|h| (h.key.clone(), h.process))
                .collect(),
        }
    }

    /// A kept lease at a start: renewed `now` (its holders get one lease to renew it or
    /// be found alive), the same holders (a process keeps its start time across the
    /// daemon's restart, so one still running still holds it).
    pub(super) fn restored(s: &SavedLease, now: Instant) -> Self {
        Self {
            period: Duration::from_secs(s.period_s.max(1)),
            renewed: now,
            holders: s
                .holders
                .iter()
                .map(|(key, process)| Holder {
                    key: key.clone(),
                    process: *process,
                })
                .collect(),
        }
    }
}

/// What a registration asks of the lease.
#[derive(Debug, Clone, Copy)]
pub struct LeaseRequest<'a> {
    /// Its length (zero: no lease).
    pub period: Duration,
    /// The holder's own name for itself (may be empty).
    pub holder: &'a str,
}

impl Jobs {
    /// Unregisters every leased job that neither a renewal nor a live holder keeps (at
    /// the clock's now), each with one log line saying why.
    pub(super) fn expire_leases(&self) {
        let now = self.clock.now();
        let gone: Vec<(String, String)> = {
            let mut info = self.info.lock();
            info.iter_mut()
                .filter_map(|(id, j)| {
                    let why = j.lease.as_mut()?.expired(now, &*self.procs)?;
                    Some((id.clone(), why))
                })
                .collect()
        };
        for (job, why) in gone {
            tracing::info!(job, why, "lease ran out: job unregistered");
            self.unregister(&job);
        }
    }

    /// Renews job `job`'s lease (if it has one) at the clock's now.
    pub(super) fn renew(&self, job: &str) {
        let now = self.clock.now();
        if let Some(l) = self.info.lock().get_mut(job).and_then(|j| j.lease.as_mut()) {
            l.renew(now);
        }
    }

    /// An unregister of `job` by process `pid` naming holder `holder` (empty: none);
    /// true if the job was registered. A holder of a leased job leaves it: the job goes
    /// with its last holder. A release (a `holder` named) by a process that holds no
    /// lease on the job changes nothing: a rank's exit never ends a scheduler's job or
    /// other ranks'. Any other unregister (`shardcache unregister`) removes the job.
    pub fn unregister_holder(&self, job: &str, pid: i32, holder: &str) -> bool {
        let h = Holder::of(&*self.procs, pid, holder);
        {
            let mut info = self.info.lock();
            let Some(j) = info.get_mut(job) else {
                return false;
            };
            let held = j.lease.as_mut().filter(|l| l.holds(&h));
            if let Some(l) = held {
                if !l.leave(&h, &*self.procs) {
                    tracing::info!(job, holder = %h.key, holders = l.holders.len(), "holder left; the job stays for the others");
                    drop(info);
                    // Kept without the holder that left.
                    self.save_registration(job);
                    return true;
                }
            } else if !holder.is_empty() {
                return true;
            }
        }
        self.unregister(job)
    }
}

#[cfg(test)]
pub(super) mod test_support {
    use super::*;

    /// Processes as a test says: `set(pid, start)` starts one, `kill(pid)` ends it.
    #[derive(Debug, Default)]
    pub struct FakeProcesses(Mutex<HashMap<i32, u64>>);

    impl FakeProcesses {
        pub fn set(&self, pid: i32, start: u64) {
            self.0.lock().insert(pid, start);
        }
        pub fn kill(&self, pid: i32) {
            self.0.lock().remove(&pid);
        }
    }

    impl Processes for FakeProcesses {
        fn start_time(&self, pid: i32) -> Option<u64> {
            self.0.lock().get(&pid).copied()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::FakeProcesses;
    use super::*;
    use crate::access::test_support::creds;
    use crate::clock::ManualClock;
    use crate::jobs::tests::{jobs, shuffle};

    const LEASE: Duration = Duration::from_secs(60);
    const S: Duration = Duration::from_secs(1);

    /// Jobs on a manual clock, with processes as the test says.
    fn leased_jobs() -> (Jobs, Arc<ManualClock>, Arc<FakeProcesses>) {
        let clock = Arc::new(ManualClock::new());
        let procs = Arc::new(FakeProcesses::default());
        let jobs = Arc::into_inner(jobs())
            .unwrap()
            .with_lease_seams(clock.clone(), procs.clone());
        (jobs, clock, procs)
    }

    fn as_pid(pid: i32) -> Creds {
        Creds { pid, ..creds(1000) }
    }

    fn leased(holder: &str) -> Option<LeaseRequest<'_>> {
        Some(LeaseRequest {
            period: LEASE,
            holder,
        })
    }

    fn lease_of(jobs: &Jobs, job: &str) -> Option<(u32, Duration, u32, u32)> {
        let st = jobs.status(&|_, _| false, 1 << 30);
        st.into_iter().find(|j| j.job == job).map(|j| {
            (
                j.lease_seconds,
                j.lease_remaining,
                j.lease_holders,
                j.lease_holders_alive,
            )
        })
    }

    /// A leased job whose holder the daemon cannot see (pid 0) and that nobody renews is
    /// dropped once the lease runs out: plan gone, status without it; not a moment
    /// before.
    #[test]
    fn an_unrenewed_lease_runs_out_and_the_job_is_dropped() {
        let (jobs, clock, _) = leased_jobs();
        jobs.register_leased(&shuffle("j", 7, &[0]), &as_pid(0), false, leased(""))
            .unwrap();
        assert_eq!(lease_of(&jobs, "j"), Some((60, LEASE, 1, 0)));
        clock.advance(LEASE);
        assert_eq!(lease_of(&jobs, "j"), Some((60, Duration::ZERO, 1, 0)));
        clock.advance(S);
        jobs.expire_leases();
        assert!(jobs.ids().is_empty(), "unregistered");
        assert!(jobs.files_of("j").is_none(), "its plan dropped");
        assert_eq!(lease_of(&jobs, "j"), None);
    }

    /// A progress report, an open of one of its files and a registration again each
    /// renew the lease; a job registered without a lease never runs out, and keeps no
    /// lease when a leased registration joins it (a scheduler's registration outlives
    /// its readers).
    #[test]
    fn renewals_keep_a_lease_and_an_unleased_job_keeps_its_lifetime() {
        let (jobs, clock, _) = leased_jobs();
        jobs.register_leased(&shuffle("j", 7, &[0]), &as_pid(0), false, leased(""))
            .unwrap();
        let step = LEASE - S;
        let wait = |d| {
            clock.advance(d);
            jobs.expire_leases();
            assert_eq!(jobs.ids(), ["j"], "renewed within the lease");
        };
        wait(step);
        assert!(jobs.progress("j", 0, 0).unwrap());
        wait(step);
        jobs.on_open(0, "f3", false); // applied at once: no prefetcher runs
        wait(step);
        jobs.register_leased(&shuffle("j", 7, &[0]), &as_pid(0), false, leased(""))
            .unwrap();
        wait(step);
        clock.advance(2 * S);
        jobs.expire_leases();
        assert!(jobs.ids().is_empty());

        jobs.register(&shuffle("k", 7, &[0]), &as_pid(0), false)
            .unwrap();
        jobs.register_leased(&shuffle("k", 7, &[1]), &as_pid(0), false, leased(""))
            .unwrap();
        clock.advance(100 * LEASE);
        assert_eq!(lease_of(&jobs, "k"), Some((0, Duration::ZERO, 0, 0)));
        assert_eq!(jobs.ids(), ["k"], "no lease: lives until unregistered");
        // A rank letting go does not end it; an unregister does.
        assert!(jobs.unregister_holder("k", 0, "rank1"));
        assert_eq!(jobs.ids(), ["k"]);
        assert!(jobs.unregister_holder("k", 0, ""));
        assert!(jobs.ids().is_empty());
    }

    /// A holder process alive keeps the job past its lease however long nothing renews
    /// it; once it is gone (or its pid is another process now), the job lives one lease
    /// more at most.
    #[test]
    fn a_live_holder_keeps_the_job() {
        let (jobs, clock, procs) = leased_jobs();
        procs.set(100, 7);
        jobs.register_leased(&shuffle("j", 7, &[0]), &as_pid(100), false, leased(""))
            .unwrap();
        for _ in 0..10 {
            clock.advance(LEASE);
            jobs.expire_leases();
        }
        assert_eq!(lease_of(&jobs, "j").map(|l| (l.2, l.3)), Some((1, 1)));
        // The pid reused by a process started later: not the holder.
        procs.kill(100);
        procs.set(100, 8);
        assert_eq!(lease_of(&jobs, "j").map(|l| (l.2, l.3)), Some((1, 0)));
        clock.advance(LEASE + S);
        jobs.expire_leases();
        assert!(
            jobs.ids().is_empty(),
            "gone one lease after its holder at most"
        );
    }

    /// Two ranks of one job on one node register it (one plan with both ranks, two
    /// holders): one rank's unregister removes its holder only, the job stays for the
    /// other; the other's removes the job. A holder named by the client (its pid hidden
    /// from the daemon) leaves by that name; a release naming no holder of the job
    /// changes nothing; an unregister naming no holder (`shardcache unregister` in a
    /// shell) removes the job whoever holds it.
    #[test]
    fn one_holders_unregister_keeps_the_others() {
        let (jobs, _, procs) = leased_jobs();
        procs.set(100, 7);
        procs.set(101, 9);
        procs.set(555, 1);
        for (pid, rank) in [(100, 0), (101, 1)] {
            jobs.register_leased(&shuffle("j", 7, &[rank]), &as_pid(pid), false, leased(""))
                .unwrap();
        }
        assert_eq!(
            jobs.plans.planner().shuffles(),
            vec![("j".to_owned(), 4, vec![0, 1])]
        );
        assert_eq!(lease_of(&jobs, "j").map(|l| (l.2, l.3)), Some((2, 2)));
        assert!(jobs.unregister_holder("j", 100, ""));
        assert_eq!(jobs.ids(), ["j"], "the other rank holds it");
        assert_eq!(lease_of(&jobs, "j").map(|l| (l.2, l.3)), Some((1, 1)));
        assert!(jobs.unregister_holder("j", 101, ""));
        assert!(jobs.ids().is_empty(), "the last holder left");

        // Holders named by the clients, their pids hidden (0).
        for (holder, rank) in [("a", 0), ("b", 1)] {
            jobs.register_leased(&shuffle("j", 7, &[rank]), &as_pid(0), false, leased(holder))
                .unwrap();
        }
        assert!(jobs.unregister_holder("j", 0, "a"));
        assert_eq!(jobs.ids(), ["j"]);
        // A release from a process that holds nothing (again, or never) changes nothing.
        assert!(jobs.unregister_holder("j", 0, "a"));
        assert!(jobs.unregister_holder("j", 555, "z"));
        assert_eq!(lease_of(&jobs, "j").map(|l| l.2), Some(1));
        jobs.register_leased(&shuffle("j", 7, &[0]), &as_pid(0), false, leased("a"))
            .unwrap();
        assert_eq!(lease_of(&jobs, "j").map(|l| l.2), Some(2));
        // Someone else's unregister: the job goes.
        assert!(jobs.unregister_holder("j", 555, ""));
        assert!(jobs.ids().is_empty());
    }

    #[test]
    fn a_stat_line_gives_the_start_time_unless_a_zombie() {
        let line = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 12345 67";
        assert_eq!(parse_stat(line), Some(987_654));
        let zombie = line.replace(") S ", ") Z ");
        assert_eq!(parse_stat(&zombie), None);
        assert_eq!(parse_stat("garbage"), None);
        // This process: alive, and the same start time twice.
        let me = std::process::id() as i32;
        let t = ProcFs.start_time(me);
        assert!(t.is_some());
        assert_eq!(ProcFs.start_time(me), t);
        assert_eq!(ProcFs.start_time(0), None, "a pid the daemon cannot see");
    }
}
