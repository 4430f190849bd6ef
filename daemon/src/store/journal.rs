//! The index journal: an append-only file of [`Record`]s that, replayed, rebuilds which
//! blocks of which file versions the store holds.
//!
//! Layout: the 8-byte magic `SCJRNL01`, then frames of a little-endian `u32` payload
//! length, a little-endian `u64` xxh3 of the payload, and the payload (a prost-encoded
//! [`Record`]). Every frame checks itself. Replay stops at the first frame that is short,
//! fails its checksum or does not decode — a write torn by a power loss or a full disk,
//! or bytes damaged since — and keeps every record before it.
//!
//! A journal replay could not read whole is [`Damage`]d: [`set_aside`] renames it
//! (`journal.bad-<unix seconds>`, the newest few kept) so that a person can look at it,
//! and the store starts from what replay kept. Keeping the records before the damage is
//! safe because no record is trusted for the bytes it names: every block is checked
//! against its checksum after every start before it is handed out (`store/mod.rs`), so a
//! record lost after the damage can only make a block absent, or bring back one whose
//! bytes are then checked like any other.
//!
//! Appends go through one writer thread that batches whatever is queued into one
//! `write` and one `fdatasync` (group commit); [`Journal::append`] returns only once its
//! record is durable. A caller makes a block visible only after that, and writes the
//! block's data durably before appending, so a replayed record never points at data that
//! did not reach the disk.
//!
//! The journal knows records, not the index: what a record says and how it is replayed
//! are `records.rs`'s; it never reads or writes a data file.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use parking_lot::Mutex;
use std::time::Duration;

use prost::Message;
use shardcache_proto::store::v1::Record;
use xxhash_rust::xxh3::xxh3_64;

use crate::lifecycle::Task;

const MAGIC: &[u8; 8] = b"SCJRNL01";
const MAX_RECORD: usize = 1 << 20;
/// Most records one group commit takes.
const MAX_BATCH: usize = 1024;
/// Records (appends and pauses) queued for the writer; an appender waits for room.
const QUEUE: usize = 4096;
/// Longest [`Journal::close`] waits for the writer to make what was queued durable: a
/// writer stuck in a `write` or `fdatasync` on a hung disk is left behind (and logged).
pub const WRITER_STOP: Duration = Duration::from_secs(10);

type Done = SyncSender<Result<(), Arc<io::Error>>>;

/// What the writer thread is asked to do.
enum Msg {
    /// Write this frame; report durability on `Done`.
    Append(Vec<u8>, Done),
    /// Stop after everything before this message is durable, say so on the first
    /// channel, then wait for a new file (or none: keep the old) on the second.
    Pause(SyncSender<()>, Receiver<Option<File>>),
}

/// Compact when this many bytes were appended since the last rewrite (and at least
/// twice the rewritten size): a long-running daemon's journal stays proportional to
/// what the cache holds, not to its history.
pub const COMPACT_AFTER: u64 = 64 << 20;

/// An open journal accepting appends.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    tx: Mutex<Option<SyncSender<Msg>>>,
    /// The writer thread (`sc-journal`): it ends when `tx` is dropped and the queue is
    /// drained (its stop signal is that, not the task's own).
    writer: Mutex<Option<Task>>,
    /// True while the writer runs (the liveness probe reads it).
    alive: Arc<AtomicBool>,
    /// Bytes appended since the last rewrite, and the size of that rewrite.
    appended: AtomicU64,
    /// Appends waited for (each one wait for a group's `fdatasync`).
    #[cfg(test)]
    appends: AtomicU64,
    base: AtomicU64,
    compacting: AtomicBool,
}

/// What replay found wrong with a journal.
#[derive(Debug)]
pub enum Damage {
    /// It could not be read: an I/O error, or it is not a regular file.
    Unreadable(io::Error),
    /// It does not start with the journal's magic: empty, cut inside its header, or not
    /// a journal at all. Nothing in it can be used.
    NotAJournal {
        /// Its length in bytes.
        len: u64,
    },
    /// The frame at byte `at` is cut short, fails its checksum or does not decode;
    /// the records before it are kept, nothing from it on.
    Cut {
        /// Offset of the first unusable byte.
        at: u64,
        /// The journal's length in bytes.
        len: u64,
    },
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreadable(e) => write!(f, "unreadable: {e}"),
            Self::NotAJournal { len } => {
                write!(f, "not a shardcache journal (bad magic, {len} bytes)")
            }
            Self::Cut { at, len } => write!(
                f,
                "unusable from byte {at} of {len} (a torn or corrupt record)"
            ),
        }
    }
}

/// What [`replay`] read.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Every intact record before the first damage, in order.
    pub records: Vec<Record>,
    /// What was wrong, if anything (`None` also when there was no journal).
    pub damage: Option<Damage>,
}

/// Reads every intact record of the journal at `path` (none if it does not exist),
/// and says what, if anything, could not be read. Never blocks on a special file and
/// never follows a symbolic link: either is [`Damage::Unreadable`].
pub fn replay(path: &Path) -> Replayed {
    let bytes = match read_regular(path) {
        Ok(Some(b)) => b,
        Ok(None) => return Replayed::default(),
        Err(e) => {
            return Replayed {
                records: Vec::new(),
                damage: Some(Damage::Unreadable(e)),
            };
        }
    };
    let len = bytes.len() as u64;
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Replayed {
            records: Vec::new(),
            damage: Some(Damage::NotAJournal { len }),
        };
    }
    let mut records = Vec::new();
    let mut at = MAGIC.len();
    while at < bytes.len() {
        let Some(r) = decode_frame(&bytes[at..]) else {
            return Replayed {
                records,
                damage: Some(Damage::Cut { at: at as u64, len }),
            };
        };
        records.push(r.0);
        at += r.1;
    }
    Replayed {
        records,
        damage: None,
    }
}

/// The record at the start of `b` and the length of its frame, if the frame is whole
/// and intact.
fn decode_frame(b: &[u8]) -> Option<(Record, usize)> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(b.get(4..12)?.try_into().ok()?);
    if len > MAX_RECORD {
        return None;
    }
    let payload = b.get(12..12 + len)?;
    if xxh3_64(payload) != sum {
        return None;
    }
    Some((Record::decode(payload).ok()?, 12 + len))
}

/// The contents of the regular file at `path`; `None` if nothing is there.
fn read_regular(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let mut f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a regular file ({:?})", meta.file_type()),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.read_to_end(&mut bytes)?;
    Ok(Some(bytes))
}

/// Set-aside journals kept at most (the oldest beyond are removed).
pub const KEEP_SET_ASIDE: usize = 3;

/// Renames the journal at `path` to `<name>.bad-<unix seconds>` (with `-<n>` added if
/// that exists), makes the rename durable, and removes the oldest set-aside journals
/// beyond [`KEEP_SET_ASIDE`]. Returns the new path.
pub fn set_aside(path: &Path) -> io::Result<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::other("journal path has no UTF-8 file name"))?;
    let prefix = format!("{name}.bad-");
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Those set aside before, as (seconds, n) from their names.
    let mut aside: Vec<((u64, u64), PathBuf)> = std::fs::read_dir(dir)?
        .flatten()
        .filter_map(|e| {
            let file = e.file_name();
            let rest = file.to_str()?.strip_prefix(&prefix)?;
            let (s, n) = rest.split_once('-').unwrap_or((rest, "0"));
            Some(((s.parse().ok()?, n.parse().ok()?), e.path()))
        })
        .collect();
    // A name after every earlier one (several in one second get -1, -2, ...; a clock
    // set back does not make the newest look oldest).
    let secs = aside.iter().map(|((s, _), _)| *s).fold(secs, u64::max);
    let n = aside
        .iter()
        .filter(|((s, _), _)| *s == secs)
        .map(|((_, n), _)| n + 1)
        .max()
        .unwrap_or(0);
    let to = match n {
        0 => dir.join(format!("{prefix}{secs}")),
        n => dir.join(format!("{prefix}{secs}-{n}")),
    };
    std::fs::rename(path, &to)?;
    sync_dir(dir)?;
    aside.push(((secs, n), to.clone()));
    aside.sort();
    let extra = aside.len().saturating_sub(KEEP_SET_ASIDE);
    for (_, p) in aside.into_iter().take(extra) {
        if let Err(e) = remove_any(&p) {
            tracing::warn!(path = %p.display(), error = %e, "could not remove an old set-aside journal");
        }
    }
    Ok(to)
}

/// Removes whatever is at `path` unless it is a regular file (a directory with its
/// contents; a link, not its target). For the store's own names, where only the store
/// writes and anything else is debris that must not stop a start.
pub fn clear_unless_file(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => remove_any(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Removes a file, link or directory tree at `path` (never following a link).
pub fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn frame(rec: &Record) -> Vec<u8> {
    let payload = rec.encode_to_vec();
    let mut f = Vec::with_capacity(12 + payload.len());
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(&xxh3_64(&payload).to_le_bytes());
    f.extend_from_slice(&payload);
    f
}

/// Makes a directory's entries durable (after a create, rename or unlink in it).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Journal {
    /// Writes `records` as a new journal at `path` (atomically: temp file, fsync,
    /// rename, fsync of the directory) and opens it for appends.
    pub fn create(path: &Path, records: impl IntoIterator<Item = Record>) -> io::Result<Self> {
        let (file, size) = write_new(path, records)?;
        let (tx, rx) = sync_channel(QUEUE);
        let alive = Arc::new(AtomicBool::new(false));
        let writer = Task::spawn("sc-journal", alive.clone(), move |_| writer_loop(file, rx))?;
        Ok(Self {
            path: path.to_owned(),
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            alive,
            appended: AtomicU64::new(0),
            #[cfg(test)]
            appends: AtomicU64::new(0),
            base: AtomicU64::new(size),
            compacting: AtomicBool::new(false),
        })
    }

    /// True when enough was appended since the last rewrite that [`Journal::compact`]
    /// is worth it.
    pub fn wants_compaction(&self) -> bool {
        let appended = self.appended.load(Ordering::Relaxed);
        appended > COMPACT_AFTER && appended > 2 * self.base.load(Ordering::Relaxed)
    }

    /// Rewrites the journal as `snapshot()` while appends wait.
    ///
    /// The writer first makes every earlier append durable and pauses; `snapshot` is
    /// then taken, so it reflects at least every change whose record was appended
    /// before (a change is applied to the index before its removal records are appended,
    /// and additions become visible only after their records are durable). Records
    /// queued meanwhile go to the new file. At worst a block whose addition raced the
    /// snapshot is forgotten: absent, never wrongly present. One compaction at a time;
    /// a concurrent call returns at once.
    pub fn compact(&self, snapshot: impl FnOnce() -> Vec<Record>) -> io::Result<()> {
        if self.compacting.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let result = self.compact_inner(snapshot);
        self.compacting.store(false, Ordering::Release);
        result
    }

    fn compact_inner(&self, snapshot: impl FnOnce() -> Vec<Record>) -> io::Result<()> {
        let tx = self.tx.lock().clone();
        let Some(tx) = tx else {
            return Err(io::Error::other("journal closed"));
        };
        let (paused_tx, paused_rx) = sync_channel(1);
        let (resume_tx, resume_rx) = sync_channel(1);
        tx.send(Msg::Pause(paused_tx, resume_rx))
            .map_err(|_| io::Error::other("journal writer stopped"))?;
        paused_rx
            .recv()
            .map_err(|_| io::Error::other("journal writer stopped"))?;
        match write_new(&self.path, snapshot()) {
            Ok((file, size)) => {
                let _ = resume_tx.send(Some(file));
                self.appended.store(0, Ordering::Relaxed);
                self.base.store(size, Ordering::Relaxed);
                tracing::info!(bytes = size, "index journal compacted");
                Ok(())
            }
            Err(e) => {
                let _ = resume_tx.send(None);
                Err(e)
            }
        }
    }

    /// Appends `rec` and returns once it is durable. Fails if the journal is closed or a
    /// previous write failed (the journal then refuses everything: nothing new becomes
    /// visible, which is safe).
    pub fn append(&self, rec: &Record) -> io::Result<()> {
        self.append_frames(frame(rec))
    }

    /// Appends waited for since the journal opened.
    #[cfg(test)]
    pub(crate) fn appends(&self) -> u64 {
        self.appends.load(Ordering::Relaxed)
    }

    /// Appends `recs` in one write and one `fdatasync` (shared with whatever else is
    /// queued); returns once every one is durable. A crash during the write keeps a
    /// prefix of them (replay stops at a torn frame).
    pub fn append_all(&self, recs: &[Record]) -> io::Result<()> {
        self.append_frames(recs.iter().flat_map(frame).collect())
    }

    fn append_frames(&self, frame: Vec<u8>) -> io::Result<()> {
        let (done_tx, done_rx) = sync_channel(1);
        let tx = self.tx.lock().clone();
        let Some(tx) = tx else {
            return Err(io::Error::other("journal closed"));
        };
        self.appended
            .fetch_add(frame.len() as u64, Ordering::Relaxed);
        #[cfg(test)]
        self.appends.fetch_add(1, Ordering::Relaxed);
        tx.send(Msg::Append(frame, done_tx))
            .map_err(|_| io::Error::other("journal writer stopped"))?;
        match done_rx.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(io::Error::new(e.kind(), e.to_string())),
            Err(_) => Err(io::Error::other("journal writer stopped")),
        }
    }

    /// False once the writer thread has ended: closed, or ended by a panic (then every
    /// append fails and nothing new becomes visible).
    pub fn writer_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Stops accepting appends and waits, at most [`WRITER_STOP`], for the writer to
    /// make what was queued durable; false when it did not finish in time (stuck on the
    /// disk: it is left behind, and a later call does not wait for it again).
    pub fn close(&self) -> bool {
        self.tx.lock().take();
        let writer = self.writer.lock().take();
        let Some(mut t) = writer else {
            return !self.writer_alive();
        };
        // The queue's end is the writer's stop: it drains what is queued, then returns.
        t.join(WRITER_STOP)
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// Writes `records` as a complete journal at `path` atomically (temp file, fsync,
/// rename, fsync of the directory); returns it opened for appends, and its size.
fn write_new(path: &Path, records: impl IntoIterator<Item = Record>) -> io::Result<(File, u64)> {
    let tmp: PathBuf = path.with_extension("tmp");
    clear_unless_file(&tmp)?;
    let mut size = 0;
    {
        // 0600: the journal names every cached file (the store's directory is private too).
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let mut buf = Vec::with_capacity(1 << 20);
        buf.extend_from_slice(MAGIC);
        for r in records {
            buf.extend_from_slice(&frame(&r));
            if buf.len() >= 1 << 20 {
                f.write_all(&buf)?;
                size += buf.len() as u64;
                buf.clear();
            }
        }
        f.write_all(&buf)?;
        size += buf.len() as u64;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(parent) = path.parent() {
        sync_dir(parent)?;
    }
    Ok((OpenOptions::new().append(true).open(path)?, size))
}

fn writer_loop(mut file: File, rx: Receiver<Msg>) {
    let mut failed: Option<Arc<io::Error>> = None;
    let mut next = None;
    loop {
        let first = match next.take() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => return,
            },
        };
        let mut batch = match first {
            Msg::Append(f, done) => vec![(f, done)],
            Msg::Pause(paused, resume) => {
                let _ = paused.send(());
                if let Ok(Some(f)) = resume.recv() {
                    file = f;
                }
                continue;
            }
        };
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(Msg::Append(f, done)) => batch.push((f, done)),
                Ok(pause) => {
                    // Handled after this batch is durable.
                    next = Some(pause);
                    break;
                }
                Err(_) => break,
            }
        }
        let result = match &failed {
            Some(e) => Err(e.clone()),
            None => {
                let mut buf = Vec::with_capacity(batch.iter().map(|(f, _)| f.len()).sum());
                for (f, _) in &batch {
                    buf.extend_from_slice(f);
                }
                match file.write_all(&buf).and_then(|()| file.sync_data()) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        tracing::error!(error = %e, "journal write failed; the cache stops admitting data");
                        let e = Arc::new(e);
                        failed = Some(e.clone());
                        Err(e)
                    }
                }
            }
        };
        for (_, done) in batch {
            let _ = done.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcache_proto::store::v1::{BlockAdded, record::Kind};

    fn block(i: u64) -> Record {
        Record {
            kind: Some(Kind::BlockAdded(BlockAdded {
                key: vec![1; 16],
                index: i,
                len: 10,
                xxh3: i,
                generation: 1,
            })),
        }
    }

    /// The writer is a lifecycle task: alive while the journal is open, drained and
    /// joined by `close` (every queued append durable first), refusing appends after.
    #[test]
    fn close_drains_and_joins_the_writer_and_its_liveness_follows() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let j = Arc::new(Journal::create(&p, Vec::new()).unwrap());
        assert!(j.writer_alive());
        let appenders: Vec<_> = (0..4)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    (0..25)
                        .filter(|i| j.append(&block(t * 100 + i)).is_ok())
                        .count()
                })
            })
            .collect();
        let appended: usize = appenders.into_iter().map(|a| a.join().unwrap()).sum();
        assert_eq!(appended, 100);
        assert!(j.close(), "joined within the bound");
        assert!(!j.writer_alive());
        assert!(j.close(), "a second close has nothing to wait for");
        assert!(j.append(&block(0)).is_err(), "closed");
        assert_eq!(replay(&p).records.len(), 100);
    }

    #[test]
    fn appends_survive_reopen_and_a_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let j = Journal::create(&p, vec![block(0)]).unwrap();
        for i in 1..50 {
            j.append(&block(i)).unwrap();
        }
        j.close();
        let r = replay(&p);
        assert_eq!(r.records.len(), 50);
        assert!(r.damage.is_none());
        // A power loss mid-append leaves a partial frame: replay keeps everything before
        // it and says where it stopped.
        let whole = std::fs::metadata(&p).unwrap().len();
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        let torn = frame(&block(99));
        f.write_all(&torn[..torn.len() - 3]).unwrap();
        let r = replay(&p);
        assert_eq!(r.records.len(), 50);
        assert!(matches!(r.damage, Some(Damage::Cut { at, .. }) if at == whole));
        // A corrupted byte in the middle stops replay there.
        let mut bytes = std::fs::read(&p).unwrap();
        let mid = MAGIC.len() + 10 * torn.len() + 14;
        bytes[mid] ^= 0xff;
        std::fs::write(&p, &bytes).unwrap();
        let r = replay(&p);
        assert_eq!(r.records.len(), 10);
        assert!(matches!(r.damage, Some(Damage::Cut { .. })));
    }

    #[test]
    fn replay_names_what_is_wrong_and_never_blocks_or_follows_links() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let r = replay(&p);
        assert!(
            r.records.is_empty() && r.damage.is_none(),
            "no journal: nothing wrong"
        );
        for bad in [&b""[..], b"SCJR", b"not a journal at all"] {
            std::fs::write(&p, bad).unwrap();
            let r = replay(&p);
            assert!(
                matches!(r.damage, Some(Damage::NotAJournal { len }) if len == bad.len() as u64),
                "{bad:?}: {:?}",
                r.damage
            );
        }
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &p).unwrap();
        assert!(matches!(replay(&p).damage, Some(Damage::Unreadable(_))));
        std::fs::remove_file(&p).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &p,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(matches!(replay(&p).damage, Some(Damage::Unreadable(_))));
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        let r = replay(&p);
        assert!(matches!(r.damage, Some(Damage::Unreadable(_))));
        assert!(r.damage.unwrap().to_string().contains("unreadable"));
    }

    #[test]
    fn set_aside_renames_and_keeps_the_newest_few() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let mut aside = Vec::new();
        for i in 0..KEEP_SET_ASIDE + 2 {
            std::fs::write(&p, format!("bad {i}")).unwrap();
            let to = set_aside(&p).unwrap();
            assert!(!p.exists());
            assert_eq!(std::fs::read_to_string(&to).unwrap(), format!("bad {i}"));
            aside.push(to);
        }
        // Each name is new, and only the newest KEEP_SET_ASIDE remain.
        let names: std::collections::HashSet<_> = aside.iter().collect();
        assert_eq!(names.len(), aside.len());
        let left: Vec<bool> = aside.iter().map(|a| a.exists()).collect();
        assert_eq!(left, [false, false, true, true, true]);
        // A directory (or anything else) is set aside the same way.
        std::fs::create_dir_all(p.join("x")).unwrap();
        assert!(set_aside(&p).unwrap().join("x").is_dir());
    }

    #[test]
    fn compaction_keeps_the_snapshot_and_later_appends() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let j = Arc::new(Journal::create(&p, Vec::new()).unwrap());
        for i in 0..100 {
            j.append(&block(i)).unwrap();
        }
        // Appenders keep going while the journal is rewritten.
        let bg = {
            let j = j.clone();
            std::thread::spawn(move || {
                for i in 1000..1200 {
                    j.append(&block(i)).unwrap();
                }
            })
        };
        j.compact(|| (0..10).map(block).collect()).unwrap();
        bg.join().unwrap();
        j.append(&block(5000)).unwrap();
        j.close();
        let got: Vec<u64> = replay(&p)
            .records
            .into_iter()
            .map(|r| match r.kind {
                Some(Kind::BlockAdded(b)) => b.index,
                _ => panic!("unexpected record"),
            })
            .collect();
        assert_eq!(
            &got[..10],
            &(0..10).collect::<Vec<_>>()[..],
            "the snapshot comes first"
        );
        assert_eq!(*got.last().unwrap(), 5000);
        // Appends racing the rewrite land in the old file or the new one; those in the
        // new one are all intact and in order.
        let racing: Vec<u64> = got[10..got.len() - 1].to_vec();
        assert!(racing.windows(2).all(|w| w[0] < w[1]));
        assert!(racing.iter().all(|i| (1000..1200).contains(i)));
        assert!(!j.wants_compaction());
    }

    #[test]
    fn concurrent_appends_are_all_durable() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let j = Arc::new(Journal::create(&p, Vec::new()).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    for i in 0..100 {
                        j.append(&block(t * 1000 + i)).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        j.close();
        assert_eq!(replay(&p).records.len(), 800);
        assert!(
            j.append(&block(1)).is_err(),
            "closed journal refuses appends"
        );
    }
}
