//! The seams blocks travel through between the parts: where a fill gets a block
//! ([`BlockSource`]: the backing store of its root, the peers) and what the peer server
//! may serve ([`BlockProvider`]: a block of this node's store, a fill for a peer).
//!
//! The fill engine ([`crate::fill`]) is handed its [`Sources`] at construction, each
//! root's in the order it asks them; the peer server ([`crate::peer`]) is handed a
//! provider. `fill` and `peer` both import this module and nothing of each other, so the
//! daemon wires them in one pass: the peer client (a source) first, then the fill engine
//! over it, then the peer server over the fill engine (a provider).
//!
//! As [`crate::backing`] is built: the traits and the types they speak here; the real
//! implementations beside their owners ([`backing::BackingSource`] here, the peer
//! client's in `peer/source.rs`, the fill engine's provider in `fill.rs`); in-memory twins
//! ([`mem`]); a fault wrapper ([`fault`]); and one conformance suite per trait run over
//! every implementation (`conformance.rs`), so that a twin cannot drift from the real one.
//!
//! This module owns no state: it must not cache, count fills or know of plans.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use crate::backing::{BackingError, Stat};
use crate::store::Key;

pub mod backing;
pub mod fault;
pub mod mem;

#[cfg(test)]
pub(crate) mod conformance;

/// The file version a fill is for.
#[derive(Debug)]
pub struct Target {
    /// Root index (for metadata invalidation).
    pub root: usize,
    /// The path as the client named it, relative to the root (metadata cache key).
    pub rel: String,
    /// The version to fill.
    pub stat: Arc<Stat>,
    /// The store key of that version.
    pub key: Key,
    /// The block may come from a peer (false when filling for a peer: the owner reads the
    /// backing store itself).
    pub peer_ok: bool,
}

/// One block a fill asks a source for.
#[derive(Debug, Clone, Copy)]
pub struct BlockRequest<'a> {
    /// The file version.
    pub target: &'a Target,
    /// The name of its backing root (as peers and store keys name it).
    pub root: &'a str,
    /// The block's index in the file.
    pub index: usize,
    /// The block's offset in the file.
    pub offset: u64,
    /// The block's length: exactly this many bytes come back.
    pub len: usize,
    /// A prefetch (planned ahead of any reader), not a reader's fill.
    pub prefetch: bool,
}

/// What a source answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetched {
    /// The block is in the buffer (exactly [`BlockRequest::len`] bytes), with its
    /// xxh3-64 when the source checked the bytes against it (peers do: the store then
    /// does not hash them again).
    Got {
        /// The checked checksum, when there is one.
        xxh3: Option<u64>,
    },
    /// Not here: the next source is asked.
    Miss,
    /// No source is to be asked for it any more (the cluster placement moved the file
    /// away from this node while a prefetch of it ran): the fill ends without the block.
    Declined,
}

/// Why a source failed (the fill ends without the block; the reader falls back).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The backing store refused or the file changed (a new version: never cached under
    /// the old one's key).
    #[error(transparent)]
    Backing(#[from] BackingError),
    /// Reading failed.
    #[error("backing read failed: {0}")]
    Read(#[from] io::Error),
}

impl SourceError {
    /// A read the root's watch refused (the root is stalled): not an error of the cache.
    pub fn is_stall(&self) -> bool {
        match self {
            SourceError::Backing(BackingError::Stalled(_)) => true,
            SourceError::Read(io) => io.get_ref().is_some_and(|i| i.is::<BackingError>()),
            SourceError::Backing(_) => false,
        }
    }
}

/// Where a fill gets a block from. Implementations: the backing store of one root
/// ([`backing::BackingSource`]), the peers (`peer::source::PeerSource`), the in-memory
/// [`mem::MemSource`], and the [`fault::FaultySource`] wrapper.
pub trait BlockSource: Send + Sync + fmt::Debug {
    /// A short name for logs.
    fn name(&self) -> &'static str;

    /// True for a source that does not read this node's backing root (the peers): it
    /// may serve while the root stalls, and is never asked on behalf of a peer
    /// ([`Target::peer_ok`] false: the owner reads the backing store itself).
    fn remote(&self) -> bool;

    /// Block `req` into `buf` (resized to `req.len`; its contents are unspecified unless
    /// [`Fetched::Got`]). Never bytes of another version than `req.target`'s.
    fn fetch(&self, req: &BlockRequest<'_>, buf: &mut Vec<u8>) -> Result<Fetched, SourceError>;
}

/// The sources of each backing root's fills, in the order a fill asks them.
#[derive(Debug, Clone, Default)]
pub struct Sources(Vec<Vec<Arc<dyn BlockSource>>>);

impl Sources {
    /// `per_root[i]`: root `i`'s sources, in order.
    pub fn new(per_root: Vec<Vec<Arc<dyn BlockSource>>>) -> Self {
        Self(per_root)
    }

    /// Each root of `meta` reads its own backing store ([`backing::BackingSource`]).
    pub fn backing(meta: &Arc<crate::meta::Meta>, stats: &Arc<crate::stats::Stats>) -> Self {
        let n = meta.roots().all().len();
        Self(
            (0..n)
                .map(|r| {
                    let s: Arc<dyn BlockSource> =
                        Arc::new(backing::BackingSource::new(meta.clone(), r, stats.clone()));
                    vec![s]
                })
                .collect(),
        )
    }

    /// `first` is asked before every root's other sources (the peers before the backing
    /// store).
    #[must_use]
    pub fn ask_first(mut self, first: Arc<dyn BlockSource>) -> Self {
        for s in &mut self.0 {
            s.insert(0, first.clone());
        }
        self
    }

    /// The number of roots.
    pub fn roots(&self) -> usize {
        self.0.len()
    }

    /// Root `root`'s sources, in order.
    pub fn of(&self, root: usize) -> &[Arc<dyn BlockSource>] {
        self.0.get(root).map_or(&[], Vec::as_slice)
    }

    /// True when some source of `root` is remote (it may serve while the root stalls).
    pub fn any_remote(&self, root: usize) -> bool {
        self.of(root).iter().any(|s| s.remote())
    }
}

/// What the peer server may serve: blocks of this node's store, and a fill from this
/// node's backing store for a peer that asked this node (the block's owner). The real
/// one is the fill engine ([`crate::fill::Filler`]); [`mem::MemProvider`] is its twin.
pub trait BlockProvider: Send + Sync + fmt::Debug {
    /// The block size of this node's store (peers must use the same).
    fn block_size(&self) -> u32;

    /// Block `index` of the file version `key` from this node's store into `buf`,
    /// checked against the checksum recorded for it: that checksum. `None` when it is
    /// not there (or failed its check: then it is dropped).
    fn read(&self, key: &Key, index: usize, buf: &mut Vec<u8>) -> Option<u64>;

    /// Fills block `index` of `target` from this node's backing store (never from a
    /// peer), single flight with every other fill of it, waiting at most until
    /// `deadline`. True when the block is present afterwards.
    fn fill(&self, target: &Arc<Target>, index: usize, deadline: Instant) -> bool;
}
