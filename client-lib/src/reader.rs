//! A file opened through the cache: reads present blocks from the local copy, asks the
//! daemon for missing ones, and reads the backing file whenever that fails.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{
    FallbackReason, Reason, open_reply, request, response, wait_reply,
};

use shardcache_proto::wire;

use crate::client::Client;
use crate::link::{CallError, Pending};

/// Most blocks one wait asks for.
const MAX_WAIT_BLOCKS: u64 = 64;

/// Where a reader's bytes come from at the moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The local cache (with the backing store for blocks the cache could not supply).
    Cache,
    /// The backing store only.
    Backing,
}

/// Bytes and reads of one reader, by where they came from.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReaderStats {
    /// Read from blocks that were local when asked for.
    pub hit_bytes: u64,
    /// Read locally after waiting for the daemon to fetch them.
    pub filled_bytes: u64,
    /// Read from the backing store by this process.
    pub fallback_bytes: u64,
    /// Read calls served by each source.
    pub hit_reads: u64,
    /// See `hit_reads`.
    pub filled_reads: u64,
    /// See `hit_reads`.
    pub fallback_reads: u64,
    /// Time blocked waiting for the daemon to fetch blocks.
    pub wait_time: std::time::Duration,
    /// Time spent reading the backing store.
    pub fallback_time: std::time::Duration,
}

struct Cached {
    data: Option<Arc<File>>,
    data_gen: u64,
    version: pb::Version,
    block_size: u64,
    nblocks: u64,
    present: Vec<u8>,
    backing: Option<Arc<File>>,
    /// Bytes were already served from the cache: the backing file may no longer be
    /// swapped for a newer version under this reader.
    served: bool,
    /// The daemon refused to fill this file (no room for it, it changed, ...): missing
    /// blocks are read from the backing store without asking again.
    refused: bool,
}

impl Cached {
    fn has(&self, b: u64) -> bool {
        self.present
            .get((b / 8) as usize)
            .is_some_and(|x| x & (1 << (b % 8)) != 0)
    }

    fn all_present(&self) -> bool {
        (0..self.nblocks).all(|b| self.has(b))
    }
}

enum State {
    Cached(Cached),
    Direct(Arc<File>),
}

/// A file opened through [`Client::open`]. `Read + Seek`, and [`Reader::read_at`] for
/// positioned reads from several threads.
pub struct Reader {
    client: Client,
    path: PathBuf,
    pos: u64,
    size: Mutex<u64>,
    state: Mutex<State>,
    stats: Mutex<ReaderStats>,
    fallback_reason: Mutex<Option<(FallbackReason, String)>>,
    /// The registered job whose plan this read follows (0: none): the reader's totals
    /// are reported under it when it is dropped.
    job_tag: u64,
}

impl Drop for Reader {
    fn drop(&mut self) {
        if self.job_tag != 0 {
            let s = *lock(&self.stats);
            self.client.inner.report.add_job(
                self.job_tag,
                &pb::JobUsage {
                    job_tag: self.job_tag,
                    hit_bytes: s.hit_bytes,
                    filled_bytes: s.filled_bytes,
                    fallback_bytes: s.fallback_bytes,
                    wait_ns: s.wait_time.as_nanos() as u64,
                    fallback_ns: s.fallback_time.as_nanos() as u64,
                },
            );
        }
    }
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("path", &self.path)
            .field("source", &self.source())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn version_of(f: &File) -> io::Result<pb::Version> {
    let st = rustix::fs::fstat(f)?;
    Ok(pb::Version {
        size: st.st_size as u64,
        mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec as i64,
        ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec as i64,
        ino: st.st_ino,
        dev: st.st_dev,
    })
}

/// The file changed on the backing store after bytes of it were served from the cache:
/// `ESTALE`, as NFS reports it. The caller reopens the file to read the new version.
fn stale() -> io::Error {
    io::Error::from(rustix::io::Errno::STALE)
}

/// Reads until `buf` is full or end of file.
fn pread_full(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl Reader {
    pub(crate) fn open(client: Client, path: &Path) -> io::Result<Self> {
        let (path, outcome) = Self::ask_open(&client, path)?;
        Self::build(client, path, outcome)
    }

    /// [`Reader::open`] when the daemon serves the file; `None` (without touching the
    /// backing store) when it does not.
    pub(crate) fn open_cached(client: Client, path: &Path) -> Option<Self> {
        let (path, outcome) = Self::ask_open(&client, path).ok()?;
        let opened = outcome.ok()?;
        if opened.reply.read_backing {
            // The caller opens the backing store itself (see `build`).
            let r = &client.inner.report;
            r.fallback_opens.fetch_add(1, Ordering::Relaxed);
            r.add_fallback(FallbackReason::Direct, true);
            return None;
        }
        Self::build(client, path, Ok(opened)).ok()
    }

    fn ask_open(client: &Client, path: &Path) -> io::Result<(std::path::PathBuf, Outcome)> {
        let path = absolute(path)?;
        let outcome = match askable(&path) {
            Err(why) => Err(why),
            Ok(p) => {
                let req = request::Kind::Open(pb::OpenRequest { path: p.to_owned() });
                match client.inner.call(req, client.inner.cfg.timeout) {
                    Ok((response::Kind::Open(reply), fds)) => outcome(reply, &mut fds.into_iter()),
                    Ok(_) => Err((FallbackReason::Protocol, "unexpected reply".into())),
                    Err(e) => Err((e.reason(), e.to_string())),
                }
            }
        };
        Ok((path, outcome))
    }

    /// Opens many files in as few exchanges as possible (64 per request). Each result is
    /// what [`Client::open`] would have returned for that path.
    pub(crate) fn open_many(client: &Client, paths: &[&Path]) -> Vec<io::Result<Self>> {
        let mut out = Vec::with_capacity(paths.len());
        for chunk in paths.chunks(MAX_BATCH) {
            let (batch, req) = Batch::new(chunk);
            let reply = match req {
                Some(req) => client.inner.call(req, client.inner.cfg.timeout),
                None => Err(CallError::Protocol("nothing to ask".into())),
            };
            out.extend(batch.build(client, reply));
        }
        out
    }

    fn build(client: Client, path: std::path::PathBuf, outcome: Outcome) -> io::Result<Self> {
        let (state, reason) = match outcome {
            Ok(c) => (Some(c), None),
            Err(why) => (None, Some(why)),
        };
        let mut job_tag = 0;
        let (state, reason) = match state {
            // The daemon fills this cold file behind the reader, from the page cache the
            // reader's own read fills: read the backing store as a plain open would.
            Some(c) if c.reply.read_backing => {
                job_tag = c.reply.job_tag;
                let why = (
                    FallbackReason::Direct,
                    "cold: read from the backing store while the daemon fills the cache".into(),
                );
                (None, Some(why))
            }
            s => (s, reason),
        };
        let (state, size) = match state {
            Some(c) => {
                let size = c.version().map_or(0, |v| v.size);
                job_tag = c.reply.job_tag;
                (State::Cached(c.into_cached()), size)
            }
            None => {
                let f = File::open(&path)?;
                let size = f.metadata()?.len();
                let r = &client.inner.report;
                r.fallback_opens.fetch_add(1, Ordering::Relaxed);
                let why = reason.as_ref().map_or(FallbackReason::Unspecified, |r| r.0);
                r.add_fallback(why, true);
                (State::Direct(Arc::new(f)), size)
            }
        };
        Ok(Self {
            client,
            path,
            pos: 0,
            size: Mutex::new(size),
            state: Mutex::new(state),
            stats: Mutex::new(ReaderStats::default()),
            fallback_reason: Mutex::new(reason),
            job_tag,
        })
    }

    /// The file's size (of the version being read).
    pub fn len(&self) -> u64 {
        *lock(&self.size)
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The absolute path opened.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where reads go now.
    pub fn source(&self) -> Source {
        match &*lock(&self.state) {
            State::Cached(_) => Source::Cache,
            State::Direct(_) => Source::Backing,
        }
    }

    /// Why the cache was bypassed, when it was: the message (`fallback()` has the kind).
    pub fn fallback_reason(&self) -> Option<String> {
        lock(&self.fallback_reason).as_ref().map(|r| r.1.clone())
    }

    /// The kind of the last reason for reading the backing store, when there was one
    /// (the `reason` label of the daemon's fallback metrics).
    pub fn fallback(&self) -> Option<crate::FallbackReason> {
        lock(&self.fallback_reason).as_ref().map(|r| r.0.into())
    }

    /// The reason last noted for reading the backing store (unspecified when none was).
    pub(crate) fn reason(&self) -> FallbackReason {
        lock(&self.fallback_reason)
            .as_ref()
            .map_or(FallbackReason::Unspecified, |r| r.0)
    }

    /// Bytes and reads so far, by source.
    pub fn stats(&self) -> ReaderStats {
        *lock(&self.stats)
    }

    fn count(&self, kind: Kind, n: usize) {
        let n = n as u64;
        let r = &self.client.inner.report;
        let mut guard = lock(&self.stats);
        let s = &mut *guard;
        let (bytes, reads, rb, rr) = match kind {
            Kind::Hit => (
                &mut s.hit_bytes,
                &mut s.hit_reads,
                &r.hit_bytes,
                &r.hit_reads,
            ),
            Kind::Filled => (
                &mut s.filled_bytes,
                &mut s.filled_reads,
                &r.filled_bytes,
                &r.filled_reads,
            ),
            Kind::Fallback => (
                &mut s.fallback_bytes,
                &mut s.fallback_reads,
                &r.fallback_bytes,
                &r.fallback_reads,
            ),
        };
        *bytes += n;
        *reads += 1;
        rb.fetch_add(n, Ordering::Relaxed);
        rr.fetch_add(1, Ordering::Relaxed);
    }

    fn note(&self, why: FallbackReason, message: String) {
        *lock(&self.fallback_reason) = Some((why, message));
    }

    /// Reads up to `buf.len()` bytes at `offset` (0 at end of file). Never fails because
    /// of the cache: only the backing store's own errors are returned (and `ESTALE` if
    /// the file changed on the backing store after bytes were already served from the
    /// cache).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let size = self.len();
        if buf.is_empty() || offset >= size {
            return Ok(0);
        }
        let want = buf.len().min((size - offset) as usize);
        let buf = &mut buf[..want];
        let mut waited = false;
        // At most: one local read, one wait, one local read after the wait, fallback.
        for _ in 0..3 {
            let mut st = lock(&self.state);
            let c = match &mut *st {
                State::Direct(f) => {
                    let f = f.clone();
                    drop(st);
                    return self.fallback_read(&f, buf, offset);
                }
                State::Cached(c) => c,
            };
            let bs = c.block_size;
            let first = offset / bs;
            if c.has(first) {
                let mut end = first + 1;
                while end < c.nblocks && c.has(end) && end * bs < offset + want as u64 {
                    end += 1;
                }
                let n = ((end * bs).min(size) - offset).min(want as u64) as usize;
                let Some(data) = c.data.clone() else { break };
                c.served = true;
                drop(st);
                match data.read_exact_at(&mut buf[..n], offset) {
                    Ok(()) => {
                        self.count(if waited { Kind::Filled } else { Kind::Hit }, n);
                        return Ok(n);
                    }
                    Err(e) => {
                        self.note(
                            FallbackReason::LocalError,
                            format!("local read failed: {e}"),
                        );
                        break;
                    }
                }
            }
            if c.refused {
                // Declined by the daemon (the reason was noted when it said so).
                break;
            }
            if waited {
                self.note(
                    FallbackReason::WaitTimeout,
                    "blocks still missing after a wait".into(),
                );
                break;
            }
            // Ask for the missing run this read covers (at least one block).
            let last = (offset + want as u64 - 1) / bs;
            let mut count = 1;
            while first + count <= last && count < MAX_WAIT_BLOCKS && !c.has(first + count) {
                count += 1;
            }
            drop(st);
            if !self.ask(first, count) {
                break;
            }
            waited = true;
        }
        self.read_backing(buf, offset)
    }

    /// Waits for the daemon to fill block `first` (with the run of `count` blocks from it),
    /// for at most the client's `wait_timeout`, in slices: each request asks the daemon
    /// to answer within half the client's `timeout` whether or not the blocks landed, and
    /// each round trip may take at most `timeout`. A daemon that stops answering so costs
    /// the reader at most `timeout` (then it reads the backing store: `Timeout`), while a
    /// slow but live fill is waited for slice after slice until `wait_timeout` is spent
    /// (`WaitTimeout`). Every slice renews the daemon's pin on the file, so that what
    /// lands stays for this reader.
    ///
    /// True when block `first` is present afterwards. False, with the reason noted,
    /// otherwise: the daemon declined or refused, nothing fills the block, the budget
    /// ran out, or the daemon failed.
    fn ask(&self, first: u64, count: u64) -> bool {
        let cfg = &self.client.inner.cfg;
        let clock = self.client.inner.clock();
        let started = clock.now();
        let budget = started + cfg.wait_timeout;
        let slice = (cfg.timeout / 2).max(Duration::from_millis(1));
        let path = self.path.to_str().unwrap_or_default().to_owned();
        let mut resumed = false;
        // Bounded by the budget: every round takes at least its slice, or ends the loop.
        let present = loop {
            let req = {
                let st = lock(&self.state);
                let State::Cached(c) = &*st else { break false };
                if c.has(first) {
                    break true;
                }
                let left = budget.saturating_duration_since(clock.now());
                if resumed && left.is_zero() {
                    drop(st);
                    self.note(
                        FallbackReason::WaitTimeout,
                        format!(
                            "blocks still missing after waiting {:.1} s (wait_timeout)",
                            cfg.wait_timeout.as_secs_f64()
                        ),
                    );
                    break false;
                }
                pb::WaitRequest {
                    path: path.clone(),
                    version: Some(c.version),
                    first_block: first,
                    count: count as u32,
                    have_data_gen: c.data_gen,
                    timeout_ms: left.min(slice).as_millis().clamp(1, u32::MAX as u128) as u32,
                    resumed,
                    more: left > slice,
                }
            };
            resumed = true;
            match self
                .client
                .inner
                .call(request::Kind::Wait(req), cfg.timeout)
            {
                Ok((
                    response::Kind::Wait(pb::WaitReply {
                        result: Some(wait_reply::Result::Waited(w)),
                    }),
                    fds,
                )) => {
                    if !self.take_waited(&w, fds) {
                        break false;
                    }
                    if w.declined {
                        self.note(
                            FallbackReason::Declined,
                            "the daemon declined to fill blocks of this file".into(),
                        );
                    }
                    let has = matches!(&*lock(&self.state), State::Cached(c) if c.has(first));
                    if has {
                        break true;
                    }
                    if w.declined {
                        break false;
                    }
                    if !w.filling {
                        self.note(
                            FallbackReason::Declined,
                            "the daemon is not filling the block (its fill queue is full)".into(),
                        );
                        break false;
                    }
                    // Still being filled: the next slice.
                }
                Ok((
                    response::Kind::Wait(pb::WaitReply {
                        result: Some(wait_reply::Result::Refused(r)),
                    }),
                    _,
                )) => {
                    if let State::Cached(c) = &mut *lock(&self.state) {
                        c.refused = true;
                    }
                    let why = match Reason::try_from(r.reason) {
                        Ok(Reason::Stale) => FallbackReason::Stale,
                        _ => FallbackReason::Declined,
                    };
                    self.note(why, format!("wait refused: {}", r.message));
                    break false;
                }
                Ok(_) => {
                    self.note(FallbackReason::Protocol, "unexpected reply to wait".into());
                    break false;
                }
                Err(e) => {
                    self.note(e.reason(), e.to_string());
                    break false;
                }
            }
        };
        lock(&self.stats).wait_time += clock.now().saturating_duration_since(started);
        present
    }

    /// Takes in a wait's answer: the new data file (if it was replaced), the bitmap, and
    /// whether the daemon declined. False, with the reason noted, when the answer
    /// cannot be used.
    fn take_waited(&self, w: &pb::Waited, fds: Vec<OwnedFd>) -> bool {
        let mut st = lock(&self.state);
        let State::Cached(c) = &mut *st else {
            return false;
        };
        if w.data_gen != c.data_gen {
            match fds.into_iter().next() {
                Some(fd) => {
                    c.data = Some(Arc::new(File::from(fd)));
                    c.data_gen = w.data_gen;
                }
                None => {
                    drop(st);
                    self.note(
                        FallbackReason::Protocol,
                        "daemon replaced the data file without a descriptor".into(),
                    );
                    return false;
                }
            }
        }
        c.present = w.present.clone();
        c.refused = w.declined;
        true
    }

    /// A descriptor of the node-local copy holding every byte of the file, after
    /// waiting for the daemon to fetch what is missing (each wait bounded by the
    /// client's `wait_timeout`). For callers that hand the descriptor on instead of
    /// reading through the reader (the `LD_PRELOAD` shim). `None` when the cache cannot
    /// provide one: no daemon, the file is read from the backing store, the daemon
    /// refused or declined, a wait timed out, or the file is empty.
    pub fn local_copy(&self) -> Option<File> {
        // Each round completes the file, gives up (a wait that saw no block land within
        // `wait_timeout`, or a refusal), or has at least its first missing block land:
        // a file landing block by block over a slow link is waited for as long as it
        // keeps landing, and every round makes progress, so there are at most `nblocks`.
        let rounds = match &*lock(&self.state) {
            State::Cached(c) => c.nblocks + 1,
            State::Direct(_) => return None,
        };
        for _ in 0..rounds {
            let req = {
                let st = lock(&self.state);
                let State::Cached(c) = &*st else { return None };
                let Some(first) = (0..c.nblocks).find(|&b| !c.has(b)) else {
                    return c.data.as_ref()?.try_clone().ok();
                };
                if c.refused {
                    return None;
                }
                let mut count = 1;
                while first + count < c.nblocks && count < MAX_WAIT_BLOCKS && !c.has(first + count)
                {
                    count += 1;
                }
                (first, count)
            };
            if !self.ask(req.0, req.1) {
                return None; // timed out or declined: the caller reads the backing store
            }
        }
        None
    }

    /// Serves `buf` at `offset` from the backing file, keeping to the version the
    /// reader was opened with.
    fn read_backing(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let f = {
            let mut st = lock(&self.state);
            match &mut *st {
                State::Direct(f) => f.clone(),
                State::Cached(c) => match &c.backing {
                    Some(f) => f.clone(),
                    None => {
                        let f = File::open(&self.path)?;
                        let v = version_of(&f)?;
                        if v == c.version {
                            let f = Arc::new(f);
                            c.backing = Some(f.clone());
                            f
                        } else if !c.served {
                            // Nothing was served from the cache yet: read the new version
                            // from the backing store from now on.
                            *lock(&self.size) = v.size;
                            let f = Arc::new(f);
                            *st = State::Direct(f.clone());
                            drop(st);
                            self.note(
                                FallbackReason::Stale,
                                "the file changed on the backing store".into(),
                            );
                            if offset >= v.size {
                                return Ok(0);
                            }
                            let want = buf.len().min((v.size - offset) as usize);
                            return self.fallback_read(&f, &mut buf[..want], offset);
                        } else {
                            return Err(stale());
                        }
                    }
                },
            }
        };
        self.fallback_read(&f, buf, offset)
    }

    /// Reads from the backing file `f`, counted and timed as a fallback.
    fn fallback_read(&self, f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let clock = self.client.inner.clock();
        let started = clock.now();
        let n = pread_full(f, buf, offset)?;
        lock(&self.stats).fallback_time += clock.now().saturating_duration_since(started);
        self.count(Kind::Fallback, n);
        self.client.inner.report.add_fallback(self.reason(), false);
        Ok(n)
    }

    /// Maps the whole file read-only: the local copy once every block is present
    /// (waiting for the daemon to fetch the rest), else the backing file.
    ///
    /// # Safety
    /// As with any file mapping, the mapped file must not be modified while mapped.
    /// The cached copy never is (blocks are written once, into holes; eviction unlinks);
    /// when the backing file is mapped instead, that is the caller's guarantee to give.
    pub unsafe fn mmap(&self) -> io::Result<memmap2::Mmap> {
        let mut next = 0;
        loop {
            let (file, missing) = {
                let st = lock(&self.state);
                match &*st {
                    State::Direct(f) => (Some(f.clone()), None),
                    State::Cached(c) if c.all_present() => (c.data.clone(), None),
                    State::Cached(c) => (None, (next..c.nblocks).find(|b| !c.has(*b))),
                }
            };
            if let Some(f) = file {
                // SAFETY: see the function's contract; the cached copy is immutable.
                return unsafe { memmap2::Mmap::map(&*f) };
            }
            let Some(b) = missing else { break };
            let bs = match &*lock(&self.state) {
                State::Cached(c) => c.block_size,
                State::Direct(_) => continue,
            };
            // Touch the first missing block: read_at waits for it (and its run).
            let mut one = [0u8; 1];
            self.read_at(&mut one, b * bs)?;
            if !matches!(&*lock(&self.state), State::Cached(c) if c.has(b)) {
                break;
            }
            next = b + 1;
        }
        let f = File::open(&self.path)?;
        let v = version_of(&f)?;
        if let State::Cached(c) = &*lock(&self.state)
            && v != c.version
        {
            return Err(stale());
        }
        // SAFETY: see the function's contract.
        unsafe { memmap2::Mmap::map(&f) }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Hit,
    Filled,
    Fallback,
}

struct Opened {
    reply: pb::Opened,
    data: Option<File>,
}

/// What the daemon said about one open: something to read through, or why not.
/// (The reason is counted per fallback; the message is what `fallback_reason` shows.)
type Outcome = Result<Opened, (FallbackReason, String)>;

/// `path` made absolute without changing what it names, for the daemon and for the
/// client's own fallback open. `std::path::absolute` drops a final `.` (which makes a
/// file's path ENOTDIR) and repeated `./` (which can shorten a path the kernel refuses as
/// too long): a final `.` is kept, and a path the kernel refuses is left as it is.
fn absolute(path: &Path) -> io::Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let raw = path.as_os_str().as_bytes();
    if raw.len() > wire::MAX_PATH {
        return Ok(path.to_owned());
    }
    let mut abs = std::path::absolute(path)?;
    if raw == b"." || raw.ends_with(b"/.") {
        abs.push(".");
    }
    Ok(abs)
}

/// Most files per OpenMany request (the most descriptors one reply carries).
const MAX_BATCH: usize = shardcache_proto::wire::MAX_FDS;

/// The path as the daemon is asked about it, or why it is not asked (the file is then
/// read directly, where the kernel has the last word): not UTF-8, or longer than any
/// path the daemon (and the kernel) accepts.
fn askable(path: &Path) -> Result<&str, (FallbackReason, String)> {
    match path.to_str() {
        None => Err((FallbackReason::Refused, "path is not UTF-8".to_owned())),
        Some(p) if p.len() > wire::MAX_PATH => Err((
            FallbackReason::Refused,
            format!("path longer than {} bytes", wire::MAX_PATH),
        )),
        Some(p) => Ok(p),
    }
}

/// The paths of one OpenMany exchange. A path the daemon cannot be asked about (see
/// [`askable`]) is left out of the request and read directly, without keeping the rest
/// of its batch from the cache.
struct Batch {
    abs: Vec<io::Result<PathBuf>>,
    /// Per path: `None` when it is in the request, else why it is not.
    skipped: Vec<Option<(FallbackReason, String)>>,
}

impl Batch {
    /// The batch, and its request (none when no path of it can be asked about).
    fn new(chunk: &[&Path]) -> (Self, Option<request::Kind>) {
        let abs: Vec<io::Result<PathBuf>> = chunk.iter().map(|p| absolute(p)).collect();
        let mut paths = Vec::new();
        let skipped = abs
            .iter()
            .map(|p| match p.as_ref().map(|p| askable(p)) {
                Ok(Ok(p)) => {
                    paths.push(p.to_owned());
                    None
                }
                Ok(Err(why)) => Some(why),
                Err(e) => Some((FallbackReason::Refused, e.to_string())),
            })
            .collect();
        let req =
            (!paths.is_empty()).then_some(request::Kind::OpenMany(pb::OpenManyRequest { paths }));
        (Self { abs, skipped }, req)
    }

    /// One outcome per path, from the daemon's reply to the request (or its absence).
    fn outcomes(
        self,
        reply: Result<(response::Kind, Vec<OwnedFd>), CallError>,
    ) -> (Vec<io::Result<PathBuf>>, Vec<Outcome>) {
        let sent = self.skipped.iter().filter(|s| s.is_none()).count();
        let answers = match reply {
            _ if sent == 0 => Vec::new(),
            Ok((response::Kind::OpenMany(m), fds)) if m.results.len() == sent => {
                let mut fds = fds.into_iter();
                m.results
                    .into_iter()
                    .map(|r| outcome(r, &mut fds))
                    .collect()
            }
            Ok(_) => failed(sent, FallbackReason::Protocol, "unexpected reply"),
            Err(e) => failed(sent, e.reason(), &e.to_string()),
        };
        let mut answers = answers.into_iter();
        let outcomes = self
            .skipped
            .into_iter()
            .map(|s| match s {
                Some(why) => Err(why),
                None => answers
                    .next()
                    .unwrap_or_else(|| Err((FallbackReason::Protocol, "missing answer".into()))),
            })
            .collect();
        (self.abs, outcomes)
    }

    /// The readers (or errors) of the batch, in its order.
    fn build(
        self,
        client: &Client,
        reply: Result<(response::Kind, Vec<OwnedFd>), CallError>,
    ) -> Vec<io::Result<Reader>> {
        let (abs, outcomes) = self.outcomes(reply);
        abs.into_iter()
            .zip(outcomes)
            .map(|(p, o)| p.and_then(|p| Reader::build(client.clone(), p, o)))
            .collect()
    }
}

/// Opens files in a known order, one batch ahead: while the caller reads the files of
/// one batch, the daemon is already opening the next. See [`Client::open_ahead`].
pub struct OpenAhead {
    client: Client,
    paths: std::vec::IntoIter<PathBuf>,
    batch: usize,
    /// The batch sent and not yet answered.
    pending: Option<(Pending, Batch)>,
    ready: VecDeque<io::Result<Reader>>,
}

impl std::fmt::Debug for OpenAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAhead")
            .field("ready", &self.ready.len())
            .field("batch", &self.batch)
            .finish()
    }
}

impl OpenAhead {
    pub(crate) fn new(client: Client, paths: Vec<PathBuf>, batch: usize) -> Self {
        let batch = batch.clamp(1, MAX_BATCH);
        Self {
            client,
            paths: paths.into_iter(),
            batch,
            pending: None,
            ready: VecDeque::new(),
        }
    }

    /// Sends the next batch; false when there is none.
    fn send_next(&mut self) -> bool {
        let chunk: Vec<PathBuf> = self.paths.by_ref().take(self.batch).collect();
        if chunk.is_empty() {
            return false;
        }
        let refs: Vec<&Path> = chunk.iter().map(PathBuf::as_path).collect();
        let (batch, req) = Batch::new(&refs);
        let sent = match req {
            Some(req) => self.client.inner.send(req, true),
            None => Err(CallError::Protocol("nothing to ask".into())),
        };
        match sent {
            Ok(p) => self.pending = Some((p, batch)),
            Err(e) => self.ready.extend(batch.build(&self.client, Err(e))),
        }
        true
    }
}

impl Iterator for OpenAhead {
    type Item = io::Result<Reader>;

    fn next(&mut self) -> Option<io::Result<Reader>> {
        loop {
            if let Some(r) = self.ready.pop_front() {
                return Some(r);
            }
            match self.pending.take() {
                Some((p, batch)) => {
                    let reply = self.client.inner.finish(p, self.client.inner.cfg.timeout);
                    self.ready.extend(batch.build(&self.client, reply));
                    // Keep the daemon busy while these are read.
                    self.send_next();
                }
                None => {
                    if !self.send_next() {
                        return None;
                    }
                }
            }
        }
    }
}

fn failed(n: usize, reason: FallbackReason, why: &str) -> Vec<Outcome> {
    (0..n).map(|_| Err((reason, why.to_owned()))).collect()
}

/// The fallback reason for a refused open: the daemon will not serve the file at all
/// (refused), cannot cache it now (declined), or it changed (stale). Exhaustive, so
/// that a new refusal reason has to be placed here.
fn refusal_reason(reason: i32) -> FallbackReason {
    match Reason::try_from(reason) {
        Ok(
            Reason::NotUnderRoot
            | Reason::EscapesRoot
            | Reason::PermissionDenied
            | Reason::NotFound
            | Reason::NotAFile
            | Reason::Invalid
            | Reason::UncertainAccess,
        ) => FallbackReason::Refused,
        Ok(Reason::Stale) => FallbackReason::Stale,
        Ok(Reason::Busy | Reason::NoSpace | Reason::BackingError | Reason::StoreError) => {
            FallbackReason::Declined
        }
        Ok(Reason::Timeout) => FallbackReason::Timeout,
        Ok(Reason::Unspecified) | Err(_) => FallbackReason::Unspecified,
    }
}

/// Interprets one open reply, taking its descriptor (if it has one) from `fds`.
fn outcome(reply: pb::OpenReply, fds: &mut impl Iterator<Item = OwnedFd>) -> Outcome {
    match reply.result {
        Some(open_reply::Result::Opened(o)) => {
            let data = if o.data_gen != 0 {
                fds.next().map(File::from)
            } else {
                None
            };
            if o.data_gen != 0 && data.is_none() {
                return Err((
                    FallbackReason::Protocol,
                    "daemon reply lacks the data descriptor".into(),
                ));
            }
            if o.version.is_none() || o.block_size == 0 {
                return Err((
                    FallbackReason::Protocol,
                    "daemon reply lacks the version".into(),
                ));
            }
            Ok(Opened { reply: o, data })
        }
        Some(open_reply::Result::Refused(r)) => {
            Err((refusal_reason(r.reason), format!("refused: {}", r.message)))
        }
        None => Err((FallbackReason::Protocol, "empty reply".into())),
    }
}

impl Opened {
    fn into_cached(self) -> Cached {
        let v = self.reply.version.unwrap_or_default();
        let bs = self.reply.block_size as u64;
        Cached {
            data: self.data.map(Arc::new),
            data_gen: self.reply.data_gen,
            version: v,
            block_size: bs,
            nblocks: v.size.div_ceil(bs),
            present: self.reply.present,
            backing: None,
            served: false,
            refused: false,
        }
    }
}

impl Opened {
    fn version(&self) -> Option<&pb::Version> {
        self.reply.version.as_ref()
    }
}

impl Read for Reader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for Reader {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        let new = match pos {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len().checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        match new {
            Some(p) => {
                self.pos = p;
                Ok(p)
            }
            None => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek to a negative position",
            )),
        }
    }
}
