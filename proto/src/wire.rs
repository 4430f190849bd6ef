//! Framing of the local protocol: a little-endian `u32` length, then one encoded prost
//! message ([`crate::frame`], as the daemons' block stream). File descriptors ride beside a frame as `SCM_RIGHTS` ancillary data on the
//! `sendmsg` that carries its first byte.
//!
//! Both ends use blocking sockets (the daemon serves each local connection on its own
//! thread, the client library is synchronous): a request/response exchange is two
//! syscalls on each side, which keeps the open path's latency close to a bare round trip.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use prost::Message;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::frame;

/// Largest frame either side accepts: the client's limit on replies. Larger frames are
/// a protocol error.
pub const MAX_FRAME: usize = 16 << 20;
/// Largest request the daemon reads (64 paths of 4 KiB fit easily; a manifest that does
/// not fit travels by descriptor). The daemon answers a larger one with an `ErrorReply`
/// naming this limit (its `id` is 0: the request was not read) and skips it.
pub const MAX_REQUEST: usize = 1 << 20;
/// Most descriptors one frame may carry (and most files one OpenMany may name).
pub const MAX_FDS: usize = 64;
/// Longest path a request may name, in bytes: Linux's `PATH_MAX` (4096) less its NUL, as
/// the kernel counts (a longer path it refuses with `ENAMETOOLONG`, so neither may the
/// cache serve it).
pub const MAX_PATH: usize = 4095;

pub use crate::frame::size_text;

/// What can go wrong moving a frame.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed (including a read or write timeout: `WouldBlock`/`TimedOut`).
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// A frame (announced by the peer, or about to be sent) is larger than the limit.
    #[error("a frame of {len} bytes is over the {} limit", size_text(*limit))]
    TooLarge {
        /// The frame's length.
        len: usize,
        /// The limit it exceeds.
        limit: usize,
    },
    /// The frame did not decode as the expected message.
    #[error("malformed message: {0}")]
    Decode(#[from] prost::DecodeError),
}

impl From<frame::TooLarge> for WireError {
    fn from(frame::TooLarge { len, limit }: frame::TooLarge) -> Self {
        WireError::TooLarge { len, limit }
    }
}

impl From<frame::EncodeError> for WireError {
    fn from(e: frame::EncodeError) -> Self {
        match e {
            frame::EncodeError::TooLarge(t) => t.into(),
            frame::EncodeError::Prost(e) => io::Error::other(e.to_string()).into(),
        }
    }
}

impl WireError {
    /// True when the error is a socket timeout (the peer is slow, not necessarily gone).
    pub fn is_timeout(&self) -> bool {
        matches!(self, WireError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

/// Encodes `msg` into one frame and sends it, with `fds` attached to its first byte.
pub fn send<M: Message>(sock: impl AsFd, msg: &M, fds: &[BorrowedFd<'_>]) -> Result<(), WireError> {
    debug_assert!(fds.len() <= MAX_FDS);
    let buf = frame::encode(msg, MAX_FRAME)?;

    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("ancillary buffer too small").into());
    }
    let mut sent = 0;
    while sent < buf.len() {
        let iov = [IoSlice::new(&buf[sent..])];
        let r = if sent == 0 {
            rustix::net::sendmsg(&sock, &iov, &mut control, SendFlags::NOSIGNAL)
        } else {
            rustix::net::send(&sock, &buf[sent..], SendFlags::NOSIGNAL)
        };
        match r {
            Ok(n) => sent += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(io::Error::from(e).into()),
        }
    }
    Ok(())
}

/// Reads frames from one socket, keeping bytes that arrived beyond the current frame.
#[derive(Debug)]
pub struct FrameReader {
    /// Allocated (and zeroed) once; `start..end` holds received, unparsed bytes.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    limit: usize,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameReader {
    /// A reader accepting frames up to [`MAX_FRAME`].
    pub fn new() -> Self {
        Self::with_limit(MAX_FRAME)
    }

    /// A reader refusing frames larger than `limit` bytes (at most [`MAX_FRAME`]) before
    /// allocating anything for them: a server reading requests from untrusted peers
    /// keeps this small.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            end: 0,
            limit: limit.min(MAX_FRAME),
        }
    }

    /// Receives one frame and decodes it as `M`, returning it with the descriptors that
    /// arrived with it (close-on-exec set). Blocks until it arrives (or the socket's
    /// read timeout passes).
    pub fn recv<M: Message + Default>(
        &mut self,
        sock: impl AsFd,
    ) -> Result<(M, Vec<OwnedFd>), WireError> {
        self.recv_spin(sock, Duration::ZERO)
    }

    /// Like [`FrameReader::recv`], but first polls without sleeping for up to `spin`.
    ///
    /// On virtual machines a sleeping thread takes tens of microseconds to wake; a
    /// request/response peer that answers within `spin` is then served without any
    /// sleep on this side, at the price of one busy core for at most `spin`.
    pub fn recv_spin<M: Message + Default>(
        &mut self,
        sock: impl AsFd,
        spin: Duration,
    ) -> Result<(M, Vec<OwnedFd>), WireError> {
        let mut fds = Vec::new();
        let spin_until = (!spin.is_zero()).then(|| Instant::now() + spin);
        let len = loop {
            if let Some(len) = self.frame_len()?
                && self.end - self.start >= frame::PREFIX + len
            {
                break len;
            }
            self.fill(sock.as_fd(), &mut fds, spin_until)?;
        };
        let body = &self.buf[self.start + frame::PREFIX..self.start + frame::PREFIX + len];
        let msg = M::decode(body)?;
        self.start += frame::PREFIX + len;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok((msg, fds))
    }

    /// Skips the frame that [`FrameReader::recv`] refused as too large (`len` bytes, as
    /// its [`WireError::TooLarge`] said), reading and discarding its body in small
    /// pieces (nothing is allocated for it) and closing any descriptors that came with
    /// it, so that the next frame on the connection can be read. Blocks until the whole
    /// body arrived (or the socket's read timeout passes).
    pub fn skip(&mut self, sock: impl AsFd, len: usize) -> Result<(), WireError> {
        debug_assert!(
            self.end - self.start >= frame::PREFIX,
            "skip follows a refused header"
        );
        self.start += frame::PREFIX;
        let buffered = self.end - self.start;
        if buffered >= len {
            self.start += len;
        } else {
            let mut left = len - buffered;
            self.start = 0;
            self.end = 0;
            let mut scratch = [0u8; 64 << 10];
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            while left > 0 {
                let want = left.min(scratch.len());
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let mut iov = [IoSliceMut::new(&mut scratch[..want])];
                match rustix::net::recvmsg(&sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
                    Ok(r) => {
                        // Descriptors of a skipped frame are closed here.
                        for m in control.drain() {
                            if let RecvAncillaryMessage::ScmRights(rights) = m {
                                rights.for_each(drop);
                            }
                        }
                        if r.bytes == 0 {
                            return Err(WireError::Closed);
                        }
                        left -= r.bytes;
                    }
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(io::Error::from(e).into()),
                }
            }
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(())
    }

    fn frame_len(&self) -> Result<Option<usize>, WireError> {
        if self.end - self.start < frame::PREFIX {
            return Ok(None);
        }
        let mut b = [0u8; frame::PREFIX];
        b.copy_from_slice(&self.buf[self.start..self.start + frame::PREFIX]);
        Ok(Some(frame::len_of(b, self.limit)?))
    }

    fn fill(
        &mut self,
        sock: BorrowedFd<'_>,
        fds: &mut Vec<OwnedFd>,
        spin_until: Option<Instant>,
    ) -> Result<(), WireError> {
        // Make room: move unparsed bytes to the front, grow for a large frame.
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let need = match self.frame_len()? {
            Some(len) => frame::PREFIX + len,
            None => frame::PREFIX,
        };
        let want = need.max(64 << 10);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        loop {
            let spinning = spin_until.is_some_and(|t| Instant::now() < t);
            let flags = if spinning {
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT
            } else {
                RecvFlags::CMSG_CLOEXEC
            };
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut self.buf[self.end..])];
            match rustix::net::recvmsg(sock, &mut iov, &mut control, flags) {
                Ok(r) => {
                    for m in control.drain() {
                        if let RecvAncillaryMessage::ScmRights(rights) = m {
                            fds.extend(rights);
                        }
                    }
                    if r.bytes == 0 {
                        return Err(WireError::Closed);
                    }
                    self.end += r.bytes;
                    return Ok(());
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) if spinning => std::hint::spin_loop(),
                Err(e) => return Err(io::Error::from(e).into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::v1 as pb;
    use std::io::{Read, Seek, Write};
    use std::os::unix::net::UnixStream;

    #[test]
    fn frames_and_descriptors_round_trip() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"payload").unwrap();
        let req = pb::Request {
            id: 7,
            kind: Some(pb::request::Kind::Open(pb::OpenRequest {
                path: "/x".into(),
            })),
            ..Default::default()
        };
        send(&a, &req, &[f.as_fd()]).unwrap();
        send(&a, &req, &[]).unwrap();
        let mut r = FrameReader::new();
        let (got, fds): (pb::Request, _) = r.recv(&b).unwrap();
        assert_eq!(got, req);
        assert_eq!(fds.len(), 1);
        let mut passed = std::fs::File::from(fds.into_iter().next().unwrap());
        passed.rewind().unwrap();
        let mut s = String::new();
        passed.read_to_string(&mut s).unwrap();
        assert_eq!(s, "payload");
        let (got2, fds2): (pb::Request, _) = r.recv(&b).unwrap();
        assert_eq!(got2.id, 7);
        assert!(fds2.is_empty());
        drop(a);
        assert!(matches!(r.recv::<pb::Request>(&b), Err(WireError::Closed)));
    }

    #[test]
    fn oversized_frame_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&(MAX_FRAME as u32 + 1).to_le_bytes())
            .unwrap();
        let mut r = FrameReader::new();
        assert!(matches!(
            r.recv::<pb::Request>(&b),
            Err(WireError::TooLarge { .. })
        ));
    }

    #[test]
    fn an_oversized_frame_is_skipped_whole_and_the_next_one_read() {
        let (a, b) = UnixStream::pair().unwrap();
        let req = pb::Request {
            id: 9,
            ..Default::default()
        };
        let limit = 1000;
        for body_len in [10, 1001, 200_000] {
            // The oversized frame, with a descriptor, then a good one; written from
            // another thread (more than the socket buffer holds).
            let a2 = a.try_clone().unwrap();
            let req2 = req.clone();
            let writer = std::thread::spawn(move || {
                let f = tempfile::tempfile().unwrap();
                let mut frame = (body_len as u32 + limit as u32).to_le_bytes().to_vec();
                frame.resize(4 + body_len + limit, 7);
                let iov = [IoSlice::new(&frame[..1])];
                let fds = [f.as_fd()];
                let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
                rustix::net::sendmsg(&a2, &iov, &mut control, SendFlags::empty()).unwrap();
                (&a2).write_all(&frame[1..]).unwrap();
                send(&a2, &req2, &[]).unwrap();
            });
            let mut r = FrameReader::with_limit(limit);
            let len = match r.recv::<pb::Request>(&b) {
                Err(WireError::TooLarge { len, limit: l }) => {
                    assert_eq!(l, limit);
                    len
                }
                other => panic!("{other:?}"),
            };
            assert_eq!(len, body_len + limit);
            r.skip(&b, len).unwrap();
            let (got, fds): (pb::Request, _) = r.recv(&b).unwrap();
            assert_eq!(got, req);
            assert!(fds.is_empty());
            writer.join().unwrap();
        }
        assert_eq!(size_text(16 << 20), "16 MiB");
        assert_eq!(size_text(4096), "4 KiB");
        assert_eq!(size_text(1000), "1000 bytes");
    }
}
