//! The in-memory index: which file versions have entries ([`Entry`]), which of their
//! blocks are present and with what checksum ([`BlockMeta`]), how many bytes they take,
//! and the bookkeeping that keeps those counts right as entries leave
//! ([`evict_locked`], [`retire_other_versions`]).
//!
//! Everything here runs under the store's index lock, so it does no I/O: no file is
//! opened, unlinked or `statvfs`ed, and no journal record is written here. An entry
//! that leaves comes back as an [`Evicted`], whose journal record and unlink the store
//! does after the lock is released. Nor does it call the eviction policy: what the
//! policy must hear (a file cached, used or dropped) is logged here ([`PolicyEvent`])
//! and applied by the next holder of the store's policy lock.

use rustc_hash::FxHashMap as HashMap;

use super::Residency;
use super::key::{Key, PathKey, path_key};
use super::pins::Pins;
use super::space::FsSample;
use crate::backing::Version;

/// One present block: its length, the xxh3-64 of its bytes, and whether those bytes were
/// checked against it since this start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BlockMeta {
    pub(super) len: u32,
    pub(super) xxh3: u64,
    pub(super) verified: bool,
}

/// One cached file version.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) root: String,
    pub(super) path: String,
    pub(super) version: Version,
    pub(super) block_size: u32,
    pub(super) generation: u64,
    pub(super) blocks: Vec<Option<BlockMeta>>,
    /// The data file exists and its `FileAdded` record is durable.
    pub(super) durable: bool,
    pub(super) bytes: u64,
    /// Fills in progress; such an entry is never evicted.
    pub(super) filling: u32,
    /// Superseded by a newer version of the same path: evicted once no fill runs.
    pub(super) doomed: bool,
}

/// Blocks of a file of `size` bytes in blocks of `bs`.
pub(super) fn nblocks(size: u64, bs: u32) -> usize {
    size.div_ceil(bs as u64) as usize
}

impl Entry {
    /// Its present blocks.
    pub(super) fn present(&self) -> u64 {
        self.blocks.iter().filter(|b| b.is_some()).count() as u64
    }

    pub(super) fn block_len(&self, i: usize) -> u32 {
        let start = i as u64 * self.block_size as u64;
        (self.version.size - start).min(self.block_size as u64) as u32
    }

    /// Present-and-verified bitmap (bit `i` of byte `i / 8`).
    pub(super) fn bitmap(&self) -> Vec<u8> {
        let mut bm = vec![0u8; self.blocks.len().div_ceil(8)];
        for (i, b) in self.blocks.iter().enumerate() {
            if b.is_some_and(|b| b.verified) {
                bm[i / 8] |= 1 << (i % 8);
            }
        }
        bm
    }
}

/// Everything the index lock guards.
pub(super) struct Index {
    pub(super) files: HashMap<Key, Entry>,
    /// The current version of each path.
    pub(super) by_path: HashMap<PathKey, Key>,
    /// Bytes of present blocks.
    pub(super) used: u64,
    /// Bytes of fills in progress.
    pub(super) reserved: u64,
    /// Present blocks not yet checked since this start.
    pub(super) unverified: u64,
    /// Present blocks, and entries with at least one: kept as blocks come and go, so
    /// that a status (a scrape, `shardcache status`) does not walk every entry under the
    /// index lock that every open takes: the walk took 12 ms at 200 000 files (release
    /// build, in-memory engine, timed once ad hoc), the status now 4 µs.
    pub(super) blocks: u64,
    pub(super) files_present: u64,
    /// What the eviction policy has yet to hear, in the order it happened (see
    /// [`PolicyEvent`]).
    pub(super) policy_log: Vec<PolicyEvent>,
    /// Files a reader is waiting on (see [`super::Store::pin`]).
    pub(super) pins: Pins,
    /// The cache file system's free space as last sampled (see [`super::space`]).
    pub(super) fs: FsSample,
}

impl Index {
    /// An empty index.
    pub(super) fn new() -> Self {
        Self {
            files: HashMap::default(),
            by_path: HashMap::default(),
            used: 0,
            reserved: 0,
            unverified: 0,
            blocks: 0,
            files_present: 0,
            policy_log: Vec::new(),
            pins: Pins::default(),
            fs: FsSample::default(),
        }
    }
}

/// What the eviction policy must hear of the index, logged under the index lock and
/// applied under the policy's own lock (`super::Store::with_policy`): no index lock holder
/// waits for the policy, whose choices may take the planner's lock.
#[derive(Debug)]
pub(super) enum PolicyEvent {
    /// A file version entered the index (root name, path).
    Insert(Key, String, String),
    /// A file version was used.
    Touch(Key),
    /// A file version left the index.
    Remove(Key),
}

/// A file that left the index and whose data file is still to be removed.
#[derive(Debug)]
pub(super) struct Evicted {
    pub(super) key: Key,
    pub(super) generation: u64,
    pub(super) bytes: u64,
}

/// Retires any other version of (`root`, `path`) than `key`: it is evicted now, or
/// once its running fills end.
pub(super) fn retire_other_versions(
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

/// The residency of the current version of `path` under `root`.
pub(super) fn residency_locked(idx: &Index, root: &str, path: &str) -> Option<Residency> {
    let e = idx.files.get(idx.by_path.get(&path_key(root, path))?)?;
    Some(Residency {
        size: e.version.size,
        resident_bytes: e.bytes,
    })
}

/// Takes `key` out of the index and the policy, keeping the counts right.
pub(super) fn evict_locked(idx: &mut Index, key: &Key) -> Option<Evicted> {
    let e = idx.files.remove(key)?;
    idx.policy_log.push(PolicyEvent::Remove(*key));
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
    let present = e.present();
    idx.blocks -= present;
    idx.files_present -= u64::from(present > 0);
    Some(Evicted {
        key: *key,
        generation: e.generation,
        bytes: e.bytes,
    })
}
