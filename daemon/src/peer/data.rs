//! The peer port's two kinds of connection, and the serving side of the block stream.
//!
//! One listener serves both: [`accept`] reads each new connection's first 8 bytes and
//! hands it to gRPC (with those bytes put back in front, [`Prefixed`]) or, when they are
//! [`wire::MAGIC`], to a block-stream thread. A block-stream connection runs on a thread
//! of its own with blocking I/O, as the Unix-socket server does: a block is one `pread`
//! into a buffer, a checksum check, a MAC over it and one `write` of it to the socket,
//! with no runtime hand-offs in between. The handshake (the caller proves the shared
//! secret) comes first and is bounded by the peer timeout; after it, every request must
//! carry its session's MAC and every answer carries one (see [`wire`]). At most
//! [`MAX_CONNS_PER_CALLER`] such connections from one address and [`MAX_CONNS`] in all
//! are open at once (more are closed at once: their callers read the backing store), so
//! that callers without the secret cannot hold more than that many threads, each for at
//! most the timeout; a node opens at most [`super::MAX_STREAMS`] to one peer, well
//! within the first bound. With TLS on (`super::tls`),
//! the accept loop runs each connection's TLS handshake first (async, bounded by the
//! same timeout) and reads the 8 bytes inside it; a block stream's thread then takes
//! the TLS state over with the socket.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::proto::{BlockHeader, FetchRequest};
use super::service::{Service, serve_block};
use super::tls::{Stream, Tls};
use super::wire::{self, HandshakeError, WireError};
use crate::lifecycle::Task;
use crate::stats::inc;

/// Most block-stream connections served at once from all callers.
pub(super) const MAX_CONNS: usize = 1024;
/// Most block-stream connections served at once from one address: twice what a node
/// opens to one peer ([`super::MAX_STREAMS`]), for the connections of a caller that
/// restarted and whose old ones this end has not seen closed yet.
pub(super) const MAX_CONNS_PER_CALLER: usize = 2 * super::MAX_STREAMS;
/// Least time between two warnings of connections closed for a bound (the others are
/// counted into the next warning).
const WARN_EVERY: Duration = Duration::from_secs(10);
/// How long a served connection may sit between requests before it is closed (callers
/// keep idle connections for less: [`super::KEEP_IDLE`]).
const IDLE: Duration = Duration::from_secs(60);

/// An accepted connection: plain TCP, or TLS over it (the port runs one or the other).
pub(super) enum PeerIo {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>),
}

impl PeerIo {
    fn tcp(&self) -> &tokio::net::TcpStream {
        match self {
            PeerIo::Plain(s) => s,
            PeerIo::Tls(s) => s.get_ref().0,
        }
    }

    /// The connection for a block-stream thread (blocking I/O).
    fn into_blocking(self) -> io::Result<Stream> {
        let blocking = |s: tokio::net::TcpStream| {
            let s = s.into_std()?;
            s.set_nonblocking(false)?;
            Ok::<_, io::Error>(s)
        };
        match self {
            PeerIo::Plain(s) => Ok(Stream::Plain(blocking(s)?)),
            PeerIo::Tls(s) => {
                // What TLS read ahead stays in the connection state, read next.
                let (s, conn) = s.into_inner();
                Ok(Stream::served(blocking(s)?, conn))
            }
        }
    }
}

macro_rules! both {
    ($io:expr, $s:ident => $e:expr) => {
        match $io {
            PeerIo::Plain($s) => $e,
            PeerIo::Tls($s) => $e,
        }
    };
}

impl AsyncRead for PeerIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        both!(self.get_mut(), s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for PeerIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        both!(self.get_mut(), s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        both!(self.get_mut(), s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        both!(self, s => s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self.get_mut(), s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self.get_mut(), s => Pin::new(s).poll_shutdown(cx))
    }
}

/// A gRPC connection whose first bytes were read to tell it from a block stream: they
/// are read again first.
pub(super) struct Prefixed {
    head: [u8; 8],
    at: usize,
    io: PeerIo,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.head.len() {
            let n = (this.head.len() - this.at).min(buf.remaining());
            buf.put_slice(&this.head[this.at..this.at + n]);
            this.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl Connected for Prefixed {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.io.tcp().connect_info()
    }
}

/// Accepts connections on the peer port until `stop` turns true: gRPC ones go to
/// `grpc` (tonic's incoming stream), block streams to `data`. With `tls`, every
/// connection is TLS first (a failed handshake counts as a refused caller). A
/// connection that does not finish its TLS handshake and send 8 bytes within `timeout`
/// is dropped.
pub(super) async fn accept(
    listener: tokio::net::TcpListener,
    grpc: tokio::sync::mpsc::Sender<io::Result<Prefixed>>,
    data: Arc<DataServer>,
    tls: Option<Arc<Tls>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    timeout: Duration,
) {
    let acceptor = tls.map(|t| t.acceptor());
    loop {
        let conn = tokio::select! {
            r = listener.accept() => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        let conn = match conn {
            Ok((c, _)) => c,
            Err(e) => {
                // Out of descriptors, most likely: back off instead of spinning.
                tracing::warn!(error = %e, "peer port: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = conn.set_nodelay(true);
        let (grpc, data, acceptor) = (grpc.clone(), data.clone(), acceptor.clone());
        tokio::spawn(async move {
            let opened = async {
                let mut io = match acceptor {
                    None => PeerIo::Plain(conn),
                    Some(a) => match a.accept(conn).await {
                        Ok(s) => PeerIo::Tls(Box::new(s)),
                        Err(e) => {
                            inc(&data.svc.stats.peer_refused);
                            tracing::debug!(error = %e, "peer port: TLS handshake refused");
                            return None;
                        }
                    },
                };
                let mut head = [0u8; 8];
                io.read_exact(&mut head).await.ok()?;
                Some((io, head))
            };
            let Ok(Some((io, head))) = tokio::time::timeout(timeout, opened).await else {
                return;
            };
            if head == wire::MAGIC {
                match io.into_blocking() {
                    Ok(s) => data.admit(s),
                    Err(e) => {
                        tracing::debug!(error = %e, "block stream: cannot take the connection")
                    }
                }
            } else {
                let _ = grpc.send(Ok(Prefixed { head, at: 0, io })).await;
            }
        });
    }
}

/// The open block-stream connections, each served by a [`Task`] whose stop shuts its
/// socket down (the thread is blocked in a read or write there, not on the stop).
#[derive(Default)]
struct Conns {
    next: u64,
    live: HashMap<u64, (Task, Option<std::net::IpAddr>)>,
    /// Open connections by the caller's address.
    by_caller: HashMap<std::net::IpAddr, usize>,
    closed: bool,
    /// When a connection closed for a bound was last warned of, and how many were closed
    /// since without a warning.
    warned: Option<Instant>,
    unwarned: u64,
}

impl Conns {
    /// Forgets connection `id` (its thread ends).
    fn remove(&mut self, id: u64) -> Option<Task> {
        let (task, ip) = self.live.remove(&id)?;
        if let Some(ip) = ip
            && let Some(n) = self.by_caller.get_mut(&ip)
        {
            *n -= 1;
            if *n == 0 {
                self.by_caller.remove(&ip);
            }
        }
        Some(task)
    }

    /// Why a new connection from `ip` is closed at once, if it is.
    fn over(&self, ip: Option<std::net::IpAddr>) -> Option<String> {
        if self.live.len() >= MAX_CONNS {
            return Some(format!("{MAX_CONNS} open in all"));
        }
        let n = ip
            .and_then(|ip| self.by_caller.get(&ip))
            .copied()
            .unwrap_or(0);
        (n >= MAX_CONNS_PER_CALLER).then(|| {
            format!(
                "{MAX_CONNS_PER_CALLER} open from {}",
                ip.map_or_else(|| "?".into(), |ip| ip.to_string())
            )
        })
    }
}

/// Serves block streams.
pub(super) struct DataServer {
    secret: Vec<u8>,
    /// The gRPC service: what is served, and how (the same for both protocols).
    pub(super) svc: Arc<Service>,
    conns: Mutex<Conns>,
}

impl DataServer {
    pub(super) fn new(secret: Vec<u8>, svc: Arc<Service>) -> Self {
        Self {
            secret,
            svc,
            conns: Mutex::new(Conns::default()),
        }
    }

    /// Serves a block-stream connection (its magic read) on a thread of its own, when
    /// fewer than [`MAX_CONNS`] are open, and fewer than [`MAX_CONNS_PER_CALLER`] from
    /// its caller's address; closes it otherwise (warned of at most once per
    /// [`WARN_EVERY`], with the count since).
    fn admit(self: Arc<Self>, conn: Stream) {
        let mut conns = self.conns.lock();
        if conns.closed {
            return;
        }
        let ip = conn.tcp().peer_addr().ok().map(|a| a.ip());
        if let Some(why) = conns.over(ip) {
            conns.unwarned += 1;
            if conns.warned.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                tracing::warn!(
                    closed = conns.unwarned,
                    bound = %why,
                    "block stream: too many connections; closing new ones (their callers read elsewhere)"
                );
                conns.warned = Some(Instant::now());
                conns.unwarned = 0;
            }
            return;
        }
        let Ok(shutdown) = conn.tcp().try_clone() else {
            return;
        };
        conns.next += 1;
        let id = conns.next;
        let me = self.clone();
        // Inserted below before the lock is let go: the thread's own removal (which takes
        // the lock) always finds it.
        let spawned = Task::spawn(
            "sc-peer-data",
            Arc::new(AtomicBool::new(false)),
            move |_| {
                me.serve(conn);
                let done = me.conns.lock().remove(id);
                // Dropped (detached: this very thread) outside the lock.
                drop(done);
            },
        );
        match spawned {
            Ok(t) => {
                let t = t.with_wake(move || {
                    let _ = shutdown.shutdown(std::net::Shutdown::Both);
                });
                conns.live.insert(id, (t, ip));
                if let Some(ip) = ip {
                    *conns.by_caller.entry(ip).or_default() += 1;
                }
            }
            Err(e) => tracing::warn!(error = %e, "block stream: cannot start a thread"),
        }
    }

    /// One connection: the handshake, then requests until the caller closes it, it idles
    /// for [`IDLE`], or anything fails (a request that fails its MAC included).
    fn serve(&self, mut s: Stream) {
        let tcp = s.tcp();
        let setup = tcp
            .set_nodelay(true)
            .and_then(|()| tcp.set_read_timeout(Some(self.svc.timeout)))
            .and_then(|()| tcp.set_write_timeout(Some(self.svc.timeout)));
        if let Err(e) = setup {
            tracing::debug!(error = %e, "block stream: socket setup failed");
            return;
        }
        let mut session = match wire::server_handshake(&mut s, &self.secret) {
            Ok(session) => session,
            Err(HandshakeError::Refused) => {
                inc(&self.svc.stats.peer_refused);
                tracing::debug!(peer = ?s.tcp().peer_addr().ok(), "block stream: caller without the secret refused");
                return;
            }
            Err(HandshakeError::Io(e)) => {
                tracing::debug!(error = %e, "block stream: handshake failed");
                return;
            }
        };
        // One block buffer for the connection's life.
        let mut buf = Vec::new();
        loop {
            if s.tcp().set_read_timeout(Some(IDLE)).is_err() {
                return;
            }
            let req = match session.read_request(&mut s) {
                Ok(Some(r)) => {
                    // The request's acknowledgement goes out now, not after a delayed-ack
                    // timer: the caller takes a request unacknowledged for long as a
                    // silent peer (`super::SILENCE_MAX`), and the answer may take a
                    // backing read.
                    let _ = rustix::net::sockopt::set_tcp_quickack(s.tcp(), true);
                    r
                }
                Ok(None) => return,
                Err(WireError::Forged) => {
                    inc(&self.svc.stats.peer_forged);
                    tracing::warn!(peer = ?s.tcp().peer_addr().ok(), "block stream: a request failed its MAC (forged or replayed on the way); connection closed");
                    return;
                }
                Err(WireError::Io(e)) => {
                    tracing::debug!(error = %e, "block stream: reading a request failed");
                    return;
                }
            };
            if let Err(e) = self.answer(&mut s, &mut session, &req, &mut buf) {
                tracing::debug!(error = %e, "block stream: sending a block failed");
                return;
            }
        }
    }

    fn answer(
        &self,
        s: &mut Stream,
        session: &mut wire::Session,
        req: &FetchRequest,
        data: &mut Vec<u8>,
    ) -> io::Result<()> {
        let svc = &self.svc;
        if req.release {
            svc.released(req);
            let head = BlockHeader {
                code: 0,
                message: String::new(),
                length: 0,
                xxh3: crate::checksum::block_xxh3(&[]),
            };
            return session.send_reply(s, &head, &[]);
        }
        let got = serve_block(&*svc.provider, &svc.meta, req, svc.timeout, data);
        match got {
            Ok((sum, key)) => {
                let head = BlockHeader {
                    code: 0,
                    message: String::new(),
                    length: data.len() as u64,
                    xxh3: sum,
                };
                session.send_reply(s, &head, data)?;
                svc.served(req, key, data.len());
            }
            Err(status) => {
                let head = BlockHeader {
                    code: status.code() as u32,
                    message: status.message().to_owned(),
                    length: 0,
                    xxh3: 0,
                };
                session.send_reply(s, &head, &[])?;
            }
        }
        Ok(())
    }

    /// Block-stream connections being served now.
    #[cfg(test)]
    pub(super) fn open(&self) -> usize {
        self.conns.lock().live.len()
    }

    /// Ends every block-stream connection (its socket shut down) and waits for their
    /// threads, all together at most the peer timeout and a second (one answering a
    /// request finishes it first: its fill is bounded by the timeout); a thread still
    /// running then, stuck in the backing store, is left behind and logged. No new
    /// connections are taken. Returns how many threads were left behind.
    pub(super) fn close(&self) -> usize {
        let mut live: Vec<Task> = {
            let mut conns = self.conns.lock();
            conns.closed = true;
            conns.live.drain().map(|(_, (t, _))| t).collect()
        };
        for t in &live {
            t.stop();
        }
        let deadline = Instant::now() + self.svc.timeout + Duration::from_secs(1);
        let mut left = 0;
        for t in &mut live {
            if !t.join(deadline.saturating_duration_since(Instant::now())) {
                left += 1;
            }
        }
        left
    }
}
