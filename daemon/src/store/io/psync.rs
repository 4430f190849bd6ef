//! The portable engine: `pwrite` + `fdatasync` for writes, `pread` for reads, on
//! descriptors kept in a bounded LRU cache ([`KEPT`] data files), so that the blocks of
//! a fill and the reads of a verification pass open their data file once, not once per
//! block.
//!
//! A descriptor leaves the cache when its file is removed through [`BlockIo::remove`],
//! when the cache is full, and after a failed write or `fdatasync` (the next call opens
//! the file again rather than trust a description that reported an error). It owns no
//! other state and never touches the index or the journal.
//!
//! **Group commit of new files.** A batch of new files ([`BlockIo::create_written`],
//! two or more: the small files a lander or a busy worker lands together) is made
//! durable with one `syncfs(2)` of the cache's file system after every file is created
//! and written, not a `fsync` per file and per directory: on a file system without a
//! journal (this project's VMs) each `fsync` is a flush of the disk's cache of its own.
//! Timed ad hoc on the development VM (2 cores; 256 files of 100 KiB, batches of 32):
//! 0.95–1.2 ms per file synced one by one, 0.23–0.69 ms with one `syncfs` per batch
//! (ext4 with and without a journal). `syncfs` reports writeback errors of the whole
//! file system since its descriptor was opened only from Linux 5.8 on: each batch opens
//! its own descriptor of the data directory before it creates anything, so any error
//! while its files were written fails the whole batch (an error of another writer's
//! file on the same file system too: the batch is then not made visible, and filled
//! again later). On older kernels, and for a single new file, each file and its
//! directory are synced as before. The price of `syncfs`: it also writes whatever else
//! is dirty on the file system — nothing of the cache's own (every other write of the
//! store is synced at once), but another tenant's dirty data when the cache shares its
//! file system; a cache on a file system of its own pays nothing for that.

use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// `fsync`, `fdatasync` and `syncfs` calls made so far ([`BlockIo::syncs`]).
    syncs: AtomicU64,
    /// Whether a batch of new files is synced with one `syncfs` ([`syncfs_reports_errors`]).
    group_sync: bool,
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
            syncs: AtomicU64::new(0),
            group_sync: syncfs_reports_errors(),
        }
    }

    /// Counts `n` syncs made ([`BlockIo::syncs`]).
    pub(crate) fn synced(&self, n: u64) {
        self.syncs.fetch_add(n, Ordering::Relaxed);
    }

    /// Syncs directory `dir` (counted).
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.synced(1);
        journal::sync_dir(dir)
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
        self.synced(1);
        f.sync_all()?;
        self.sync_dir(path.parent().unwrap_or(&self.dir))?;
        let f = Arc::new(f);
        self.cache().put(name.to_owned(), f.clone());
        Ok(f)
    }

    /// [`BlockIo::create_written`] with the syncs shared: two files or more with one
    /// `syncfs` (see the module documentation), else each file and each directory once.
    pub(crate) fn create_written_shared(&self, files: &[NewFile<'_>]) -> Vec<io::Result<()>> {
        // Opened before anything is written: its `syncfs` reports every writeback error
        // of the file system from now on.
        let group = if self.group_sync && files.len() > 1 {
            match File::open(&self.dir) {
                Ok(d) => Some(d),
                Err(e) => return files.iter().map(|_| Err(copy_err(&e))).collect(),
            }
        } else {
            None
        };
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
        let results = match group {
            Some(d) => self.group_synced(&d, written),
            None => self.each_synced(files, written),
        };
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

    /// Makes every written file of a batch durable with one `syncfs` of the file system
    /// through `dir` (opened before the batch was written); its error fails them all.
    fn group_synced(&self, dir: &File, written: Vec<io::Result<File>>) -> Vec<io::Result<File>> {
        if !written.iter().any(Result::is_ok) {
            return written;
        }
        self.synced(1);
        match rustix::fs::syncfs(dir) {
            Ok(()) => written,
            Err(e) => {
                let e = io::Error::from(e);
                written
                    .into_iter()
                    .map(|r| r.and_then(|_| Err(copy_err(&e))))
                    .collect()
            }
        }
    }

    /// Makes every written file of a batch durable one by one: each file's bytes,
    /// length and inode, then each directory's entries once.
    fn each_synced(
        &self,
        files: &[NewFile<'_>],
        written: Vec<io::Result<File>>,
    ) -> Vec<io::Result<File>> {
        let mut results: Vec<io::Result<File>> = written
            .into_iter()
            .map(|r| {
                r.and_then(|f| {
                    self.synced(1);
                    f.sync_all().map(|()| f)
                })
            })
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
            if let Err(e) = self.sync_dir(&d) {
                for (nf, r) in files.iter().zip(results.iter_mut()) {
                    if r.is_ok() && dir_of(nf) == d {
                        *r = Err(copy_err(&e));
                    }
                }
            }
        }
        results
    }
}

/// The same error again (one per file it fails).
fn copy_err(e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

/// Whether this kernel's engines sync a batch of new files with one `syncfs`.
#[cfg(test)]
pub(crate) fn group_sync_here() -> bool {
    syncfs_reports_errors()
}

/// Whether `syncfs(2)` reports writeback errors (Linux 5.8 and later): before, it
/// returned success after a failed writeback, and a batch synced with it could be
/// taken for durable when it was not.
fn syncfs_reports_errors() -> bool {
    let release = rustix::system::uname();
    let release = release.release().to_string_lossy();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (5, 8)
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
            .and_then(|()| {
                self.synced(1);
                f.sync_data()
            });
        if r.is_err() {
            self.forget(name);
        }
        r
    }

    fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
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

    /// A batch of new files is made durable with one `syncfs` (where it reports
    /// errors), and is then all there with its bytes; one new file alone with a sync of
    /// itself and one of its directory.
    #[test]
    fn a_batch_of_new_files_is_synced_once() {
        let dir = tempfile::tempdir().unwrap();
        for d in ["ab", "cd"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let io = Psync::new(dir.path());
        let bytes: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; 1000 + usize::from(i)]).collect();
        let names: Vec<String> = (0..8)
            .map(|i| format!("{}/f{i}", if i % 2 == 0 { "ab" } else { "cd" }))
            .collect();
        let writes: Vec<[Write<'_>; 1]> = bytes.iter().map(|b| [(0, &b[..])]).collect();
        let files: Vec<NewFile<'_>> = names
            .iter()
            .zip(&writes)
            .zip(&bytes)
            .map(|((name, w), b)| NewFile {
                name,
                size: b.len() as u64,
                writes: w,
            })
            .collect();
        let r = io.create_written(&files);
        assert!(r.iter().all(Result::is_ok), "{r:?}");
        let batch = if group_sync_here() { 1 } else { 8 + 2 };
        assert_eq!(io.syncs(), batch);
        for (name, b) in names.iter().zip(&bytes) {
            assert_eq!(&std::fs::read(dir.path().join(name)).unwrap(), b, "{name}");
        }
        let one = [(0, &b"alone"[..])];
        let r = io.create_written(&[NewFile {
            name: "ab/alone",
            size: 5,
            writes: &one,
        }]);
        assert!(r[0].is_ok(), "{r:?}");
        assert_eq!(io.syncs(), batch + 2, "one file: itself and its directory");
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
