//! Fault injection and observation for tests and benchmarks, as a wrapper: a
//! [`FaultyBacking`] counts every call that reaches the store, fails reads on demand and
//! hangs every call on demand (as a hung network file system does), without a test-only
//! field in any production type.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex};

use super::{Backing, BackingError, BackingFile, DirEntry, Owner, Stat, Version};

/// Counters and switches shared by a [`FaultyBacking`] and the files opened through it.
#[derive(Debug, Default)]
pub struct Faults {
    /// `stat` calls that reached the store.
    pub stats: AtomicU64,
    /// `read_at` calls that reached the store.
    pub reads: AtomicU64,
    /// Make every read fail with an I/O error.
    pub fail_reads: AtomicBool,
    /// Calls blocked by [`Faults::hang`] right now.
    pub hung: AtomicU64,
    /// While true, every call blocks until [`Faults::release`].
    hang: Mutex<bool>,
    cv: Condvar,
}

impl Faults {
    /// From now on every call (stat, open, list, read, version) blocks, as on a hung
    /// file system, until [`Faults::release`].
    pub fn hang(&self) {
        *self.hang.lock() = true;
    }

    /// Lets blocked calls and later ones go on.
    pub fn release(&self) {
        *self.hang.lock() = false;
        self.cv.notify_all();
    }

    fn block_while_hung(&self) {
        let mut g = self.hang.lock();
        if *g {
            self.hung.fetch_add(1, Ordering::Relaxed);
            while *g {
                self.cv.wait(&mut g);
            }
            self.hung.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Wraps a backing store, counting calls and failing reads when told to.
pub struct FaultyBacking {
    inner: Arc<dyn Backing>,
    faults: Arc<Faults>,
}

impl fmt::Debug for FaultyBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyBacking")
            .field("inner", &self.inner)
            .finish()
    }
}

impl FaultyBacking {
    /// Wraps `inner`; the returned [`Faults`] observe and steer it.
    pub fn new(inner: Arc<dyn Backing>) -> (Self, Arc<Faults>) {
        let faults = Arc::new(Faults::default());
        (
            Self {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }
}

impl Backing for FaultyBacking {
    fn stat(&self, path: &str) -> Result<Stat, BackingError> {
        self.faults.stats.fetch_add(1, Ordering::Relaxed);
        self.faults.block_while_hung();
        self.inner.stat(path)
    }

    fn open(&self, stat: &Stat) -> Result<Box<dyn BackingFile>, BackingError> {
        self.faults.block_while_hung();
        Ok(Box::new(FaultyFile {
            inner: self.inner.open(stat)?,
            faults: self.faults.clone(),
        }))
    }

    fn list(&self, dir: &str) -> Result<Vec<DirEntry>, BackingError> {
        self.faults.block_while_hung();
        self.inner.list(dir)
    }

    fn dir_owners(&self, dir: &str) -> Result<Vec<Owner>, BackingError> {
        self.inner.dir_owners(dir)
    }
}

#[derive(Debug)]
struct FaultyFile {
    inner: Box<dyn BackingFile>,
    faults: Arc<Faults>,
}

impl BackingFile for FaultyFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.faults.reads.fetch_add(1, Ordering::Relaxed);
        self.faults.block_while_hung();
        if self.faults.fail_reads.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected read failure"));
        }
        self.inner.read_at(buf, offset)
    }

    fn version(&self) -> io::Result<Version> {
        self.faults.block_while_hung();
        self.inner.version()
    }
}
