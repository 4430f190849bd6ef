//! Time as a seam: the [`Clock`] the daemon's rate limits (and whatever else is given
//! one) read, so that unit tests move time by hand instead of sleeping.
//!
//! [`SystemClock`] is the monotonic clock; [`ManualClock`] stands still until a test
//! advances it, and its `sleep` only advances it. Owns nothing else: no timers, no
//! threads.

use std::fmt::Debug;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// A monotonic clock that can also wait.
pub trait Clock: Send + Sync + Debug {
    /// Now.
    fn now(&self) -> Instant;
    /// Waits `d` (the system clock sleeps the thread; a manual one advances itself).
    fn sleep(&self, d: Duration);
}

/// The real monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, d: Duration) {
        if !d.is_zero() {
            std::thread::sleep(d);
        }
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Instant>,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    /// A clock standing at the real now.
    pub fn new() -> Self {
        Self {
            now: Mutex::new(Instant::now()),
        }
    }

    /// Moves the clock `d` forward.
    pub fn advance(&self, d: Duration) {
        *self.now.lock() += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *self.now.lock()
    }

    fn sleep(&self, d: Duration) {
        self.advance(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced_or_slept_on() {
        let c = ManualClock::new();
        let t0 = c.now();
        assert_eq!(c.now(), t0);
        c.advance(Duration::from_millis(5));
        c.sleep(Duration::from_millis(7));
        assert_eq!(c.now() - t0, Duration::from_millis(12));
    }
}
