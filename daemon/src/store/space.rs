//! Space: how many bytes the cache may hold ([`Space::capacity`]), what it leaves free on
//! its file system ([`Space::min_free`]), and that file system's free space, sampled.
//!
//! `statvfs` is a system call on every fill otherwise, and it used to run under the index
//! lock at every step of making room. Now it runs at most once per [`SAMPLE_EVERY`], on
//! the caller's thread before it takes the index lock ([`Space::sample_due`]); the index
//! keeps the sample with the bytes it held then ([`FsSample`]), and estimates the free
//! space now by taking off whatever the cache has added since. The estimate errs only
//! low: bytes the cache freed since (evictions, whose unlinks come after the lock) are
//! not counted back until the next sample, and bytes being written are reserved besides.
//! What other programs write to the file system between two samples is not seen — at
//! most [`SAMPLE_EVERY`] of it, as before at most one fill's.
//!
//! This module owns the numbers; the choice of what to evict is the policy's
//! ([`super::evict`]), the loop that evicts until a block fits is the store's
//! (`Store::begin_fill`).

use parking_lot::Mutex;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::config::SizeSpec;

/// Longest a free-space sample is used before the file system is asked again.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// (size, available) of the file system holding `dir`, in bytes.
pub(super) fn fs_stats(dir: &Path) -> io::Result<(u64, u64)> {
    let s = rustix::fs::statvfs(dir)?;
    Ok((s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize))
}

/// The store's space limits and when the file system is next sampled.
#[derive(Debug)]
pub(super) struct Space {
    dir: PathBuf,
    /// Most bytes of cached data (resolved).
    pub(super) capacity: u64,
    /// Free space to leave on the file system (resolved).
    pub(super) min_free: u64,
    /// When the next sample is due.
    due: Mutex<Instant>,
}

impl Space {
    /// Resolves the limits against the file system holding `dir`; returns its available
    /// bytes too (the first sample: [`FsSample::update`] it once the index is built).
    pub(super) fn new(
        dir: &Path,
        capacity: SizeSpec,
        min_free: SizeSpec,
    ) -> io::Result<(Self, u64)> {
        let (fs_size, fs_free) = fs_stats(dir)?;
        let space = Self {
            dir: dir.to_owned(),
            capacity: capacity.resolve(fs_size),
            min_free: min_free.resolve(fs_size),
            due: Mutex::new(Instant::now() + SAMPLE_EVERY),
        };
        Ok((space, fs_free))
    }

    /// The file system's available bytes when a new sample is due (`None`: the last one
    /// is still fresh). Call without the index lock; hand the result to
    /// [`FsSample::update`] under it.
    pub(super) fn sample_due(&self) -> io::Result<Option<u64>> {
        let now = Instant::now();
        {
            let mut due = self.due.lock();
            if now < *due {
                return Ok(None);
            }
            *due = now + SAMPLE_EVERY;
        }
        fs_stats(&self.dir).map(|(_, free)| Some(free))
    }

    /// (size, available) of the file system now (for status; never under the index lock).
    pub(super) fn fs_stats(&self) -> io::Result<(u64, u64)> {
        fs_stats(&self.dir)
    }
}

/// A sample of the file system's available bytes and the bytes the cache held then.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FsSample {
    free: u64,
    used_then: u64,
}

impl FsSample {
    /// Takes a new sample (`free`, from [`Space::sample_due`]) while the cache holds `used`.
    pub(super) fn update(&mut self, free: Option<u64>, used: u64) {
        if let Some(free) = free {
            *self = Self {
                free,
                used_then: used,
            };
        }
    }

    /// The available bytes now that the cache holds `used`: the sample less what the
    /// cache added since.
    pub(super) fn free_now(&self, used: u64) -> u64 {
        self.free
            .saturating_sub(used.saturating_sub(self.used_then))
    }
}
