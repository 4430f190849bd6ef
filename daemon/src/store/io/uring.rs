//! The io_uring engine (the `io-uring` crate): the writes of one call go to the kernel
//! as one chain ending in a linked `fdatasync` (one submission, one wait), and the reads
//! of one call (a verification group) go in flight together, up to [`DEPTH`] at once.
//!
//! Probed at start ([`Uring::new`]): a ring is set up, the opcodes it needs are checked
//! with the kernel's probe, and a no-op is submitted and reaped, so that an old kernel
//! (ENOSYS), a sandbox or `kernel.io_uring_disabled` (EPERM) or a missing opcode is
//! found before the store serves; [`super::open`] then falls back to psync.
//!
//! Rings are pooled (one per thread in a call, created on demand, a few kept). Every
//! buffer handed to the kernel belongs to its operation until its completion is reaped:
//! a call never returns while one of its operations is in flight, whatever fails
//! (waits interrupted by signals are resumed; a wait that fails otherwise is retried,
//! never abandoned). Short transfers and operations cancelled by a broken chain are
//! finished with `pwrite`/`pread`/`fdatasync` on the same descriptor, so a result is
//! as exact as psync's. Descriptors, creation and removal are psync's.

use parking_lot::Mutex;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use io_uring::{IoUring, Probe, opcode, squeue, types};

use super::psync::Psync;
use super::{BlockIo, Read, Write};

/// Entries of each ring: operations in flight at once per call.
pub const DEPTH: u32 = 64;

/// Rings kept between calls (more are made while more threads call at once).
const POOLED: usize = 16;

/// Most rings at once; a call that finds none free beyond this does its I/O as psync
/// does (many client threads checking blocks after a start must not set up a ring
/// each).
const MOST_RINGS: usize = 64;

/// `user_data` of the linked `fdatasync`.
const SYNC: u64 = u64::MAX;

/// io_uring over psync's descriptors.
pub struct Uring {
    psync: Psync,
    rings: Mutex<Vec<IoUring>>,
    /// Rings in existence (pooled or in use).
    live: AtomicUsize,
}

impl std::fmt::Debug for Uring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uring").field("psync", &self.psync).finish()
    }
}

/// Sets up a ring and checks that it runs what this engine submits.
fn probe() -> io::Result<IoUring> {
    let ring = IoUring::new(DEPTH)?;
    let mut p = Probe::new();
    ring.submitter().register_probe(&mut p)?;
    for (code, name) in [
        (opcode::Write::CODE, "write"),
        (opcode::Read::CODE, "read"),
        (opcode::Fsync::CODE, "fsync"),
        (opcode::Nop::CODE, "nop"),
    ] {
        if !p.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring lacks the {name} operation"),
            ));
        }
    }
    let mut ring = ring;
    // SAFETY: a no-op refers to no memory.
    unsafe {
        ring.submission()
            .push(&opcode::Nop::new().build().user_data(7))
    }
    .map_err(|_| io::Error::other("io_uring submission queue full at start"))?;
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("io_uring: no completion for a no-op"))?;
    if cqe.result() < 0 {
        return Err(io::Error::from_raw_os_error(-cqe.result()));
    }
    Ok(ring)
}

impl Uring {
    /// Probes io_uring (see the module documentation); `Err` when it cannot run here.
    pub fn new(dir: &Path) -> io::Result<Self> {
        let ring = probe()?;
        Ok(Self {
            psync: Psync::new(dir),
            rings: Mutex::new(vec![ring]),
            live: AtomicUsize::new(1),
        })
    }

    /// Runs `f` on a ring of the pool (a new one when all are in use); `None` when no
    /// ring can be had now ([`MOST_RINGS`] in use, or a memory limit): the caller does
    /// the call as psync would.
    fn with_ring<T>(&self, f: impl FnOnce(&mut IoUring) -> T) -> Option<T> {
        let pooled = self.rings.lock().pop();
        let mut ring = match pooled {
            Some(r) => r,
            None => {
                if self.live.fetch_add(1, Ordering::Relaxed) >= MOST_RINGS {
                    self.live.fetch_sub(1, Ordering::Relaxed);
                    return None;
                }
                match IoUring::new(DEPTH) {
                    Ok(r) => r,
                    Err(e) => {
                        self.live.fetch_sub(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "no io_uring ring for this call; pread/pwrite instead");
                        return None;
                    }
                }
            }
        };
        let out = f(&mut ring);
        let mut pool = self.rings.lock();
        if pool.len() < POOLED {
            pool.push(ring);
        } else {
            drop(pool);
            drop(ring);
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
        Some(out)
    }
}

/// Submits what is queued and waits until `n` completions are ready. Never gives up:
/// the operations queued point into the caller's buffers.
fn submit_wait(ring: &mut IoUring, n: usize) {
    let mut errors = 0u32;
    loop {
        match ring.submit_and_wait(n) {
            Ok(_) if ring.completion().len() >= n => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                errors += 1;
                if errors == 1 || errors.is_power_of_two() {
                    tracing::warn!(error = %e, "io_uring wait failed; waiting for the operations in flight");
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// Reaps every completion ready: (user_data, result).
fn reap(ring: &mut IoUring, out: &mut Vec<(u64, i32)>) {
    out.extend(ring.completion().map(|c| (c.user_data(), c.result())));
}

fn sync_fallback(f: &File) -> io::Result<()> {
    f.sync_data()
}

impl Uring {
    fn write_chain(&self, f: &File, writes: &[Write<'_>]) -> io::Result<()> {
        let fd = types::Fd(f.as_raw_fd());
        // The last chunk ends with the fdatasync; earlier chunks (more writes than a ring
        // holds) complete before it is queued.
        let chunk = DEPTH as usize - 1;
        let chunks: Vec<&[Write<'_>]> = if writes.is_empty() {
            vec![&[]]
        } else {
            writes.chunks(chunk).collect()
        };
        let last_chunk = chunks.len() - 1;
        let mut sync_done = false;
        let mut redo: Vec<(usize, usize)> = Vec::new(); // (write index, bytes done)
        let mut base = 0usize;
        let mut done = Vec::with_capacity(DEPTH as usize);
        let chained = self.with_ring(|ring| {
            for (c, ws) in chunks.iter().enumerate() {
                let with_sync = c == last_chunk;
                let n = ws.len() + usize::from(with_sync);
                {
                    let mut sq = ring.submission();
                    for (j, (off, data)) in ws.iter().enumerate() {
                        let e = opcode::Write::new(fd, data.as_ptr(), data.len() as u32)
                            .offset(*off)
                            .build()
                            .user_data((base + j) as u64);
                        let e = if with_sync {
                            e.flags(squeue::Flags::IO_LINK)
                        } else {
                            e
                        };
                        // SAFETY: `data` outlives the call, and the call waits below for
                        // this operation's completion before it returns.
                        unsafe { sq.push(&e) }.expect("a chunk fits the ring");
                    }
                    if with_sync {
                        let e = opcode::Fsync::new(fd)
                            .flags(types::FsyncFlags::DATASYNC)
                            .build()
                            .user_data(SYNC);
                        // SAFETY: refers to no memory.
                        unsafe { sq.push(&e) }.expect("a chunk fits the ring");
                    }
                }
                submit_wait(ring, n);
                done.clear();
                reap(ring, &mut done);
                for &(ud, res) in &done {
                    if ud == SYNC {
                        sync_done = res == 0;
                        if res < 0 && res != -libc::ECANCELED {
                            // The kernel reported the sync's error: it is the answer (a
                            // retry could see success for data already lost).
                            return Err(io::Error::from_raw_os_error(-res));
                        }
                        continue;
                    }
                    let i = ud as usize;
                    let len = writes[i].1.len();
                    if res < 0 && res != -libc::ECANCELED {
                        return Err(io::Error::from_raw_os_error(-res));
                    }
                    let got = if res < 0 { 0 } else { res as usize };
                    if got < len {
                        redo.push((i, got));
                    }
                }
                base += ws.len();
            }
            Ok(())
        });
        match chained {
            Some(r) => r?,
            None => {
                // No ring: every write as psync does it.
                for (off, data) in writes {
                    f.write_all_at(data, *off)?;
                }
                sync_done = false;
            }
        }
        // A short write (or one cancelled after it broke the chain): finish it here.
        for (i, got) in redo {
            let (off, data) = writes[i];
            f.write_all_at(&data[got..], off + got as u64)?;
            sync_done = false;
        }
        if !sync_done {
            sync_fallback(f)?;
        }
        Ok(())
    }

    fn read_batch(&self, f: &File, reads: &mut [Read<'_>]) -> Vec<io::Result<()>> {
        let fd = types::Fd(f.as_raw_fd());
        let mut out: Vec<io::Result<()>> = (0..reads.len()).map(|_| Ok(())).collect();
        let mut partial: Vec<(usize, usize)> = Vec::new();
        let mut done = Vec::with_capacity(DEPTH as usize);
        let batched = self.with_ring(|ring| {
            let mut base = 0usize;
            for rs in reads.chunks_mut(DEPTH as usize) {
                {
                    let mut sq = ring.submission();
                    for (j, (off, buf)) in rs.iter_mut().enumerate() {
                        let e = opcode::Read::new(fd, buf.as_mut_ptr(), buf.len() as u32)
                            .offset(*off)
                            .build()
                            .user_data((base + j) as u64);
                        // SAFETY: `buf` outlives the call, and the call waits below for
                        // this operation's completion before it returns.
                        unsafe { sq.push(&e) }.expect("a chunk fits the ring");
                    }
                }
                submit_wait(ring, rs.len());
                done.clear();
                reap(ring, &mut done);
                for &(ud, res) in &done {
                    let i = ud as usize;
                    let len = rs[i - base].1.len();
                    if res < 0 {
                        out[i] = Err(io::Error::from_raw_os_error(-res));
                    } else if (res as usize) < len {
                        partial.push((i, res as usize));
                    }
                }
                base += rs.len();
            }
        });
        if batched.is_none() {
            // No ring: every read as psync does it.
            for (r, (off, buf)) in out.iter_mut().zip(reads.iter_mut()) {
                *r = f.read_exact_at(buf, *off);
            }
        }
        for (i, got) in partial {
            let (off, buf) = &mut reads[i];
            out[i] = if got == 0 {
                Err(super::eof())
            } else {
                f.read_exact_at(&mut buf[got..], *off + got as u64)
            };
        }
        out
    }
}

impl BlockIo for Uring {
    fn engine(&self) -> &'static str {
        "uring"
    }

    fn create(&self, name: &str, size: u64) -> io::Result<()> {
        self.psync.create(name, size)
    }

    fn create_written(&self, files: &[super::NewFile<'_>]) -> Vec<io::Result<()>> {
        // New files, small ones mostly (one block each): psync's writes and shared
        // syncs; a ring would only chain one file's write to its own sync.
        self.psync.create_written_shared(files)
    }

    fn write_durable(&self, name: &str, writes: &[Write<'_>]) -> io::Result<()> {
        let f = self.psync.file(name)?;
        // One linked fdatasync (or its fallback).
        self.psync.synced(1);
        let r = self.write_chain(&f, writes);
        if r.is_err() {
            self.psync.forget(name);
        }
        r
    }

    fn syncs(&self) -> u64 {
        self.psync.syncs()
    }

    fn read_many(&self, name: &str, reads: &mut [Read<'_>]) -> Vec<io::Result<()>> {
        match self.psync.file(name) {
            Ok(f) => self.read_batch(&f, reads),
            Err(e) => reads
                .iter()
                .map(|_| Err(io::Error::new(e.kind(), e.to_string())))
                .collect(),
        }
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        self.psync.remove(name)
    }

    fn exists(&self, name: &str) -> bool {
        self.psync.exists(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Where io_uring cannot run (a sandbox), the engine is not made and the test says so.
    fn available() -> bool {
        match probe() {
            Ok(_) => true,
            Err(e) => {
                eprintln!("io_uring unavailable here ({e}); nothing to test");
                false
            }
        }
    }

    #[test]
    fn conformance() {
        if !available() {
            return;
        }
        super::super::conformance::run_all(&|dir: &Path| -> Arc<dyn BlockIo> {
            Arc::new(Uring::new(dir).expect("probed above"))
        });
    }

    #[test]
    fn more_threads_than_rings_all_complete() {
        if !available() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let io = Uring::new(dir.path()).unwrap();
        let n = MOST_RINGS + 16;
        io.create("f", (n * 4096) as u64).unwrap();
        std::thread::scope(|s| {
            for t in 0..n {
                let io = &io;
                s.spawn(move || {
                    for _ in 0..4 {
                        io.write_durable("f", &[((t * 4096) as u64, &[t as u8; 4096])])
                            .unwrap();
                        let mut b = [0u8; 4096];
                        io.read_many("f", &mut [((t * 4096) as u64, &mut b[..])])
                            .remove(0)
                            .unwrap();
                        assert_eq!(b, [t as u8; 4096]);
                    }
                });
            }
        });
        assert!(io.live.load(Ordering::Relaxed) <= MOST_RINGS);
        assert!(io.rings.lock().len() <= POOLED);
    }

    proptest::proptest! {
        #[test]
        fn behaves_as_the_in_memory_twin(steps in super::super::conformance::steps()) {
            if available() {
                let dir = tempfile::tempdir().unwrap();
                std::fs::create_dir(dir.path().join("ab")).unwrap();
                super::super::conformance::differential(&Uring::new(dir.path()).unwrap(), &steps);
            }
        }
    }

    #[test]
    fn auto_picks_an_engine_that_works() {
        let dir = tempfile::tempdir().unwrap();
        let io = super::super::open(super::super::IoEngine::Auto, dir.path()).unwrap();
        assert_eq!(io.engine(), if available() { "uring" } else { "psync" });
        io.create("f", 4096).unwrap();
        io.write_durable("f", &[(0, &[7u8; 4096])]).unwrap();
    }
}
