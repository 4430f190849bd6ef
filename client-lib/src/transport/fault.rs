//! Faults of the path to the daemon, as a wrapper over any [`Transport`]: refused
//! connections, connections that hang (every receive waits its whole timeout on the
//! wrapper's clock, and the reply, if one comes, is left unread) or are closed under the
//! caller. The wrapped transport and its daemon know nothing of it.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::wire::WireError;

use super::{Connection, Transport, timed_out};
use crate::clock::Clock;

/// Switches and counters shared by a [`FaultyTransport`] and its connections.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// New connections are refused.
    pub refuse: AtomicBool,
    /// Every receive waits its timeout and times out.
    pub hang: AtomicBool,
    /// Every send and receive finds the connection closed.
    pub close: AtomicBool,
    /// Connections made through the wrapper.
    pub connects: AtomicU64,
}

/// `inner`, with [`Faults`] injected.
#[derive(Debug)]
pub(crate) struct FaultyTransport {
    inner: Arc<dyn Transport>,
    faults: Arc<Faults>,
    clock: Arc<dyn Clock>,
}

impl FaultyTransport {
    pub(crate) fn new(
        inner: Arc<dyn Transport>,
        faults: Arc<Faults>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            inner,
            faults,
            clock,
        }
    }
}

impl Transport for FaultyTransport {
    fn connect(&self) -> io::Result<Box<dyn Connection>> {
        if self.faults.refuse.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "fault: connection refused",
            ));
        }
        let inner = self.inner.connect()?;
        self.faults.connects.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(FaultyConnection {
            inner,
            faults: self.faults.clone(),
            clock: self.clock.clone(),
        }))
    }
}

struct FaultyConnection {
    inner: Box<dyn Connection>,
    faults: Arc<Faults>,
    clock: Arc<dyn Clock>,
}

impl Connection for FaultyConnection {
    fn send(
        &mut self,
        req: &pb::Request,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(), WireError> {
        if self.faults.close.load(Ordering::SeqCst) {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe).into());
        }
        self.inner.send(req, fds, timeout)
    }

    fn recv(
        &mut self,
        timeout: Duration,
        spin: Duration,
    ) -> Result<(pb::Response, Vec<OwnedFd>), WireError> {
        if self.faults.close.load(Ordering::SeqCst) {
            return Err(WireError::Closed);
        }
        if self.faults.hang.load(Ordering::SeqCst) {
            self.clock.sleep(timeout);
            return Err(timed_out());
        }
        self.inner.recv(timeout, spin)
    }
}
