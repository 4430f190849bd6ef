//! Journal records and the index: the [`Record`] constructors for each change the store
//! journals, [`apply`] to replay one into the index being rebuilt, and [`records_of`] to
//! write the index back out (a compaction, or the journal a start begins with).
//!
//! The wire format of a record is `shardcache.store.v1` (proto/); the framing, group
//! commit and damage handling are [`super::journal`]'s. Nothing here does I/O.

use rustc_hash::FxHashMap as HashMap;
use shardcache_proto::store::v1 as jpb;
use shardcache_proto::store::v1::record::Kind;

use super::index::{BlockMeta, Entry, nblocks};
use super::key::Key;
use crate::backing::Version;

/// The journal records that rebuild `files` (durable entries and their present blocks).
pub(super) fn records_of(files: &HashMap<Key, Entry>) -> Vec<jpb::Record> {
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

/// Applies one replayed journal record.
pub(super) fn apply(files: &mut HashMap<Key, Entry>, r: jpb::Record) {
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
pub(super) struct Record;

impl Record {
    pub(super) fn file_added(key: &Key, e: &Entry) -> jpb::Record {
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

    pub(super) fn block_added(key: &Key, generation: u64, i: usize, b: &BlockMeta) -> jpb::Record {
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

    pub(super) fn block_removed(key: &Key, generation: u64, i: usize) -> jpb::Record {
        jpb::Record {
            kind: Some(Kind::BlockRemoved(jpb::BlockRemoved {
                key: key.0.to_vec(),
                index: i as u64,
                generation,
            })),
        }
    }

    pub(super) fn file_removed(key: &Key, generation: u64) -> jpb::Record {
        jpb::Record {
            kind: Some(Kind::FileRemoved(jpb::FileRemoved {
                key: key.0.to_vec(),
                generation,
            })),
        }
    }
}
