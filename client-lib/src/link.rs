//! The client's link to the daemon, over a [`Transport`]: request ids, a pool of idle
//! connections, the breaker, and the deadline of every exchange. What a failure means
//! for the caller ([`CallError`]) is decided here, once.
//!
//! The rules (docs/SEMANTICS.md, section 2):
//! - No exchange waits longer than its timeout for the answer; a connection whose
//!   exchange did not complete (a timeout above all: its late answer may still come) is
//!   dropped, never pooled or used again.
//! - After a timeout, or a failure to reach the daemon on a fresh connection, the link is
//!   *down* for `retry_after`: every call fails at once (`Unavailable`), pooled
//!   connections included, so that the reader of a hung daemon's file pays the timeout
//!   once per `retry_after`, not once per block. A stale pooled connection (the daemon
//!   restarted) is not evidence that the daemon is down: the call is retried once on a
//!   fresh connection (every request is idempotent).
//! - The read accounting of [`Report`] rides on the next request that has room for it,
//!   and goes back to the report when that request is not delivered.
//!
//! This module knows nothing of what requests mean (opens, waits, status): that is the
//! client's and the reader's.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;
use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{request, response};
use shardcache_proto::wire::{self, WireError};

use crate::clock::Clock;
use crate::report::Report;
use crate::transport::{Connection, Transport};

/// Why the daemon could not answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error("daemon unavailable: {0}")]
    Unavailable(String),
    #[error("daemon timed out")]
    Timeout,
    #[error("daemon protocol error: {0}")]
    Protocol(String),
    /// The request is over a limit of the protocol; nothing was sent.
    #[error("{0}")]
    OverLimit(String),
}

impl CallError {
    /// The fallback reason a reader records when this ends its exchange.
    pub(crate) fn reason(&self) -> pb::FallbackReason {
        match self {
            CallError::Unavailable(_) => pb::FallbackReason::Unavailable,
            CallError::Timeout => pb::FallbackReason::Timeout,
            CallError::Protocol(_) => pb::FallbackReason::Protocol,
            CallError::OverLimit(_) => pb::FallbackReason::Refused,
        }
    }
}

impl From<CallError> for std::io::Error {
    fn from(e: CallError) -> Self {
        use std::io::{Error, ErrorKind};
        match e {
            CallError::Unavailable(m) => Error::new(ErrorKind::ConnectionRefused, m),
            CallError::Timeout => {
                Error::new(ErrorKind::TimedOut, "shardcached did not answer in time")
            }
            CallError::Protocol(m) => Error::new(ErrorKind::InvalidData, m),
            CallError::OverLimit(m) => Error::new(ErrorKind::InvalidInput, m),
        }
    }
}

/// A request sent and not yet answered; it owns its connection until [`Link::finish`].
pub(crate) struct Pending {
    conn: Box<dyn Connection>,
    was_pooled: bool,
    id: u64,
    report: Option<pb::ReadReport>,
    sent: Instant,
}

/// How the link behaves (from [`crate::ClientConfig`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinkConfig {
    /// Longest wait for room to send a request.
    pub send_timeout: Duration,
    /// How long the link stays down after the daemon failed to answer.
    pub retry_after: Duration,
    /// Most idle connections kept.
    pub pool: usize,
    /// How long a receive polls before it sleeps.
    pub spin: Duration,
}

/// Connections to the daemon, pooled, with the breaker.
pub(crate) struct Link {
    cfg: LinkConfig,
    transport: Arc<dyn Transport>,
    clock: Arc<dyn Clock>,
    pool: Mutex<Vec<Box<dyn Connection>>>,
    next_id: AtomicU64,
    down_until: Mutex<Option<Instant>>,
    /// Recent answer time, in nanoseconds (a moving average): a receive polls only while
    /// answers come within the spin ([`Link::spin`]).
    recent_ns: AtomicU64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("cfg", &self.cfg)
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

impl Link {
    pub(crate) fn new(
        cfg: LinkConfig,
        transport: Arc<dyn Transport>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            cfg,
            transport,
            clock,
            pool: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            down_until: Mutex::new(None),
            recent_ns: AtomicU64::new(0),
        }
    }

    /// The clock deadlines are kept on.
    pub(crate) fn clock(&self) -> &dyn Clock {
        &*self.clock
    }

    /// How long the next receive polls before it sleeps: the configured spin while the
    /// daemon's recent answers came within about twice it, else none. Polling pays for
    /// an answer that is microseconds away (a cached file's open); for one that waits on
    /// a fill (a cold file) it only takes a core from the threads doing the work, which
    /// on a small machine is the daemon's.
    fn spin(&self) -> Duration {
        let recent = Duration::from_nanos(self.recent_ns.load(Ordering::Relaxed));
        if recent <= self.cfg.spin * 2 {
            self.cfg.spin
        } else {
            Duration::ZERO
        }
    }

    /// Counts an answer that took `took` into the recent answer time (weight 1/8).
    fn answered_in(&self, took: Duration) {
        let took = took.as_nanos().min(u128::from(u32::MAX)) as u64;
        let old = self.recent_ns.load(Ordering::Relaxed);
        self.recent_ns
            .store(old - old / 8 + took / 8, Ordering::Relaxed);
    }

    fn is_down(&self) -> bool {
        let mut d = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        match *d {
            Some(t) if self.clock.now() < t => true,
            Some(_) => {
                *d = None;
                false
            }
            None => false,
        }
    }

    fn mark_down(&self) {
        *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(self.clock.now() + self.cfg.retry_after);
    }

    /// A pooled connection (`true`) or a new one (`false`).
    fn take_conn(&self, pooled: bool) -> Result<(Box<dyn Connection>, bool), CallError> {
        // First: after a timeout, a pooled connection to a hung daemon would cost another
        // `timeout` per call; for `retry_after` no call waits on the daemon at all.
        if self.is_down() {
            return Err(CallError::Unavailable(
                "shardcached recently unreachable".into(),
            ));
        }
        if pooled && let Some(c) = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok((c, true));
        }
        match self.transport.connect() {
            Ok(c) => Ok((c, false)),
            Err(e) => {
                self.mark_down();
                Err(CallError::Unavailable(e.to_string()))
            }
        }
    }

    /// Sends one request and waits up to `timeout` for its reply, with descriptors passed
    /// along. Cancel-safe in the sense that matters here: a connection whose exchange did
    /// not complete is dropped, never reused.
    pub(crate) fn call(
        &self,
        kind: request::Kind,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
        report: &Report,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        match self.call_once(kind.clone(), fds, timeout, true, report) {
            // A pooled connection may have been closed by a restarted daemon: every
            // request is idempotent, so try once more on a fresh connection.
            Err(CallError::Unavailable(_)) if !self.is_down() => {
                self.call_once(kind, fds, timeout, false, report)
            }
            r => r,
        }
    }

    fn call_once(
        &self,
        kind: request::Kind,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
        pooled: bool,
        report: &Report,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        let pending = self.send(kind, fds, pooled, report)?;
        self.finish(pending, timeout, report)
    }

    /// Sends a request without waiting for its reply (see [`Link::finish`]): the
    /// connection stays with the returned [`Pending`] until then.
    pub(crate) fn send(
        &self,
        kind: request::Kind,
        fds: &[BorrowedFd<'_>],
        pooled: bool,
        report: &Report,
    ) -> Result<Pending, CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut req = pb::Request {
            id,
            report: None,
            kind: Some(kind),
        };
        // Over the daemon's request limit nothing is sent: the daemon would only answer
        // that, and this says which limit without costing a round trip.
        let len = req.encoded_len();
        if len > wire::MAX_REQUEST {
            return Err(CallError::OverLimit(format!(
                "request of {len} bytes is over the local protocol's {} request limit; send less per request",
                wire::size_text(wire::MAX_REQUEST)
            )));
        }
        let (mut conn, was_pooled) = self.take_conn(pooled)?;
        // The piggybacked report is small, but never the reason a request is refused:
        // where it does not fit, it waits for the next request.
        let piggyback = report.take().and_then(|r| {
            if len + r.encoded_len() + 16 <= wire::MAX_REQUEST {
                Some(r)
            } else {
                report.give_back(&r);
                None
            }
        });
        req.report = piggyback.clone();
        let sent = conn.send(&req, fds, self.cfg.send_timeout);
        let pending = Pending {
            conn,
            was_pooled,
            id,
            report: piggyback,
            sent: self.clock.now(),
        };
        match sent {
            Ok(()) => Ok(pending),
            Err(e) => Err(self.failed(&pending, e, report)),
        }
    }

    /// Waits up to `timeout` for the reply to `pending`. A connection whose exchange did
    /// not complete is dropped, never reused.
    pub(crate) fn finish(
        &self,
        mut pending: Pending,
        timeout: Duration,
        report: &Report,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        let r = pending.conn.recv(timeout, self.spin());
        self.answered_in(self.clock.now().saturating_duration_since(pending.sent));
        match r {
            // Id 0 with an error: the daemon could not read the request (over its limit)
            // and says why; the connection stays in step.
            Ok((resp, fds))
                if resp.id == pending.id
                    || (resp.id == 0 && matches!(resp.kind, Some(response::Kind::Error(_)))) =>
            {
                let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
                if pool.len() < self.cfg.pool {
                    pool.push(pending.conn);
                }
                drop(pool);
                resp.kind
                    .map(|k| (k, fds))
                    .ok_or_else(|| CallError::Protocol("empty reply".into()))
            }
            // Id 0 answers no request: the daemon refused the connection, saying why.
            Ok((resp, _)) if resp.id == 0 => {
                let why = match resp.kind {
                    Some(response::Kind::Error(e)) => e.message,
                    _ => "shardcached refused the connection".into(),
                };
                Err(self.refused(&pending, why, report))
            }
            Ok(_) => Err(CallError::Protocol("reply to another request".into())),
            Err(e) => Err(self.failed(&pending, e, report)),
        }
    }

    /// The daemon refused the connection of `pending` (a new one is refused for a
    /// while, as when it could not be reached; a pooled one may be retried at once).
    fn refused(&self, pending: &Pending, why: String, report: &Report) -> CallError {
        if let Some(r) = &pending.report {
            report.give_back(r);
        }
        if !pending.was_pooled {
            self.mark_down();
        }
        CallError::Unavailable(why)
    }

    fn failed(&self, pending: &Pending, e: WireError, report: &Report) -> CallError {
        if let Some(r) = &pending.report {
            report.give_back(r);
        }
        if e.is_timeout() {
            self.mark_down();
            CallError::Timeout
        } else {
            // A stale pooled connection is not evidence that the daemon is down.
            if !pending.was_pooled && matches!(e, WireError::Closed | WireError::Io(_)) {
                self.mark_down();
            }
            CallError::Unavailable(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::transport::mem::{Answer, MemTransport, Script};

    #[test]
    fn a_receive_polls_only_while_answers_come_within_the_spin() {
        let clock = Arc::new(ManualClock::default());
        let spin = Duration::from_micros(50);
        let cfg = LinkConfig {
            send_timeout: Duration::from_secs(1),
            retry_after: Duration::from_secs(2),
            pool: 8,
            spin,
        };
        let transport = Arc::new(MemTransport::new(
            Script::new(|_| Answer::Hang),
            clock.clone(),
        ));
        let link = Link::new(cfg, transport, clock);
        assert_eq!(link.spin(), spin, "polls until answers say otherwise");
        // Answers that wait on fills (milliseconds): sleep instead.
        for _ in 0..16 {
            link.answered_in(Duration::from_millis(3));
        }
        assert_eq!(link.spin(), Duration::ZERO);
        // Cached files again (tens of microseconds): poll again.
        for _ in 0..64 {
            link.answered_in(Duration::from_micros(20));
        }
        assert_eq!(link.spin(), spin);
        // One slow answer among fast ones does not stop the polling.
        link.answered_in(Duration::from_micros(400));
        assert_eq!(link.spin(), spin);
    }
}
