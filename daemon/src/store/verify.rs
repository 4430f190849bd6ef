//! Verification: every block is checked against the xxh3 recorded when it was written
//! before it is first handed out after a start — to a local reader (a part of a file per
//! [`super::Store::view`], the rest by a fill worker when a reader waits for it) or to a
//! peer ([`super::Store::read_block_into`]) — and the background scrub
//! ([`super::Store::verify_unverified`]) checks the rest. A block that fails is dropped
//! from the index and its removal journaled; whoever needs it fetches it again.
//!
//! This module reads data files (through the store's descriptors) and changes only the
//! `verified` mark and the presence of the blocks it checked, under the index lock and
//! only when the block is still the one it read (a refill meanwhile is left alone). It
//! never writes a data file.

use super::Store;
use super::index::BlockMeta;
use super::io::Read;
use super::key::{Key, data_name};
use super::records::Record;
use crate::checksum::{BlockHasher, block_xxh3};
use crate::stats::{add, inc};

/// Most bytes the scrub ([`Store::verify_unverified`]) checks between two calls of its
/// pace.
pub const SCRUB_GROUP: u64 = 4 << 20;

/// Most bytes of unverified blocks one [`Store::view`] checks before it answers (at
/// least one block): about 20 ms of reading at 1.5 GB/s, well inside a client's open
/// timeout.
pub const VERIFY_PER_VIEW: u64 = 32 << 20;

/// Most bytes one engine call reads while verifying (at least one block).
pub const READ_BATCH: u64 = 8 << 20;

/// A verification reads each block as pieces of at most this many bytes, in flight
/// together where the engine allows it: a disk serves several reads of one block at once
/// faster than one long one (on the development VM, uncached buffered reads ran at about
/// twice the speed of `pread` with 8 io_uring reads in flight; a [`READ_BATCH`] holds 8).
pub const VERIFY_PIECE: usize = 1 << 20;

/// A block for a peer is read and hashed this many bytes at a time (each piece hashed
/// while it is still in the CPU's cache).
pub const PIECE: usize = 256 << 10;

/// The reads of a block at `offset` into `buf`, a [`VERIFY_PIECE`] each.
fn pieces(offset: u64, buf: &mut [u8]) -> Vec<Read<'_>> {
    buf.chunks_mut(VERIFY_PIECE)
        .enumerate()
        .map(|(n, p)| (offset + (n * VERIFY_PIECE) as u64, p))
        .collect()
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

impl Store {
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
        let (generation, bs, meta) = {
            let idx = self.lock();
            let e = idx.files.get(key)?;
            let meta = (*e.blocks.get(i)?)?;
            (e.generation, e.block_size, meta)
        };
        // Every byte is overwritten by the reads below: only growth is zero-filled.
        buf.resize(meta.len as usize, 0);
        let base = i as u64 * bs as u64;
        let name = data_name(key, generation);
        // Piece by piece, each hashed as soon as it is read (as the peers benchmark
        // measured this path): a peer is usually served from the page cache, where reads
        // in flight together gain nothing.
        let mut hash = BlockHasher::new();
        for (n, piece) in buf.chunks_mut(PIECE).enumerate() {
            let off = base + (n * PIECE) as u64;
            self.io
                .read_many(&name, &mut [(off, &mut *piece)])
                .pop()?
                .ok()?;
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

    /// Checks `blocks` of `key` (generation `generation`) against their checksums; drops the
    /// corrupt ones (and those that cannot be read). The blocks are read in batches of up
    /// to [`READ_BATCH`] bytes, each block as [`VERIFY_PIECE`]s, all in flight together where the
    /// engine allows it.
    pub(super) fn verify_blocks(
        &self,
        key: &Key,
        generation: u64,
        blocks: &[(usize, BlockMeta)],
    ) -> VerifyReport {
        let Some(bs) = self.lock().files.get(key).map(|e| e.block_size) else {
            return VerifyReport::default();
        };
        let name = data_name(key, generation);
        // One batch's buffer: READ_BATCH bytes, or the largest block, or all of them.
        let largest = blocks.iter().map(|(_, b)| b.len as u64).max().unwrap_or(0);
        let total: u64 = blocks.iter().map(|(_, b)| b.len as u64).sum();
        let mut buf = vec![0u8; READ_BATCH.min(total).max(largest) as usize];
        let mut results = Vec::with_capacity(blocks.len());
        let mut rest = blocks;
        while !rest.is_empty() {
            // As many blocks as fit the buffer (at least one).
            let mut take = 0;
            let mut bytes = 0usize;
            while take < rest.len() && (take == 0 || bytes + rest[take].1.len as usize <= buf.len())
            {
                bytes += rest[take].1.len as usize;
                take += 1;
            }
            let (batch, more) = rest.split_at(take);
            rest = more;
            let mut reads = Vec::new();
            let mut spans = Vec::with_capacity(batch.len());
            let mut free = &mut buf[..];
            for &(i, meta) in batch {
                let (b, after) = free.split_at_mut(meta.len as usize);
                free = after;
                let first = reads.len();
                reads.extend(pieces(i as u64 * bs as u64, b));
                spans.push(first..reads.len());
            }
            let ok = self.io.read_many(&name, &mut reads);
            drop(reads);
            let mut at = 0usize;
            for (&(i, meta), span) in batch.iter().zip(spans) {
                let b = &buf[at..at + meta.len as usize];
                at += meta.len as usize;
                let good = ok[span].iter().all(Result::is_ok) && block_xxh3(b) == meta.xxh3;
                results.push((i, meta, good));
            }
        }
        self.record_checks(key, generation, results)
    }

    /// Records the outcome of checking blocks of `key` (generation `generation`): those
    /// that held become verified, the others are dropped (counted, logged, and their
    /// removal journaled). A block that changed meanwhile (refilled) is left alone.
    pub(super) fn record_checks(
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
                    idx.blocks -= 1;
                    if e.bytes == 0 {
                        idx.files_present -= 1;
                    }
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
        // Unpaced: groups as large as one engine call reads.
        self.verify_where(false, READ_BATCH, &mut |_| true)
    }

    /// Checks the blocks not yet verified since this start (the background scrub). After
    /// each group of blocks (at most [`SCRUB_GROUP`] bytes) `pace` is told the bytes just
    /// read, and may sleep to hold a rate; it returns false to stop.
    pub fn verify_unverified(&self, pace: &mut dyn FnMut(u64) -> bool) -> VerifyReport {
        self.verify_where(true, SCRUB_GROUP, pace)
    }

    /// Checks every present block (`only_unverified`: those not verified since this
    /// start) in groups that close once they hold `group_max` bytes, telling `pace` the
    /// bytes of each.
    fn verify_where(
        &self,
        only_unverified: bool,
        group_max: u64,
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
            if durable && !self.io.exists(&data_name(&key, generation)) {
                total.missing_files += 1;
            }
            total.files += 1;
            let mut group = Vec::new();
            let mut group_bytes = 0u64;
            let last = blocks.len() - 1;
            for (n, b) in blocks.into_iter().enumerate() {
                group_bytes += b.1.len as u64;
                group.push(b);
                if group_bytes < group_max && n < last {
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
}
