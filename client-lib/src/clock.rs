//! The client's one source of time: deadlines of calls and waits, the breaker's
//! `retry_after`, and the wait and fallback times readers report.
//!
//! Production uses [`SystemClock`]; unit tests use [`ManualClock`], whose time moves
//! only when something sleeps on it (a fake daemon taking its time to answer, a hung
//! one never answering), so that the fallback logic is tested in-process, exactly and
//! without a single real sleep. The socket's own read and write timeouts are the
//! kernel's and stay in [`crate::transport::unix`]; nothing else reads the time.

use std::fmt;
#[cfg(test)]
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where the time comes from.
pub(crate) trait Clock: Send + Sync + fmt::Debug {
    /// The current instant.
    fn now(&self) -> Instant;
    /// Lets `d` pass (the system clock sleeps; a manual one moves its time forward).
    /// Only the test doubles of [`crate::transport`] take time this way.
    #[cfg_attr(not(test), allow(dead_code))]
    fn sleep(&self, d: Duration);
}

/// The operating system's monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }
}

/// A clock that moves only when told to ([`ManualClock::advance`]) or slept on.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct ManualClock {
    start: Instant,
    elapsed: Mutex<Duration>,
}

#[cfg(test)]
impl Default for ManualClock {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            elapsed: Mutex::new(Duration::ZERO),
        }
    }
}

#[cfg(test)]
impl ManualClock {
    /// Moves the time forward by `d`.
    pub(crate) fn advance(&self, d: Duration) {
        *self.elapsed.lock().unwrap_or_else(|e| e.into_inner()) += d;
    }

    /// Time passed since the clock was made.
    pub(crate) fn elapsed(&self) -> Duration {
        *self.elapsed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    fn sleep(&self, d: Duration) {
        self.advance(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let c = ManualClock::default();
        let t0 = c.now();
        assert_eq!(c.now(), t0);
        c.sleep(Duration::from_millis(300));
        c.advance(Duration::from_secs(2));
        assert_eq!(c.now() - t0, Duration::from_millis(2300));
        assert_eq!(c.elapsed(), Duration::from_millis(2300));
    }

    #[test]
    fn the_system_clock_moves_forward() {
        let c = SystemClock;
        let t0 = c.now();
        c.sleep(Duration::from_millis(1));
        assert!(c.now() > t0);
    }
}
