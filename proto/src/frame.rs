//! The framing both of shardcache's prost protocols use: the local Unix-socket protocol
//! ([`crate::wire`], with descriptors beside its frames) and the daemons' block stream
//! (the daemon's `peer::wire`, with a MAC tag and block bytes after its frames).
//!
//! A frame is a little-endian `u32` length, then that many bytes of one encoded prost
//! message. Each protocol has its own limit, checked on both sides: before a frame is
//! sent, and on receipt as soon as its length is known, before anything is allocated for
//! its body. What rides beside the frames, and how a socket is read, is each protocol's
//! own; this module only encodes, checks lengths, and reads one frame from a [`Read`].

use std::io::{self, Read};

use prost::Message;

/// Bytes of a frame's length prefix.
pub const PREFIX: usize = 4;

/// A byte limit as people write it: `16 MiB`, `4 KiB`, or bytes.
pub fn size_text(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n.is_multiple_of(1 << 20) => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n.is_multiple_of(1 << 10) => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

/// A frame (announced by the other end, or about to be sent) over its protocol's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a frame of {len} bytes is over the {} limit", size_text(*limit))]
pub struct TooLarge {
    /// The frame's length (its body, without the prefix).
    pub len: usize,
    /// The limit it exceeds.
    pub limit: usize,
}

/// Why a message could not be framed.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The message is larger than the limit.
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
    /// prost refused it (it does not, into a growable buffer; kept for exhaustiveness).
    #[error("the message did not encode: {0}")]
    Prost(#[from] prost::EncodeError),
}

/// `len` when it is within `limit`.
pub fn check(len: usize, limit: usize) -> Result<usize, TooLarge> {
    if len > limit {
        return Err(TooLarge { len, limit });
    }
    Ok(len)
}

/// The body length a prefix announces, checked against `limit`.
pub fn len_of(prefix: [u8; PREFIX], limit: usize) -> Result<usize, TooLarge> {
    check(u32::from_le_bytes(prefix) as usize, limit)
}

/// `msg` as one frame, its prefix included, refused when its body is over `limit`.
pub fn encode(msg: &impl Message, limit: usize) -> Result<Vec<u8>, EncodeError> {
    let len = check(msg.encoded_len(), limit)?;
    // A limit is never above what the prefix can say: `u32` covers every protocol's.
    let prefix = u32::try_from(len).map_err(|_| TooLarge { len, limit })?;
    let mut buf = Vec::with_capacity(PREFIX + len);
    buf.extend_from_slice(&prefix.to_le_bytes());
    msg.encode(&mut buf)?;
    Ok(buf)
}

/// The body of a whole frame (as [`encode`] and [`read`] give it).
pub fn body(frame: &[u8]) -> &[u8] {
    frame.get(PREFIX..).unwrap_or_default()
}

/// Reads one whole frame, its prefix included. `Ok(None)` when `r` ended cleanly before
/// the frame began (the other end is done); a frame cut short is `UnexpectedEof`; one
/// over `limit` is `InvalidData`, its error a [`TooLarge`] naming the limit, refused
/// before its body is read or allocated.
pub fn read<R: Read>(r: &mut R, limit: usize) -> io::Result<Option<Vec<u8>>> {
    let mut prefix = [0u8; PREFIX];
    let mut got = 0;
    while got < PREFIX {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = len_of(prefix, limit).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut buf = vec![0u8; PREFIX + len];
    buf[..PREFIX].copy_from_slice(&prefix);
    r.read_exact(&mut buf[PREFIX..])?;
    Ok(Some(buf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::v1 as pb;

    fn msg() -> pb::Request {
        pb::Request {
            id: 7,
            kind: Some(pb::request::Kind::Open(pb::OpenRequest {
                path: "/data/shard-0".into(),
            })),
            ..Default::default()
        }
    }

    #[test]
    fn frames_round_trip() {
        let mut stream = encode(&msg(), 1 << 10).unwrap();
        assert_eq!(stream.len(), PREFIX + msg().encoded_len());
        stream.extend(encode(&pb::Request::default(), 1 << 10).unwrap());
        let mut r = stream.as_slice();
        let one = read(&mut r, 1 << 10).unwrap().unwrap();
        assert_eq!(pb::Request::decode(body(&one)).unwrap(), msg());
        let two = read(&mut r, 1 << 10).unwrap().unwrap();
        assert_eq!(two, [0, 0, 0, 0], "an empty message is a bare prefix");
        assert_eq!(
            pb::Request::decode(body(&two)).unwrap(),
            pb::Request::default()
        );
        assert!(read(&mut r, 1 << 10).unwrap().is_none(), "a clean end");
    }

    #[test]
    fn an_oversized_frame_is_refused_naming_the_limit() {
        let limit = 4 << 10;
        let big = pb::Request {
            id: 1,
            kind: Some(pb::request::Kind::Open(pb::OpenRequest {
                path: "x".repeat(limit),
            })),
            ..Default::default()
        };
        match encode(&big, limit) {
            Err(EncodeError::TooLarge(e)) => {
                assert_eq!(e.len, big.encoded_len());
                assert_eq!(e.limit, limit);
                assert!(e.to_string().contains("over the 4 KiB limit"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        // Announced by the other end: refused from the prefix alone (no body follows).
        let prefix = ((limit + 1) as u32).to_le_bytes();
        assert_eq!(
            len_of(prefix, limit),
            Err(TooLarge {
                len: limit + 1,
                limit
            })
        );
        let e = read(&mut prefix.as_slice(), limit).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert_eq!(
            e.to_string(),
            "a frame of 4097 bytes is over the 4 KiB limit"
        );
        // At the limit exactly is fine.
        let mut at = (limit as u32).to_le_bytes().to_vec();
        at.resize(PREFIX + limit, 0);
        assert_eq!(
            read(&mut at.as_slice(), limit).unwrap().unwrap().len(),
            PREFIX + limit
        );
        assert_eq!(size_text(16 << 20), "16 MiB");
        assert_eq!(size_text(1000), "1000 bytes");
    }

    #[test]
    fn a_short_read_is_an_unexpected_end() {
        let frame = encode(&msg(), 1 << 10).unwrap();
        for cut in [1, PREFIX - 1, PREFIX, frame.len() - 1] {
            let e = read(&mut &frame[..cut], 1 << 10).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
        assert!(read(&mut &frame[..0], 1 << 10).unwrap().is_none());
    }

    #[test]
    fn a_reader_that_gives_a_byte_at_a_time_still_reads_whole_frames() {
        /// Hands out one byte per call, interrupted before each.
        struct Trickle<'a>(&'a [u8], bool);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.1 = !self.1;
                if self.1 {
                    return Err(io::ErrorKind::Interrupted.into());
                }
                let Some((&b, rest)) = self.0.split_first() else {
                    return Ok(0);
                };
                buf[0] = b;
                self.0 = rest;
                Ok(1)
            }
        }
        let frame = encode(&msg(), 1 << 10).unwrap();
        let mut r = Trickle(&frame, false);
        assert_eq!(read(&mut r, 1 << 10).unwrap().unwrap(), frame);
        assert!(read(&mut r, 1 << 10).unwrap().is_none());
    }
}
