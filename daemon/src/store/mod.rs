//! The NVMe store: blocks of backing-file versions in local sparse files, an index of
//! which blocks are present, and the space they may take.
//!
//! ## Layout (`<cache_dir>/shardcache-v1/`)
//! - `data/<xx>/<key>.<generation>`: one sparse file per cached file version, as long as the
//!   backing file; block `i` lives at `i * block_size`; missing blocks are holes. `key`
//!   is the xxh3-128 of (root, path, version), so a changed backing file can never map
//!   to an old copy; `generation` tells successive data files of one key apart.
//! - `journal`: the index, as an append-only log ([`journal`]).
//! - `LOCK`: held (`flock`) by the running daemon. `CLEAN`: written at orderly shutdown;
//!   the next start only logs it.
//!
//! ## Rules
//! - A block becomes visible only after its bytes are written and `fdatasync`ed and its
//!   journal record (with the xxh3 of the bytes) is durable. A crash at any point leaves
//!   at most a block that is absent from the index, never one that is present but wrong.
//! - After every start, orderly shutdown before it or not, every block is *unverified*:
//!   its checksum is checked before the block is first handed out — to a local client
//!   ([`Store::view`], at most [`VERIFY_PER_VIEW`] bytes per call; a fill worker checks
//!   the blocks a reader waits for, [`Store::begin_fill`]) or to a peer
//!   ([`Store::read_block_into`] checks every block it sends) — and the daemon's
//!   background scrub ([`Store::verify_unverified`]) checks the rest. Corrupt blocks are
//!   dropped (and refetched by whoever needs them). A clean shutdown saves no check: the
//!   bytes on disk may have changed while no daemon ran. `shardcache verify` checks all
//!   blocks.
//! - A journal that cannot be read whole is set aside and the store starts from the
//!   intact records before the damage (none if it has no valid header); data files no
//!   record names are removed. The data files carry no checksums of their own, so there
//!   is nothing else to rebuild the index from ([`journal`]).
//! - Space: cached bytes stay under `capacity`, and the cache file system keeps
//!   `min_free` free; room is made by evicting whole files in the order the
//!   [`evict::EvictionPolicy`] gives. Eviction unlinks the data file, so a client that
//!   already holds a descriptor keeps reading the same (correct) bytes.
//!
//! The store never reads the backing store and knows nothing of clients: the fill
//! engine ([`crate::fill`]) feeds it, the server hands out its descriptors.

pub mod evict;
mod free;
pub mod journal;

use rustc_hash::FxHashMap as HashMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use shardcache_proto::store::v1 as jpb;
use shardcache_proto::store::v1::record::Kind;
use xxhash_rust::xxh3::xxh3_128;

use crate::backing::{Stat, Version};
use crate::checksum::{BlockHasher, block_xxh3};
use crate::stats::{Stats, add, inc};
use crate::units::SizeSpec;
use evict::{EvictionPolicy, Lru};
use free::{FreeSpace, fs_stats};
use journal::Journal;

/// Identity of a cached file version: xxh3-128 of (root, canonical path, version).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub [u8; 16]);

impl Key {
    /// The key of `path` under `root` at `version`.
    pub fn of(root: &str, path: &str, v: &Version) -> Self {
        let mut b = Vec::with_capacity(root.len() + path.len() + 48);
        b.extend_from_slice(root.as_bytes());
        b.push(0);
        b.extend_from_slice(path.as_bytes());
        b.push(0);
        for x in [v.size, v.mtime_ns as u64, v.ctime_ns as u64, v.ino, v.dev] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        Key(xxh3_128(&b).to_le_bytes())
    }

    fn from_slice(b: &[u8]) -> Option<Self> {
        Some(Key(b.try_into().ok()?))
    }

    /// Lower-case hex, as used in data file names.
    pub fn hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(32);
        for b in self.0 {
            s.push(DIGITS[(b >> 4) as usize] as char);
            s.push(DIGITS[(b & 15) as usize] as char);
        }
        s
    }
}

/// Identity of a path regardless of version: xxh3-128 of (root, canonical path).
type PathKey = u128;

fn path_key(root: &str, path: &str) -> PathKey {
    let mut b = Vec::with_capacity(root.len() + path.len() + 1);
    b.extend_from_slice(root.as_bytes());
    b.push(0);
    b.extend_from_slice(path.as_bytes());
    xxh3_128(&b)
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.hex())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockMeta {
    len: u32,
    xxh3: u64,
    verified: bool,
}

#[derive(Debug)]
struct Entry {
    root: String,
    path: String,
    version: Version,
    block_size: u32,
    generation: u64,
    blocks: Vec<Option<BlockMeta>>,
    /// The data file exists and its `FileAdded` record is durable.
    durable: bool,
    bytes: u64,
    /// Fills in progress; such an entry is never evicted.
    filling: u32,
    /// Superseded by a newer version of the same path: evicted once no fill runs.
    doomed: bool,
}

fn nblocks(size: u64, bs: u32) -> usize {
    size.div_ceil(bs as u64) as usize
}

impl Entry {
    fn block_len(&self, i: usize) -> u32 {
        let start = i as u64 * self.block_size as u64;
        (self.version.size - start).min(self.block_size as u64) as u32
    }

    fn bitmap(&self) -> Vec<u8> {
        let mut bm = vec![0u8; self.blocks.len().div_ceil(8)];
        for (i, b) in self.blocks.iter().enumerate() {
            if b.is_some_and(|b| b.verified) {
                bm[i / 8] |= 1 << (i % 8);
            }
        }
        bm
    }
}

struct Index {
    files: HashMap<Key, Entry>,
    by_path: HashMap<PathKey, Key>,
    used: u64,
    reserved: u64,
    unverified: u64,
    policy: Box<dyn EvictionPolicy>,
    /// Files a reader is waiting on, not evictable until the instant given (see
    /// [`Store::pin`]).
    pins: HashMap<Key, Instant>,
    /// When `pins` may next be swept of expired entries.
    pins_swept: Instant,
}

/// Pins held at most at once (a bound on memory if readers vanish mid-wait).
const MAX_PINS: usize = 4096;

/// Most bytes the scrub ([`Store::verify_unverified`]) checks between two calls of its
/// pace.
pub const SCRUB_GROUP: u64 = 4 << 20;

/// Most bytes of unverified blocks one [`Store::view`] checks before it answers (at
/// least one block): about 20 ms of reading at 1.5 GB/s, well inside a client's open
/// timeout.
pub const VERIFY_PER_VIEW: u64 = 32 << 20;

/// A file that left the index and whose data file is still to be removed.
#[derive(Debug)]
struct Evicted {
    key: Key,
    generation: u64,
    bytes: u64,
}

/// Where the store lives and how much it may take.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// The cache directory (the store uses `shardcache-v1/` inside it).
    pub dir: PathBuf,
    /// Most bytes of cached data.
    pub capacity: SizeSpec,
    /// Free space to leave on the file system.
    pub min_free: SizeSpec,
    /// Block size for new entries.
    pub block_size: u32,
}

/// Errors of the store. Each one means "not cached", never a failed client read.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Nothing can be evicted to make room.
    #[error("no space in the cache (capacity or free-space floor reached, nothing evictable)")]
    NoSpace,
    /// The entry was evicted or superseded meanwhile.
    #[error("cache entry is gone")]
    Gone,
    /// Local I/O failed.
    #[error("cache I/O error: {0}")]
    Io(#[from] io::Error),
}

/// What a client may read of one file version right now.
#[derive(Debug)]
pub struct View {
    /// The entry's key.
    pub key: Key,
    /// Its block size.
    pub block_size: u32,
    /// Present-and-verified bitmap (bit `i` of byte `i / 8`).
    pub present: Vec<u8>,
    /// Number of blocks in the file.
    pub nblocks: usize,
    /// Number of present blocks.
    pub npresent: usize,
    /// A fresh read-only descriptor of the data file, when any block is present.
    pub data: Option<File>,
    /// The data file's generation (0 when there is none yet).
    pub data_gen: u64,
}

/// Permission to fill one block, with its space reserved.
#[derive(Debug)]
pub struct Permit {
    key: Key,
    index: usize,
    len: u32,
    offset: u64,
}

impl Permit {
    /// Offset of the block in the file.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Length of the block.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// True for a zero-length block (never issued: empty files have no blocks).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Result of checking checksums.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct VerifyReport {
    /// Blocks read and checked.
    pub checked: u64,
    /// Blocks whose bytes did not match their checksum (dropped).
    pub corrupt: u64,
    /// Entries whose data file had disappeared (dropped).
    pub missing_files: u64,
    /// Cached files with blocks to check.
    pub files: u64,
    /// Bytes of the blocks checked.
    pub bytes: u64,
}

/// How much of the current version of one path the cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// Size of the cached version.
    pub size: u64,
    /// Bytes of its blocks present in the cache.
    pub resident_bytes: u64,
}

/// One cached file, for listings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedEntry {
    /// The backing root's name.
    pub root: String,
    /// Canonical path under it.
    pub path: String,
    /// Residency of its current version.
    pub residency: Residency,
}

/// What an explicit eviction ([`Store::evict_matching`]) did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EvictOutcome {
    /// Files dropped that held bytes.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Matching files left in place because a fill of them is running.
    pub busy: u64,
}

/// Space and contents, for status.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreStatus {
    /// Capacity in bytes (resolved).
    pub capacity: u64,
    /// Bytes of present blocks.
    pub used: u64,
    /// Free bytes on the cache file system.
    pub fs_free: u64,
    /// Total size of the cache file system in bytes.
    pub fs_size: u64,
    /// Free-space floor in bytes (resolved).
    pub min_free: u64,
    /// Entries with at least one present block.
    pub files: u64,
    /// Present blocks.
    pub blocks: u64,
    /// Present blocks not yet verified since this start.
    pub unverified: u64,
}

/// The NVMe store.
pub struct Store {
    dir: PathBuf,
    data_dir: PathBuf,
    /// A descriptor of `data_dir`: data files are opened relative to it, which spares the
    /// kernel the walk of the whole cache path on every client open.
    data_fd: std::os::fd::OwnedFd,
    index: Mutex<Index>,
    journal: Journal,
    capacity: u64,
    min_free: u64,
    block_size: u32,
    next_generation: AtomicU64,
    create: Mutex<()>,
    /// The file system's free bytes, measured off the index lock.
    free: FreeSpace,
    stats: Arc<Stats>,
    _lock: File,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("capacity", &self.capacity)
            .finish()
    }
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

impl Store {
    /// Opens (or creates) the store, replays its journal and checks what it finds.
    pub fn open(cfg: &StoreConfig, stats: Arc<Stats>) -> io::Result<Self> {
        Self::open_with_policy(cfg, stats, Box::new(Lru::default()))
    }

    /// Like [`Store::open`], ordering evictions by `policy`.
    pub fn open_with_policy(
        cfg: &StoreConfig,
        stats: Arc<Stats>,
        policy: Box<dyn EvictionPolicy>,
    ) -> io::Result<Self> {
        let dir = cfg.dir.join("shardcache-v1");
        ensure_dir(&dir)?;
        // Private to the daemon: the journal names every cached file.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let data_dir = dir.join("data");
        ensure_dir(&data_dir)?;
        for i in 0..=255u8 {
            ensure_dir(&data_dir.join(format!("{i:02x}")))?;
        }
        journal::sync_dir(&data_dir)?;
        journal::sync_dir(&dir)?;

        let lock_path = dir.join("LOCK");
        journal::clear_unless_file(&lock_path)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&lock_path)?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
            |_| {
                io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!(
                        "{}: another shardcached is using this cache directory",
                        dir.display()
                    ),
                )
            },
        )?;

        // CLEAN says only how the last run ended (for the log): it vouches for no block.
        let clean_marker = dir.join("CLEAN");
        let clean = std::fs::symlink_metadata(&clean_marker).is_ok_and(|m| m.is_file());
        if let Err(e) = journal::remove_any(&clean_marker) {
            tracing::warn!(path = %clean_marker.display(), error = %e, "could not remove the CLEAN marker");
        }
        journal::sync_dir(&dir)?;

        let (fs_size, _) = fs_stats(&dir)?;
        let capacity = cfg.capacity.resolve(fs_size);
        let min_free = cfg.min_free.resolve(fs_size);

        let journal_path = dir.join("journal");
        let replayed = journal::replay(&journal_path);
        if let Some(damage) = &replayed.damage {
            inc(&stats.journal_recoveries);
            let kept = replayed.records.len();
            match journal::set_aside(&journal_path) {
                Ok(aside) => tracing::warn!(
                    kept,
                    "index journal damaged ({damage}): set aside as {}; kept the {kept} intact records before the damage (their blocks are checked before use), the rest is fetched again",
                    aside.display()
                ),
                Err(e) => tracing::warn!(
                    kept,
                    "index journal damaged ({damage}), and it could not be set aside ({e}): it is replaced; kept the {kept} intact records before the damage (their blocks are checked before use), the rest is fetched again"
                ),
            }
        }
        let mut files: HashMap<Key, Entry> = HashMap::default();
        for r in replayed.records {
            apply(&mut files, r);
        }
        let mut max_generation = 0;
        let mut dropped = 0;
        files.retain(|key, e| {
            max_generation = max_generation.max(e.generation);
            let ok = std::fs::symlink_metadata(data_path(&data_dir, key, e.generation))
                .is_ok_and(|m| m.is_file() && m.len() == e.version.size);
            if !ok {
                dropped += 1;
            }
            ok
        });
        remove_orphans(&data_dir, &files);

        let mut index = Index {
            files: HashMap::default(),
            by_path: HashMap::default(),
            used: 0,
            reserved: 0,
            unverified: 0,
            policy,
            pins: HashMap::default(),
            pins_swept: Instant::now(),
        };
        // No block is trusted for what a previous run did, however it ended: each is
        // checked against its checksum before it is first handed out (`view`, `begin_fill`,
        // `read_block_into`) or by the background scrub.
        for (key, mut e) in files {
            for b in e.blocks.iter_mut().flatten() {
                b.verified = false;
                index.unverified += 1;
                index.used += b.len as u64;
                e.bytes += b.len as u64;
            }
            index.policy.insert(key, &e.root, &e.path);
            index.by_path.insert(path_key(&e.root, &e.path), key);
            index.files.insert(key, e);
        }
        let journal = Journal::create(&journal_path, records_of(&index.files))?;
        tracing::info!(
            dir = %dir.display(),
            files = index.files.len(),
            used = index.used,
            capacity,
            unverified = index.unverified,
            previous_stop = if clean { "orderly" } else { "crash" },
            dropped,
            "store opened"
        );
        Ok(Self {
            free: FreeSpace::new(&dir)?,
            dir,
            data_fd: rustix::fs::open(
                &data_dir,
                rustix::fs::OFlags::PATH
                    | rustix::fs::OFlags::DIRECTORY
                    | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )?,
            data_dir,
            index: Mutex::new(index),
            journal,
            capacity,
            min_free,
            block_size: cfg.block_size,
            next_generation: AtomicU64::new((max_generation + 1).max(now_nanos())),
            create: Mutex::new(()),
            stats,
            _lock: lock,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a data file read-only (a fresh open file description each time, so that
    /// clients never share a file offset).
    fn open_data(&self, key: &Key, generation: u64) -> io::Result<File> {
        let rel = data_name(key, generation);
        let fd = rustix::fs::openat(
            &self.data_fd,
            rel.as_str(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC | rustix::fs::OFlags::NOFOLLOW,
            rustix::fs::Mode::empty(),
        )?;
        Ok(File::from(fd))
    }

    fn data_path(&self, key: &Key, generation: u64) -> PathBuf {
        data_path(&self.data_dir, key, generation)
    }

    /// Looks up (creating if needed) the entry for `stat` under `root`, checks its
    /// unverified blocks, and returns what a client may read now with a descriptor.
    /// An older version of the same path is retired.
    pub fn view(&self, root: &str, stat: &Stat) -> Result<View, StoreError> {
        let key = Key::of(root, &stat.path, &stat.version);
        let mut evicted = Vec::new();
        let to_verify = {
            let mut idx = self.lock();
            retire_other_versions(&mut idx, root, &stat.path, &key, &mut evicted);
            if !idx.files.contains_key(&key) {
                // Nothing cached: no entry is made until a fill starts, so opening files
                // that are never filled costs no memory.
                drop(idx);
                self.finish_evictions(evicted);
                let n = nblocks(stat.version.size, self.block_size);
                return Ok(View {
                    key,
                    block_size: self.block_size,
                    present: vec![0; n.div_ceil(8)],
                    nblocks: n,
                    npresent: 0,
                    data: None,
                    data_gen: 0,
                });
            }
            idx.policy.touch(key);
            let e = &idx.files[&key];
            // The first unverified blocks, up to VERIFY_PER_VIEW bytes (at least one):
            // a small file is checked whole at its open; a large one a part at a time,
            // in the order a sequential reader needs it, the rest by the fill workers
            // when a reader waits for it (`begin_fill`) and by the scrub.
            let mut budget = 0u64;
            let list: Vec<(usize, BlockMeta)> = e
                .blocks
                .iter()
                .enumerate()
                .filter_map(|(i, b)| b.filter(|b| !b.verified).map(|b| (i, b)))
                .take_while(|(_, b)| {
                    let go = budget < VERIFY_PER_VIEW;
                    budget += b.len as u64;
                    go
                })
                .collect();
            (e.generation, list)
        };
        self.finish_evictions(evicted);
        if !to_verify.1.is_empty() {
            self.verify_blocks(&key, to_verify.0, &to_verify.1);
        }
        // Open the data file before reading the bitmap: blocks are only ever added to a
        // data file, so everything the bitmap says is present is in this descriptor.
        for _ in 0..3 {
            let (generation, durable) = match self.lock().files.get(&key) {
                Some(e) => (e.generation, e.durable),
                None => return Err(StoreError::Gone),
            };
            let data = if durable {
                match self.open_data(&key, generation) {
                    Ok(f) => Some(f),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e.into()),
                }
            } else {
                None
            };
            let idx = self.lock();
            let Some(e) = idx.files.get(&key) else {
                return Err(StoreError::Gone);
            };
            if e.generation != generation {
                continue;
            }
            let npresent = e
                .blocks
                .iter()
                .filter(|b| b.is_some_and(|b| b.verified))
                .count();
            let data = if npresent > 0 { data } else { None };
            return Ok(View {
                key,
                block_size: e.block_size,
                present: e.bitmap(),
                nblocks: e.blocks.len(),
                npresent,
                data_gen: if data.is_some() { generation } else { 0 },
                data,
            });
        }
        Err(StoreError::Gone)
    }

    /// Files cached whole (every block present), least recently used first, as
    /// (root name, path, size).
    pub fn cached_files(&self) -> Vec<(String, String, u64)> {
        let idx = self.lock();
        idx.policy
            .order()
            .iter()
            .filter_map(|k| idx.files.get(k))
            .filter(|e| e.blocks.iter().all(Option::is_some))
            .map(|e| (e.root.clone(), e.path.clone(), e.version.size))
            .collect()
    }

    /// True when the current entry of `path` under `root` is cached whole.
    pub fn is_cached(&self, root: &str, path: &str) -> bool {
        let idx = self.lock();
        idx.by_path
            .get(&path_key(root, path))
            .and_then(|k| idx.files.get(k))
            .is_some_and(|e| e.blocks.iter().all(Option::is_some))
    }

    /// The residency of the current version of `path` under `root`, when any of it has an
    /// entry.
    pub fn residency(&self, root: &str, path: &str) -> Option<Residency> {
        let idx = self.lock();
        residency_locked(&idx, root, path)
    }

    /// [`Store::residency`] of many paths, taking the index lock once per few thousand
    /// (a listing of a large job must not hold up opens for long).
    pub fn residency_many(&self, files: &[(&str, &str)]) -> Vec<Option<Residency>> {
        let mut out = Vec::with_capacity(files.len());
        for chunk in files.chunks(4096) {
            let idx = self.lock();
            out.extend(chunk.iter().map(|(r, p)| residency_locked(&idx, r, p)));
        }
        out
    }

    /// Every current entry holding at least one block (superseded versions are left
    /// out), for listings. Costs a pass over the index.
    pub fn entries(&self) -> Vec<CachedEntry> {
        let idx = self.lock();
        idx.files
            .values()
            .filter(|e| e.bytes > 0 && !e.doomed)
            .map(|e| CachedEntry {
                root: e.root.clone(),
                path: e.path.clone(),
                residency: Residency {
                    size: e.version.size,
                    resident_bytes: e.bytes,
                },
            })
            .collect()
    }

    /// Drops every entry whose (root name, path) `matches` accepts, as eviction for room
    /// does: the index forgets it first, then its data file is unlinked, so that a
    /// reader holding a descriptor keeps reading the same bytes and every later open
    /// finds it uncached. Pins are overridden (an operator asked); entries with a fill
    /// running are left alone and counted as busy. `matches` runs under the index lock:
    /// it must not call back into the store or the planner.
    pub fn evict_matching(&self, matches: &dyn Fn(&str, &str) -> bool) -> EvictOutcome {
        let mut out = EvictOutcome::default();
        let mut evicted = Vec::new();
        {
            let mut idx = self.lock();
            let keys: Vec<Key> = idx
                .files
                .iter()
                .filter(|(_, e)| matches(&e.root, &e.path))
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                if idx.files.get(&k).is_some_and(|e| e.filling > 0) {
                    out.busy += 1;
                    continue;
                }
                idx.pins.remove(&k);
                if let Some(ev) = evict_locked(&mut idx, &k) {
                    if ev.bytes > 0 {
                        out.files += 1;
                        out.bytes += ev.bytes;
                    }
                    evicted.push(ev);
                }
            }
        }
        self.finish_evictions(evicted);
        out
    }

    /// Bytes that can be admitted without evicting anything.
    pub fn room(&self) -> u64 {
        let fs_free = self.free.get();
        let idx = self.lock();
        let by_capacity = self.capacity.saturating_sub(idx.used + idx.reserved);
        let by_floor = fs_free.saturating_sub(self.min_free + idx.reserved);
        by_capacity.min(by_floor)
    }

    /// The bytes of block `i` of `key` and their xxh3-64, checked against the checksum
    /// recorded when the block was written (a block that fails the check is dropped, as
    /// `verify` would, and `None` returned). For serving peers: they check again.
    pub fn read_block(&self, key: &Key, i: usize) -> Option<(Vec<u8>, u64)> {
        let mut buf = Vec::new();
        let sum = self.read_block_into(key, i, &mut buf)?;
        Some((buf, sum))
    }

    /// [`Store::read_block`] into `buf` (resized to the block's length; a buffer kept
    /// from one block to the next spares an allocation and its page faults per block).
    /// The checksum is computed piece by piece as the block is read, each piece still in
    /// the CPU's cache. `buf`'s contents are unspecified on `None`.
    pub fn read_block_into(&self, key: &Key, i: usize, buf: &mut Vec<u8>) -> Option<u64> {
        const PIECE: usize = 256 << 10;
        let (generation, bs, meta) = {
            let idx = self.lock();
            let e = idx.files.get(key)?;
            let meta = (*e.blocks.get(i)?)?;
            (e.generation, e.block_size, meta)
        };
        let f = self.open_data(key, generation).ok()?;
        // Every byte is overwritten by the reads below: only growth is zero-filled.
        buf.resize(meta.len as usize, 0);
        let base = i as u64 * bs as u64;
        let mut hash = BlockHasher::new();
        for (n, piece) in buf.chunks_mut(PIECE).enumerate() {
            f.read_exact_at(piece, base + (n * PIECE) as u64).ok()?;
            hash.update(piece);
        }
        let sum = hash.digest();
        if sum != meta.xxh3 {
            self.verify_blocks(key, generation, &[(i, meta)]);
            return None;
        }
        if !meta.verified {
            // Checked since this start: no need to read it again for a local reader.
            self.record_checks(key, generation, vec![(i, meta, true)]);
        }
        Some(sum)
    }

    /// Keeps `key` from being evicted until `until` (or [`Store::unpin`]): a reader was
    /// told the file is being filled and has not yet been handed a descriptor holding
    /// the blocks. Without it, a fill that completes could be evicted (the reader's file
    /// is, by then, the one needed farthest in the future) before the reader's reply,
    /// and the reader would fetch the same bytes again from the backing store. Pins
    /// expire on their own, so a reader that goes away costs nothing lasting.
    pub fn pin(&self, key: &Key, until: Instant) {
        let mut idx = self.lock();
        if idx.pins.len() >= MAX_PINS && !idx.pins.contains_key(key) {
            // Sweep expired pins, at most once per 100 ms (a full map of live pins
            // would otherwise cost a sweep per open).
            let now = Instant::now();
            if now < idx.pins_swept {
                return; // best effort: a pin only saves a refetch
            }
            idx.pins.retain(|_, u| *u > now);
            idx.pins_swept = now + std::time::Duration::from_millis(100);
            if idx.pins.len() >= MAX_PINS {
                return;
            }
        }
        let u = idx.pins.entry(*key).or_insert(until);
        *u = (*u).max(until);
    }

    /// Lets `key` be evicted again.
    pub fn unpin(&self, key: &Key) {
        self.lock().pins.remove(key);
    }

    /// True when block `i` of `key` is present and verified.
    pub fn is_present(&self, key: &Key, i: usize) -> bool {
        self.lock()
            .files
            .get(key)
            .and_then(|e| e.blocks.get(i).copied().flatten())
            .is_some_and(|b| b.verified)
    }

    /// Reserves space for block `i` of `key` (evicting if needed). `Ok(None)` when the
    /// block is already present.
    pub fn begin_fill(
        &self,
        root: &str,
        stat: &Stat,
        i: usize,
        prefetch: bool,
    ) -> Result<Option<Permit>, StoreError> {
        let key = &Key::of(root, &stat.path, &stat.version);
        // A block kept from before this start is checked now (on a fill worker, for a
        // reader waiting on it): if it holds, there is nothing to fill; if not, it is
        // dropped and filled below.
        let unverified = self.lock().files.get(key).and_then(|e| {
            let b = (*e.blocks.get(i)?)?;
            (!b.verified).then_some((e.generation, b))
        });
        if let Some((generation, meta)) = unverified {
            self.verify_blocks(key, generation, &[(i, meta)]);
        }
        let mut evicted = Vec::new();
        // Measured (when due) before the index lock is taken, never under it.
        let fs_free = self.free.get();
        let result = (|| {
            let mut idx = self.lock();
            if !idx.files.contains_key(key) {
                retire_other_versions(&mut idx, root, &stat.path, key, &mut evicted);
                let e = Entry {
                    root: root.to_owned(),
                    path: stat.path.clone(),
                    version: stat.version,
                    block_size: self.block_size,
                    generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
                    blocks: vec![None; nblocks(stat.version.size, self.block_size)],
                    durable: false,
                    bytes: 0,
                    filling: 0,
                    doomed: false,
                };
                idx.files.insert(*key, e);
                idx.policy.insert(*key, root, &stat.path);
                idx.by_path.insert(path_key(root, &stat.path), *key);
            }
            let e = idx.files.get(key).ok_or(StoreError::Gone)?;
            if e.doomed {
                return Err(StoreError::Gone);
            }
            match e.blocks.get(i) {
                None => return Err(StoreError::Gone),
                Some(Some(_)) => return Ok(None),
                Some(None) => {}
            }
            let len = e.block_len(i);
            let offset = i as u64 * e.block_size as u64;
            let mut freed = 0u64;
            loop {
                let wanted = idx.used + idx.reserved + len as u64;
                let over_cap = wanted > self.capacity;
                let short =
                    (self.min_free + idx.reserved + len as u64).saturating_sub(fs_free + freed);
                if !over_cap && short == 0 {
                    break;
                }
                let Index {
                    files,
                    policy,
                    pins,
                    ..
                } = &mut *idx;
                let now = Instant::now();
                let victim = policy.victim(&|k| {
                    k != key
                        && files.get(k).is_some_and(|e| e.filling == 0)
                        && pins.get(k).is_none_or(|until| *until <= now)
                });
                let Some(victim) = victim else {
                    inc(&self.stats.fills_no_space);
                    return Err(StoreError::NoSpace);
                };
                // The policy may let the cache go over its capacity instead (by a
                // bounded amount, for a bounded time), never past the free-space floor.
                if short == 0
                    && wanted <= self.capacity + policy.overcommit(root, &stat.path, &victim)
                {
                    tracing::debug!(path = %stat.path, over = wanted - self.capacity, "over capacity: the policy's overcommit");
                    break;
                }
                if !policy.admits(root, &stat.path, &victim, prefetch) {
                    // Everything cached is needed sooner than this file: bypass.
                    tracing::debug!(path = %stat.path, prefetch, "not admitted: everything cached is needed sooner");
                    inc(&self.stats.fills_no_space);
                    return Err(StoreError::NoSpace);
                }
                if let Some(e) = idx.files.get(&victim) {
                    tracing::debug!(dir = %self.dir.display(), path = %e.path, to_admit = %stat.path, prefetch, "evicting");
                }
                if let Some(ev) = evict_locked(&mut idx, &victim) {
                    freed += ev.bytes;
                    evicted.push(ev);
                }
            }
            idx.reserved += len as u64;
            idx.files.get_mut(key).expect("checked above").filling += 1;
            Ok(Some(Permit {
                key: *key,
                index: i,
                len,
                offset,
            }))
        })();
        if result.is_err() {
            // Do not keep an entry that a refused fill created and nothing fills.
            let mut idx = self.lock();
            if idx
                .files
                .get(key)
                .is_some_and(|e| e.filling == 0 && !e.durable)
            {
                evict_locked(&mut idx, key);
            }
        }
        self.finish_evictions(evicted);
        result
    }

    /// The cache's capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Makes the data file of `key` exist durably; returns its generation.
    fn ensure_durable(&self, key: &Key) -> Result<u64, StoreError> {
        let _g = self.create.lock().unwrap_or_else(|e| e.into_inner());
        let rec = {
            let idx = self.lock();
            let e = idx.files.get(key).ok_or(StoreError::Gone)?;
            if e.durable {
                return Ok(e.generation);
            }
            (e.generation, e.version.size, Record::file_added(key, e))
        };
        let (generation, size, rec) = rec;
        let path = self.data_path(key, generation);
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?;
        f.set_len(size)?;
        f.sync_all()?;
        journal::sync_dir(path.parent().expect("data files live in a subdirectory"))?;
        self.journal.append(&rec)?;
        let mut idx = self.lock();
        let e = idx.files.get_mut(key).ok_or(StoreError::Gone)?;
        e.durable = true;
        Ok(generation)
    }

    /// Writes a filled block durably and makes it visible. `data` must be exactly the
    /// block's bytes; its checksum is computed here.
    pub fn commit_fill(&self, permit: Permit, data: &[u8]) -> Result<(), StoreError> {
        self.commit_fill_summed(permit, data, block_xxh3(data))
    }

    /// [`Store::commit_fill`] of bytes whose xxh3-64 the caller already knows: a block
    /// from a peer, whose checksum the sender checked its bytes against and announced
    /// under the reply's MAC (see `peer::wire`). `xxh3` must be [`block_xxh3`] of
    /// `data`: a wrong one makes the block fail its next check (and be dropped then).
    pub fn commit_fill_summed(
        &self,
        permit: Permit,
        data: &[u8],
        xxh3: u64,
    ) -> Result<(), StoreError> {
        debug_assert_eq!(data.len(), permit.len as usize);
        let r = self.write_block(&permit, data, xxh3);
        self.release(&permit, r.as_ref().ok().copied());
        self.maybe_compact();
        r.map(|_| ())
    }

    /// Ends a fill: returns its reservation, records the block if it was `written`, and
    /// drops an entry that is superseded, or that nothing of ever reached the disk.
    fn release(&self, permit: &Permit, written: Option<BlockMeta>) {
        let mut evicted = Vec::new();
        {
            let mut guard = self.lock();
            let idx = &mut *guard;
            idx.reserved -= permit.len as u64;
            let Some(e) = idx.files.get_mut(&permit.key) else {
                return;
            };
            e.filling -= 1;
            if let Some(meta) = written {
                e.blocks[permit.index] = Some(meta);
                e.bytes += permit.len as u64;
                idx.used += permit.len as u64;
            }
            let (idle, durable, doomed) = (e.filling == 0, e.durable, e.doomed);
            if idle && !durable {
                evict_locked(idx, &permit.key);
            } else if idle && doomed {
                evicted.extend(evict_locked(idx, &permit.key));
            }
        }
        // Journal appends and unlinks happen outside the index lock.
        self.finish_evictions(evicted);
    }

    fn write_block(
        &self,
        permit: &Permit,
        data: &[u8],
        xxh3: u64,
    ) -> Result<BlockMeta, StoreError> {
        let generation = self.ensure_durable(&permit.key)?;
        let f = OpenOptions::new()
            .write(true)
            .open(self.data_path(&permit.key, generation))?;
        f.write_all_at(data, permit.offset)?;
        self.free.wrote(data.len() as u64);
        f.sync_data()?;
        let meta = BlockMeta {
            len: permit.len,
            xxh3,
            verified: true,
        };
        self.journal.append(&Record::block_added(
            &permit.key,
            generation,
            permit.index,
            &meta,
        ))?;
        Ok(meta)
    }

    /// Rewrites the journal from the index when it has grown well past what the cache
    /// holds. Called after appends, never under the index lock.
    fn maybe_compact(&self) {
        if self.journal.wants_compaction()
            && let Err(e) = self.journal.compact(|| records_of(&self.lock().files))
        {
            tracing::warn!(error = %e, "journal compaction failed; will retry");
        }
    }

    /// Gives back a permit whose fill failed.
    pub fn abort_fill(&self, permit: Permit) {
        self.release(&permit, None);
    }

    fn finish_evictions(&self, evicted: Vec<Evicted>) {
        for ev in evicted {
            let rec = Record::file_removed(&ev.key, ev.generation);
            if let Err(e) = self.journal.append(&rec) {
                tracing::warn!(error = %e, "journal append failed during eviction");
            }
            match std::fs::remove_file(self.data_path(&ev.key, ev.generation)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(error = %e, key = ?ev.key, "could not remove evicted data file")
                }
            }
            inc(&self.stats.evicted_files);
            add(&self.stats.evicted_bytes, ev.bytes);
            self.free.removed();
        }
    }

    /// Checks `blocks` of `key` (generation `generation`) against their checksums; drops the
    /// corrupt ones.
    fn verify_blocks(
        &self,
        key: &Key,
        generation: u64,
        blocks: &[(usize, BlockMeta)],
    ) -> VerifyReport {
        let Some(bs) = self.lock().files.get(key).map(|e| e.block_size) else {
            return VerifyReport::default();
        };
        let file = self.open_data(key, generation);
        let mut buf = vec![
            0u8;
            blocks
                .iter()
                .map(|(_, b)| b.len as usize)
                .max()
                .unwrap_or(0)
        ];
        let mut results = Vec::with_capacity(blocks.len());
        for &(i, meta) in blocks {
            let b = &mut buf[..meta.len as usize];
            let ok = match &file {
                Ok(f) => {
                    f.read_exact_at(b, i as u64 * bs as u64).is_ok() && block_xxh3(b) == meta.xxh3
                }
                Err(_) => false,
            };
            results.push((i, meta, ok));
        }
        self.record_checks(key, generation, results)
    }

    /// Records the outcome of checking blocks of `key` (generation `generation`): those
    /// that held become verified, the others are dropped (counted, logged, and their
    /// removal journaled). A block that changed meanwhile (refilled) is left alone.
    fn record_checks(
        &self,
        key: &Key,
        generation: u64,
        results: Vec<(usize, BlockMeta, bool)>,
    ) -> VerifyReport {
        let mut report = VerifyReport {
            checked: results.len() as u64,
            ..VerifyReport::default()
        };
        let mut removed = Vec::new();
        {
            let mut idx = self.lock();
            let idx = &mut *idx;
            let Some(e) = idx.files.get_mut(key) else {
                return report;
            };
            if e.generation != generation {
                return report;
            }
            for (i, meta, ok) in results {
                let Some(cur) = e.blocks[i] else { continue };
                if cur.len != meta.len || cur.xxh3 != meta.xxh3 {
                    continue;
                }
                if !cur.verified {
                    idx.unverified -= 1;
                }
                if ok {
                    e.blocks[i] = Some(BlockMeta {
                        verified: true,
                        ..cur
                    });
                } else {
                    e.blocks[i] = None;
                    e.bytes -= cur.len as u64;
                    idx.used -= cur.len as u64;
                    removed.push(i);
                }
            }
        }
        add(&self.stats.blocks_verified, report.checked);
        for i in removed {
            report.corrupt += 1;
            inc(&self.stats.corrupt_blocks);
            tracing::warn!(key = ?key, block = i, "cached block failed its checksum; dropped, will be refetched");
            if let Err(e) = self
                .journal
                .append(&Record::block_removed(key, generation, i))
            {
                tracing::warn!(error = %e, "journal append failed while dropping a corrupt block");
            }
        }
        report
    }

    /// Re-checks the checksum of every present block.
    pub fn verify_all(&self) -> VerifyReport {
        self.verify_where(false, &mut |_| true)
    }

    /// Checks the blocks not yet verified since this start (the background scrub). After
    /// each group of blocks (at most [`SCRUB_GROUP`] bytes) `pace` is told the bytes just
    /// read, and may sleep to hold a rate; it returns false to stop.
    pub fn verify_unverified(&self, pace: &mut dyn FnMut(u64) -> bool) -> VerifyReport {
        self.verify_where(true, pace)
    }

    fn verify_where(
        &self,
        only_unverified: bool,
        pace: &mut dyn FnMut(u64) -> bool,
    ) -> VerifyReport {
        type Snapshot = (Key, u64, bool, Vec<(usize, BlockMeta)>);
        let entries: Vec<Snapshot> = self
            .lock()
            .files
            .iter()
            .map(|(k, e)| {
                let blocks = e
                    .blocks
                    .iter()
                    .enumerate()
                    .filter_map(|(i, b)| {
                        b.filter(|b| !only_unverified || !b.verified)
                            .map(|b| (i, b))
                    })
                    .collect();
                (*k, e.generation, e.durable, blocks)
            })
            .collect();
        let mut total = VerifyReport::default();
        'files: for (key, generation, durable, blocks) in entries {
            if blocks.is_empty() {
                continue;
            }
            if durable && !self.data_path(&key, generation).exists() {
                total.missing_files += 1;
            }
            total.files += 1;
            let mut group = Vec::new();
            let mut group_bytes = 0u64;
            let last = blocks.len() - 1;
            for (n, b) in blocks.into_iter().enumerate() {
                group_bytes += b.1.len as u64;
                group.push(b);
                if group_bytes < SCRUB_GROUP && n < last {
                    continue;
                }
                // What was checked since the snapshot (by a reader's view, a fill
                // worker or a peer's request) is not read again.
                if only_unverified {
                    let idx = self.lock();
                    let still = |(i, m): &(usize, BlockMeta)| {
                        idx.files
                            .get(&key)
                            .filter(|e| e.generation == generation)
                            .and_then(|e| e.blocks[*i])
                            .is_some_and(|b| !b.verified && b.xxh3 == m.xxh3)
                    };
                    group.retain(still);
                }
                let bytes: u64 = group.iter().map(|(_, b)| b.len as u64).sum();
                let r = self.verify_blocks(&key, generation, &group);
                total.bytes += bytes;
                total.checked += r.checked;
                total.corrupt += r.corrupt;
                group.clear();
                group_bytes = 0;
                if !pace(bytes) {
                    break 'files;
                }
            }
        }
        total
    }

    /// Space and contents.
    pub fn status(&self) -> StoreStatus {
        let (fs_size, fs_free) = fs_stats(&self.dir).unwrap_or((0, 0));
        let idx = self.lock();
        let mut s = StoreStatus {
            capacity: self.capacity,
            used: idx.used,
            fs_free,
            fs_size,
            min_free: self.min_free,
            unverified: idx.unverified,
            ..Default::default()
        };
        for e in idx.files.values() {
            let n = e.blocks.iter().filter(|b| b.is_some()).count() as u64;
            if n > 0 {
                s.files += 1;
                s.blocks += n;
            }
        }
        s
    }

    /// Default block size of new entries.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Flushes the journal and marks the shutdown orderly (`CLEAN`, which the next start
    /// only logs: no start trusts a block it did not check). Call once, after every fill
    /// has finished.
    pub fn close(&self) -> io::Result<()> {
        self.journal.close();
        let marker = self.dir.join("CLEAN");
        journal::clear_unless_file(&marker)?;
        File::create(&marker)?.sync_all()?;
        journal::sync_dir(&self.dir)
    }
}

/// `<xx>/<key>.<generation>`, built without the formatting machinery (this is on the
/// path of every client open).
fn data_name(key: &Key, generation: u64) -> String {
    let hex = key.hex();
    let mut s = String::with_capacity(56);
    s.push_str(&hex[..2]);
    s.push('/');
    s.push_str(&hex);
    s.push('.');
    let mut digits = [0u8; 20];
    let mut n = generation;
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    s.extend(digits[i..].iter().map(|&d| d as char));
    s
}

fn data_path(data_dir: &Path, key: &Key, generation: u64) -> PathBuf {
    data_dir.join(data_name(key, generation))
}

/// The journal records that rebuild `files` (durable entries and their present blocks).
fn records_of(files: &HashMap<Key, Entry>) -> Vec<jpb::Record> {
    let mut records = Vec::with_capacity(files.len() * 2);
    for (key, e) in files.iter().filter(|(_, e)| e.durable) {
        records.push(Record::file_added(key, e));
        for (i, b) in e.blocks.iter().enumerate() {
            if let Some(b) = b {
                records.push(Record::block_added(key, e.generation, i, b));
            }
        }
    }
    records
}

/// Retires any other version of (`root`, `path`) than `key`: it is evicted now, or
/// once its running fills end.
fn retire_other_versions(
    idx: &mut Index,
    root: &str,
    path: &str,
    key: &Key,
    evicted: &mut Vec<Evicted>,
) {
    let pkey = path_key(root, path);
    if let Some(old) = idx.by_path.get(&pkey).copied()
        && old != *key
    {
        idx.by_path.remove(&pkey);
        if let Some(e) = idx.files.get_mut(&old) {
            e.doomed = true;
            if e.filling == 0 {
                evicted.extend(evict_locked(idx, &old));
            }
        }
    }
}

fn residency_locked(idx: &Index, root: &str, path: &str) -> Option<Residency> {
    let e = idx.files.get(idx.by_path.get(&path_key(root, path))?)?;
    Some(Residency {
        size: e.version.size,
        resident_bytes: e.bytes,
    })
}

fn evict_locked(idx: &mut Index, key: &Key) -> Option<Evicted> {
    let e = idx.files.remove(key)?;
    idx.policy.remove(key);
    let pkey = path_key(&e.root, &e.path);
    if idx.by_path.get(&pkey) == Some(key) {
        idx.by_path.remove(&pkey);
    }
    idx.used -= e.bytes;
    idx.unverified -= e
        .blocks
        .iter()
        .filter(|b| b.is_some_and(|b| !b.verified))
        .count() as u64;
    Some(Evicted {
        key: *key,
        generation: e.generation,
        bytes: e.bytes,
    })
}

/// Removes everything under `data_dir` that is not the data file of an entry of `files`:
/// data files no durable record names (a crash between creating one and recording it,
/// or a journal that was lost) and anything that is not ours (directories, links,
/// special files). Only the 256 subdirectories are looked into, and links are never
/// followed: nothing outside the store is touched.
fn remove_orphans(data_dir: &Path, files: &HashMap<Key, Entry>) {
    let keep: std::collections::HashSet<String> = files
        .iter()
        .map(|(k, e)| format!("{}.{}", k.hex(), e.generation))
        .collect();
    let mut removed = 0u64;
    for i in 0..=255u8 {
        let sub = data_dir.join(format!("{i:02x}"));
        let Ok(ents) = std::fs::read_dir(&sub) else {
            continue;
        };
        for ent in ents.flatten() {
            let regular = ent.file_type().is_ok_and(|t| t.is_file());
            if regular && keep.contains(ent.file_name().to_string_lossy().as_ref()) {
                continue;
            }
            tracing::debug!(file = %ent.path().display(), regular, "removing an orphaned data file");
            match journal::remove_any(&ent.path()) {
                Ok(()) => removed += 1,
                Err(e) => {
                    tracing::warn!(path = %ent.path().display(), error = %e, "could not remove an orphaned data file")
                }
            }
        }
    }
    if removed > 0 {
        tracing::info!(removed, "orphaned data files removed");
    }
}

/// Makes `path` a real directory (not a link to one): whatever else is there is removed
/// first. For the store's own directories.
fn ensure_dir(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => {
            tracing::warn!(path = %path.display(), "not a directory in the cache: replaced by one");
            journal::remove_any(path)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(path)
}

/// Applies one replayed journal record.
fn apply(files: &mut HashMap<Key, Entry>, r: jpb::Record) {
    match r.kind {
        Some(Kind::FileAdded(f)) => {
            let (Some(key), Some(v)) = (Key::from_slice(&f.key), f.version) else {
                return;
            };
            if f.block_size == 0 {
                return;
            }
            let version = Version {
                size: v.size,
                mtime_ns: v.mtime_ns,
                ctime_ns: v.ctime_ns,
                ino: v.ino,
                dev: v.dev,
            };
            files.insert(
                key,
                Entry {
                    root: f.root,
                    path: f.path,
                    version,
                    block_size: f.block_size,
                    generation: f.generation,
                    blocks: vec![None; nblocks(version.size, f.block_size)],
                    durable: true,
                    bytes: 0,
                    filling: 0,
                    doomed: false,
                },
            );
        }
        Some(Kind::BlockAdded(b)) => {
            let Some(key) = Key::from_slice(&b.key) else {
                return;
            };
            if let Some(e) = files.get_mut(&key).filter(|e| e.generation == b.generation) {
                let i = b.index as usize;
                if i < e.blocks.len() && e.block_len(i) == b.len {
                    e.blocks[i] = Some(BlockMeta {
                        len: b.len,
                        xxh3: b.xxh3,
                        verified: false,
                    });
                }
            }
        }
        Some(Kind::BlockRemoved(b)) => {
            let Some(key) = Key::from_slice(&b.key) else {
                return;
            };
            if let Some(e) = files.get_mut(&key).filter(|e| e.generation == b.generation)
                && let Some(slot) = e.blocks.get_mut(b.index as usize)
            {
                *slot = None;
            }
        }
        Some(Kind::FileRemoved(f)) => {
            let Some(key) = Key::from_slice(&f.key) else {
                return;
            };
            if files
                .get(&key)
                .is_some_and(|e| e.generation == f.generation)
            {
                files.remove(&key);
            }
        }
        None => {}
    }
}

/// Constructors of journal records.
struct Record;

impl Record {
    fn file_added(key: &Key, e: &Entry) -> jpb::Record {
        let v = e.version;
        jpb::Record {
            kind: Some(Kind::FileAdded(jpb::FileAdded {
                key: key.0.to_vec(),
                root: e.root.clone(),
                path: e.path.clone(),
                version: Some(jpb::Version {
                    size: v.size,
                    mtime_ns: v.mtime_ns,
                    ctime_ns: v.ctime_ns,
                    ino: v.ino,
                    dev: v.dev,
                }),
                block_size: e.block_size,
                generation: e.generation,
            })),
        }
    }

    fn block_added(key: &Key, generation: u64, i: usize, b: &BlockMeta) -> jpb::Record {
        jpb::Record {
            kind: Some(Kind::BlockAdded(jpb::BlockAdded {
                key: key.0.to_vec(),
                index: i as u64,
                len: b.len,
                xxh3: b.xxh3,
                generation,
            })),
        }
    }

    fn block_removed(key: &Key, generation: u64, i: usize) -> jpb::Record {
        jpb::Record {
            kind: Some(Kind::BlockRemoved(jpb::BlockRemoved {
                key: key.0.to_vec(),
                index: i as u64,
                generation,
            })),
        }
    }

    fn file_removed(key: &Key, generation: u64) -> jpb::Record {
        jpb::Record {
            kind: Some(Kind::FileRemoved(jpb::FileRemoved {
                key: key.0.to_vec(),
                generation,
            })),
        }
    }
}

#[cfg(test)]
mod tests;
