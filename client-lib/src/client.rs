//! The client's public face: [`Client`] (its configuration, and the daemon's API as
//! calls: open, register, status, list, evict, verify) over one [`Link`] to the daemon
//! and one [`Report`] of what its readers read. How a call reaches the daemon, and what
//! a failure means, is [`crate::link`]'s; reading a file is [`crate::reader`]'s.

use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{request, response};
use shardcache_proto::wire;

use crate::api::{EvictTarget, Evicted, ListQuery, Listing, Registered, Status, Verified};
use crate::clock::{Clock, SystemClock};
use crate::link::{CallError, Link, LinkConfig, Pending};
use crate::reader::{OpenAhead, Reader};
use crate::report::Report;
use crate::transport::Transport;
use crate::transport::unix::UnixTransport;

/// Where the daemon listens unless `SHARDCACHE_SOCKET` or the configuration says
/// otherwise.
pub const DEFAULT_SOCKET: &str = "/run/shardcache/shardcached.sock";

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
    /// thread costs tens of microseconds on virtual machines), while the daemon's recent
    /// answers came within about twice it (never for answers that wait on fills).
    /// Default 50 µs (`$SHARDCACHE_SPIN_US`).
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

pub(crate) struct Inner {
    pub cfg: ClientConfig,
    link: Link,
    pub report: Report,
}

impl Inner {
    /// The clock every deadline is kept on.
    pub(crate) fn clock(&self) -> &dyn Clock {
        self.link.clock()
    }

    /// One exchange with the daemon, bounded by `timeout` (see [`Link::call`]).
    pub(crate) fn call(
        &self,
        kind: request::Kind,
        timeout: Duration,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        self.link.call(kind, &[], timeout, &self.report)
    }

    /// [`Inner::call`] with descriptors passed along with the request.
    pub(crate) fn call_fds(
        &self,
        kind: request::Kind,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        self.link.call(kind, fds, timeout, &self.report)
    }

    /// Sends a request without waiting for its reply (see [`Inner::finish`]).
    pub(crate) fn send(&self, kind: request::Kind, pooled: bool) -> Result<Pending, CallError> {
        self.link.send(kind, &[], pooled, &self.report)
    }

    /// Waits up to `timeout` for the reply to `pending`.
    pub(crate) fn finish(
        &self,
        pending: Pending,
        timeout: Duration,
    ) -> Result<(response::Kind, Vec<OwnedFd>), CallError> {
        self.link.finish(pending, timeout, &self.report)
    }
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
        let transport = Arc::new(UnixTransport::new(cfg.socket.clone()));
        Self::with_transport(cfg, transport, Arc::new(SystemClock))
    }

    /// A client talking to the daemon through `transport`, its time kept by `clock`
    /// (tests: a scripted daemon on a manual clock).
    pub(crate) fn with_transport(
        cfg: ClientConfig,
        transport: Arc<dyn Transport>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let link = Link::new(
            LinkConfig {
                send_timeout: cfg.timeout,
                retry_after: cfg.retry_after,
                pool: cfg.pool,
                spin: cfg.spin,
            },
            transport,
            clock,
        );
        Self {
            inner: Arc::new(Inner {
                cfg,
                link,
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
    pub fn register(&self, manifest_json: &str) -> io::Result<Registered> {
        self.register_with(manifest_json, 0, String::new())
    }

    /// Registers a manifest as [`Client::register`] does, with a lease of `lease` (whole
    /// seconds, at least one): the daemon keeps the job while this process is alive, or
    /// while the job is renewed within the lease (a registration again, a progress
    /// report, a read of one of its files), and unregisters it otherwise. This process
    /// becomes one of the job's holders: [`Client::release`] removes it. See
    /// docs/MANIFEST.md, "Leases", and [`crate::JobLease`], which does all of it.
    pub fn register_leased(&self, manifest_json: &str, lease: Duration) -> io::Result<Registered> {
        let secs = u32::try_from(lease.as_secs().max(1)).unwrap_or(u32::MAX);
        self.register_with(manifest_json, secs, crate::lease::holder())
    }

    fn register_with(
        &self,
        manifest_json: &str,
        lease_s: u32,
        holder: String,
    ) -> io::Result<Registered> {
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
            lease_s,
            holder: holder.clone(),
            ..Default::default()
        });
        // Room for the request's id.
        let reply = if inline.encoded_len() + 16 <= wire::MAX_REQUEST {
            self.inner.call(inline, timeout)?
        } else {
            let fd = sealed_memfd(manifest_json.as_bytes())?;
            let req = request::Kind::Register(pb::RegisterRequest {
                manifest_fd: true,
                lease_s,
                holder,
                ..Default::default()
            });
            self.inner.call_fds(req, &[fd.as_fd()], timeout)?
        };
        match reply {
            (response::Kind::Register(r), _) => Ok(r.into()),
            (response::Kind::Error(e), _) => {
                Err(io::Error::new(io::ErrorKind::InvalidInput, e.message))
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Forgets a registered job, whoever holds it; true if it was registered.
    pub fn unregister(&self, job: &str) -> io::Result<bool> {
        self.unregister_as(job, String::new())
    }

    /// This process stops holding leased job `job` ([`Client::register_leased`]): the
    /// daemon removes its holder only while other processes hold the job (other ranks on
    /// this node), else the job. True if the job was registered.
    pub fn release(&self, job: &str) -> io::Result<bool> {
        self.unregister_as(job, crate::lease::holder())
    }

    fn unregister_as(&self, job: &str, holder: String) -> io::Result<bool> {
        let req = request::Kind::Unregister(pb::UnregisterRequest {
            job: job.to_owned(),
            holder,
        });
        match self.inner.call(req, self.inner.cfg.timeout)? {
            (response::Kind::Unregister(r), _) => Ok(r.found),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Tells the daemon that `job` is about to read step `step` of epoch `epoch` (this
    /// renews its lease; within the epoch the job reads, the position only moves
    /// forward: a step behind the reads already recorded changes nothing); false when
    /// the daemon does not know the job (never registered
    /// there, its lease ran out, or the daemon restarted): register it again.
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
    pub fn status(&self) -> io::Result<Status> {
        match self.inner.call(
            request::Kind::Status(pb::StatusRequest {}),
            self.inner.cfg.timeout,
        )? {
            (response::Kind::Status(s), _) => Ok(s.into()),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// What the cache holds: the datasets (registered jobs, and per backing root the
    /// cached files no job plans), or a page of a job's or a path's files. A caller other
    /// than root or the daemon's user sees only what it may read. Errors: `NotFound` (no
    /// such job or path), `InvalidInput`, `PermissionDenied`, with the daemon's message.
    pub fn list(&self, query: ListQuery, timeout: Duration) -> io::Result<Listing> {
        match self
            .inner
            .call(request::Kind::List(query.into()), timeout)?
        {
            (response::Kind::List(r), _) => Ok(r.into()),
            (response::Kind::Error(e), _) => Err(daemon_error(e)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Drops cached copies (never anything on the backing store): of `paths` (files, or
    /// everything under directories), of a registered job's files, or everything. Only
    /// root and the daemon's user may; others get `PermissionDenied`.
    pub fn evict(&self, target: EvictTarget, timeout: Duration) -> io::Result<Evicted> {
        match self
            .inner
            .call(request::Kind::Evict(target.into()), timeout)?
        {
            (response::Kind::Evict(r), _) => Ok(r.into()),
            (response::Kind::Error(e), _) => Err(daemon_error(e)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Asks the daemon to re-check every cached block's checksum (may take long).
    pub fn verify(&self, timeout: Duration) -> io::Result<Verified> {
        match self
            .inner
            .call(request::Kind::Verify(pb::VerifyRequest {}), timeout)?
        {
            (response::Kind::Verify(v), _) => Ok(v.into()),
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
