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
//! few (a pool per training process) and bounded by `max_connections`, shared out by uid
//! ([`admit`]): one user cannot hold them all, and an operator is always answered.

pub mod admin;
pub mod admit;
mod creds;

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{Reason, request, response};
use shardcache_proto::wire::{self, FrameReader, WireError};

pub use self::admit::Limits;
use self::admit::{Activity, Table, Verdict, Why};
use crate::access::{self, Creds};
use crate::backing::Version;
use crate::cache::{self, MAX_PATH, MAX_WAIT_BLOCKS, Opened, ReadPath, Refusal, WaitFor, Waited};
use crate::fill::Filler;
use crate::jobs::{JobError, LeaseRequest};
use crate::lifecycle::{Gauge, Task};
use crate::meta::Meta;
use crate::stats::{Stats, inc};
use crate::status::{
    self, Fallbacks, JobStatus, PeerStatus, PeersStatus, RootHealth, Space, Status,
};
use crate::store::Store;

/// Longest [`Server::close`] waits for the accept loop.
const ACCEPT_STOP: Duration = Duration::from_secs(5);
/// Longest a reply may wait for its client to read it.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// Counters.
    pub stats: Arc<Stats>,
    /// The read path: opens, waits and status.
    pub cache: Arc<ReadPath>,
    /// How long a connection thread polls for the next request before sleeping.
    pub spin: Duration,
    /// Connection threads polling right now; at most [`MAX_SPINNERS`] do, so that busy
    /// clients never cost the node more than that many cores of polling.
    pub spinners: AtomicUsize,
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    path: PathBuf,
    conns: Conns,
    /// Connection threads running (those of connections closed to make room included,
    /// until they end).
    active: Arc<Gauge>,
    /// The accept loop (stopped by shutting the listener down and connecting once).
    accept: Task,
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
    /// Serves `listener` until [`Server::close`], sharing its connections out as
    /// [`admit`] describes.
    pub fn start(
        listener: UnixListener,
        path: PathBuf,
        ctx: Arc<Ctx>,
        limits: Limits,
    ) -> io::Result<Self> {
        let listener = Arc::new(listener);
        let conns: Conns = Arc::new(Mutex::new(Table::new(limits)));
        let active = Arc::new(Gauge::default());
        let accepting = Arc::new(AtomicBool::new(false));
        let accept = {
            let (l, conns, active) = (listener.clone(), conns.clone(), active.clone());
            Task::spawn("sc-accept", accepting.clone(), move |stop| {
                let mut accept_errors = Throttle::default();
                for conn in l.incoming() {
                    if stop.is_stopped() {
                        break;
                    }
                    match conn {
                        Ok(c) => admit_one(c, &conns, &active, &ctx, limits),
                        Err(e) => {
                            if let Some(n) = accept_errors.hit() {
                                tracing::warn!(error = %e, count = n, "accept failed");
                            }
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                }
            })?
            // `accept` does not see the stop: the listener is shut down, and, in case
            // that does not wake it, connected to once.
            .with_wake({
                let (listener, path) = (listener.clone(), path.clone());
                move || {
                    let _ = rustix::net::shutdown(listener.as_fd(), rustix::net::Shutdown::Both);
                    let _ = UnixStream::connect(&path);
                }
            })
        };
        Ok(Self {
            path,
            conns,
            active,
            accept,
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
        self.accept.shutdown(ACCEPT_STOP);
        for c in self.conns.lock().handles() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }

    /// Waits up to `limit` for connection threads to end; returns how many remain.
    pub fn drain(&self, limit: Duration) -> usize {
        self.active.wait_zero(limit)
    }
}

/// The connections held, with a handle of each to close it.
type Conns = Arc<Mutex<Table<UnixStream>>>;

/// Log lines about refused and closed connections: one per period, with a count.
static REFUSED_LOG: Mutex<Throttle> = Mutex::new(Throttle::new());
static CLOSED_LOG: Mutex<Throttle> = Mutex::new(Throttle::new());

/// Admits, or refuses, a connection just accepted (on the accept thread).
fn admit_one(conn: UnixStream, conns: &Conns, active: &Arc<Gauge>, ctx: &Arc<Ctx>, limits: Limits) {
    let stats = &ctx.stats;
    let creds = match creds::peer(&conn) {
        Ok(c) => c,
        Err(e) => {
            inc(&stats.conns_refused_other);
            tracing::warn!(error = %e, "cannot read client credentials; refusing");
            return;
        }
    };
    let uid = creds.uid;
    let mut table = conns.lock();
    match table.decide(uid, access::is_operator(&creds)) {
        Verdict::Admit => {}
        Verdict::Evict { victim, why } => {
            if let Some(s) = table.remove(victim) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            let held = table.held_by(uid);
            inc(match why {
                Why::UidLimit => &stats.conns_closed_uid_limit,
                Why::Full => &stats.conns_closed_full,
            });
            if let Some(n) = CLOSED_LOG.lock().hit() {
                tracing::info!(
                    uid,
                    held,
                    ?why,
                    closed = n,
                    "closed idle client connections to admit others (limits: max_connections, max_connections_per_uid)"
                );
            }
        }
        Verdict::Refuse(why) => {
            let held = table.held_by(uid);
            drop(table);
            let message = match why {
                Why::UidLimit => {
                    inc(&stats.conns_refused_uid_limit);
                    format!(
                        "shardcached: uid {uid} holds {held} connections, the most one user may (max_connections_per_uid = {}), none of them idle; this one is refused and the client reads the backing store: use fewer connections, or raise max_connections_per_uid",
                        limits.per_uid
                    )
                }
                Why::Full => {
                    inc(&stats.conns_refused_full);
                    format!(
                        "shardcached: all {} connections are in use (max_connections), none idle; this one is refused and the client reads the backing store: raise max_connections",
                        limits.max
                    )
                }
            };
            if let Some(n) = REFUSED_LOG.lock().hit() {
                tracing::warn!(
                    uid,
                    held,
                    ?why,
                    refused = n,
                    "refusing client connections (they read the backing store)"
                );
            }
            refuse(&conn, message);
            return;
        }
    }
    // Threads of closed connections end at once; should they lag behind a uid that
    // connects faster, the threads are still bounded.
    let threads = 2 * (limits.max + limits.reserve);
    let handle = if active.get() >= threads {
        Err(io::Error::other(format!(
            "{threads} connection threads running"
        )))
    } else {
        conn.try_clone()
    };
    let handle = match handle {
        Ok(h) => h,
        Err(e) => {
            drop(table);
            inc(&stats.conns_refused_other);
            refuse(
                &conn,
                format!(
                    "shardcached: cannot serve another connection now ({e}); the client reads the backing store"
                ),
            );
            return;
        }
    };
    let (id, activity) = table.insert(uid, handle);
    stats
        .connections
        .store(table.len() as u64, Ordering::Relaxed);
    drop(table);
    let counted = active.enter();
    let (ctx2, conns2) = (ctx.clone(), conns.clone());
    let spawned = std::thread::Builder::new()
        .name("sc-conn".into())
        .stack_size(512 << 10)
        .spawn(move || {
            // A reply its client does not read ends the connection (an honest client
            // reads at once, or gives up and closes it), so that a thread never waits on
            // one for good.
            let _ = conn.set_write_timeout(Some(REPLY_TIMEOUT));
            serve(&conn, &creds, &ctx2, &activity);
            let mut t = conns2.lock();
            t.remove(id);
            ctx2.stats
                .connections
                .store(t.len() as u64, Ordering::Relaxed);
            drop(t);
            drop(counted);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start a connection thread");
        inc(&stats.conns_refused_other);
        let mut t = conns.lock();
        t.remove(id);
        stats.connections.store(t.len() as u64, Ordering::Relaxed);
        drop(t);
    }
}

/// Tells a refused client why (a reply with id 0, which answers no request; the client
/// reports it and reads the backing store), without waiting on it, and closes.
fn refuse(conn: &UnixStream, message: String) {
    let reply = pb::Response {
        id: 0,
        kind: Some(error_reply(message, pb::ErrorCode::Unspecified)),
    };
    if conn.set_nonblocking(true).is_ok() {
        let _ = wire::send(conn, &reply, &[]);
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

    const fn new() -> Self {
        Self {
            last: None,
            count: 0,
        }
    }

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

fn serve(conn: &UnixStream, creds: &Creds, ctx: &Ctx, activity: &Activity) {
    let mut reader = FrameReader::with_limit(wire::MAX_REQUEST);
    loop {
        let (mut req, fds): (pb::Request, _) = match recv_request(&mut reader, conn, ctx) {
            Ok(x) => x,
            Err(WireError::Closed) => return,
            Err(WireError::TooLarge { len, limit }) => {
                // Say which limit, then skip the frame: the client learns why instead of
                // finding the connection closed, and the connection goes on.
                let message = format!(
                    "request of {len} bytes is over the local protocol's {} request limit: send less per request (the client library passes large manifests by descriptor; at most {} paths per open_many, {MAX_WAIT_BLOCKS} blocks per wait)",
                    wire::size_text(limit),
                    wire::MAX_FDS
                );
                let resp = pb::Response {
                    id: 0,
                    kind: Some(error_reply(message, pb::ErrorCode::Invalid)),
                };
                if wire::send(conn, &resp, &[]).is_err() || reader.skip(conn, len).is_err() {
                    return;
                }
                continue;
            }
            Err(e) => {
                tracing::debug!(pid = creds.pid, error = %e, "client connection ended");
                return;
            }
        };
        // Busy until the reply is sent: the admission never closes this connection now.
        let _busy = activity.busy();
        // A manifest passed by descriptor is read (one at a time: each may be 64 MiB)
        // and then registered like an inline one.
        let _big = match &mut req.kind {
            Some(request::Kind::Register(r)) if r.manifest_fd => {
                let one_at_a_time = BIG_MANIFEST.lock();
                match manifest_from_fd(fds.into_iter().next()) {
                    Ok(json) => r.manifest_json = json,
                    Err(message) => {
                        let resp = pb::Response {
                            id: req.id,
                            kind: Some(error_reply(message, pb::ErrorCode::Invalid)),
                        };
                        if wire::send(conn, &resp, &[]).is_err() {
                            return;
                        }
                        continue;
                    }
                }
                Some(one_at_a_time)
            }
            _ => None,
        };
        let id = req.id;
        let (resp, fd) = handle_request(ctx, creds, req);
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        match wire::send(conn, &resp, &fds) {
            Ok(()) => {}
            Err(WireError::TooLarge { len, limit }) => {
                // Nothing was sent: answer with why (a listing pages itself to fit, so
                // this is a reply nobody planned for, e.g. a status with very many jobs).
                let message = format!(
                    "the reply of {len} bytes is over the local protocol's {} reply limit; ask for less (a smaller list page)",
                    wire::size_text(limit)
                );
                tracing::warn!(pid = creds.pid, len, "reply over the frame limit");
                let resp = pb::Response {
                    id,
                    kind: Some(error_reply(message, pb::ErrorCode::Invalid)),
                };
                if wire::send(conn, &resp, &[]).is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(pid = creds.pid, error = %e, "reply failed");
                return;
            }
        }
    }
}

/// Held while a manifest passed by descriptor is read and registered: one at a time,
/// so that clients cannot make the daemon hold many 64 MiB manifests at once.
static BIG_MANIFEST: Mutex<()> = Mutex::new(());

/// The manifest in the descriptor of a `RegisterRequest` with `manifest_fd`: a memfd or
/// another shared-memory file (so that reading it cannot hang on a file system or a
/// pipe), at most [`shardcache_plan::manifest::MAX_BYTES`], UTF-8.
fn manifest_from_fd(fd: Option<std::os::fd::OwnedFd>) -> Result<String, String> {
    use std::os::unix::fs::FileExt;
    const MAX: usize = shardcache_plan::manifest::MAX_BYTES;
    let too_big = |n: u64| {
        format!(
            "manifest: {n} bytes is over the {} limit (docs/MANIFEST.md): split the dataset into several jobs, or select its files with a glob",
            wire::size_text(MAX)
        )
    };
    let fd = fd.ok_or("register: manifest_fd is set but no descriptor came with the request")?;
    if rustix::fs::fcntl_get_seals(&fd).is_err() {
        return Err(
            "register: the manifest descriptor must be a memfd (memfd_create), not a file, pipe or socket"
                .into(),
        );
    }
    let size = rustix::fs::fstat(&fd)
        .map_err(|e| format!("register: manifest descriptor: {e}"))?
        .st_size as u64;
    if size > MAX as u64 {
        return Err(too_big(size));
    }
    // Read from offset 0 (positioned: the client's file offset is its own), never more
    // than the limit, whatever the size said (an unsealed file may grow meanwhile).
    let f = File::from(fd);
    let mut buf = vec![0u8; size as usize + 1];
    let mut n = 0;
    loop {
        if n == buf.len() {
            if n > MAX {
                return Err(too_big(n as u64));
            }
            buf.resize((n * 2).clamp(4096, MAX + 1), 0);
        }
        match f.read_at(&mut buf[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("register: reading the manifest descriptor: {e}")),
        }
    }
    buf.truncate(n);
    String::from_utf8(buf).map_err(|e| {
        format!(
            "manifest: not UTF-8 (at byte {})",
            e.utf8_error().valid_up_to()
        )
    })
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
            for o in ctx.cache.open_many(creds, &m.paths) {
                let (r, fd) = opened(o);
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
        Some(request::Kind::Status(_)) => (
            response::Kind::Status(pb_status(ctx.cache.status())),
            Vec::new(),
        ),
        Some(request::Kind::Register(r)) => {
            let operator = access::is_operator(creds);
            let lease = (r.lease_s > 0).then(|| LeaseRequest {
                period: Duration::from_secs(r.lease_s.into()),
                holder: &r.holder,
            });
            let kind = match ctx
                .jobs
                .register_leased(&r.manifest_json, creds, operator, lease)
            {
                Ok(r) => response::Kind::Register(pb::RegisterReply {
                    job: r.job,
                    files: r.files as u64,
                    dirs_denied: r.dirs_denied as u64,
                    immutable_held: r.immutable_held as u64,
                    immutable_over_limit: r.immutable_over_limit as u64,
                    immutable_owner_only: r.immutable_owner_only,
                }),
                Err(e) => job_error("", e),
            };
            (kind, Vec::new())
        }
        Some(request::Kind::Unregister(u)) => {
            let kind = match ctx
                .jobs
                .may_change(&u.job, creds.uid, access::is_operator(creds))
            {
                Ok(()) => response::Kind::Unregister(pb::UnregisterReply {
                    found: ctx.jobs.unregister_holder(&u.job, creds.pid, &u.holder),
                }),
                Err(e) => job_error("unregister: ", e),
            };
            (kind, Vec::new())
        }
        Some(request::Kind::Progress(p)) => {
            let kind = match ctx
                .jobs
                .may_change(&p.job, creds.uid, access::is_operator(creds))
                .and_then(|()| ctx.jobs.progress(&p.job, p.epoch, p.step))
            {
                Ok(found) => response::Kind::Progress(pb::ProgressReply { found }),
                Err(e) => job_error("progress: ", e),
            };
            (kind, Vec::new())
        }
        Some(request::Kind::Verify(_)) if !access::is_operator(creds) => (
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

/// The one mapping from job errors to error replies.
fn job_error(what: &str, e: JobError) -> response::Kind {
    let code = match &e {
        JobError::NotYours { .. } => pb::ErrorCode::PermissionDenied,
        JobError::Manifest(_)
        | JobError::RootNotServed(_)
        | JobError::Glob(_)
        | JobError::NothingMatched { .. }
        | JobError::UnknownFile { .. }
        | JobError::Plan(_)
        | JobError::Position(_) => pb::ErrorCode::Invalid,
    };
    error_reply(format!("{what}{e}"), code)
}

/// The one mapping from the read path's reasons to the wire's.
fn pb_reason(r: cache::Reason) -> Reason {
    match r {
        cache::Reason::NotUnderRoot => Reason::NotUnderRoot,
        cache::Reason::EscapesRoot => Reason::EscapesRoot,
        cache::Reason::PermissionDenied => Reason::PermissionDenied,
        cache::Reason::NotFound => Reason::NotFound,
        cache::Reason::NotAFile => Reason::NotAFile,
        cache::Reason::Stale => Reason::Stale,
        cache::Reason::Busy => Reason::Busy,
        cache::Reason::NoSpace => Reason::NoSpace,
        cache::Reason::BackingError => Reason::BackingError,
        cache::Reason::Invalid => Reason::Invalid,
        cache::Reason::UncertainAccess => Reason::UncertainAccess,
        cache::Reason::StoreError => Reason::StoreError,
    }
}

fn pb_refused(r: Refusal) -> pb::Refused {
    let Refusal { reason, message } = r;
    pb::Refused {
        reason: pb_reason(reason) as i32,
        message,
    }
}

fn pb_version(v: &Version) -> pb::Version {
    let Version {
        size,
        mtime_ns,
        ctime_ns,
        ino,
        dev,
    } = *v;
    pb::Version {
        size,
        mtime_ns,
        ctime_ns,
        ino,
        dev,
    }
}

fn version(v: &pb::Version) -> Version {
    let pb::Version {
        size,
        mtime_ns,
        ctime_ns,
        ino,
        dev,
    } = *v;
    Version {
        size,
        mtime_ns,
        ctime_ns,
        ino,
        dev,
    }
}

/// An open, adapted: the read path's outcome as the wire's reply and descriptor.
fn open(ctx: &Ctx, creds: &Creds, path: &str) -> (pb::open_reply::Result, Option<File>) {
    opened(ctx.cache.open(creds, path))
}

/// An open's outcome as the wire's reply and descriptor.
fn opened(o: Result<Opened, Refusal>) -> (pb::open_reply::Result, Option<File>) {
    match o {
        Ok(Opened {
            version,
            block_size,
            present,
            data_gen,
            job_tag,
            data,
            read_backing,
        }) => (
            pb::open_reply::Result::Opened(pb::Opened {
                version: Some(pb_version(&version)),
                block_size,
                present,
                data_gen,
                job_tag,
                read_backing,
            }),
            data,
        ),
        Err(r) => (pb::open_reply::Result::Refused(pb_refused(r)), None),
    }
}

/// A wait, adapted (see [`ReadPath::wait`]).
fn wait(ctx: &Ctx, creds: &Creds, w: &pb::WaitRequest) -> (pb::wait_reply::Result, Option<File>) {
    let pb::WaitRequest {
        path,
        version: v,
        first_block,
        count,
        have_data_gen,
        timeout_ms,
        resumed,
        more,
    } = w;
    let w = WaitFor {
        path: path.clone(),
        version: v.as_ref().map(version),
        first_block: *first_block,
        count: *count,
        have_data_gen: *have_data_gen,
        timeout: match *timeout_ms {
            0 => None,
            ms => Some(Duration::from_millis(u64::from(ms))),
        },
        more: *more,
        resumed: *resumed,
    };
    match ctx.cache.wait(creds, &w) {
        Ok(Waited {
            present,
            data_gen,
            declined,
            filling,
            data,
        }) => (
            pb::wait_reply::Result::Waited(pb::Waited {
                present,
                data_gen,
                declined,
                filling,
            }),
            data,
        ),
        Err(r) => (pb::wait_reply::Result::Refused(pb_refused(r)), None),
    }
}

/// The status reply: [`Status`] field by field (destructured whole, so that a field added
/// to it fails the build until it is mapped here).
fn pb_status(s: Status) -> pb::StatusReply {
    let Status {
        daemon_version,
        uptime,
        cache_dir,
        space:
            Space {
                capacity_bytes,
                used_bytes,
                fs_free_bytes,
                fs_size_bytes,
                min_free_bytes,
                files,
                blocks,
                unverified_blocks,
            },
        block_size,
        io_engine,
        counters,
        fallbacks,
        roots,
        metrics_addr,
        connections,
        jobs,
        prefetching,
        peers,
    } = s;
    let (peer_id, peers) = match peers {
        Some(PeersStatus { me, members }) => (me, members.into_iter().map(pb_peer).collect()),
        None => (String::new(), Vec::new()),
    };
    pb::StatusReply {
        daemon_version,
        uptime_seconds: uptime.as_secs(),
        backing_roots: roots.iter().map(|r| r.root.clone()).collect(),
        cache_dir: cache_dir.display().to_string(),
        capacity_bytes,
        used_bytes,
        fs_free_bytes,
        fs_size_bytes,
        min_free_bytes,
        files,
        blocks,
        block_size,
        io_engine,
        unverified_blocks,
        counters: Some(counters),
        fallbacks: fallbacks
            .into_iter()
            .map(
                |Fallbacks {
                     reason,
                     opens,
                     reads,
                 }| pb::FallbackCount {
                    reason: reason as i32,
                    opens,
                    reads,
                },
            )
            .collect(),
        backing_health: roots.into_iter().map(pb_root).collect(),
        metrics_addr: metrics_addr.map(|a| a.to_string()).unwrap_or_default(),
        connections,
        // The reply carries the node's prefetches in every job's status.
        jobs: jobs.into_iter().map(|j| pb_job(j, prefetching)).collect(),
        peer_id,
        peers,
    }
}

fn pb_root(r: RootHealth) -> pb::BackingHealth {
    let RootHealth {
        root,
        stalled,
        calls_in_flight,
        calls_stuck,
        oldest_call_seconds,
        calls_refused,
    } = r;
    pb::BackingHealth {
        root,
        stalled,
        calls_in_flight,
        calls_stuck,
        oldest_call_seconds,
        calls_refused,
    }
}

fn pb_peer(p: PeerStatus) -> pb::PeerStatus {
    let PeerStatus {
        id,
        healthy,
        failures,
        last_ok,
    } = p;
    pb::PeerStatus {
        id,
        healthy,
        failures,
        last_ok_seconds: last_ok.map_or(-1.0, |d| d.as_secs_f64()),
    }
}

fn pb_job(j: JobStatus, prefetching: u64) -> pb::JobStatus {
    let JobStatus {
        job,
        epoch,
        step,
        epoch_len,
        files,
        window,
        window_resident,
        window_bytes,
        window_resident_bytes,
        backing_bytes,
        hit_bytes,
        filled_bytes,
        fallback_bytes,
        opens,
        opens_hit,
        wait,
        fallback,
        rate,
        placement_nodes,
        placement_slots,
        placement_room_bytes,
        placement_here,
        placement_departing,
        files_denied,
        dirs_denied,
        immutable_not_owned,
        immutable_over_limit,
        lease_seconds,
        lease_remaining,
        lease_holders,
        lease_holders_alive,
    } = j;
    pb::JobStatus {
        job,
        epoch,
        step,
        epoch_len,
        files,
        window,
        window_resident,
        window_bytes,
        window_resident_bytes,
        backing_bytes,
        hit_bytes,
        filled_bytes,
        fallback_bytes,
        opens,
        opens_hit,
        wait_seconds: status::seconds(wait),
        fallback_seconds: status::seconds(fallback),
        rate: rate.unwrap_or(0.0),
        prefetching,
        placement_nodes,
        placement_slots,
        placement_room_bytes,
        placement_here,
        placement_departing,
        files_denied,
        dirs_denied,
        immutable_not_owned,
        immutable_over_limit,
        lease_seconds,
        lease_remaining_seconds: status::seconds(lease_remaining),
        lease_holders,
        lease_holders_alive,
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

    #[test]
    fn a_status_maps_to_its_reply_field_by_field() {
        let s = Status {
            uptime: Duration::from_millis(42_900),
            fallbacks: vec![Fallbacks {
                reason: pb::FallbackReason::Declined,
                opens: 1,
                reads: 2,
            }],
            roots: vec![RootHealth {
                root: "/r".into(),
                calls_stuck: 2,
                ..Default::default()
            }],
            metrics_addr: Some("127.0.0.1:9".parse().unwrap()),
            jobs: vec![JobStatus {
                job: "j".into(),
                wait: Duration::from_nanos(1_500_000_000),
                rate: None,
                ..Default::default()
            }],
            prefetching: 3,
            peers: Some(PeersStatus {
                me: "a:1".into(),
                members: vec![PeerStatus {
                    id: "a:1".into(),
                    healthy: true,
                    failures: 0,
                    last_ok: None,
                }],
            }),
            ..Default::default()
        };
        let r = pb_status(s);
        assert_eq!(r.uptime_seconds, 42, "whole seconds");
        assert_eq!(r.backing_roots, ["/r"]);
        assert_eq!(r.backing_health[0].root, "/r");
        assert_eq!(r.backing_health[0].calls_stuck, 2);
        assert_eq!(r.metrics_addr, "127.0.0.1:9");
        assert_eq!(r.fallbacks[0].reason, pb::FallbackReason::Declined as i32);
        assert_eq!((r.fallbacks[0].opens, r.fallbacks[0].reads), (1, 2));
        assert_eq!(r.jobs[0].wait_seconds, 1.5);
        assert_eq!(r.jobs[0].rate, 0.0, "not measured yet");
        assert_eq!(r.jobs[0].prefetching, 3, "the node's, in every job");
        assert_eq!(r.peer_id, "a:1");
        assert_eq!(r.peers[0].last_ok_seconds, -1.0, "no exchange yet");
        assert!(r.counters.is_some());

        let off = pb_status(Status::default());
        assert_eq!(
            (off.peer_id.as_str(), off.peers.len()),
            ("", 0),
            "peers off"
        );
        assert_eq!(off.metrics_addr, "", "metrics off");
    }
}
