//! The cache file system's free bytes, as admission needs them: measured by `statvfs`
//! off the index lock and kept, so that an eviction step never waits on a system call
//! under the lock (on a busy or network-backed file system `statvfs` can take
//! milliseconds, and every open and fill waits on that lock).
//!
//! Between measurements the bytes the store writes are subtracted (the estimate errs
//! low, never high: a file system filling up is seen at once). It is measured again,
//! on the caller's thread before it takes the index lock, when the last measurement is
//! older than [`MAX_AGE`], after [`MAX_WRITTEN`] bytes were written since, or after the
//! store removed files (their room comes back only once they are unlinked, and
//! descriptors clients still hold keep it longer). Knows nothing of the index.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Longest a measurement is used.
pub const MAX_AGE: Duration = Duration::from_secs(1);
/// Most bytes written before the next use measures again.
pub const MAX_WRITTEN: u64 = 64 << 20;

/// The file system's total and available bytes (`statvfs`).
pub fn fs_stats(dir: &Path) -> io::Result<(u64, u64)> {
    let s = rustix::fs::statvfs(dir)?;
    Ok((s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize))
}

/// See the module doc.
#[derive(Debug)]
pub struct FreeSpace {
    dir: PathBuf,
    /// Available bytes at the last measurement.
    measured: AtomicU64,
    /// Bytes written since it.
    written: AtomicU64,
    /// Files were removed since it.
    stale: AtomicBool,
    /// When it was taken; held while one caller measures (the others use the last).
    at: Mutex<Instant>,
    /// Measurements taken (for tests).
    measurements: AtomicU64,
}

impl FreeSpace {
    /// Measures `dir`'s file system once.
    pub fn new(dir: &Path) -> io::Result<Self> {
        let (_, free) = fs_stats(dir)?;
        Ok(Self {
            dir: dir.to_owned(),
            measured: AtomicU64::new(free),
            written: AtomicU64::new(0),
            stale: AtomicBool::new(false),
            at: Mutex::new(Instant::now()),
            measurements: AtomicU64::new(1),
        })
    }

    /// The available bytes as far as known: measured again first when due (see the
    /// module doc). Must not be called under the index lock.
    pub fn get(&self) -> u64 {
        self.refresh_if_due();
        self.estimate()
    }

    /// The last measurement less the bytes written since (no system call).
    pub fn estimate(&self) -> u64 {
        self.measured
            .load(Ordering::Acquire)
            .saturating_sub(self.written.load(Ordering::Acquire))
    }

    /// `n` bytes were written to the file system.
    pub fn wrote(&self, n: u64) {
        self.written.fetch_add(n, Ordering::AcqRel);
    }

    /// Files were removed: measure before the next use.
    pub fn removed(&self) {
        self.stale.store(true, Ordering::Release);
    }

    /// Measurements taken so far.
    #[cfg(test)]
    pub fn measurements(&self) -> u64 {
        self.measurements.load(Ordering::Relaxed)
    }

    fn refresh_if_due(&self) {
        let due = |at: &Instant| {
            self.stale.load(Ordering::Acquire)
                || self.written.load(Ordering::Acquire) >= MAX_WRITTEN
                || at.elapsed() >= MAX_AGE
        };
        // One caller measures; the others go on with the last measurement.
        let Ok(mut at) = self.at.try_lock() else {
            return;
        };
        if !due(&at) {
            return;
        }
        self.stale.store(false, Ordering::Release);
        // Bytes written from here on may be in the measurement and are still
        // subtracted: the estimate errs low.
        let before = self.written.load(Ordering::Acquire);
        match fs_stats(&self.dir) {
            Ok((_, free)) => {
                self.measured.store(free, Ordering::Release);
                self.written.fetch_sub(before, Ordering::AcqRel);
                self.measurements.fetch_add(1, Ordering::Relaxed);
                *at = Instant::now();
            }
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "statvfs failed; keeping the last measurement");
                *at = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_count_down_and_removals_or_bytes_measure_again() {
        let dir = tempfile::tempdir().unwrap();
        let f = FreeSpace::new(dir.path()).unwrap();
        let first = f.get();
        assert!(first > 0);
        assert_eq!(f.measurements(), 1, "fresh: not measured again");
        f.wrote(4096);
        assert_eq!(
            f.get(),
            first - 4096,
            "written bytes counted down, no statvfs"
        );
        assert_eq!(f.measurements(), 1);
        f.removed();
        f.get();
        assert_eq!(f.measurements(), 2, "measured after a removal");
        f.wrote(MAX_WRITTEN);
        f.get();
        assert_eq!(f.measurements(), 3, "measured after MAX_WRITTEN bytes");
        assert!(f.estimate() > 0);
    }

    #[test]
    fn an_old_measurement_is_taken_again() {
        let dir = tempfile::tempdir().unwrap();
        let f = FreeSpace::new(dir.path()).unwrap();
        *f.at.lock().unwrap() = Instant::now() - MAX_AGE;
        f.get();
        assert_eq!(f.measurements(), 2);
    }

    /// Fills that evict nothing measure the file system about once a second or per
    /// [`MAX_WRITTEN`] bytes, not per block (and never under the index lock: the
    /// store asks before taking it).
    #[test]
    fn fills_do_not_measure_per_block() {
        use crate::backing::{Owner, Stat, Version};
        use crate::stats::Stats;
        use crate::store::{Store, StoreConfig};
        use crate::units::SizeSpec;
        use std::sync::Arc;

        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            dir: dir.path().to_owned(),
            capacity: SizeSpec::Bytes(1 << 30),
            min_free: SizeSpec::Bytes(0),
            block_size: 4096,
        };
        let store = Store::open(&cfg, Arc::new(Stats::default())).unwrap();
        let before = store.free.measurements();
        let started = Instant::now();
        for f in 0..20u64 {
            let stat = Stat {
                path: format!("f{f}"),
                dirs: vec![],
                owner: Owner::default(),
                version: Version {
                    size: 5 * 4096,
                    mtime_ns: 1,
                    ctime_ns: 1,
                    ino: f + 1,
                    dev: 1,
                },
            };
            for i in 0..5 {
                let permit = store.begin_fill("/r", &stat, i, false).unwrap().unwrap();
                store.commit_fill(permit, &[f as u8; 4096]).unwrap();
            }
        }
        let secs = started.elapsed().as_secs() + 1;
        let took = store.free.measurements() - before;
        assert!(
            took <= secs,
            "{took} statvfs calls for 100 blocks in about {secs} s"
        );
    }
}
