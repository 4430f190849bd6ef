//! The local API server: a Unix stream socket, one thread per client connection.
//!
//! Each connection's credentials are read from the kernel once (`SO_PEERCRED`,
//! `SO_PEERGROUPS`) and every request on it is judged with them. An open of a cached
//! file answers with a fresh read-only descriptor of the data file (`SCM_RIGHTS`) and
//! the bitmap of the blocks the client may read through it; no file data crosses the
//! socket. Refusals carry a reason, and the client then reads the backing store itself.
//!
//! Threads, not async tasks: the open path is one request, a few hash lookups and an
//! `open(2)`, and a blocking thread answers it with the fewest wake-ups. Connections are
//! few (a pool per training process) and bounded by `max_connections`.

pub mod admin;
mod creds;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{Reason, request, response};
use shardcache_proto::wire::{self, FrameReader, WireError};

use crate::access::{self, Creds, Decision};
use crate::backing::{BackingError, Stat};
use crate::fill::{Filler, Priority, Scheduled, Target};
use crate::meta::{Meta, ResolveError};
use crate::stats::{Stats, inc};
use crate::store::{Store, StoreError, View};

/// Most blocks one Wait request may name.
const MAX_WAIT_BLOCKS: u64 = 1024;
/// Largest request accepted (64 paths of 4 KiB fit easily); larger ones end the
/// connection before anything is allocated for them.
const MAX_REQUEST: usize = 1 << 20;
/// How long a file stays pinned after a reader was told it is being filled (see
/// [`Store::pin`]); each wait of that reader renews it.
const PIN: Duration = Duration::from_secs(2);
/// Longest path accepted (Linux PATH_MAX).
const MAX_PATH: usize = 4096;

/// What request handlers share.
#[derive(Debug)]
pub struct Ctx {
    /// Roots and metadata.
    pub meta: Arc<Meta>,
    /// The NVMe store.
    pub store: Arc<Store>,
    /// The fill engine.
    pub filler: Arc<Filler>,
    /// Registered jobs and their planner.
    pub jobs: Arc<crate::jobs::Jobs>,
    /// The peers, when this node shares with others.
    pub peers: Option<Arc<crate::peer::Peers>>,
    /// Counters.
    pub stats: Arc<Stats>,
    /// Blocks to read ahead.
    pub readahead: u32,
    /// Longest wait granted to a client.
    pub max_wait: Duration,
    /// When the daemon started.
    pub started: Instant,
    /// The configured cache directory (for status).
    pub cache_dir: PathBuf,
    /// How long a connection thread polls for the next request before sleeping.
    pub spin: Duration,
    /// Connection threads polling right now; at most [`MAX_SPINNERS`] do, so that busy
    /// clients never cost the node more than that many cores of polling.
    pub spinners: AtomicUsize,
    /// The bound address of the metrics endpoint (for status), when it is on.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    path: PathBuf,
    listener: Arc<UnixListener>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<u64, UnixStream>>>,
    active: Arc<AtomicUsize>,
    accept: Option<JoinHandle<()>>,
    /// False once the accept thread has ended.
    accepting: Arc<AtomicBool>,
}

/// Binds the socket at `path` with `mode`, replacing a stale socket but refusing to take
/// over one that a live daemon still answers on, or to replace anything not a socket.
pub fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        // Only ever replace a socket: a typo in --socket must not delete a file.
        if !std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{}: exists and is not a socket; refusing to replace it",
                    path.display()
                ),
            ));
        }
        match UnixStream::connect(path) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!(
                        "{}: another shardcached is listening on this socket",
                        path.display()
                    ),
                ));
            }
            Err(_) => std::fs::remove_file(path)?,
        }
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(l)
}

impl Server {
    /// Serves `listener` until [`Server::close`].
    pub fn start(
        listener: UnixListener,
        path: PathBuf,
        ctx: Arc<Ctx>,
        max_conns: usize,
    ) -> io::Result<Self> {
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<HashMap<u64, UnixStream>>> = Arc::default();
        let active = Arc::new(AtomicUsize::new(0));
        let accepting = Arc::new(AtomicBool::new(true));
        let accept = {
            let (listener, stop, conns, active) = (
                listener.clone(),
                stop.clone(),
                conns.clone(),
                active.clone(),
            );
            let alive = crate::daemon::Alive::new(accepting.clone());
            std::thread::Builder::new().name("sc-accept".into()).spawn(move || {
                let _alive = alive;
                let next_id = AtomicU64::new(0);
                // A storm of failed accepts or refused clients is one warning per
                // period, with how many it stands for, not one line per connection.
                let (mut accept_errors, mut refused) = (Throttle::default(), Throttle::default());
                for conn in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let conn = match conn {
                        Ok(c) => c,
                        Err(e) => {
                            if let Some(n) = accept_errors.hit() {
                                tracing::warn!(error = %e, count = n, "accept failed");
                            }
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    };
                    if active.load(Ordering::Acquire) >= max_conns {
                        if let Some(n) = refused.hit() {
                            tracing::warn!(max_conns, refused = n, "connection limit reached; refusing clients (they read the backing store)");
                        }
                        continue;
                    }
                    let creds = match creds::peer(&conn) {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot read client credentials; refusing");
                            continue;
                        }
                    };
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    if let Ok(c) = conn.try_clone() {
                        conns.lock().unwrap_or_else(|e| e.into_inner()).insert(id, c);
                    }
                    active.fetch_add(1, Ordering::AcqRel);
                    let (ctx, conns2, active2) = (ctx.clone(), conns.clone(), active.clone());
                    let spawned = std::thread::Builder::new()
                        .name("sc-conn".into())
                        .stack_size(512 << 10)
                        .spawn(move || {
                            serve(&conn, &creds, &ctx);
                            conns2.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                            active2.fetch_sub(1, Ordering::AcqRel);
                        });
                    if let Err(e) = spawned {
                        tracing::warn!(error = %e, "cannot start a connection thread");
                        conns.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                        active.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })?
        };
        Ok(Self {
            path,
            listener,
            stop,
            conns,
            active,
            accept: Some(accept),
            accepting,
        })
    }

    /// A flag that is true while the accept thread runs (for the liveness probe).
    pub fn accepting(&self) -> Arc<AtomicBool> {
        self.accepting.clone()
    }

    /// Stops accepting, disconnects every client and waits (bounded) for their threads.
    /// Clients then read the backing store. Call before closing the filler.
    pub fn close(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = rustix::net::shutdown(self.listener.as_fd(), rustix::net::Shutdown::Both);
        // Wake the accept loop in case shutdown did not.
        let _ = UnixStream::connect(&self.path);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }

    /// Waits up to `limit` for connection threads to end; returns how many remain.
    pub fn drain(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        while self.active.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.active.load(Ordering::Acquire)
    }
}

/// Counts events and says when to log them: at most once per [`Throttle::PERIOD`],
/// with the number of events since the last line.
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    count: u64,
}

impl Throttle {
    const PERIOD: Duration = Duration::from_secs(10);

    /// Counts one event; `Some(events since the last line)` when a line is due.
    fn hit(&mut self) -> Option<u64> {
        self.count += 1;
        if self.last.is_some_and(|t| t.elapsed() < Self::PERIOD) {
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.count))
    }
}

/// Most connection threads polling at once.
pub const MAX_SPINNERS: usize = 2;

/// Waits for the next request, polling first if fewer than [`MAX_SPINNERS`] threads are.
fn recv_request(
    reader: &mut FrameReader,
    conn: &UnixStream,
    ctx: &Ctx,
) -> Result<(pb::Request, Vec<std::os::fd::OwnedFd>), WireError> {
    if ctx.spin.is_zero() {
        return reader.recv(conn);
    }
    if ctx.spinners.fetch_add(1, Ordering::AcqRel) >= MAX_SPINNERS {
        ctx.spinners.fetch_sub(1, Ordering::AcqRel);
        return reader.recv(conn);
    }
    let r = reader.recv_spin(conn, ctx.spin);
    ctx.spinners.fetch_sub(1, Ordering::AcqRel);
    r
}

fn serve(conn: &UnixStream, creds: &Creds, ctx: &Ctx) {
    let mut reader = FrameReader::with_limit(MAX_REQUEST);
    loop {
        let req: pb::Request = match recv_request(&mut reader, conn, ctx) {
            Ok((req, _fds)) => req,
            Err(WireError::Closed) => return,
            Err(e) => {
                tracing::debug!(pid = creds.pid, error = %e, "client connection ended");
                return;
            }
        };
        let (resp, fd) = handle_request(ctx, creds, req);
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        if let Err(e) = wire::send(conn, &resp, &fds) {
            tracing::debug!(pid = creds.pid, error = %e, "reply failed");
            return;
        }
    }
}

/// An error reply with its code.
fn error_reply(message: String, code: pb::ErrorCode) -> response::Kind {
    response::Kind::Error(pb::ErrorReply {
        message,
        code: code as i32,
    })
}

/// Serves one request from a client with credentials `creds`: the reply, and the
/// descriptors to pass with it. What a connection thread does with every request.
pub fn handle_request(ctx: &Ctx, creds: &Creds, req: pb::Request) -> (pb::Response, Vec<File>) {
    if let Some(r) = &req.report {
        ctx.stats.add_report(r);
        ctx.jobs.add_usage(&r.jobs);
    }
    let (kind, fds) = handle(ctx, creds, req.kind);
    (
        pb::Response {
            id: req.id,
            kind: Some(kind),
        },
        fds,
    )
}

fn handle(ctx: &Ctx, creds: &Creds, kind: Option<request::Kind>) -> (response::Kind, Vec<File>) {
    match kind {
        Some(request::Kind::Open(o)) => {
            let (r, fd) = open(ctx, creds, &o.path);
            (
                response::Kind::Open(pb::OpenReply { result: Some(r) }),
                fd.into_iter().collect(),
            )
        }
        Some(request::Kind::OpenMany(m)) => {
            if m.paths.len() > wire::MAX_FDS {
                let message = format!("open_many: at most {} paths per request", wire::MAX_FDS);
                return (
                    response::Kind::Error(pb::ErrorReply {
                        message,
                        code: pb::ErrorCode::Invalid as i32,
                    }),
                    Vec::new(),
                );
            }
            let mut results = Vec::with_capacity(m.paths.len());
            let mut fds = Vec::new();
            for p in &m.paths {
                let (r, fd) = open(ctx, creds, p);
                results.push(pb::OpenReply { result: Some(r) });
                fds.extend(fd);
            }
            (response::Kind::OpenMany(pb::OpenManyReply { results }), fds)
        }
        Some(request::Kind::Wait(w)) => {
            let (r, fd) = wait(ctx, creds, &w);
            (
                response::Kind::Wait(pb::WaitReply { result: Some(r) }),
                fd.into_iter().collect(),
            )
        }
        Some(request::Kind::Status(_)) => (response::Kind::Status(status(ctx)), Vec::new()),
        Some(request::Kind::Register(r)) => {
            let operator = admin::is_operator(creds);
            match ctx.jobs.register(&r.manifest_json, creds.uid, operator) {
                Ok((job, files)) => (
                    response::Kind::Register(pb::RegisterReply {
                        job,
                        files: files as u64,
                    }),
                    Vec::new(),
                ),
                Err(message) => (error_reply(message, pb::ErrorCode::Invalid), Vec::new()),
            }
        }
        Some(request::Kind::Unregister(u)) => {
            let kind = match ctx
                .jobs
                .may_change(&u.job, creds.uid, admin::is_operator(creds))
            {
                Ok(()) => response::Kind::Unregister(pb::UnregisterReply {
                    found: ctx.jobs.unregister(&u.job),
                }),
                Err(e) => error_reply(format!("unregister: {e}"), pb::ErrorCode::PermissionDenied),
            };
            (kind, Vec::new())
        }
        Some(request::Kind::Progress(p)) => {
            let allowed = ctx
                .jobs
                .may_change(&p.job, creds.uid, admin::is_operator(creds));
            let kind = match allowed.map(|()| ctx.jobs.progress(&p.job, p.epoch, p.step)) {
                Ok(Ok(found)) => response::Kind::Progress(pb::ProgressReply { found }),
                Ok(Err(e)) => error_reply(format!("progress: {e}"), pb::ErrorCode::Invalid),
                Err(e) => error_reply(format!("progress: {e}"), pb::ErrorCode::PermissionDenied),
            };
            (kind, Vec::new())
        }
        Some(request::Kind::Verify(_)) if !admin::is_operator(creds) => (
            error_reply(
                format!(
                    "verify: only root or the daemon's user (uid {}) may re-check the whole cache, not uid {}; run it as one of them (e.g. sudo)",
                    rustix::process::geteuid().as_raw(),
                    creds.uid
                ),
                pb::ErrorCode::PermissionDenied,
            ),
            Vec::new(),
        ),
        Some(request::Kind::Verify(_)) => {
            let r = ctx.store.verify_all();
            let reply = pb::VerifyReply {
                blocks_checked: r.checked,
                corrupt_blocks: r.corrupt,
                missing_files: r.missing_files,
                files_checked: r.files,
                bytes_checked: r.bytes,
            };
            (response::Kind::Verify(reply), Vec::new())
        }
        Some(request::Kind::List(l)) => (admin::list(ctx, creds, &l), Vec::new()),
        Some(request::Kind::Evict(e)) => (admin::evict(ctx, creds, &e), Vec::new()),
        None => {
            let message = "empty request".to_owned();
            (
                response::Kind::Error(pb::ErrorReply {
                    message,
                    code: pb::ErrorCode::Invalid as i32,
                }),
                Vec::new(),
            )
        }
    }
}

fn refused(reason: Reason, message: impl Into<String>) -> pb::Refused {
    pb::Refused {
        reason: reason as i32,
        message: message.into(),
    }
}

/// The single mapping from lookup errors to refusals (and their counters).
fn refuse_resolve(stats: &Stats, e: ResolveError) -> pb::Refused {
    let msg = e.to_string();
    let reason = match e {
        ResolveError::NotUnderRoot(_) => Reason::NotUnderRoot,
        ResolveError::Backing(b) => match b {
            BackingError::NotFound(_) => Reason::NotFound,
            BackingError::Escapes(_) => Reason::EscapesRoot,
            BackingError::NotAFile(_) => Reason::NotAFile,
            BackingError::Invalid { .. } => Reason::Invalid,
            BackingError::Changed(_) => Reason::Stale,
            BackingError::Io { .. } => Reason::BackingError,
            // The client reads the store itself at once (its own read may then hang in
            // the kernel, as it would without the cache).
            BackingError::Stalled(_) => Reason::Busy,
        },
    };
    match reason {
        Reason::NotUnderRoot | Reason::EscapesRoot | Reason::Invalid => inc(&stats.refused_path),
        Reason::NotFound | Reason::NotAFile => inc(&stats.refused_not_found),
        _ => inc(&stats.refused_other),
    }
    refused(reason, msg)
}

fn refuse_store(stats: &Stats, e: StoreError) -> pb::Refused {
    inc(&stats.refused_other);
    let reason = match &e {
        StoreError::NoSpace => Reason::NoSpace,
        StoreError::Gone | StoreError::Io(_) => Reason::StoreError,
    };
    refused(reason, e.to_string())
}

/// Resolves, stats and access-checks `path` for `creds`.
fn authorize(
    ctx: &Ctx,
    creds: &Creds,
    path: &str,
) -> Result<(usize, String, Arc<Stat>), pb::Refused> {
    if path.len() > MAX_PATH {
        inc(&ctx.stats.refused_path);
        return Err(refused(
            Reason::Invalid,
            format!("path longer than {MAX_PATH} bytes"),
        ));
    }
    let (root, rel) = ctx
        .meta
        .roots()
        .resolve(path)
        .map_err(|e| refuse_resolve(&ctx.stats, e))?;
    let stat = ctx
        .meta
        .stat(root, rel)
        .map_err(|e| refuse_resolve(&ctx.stats, e.into()))?;
    match access::check(&stat, creds) {
        Decision::Allow => Ok((root, rel.to_owned(), stat)),
        Decision::Deny => {
            inc(&ctx.stats.refused_denied);
            tracing::debug!(uid = creds.uid, path, "access denied through the cache");
            Err(refused(
                Reason::PermissionDenied,
                format!("{path}: permission denied"),
            ))
        }
        Decision::Uncertain => {
            inc(&ctx.stats.refused_other);
            Err(refused(
                Reason::UncertainAccess,
                format!("{path}: has an ACL; read it from the backing store"),
            ))
        }
    }
}

fn target(root: usize, rel: String, stat: Arc<Stat>, view: &View) -> Arc<Target> {
    Arc::new(Target {
        peer_ok: true,
        root,
        rel,
        stat,
        key: view.key,
    })
}

fn pb_version(v: &crate::backing::Version) -> pb::Version {
    pb::Version {
        size: v.size,
        mtime_ns: v.mtime_ns,
        ctime_ns: v.ctime_ns,
        ino: v.ino,
        dev: v.dev,
    }
}

fn is_set(bm: &[u8], i: usize) -> bool {
    bm.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
}

/// Queues read-ahead for the first `n` missing blocks at or after `from`.
fn readahead(ctx: &Ctx, t: &Arc<Target>, view: &View, from: usize, n: u32) {
    let mut queued = 0;
    for i in from..view.nblocks {
        if queued >= n {
            break;
        }
        if !is_set(&view.present, i) {
            if matches!(
                ctx.filler.request(t, i, Priority::Readahead),
                Scheduled::Shed
            ) {
                break;
            }
            queued += 1;
        }
    }
}

fn open(ctx: &Ctx, creds: &Creds, path: &str) -> (pb::open_reply::Result, Option<File>) {
    inc(&ctx.stats.opens);
    let (root, rel, stat) = match authorize(ctx, creds, path) {
        Ok(x) => x,
        Err(r) => return (pb::open_reply::Result::Refused(r), None),
    };
    tracing::trace!(path = %rel, "open");
    let root_name = &ctx.meta.roots().get(root).name;
    let view = ctx.store.view(root_name, &stat);
    // Only now (the descriptor is in hand, or the file pinned below) may the job's
    // position move past this file; before, the file would be the one needed farthest
    // in the future, and a prefetch could evict it under this very open.
    let hit = view.as_ref().is_ok_and(|v| v.npresent == v.nblocks);
    if let Ok(v) = &view
        && !hit
    {
        ctx.store.pin(&v.key, Instant::now() + PIN);
    }
    let job_tag = ctx.jobs.on_open(root, &rel, hit);
    let mut view = match view {
        Ok(v) => v,
        Err(e) => {
            return (
                pb::open_reply::Result::Refused(refuse_store(&ctx.stats, e)),
                None,
            );
        }
    };
    if hit {
        inc(&ctx.stats.opens_full);
    } else {
        if view.npresent > 0 {
            inc(&ctx.stats.opens_partial);
        } else {
            inc(&ctx.stats.opens_empty);
        }
        let t = target(root, rel, stat.clone(), &view);
        readahead(ctx, &t, &view, 0, ctx.readahead);
    }
    let opened = pb::Opened {
        version: Some(pb_version(&stat.version)),
        block_size: view.block_size,
        present: std::mem::take(&mut view.present),
        data_gen: view.data_gen,
        job_tag,
    };
    (pb::open_reply::Result::Opened(opened), view.data.take())
}

fn wait(ctx: &Ctx, creds: &Creds, w: &pb::WaitRequest) -> (pb::wait_reply::Result, Option<File>) {
    inc(&ctx.stats.waits);
    let refuse = |r| (pb::wait_reply::Result::Refused(r), None);
    let (root, rel, stat) = match authorize(ctx, creds, &w.path) {
        Ok(x) => x,
        Err(r) => return refuse(r),
    };
    if w.version.as_ref() != Some(&pb_version(&stat.version)) {
        inc(&ctx.stats.refused_other);
        return refuse(refused(
            Reason::Stale,
            format!("{}: changed on the backing store", w.path),
        ));
    }
    let root_name = ctx.meta.roots().get(root).name.clone();
    let view = match ctx.store.view(&root_name, &stat) {
        Ok(v) => v,
        Err(e) => return refuse(refuse_store(&ctx.stats, e)),
    };
    let t = target(root, rel, stat.clone(), &view);
    let timeout = match w.timeout_ms {
        0 => ctx.max_wait,
        ms => Duration::from_millis(ms as u64).min(ctx.max_wait),
    };
    // Keep what lands for this reader until it has the descriptor.
    ctx.store.pin(&view.key, Instant::now() + timeout + PIN);
    let first = w.first_block as usize;
    let end = (w
        .first_block
        .saturating_add(w.count.max(1) as u64)
        .min(MAX_WAIT_BLOCKS))
    .min(view.nblocks as u64) as usize;
    let mut flights = Vec::new();
    for i in first..end {
        if is_set(&view.present, i) {
            continue;
        }
        if let Scheduled::InFlight(f) = ctx.filler.request(&t, i, Priority::Demand) {
            flights.push(f);
        }
    }
    readahead(ctx, &t, &view, end, ctx.readahead);
    let deadline = Instant::now() + timeout;
    let (mut timed_out, mut declined) = (false, false);
    for f in &flights {
        match f.wait_until(deadline) {
            None => {
                timed_out = true;
                break;
            }
            Some(ok) => declined |= !ok,
        }
    }
    if timed_out {
        inc(&ctx.stats.wait_timeouts);
    }
    // Always a fresh view: blocks may have landed between the first view and the
    // requests (then there was nothing to wait on, but the old bitmap is stale).
    let mut view = match ctx.store.view(&root_name, &stat) {
        Ok(v) => v,
        Err(e) => return refuse(refuse_store(&ctx.stats, e)),
    };
    if declined
        && (first..end).any(|i| !is_set(&view.present, i))
        && let Some(peers) = &ctx.peers
        && let Some((file, present)) = transient(ctx, peers, &root_name, &stat, first, end)
    {
        let waited = pb::Waited {
            present,
            data_gen: TRANSIENT_GEN | NEXT_TRANSIENT.fetch_add(1, Ordering::Relaxed),
            declined: false,
        };
        return (pb::wait_reply::Result::Waited(waited), Some(file));
    }
    if view.npresent == view.nblocks {
        // The reader gets (or has) a descriptor holding every block: eviction from now
        // on unlinks a file it keeps reading.
        ctx.store.unpin(&view.key);
    }
    let fd = if view.data_gen != w.have_data_gen {
        view.data.take()
    } else {
        None
    };
    let waited = pb::Waited {
        present: std::mem::take(&mut view.present),
        data_gen: view.data_gen,
        declined,
    };
    (pb::wait_reply::Result::Waited(waited), fd)
}

/// Generations of transient copies (see [`transient`]): never those of a data file.
const TRANSIENT_GEN: u64 = 1 << 63;
static NEXT_TRANSIENT: AtomicU64 = AtomicU64::new(1);

/// Blocks `first..end` of a file this node declined to cache (no room worth making),
/// fetched from the node that owns it into an unlinked temporary file: the reader gets
/// them from the cluster instead of the shared file system, and nothing is kept. `None`
/// when this node owns the file, or a peer cannot supply every block (the reader then
/// reads the backing store).
fn transient(
    ctx: &Ctx,
    peers: &crate::peer::Peers,
    root: &str,
    stat: &Stat,
    first: usize,
    end: usize,
) -> Option<(File, Vec<u8>)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let bs = ctx.store.block_size() as u64;
    let size = stat.version.size;
    let nblocks = size.div_ceil(bs) as usize;
    let tmp = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(&ctx.cache_dir)
        .ok()?;
    tmp.set_len(size).ok()?;
    let mut present = vec![0u8; nblocks.div_ceil(8)];
    let mut data = Vec::new();
    for i in first..end {
        let len = (size - i as u64 * bs).min(bs) as usize;
        if !peers.fetch(root, stat, i, len, false, &mut data) {
            return None;
        }
        tmp.write_all_at(&data, i as u64 * bs).ok()?;
        present[i / 8] |= 1 << (i % 8);
    }
    // The reader gets a read-only descriptor of it.
    let ro = File::open(format!("/proc/self/fd/{}", tmp.as_raw_fd())).ok()?;
    Some((ro, present))
}

/// The daemon's status: what `shardcache status` shows and the metrics endpoint renders.
pub fn status(ctx: &Ctx) -> pb::StatusReply {
    let names: Vec<String> = ctx
        .meta
        .roots()
        .all()
        .iter()
        .map(|r| r.name.clone())
        .collect();
    let s = ctx.store.status();
    let jobs = ctx.jobs.status(
        &|root, path| ctx.store.is_cached(&names[root], path),
        s.capacity,
    );
    pb::StatusReply {
        daemon_version: env!("CARGO_PKG_VERSION").to_owned(),
        uptime_seconds: ctx.started.elapsed().as_secs(),
        backing_roots: ctx
            .meta
            .roots()
            .all()
            .iter()
            .map(|r| r.name.clone())
            .collect(),
        cache_dir: ctx.cache_dir.display().to_string(),
        capacity_bytes: s.capacity,
        used_bytes: s.used,
        fs_free_bytes: s.fs_free,
        fs_size_bytes: s.fs_size,
        min_free_bytes: s.min_free,
        files: s.files,
        blocks: s.blocks,
        block_size: ctx.store.block_size(),
        unverified_blocks: s.unverified,
        counters: Some(ctx.stats.snapshot()),
        fallbacks: ctx.stats.fallbacks(),
        backing_health: (0..names.len())
            .map(|i| {
                let h = ctx.meta.roots().watch(i).health();
                pb::BackingHealth {
                    root: names[i].clone(),
                    stalled: h.stalled,
                    calls_in_flight: h.in_flight,
                    calls_stuck: h.stuck,
                    oldest_call_seconds: h.oldest_seconds,
                    calls_refused: h.refused,
                }
            })
            .collect(),
        metrics_addr: ctx.metrics_addr.map(|a| a.to_string()).unwrap_or_default(),
        jobs,
        peer_id: ctx
            .peers
            .as_ref()
            .map(|p| p.membership().me().to_owned())
            .unwrap_or_default(),
        peers: ctx
            .peers
            .as_ref()
            .map(|p| {
                let healthy = p.membership().healthy();
                p.membership()
                    .all()
                    .into_iter()
                    .map(|(id, h)| pb::PeerStatus {
                        healthy: healthy.contains(&id),
                        failures: h.failures,
                        last_ok_seconds: h.last_ok.map_or(-1.0, |t| t.elapsed().as_secs_f64()),
                        id,
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_replaces_only_stale_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-socket");
        std::fs::write(&file, b"precious").unwrap();
        let e = bind(&file, 0o666).unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"precious", "left alone");

        let sock = dir.path().join("s.sock");
        let live = bind(&sock, 0o666).unwrap();
        assert!(
            bind(&sock, 0o666)
                .unwrap_err()
                .to_string()
                .contains("another shardcached")
        );
        drop(live); // the socket file stays behind, stale
        assert!(sock.exists());
        bind(&sock, 0o666).unwrap();
    }
}
