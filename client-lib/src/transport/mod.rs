//! The seam between the client and the daemon's socket: a [`Transport`] makes
//! connections, and a [`Connection`] moves one framed request and one framed reply at a
//! time, each bounded by a timeout. Nothing here pools, retries, numbers requests or
//! decides what a failure means: that is [`crate::link`], written once over this trait.
//!
//! Implementations: [`unix::UnixTransport`] (the daemon's Unix socket, the local
//! protocol's framing of [`shardcache_proto::wire`], descriptors as `SCM_RIGHTS`) and,
//! for tests, [`mem::MemTransport`], a scripted daemon in the same process whose answers
//! take (manual-clock) time, hang, close the connection or come out of step, and
//! [`fault::FaultyTransport`], a wrapper that refuses connections or hangs and closes
//! them on demand over any transport. One conformance suite ([`conformance`]) runs over
//! all of them, so that the fake cannot drift from the socket.

use std::fmt;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::wire::WireError;

#[cfg(test)]
pub(crate) mod conformance;
#[cfg(test)]
pub(crate) mod fault;
#[cfg(test)]
pub(crate) mod mem;
pub(crate) mod unix;

/// Makes connections to the daemon.
pub(crate) trait Transport: Send + Sync + fmt::Debug {
    /// A new connection. The error names the daemon's address (its message is what a
    /// caller shows).
    fn connect(&self) -> io::Result<Box<dyn Connection>>;
}

/// One connection to the daemon. Requests and replies alternate; a connection whose
/// exchange did not complete (an error or a timeout) is out of step and must be dropped
/// by its owner, never used again.
pub(crate) trait Connection: Send {
    /// Sends `req` as one frame, `fds` attached, waiting at most `timeout` for room in
    /// the socket.
    fn send(
        &mut self,
        req: &pb::Request,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(), WireError>;

    /// Receives the next reply frame with the descriptors that came with it, waiting at
    /// most `timeout` (a timeout is an error for which [`WireError::is_timeout`] holds).
    /// `spin`: how long to poll before sleeping (an implementation may ignore it).
    fn recv(
        &mut self,
        timeout: Duration,
        spin: Duration,
    ) -> Result<(pb::Response, Vec<OwnedFd>), WireError>;
}

/// The error a connection reports when its `timeout` passed without an answer.
#[cfg(test)]
pub(crate) fn timed_out() -> WireError {
    WireError::Io(io::Error::from(io::ErrorKind::WouldBlock))
}
