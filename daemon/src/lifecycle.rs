//! The daemon's long-lived threads: how each is named, stopped, joined and seen alive,
//! and one ordered shutdown.
//!
//! A [`Task`] is a named thread with a [`Stop`] signal its body polls or sleeps on
//! (and, for a body blocked elsewhere — in `accept`, on a part's own condition
//! variable — a wake-up the stop runs), a liveness flag the probes read (cleared when
//! the body returns or panics), and a bounded join: a thread stuck in a system call
//! that cannot be cancelled is left behind, logged, rather than holding shutdown.
//! [`Gauge`] counts short-lived threads (connections) and waits, without polling, for
//! them to end. [`Shutdown`] runs named steps in the order `daemon.rs` lists them.
//!
//! Owns no part of the cache and imports nothing of the daemon's parts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Marks a long-running thread as alive for as long as it is held: its drop (the thread
/// ending, by return or by panic) clears the flag the liveness probe reads.
#[derive(Debug)]
pub struct Alive(Arc<AtomicBool>);

impl Alive {
    /// Holds `flag` (already set by the caller) until dropped.
    pub fn new(flag: Arc<AtomicBool>) -> Self {
        Self(flag)
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A stop signal: set once, seen by polling or by a bounded sleep that it ends early.
#[derive(Debug, Default)]
pub struct Stop {
    stopped: Mutex<bool>,
    cv: Condvar,
}

impl Stop {
    /// True once [`Stop::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        *self.stopped.lock()
    }

    /// Sets the signal and wakes every [`Stop::sleep`].
    pub fn stop(&self) {
        *self.stopped.lock() = true;
        self.cv.notify_all();
    }

    /// Sleeps for `d`, or until stopped; true when stopped.
    pub fn sleep(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut g = self.stopped.lock();
        while !*g {
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return *g;
            }
        }
        true
    }
}

type WakeFn = Box<dyn Fn() + Send + Sync>;

/// A named thread with a stop signal, a liveness flag and a bounded join.
pub struct Task {
    name: String,
    stop: Arc<Stop>,
    alive: Arc<AtomicBool>,
    wake: Option<WakeFn>,
    handle: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task")
            .field("name", &self.name)
            .field("alive", &self.alive())
            .finish_non_exhaustive()
    }
}

impl Task {
    /// Runs `body` on a thread named `name`; `alive` (for the probes) is set now and
    /// cleared when `body` returns or panics.
    pub fn spawn(
        name: &str,
        alive: Arc<AtomicBool>,
        body: impl FnOnce(&Stop) + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(Stop::default());
        alive.store(true, Ordering::Release);
        let guard = Alive::new(alive.clone());
        let s = stop.clone();
        let spawned = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _alive = guard;
                body(&s);
            });
        match spawned {
            Ok(h) => Ok(Self {
                name: name.to_owned(),
                stop,
                alive,
                wake: None,
                handle: Some(h),
            }),
            Err(e) => {
                alive.store(false, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Runs `wake` when the task is stopped, for a body blocked somewhere [`Stop`] does
    /// not reach (an `accept`, a part's own condition variable).
    #[must_use]
    pub fn with_wake(mut self, wake: impl Fn() + Send + Sync + 'static) -> Self {
        self.wake = Some(Box::new(wake));
        self
    }

    /// The thread's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// False once the body has returned or panicked.
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Signals the body to stop (and wakes it); does not wait.
    pub fn stop(&self) {
        self.stop.stop();
        if let Some(w) = &self.wake {
            w();
        }
    }

    /// Waits up to `within` for the thread to end; true when it did (a second call
    /// after a true is true). A thread still running then is left behind and logged:
    /// one stuck in a system call cannot be cancelled, and must not hold shutdown.
    pub fn join(&mut self, within: Duration) -> bool {
        let Some(h) = self.handle.take() else {
            return true;
        };
        let deadline = Instant::now() + within;
        let mut pause = Duration::from_micros(100);
        while !h.is_finished() && Instant::now() < deadline {
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        if h.is_finished() {
            if h.join().is_err() {
                tracing::warn!(task = %self.name, "the thread ended by a panic");
            }
            true
        } else {
            tracing::warn!(task = %self.name, ?within, "the thread did not stop; leaving it behind");
            self.handle = Some(h);
            false
        }
    }

    /// [`Task::stop`], then [`Task::join`].
    pub fn shutdown(&mut self, within: Duration) -> bool {
        self.stop();
        self.join(within)
    }
}

impl Drop for Task {
    /// A task dropped without a shutdown is told to stop (not waited for).
    fn drop(&mut self) {
        if self.handle.is_some() {
            self.stop();
        }
    }
}

/// A wake-up a task sleeps on between events: `notify` from any thread, `wait` up to a
/// timeout (a notification that came while the task was busy is not lost).
#[derive(Debug, Default)]
pub struct Wake {
    woken: Mutex<bool>,
    cv: Condvar,
}

impl Wake {
    /// Wakes the waiter (or the next `wait`, if none is waiting now).
    pub fn notify(&self) {
        *self.woken.lock() = true;
        self.cv.notify_all();
    }

    /// Waits until notified or `timeout` passed; true when notified. Clears the
    /// notification.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut woken = self.woken.lock();
        while !*woken {
            if self.cv.wait_until(&mut woken, deadline).timed_out() {
                break;
            }
        }
        std::mem::replace(&mut *woken, false)
    }
}

/// Counts running short-lived threads (a guard each) and waits for them to end.
#[derive(Debug, Default)]
pub struct Gauge {
    n: Mutex<usize>,
    cv: Condvar,
    /// The count, readable without the lock.
    now: AtomicUsize,
}

/// One counted thread: held for its life.
#[derive(Debug)]
pub struct Counted(Arc<Gauge>);

impl Gauge {
    /// Counts one more until the returned guard drops.
    pub fn enter(self: &Arc<Self>) -> Counted {
        let mut n = self.n.lock();
        *n += 1;
        self.now.store(*n, Ordering::Release);
        Counted(self.clone())
    }

    /// The number running.
    pub fn get(&self) -> usize {
        self.now.load(Ordering::Acquire)
    }

    /// Waits up to `within` for the count to reach zero; returns how many remain.
    pub fn wait_zero(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        let mut n = self.n.lock();
        while *n > 0 {
            if self.cv.wait_until(&mut n, deadline).timed_out() {
                break;
            }
        }
        *n
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut n = self.0.n.lock();
        *n -= 1;
        self.0.now.store(*n, Ordering::Release);
        if *n == 0 {
            self.0.cv.notify_all();
        }
    }
}

/// One ordered shutdown of a `C` (the daemon): named steps run in the order they were
/// added, each logged with how long it took.
pub struct Shutdown<C> {
    steps: Vec<Step<C>>,
}

/// A named step of a [`Shutdown`].
struct Step<C> {
    name: &'static str,
    run: fn(&mut C),
}

impl<C> Default for Shutdown<C> {
    fn default() -> Self {
        Self { steps: Vec::new() }
    }
}

impl<C> std::fmt::Debug for Shutdown<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.steps.iter().map(|s| s.name))
            .finish()
    }
}

impl<C> Shutdown<C> {
    /// Adds `step`, to run after every step added before it.
    #[must_use]
    pub fn then(mut self, name: &'static str, step: fn(&mut C)) -> Self {
        self.steps.push(Step { name, run: step });
        self
    }

    /// The steps' names, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.steps.iter().map(|s| s.name).collect()
    }

    /// Runs the steps on `c`, in order.
    pub fn run(self, c: &mut C) {
        for Step { name, run } in self.steps {
            let t = Instant::now();
            run(c);
            tracing::debug!(step = name, seconds = t.elapsed().as_secs_f64(), "shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_stops_when_told_and_its_liveness_follows_it() {
        let alive = Arc::new(AtomicBool::new(false));
        let mut t = Task::spawn("sc-test", alive.clone(), |stop| {
            while !stop.sleep(Duration::from_secs(60)) {}
        })
        .unwrap();
        assert!(t.alive() && alive.load(Ordering::Acquire));
        assert_eq!(t.name(), "sc-test");
        let started = Instant::now();
        assert!(t.shutdown(Duration::from_secs(5)));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "woken, not slept out"
        );
        assert!(!t.alive() && !alive.load(Ordering::Acquire));
        assert!(t.join(Duration::ZERO), "joined already");
    }

    #[test]
    fn a_panicking_task_is_seen_dead() {
        let alive = Arc::new(AtomicBool::new(false));
        let mut t = Task::spawn("sc-panics", alive.clone(), |_| panic!("on purpose")).unwrap();
        assert!(t.join(Duration::from_secs(5)));
        assert!(!alive.load(Ordering::Acquire));
    }

    #[test]
    fn a_stuck_task_is_left_behind_within_the_bound() {
        let release = Arc::new(Stop::default());
        let r = release.clone();
        let mut t = Task::spawn("sc-stuck", Arc::new(AtomicBool::new(false)), move |_| {
            // Deaf to its own stop (as a thread in a hung system call is).
            r.sleep(Duration::from_secs(60));
        })
        .unwrap();
        let started = Instant::now();
        assert!(!t.shutdown(Duration::from_millis(50)));
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(t.alive());
        release.stop();
        assert!(t.join(Duration::from_secs(5)), "joined once it came back");
    }

    #[test]
    fn a_wake_reaches_a_body_blocked_elsewhere() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = Mutex::new(rx);
        let mut t = Task::spawn("sc-woken", Arc::new(AtomicBool::new(false)), move |stop| {
            while !stop.is_stopped() {
                let _ = rx.lock().recv();
            }
        })
        .unwrap()
        .with_wake(move || {
            let _ = tx.send(());
        });
        assert!(t.shutdown(Duration::from_secs(5)));
    }

    #[test]
    fn a_gauge_waits_for_its_threads_without_polling() {
        let g = Arc::new(Gauge::default());
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let c = g.enter();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(20 * i));
                    drop(c);
                })
            })
            .collect();
        assert_eq!(g.wait_zero(Duration::from_secs(5)), 0);
        assert_eq!(g.get(), 0);
        let _held = g.enter();
        assert_eq!(g.wait_zero(Duration::from_millis(10)), 1, "bounded");
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn shutdown_runs_its_steps_in_order() {
        let s = Shutdown::<Vec<&str>>::default()
            .then("a", |v| v.push("a"))
            .then("b", |v| v.push("b"))
            .then("c", |v| v.push("c"));
        assert_eq!(s.names(), ["a", "b", "c"]);
        let mut order = Vec::new();
        s.run(&mut order);
        assert_eq!(order, ["a", "b", "c"]);
    }
}
