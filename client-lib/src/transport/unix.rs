//! The real transport: a blocking Unix stream socket to the daemon, framed by
//! [`shardcache_proto::wire`], with the kernel's socket timeouts bounding every send and
//! receive. No runtime, no threads: an exchange is a `sendmsg` and a `recvmsg` (after a
//! short spin, see [`crate::ClientConfig::spin`]).

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::wire::{self, FrameReader, WireError};

use super::{Connection, Transport};

/// Connections to the daemon's socket at a path.
#[derive(Debug, Clone)]
pub(crate) struct UnixTransport {
    socket: PathBuf,
}

impl UnixTransport {
    /// A transport to the socket at `socket`.
    pub(crate) fn new(socket: PathBuf) -> Self {
        Self { socket }
    }
}

impl Transport for UnixTransport {
    fn connect(&self) -> io::Result<Box<dyn Connection>> {
        match UnixStream::connect(&self.socket) {
            Ok(sock) => Ok(Box::new(UnixConnection {
                sock,
                reader: FrameReader::new(),
            })),
            Err(e) => Err(io::Error::new(
                e.kind(),
                format!("{}: {e}", self.socket.display()),
            )),
        }
    }
}

/// One connection: the socket and the frame reader that keeps what arrived beyond the
/// current frame.
#[derive(Debug)]
struct UnixConnection {
    sock: UnixStream,
    reader: FrameReader,
}

impl Connection for UnixConnection {
    fn send(
        &mut self,
        req: &pb::Request,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(), WireError> {
        self.sock.set_write_timeout(Some(timeout))?;
        wire::send(&self.sock, req, fds)
    }

    fn recv(
        &mut self,
        timeout: Duration,
        spin: Duration,
    ) -> Result<(pb::Response, Vec<OwnedFd>), WireError> {
        // A zero timeout would mean "block forever" to the kernel.
        self.sock
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        self.reader.recv_spin(&self.sock, spin)
    }
}
