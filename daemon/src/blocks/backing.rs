//! The backing store of one root as a [`BlockSource`]: a block is read through a
//! descriptor opened for the exact version the client was told about (kept a while for
//! the next block of the file), and the version is checked again after the read: a
//! file changed underneath is never handed on under the old version's key (its metadata
//! is dropped from the cache instead, so that the next open sees the new version).

use std::sync::Arc;
use std::time::Duration;

use super::{BlockRequest, BlockSource, Fetched, SourceError};
use crate::backing::{BackingError, BackingFile, BackingFileExt};
use crate::meta::Meta;
use crate::stats::{Stats, add, inc};
use crate::store::Key;

/// Open descriptors kept per root, and for how long one may sit unused.
const HANDLES: u64 = 256;
const HANDLE_IDLE: Duration = Duration::from_secs(30);

/// Reads blocks of root `root` from its backing store.
pub struct BackingSource {
    meta: Arc<Meta>,
    root: usize,
    stats: Arc<Stats>,
    handles: moka::sync::Cache<Key, Arc<dyn BackingFile>>,
}

impl std::fmt::Debug for BackingSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackingSource")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl BackingSource {
    /// The source of root `root` of `meta`'s roots (read through its watch), counting
    /// backing reads into `stats`.
    pub fn new(meta: Arc<Meta>, root: usize, stats: Arc<Stats>) -> Self {
        Self {
            meta,
            root,
            stats,
            handles: moka::sync::Cache::builder()
                .max_capacity(HANDLES)
                .time_to_idle(HANDLE_IDLE)
                .build(),
        }
    }
}

impl BlockSource for BackingSource {
    fn name(&self) -> &'static str {
        "backing"
    }

    fn remote(&self) -> bool {
        false
    }

    fn fetch(&self, req: &BlockRequest<'_>, buf: &mut Vec<u8>) -> Result<Fetched, SourceError> {
        let t = req.target;
        debug_assert_eq!(t.root, self.root, "a source serves its own root");
        let changed = || {
            self.meta.invalidate(t.root, &t.rel);
            self.handles.invalidate(&t.key);
            SourceError::Backing(BackingError::Changed(t.stat.path.clone()))
        };
        let file = match self.handles.get(&t.key) {
            Some(f) => f,
            None => {
                let f: Arc<dyn BackingFile> =
                    match self.meta.roots().get(self.root).backing.open(&t.stat) {
                        Ok(f) => Arc::from(f),
                        Err(BackingError::Changed(_)) => return Err(changed()),
                        Err(e) => return Err(e.into()),
                    };
                self.handles.insert(t.key, f.clone());
                f
            }
        };
        // Every byte is overwritten by the read (or the block is not handed on).
        buf.resize(req.len, 0);
        let n = file.read_full_at(buf, req.offset)?;
        inc(&self.stats.backing_reads);
        add(&self.stats.backing_bytes, n as u64);
        self.stats.charge.backing_read(t.root, &t.rel, n as u64);
        if n != req.len || file.version()? != t.stat.version {
            return Err(changed());
        }
        Ok(Fetched::Got { xxh3: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::Owner;
    use crate::backing::mem::MemBacking;
    use crate::blocks::Target;
    use crate::blocks::conformance::{self, SourceFixture};
    use crate::meta::test_support::one_root;

    struct Fx {
        mem: Arc<MemBacking>,
        meta: Arc<Meta>,
        source: BackingSource,
    }

    fn fx() -> Fx {
        let mem = Arc::new(MemBacking::new());
        let (meta, stats) = one_root(mem.clone());
        Fx {
            source: BackingSource::new(meta.clone(), 0, stats),
            mem,
            meta,
        }
    }

    impl SourceFixture for Fx {
        fn source(&self) -> &dyn BlockSource {
            &self.source
        }
        fn root(&self) -> &str {
            "/r"
        }
        fn put(&self, path: &str, data: &[u8]) -> Arc<Target> {
            let owner = Owner {
                mode: 0o644,
                ..Owner::default()
            };
            self.mem.put(path, data.to_vec(), owner);
            self.meta.invalidate(0, path);
            let stat = self.meta.stat(0, path).unwrap();
            Arc::new(Target {
                root: 0,
                rel: path.to_owned(),
                key: Key::of("/r", &stat.path, &stat.version),
                stat,
                peer_ok: true,
            })
        }
    }

    #[test]
    fn conformance() {
        conformance::sources(&fx);
    }
}
