//! Connections to the daemon: a pool, timeouts, a breaker, and read accounting.

use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;
use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{request, response};
use shardcache_proto::wire::{self, FrameReader, WireError};

use crate::reader::{OpenAhead, Reader};

/// Where the daemon listens unless `SHARDCACHE_SOCKET` or the configuration says
/// otherwise.
pub const DEFAULT_SOCKET: &str = "/run/shardcache/shardcached.sock";

/// Number of `FallbackReason` values (as the daemon counts them).
const FALLBACK_REASONS: usize = pb::FallbackReason::Protocol as usize + 1;

/// How a [`Client`] talks to the daemon.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The daemon's socket. Default: `$SHARDCACHE_SOCKET`, else [`DEFAULT_SOCKET`].
    pub socket: PathBuf,
    /// Longest wait for the daemon's answer to an open or a status request before the
    /// client reads the backing store instead. Default 1 s (`$SHARDCACHE_TIMEOUT_MS`).
    pub timeout: Duration,
    /// Longest wait for the daemon to fetch a missing block. Default 10 s
    /// (`$SHARDCACHE_WAIT_TIMEOUT_MS`).
    pub wait_timeout: Duration,
    /// After the daemon could not be reached or timed out, how long the client goes
    /// straight to the backing store before trying it again. Default 2 s.
    pub retry_after: Duration,
    /// Most idle connections kept. Default 8.
    pub pool: usize,
    /// How long to poll for the daemon's answer before sleeping (waking a sleeping
    /// thread costs tens of microseconds on virtual machines). Default 50 µs
    /// (`$SHARDCACHE_SPIN_US`).
    pub spin: Duration,
}

fn env_ms(name: &str) -> Option<Duration> {
    std::env::var(name)
        .ok()?
        .parse()
        .ok()
        .map(Duration::from_millis)
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            socket: std::env::var_os("SHARDCACHE_SOCKET")
                .map(PathBuf::from)
                .unwrap_or_else(|| DEFAULT_SOCKET.into()),
            timeout: env_ms("SHARDCACHE_TIMEOUT_MS").unwrap_or(Duration::from_secs(1)),
            wait_timeout: env_ms("SHARDCACHE_WAIT_TIMEOUT_MS").unwrap_or(Duration::from_secs(10)),
            retry_after: Duration::from_secs(2),
            pool: 8,
            spin: std::env::var("SHARDCACHE_SPIN_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_micros)
                .unwrap_or(Duration::from_micros(50)),
        }
    }
}

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

impl From<CallError> for io::Error {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Unavailable(m) => io::Error::new(io::ErrorKind::ConnectionRefused, m),
            CallError::Timeout => io::Error::new(
                io::ErrorKind::TimedOut,
                "shardcached did not answer in time",
            ),
            CallError::Protocol(m) => io::Error::new(io::ErrorKind::InvalidData, m),
            CallError::OverLimit(m) => io::Error::new(io::ErrorKind::InvalidInput, m),
        }
    }
}

struct Conn {
    sock: UnixStream,
    reader: FrameReader,
}

/// A request sent and not yet answered; it owns its connection until
/// [`Inner::finish`].
pub(crate) struct Pending {
    conn: Conn,
    was_pooled: bool,
    id: u64,
    report: Option<pb::ReadReport>,
}

#[derive(Default)]
pub(crate) struct Report {
    pub hit_bytes: AtomicU64,
    pub filled_bytes: AtomicU64,
    pub fallback_bytes: AtomicU64,
    pub hit_reads: AtomicU64,
    pub filled_reads: AtomicU64,
    pub fallback_reads: AtomicU64,
    pub fallback_opens: AtomicU64,
    /// Fallback opens and reads by `FallbackReason` (indexed by its value).
    fallback_opens_by: [AtomicU64; FALLBACK_REASONS],
    fallback_reads_by: [AtomicU64; FALLBACK_REASONS],
    /// Per registered job (by tag), from dropped readers.
    jobs: Mutex<HashMap<u64, pb::JobUsage>>,
}

impl Report {
    fn take(&self) -> Option<pb::ReadReport> {
        let r = pb::ReadReport {
            hit_bytes: self.hit_bytes.swap(0, Ordering::Relaxed),
            filled_bytes: self.filled_bytes.swap(0, Ordering::Relaxed),
            fallback_bytes: self.fallback_bytes.swap(0, Ordering::Relaxed),
            hit_reads: self.hit_reads.swap(0, Ordering::Relaxed),
            filled_reads: self.filled_reads.swap(0, Ordering::Relaxed),
            fallback_reads: self.fallback_reads.swap(0, Ordering::Relaxed),
            fallback_opens: self.fallback_opens.swap(0, Ordering::Relaxed),
            fallbacks: (0..FALLBACK_REASONS)
                .map(|i| pb::FallbackCount {
                    reason: i as i32,
                    opens: self.fallback_opens_by[i].swap(0, Ordering::Relaxed),
                    reads: self.fallback_reads_by[i].swap(0, Ordering::Relaxed),
                })
                .filter(|f| f.opens + f.reads > 0)
                .collect(),
            jobs: std::mem::take(&mut *self.jobs.lock().unwrap_or_else(|e| e.into_inner()))
                .into_values()
                .collect(),
        };
        (r != pb::ReadReport::default()).then_some(r)
    }

    /// Counts a fallback open (`open`) or read for `reason`.
    pub(crate) fn add_fallback(&self, reason: pb::FallbackReason, open: bool) {
        let i = (reason as usize).min(FALLBACK_REASONS - 1);
        let by = if open {
            &self.fallback_opens_by
        } else {
            &self.fallback_reads_by
        };
        by[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Adds a reader's totals to what is reported for job `tag`.
    pub(crate) fn add_job(&self, tag: u64, u: &pb::JobUsage) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let e = jobs.entry(tag).or_insert_with(|| pb::JobUsage {
            job_tag: tag,
            ..Default::default()
        });
        e.hit_bytes += u.hit_bytes;
        e.filled_bytes += u.filled_bytes;
        e.fallback_bytes += u.fallback_bytes;
        e.wait_ns += u.wait_ns;
        e.fallback_ns += u.fallback_ns;
    }

    fn give_back(&self, r: &pb::ReadReport) {
        self.hit_bytes.fetch_add(r.hit_bytes, Ordering::Relaxed);
        self.filled_bytes
            .fetch_add(r.filled_bytes, Ordering::Relaxed);
        self.fallback_bytes
            .fetch_add(r.fallback_bytes, Ordering::Relaxed);
        self.hit_reads.fetch_add(r.hit_reads, Ordering::Relaxed);
        self.filled_reads
            .fetch_add(r.filled_reads, Ordering::Relaxed);
        self.fallback_reads
            .fetch_add(r.fallback_reads, Ordering::Relaxed);
        self.fallback_opens
            .fetch_add(r.fallback_opens, Ordering::Relaxed);
        for u in &r.jobs {
            self.add_job(u.job_tag, u);
        }
        for f in &r.fallbacks {
            let i = usize::try_from(f.reason)
                .unwrap_or(0)
                .min(FALLBACK_REASONS - 1);
            self.fallback_opens_by[i].fetch_add(f.opens, Ordering::Relaxed);
            self.fallback_reads_by[i].fetch_add(f.reads, Ordering::Relaxed);
        }
    }
}

pub(crate) struct Inner {
    pub cfg: ClientConfig,
    pool: Mutex<Vec<Conn>>,
    next_id: AtomicU64,
    down_until: Mutex<Option<Instant>>,
    pub report: Report,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Deliver what is still unreported, if the daemon is there to take it.
        let jobs = !self
            .report
            .jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        if jobs
            || self.report.hit_reads.load(Ordering::Relaxed)
                + self.report.filled_reads.load(Ordering::Relaxed)
                + self.report.fallback_reads.load(Ordering::Relaxed)
                + self.report.fallback_opens.load(Ordering::Relaxed)
                > 0
        {
            let _ = self.call(
                request::Kind::Status(pb::StatusRequest {}),
                self.cfg.timeout,
            );
        }
    }
}

/// A handle on the local daemon. Cheap to clone; safe to share between threads.
///
/// Creating one never fails: when the daemon is absent, every [`Client::open`] reads
/// the backing store directly, and the client tries the daemon again later.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("socket", &self.inner.cfg.socket)
            .finish()
    }
}

impl Client {
    /// A client with the default configuration (environment variables honoured).
    pub fn connect() -> Self {
        Self::with_config(ClientConfig::default())
    }

    /// A client for the daemon at `socket`, other settings default.
    pub fn at(socket: impl AsRef<Path>) -> Self {
        Self::with_config(ClientConfig {
            socket: socket.as_ref().to_owned(),
            ..ClientConfig::default()
        })
    }

    /// A client with explicit settings.
    pub fn with_config(cfg: ClientConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                cfg,
                pool: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(1),
                down_until: Mutex::new(None),
                report: Report::default(),
            }),
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    /// Opens `path` for reading through the cache (or directly, see the crate docs).
    /// Errors are the backing store's own (`NotFound`, `PermissionDenied`, ...).
    pub fn open(&self, path: impl AsRef<Path>) -> io::Result<Reader> {
        Reader::open(self.clone(), path.as_ref())
    }

    /// Opens `path` when the daemon serves it; `None` otherwise, without touching the
    /// backing store (for callers with a fallback of their own, like the preload shim,
    /// which then runs the program's real `open`).
    pub fn open_cached(&self, path: impl AsRef<Path>) -> Option<Reader> {
        Reader::open_cached(self.clone(), path.as_ref())
    }

    /// Opens several files at once: one exchange with the daemon per 64 files instead
    /// of one per file. For loaders that know the next batch of samples; each result
    /// is what [`Client::open`] would give for that path.
    pub fn open_many<P: AsRef<Path>>(&self, paths: &[P]) -> Vec<io::Result<Reader>> {
        let paths: Vec<&Path> = paths.iter().map(AsRef::as_ref).collect();
        Reader::open_many(self, &paths)
    }

    /// Opens `paths` in order, one batch of `batch` files (at most 64) ahead of the
    /// caller: the daemon opens the next batch while the caller reads the current one.
    /// For loaders that know their order (a sampler's epoch, a manifest). Each item is
    /// what [`Client::open`] would give for that path.
    pub fn open_ahead<P: AsRef<Path>>(
        &self,
        paths: impl IntoIterator<Item = P>,
        batch: usize,
    ) -> OpenAhead {
        let paths = paths.into_iter().map(|p| p.as_ref().to_owned()).collect();
        OpenAhead::new(self.clone(), paths, batch)
    }

    /// Registers a prefetch manifest (docs/MANIFEST.md) with the daemon; returns the job
    /// id and the number of files. A malformed manifest is refused with the field named
    /// (`InvalidInput`), and so is one over the 64 MiB limit, with the limit named.
    ///
    /// A manifest that does not fit in one request (1 MiB) is passed by descriptor: a
    /// sealed memfd the daemon reads. The call waits 10 s (or `timeout` if longer), plus
    /// 2 s per MiB of manifest (the daemon parses and plans it), for the answer.
    pub fn register(&self, manifest_json: &str) -> io::Result<pb::RegisterReply> {
        const MAX: usize = shardcache_plan::manifest::MAX_BYTES;
        if manifest_json.len() > MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "manifest: {} bytes is over the {} limit (docs/MANIFEST.md): split the dataset into several jobs, or select its files with a glob",
                    manifest_json.len(),
                    wire::size_text(MAX)
                ),
            ));
        }
        let timeout = self.inner.cfg.timeout.max(Duration::from_secs(10))
            + Duration::from_secs(2 * (manifest_json.len() >> 20) as u64);
        let inline = request::Kind::Register(pb::RegisterRequest {
            manifest_json: manifest_json.to_owned(),
            ..Default::default()
        });
        // Room for the request's id.
        let reply = if inline.encoded_len() + 16 <= wire::MAX_REQUEST {
            self.inner.call(inline, timeout)?
        } else {
            let fd = sealed_memfd(manifest_json.as_bytes())?;
            let req = request::Kind::Register(pb::RegisterRequest {
                manifest_fd: true,
                ..Default::default()
            });
            self.inner.call_fds(req, &[fd.as_fd()], timeout)?
        };
        match reply {
            (response::Kind::Register(r), _) => Ok(r),
            (response::Kind::Error(e), _) => {
                Err(io::Error::new(io::ErrorKind::InvalidInput, e.message))
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Forgets a registered job; true if it was registered.
    pub fn unregister(&self, job: &str) -> io::Result<bool> {
        let req = request::Kind::Unregister(pb::UnregisterRequest {
            job: job.to_owned(),
        });
        match self.inner.call(req, self.inner.cfg.timeout)? {
            (response::Kind::Unregister(r), _) => Ok(r.found),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Tells the daemon that `job` is about to read step `step` of epoch `epoch`.
    pub fn progress(&self, job: &str, epoch: u64, step: u64) -> io::Result<bool> {
        let req = request::Kind::Progress(pb::ProgressRequest {
            job: job.to_owned(),
            epoch,
            step,
        });
        match self.inner.call(req, self.inner.cfg.timeout)? {
            (response::Kind::Progress(r), _) => Ok(r.found),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// The daemon's status.
    pub fn status(&self) -> io::Result<pb::StatusReply> {
        match self.inner.call(
            request::Kind::Status(pb::StatusRequest {}),
            self.inner.cfg.timeout,
        )? {
            (response::Kind::Status(s), _) => Ok(s),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// What the cache holds: with `job` and `path` empty, the datasets (registered jobs,
    /// and per backing root the cached files no job plans); with either, a page of its
    /// files. A caller other than root or the daemon's user sees only what it may read.
    /// Errors: `NotFound` (no such job or path), `InvalidInput`, `PermissionDenied`,
    /// with the daemon's message.
    pub fn list(&self, req: pb::ListRequest, timeout: Duration) -> io::Result<pb::ListReply> {
        match self.inner.call(request::Kind::List(req), timeout)? {
            (response::Kind::List(r), _) => Ok(r),
            (response::Kind::Error(e), _) => Err(daemon_error(e)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Drops cached copies (never anything on the backing store): of `paths` (files, or
    /// everything under directories), of a registered job's files, or everything. Only
    /// root and the daemon's user may; others get `PermissionDenied`.
    pub fn evict(&self, req: pb::EvictRequest, timeout: Duration) -> io::Result<pb::EvictReply> {
        match self.inner.call(request::Kind::Evict(req), timeout)? {
            (response::Kind::Evict(r), _) => Ok(r),
            (response::Kind::Error(e), _) => Err(daemon_error(e)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Asks the daemon to re-check every cached block's checksum (may take long).
    pub fn verify(&self, timeout: Duration) -> io::Result<pb::VerifyReply> {
        match self
            .inner
            .call(request::Kind::Verify(pb::VerifyRequest {}), timeout)?
        {
            (response::Kind::Verify(v), _) => Ok(v),
            (other, _) => Err(unexpected(&other)),
        }
    }
}

/// `bytes` in a memfd sealed against every change, for the daemon to read.
fn sealed_memfd(bytes: &[u8]) -> io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(
        "shardcache-manifest",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let mut f = std::fs::File::from(fd);
    f.write_all(bytes)?;
    rustix::fs::fcntl_add_seals(
        &f,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
    )?;
    Ok(OwnedFd::from(f))
}

/// The daemon's refusal as an error of the matching kind, with its message.
fn daemon_error(e: pb::ErrorReply) -> io::Error {
    let kind = match pb::ErrorCode::try_from(e.code) {
        Ok(pb::ErrorCode::NotFound) => io::ErrorKind::NotFound,
        Ok(pb::ErrorCode::PermissionDenied) => io::ErrorKind::PermissionDenied,
        Ok(pb::ErrorCode::Invalid) => io::ErrorKind::InvalidInput,
        Ok(pb::ErrorCode::Unspecified) | Err(_) => io::ErrorKind::Other,
    };
    io::Error::new(kind, e.message)
}

pub(crate) fn unexpected(k: &response::Kind) -> io::Error {
    let what = match k {
        response::Kind::Error(e) => format!("daemon error: {}", e.message),
        _ => "unexpected reply from shardcached".to_owned(),
    };
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl Inner {
    fn is_down(&self) -> bool {
        let mut d = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        match *d {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *d = None;
                false
            }
            None => false,
        }
    }

    fn mark_down(&self) {
        *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Instant::now() + self.cfg.retry_after);
    }

    /// A pooled connection (`true`) or a new one (`false`).
    fn take_conn(&self, pooled: bool) -> Result<(Conn, bool), CallError> {
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
        match UnixStream::connect(&self.cfg.socket) {
            Ok(sock) => Ok((
                Conn {
                    sock,
                    reader: FrameReader::new(),
                },
                false,
            )),
            Err(e) => {
                self.mark_down();
                Err(CallError::Unavailable(format!(
                    "{}: {e}",
                    self.cfg.socket.display()
                )))
            }
        }
    }

    /// Sends one request and waits up to `timeout` for its reply. Cancel-safe in the
    /// sense that matters here: a connection whose exchange did not complete is dropped,
    /// never reused.
    pub(crate) fn call(
        &self,
        kind: request::Kind,
        timeout: Duration,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        self.call_fds(kind, &[], timeout)
    }

    /// [`Inner::call`] with descriptors passed along with the request.
    pub(crate) fn call_fds(
        &self,
        kind: request::Kind,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        match self.call_once(kind.clone(), fds, timeout, true) {
            // A pooled connection may have been closed by a restarted daemon: every
            // request is idempotent, so try once more on a fresh connection.
            Err(CallError::Unavailable(_)) if !self.is_down() => {
                self.call_once(kind, fds, timeout, false)
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
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        let pending = self.send_fds(kind, fds, pooled)?;
        self.finish(pending, timeout)
    }

    /// Sends a request without waiting for its reply (see [`Inner::finish`]): the
    /// connection stays with the returned [`Pending`] until then.
    pub(crate) fn send(&self, kind: request::Kind, pooled: bool) -> Result<Pending, CallError> {
        self.send_fds(kind, &[], pooled)
    }

    fn send_fds(
        &self,
        kind: request::Kind,
        fds: &[BorrowedFd<'_>],
        pooled: bool,
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
        let (conn, was_pooled) = self.take_conn(pooled)?;
        // The piggybacked report is small, but never the reason a request is refused:
        // where it does not fit, it waits for the next request.
        let report = self.report.take().and_then(|r| {
            if len + r.encoded_len() + 16 <= wire::MAX_REQUEST {
                Some(r)
            } else {
                self.report.give_back(&r);
                None
            }
        });
        req.report = report.clone();
        let sent = conn
            .sock
            .set_write_timeout(Some(self.cfg.timeout))
            .map_err(WireError::from)
            .and_then(|()| wire::send(&conn.sock, &req, fds));
        let pending = Pending {
            conn,
            was_pooled,
            id,
            report,
        };
        match sent {
            Ok(()) => Ok(pending),
            Err(e) => Err(self.failed(&pending, e)),
        }
    }

    /// Waits up to `timeout` for the reply to `pending`. A connection whose exchange did
    /// not complete is dropped, never reused.
    pub(crate) fn finish(
        &self,
        mut pending: Pending,
        timeout: Duration,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        let conn = &mut pending.conn;
        let result = conn
            .sock
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(WireError::from)
            .and_then(|()| {
                conn.reader
                    .recv_spin::<pb::Response>(&conn.sock, self.cfg.spin)
            });
        match result {
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
                Err(self.refused(&pending, why))
            }
            Ok(_) => Err(CallError::Protocol("reply to another request".into())),
            Err(e) => Err(self.failed(&pending, e)),
        }
    }

    /// The daemon refused the connection of `pending` (a new one is refused for a
    /// while, as when it could not be reached; a pooled one may be retried at once).
    fn refused(&self, pending: &Pending, why: String) -> CallError {
        if let Some(r) = &pending.report {
            self.report.give_back(r);
        }
        if !pending.was_pooled {
            self.mark_down();
        }
        CallError::Unavailable(why)
    }

    fn failed(&self, pending: &Pending, e: WireError) -> CallError {
        if let Some(r) = &pending.report {
            self.report.give_back(r);
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
