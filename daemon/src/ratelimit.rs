//! The one token bucket of the daemon: bytes per second toward the backing store (the
//! `backing_bandwidth` throttle, scrub), and bytes or files per second for prefetch.
//!
//! Hand-written rather than `governor`: two of its users charge a cost only once it is
//! known (prefetch starts a file while the bucket is not in debt, then charges the file's
//! size, so one large file may overdraw it), which a GCRA limiter that refuses a cell
//! larger than its burst does not express; and one type with an injected [`Clock`] is
//! what lets the callers be tested without sleeping.
//!
//! Owns: the arithmetic of tokens over time. Must not: sleep on its own (it asks its
//! clock), know what a token stands for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::clock::{Clock, SystemClock};

/// A token bucket: `rate` tokens a second, at most `burst` saved up, and a debt allowed.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    clock: Arc<dyn Clock>,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// `rate` tokens a second (at least 1), at most `burst` saved, starting with
    /// `initial` tokens, on the system clock.
    pub fn new(rate: u64, burst: f64, initial: f64) -> Self {
        Self::with_clock(rate, burst, initial, Arc::new(SystemClock))
    }

    /// As [`TokenBucket::new`], on `clock`.
    pub fn with_clock(rate: u64, burst: f64, initial: f64, clock: Arc<dyn Clock>) -> Self {
        let now = clock.now();
        Self {
            rate: rate.max(1) as f64,
            burst,
            clock,
            state: Mutex::new((initial.min(burst), now)),
        }
    }

    /// Tokens per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// The tokens now (negative: in debt), after refilling for the time passed.
    fn refilled(&self, s: &mut (f64, Instant)) -> f64 {
        let now = self.clock.now();
        let (tokens, last) = *s;
        let tokens = (tokens + now.saturating_duration_since(last).as_secs_f64() * self.rate)
            .min(self.burst);
        *s = (tokens, now);
        tokens
    }

    /// Whether the bucket is not in debt now (a cost may start).
    pub fn allows(&self) -> bool {
        let mut s = self.state.lock();
        self.refilled(&mut s) >= 0.0
    }

    /// How long until the bucket is out of debt (zero when it is not in debt).
    pub fn until_allowed(&self) -> Duration {
        let mut s = self.state.lock();
        let tokens = self.refilled(&mut s);
        if tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-tokens / self.rate)
        }
    }

    /// Charges `n` tokens now, whatever the balance (it may go into debt), and says how
    /// long until the debt is paid back (zero when there is none).
    pub fn charge(&self, n: u64) -> Duration {
        let mut s = self.state.lock();
        let left = self.refilled(&mut s) - n as f64;
        s.0 = left;
        if left < 0.0 {
            Duration::from_secs_f64(-left / self.rate)
        } else {
            Duration::ZERO
        }
    }

    /// Takes `n` tokens, waiting on the clock while the bucket is in debt.
    pub fn take(&self, n: u64) {
        let wait = self.charge(n);
        self.clock.sleep(wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn bucket(rate: u64, burst: f64, initial: f64) -> (TokenBucket, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new());
        (
            TokenBucket::with_clock(rate, burst, initial, clock.clone()),
            clock,
        )
    }

    #[test]
    fn a_take_past_the_burst_waits_for_exactly_the_debt() {
        let (b, clock) = bucket(1000, 100.0, 100.0);
        let t0 = clock.now();
        b.take(100); // the burst: no wait
        assert_eq!(clock.now(), t0);
        b.take(500); // 500 in debt at 1000/s: half a second
        assert_eq!(clock.now() - t0, Duration::from_millis(500));
        // Over ten seconds, 10 000 tokens' worth and no more goes through.
        for _ in 0..100 {
            b.take(100);
        }
        let spent = (clock.now() - t0).as_secs_f64();
        assert!((spent - 10.5).abs() < 1e-6, "{spent}");
    }

    #[test]
    fn savings_are_capped_at_the_burst() {
        let (b, clock) = bucket(10, 5.0, 0.0);
        clock.advance(Duration::from_secs(3600));
        assert_eq!(b.charge(5), Duration::ZERO);
        assert_eq!(b.charge(10), Duration::from_secs(1));
    }

    #[test]
    fn a_cost_may_start_while_not_in_debt_and_overdraw() {
        // Prefetch: a file starts while the bucket is not in debt, then its size is
        // charged; the next waits until the debt is paid.
        let (b, clock) = bucket(100, 10.0, 0.0);
        assert!(b.allows());
        b.charge(1000);
        assert!(!b.allows());
        clock.advance(Duration::from_millis(9_990));
        assert!(!b.allows());
        assert_eq!(b.until_allowed(), Duration::from_millis(10));
        clock.advance(Duration::from_millis(10));
        assert!(b.allows());
    }

    #[test]
    fn a_clock_that_goes_nowhere_refills_nothing() {
        let (b, _clock) = bucket(1_000_000, 1e9, 0.0);
        assert!(b.allows());
        b.charge(1);
        assert!(!b.allows(), "no time passed, so the debt stands");
    }
}
