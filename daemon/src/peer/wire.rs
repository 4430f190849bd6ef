//! The block stream's wire format: how two daemons move block bytes off gRPC.
//!
//! gRPC costs this path most of its throughput (HTTP/2 framing, a copy into and out of
//! every message, wake-ups between the runtime's tasks; `shardcache-bench peers`
//! measured it at 0.36–0.46 of a raw TCP stream). A block-stream connection instead
//! carries the bytes as they are, on the peer port itself:
//!
//! 1. The client sends [`MAGIC`] and a fresh random nonce (the peer port tells these
//!    connections from gRPC ones by the first 8 bytes; HTTP/2's preface starts `PRI *`).
//! 2. The server answers with its own nonce; the client proves the shared secret with
//!    an HMAC-SHA256 over both nonces ([`proof`], role `client`). A wrong proof ends the
//!    connection: the caller gets nothing else. The server then proves the secret too
//!    (role `server`), so the client never trusts bytes from a node that does not hold
//!    it. The secret itself never travels; fresh nonces on both sides make a recorded
//!    exchange useless to replay, and the role in the proof keeps one side's proof from
//!    being reflected back as the other's.
//! 3. Then any number of exchanges: a [`frame`] holding a `FetchRequest`, answered by a
//!    frame holding a `BlockHeader` and, when its code is OK, exactly `length` raw
//!    bytes, whose xxh3-64 is in the header (the sender checked them against it before
//!    sending; the receiver checks them before it trusts them).
//!
//! A frame is a 4-byte little-endian length and that many bytes of protobuf, at most
//! [`MAX_FRAME`]. Everything here is blocking I/O: both ends run it on their own threads.
//!
//! [`frame`]: write_frame

use std::io::{self, Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The first bytes of a block-stream connection (version 1 of this protocol).
pub const MAGIC: [u8; 8] = *b"SCPEERD1";
/// Bytes of each side's nonce.
pub const NONCE: usize = 32;
/// Bytes of a proof (HMAC-SHA256).
pub const PROOF: usize = 32;
/// Largest frame (request or block header) either end accepts.
pub const MAX_FRAME: usize = 64 << 10;

/// Which end a proof is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The node that asks for blocks.
    Client,
    /// The node that serves them.
    Server,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"shardcache peer block stream v1: client",
            Role::Server => b"shardcache peer block stream v1: server",
        }
    }
}

/// A fresh random nonce from the operating system.
pub fn nonce() -> io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(n)
}

fn mac(secret: &[u8], role: Role, client: &[u8; NONCE], server: &[u8; NONCE]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    m.update(role.label());
    m.update(client);
    m.update(server);
    m
}

/// `role`'s proof that it holds `secret`, for the nonces of this connection.
pub fn proof(secret: &[u8], role: Role, client: &[u8; NONCE], server: &[u8; NONCE]) -> [u8; PROOF] {
    mac(secret, role, client, server)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks `given` against `role`'s proof, in time independent of where they differ.
pub fn check_proof(
    secret: &[u8],
    role: Role,
    client: &[u8; NONCE],
    server: &[u8; NONCE],
    given: &[u8],
) -> bool {
    mac(secret, role, client, server)
        .verify_slice(given)
        .is_ok()
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The other end did not prove the shared secret.
    #[error("the other end did not prove the shared secret")]
    Refused,
    /// The connection failed or timed out.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The client's side of the handshake on a fresh connection (nothing read or written
/// yet). On success the connection carries requests.
pub fn client_handshake<S: Read + Write>(s: &mut S, secret: &[u8]) -> Result<(), HandshakeError> {
    let mine = nonce()?;
    let mut hello = [0u8; MAGIC.len() + NONCE];
    hello[..MAGIC.len()].copy_from_slice(&MAGIC);
    hello[MAGIC.len()..].copy_from_slice(&mine);
    s.write_all(&hello)?;
    let mut theirs = [0u8; NONCE];
    s.read_exact(&mut theirs)?;
    s.write_all(&proof(secret, Role::Client, &mine, &theirs))?;
    let mut answer = [0u8; PROOF];
    match s.read_exact(&mut answer) {
        Ok(()) => {}
        // A server that refused our proof closes the connection.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(HandshakeError::Refused),
        Err(e) => return Err(e.into()),
    }
    if !check_proof(secret, Role::Server, &mine, &theirs, &answer) {
        return Err(HandshakeError::Refused);
    }
    Ok(())
}

/// The server's side of the handshake, after [`MAGIC`] was read from `s`. On `Refused`
/// nothing was sent but the server's nonce; the caller closes the connection.
pub fn server_handshake<S: Read + Write>(s: &mut S, secret: &[u8]) -> Result<(), HandshakeError> {
    let mut theirs = [0u8; NONCE];
    s.read_exact(&mut theirs)?;
    let mine = nonce()?;
    s.write_all(&mine)?;
    let mut given = [0u8; PROOF];
    s.read_exact(&mut given)?;
    if !check_proof(secret, Role::Client, &theirs, &mine, &given) {
        return Err(HandshakeError::Refused);
    }
    s.write_all(&proof(secret, Role::Server, &theirs, &mine))?;
    Ok(())
}

/// Writes `msg` as one frame.
pub fn write_frame<W: Write>(w: &mut W, msg: &impl prost::Message) -> io::Result<()> {
    let len = msg.encoded_len();
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "frame too large",
        ));
    }
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    msg.encode(&mut buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    w.write_all(&buf)
}

/// Reads one frame holding an `M`. `Ok(None)` when the connection ended cleanly before
/// the frame began (the other end is done).
pub fn read_frame<M: prost::Message + Default, R: Read>(r: &mut R) -> io::Result<Option<M>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    M::decode(buf.as_slice())
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair(client_secret: &'static [u8], server_secret: &'static [u8]) -> (bool, bool) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let mut magic = [0u8; 8];
            b.read_exact(&mut magic).unwrap();
            assert_eq!(magic, MAGIC);
            server_handshake(&mut b, server_secret).is_ok()
            // `b` is dropped here: a refusing server closes the connection.
        });
        let client = client_handshake(&mut a, client_secret).is_ok();
        (client, server.join().unwrap())
    }

    #[test]
    fn both_ends_accept_only_the_same_secret() {
        assert_eq!(
            pair(b"one shared secret", b"one shared secret"),
            (true, true)
        );
        assert_eq!(
            pair(b"a wrong secret!!!", b"one shared secret"),
            (false, false)
        );
        assert_eq!(
            pair(b"one shared secret", b"a wrong secret!!!"),
            (false, false)
        );
    }

    #[test]
    fn proofs_depend_on_role_nonces_and_secret() {
        let (c, s) = ([1u8; NONCE], [2u8; NONCE]);
        let p = proof(b"k", Role::Client, &c, &s);
        assert!(check_proof(b"k", Role::Client, &c, &s, &p));
        assert!(
            !check_proof(b"k", Role::Server, &c, &s, &p),
            "not reflectable"
        );
        assert!(!check_proof(b"k", Role::Client, &s, &c, &p));
        assert!(!check_proof(b"K", Role::Client, &c, &s, &p));
        assert!(!check_proof(b"k", Role::Client, &c, &s, &p[..31]));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused() {
        let h = crate::peer::proto::BlockHeader {
            code: 0,
            message: String::new(),
            length: 4 << 20,
            xxh3: 42,
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &h).unwrap();
        let mut r = buf.as_slice();
        let back: crate::peer::proto::BlockHeader = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(back, h);
        assert!(
            read_frame::<crate::peer::proto::BlockHeader, _>(&mut r)
                .unwrap()
                .is_none()
        );
        let mut huge = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        huge.resize(4 + MAX_FRAME + 1, 0);
        assert!(read_frame::<crate::peer::proto::BlockHeader, _>(&mut huge.as_slice()).is_err());
    }
}
