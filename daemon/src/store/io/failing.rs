//! Fault injection as a wrapper, like `backing::fault`: a [`FailingIo`] passes every
//! call to the engine it wraps unless a fault is armed in its [`IoFaults`], without a
//! test-only field in any real engine. Faults are armed one call at a time (each armed
//! fault fails the next call of its kind, then is spent):
//!
//! - [`Fault::SyncEio`]: the writes reach the engine, then `fdatasync` "fails" with EIO
//!   (the bytes may be on disk or not: nothing may be trusted);
//! - [`Fault::Enospc`]: the write fails with ENOSPC before any byte is written;
//! - [`Fault::ShortWrite`]: the first half of the first write lands (a torn block), then
//!   ENOSPC, as a disk that fills midway does;
//! - [`Fault::CreateEnospc`]: creating a data file fails with ENOSPC;
//! - [`Fault::ReadEio`]: a read fails with EIO (each failed `(name, offset)` is noted in
//!   [`IoFaults::failed_reads`]).

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{BlockIo, NewFile, Read, Write};

/// A fault to inject into the next call of its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The next `write_durable` writes, then reports EIO from `fdatasync`.
    SyncEio,
    /// The next `write_durable` fails with ENOSPC, writing nothing.
    Enospc,
    /// The next `write_durable` writes half of its first write, then fails with ENOSPC.
    ShortWrite,
    /// The next `create` fails with ENOSPC.
    CreateEnospc,
    /// The next read (one buffer of a `read_many`) fails with EIO.
    ReadEio,
}

/// Armed faults and what they did, shared by a [`FailingIo`] and its test.
#[derive(Debug, Default)]
pub struct IoFaults {
    armed: Mutex<VecDeque<Fault>>,
    /// Faults injected so far.
    pub injected: AtomicU64,
    /// `write_durable` calls (each one batch of writes and one `fdatasync`) and
    /// `create_written` batches made so far.
    pub durable_writes: AtomicU64,
    /// `(name, offset)` of every read failed by [`Fault::ReadEio`].
    pub failed_reads: Mutex<Vec<(String, u64)>>,
    /// Where every `write_durable` waits while [`IoFaults::hold`] holds it (before
    /// writing): a cache disk slow to land blocks.
    pub writes: Gate,
    /// Where every `read_many` waits while [`IoFaults::hold_reads`] holds it (before
    /// reading): a check of cached blocks caught mid-way.
    pub reads: Gate,
}

/// Calls of one kind waiting while the gate is closed, until it opens.
#[derive(Debug, Default)]
pub struct Gate {
    /// Calls waiting at the gate now.
    pub held: AtomicU64,
    closed: Mutex<bool>,
    /// Told when a call starts to wait and when the gate opens.
    cv: parking_lot::Condvar,
}

impl Gate {
    fn close(&self) {
        *self.closed.lock() = true;
    }

    fn open(&self) {
        *self.closed.lock() = false;
        self.cv.notify_all();
    }

    fn is_closed(&self) -> bool {
        *self.closed.lock()
    }

    /// Waits while the gate is closed.
    fn pass(&self) {
        let mut g = self.closed.lock();
        if *g {
            self.held.fetch_add(1, Ordering::Relaxed);
            self.cv.notify_all();
            while *g {
                self.cv.wait(&mut g);
            }
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Waits until `n` calls wait at the gate, or `limit` has passed; true when they do.
    pub fn wait_for_held(&self, n: u64, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let mut g = self.closed.lock();
        while self.held.load(Ordering::Relaxed) < n {
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return self.held.load(Ordering::Relaxed) >= n;
            }
        }
        true
    }
}

impl IoFaults {
    /// Arms `fault` for the next call of its kind.
    pub fn arm(&self, fault: Fault) {
        self.lock().push_back(fault);
    }

    /// From now on every `write_durable` waits until [`IoFaults::release`].
    pub fn hold(&self) {
        self.writes.close();
    }

    /// From now on every `read_many` waits until [`IoFaults::release`].
    pub fn hold_reads(&self) {
        self.reads.close();
    }

    /// Lets held writes and reads, and later ones, go on.
    pub fn release(&self) {
        self.writes.open();
        self.reads.open();
    }

    /// Disarms every fault not yet injected.
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, VecDeque<Fault>> {
        self.armed.lock()
    }

    /// Takes the first armed fault among `kinds`, if any.
    fn take(&self, kinds: &[Fault]) -> Option<Fault> {
        let mut q = self.lock();
        let i = q.iter().position(|f| kinds.contains(f))?;
        self.injected.fetch_add(1, Ordering::Relaxed);
        q.remove(i)
    }
}

fn os(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// Wraps an engine, failing calls when a fault is armed.
#[derive(Debug)]
pub struct FailingIo {
    inner: Arc<dyn BlockIo>,
    faults: Arc<IoFaults>,
}

impl FailingIo {
    /// Wraps `inner`; the returned [`IoFaults`] arm faults and observe them.
    pub fn new(inner: Arc<dyn BlockIo>) -> (Self, Arc<IoFaults>) {
        let faults = Arc::new(IoFaults::default());
        (Self::with(inner, faults.clone()), faults)
    }

    /// Wraps `inner`, steered by `faults` (shared, say, by the engines of successive
    /// starts of one store).
    pub fn with(inner: Arc<dyn BlockIo>, faults: Arc<IoFaults>) -> Self {
        Self { inner, faults }
    }
}

impl BlockIo for FailingIo {
    fn engine(&self) -> &'static str {
        self.inner.engine()
    }

    fn create(&self, name: &str, size: u64) -> io::Result<()> {
        if self.faults.take(&[Fault::CreateEnospc]).is_some() {
            return Err(os(libc::ENOSPC));
        }
        self.inner.create(name, size)
    }

    fn create_written(&self, files: &[NewFile<'_>]) -> Vec<io::Result<()>> {
        // With a fault armed or writes held, file by file: each create and write may
        // take its fault, or wait.
        if !self.faults.lock().is_empty() || self.faults.writes.is_closed() {
            return files
                .iter()
                .map(|f| {
                    self.create(f.name, f.size)
                        .and_then(|()| self.write_durable(f.name, f.writes))
                })
                .collect();
        }
        self.faults.durable_writes.fetch_add(1, Ordering::Relaxed);
        self.inner.create_written(files)
    }

    fn write_durable(&self, name: &str, writes: &[Write<'_>]) -> io::Result<()> {
        self.faults.durable_writes.fetch_add(1, Ordering::Relaxed);
        self.faults.writes.pass();
        match self
            .faults
            .take(&[Fault::SyncEio, Fault::Enospc, Fault::ShortWrite])
        {
            None => self.inner.write_durable(name, writes),
            Some(Fault::SyncEio) => {
                self.inner.write_durable(name, writes)?;
                Err(os(libc::EIO))
            }
            Some(Fault::ShortWrite) => {
                if let Some((off, data)) = writes.first() {
                    let half = &data[..data.len() / 2];
                    if !half.is_empty() {
                        self.inner.write_durable(name, &[(*off, half)])?;
                    }
                }
                Err(os(libc::ENOSPC))
            }
            Some(_) => Err(os(libc::ENOSPC)),
        }
    }

    fn syncs(&self) -> u64 {
        self.inner.syncs()
    }

    fn read_many(&self, name: &str, reads: &mut [Read<'_>]) -> Vec<io::Result<()>> {
        self.faults.reads.pass();
        let mut out = self.inner.read_many(name, reads);
        for (r, (off, _)) in out.iter_mut().zip(reads.iter()) {
            if self.faults.take(&[Fault::ReadEio]).is_some() {
                *r = Err(os(libc::EIO));
                self.faults
                    .failed_reads
                    .lock()
                    .push((name.to_owned(), *off));
            }
        }
        out
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        self.inner.remove(name)
    }

    fn exists(&self, name: &str) -> bool {
        self.inner.exists(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::io::mem::MemIo;
    use crate::store::io::psync::Psync;
    use std::path::Path;

    #[test]
    fn conformance_with_nothing_armed() {
        super::super::conformance::run_all(&|dir: &Path| -> Arc<dyn BlockIo> {
            Arc::new(FailingIo::new(Arc::new(Psync::new(dir))).0)
        });
        super::super::conformance::run_all(&|_: &Path| -> Arc<dyn BlockIo> {
            Arc::new(FailingIo::new(Arc::new(MemIo::new())).0)
        });
    }

    #[test]
    fn each_fault_fails_one_call_with_its_error_then_is_spent() {
        let (io, faults) = FailingIo::new(Arc::new(MemIo::new()));
        faults.arm(Fault::CreateEnospc);
        assert_eq!(
            io.create("f", 8).unwrap_err().raw_os_error(),
            Some(libc::ENOSPC)
        );
        io.create("f", 8).unwrap();
        faults.arm(Fault::ShortWrite);
        let e = io.write_durable("f", &[(0, b"abcdefgh")]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        let mut buf = [0u8; 8];
        io.read_many("f", &mut [(0, &mut buf[..])])
            .remove(0)
            .unwrap();
        assert_eq!(&buf, b"abcd\0\0\0\0", "a short write tears the block");
        faults.arm(Fault::SyncEio);
        let e = io.write_durable("f", &[(0, b"ABCDEFGH")]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        faults.arm(Fault::Enospc);
        assert!(io.write_durable("f", &[(0, b"xxxxxxxx")]).is_err());
        io.read_many("f", &mut [(0, &mut buf[..])])
            .remove(0)
            .unwrap();
        assert_eq!(&buf, b"ABCDEFGH", "ENOSPC wrote nothing");
        faults.arm(Fault::ReadEio);
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        let r = io.read_many("f", &mut [(0, &mut a[..]), (4, &mut b[..])]);
        assert_eq!(r[0].as_ref().unwrap_err().raw_os_error(), Some(libc::EIO));
        assert!(r[1].is_ok(), "one read per armed fault");
        assert_eq!(&b, b"EFGH");
        assert_eq!(*faults.failed_reads.lock(), vec![("f".to_owned(), 0)]);
        assert_eq!(faults.injected.load(Ordering::Relaxed), 5);
        io.write_durable("f", &[(0, b"12345678")]).unwrap();
    }
}
