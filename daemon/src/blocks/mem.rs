//! In-memory twins of both seams, for unit tests: [`MemSource`] (a source holding whole
//! file versions, by store key: a peer when `remote`, else a backing store) and
//! [`MemProvider`] (a node's store and backing store as two maps). Both pass the
//! conformance suites the real ones pass.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::Instant;

use super::{BlockProvider, BlockRequest, BlockSource, Fetched, SourceError, Target};
use crate::checksum::block_xxh3;
use crate::store::Key;

/// File versions in memory, served block by block.
#[derive(Debug, Default)]
pub struct MemSource {
    remote: bool,
    files: Mutex<HashMap<Key, Arc<Vec<u8>>>>,
    fetches: AtomicU64,
}

impl MemSource {
    /// An empty source; `remote`: it stands for the peers (it reports checked checksums
    /// and is not asked on a peer's behalf), else for a backing store.
    pub fn new(remote: bool) -> Self {
        Self {
            remote,
            ..Self::default()
        }
    }

    /// Holds `data` as the file version `key`.
    pub fn insert(&self, key: Key, data: Vec<u8>) {
        self.files.lock().insert(key, Arc::new(data));
    }

    /// Forgets the file version `key`.
    pub fn remove(&self, key: &Key) {
        self.files.lock().remove(key);
    }

    /// Fetches asked of it so far.
    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::Relaxed)
    }
}

impl BlockSource for MemSource {
    fn name(&self) -> &'static str {
        if self.remote { "mem-peers" } else { "mem" }
    }

    fn remote(&self) -> bool {
        self.remote
    }

    fn fetch(&self, req: &BlockRequest<'_>, buf: &mut Vec<u8>) -> Result<Fetched, SourceError> {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        let Some(data) = self.files.lock().get(&req.target.key).cloned() else {
            return Ok(Fetched::Miss);
        };
        let start = usize::try_from(req.offset).unwrap_or(usize::MAX);
        let Some(block) = start
            .checked_add(req.len)
            .and_then(|end| data.get(start..end))
        else {
            return Ok(Fetched::Miss);
        };
        buf.clear();
        buf.extend_from_slice(block);
        Ok(Fetched::Got {
            xxh3: self.remote.then(|| block_xxh3(block)),
        })
    }
}

/// A file's current version on a [`MemProvider`]'s backing store: its key and bytes.
type Current = (Key, Vec<u8>);

/// A node's store (blocks by key and index) and its backing store (the current version
/// of each file, by root and path) in memory.
#[derive(Debug)]
pub struct MemProvider {
    block_size: u32,
    cached: Mutex<HashMap<(Key, usize), Vec<u8>>>,
    backing: Mutex<HashMap<(usize, String), Current>>,
    fills: AtomicU64,
}

impl MemProvider {
    /// Empty, with blocks of `block_size` bytes.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            cached: Mutex::default(),
            backing: Mutex::default(),
            fills: AtomicU64::new(0),
        }
    }

    /// Makes `data`, as version `key`, the current content of `rel` under root `root` on
    /// the backing store.
    pub fn put_backing(&self, root: usize, rel: &str, key: Key, data: Vec<u8>) {
        self.backing
            .lock()
            .insert((root, rel.to_owned()), (key, data));
    }

    /// Puts block `index` of version `key` in the store.
    pub fn put_cached(&self, key: Key, index: usize, data: Vec<u8>) {
        self.cached.lock().insert((key, index), data);
    }

    /// Fills that read the backing store so far.
    pub fn fills(&self) -> u64 {
        self.fills.load(Ordering::Relaxed)
    }
}

impl BlockProvider for MemProvider {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn read(&self, key: &Key, index: usize, buf: &mut Vec<u8>) -> Option<u64> {
        let cached = self.cached.lock();
        let block = cached.get(&(*key, index))?;
        buf.clear();
        buf.extend_from_slice(block);
        Some(block_xxh3(block))
    }

    fn fill(&self, target: &Arc<Target>, index: usize, _deadline: Instant) -> bool {
        if self.cached.lock().contains_key(&(target.key, index)) {
            return true;
        }
        let block = {
            let backing = self.backing.lock();
            let Some((key, data)) = backing.get(&(target.root, target.rel.clone())) else {
                return false;
            };
            if *key != target.key {
                return false; // the file changed: not this version
            }
            let bs = self.block_size as usize;
            let start = index.saturating_mul(bs);
            match data.get(start..(start + bs).min(data.len())) {
                Some(b) if !b.is_empty() => b.to_vec(),
                _ => return false,
            }
        };
        self.fills.fetch_add(1, Ordering::Relaxed);
        self.cached.lock().insert((target.key, index), block);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::{Stat, Version};
    use crate::blocks::conformance::{self, ProviderFixture, SourceFixture};

    /// Versions of files for the fixtures: each put is a new version (a new inode).
    #[derive(Default)]
    struct Versions {
        next: AtomicU64,
        current: Mutex<HashMap<String, Key>>,
    }

    impl Versions {
        /// A new version of `path` with `len` bytes, and the key of the one it replaces.
        fn next(&self, path: &str, len: usize) -> (Arc<Target>, Option<Key>) {
            let version = Version {
                size: len as u64,
                ino: self.next.fetch_add(1, Ordering::Relaxed) + 1,
                ..Version::default()
            };
            let stat = Arc::new(Stat {
                path: path.to_owned(),
                dirs: Vec::new(),
                owner: Default::default(),
                version,
            });
            let key = Key::of("/r", path, &version);
            let old = self.current.lock().insert(path.to_owned(), key);
            let t = Arc::new(Target {
                root: 0,
                rel: path.to_owned(),
                stat,
                key,
                peer_ok: true,
            });
            (t, old)
        }
    }

    struct SourceFx {
        source: MemSource,
        versions: Versions,
    }

    impl SourceFixture for SourceFx {
        fn source(&self) -> &dyn BlockSource {
            &self.source
        }
        fn root(&self) -> &str {
            "/r"
        }
        fn put(&self, path: &str, data: &[u8]) -> Arc<Target> {
            let (t, old) = self.versions.next(path, data.len());
            if let Some(old) = old {
                self.source.remove(&old);
            }
            self.source.insert(t.key, data.to_vec());
            t
        }
    }

    #[test]
    fn sources_conform() {
        for remote in [false, true] {
            conformance::sources(&|| SourceFx {
                source: MemSource::new(remote),
                versions: Versions::default(),
            });
        }
    }

    struct ProviderFx {
        provider: MemProvider,
        versions: Versions,
    }

    impl ProviderFixture for ProviderFx {
        fn provider(&self) -> &dyn BlockProvider {
            &self.provider
        }
        fn put(&self, path: &str, data: &[u8]) -> Arc<Target> {
            let (t, _) = self.versions.next(path, data.len());
            self.provider.put_backing(0, path, t.key, data.to_vec());
            t
        }
    }

    #[test]
    fn providers_conform() {
        conformance::providers(&|| ProviderFx {
            provider: MemProvider::new(conformance::BS as u32),
            versions: Versions::default(),
        });
    }
}
