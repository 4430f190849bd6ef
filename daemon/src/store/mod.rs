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
//!
//! ## Files
//! This file is the facade: [`Store`] and what it hands out ([`View`], [`Permit`],
//! [`StoreStatus`]), looking up and creating entries, the fill protocol
//! ([`Store::begin_fill`] → [`Store::commit_fill`] / [`Store::commit_fills`] /
//! [`Store::abort_fill`]), explicit eviction, status. The roles it leans on:
//! `key.rs` (names), `index.rs` (entries, blocks, counts; no I/O, under the lock),
//! `space.rs` (capacity, the free-space floor, the sampled `statvfs`), `room.rs` (the
//! loop that evicts, in the policy's order, until a block fits), `pins.rs`
//! (readers' pins), [`journal`] (the log and its group commit), `records.rs` (journal
//! records ↔ index), `recover.rs` (what a start does), `verify.rs` (checks and the
//! scrub), [`evict`] (the policy seam and LRU), [`io`] (the I/O engine every write,
//! sync and check of a data file goes through: psync or io_uring). The facade opens
//! data files itself only for clients ([`View::data`]: a fresh read-only descriptor).

pub mod evict;
mod index;
pub mod io;
pub mod journal;
mod key;
mod pins;
mod records;
mod recover;
mod room;
mod space;
mod verify;

use std::fmt;
use std::fs::File;
use std::io as stdio;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use std::time::Instant;

use crate::backing::Stat;
use crate::checksum::block_xxh3;
use crate::config::SizeSpec;
use crate::stats::{Stats, add, inc};
use evict::{EvictionPolicy, Lru};
use index::{
    BlockMeta, Entry, Evicted, Index, PolicyEvent, evict_locked, nblocks, residency_locked,
    retire_other_versions,
};
use io::{BlockIo, IoEngine};
use journal::Journal;
use key::{data_name, path_key};
use records::{Record, records_of};
use space::Space;

pub use key::Key;
pub use pins::MAX_PINS;
pub use verify::{SCRUB_GROUP, VERIFY_PER_VIEW, VerifyReport};

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
    Io(#[from] stdio::Error),
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
    /// A descriptor of the data directory: data files are opened relative to it, which spares the
    /// kernel the walk of the whole cache path on every client open.
    data_fd: std::os::fd::OwnedFd,
    /// The engine of every write and check of a data file (see [`io`]).
    io: Arc<dyn BlockIo>,
    index: Mutex<Index>,
    /// The eviction policy, behind a lock of its own, taken before the index lock and
    /// never under it (see [`Store::with_policy`]).
    policy: Mutex<Box<dyn EvictionPolicy>>,
    journal: Journal,
    space: Space,
    block_size: u32,
    next_generation: AtomicU64,
    /// Serialises the first landing of a file (its creation) with other landings of the
    /// same file, one lock per stripe of keys: files are created side by side.
    create: Box<[Mutex<()>]>,
    stats: Arc<Stats>,
    _lock: File,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("capacity", &self.space.capacity)
            .finish()
    }
}

impl Store {
    /// Opens (or creates) the store, replays its journal and checks what it finds.
    pub fn open(cfg: &StoreConfig, stats: Arc<Stats>) -> stdio::Result<Self> {
        Self::open_with_policy(cfg, stats, Box::new(Lru::default()))
    }

    /// Like [`Store::open`], ordering evictions by `policy`.
    pub fn open_with_policy(
        cfg: &StoreConfig,
        stats: Arc<Stats>,
        policy: Box<dyn EvictionPolicy>,
    ) -> stdio::Result<Self> {
        Self::open_with(cfg, stats, policy, &|dir| io::open(IoEngine::Auto, dir))
    }

    /// Like [`Store::open_with_policy`], on the I/O engine `engine` makes over the data
    /// directory (`|dir| store::io::open(choice, dir)`, or a wrapped one in tests).
    pub fn open_with(
        cfg: &StoreConfig,
        stats: Arc<Stats>,
        policy: Box<dyn EvictionPolicy>,
        engine: &dyn Fn(&std::path::Path) -> stdio::Result<Arc<dyn BlockIo>>,
    ) -> stdio::Result<Self> {
        Self::recover(cfg, stats, policy, engine)
    }

    /// The I/O engine that runs (`psync`, `uring`).
    pub fn io_engine(&self) -> &'static str {
        self.io.engine()
    }

    /// Syncs the store's engine made of data files, their directories and the file
    /// system ([`io::BlockIo::syncs`]; the journal's are its own).
    pub fn data_syncs(&self) -> u64 {
        self.io.syncs()
    }

    fn lock(&self) -> IndexGuard<'_> {
        IndexGuard {
            guard: Some(self.index.lock()),
            store: self,
        }
    }

    /// Runs `f` on the eviction policy, locked, having told it everything the index
    /// logged for it ([`index::PolicyEvent`]), and tells it what was logged meanwhile
    /// before letting go. Lock order: this lock, then the index lock (briefly, to take
    /// the log), then whatever the policy takes (the planner's); no index lock holder
    /// ever waits for this one (see [`IndexGuard`]), so a policy's slow look holds up
    /// the fills that need victims, never an open.
    fn with_policy<R>(&self, f: impl FnOnce(&mut dyn EvictionPolicy) -> R) -> R {
        let mut p = self.policy.lock();
        let log = std::mem::take(&mut self.index.lock().policy_log);
        tell(&mut **p, log);
        let r = f(&mut **p);
        let log = std::mem::take(&mut self.index.lock().policy_log);
        tell(&mut **p, log);
        r
    }

    /// Opens a data file read-only (a fresh open file description each time, so that
    /// clients never share a file offset).
    fn open_data(&self, key: &Key, generation: u64) -> stdio::Result<File> {
        let rel = data_name(key, generation);
        let fd = rustix::fs::openat(
            &self.data_fd,
            rel.as_str(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC | rustix::fs::OFlags::NOFOLLOW,
            rustix::fs::Mode::empty(),
        )?;
        Ok(File::from(fd))
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
                return Ok(self.uncached_view(key, stat));
            }
            idx.policy_log.push(PolicyEvent::Touch(key));
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
            // An entry evicted since the first look (for room, or by an operator, while
            // its blocks were checked) is simply not cached any more.
            let (generation, durable) = match self.lock().files.get(&key) {
                Some(e) => (e.generation, e.durable),
                None => return Ok(self.uncached_view(key, stat)),
            };
            let data = if durable {
                match self.open_data(&key, generation) {
                    Ok(f) => Some(f),
                    Err(e) if e.kind() == stdio::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e.into()),
                }
            } else {
                None
            };
            let idx = self.lock();
            let Some(e) = idx.files.get(&key) else {
                drop(idx);
                return Ok(self.uncached_view(key, stat));
            };
            // A file that turned durable since the first look (its landing finished in
            // between) may now have blocks present that the descriptor-less view above
            // cannot serve: look again.
            if e.generation != generation || e.durable != durable {
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

    /// The view of a file version with nothing cached.
    fn uncached_view(&self, key: Key, stat: &Stat) -> View {
        let n = nblocks(stat.version.size, self.block_size);
        View {
            key,
            block_size: self.block_size,
            present: vec![0; n.div_ceil(8)],
            nblocks: n,
            npresent: 0,
            data: None,
            data_gen: 0,
        }
    }

    /// Files cached whole (every block present), least recently used first, as
    /// (root name, path, size).
    pub fn cached_files(&self) -> Vec<(String, String, u64)> {
        let order = self.with_policy(|p| p.order());
        let idx = self.lock();
        order
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
                idx.pins.unpin(&k);
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
        let Ok(sample) = self.space.sample_due() else {
            return 0;
        };
        let mut idx = self.lock();
        let used = idx.used;
        idx.fs.update(sample, used);
        let fs_free = idx.fs.free_now(used);
        let by_capacity = self.space.capacity.saturating_sub(idx.used + idx.reserved);
        let by_floor = fs_free.saturating_sub(self.space.min_free + idx.reserved);
        by_capacity.min(by_floor)
    }

    /// Keeps `key` from being evicted until `until` (or [`Store::unpin`]): a reader was
    /// told the file is being filled and has not yet been handed a descriptor holding
    /// the blocks (see `pins.rs`).
    pub fn pin(&self, key: &Key, until: Instant) {
        self.lock().pins.pin(key, until);
    }

    /// Lets `key` be evicted again.
    pub fn unpin(&self, key: &Key) {
        self.lock().pins.unpin(key);
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
        let mut making = room::Making::default();
        let result = loop {
            // The file system is asked (when the last sample is stale) before the lock.
            let sample = match self.space.sample_due() {
                Ok(s) => s,
                Err(e) => break Err(e.into()),
            };
            let mut idx = self.lock();
            let used = idx.used;
            idx.fs.update(sample, used);
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
                idx.policy_log.push(PolicyEvent::Insert(
                    *key,
                    root.to_owned(),
                    stat.path.clone(),
                ));
                idx.by_path.insert(path_key(root, &stat.path), *key);
            }
            let Some(e) = idx.files.get(key) else {
                break Err(StoreError::Gone);
            };
            if e.doomed {
                break Err(StoreError::Gone);
            }
            match e.blocks.get(i) {
                None => break Err(StoreError::Gone),
                Some(Some(_)) => break Ok(None),
                Some(None) => {}
            }
            let len = e.block_len(i);
            let offset = i as u64 * e.block_size as u64;
            let wanted = room::Wanted {
                key,
                root,
                path: &stat.path,
                len: len as u64,
                prefetch,
                dir: &self.dir,
            };
            match room::make_room(
                &mut idx,
                &self.space,
                &self.stats,
                &wanted,
                &mut making,
                &mut evicted,
            ) {
                Ok(room::Made::Room) => {}
                Ok(room::Made::Look) => {
                    // Victims are chosen without the index lock (see `room`).
                    drop(idx);
                    if making.looks < room::MAX_LOOKS
                        && self.with_policy(|p| room::choose(p, &wanted, &mut making))
                    {
                        continue;
                    }
                    inc(&self.stats.fills_no_space);
                    break Err(StoreError::NoSpace);
                }
                Err(e) => break Err(e),
            }
            idx.reserved += len as u64;
            idx.files.get_mut(key).expect("checked above").filling += 1;
            break Ok(Some(Permit {
                key: *key,
                index: i,
                len,
                offset,
            }));
        };
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
        self.space.capacity
    }

    /// Writes `blocks` of one file version (offset, bytes, checksum, index, length) to
    /// its data file durably, then records them in one journal group: the file itself
    /// too, when this is its first landing (the data file is created, written and synced
    /// with them; landings of the same file wait for it, others run side by side).
    /// Returns the blocks' records.
    fn land(
        &self,
        key: &Key,
        blocks: &[(&Permit, &[u8], u64)],
    ) -> Result<Vec<BlockMeta>, StoreError> {
        let stripe = &self.create[stripe_of(key, self.create.len())];
        let first = stripe.lock();
        let (generation, durable, size, file_rec) = {
            let idx = self.lock();
            let e = idx.files.get(key).ok_or(StoreError::Gone)?;
            (
                e.generation,
                e.durable,
                e.version.size,
                (!e.durable).then(|| Record::file_added(key, e)),
            )
        };
        if durable {
            drop(first);
        }
        let name = data_name(key, generation);
        let writes: Vec<io::Write<'_>> = blocks.iter().map(|(p, d, _)| (p.offset, *d)).collect();
        let written = if durable {
            // The bytes and an fdatasync, in one submission where the engine can.
            self.io.write_durable(&name, &writes)
        } else {
            // Created and written, then synced once with its directory (not a sync
            // of the empty file, one of the directory and one of the bytes).
            let new = io::NewFile {
                name: &name,
                size,
                writes: &writes,
            };
            let mut r = self.io.create_written(std::slice::from_ref(&new));
            r.pop().expect("one result per file")
        };
        if let Err(e) = written {
            if !durable {
                // Created by this landing and recorded nowhere: not left behind.
                let _ = self.io.remove(&name);
            }
            return Err(e.into());
        }
        let metas: Vec<BlockMeta> = blocks
            .iter()
            .map(|(p, _, xxh3)| BlockMeta {
                len: p.len,
                xxh3: *xxh3,
                verified: true,
            })
            .collect();
        let records: Vec<_> = file_rec
            .into_iter()
            .chain(
                blocks
                    .iter()
                    .zip(&metas)
                    .map(|((p, _, _), m)| Record::block_added(key, generation, p.index, m)),
            )
            .collect();
        if let Err(e) = self.journal.append_all(&records) {
            if !durable {
                let _ = self.io.remove(&name);
            }
            return Err(e.into());
        }
        if !durable {
            self.lock()
                .files
                .get_mut(key)
                .ok_or(StoreError::Gone)?
                .durable = true;
        }
        Ok(metas)
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

    /// Writes several filled blocks of one file version durably as one batch — their
    /// bytes and one `fdatasync` (with io_uring, one submission), then their journal
    /// records in one group — and makes them visible. Each `data` must be exactly its
    /// permit's block. On an error none of them is made visible (some may be written: they
    /// stay invisible, and a later fill writes them again) and every permit is given
    /// back; permits of different files are refused (`Gone`) before anything is written.
    pub fn commit_fills(&self, blocks: Vec<(Permit, &[u8])>) -> Result<(), StoreError> {
        let r = self.write_blocks(&blocks);
        for (n, (permit, _)) in blocks.iter().enumerate() {
            self.release(permit, r.as_ref().ok().map(|metas| metas[n]));
        }
        self.maybe_compact();
        r.map(|_| ())
    }

    /// Writes the blocks of several files durably as one batch and makes them visible:
    /// the files new to the disk (small files, one block each, mostly) are created and
    /// written together with their syncs shared ([`io::BlockIo::create_written`]), and all
    /// their journal records go in one group — about one commit of the file system and
    /// one of the journal for the batch, where landing them one by one costs three and
    /// one per file. Each `data` must be exactly its permit's block. One result per
    /// block, in order: a file that fails is not made visible (its data file removed)
    /// and the others land; a failed journal write fails them all. Blocks of a file
    /// already on disk, and a second block of one file, land one by one
    /// ([`Store::commit_fill`]).
    pub fn commit_new_files(&self, blocks: Vec<(Permit, &[u8])>) -> Vec<Result<(), StoreError>> {
        let n = blocks.len();
        let mut results: Vec<Option<Result<BlockMeta, StoreError>>> =
            (0..n).map(|_| None).collect();
        // The creation stripes of every file, taken in order (one lander holds several:
        // sorted, so that two never wait on each other), held until the batch is durable
        // or given up: landings of the same files wait for them, as in `land`.
        let mut stripes: Vec<usize> = blocks
            .iter()
            .map(|(p, _)| stripe_of(&p.key, self.create.len()))
            .collect();
        stripes.sort_unstable();
        stripes.dedup();
        let guards: Vec<_> = stripes.iter().map(|&i| self.create[i].lock()).collect();
        // (position, name, size, generation, record of the file, checksum)
        let mut new: Vec<(usize, String, u64, u64, _, u64)> = Vec::new();
        let mut alone: Vec<usize> = Vec::new();
        {
            let idx = self.lock();
            let mut seen = std::collections::HashSet::new();
            for (pos, (p, d)) in blocks.iter().enumerate() {
                if d.len() != p.len as usize {
                    results[pos] = Some(Err(StoreError::Gone));
                    continue;
                }
                let Some(e) = idx.files.get(&p.key) else {
                    results[pos] = Some(Err(StoreError::Gone));
                    continue;
                };
                if e.durable || !seen.insert(p.key) {
                    alone.push(pos);
                    continue;
                }
                new.push((
                    pos,
                    data_name(&p.key, e.generation),
                    e.version.size,
                    e.generation,
                    Record::file_added(&p.key, e),
                    block_xxh3(d),
                ));
            }
        }
        let writes: Vec<[io::Write<'_>; 1]> = new
            .iter()
            .map(|(pos, ..)| [(blocks[*pos].0.offset, blocks[*pos].1)])
            .collect();
        let files: Vec<io::NewFile<'_>> = new
            .iter()
            .zip(&writes)
            .map(|((_, name, size, ..), w)| io::NewFile {
                name,
                size: *size,
                writes: w,
            })
            .collect();
        let written = self.io.create_written(&files);
        let mut records = Vec::new();
        let mut landed = Vec::new();
        for ((pos, name, _, generation, file_rec, xxh3), w) in new.into_iter().zip(written) {
            let p = &blocks[pos].0;
            match w {
                Ok(()) => {
                    let meta = BlockMeta {
                        len: p.len,
                        xxh3,
                        verified: true,
                    };
                    records.push(file_rec);
                    records.push(Record::block_added(&p.key, generation, p.index, &meta));
                    landed.push((pos, name, meta));
                }
                Err(e) => {
                    // Created by this landing and recorded nowhere: not left behind.
                    let _ = self.io.remove(&name);
                    results[pos] = Some(Err(e.into()));
                }
            }
        }
        if !landed.is_empty() {
            match self.journal.append_all(&records) {
                Ok(()) => {
                    let mut idx = self.lock();
                    for (pos, _, meta) in landed {
                        results[pos] = Some(match idx.files.get_mut(&blocks[pos].0.key) {
                            Some(e) => {
                                e.durable = true;
                                Ok(meta)
                            }
                            None => Err(StoreError::Gone),
                        });
                    }
                }
                Err(e) => {
                    for (pos, name, _) in landed {
                        let _ = self.io.remove(&name);
                        results[pos] = Some(Err(stdio::Error::new(e.kind(), e.to_string()).into()));
                    }
                }
            }
        }
        drop(guards);
        for pos in alone {
            let (p, d) = &blocks[pos];
            results[pos] = Some(self.write_block(p, d, block_xxh3(d)));
        }
        let results: Vec<Result<BlockMeta, StoreError>> = results
            .into_iter()
            .map(|r| r.unwrap_or(Err(StoreError::Gone)))
            .collect();
        for ((permit, _), r) in blocks.iter().zip(&results) {
            self.release(permit, r.as_ref().ok().copied());
        }
        self.maybe_compact();
        results.into_iter().map(|r| r.map(|_| ())).collect()
    }

    fn write_blocks(&self, blocks: &[(Permit, &[u8])]) -> Result<Vec<BlockMeta>, StoreError> {
        let Some((first, _)) = blocks.first() else {
            return Ok(Vec::new());
        };
        let key = first.key;
        if blocks
            .iter()
            .any(|(p, d)| p.key != key || d.len() != p.len as usize)
        {
            return Err(StoreError::Gone);
        }
        let summed: Vec<(&Permit, &[u8], u64)> =
            blocks.iter().map(|(p, d)| (p, *d, block_xxh3(d))).collect();
        self.land(&key, &summed)
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
                if e.blocks[permit.index].replace(meta).is_none() {
                    idx.blocks += 1;
                    // Its first present block (none of its bytes yet): the file counts
                    // from now on.
                    idx.files_present += u64::from(e.bytes == 0);
                }
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
        let mut metas = self.land(&permit.key, &[(permit, data, xxh3)])?;
        metas.pop().ok_or(StoreError::Gone)
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
        if evicted.is_empty() {
            return;
        }
        // Every removal's record in one journal group (one wait for its `fdatasync`, not
        // one per file: a fill that makes room for several files waited out several),
        // durable before any data file goes.
        let records: Vec<_> = evicted
            .iter()
            .map(|ev| Record::file_removed(&ev.key, ev.generation))
            .collect();
        if let Err(e) = self.journal.append_all(&records) {
            tracing::warn!(error = %e, files = records.len(), "journal append failed during eviction");
        }
        for ev in evicted {
            match self.io.remove(&data_name(&ev.key, ev.generation)) {
                Ok(()) => {}
                Err(e) if e.kind() == stdio::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(error = %e, key = ?ev.key, "could not remove evicted data file")
                }
            }
            inc(&self.stats.evicted_files);
            add(&self.stats.evicted_bytes, ev.bytes);
        }
    }

    /// Space and contents.
    pub fn status(&self) -> StoreStatus {
        let (fs_size, fs_free) = self.space.fs_stats().unwrap_or((0, 0));
        let idx = self.lock();
        StoreStatus {
            capacity: self.space.capacity,
            used: idx.used,
            fs_free,
            fs_size,
            min_free: self.space.min_free,
            unverified: idx.unverified,
            files: idx.files_present,
            blocks: idx.blocks,
        }
    }

    /// The counts of [`Store::status`] found by walking every entry: what the index's
    /// running counts must equal.
    #[cfg(test)]
    pub(crate) fn recount(&self) -> (u64, u64) {
        let idx = self.lock();
        let present = idx.files.values().map(index::Entry::present);
        present.fold((0, 0), |(f, b), n| (f + u64::from(n > 0), b + n))
    }

    /// Default block size of new entries.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// False once the journal's writer thread (`sc-journal`) has ended: closed, or ended
    /// by a panic (then every append fails, and nothing new is admitted).
    pub fn journal_alive(&self) -> bool {
        self.journal.writer_alive()
    }

    /// Flushes the journal and marks the shutdown orderly (`CLEAN`, which the next start
    /// only logs: no start trusts a block it did not check). Call once, after every fill
    /// has finished.
    pub fn close(&self) -> stdio::Result<()> {
        if !self.journal.close() {
            // What was queued may not be durable: the shutdown is not called orderly.
            return Err(stdio::Error::other(format!(
                "the journal writer did not finish within {} s",
                journal::WRITER_STOP.as_secs()
            )));
        }
        let marker = self.dir.join("CLEAN");
        journal::clear_unless_file(&marker)?;
        File::create(&marker)?.sync_all()?;
        journal::sync_dir(&self.dir)
    }
}

/// Stripes of the creation lock.
const CREATE_STRIPES: usize = 256;

/// The creation locks of a store.
/// Tells `p` what the index logged for it, in order.
fn tell(p: &mut dyn EvictionPolicy, log: Vec<PolicyEvent>) {
    for ev in log {
        match ev {
            PolicyEvent::Insert(k, root, path) => p.insert(k, &root, &path),
            PolicyEvent::Touch(k) => p.touch(k),
            PolicyEvent::Remove(k) => p.remove(&k),
        }
    }
}

/// The index, locked (see [`Store::lock`]). On release, what it logged for the policy
/// is told to the policy by this thread when the policy lock is free, and left for its
/// holder otherwise (who tells it before letting go, [`Store::with_policy`]): never
/// waited for. The log is taken under both locks and told under the policy's, so the
/// policy hears everything in the order it happened.
struct IndexGuard<'a> {
    guard: Option<MutexGuard<'a, Index>>,
    store: &'a Store,
}

impl std::ops::Deref for IndexGuard<'_> {
    type Target = Index;
    fn deref(&self) -> &Index {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for IndexGuard<'_> {
    fn deref_mut(&mut self) -> &mut Index {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl Drop for IndexGuard<'_> {
    fn drop(&mut self) {
        let Some(mut g) = self.guard.take() else {
            return;
        };
        if g.policy_log.is_empty() {
            return;
        }
        // (A try: the lock order is policy, then index.)
        if let Some(mut p) = self.store.policy.try_lock() {
            let log = std::mem::take(&mut g.policy_log);
            drop(g);
            tell(&mut **p, log);
        }
    }
}

pub(super) fn create_stripes() -> Box<[Mutex<()>]> {
    (0..CREATE_STRIPES).map(|_| Mutex::new(())).collect()
}

/// The stripe of `key` among `n`.
fn stripe_of(key: &Key, n: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % n.max(1) as u64) as usize
}

/// A store in `dir` of `capacity` bytes with `block_size` blocks and no free-space
/// floor: what the daemon's unit tests open.
#[cfg(test)]
pub(crate) fn test_config(dir: &std::path::Path, capacity: u64, block_size: u32) -> StoreConfig {
    StoreConfig {
        dir: dir.to_owned(),
        capacity: SizeSpec::Bytes(capacity),
        min_free: SizeSpec::Bytes(0),
        block_size,
    }
}

#[cfg(test)]
mod tests;
