//! A bandwidth budget toward the backing store: a wrapper that makes every read wait for
//! tokens from a shared bucket. It protects the shared file system from the cache (the
//! `backing_bandwidth` setting) and gives tests and benchmarks a slow store.

use std::fmt;
use std::io;
use std::sync::Arc;

use crate::ratelimit::TokenBucket;

use super::{Backing, BackingError, BackingFile, DirEntry, Owner, Stat, Version};

/// The bucket every file opened through one [`ThrottledBacking`] shares: `rate` bytes a
/// second with a burst of a tenth of a second (at least 1 MiB), starting full.
#[derive(Debug)]
pub struct Bucket(TokenBucket);

impl Bucket {
    /// `rate` bytes per second with a burst of one tenth of a second (at least 1 MiB).
    pub fn new(rate: u64) -> Self {
        let burst = (rate.max(1) as f64 / 10.0).max(1048576.0);
        Self(TokenBucket::new(rate, burst, burst))
    }

    /// Takes `n` tokens, sleeping while the bucket is in debt.
    pub fn take(&self, n: usize) {
        self.0.take(n as u64);
    }
}

/// Wraps a backing store so that reads through it stay under a byte rate.
pub struct ThrottledBacking {
    inner: Arc<dyn Backing>,
    bucket: Arc<Bucket>,
}

impl fmt::Debug for ThrottledBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottledBacking")
            .field("inner", &self.inner)
            .field("rate", &self.bucket.0.rate())
            .finish()
    }
}

impl ThrottledBacking {
    /// Limits reads through `inner` to `bytes_per_sec`.
    pub fn new(inner: Arc<dyn Backing>, bytes_per_sec: u64) -> Self {
        Self {
            inner,
            bucket: Arc::new(Bucket::new(bytes_per_sec)),
        }
    }
}

impl Backing for ThrottledBacking {
    fn stat(&self, path: &str) -> Result<Stat, BackingError> {
        self.inner.stat(path)
    }

    fn open(&self, stat: &Stat) -> Result<Box<dyn BackingFile>, BackingError> {
        Ok(Box::new(ThrottledFile {
            inner: self.inner.open(stat)?,
            bucket: self.bucket.clone(),
        }))
    }

    fn list(&self, dir: &str) -> Result<Vec<DirEntry>, BackingError> {
        self.inner.list(dir)
    }

    fn dir_owners(&self, dir: &str) -> Result<Vec<Owner>, BackingError> {
        self.inner.dir_owners(dir)
    }
}

#[derive(Debug)]
struct ThrottledFile {
    inner: Box<dyn BackingFile>,
    bucket: Arc<Bucket>,
}

impl BackingFile for ThrottledFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let n = self.inner.read_at(buf, offset)?;
        self.bucket.take(n);
        Ok(n)
    }

    fn version(&self) -> io::Result<Version> {
        self.inner.version()
    }
}
