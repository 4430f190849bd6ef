//! The portable engine: `pwrite` + `fdatasync` for writes, `pread` for reads, on
//! descriptors kept in a bounded LRU cache ([`KEPT`] data files), so that the blocks of
//! a fill and the reads of a verification pass open their data file once, not once per
//! block.
//!
//! A descriptor leaves the cache when its file is removed through [`BlockIo::remove`],
//! when the cache is full, and after a failed write or `fdatasync` (the next call opens
//! the file again rather than trust a description that reported an error). It owns no
//! other state and never touches the index or the journal.

use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use lru::LruCache;

use super::{BlockIo, NewFile, Read, Write};
use crate::store::journal;

/// Data files whose descriptors are kept open.
pub const KEPT: usize = 256;

/// `pread` / `pwrite` / `fdatasync` with kept descriptors.
pub struct Psync {
    dir: PathBuf,
    files: Mutex<LruCache<String, Arc<File>>>,
}

impl std::fmt::Debug for Psync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Psync").field("dir", &self.dir).finish()
    }
}

impl Psync {
    /// An engine over the data directory `dir` (nothing is opened yet).
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            files: Mutex::new(LruCache::new(NonZeroUsize::new(KEPT).expect("non-zero"))),
        }
    }

    fn cache(&self) -> parking_lot::MutexGuard<'_, LruCache<String, Arc<File>>> {
        self.files.lock()
    }

    /// The kept descriptor of `name`, opened (read-write, no links followed) if needed.
    pub(crate) fn file(&self, name: &str) -> io::Result<Arc<File>> {
        if let Some(f) = self.cache().get(name) {
            return Ok(f.clone());
        }
        let f = Arc::new(
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(self.dir.join(name))?,
        );
        self.cache().put(name.to_owned(), f.clone());
        // A removal between the open and the line above unlinked the file after its
        // descriptor was dropped from the cache (see `remove`): do not keep it (it would
        // hold the removed file's blocks on disk until it left the cache).
        if f.metadata().is_ok_and(|m| m.nlink() == 0) {
            self.forget(name);
        }
        Ok(f)
    }

    /// Drops the kept descriptor of `name` (it is closed once no call uses it).
    pub(crate) fn forget(&self, name: &str) {
        self.cache().pop(name);
    }

    /// Creates `name` as [`BlockIo::create`] says and keeps its descriptor.
    pub(crate) fn create_file(&self, name: &str, size: u64) -> io::Result<Arc<File>> {
        self.forget(name);
        let path = self.dir.join(name);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        f.set_len(size)?;
        f.sync_all()?;
        journal::sync_dir(path.parent().unwrap_or(&self.dir))?;
        let f = Arc::new(f);
        self.cache().put(name.to_owned(), f.clone());
        Ok(f)
    }

    /// [`BlockIo::create_written`] with the syncs shared (see there).
    pub(crate) fn create_written_shared(&self, files: &[NewFile<'_>]) -> Vec<io::Result<()>> {
        let written: Vec<io::Result<File>> = files
            .iter()
            .map(|nf| {
                self.forget(nf.name);
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(self.dir.join(nf.name))?;
                f.set_len(nf.size)?;
                nf.writes
                    .iter()
                    .try_for_each(|(off, data)| f.write_all_at(data, *off))?;
                Ok(f)
            })
            .collect();
        // Every file's bytes, length and inode; then each directory's entries.
        let mut results: Vec<io::Result<File>> = written
            .into_iter()
            .map(|r| r.and_then(|f| f.sync_all().map(|()| f)))
            .collect();
        let dir_of = |nf: &NewFile<'_>| {
            let p = self.dir.join(nf.name);
            p.parent().unwrap_or(&self.dir).to_owned()
        };
        let dirs: std::collections::BTreeSet<PathBuf> = files
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|(nf, _)| dir_of(nf))
            .collect();
        for d in dirs {
            if let Err(e) = journal::sync_dir(&d) {
                for (nf, r) in files.iter().zip(results.iter_mut()) {
                    if r.is_ok() && dir_of(nf) == d {
                        *r = Err(io::Error::new(e.kind(), e.to_string()));
                    }
                }
            }
        }
        files
            .iter()
            .zip(results)
            .map(|(nf, r)| {
                r.map(|f| {
                    self.cache().put(nf.name.to_owned(), Arc::new(f));
                })
            })
            .collect()
    }
}

impl BlockIo for Psync {
    fn engine(&self) -> &'static str {
        "psync"
    }

    fn create(&self, name: &str, size: u64) -> io::Result<()> {
        self.create_file(name, size).map(|_| ())
    }

    fn create_written(&self, files: &[NewFile<'_>]) -> Vec<io::Result<()>> {
        self.create_written_shared(files)
    }

    fn write_durable(&self, name: &str, writes: &[Write<'_>]) -> io::Result<()> {
        let f = self.file(name)?;
        let r = writes
            .iter()
            .try_for_each(|(off, data)| f.write_all_at(data, *off))
            .and_then(|()| f.sync_data());
        if r.is_err() {
            self.forget(name);
        }
        r
    }

    fn read_many(&self, name: &str, reads: &mut [Read<'_>]) -> Vec<io::Result<()>> {
        match self.file(name) {
            Ok(f) => reads
                .iter_mut()
                .map(|(off, buf)| f.read_exact_at(buf, *off))
                .collect(),
            Err(e) => reads
                .iter()
                .map(|_| Err(io::Error::new(e.kind(), e.to_string())))
                .collect(),
        }
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        // Unlink first, then forget: a descriptor opened meanwhile is either forgotten
        // here or sees the file unlinked (`file`).
        let r = std::fs::remove_file(self.dir.join(name));
        self.forget(name);
        r
    }

    fn exists(&self, name: &str) -> bool {
        std::fs::symlink_metadata(self.dir.join(name)).is_ok_and(|m| m.is_file())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conformance() {
        super::super::conformance::run_all(&|dir: &Path| -> Arc<dyn BlockIo> {
            Arc::new(Psync::new(dir))
        });
    }

    proptest::proptest! {
        #[test]
        fn behaves_as_the_in_memory_twin(steps in super::super::conformance::steps()) {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir(dir.path().join("ab")).unwrap();
            super::super::conformance::differential(&Psync::new(dir.path()), &steps);
        }
    }

    #[test]
    fn a_fill_opens_its_data_file_once() {
        let dir = tempfile::tempdir().unwrap();
        let io = Psync::new(dir.path());
        io.create("f", 1 << 20).unwrap();
        let first = io.file("f").unwrap();
        for i in 0..8u64 {
            io.write_durable("f", &[(i * 4096, &[i as u8; 4096])])
                .unwrap();
        }
        assert!(
            Arc::ptr_eq(&first, &io.file("f").unwrap()),
            "the descriptor is kept"
        );
        io.remove("f").unwrap();
        assert!(
            io.file("f").is_err(),
            "a removed file is not served from the cache"
        );
    }
}
