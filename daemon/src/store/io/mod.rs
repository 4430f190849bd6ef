//! The NVMe side of the store as a seam: [`BlockIo`] creates data files, writes blocks
//! durably, reads them back for verification and for peers, and removes data files.
//!
//! Implementations: [`psync`] (`pread`/`pwrite`/`fdatasync` on descriptors kept in a
//! bounded cache, so that a fill does not reopen its data file for every block),
//! [`uring`] (io_uring: a batch of writes with a linked `fdatasync` in one submission,
//! batched reads; probed at start, psync when the kernel or a sandbox refuses it),
//! [`mem`] (in memory: the twin the conformance suite holds the others to) and
//! [`failing`] (a wrapper that injects EIO — from `fdatasync` too —, ENOSPC and short
//! writes). One conformance suite (`conformance.rs`) runs over all of them.
//!
//! The engine is synchronous: fills run on blocking threads, and a call returns once
//! every operation it submitted has completed (a buffer belongs to the operation until
//! its completion arrives). Clients do not go through it: they are handed descriptors of
//! the same data files ([`super::Store::view`]), so the on-disk layout is the store's,
//! not the engine's. An engine knows nothing of keys, the index or the journal: it sees
//! names relative to the data directory (`<xx>/<key>.<generation>`), offsets and bytes.
//! It assumes the data directory is the daemon's: a data file is replaced or removed
//! only through [`BlockIo::remove`] (bytes damaged in place are seen through any
//! descriptor, so a kept descriptor never hides corruption from verification).

use std::fmt;
use std::io;
use std::path::Path;
use std::sync::Arc;

#[cfg(test)]
pub(crate) mod conformance;
pub mod failing;
pub mod mem;
pub mod psync;
pub mod uring;

/// One write: the bytes to put at an offset of a data file.
pub type Write<'a> = (u64, &'a [u8]);

/// One read: an offset of a data file and the buffer to fill whole from it.
pub type Read<'a> = (u64, &'a mut [u8]);

/// A data file to create and write at once ([`BlockIo::create_written`]).
#[derive(Debug, Clone, Copy)]
pub struct NewFile<'a> {
    /// Its name under the data directory.
    pub name: &'a str,
    /// Its length.
    pub size: u64,
    /// What to write to it.
    pub writes: &'a [Write<'a>],
}

/// The store's block I/O on its data files (see the module documentation).
pub trait BlockIo: Send + Sync + fmt::Debug {
    /// Which engine runs (`psync`, `uring`, `mem`), for the log and status.
    fn engine(&self) -> &'static str;

    /// Creates data file `name` (replacing any), `size` bytes long and all hole, mode
    /// 0600; on `Ok` the file, its length and its directory entry are durable.
    fn create(&self, name: &str, size: u64) -> io::Result<()>;

    /// Writes every `(offset, bytes)` of `writes` whole to `name`, then makes them
    /// durable (`fdatasync`). `Ok` means every byte is written and durable; on an error
    /// nothing is promised of any of them (some may be written, torn, or lost).
    fn write_durable(&self, name: &str, writes: &[Write<'_>]) -> io::Result<()>;

    /// Creates each of `files` and writes it, as [`BlockIo::create`] and then
    /// [`BlockIo::write_durable`] would, one result per file with what those two promise
    /// together. An engine may share the syncs among the files: every file created and
    /// written first, then the whole batch made durable at once (`psync`: one `syncfs`
    /// of the file system, or each file and each directory once where `syncfs` does not
    /// report errors), so a batch of small files costs one sync instead of three per
    /// file. On an error a file may be left created, in part or whole, for the caller to
    /// remove.
    fn create_written(&self, files: &[NewFile<'_>]) -> Vec<io::Result<()>> {
        files
            .iter()
            .map(|f| {
                self.create(f.name, f.size)
                    .and_then(|()| self.write_durable(f.name, f.writes))
            })
            .collect()
    }

    /// Fills every buffer of `reads` whole from `name` at its offset; one result per
    /// read, in order (a read past the end of the file is `UnexpectedEof`, a missing
    /// file `NotFound` for each).
    fn read_many(&self, name: &str, reads: &mut [Read<'_>]) -> Vec<io::Result<()>>;

    /// Removes data file `name` (and forgets any descriptor of it); `NotFound` when
    /// there is none.
    fn remove(&self, name: &str) -> io::Result<()>;

    /// True when data file `name` exists.
    fn exists(&self, name: &str) -> bool;

    /// Syncs made so far (`fsync`, `fdatasync`, `syncfs`) of data files, their
    /// directories and the file system: each one a wait for the disk, and on a file
    /// system without a journal a flush of its cache. What a landed file costs in them
    /// is what the store's durability costs (`data_syncs` in the status). An engine
    /// without a disk counts none.
    fn syncs(&self) -> u64 {
        0
    }
}

pub use crate::config::IoEngine;

/// The engine `choice` asks for over the data directory `data_dir`: `auto` probes
/// io_uring and falls back to psync on any setup failure (ENOSYS from an old kernel,
/// EPERM from a sandbox or `kernel.io_uring_disabled`, a missing opcode); `uring`
/// fails instead. Logs once which engine runs and why.
pub fn open(choice: IoEngine, data_dir: &Path) -> io::Result<Arc<dyn BlockIo>> {
    let psync = || -> Arc<dyn BlockIo> { Arc::new(psync::Psync::new(data_dir)) };
    match choice {
        IoEngine::Psync => {
            tracing::info!(engine = "psync", "store I/O engine (configured)");
            Ok(psync())
        }
        IoEngine::Uring => {
            let u = uring::Uring::new(data_dir).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "io_engine = \"uring\": io_uring is not available here ({e}); use \"auto\" or \"psync\""
                    ),
                )
            })?;
            tracing::info!(engine = "uring", "store I/O engine (configured)");
            Ok(Arc::new(u))
        }
        IoEngine::Auto => match uring::Uring::new(data_dir) {
            Ok(u) => {
                tracing::info!(engine = "uring", "store I/O engine (auto: io_uring probed)");
                Ok(Arc::new(u))
            }
            Err(e) => {
                tracing::info!(engine = "psync", reason = %e, "store I/O engine (auto: io_uring unavailable)");
                Ok(psync())
            }
        },
    }
}

/// A read past the end of a data file, as `read_exact_at` reports it.
pub(crate) fn eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past the end of a data file",
    )
}
