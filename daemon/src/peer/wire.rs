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
//!    a MAC over both nonces ([`proof`], role `client`). A wrong proof ends the
//!    connection: the caller gets nothing else. The server then proves the secret too
//!    (role `server`), so the client never trusts bytes from a node that does not hold
//!    it. The secret itself never travels; fresh nonces on both sides make a recorded
//!    exchange useless to replay, and the role in the proof keeps one side's proof from
//!    being reflected back as the other's.
//! 3. Both ends derive the connection's [`Session`] keys from the secret and both
//!    nonces: one per direction, fresh for every connection. Then any number of
//!    exchanges: a [`frame`] holding a `FetchRequest` and its tag, answered by a frame
//!    holding a `BlockHeader`, then — when its code is OK — exactly `length` raw bytes of
//!    the block, then the reply's tag. A tag is keyed BLAKE3 ([`crate::checksum::Mac`])
//!    over the message's sequence number in its direction, (for a reply) the request it
//!    answers as sent, the frame and the bytes. The receiver checks it before it acts
//!    on the request or trusts a byte of the block: bytes injected into the connection,
//!    changed on the way, or replayed from an earlier exchange, of this connection or
//!    another one, do not verify ([`WireError::Forged`]), and the connection ends.
//!    The header also carries the block's xxh3-64, the store's checksum: the sender
//!    checked the very bytes it sends against it (a damaged copy is not sent), and the
//!    receiver checks them too, in the same pass as the MAC, and records it with the
//!    block. The tag says who sent header and bytes, that nothing changed on the way,
//!    and that they are the answer to this request; the checksum, that they are the
//!    bytes it was recorded for (a holder of the secret with a damaged copy or buffer
//!    cannot put them in another node's cache).
//!
//! A frame is a 4-byte little-endian length and that many bytes of protobuf, at most
//! [`MAX_FRAME`] ([`shardcache_proto::frame`], the local protocol's framing too). Everything here is blocking I/O: both ends run it on their own threads.
//! Nothing is secret from a listener on the path but the secret itself (the bytes travel
//! in the clear unless the port runs TLS: see `peer::tls`).
//!
//! [`frame`]: write_frame

use std::io::{self, IoSlice, Read, Write};

use shardcache_proto::frame;

use super::proto::{BlockHeader, FetchRequest};
use crate::checksum::{MAC_LEN, Mac, MacKey, derive_key};

/// The first bytes of a block-stream connection (version 2 of this protocol: every
/// message MACed; version 1 carried block bytes with only their xxh3).
pub const MAGIC: [u8; 8] = *b"SCPEERD2";
/// Bytes of each side's nonce.
pub const NONCE: usize = 32;
/// Bytes of a proof.
pub const PROOF: usize = MAC_LEN;
/// Bytes of the tag after every message.
pub const TAG: usize = MAC_LEN;
/// Largest frame (request or block header) either end accepts.
pub const MAX_FRAME: usize = 64 << 10;

/// Key-derivation purposes (see [`derive_key`]).
const PROOF_KEY: &str = "shardcache 2026-12 peer block stream proof";
const CLIENT_KEY: &str = "shardcache 2026-12 peer block stream client to server";
const SERVER_KEY: &str = "shardcache 2026-12 peer block stream server to client";

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
            Role::Client => b"client",
            Role::Server => b"server",
        }
    }
}

/// A fresh random nonce from the operating system.
pub fn nonce() -> io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(n)
}

fn mac(secret: &[u8], role: Role, client: &[u8; NONCE], server: &[u8; NONCE]) -> Mac {
    let mut m = Mac::new(&derive_key(PROOF_KEY, &[secret]));
    m.update(role.label()).update(client).update(server);
    m
}

/// `role`'s proof that it holds `secret`, for the nonces of this connection.
pub fn proof(secret: &[u8], role: Role, client: &[u8; NONCE], server: &[u8; NONCE]) -> [u8; PROOF] {
    mac(secret, role, client, server).tag()
}

/// Checks `given` against `role`'s proof, in time independent of where they differ.
pub fn check_proof(
    secret: &[u8],
    role: Role,
    client: &[u8; NONCE],
    server: &[u8; NONCE],
    given: &[u8],
) -> bool {
    mac(secret, role, client, server).verify(given)
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

/// Why an exchange on an established connection failed (the connection is done).
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A message's tag did not verify: it was not sent by the other end of this
    /// session, was changed on the way, or was replayed or reordered.
    #[error(
        "a message failed its MAC (forged, changed on the way, or replayed): dropped with its connection"
    )]
    Forged,
    /// The connection failed, timed out, or carried a malformed frame.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// One authenticated connection's state: a key and a sequence number per direction,
/// and the last request (a reply's tag covers the request it answers). Requests and
/// replies alternate: the client sends one request and reads its reply before the next.
pub struct Session {
    send: MacKey,
    sent: u64,
    recv: MacKey,
    received: u64,
    /// The last request sent (client) or read (server), as framed.
    request: Vec<u8>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

/// The check of a reply in progress: the block's bytes go through [`Opening::update`]
/// as they arrive; [`Session::finish_reply`] then reads the tag and checks it.
#[must_use = "a reply is trusted only once Session::finish_reply checked it"]
#[derive(Debug)]
pub struct Opening(Mac);

impl Opening {
    /// Adds the next piece of the block's bytes.
    pub fn update(&mut self, piece: &[u8]) {
        self.0.update(piece);
    }
}

impl Session {
    fn new(role: Role, secret: &[u8], client: &[u8; NONCE], server: &[u8; NONCE]) -> Self {
        let c = derive_key(CLIENT_KEY, &[secret, client, server]);
        let s = derive_key(SERVER_KEY, &[secret, client, server]);
        let (send, recv) = match role {
            Role::Client => (c, s),
            Role::Server => (s, c),
        };
        Self {
            send,
            sent: 0,
            recv,
            received: 0,
            request: Vec::new(),
        }
    }

    /// Sends a request (client).
    pub fn send_request<W: Write>(&mut self, w: &mut W, req: &FetchRequest) -> io::Result<()> {
        let frame = encode_frame(req)?;
        let tag = Mac::new(&self.send)
            .update(&self.sent.to_le_bytes())
            .update(&frame)
            .tag();
        write_all_parts(w, &mut [IoSlice::new(&frame), IoSlice::new(&tag)])?;
        self.sent += 1;
        self.request = frame;
        Ok(())
    }

    /// Reads the next request (server), checked before it is decoded. `Ok(None)` when
    /// the connection ended cleanly between requests (the client is done).
    pub fn read_request<R: Read>(&mut self, r: &mut R) -> Result<Option<FetchRequest>, WireError> {
        let Some(frame) = read_frame_bytes(r)? else {
            return Ok(None);
        };
        let mut tag = [0u8; TAG];
        r.read_exact(&mut tag)?;
        let ok = Mac::new(&self.recv)
            .update(&self.received.to_le_bytes())
            .update(&frame)
            .verify(&tag);
        if !ok {
            return Err(WireError::Forged);
        }
        self.received += 1;
        let req = decode_frame(&frame)?;
        self.request = frame;
        Ok(Some(req))
    }

    fn reply_mac(&self, key: &MacKey, seq: u64, frame: &[u8]) -> Mac {
        let mut m = Mac::new(key);
        m.update(&seq.to_le_bytes())
            .update_sized(&self.request)
            .update(frame);
        m
    }

    /// Sends the answer to the last request read (server): `head`, then `body` (the
    /// block: `head.length` bytes when `head.code` is 0, else nothing), then the tag, in
    /// one vectored write. (MACing and writing piece by piece, to overlap the MAC with
    /// the receiver's reading, measured no faster: the two ends share the CPUs, and
    /// more system calls cost more than the overlap saved.)
    pub fn send_reply<W: Write>(
        &mut self,
        w: &mut W,
        head: &BlockHeader,
        body: &[u8],
    ) -> io::Result<()> {
        let want = if head.code == 0 { head.length } else { 0 };
        if body.len() as u64 != want {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "block stream: a reply's bytes must match its header",
            ));
        }
        let frame = encode_frame(head)?;
        let tag = self
            .reply_mac(&self.send, self.sent, &frame)
            .update(body)
            .tag();
        write_all_parts(
            w,
            &mut [IoSlice::new(&frame), IoSlice::new(body), IoSlice::new(&tag)],
        )?;
        self.sent += 1;
        Ok(())
    }

    /// Reads the header of the answer to the last request sent (client). Nothing in it
    /// is trusted yet: its block's bytes (`length` of them when `code` is 0) go through
    /// the returned [`Opening`] as they are read, then [`Session::finish_reply`] checks
    /// the whole. A connection that ends here gives `UnexpectedEof`.
    pub fn read_reply<R: Read>(&mut self, r: &mut R) -> Result<(BlockHeader, Opening), WireError> {
        let frame = read_frame_bytes(r)?.ok_or(io::Error::from(io::ErrorKind::UnexpectedEof))?;
        let head = decode_frame(&frame)?;
        let m = self.reply_mac(&self.recv, self.received, &frame);
        Ok((head, Opening(m)))
    }

    /// Reads the reply's tag and checks it against everything read since
    /// [`Session::read_reply`]: only then may the header and the block be trusted.
    pub fn finish_reply<R: Read>(&mut self, r: &mut R, opened: Opening) -> Result<(), WireError> {
        let mut tag = [0u8; TAG];
        r.read_exact(&mut tag)?;
        if !opened.0.verify(&tag) {
            return Err(WireError::Forged);
        }
        self.received += 1;
        Ok(())
    }
}

/// Writes every byte of `parts`, in as few system calls as the writer takes.
fn write_all_parts<W: Write>(w: &mut W, mut parts: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !parts.is_empty() {
        match w.write_vectored(parts) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    // Nothing for TCP; TLS sends what it still holds.
    w.flush()
}

/// The client's side of the handshake on a fresh connection (nothing read or written
/// yet). On success the connection carries requests, in the returned session.
pub fn client_handshake<S: Read + Write>(
    s: &mut S,
    secret: &[u8],
) -> Result<Session, HandshakeError> {
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
    Ok(Session::new(Role::Client, secret, &mine, &theirs))
}

/// The server's side of the handshake, after [`MAGIC`] was read from `s`. On `Refused`
/// nothing was sent but the server's nonce; the caller closes the connection.
pub fn server_handshake<S: Read + Write>(
    s: &mut S,
    secret: &[u8],
) -> Result<Session, HandshakeError> {
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
    Ok(Session::new(Role::Server, secret, &theirs, &mine))
}

/// `msg` as one frame: its length, then its bytes.
fn encode_frame(msg: &impl prost::Message) -> io::Result<Vec<u8>> {
    frame::encode(msg, MAX_FRAME).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

fn decode_frame<M: prost::Message + Default>(f: &[u8]) -> io::Result<M> {
    M::decode(frame::body(f)).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Writes `msg` as one frame (no tag: the session's methods add one).
pub fn write_frame<W: Write>(w: &mut W, msg: &impl prost::Message) -> io::Result<()> {
    w.write_all(&encode_frame(msg)?)
}

/// Reads one frame, its length included. `Ok(None)` when the connection ended cleanly
/// before the frame began (the other end is done).
fn read_frame_bytes<R: Read>(r: &mut R) -> io::Result<Option<Vec<u8>>> {
    frame::read(r, MAX_FRAME)
}

/// Reads one frame holding an `M` (no tag: the session's methods check one).
/// `Ok(None)` when the connection ended cleanly before the frame began.
pub fn read_frame<M: prost::Message + Default, R: Read>(r: &mut R) -> io::Result<Option<M>> {
    read_frame_bytes(r)?.map(|f| decode_frame(&f)).transpose()
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
        let h = BlockHeader {
            code: 0,
            message: String::new(),
            length: 4 << 20,
            xxh3: 42,
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &h).unwrap();
        let mut r = buf.as_slice();
        let back: BlockHeader = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(back, h);
        assert!(read_frame::<BlockHeader, _>(&mut r).unwrap().is_none());
        let mut huge = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        huge.resize(4 + MAX_FRAME + 1, 0);
        assert!(read_frame::<BlockHeader, _>(&mut huge.as_slice()).is_err());
    }

    /// Two ends of one session (client, server), as after a handshake.
    fn sessions(secret: &[u8]) -> (Session, Session) {
        let (c, s) = (nonce().unwrap(), nonce().unwrap());
        (
            Session::new(Role::Client, secret, &c, &s),
            Session::new(Role::Server, secret, &c, &s),
        )
    }

    fn request(index: u64) -> FetchRequest {
        FetchRequest {
            root: "/data".into(),
            path: "shard-0".into(),
            size: 1 << 20,
            index,
            block_size: 1 << 16,
            ..Default::default()
        }
    }

    fn block(index: u64) -> (BlockHeader, Vec<u8>) {
        let body: Vec<u8> = (0..1000u32).map(|i| (i as u64 * 7 + index) as u8).collect();
        let head = BlockHeader {
            code: 0,
            message: String::new(),
            length: body.len() as u64,
            xxh3: crate::checksum::block_xxh3(&body),
        };
        (head, body)
    }

    /// The client's side of reading a reply: the header, the body, then the check.
    fn open(c: &mut Session, mut r: &[u8]) -> Result<(BlockHeader, Vec<u8>), WireError> {
        let (head, mut o) = c.read_reply(&mut r)?;
        let mut body = vec![
            0u8;
            if head.code == 0 {
                head.length as usize
            } else {
                0
            }
        ];
        r.read_exact(&mut body)?;
        o.update(&body);
        c.finish_reply(&mut r, o)?;
        Ok((head, body))
    }

    /// One exchange: the request as the client sent it and the reply as the server
    /// sent it, both checked by the other end.
    fn exchange(c: &mut Session, s: &mut Session, index: u64) -> (Vec<u8>, Vec<u8>) {
        let mut req = Vec::new();
        c.send_request(&mut req, &request(index)).unwrap();
        let got = s.read_request(&mut req.as_slice()).unwrap().unwrap();
        assert_eq!(got, request(index));
        let (head, body) = block(index);
        let mut rep = Vec::new();
        s.send_reply(&mut rep, &head, &body).unwrap();
        assert_eq!(
            rep.len(),
            4 + prost::Message::encoded_len(&head) + body.len() + TAG
        );
        (req, rep)
    }

    #[test]
    fn a_session_carries_requests_and_replies_checked() {
        let (mut c, mut s) = sessions(b"one shared secret");
        for i in 0..3 {
            let (_, rep) = exchange(&mut c, &mut s, i);
            let (head, body) = open(&mut c, &rep).unwrap();
            assert_eq!((head, body), block(i));
        }
        // A refusal is a reply too, checked as well (no body).
        let mut req = Vec::new();
        c.send_request(&mut req, &request(9)).unwrap();
        s.read_request(&mut req.as_slice()).unwrap().unwrap();
        let no = BlockHeader {
            code: tonic::Code::NotFound as u32,
            message: "not cached here".into(),
            ..Default::default()
        };
        let mut rep = Vec::new();
        assert!(
            s.send_reply(&mut rep, &no, b"bytes").is_err(),
            "no body with a refusal"
        );
        s.send_reply(&mut rep, &no, &[]).unwrap();
        assert_eq!(open(&mut c, &rep).unwrap().0, no);
        // The end between requests.
        assert!(s.read_request(&mut &[][..]).unwrap().is_none());
    }

    #[test]
    fn a_changed_byte_anywhere_in_a_reply_is_forged() {
        let (mut c, mut s) = sessions(b"one shared secret");
        let (_, rep) = exchange(&mut c, &mut s, 0);
        for at in (0..rep.len()).step_by(37).chain([rep.len() - 1]) {
            let mut bad = rep.clone();
            bad[at] ^= 1;
            // A fresh copy of the client's state for each try.
            let mut c2 = c.clone_for_test();
            match open(&mut c2, &bad) {
                Err(WireError::Forged) => {}
                // A changed header may also fail to decode or ask for other lengths.
                Err(WireError::Io(_)) => assert!(at < rep.len() - 1000 - TAG, "byte {at}"),
                Ok(_) => panic!("byte {at} changed and the reply verified"),
            }
        }
        // The block's bytes with their xxh3 fixed up (what an unkeyed checksum allows).
        let (mut head, mut body) = block(0);
        body[10] ^= 0xff;
        head.xxh3 = crate::checksum::block_xxh3(&body);
        let mut forged = Vec::new();
        write_frame(&mut forged, &head).unwrap();
        forged.extend_from_slice(&body);
        forged.extend_from_slice(&rep[rep.len() - TAG..]);
        assert!(matches!(open(&mut c, &forged), Err(WireError::Forged)));
    }

    #[test]
    fn replayed_reordered_or_reflected_messages_are_forged() {
        let secret = b"one shared secret";
        let (mut c, mut s) = sessions(secret);
        let (req0, rep0) = exchange(&mut c, &mut s, 0);
        open(&mut c, &rep0).unwrap();
        // The next request is answered with the earlier reply (a valid one, for another
        // block, of this session).
        let (req1, rep1) = exchange(&mut c, &mut s, 1);
        let mut c_replay = c.clone_for_test();
        assert!(matches!(open(&mut c_replay, &rep0), Err(WireError::Forged)));
        open(&mut c, &rep1).unwrap();
        // An earlier request sent again to the server.
        assert!(matches!(
            s.read_request(&mut req0.as_slice()),
            Err(WireError::Forged)
        ));
        // A request reflected back as a reply, a reply as a request.
        let mut s2 = s.clone_for_test();
        assert!(matches!(
            s2.read_request(&mut rep1.as_slice()),
            Err(WireError::Forged) | Err(WireError::Io(_))
        ));
        assert!(open(&mut c.clone_for_test(), &req1).is_err());
        // Another session (the same secret, other nonces): nothing carries over.
        let (mut c3, mut s3) = sessions(secret);
        assert!(matches!(
            s3.read_request(&mut req0.as_slice()),
            Err(WireError::Forged)
        ));
        let mut req = Vec::new();
        c3.send_request(&mut req, &request(0)).unwrap();
        assert!(matches!(open(&mut c3, &rep0), Err(WireError::Forged)));
    }

    impl Session {
        fn clone_for_test(&self) -> Session {
            Session {
                send: self.send,
                sent: self.sent,
                recv: self.recv,
                received: self.received,
                request: self.request.clone(),
            }
        }
    }
}
