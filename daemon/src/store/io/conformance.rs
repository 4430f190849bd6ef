//! One conformance suite for every [`BlockIo`] engine and wrapper, so that psync,
//! io_uring and the in-memory twin cannot drift apart: plain functions over the trait,
//! each on a fresh data directory.

use std::io;
use std::path::Path;
use std::sync::Arc;

use super::{BlockIo, NewFile};

/// Runs every check; `new` makes an engine over an empty data directory (with the
/// subdirectory `ab/` the names below use).
pub(crate) fn run_all(new: &dyn Fn(&Path) -> Arc<dyn BlockIo>) {
    type Check = fn(&dyn BlockIo);
    let checks: [(&str, Check); 10] = [
        ("a created file is all hole", a_created_file_is_all_hole),
        ("written blocks read back", written_blocks_read_back),
        ("reads past the end fail", reads_past_the_end_fail),
        ("create replaces", create_replaces),
        ("removed files are gone", removed_files_are_gone),
        (
            "more files than descriptors kept",
            more_files_than_descriptors_kept,
        ),
        ("a batch longer than a ring", a_batch_longer_than_a_ring),
        ("empty batches", empty_batches),
        (
            "files created and written at once",
            files_created_and_written_at_once,
        ),
        (
            "threads write blocks of one file",
            threads_write_blocks_of_one_file,
        ),
    ];
    for (what, check) in checks {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("ab")).expect("mkdir");
        let io = new(dir.path());
        eprintln!("conformance ({}): {what}", io.engine());
        check(&*io);
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn read(io: &dyn BlockIo, name: &str, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0xEE; len];
    io.read_many(name, &mut [(off, &mut buf[..])])
        .remove(0)
        .map(|()| buf)
}

fn a_created_file_is_all_hole(io: &dyn BlockIo) {
    assert!(!io.exists("ab/f.1"));
    io.create("ab/f.1", 3 * 4096 + 17).unwrap();
    assert!(io.exists("ab/f.1"));
    assert_eq!(
        read(io, "ab/f.1", 0, 3 * 4096 + 17).unwrap(),
        vec![0; 3 * 4096 + 17]
    );
}

fn written_blocks_read_back(io: &dyn BlockIo) {
    io.create("ab/f.1", 4 * 4096).unwrap();
    let (a, b, c) = (pattern(1, 4096), pattern(2, 4096), pattern(3, 100));
    io.write_durable("ab/f.1", &[(0, &a), (2 * 4096, &b)])
        .unwrap();
    io.write_durable("ab/f.1", &[(3 * 4096, &c)]).unwrap();
    let mut x = vec![0; 4096];
    let mut y = vec![0xEE; 4096];
    let mut z = vec![0; 4096];
    let mut w = vec![0; 100];
    let r = io.read_many(
        "ab/f.1",
        &mut [
            (2 * 4096, &mut z[..]),
            (0, &mut x[..]),
            (4096, &mut y[..]),
            (3 * 4096, &mut w[..]),
        ],
    );
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!((x, z, w), (a, b, c));
    assert_eq!(y, vec![0; 4096], "a hole between blocks reads as zeros");
}

fn reads_past_the_end_fail(io: &dyn BlockIo) {
    io.create("ab/f.1", 4096).unwrap();
    let mut ok = vec![0; 4096];
    let mut past = vec![0; 4096];
    let r = io.read_many("ab/f.1", &mut [(0, &mut ok[..]), (100, &mut past[..])]);
    assert!(r[0].is_ok());
    assert_eq!(
        r[1].as_ref().unwrap_err().kind(),
        io::ErrorKind::UnexpectedEof
    );
    let r = io.read_many("ab/none.1", &mut [(0, &mut ok[..]), (0, &mut past[..])]);
    assert_eq!(r.len(), 2);
    assert!(
        r.iter()
            .all(|r| r.as_ref().unwrap_err().kind() == io::ErrorKind::NotFound)
    );
}

fn create_replaces(io: &dyn BlockIo) {
    io.create("ab/f.1", 8192).unwrap();
    io.write_durable("ab/f.1", &[(0, &pattern(4, 8192))])
        .unwrap();
    io.create("ab/f.1", 4096).unwrap();
    assert_eq!(read(io, "ab/f.1", 0, 4096).unwrap(), vec![0; 4096]);
    assert!(read(io, "ab/f.1", 4096, 1).is_err(), "the new length holds");
}

fn files_created_and_written_at_once(io: &dyn BlockIo) {
    // An old file of the same name is replaced.
    io.create("ab/g.1", 4096).unwrap();
    io.write_durable("ab/g.1", &[(0, &pattern(9, 4096))])
        .unwrap();
    let a = pattern(6, 5000);
    let b = pattern(7, 4096);
    let wa = [(0, &a[..])];
    let wb = [(4096, &b[..])];
    let files = [
        NewFile {
            name: "ab/f.1",
            size: 5000,
            writes: &wa,
        },
        NewFile {
            name: "ab/g.1",
            size: 8192,
            writes: &wb,
        },
    ];
    let r = io.create_written(&files);
    assert_eq!(r.len(), 2);
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(read(io, "ab/f.1", 0, 5000).unwrap(), a);
    assert_eq!(
        read(io, "ab/g.1", 0, 4096).unwrap(),
        vec![0; 4096],
        "replaced"
    );
    assert_eq!(read(io, "ab/g.1", 4096, 4096).unwrap(), b);
    assert!(read(io, "ab/g.1", 8192, 1).is_err(), "its new length");
    assert!(io.create_written(&[]).is_empty());
}

fn removed_files_are_gone(io: &dyn BlockIo) {
    io.create("ab/f.1", 4096).unwrap();
    io.write_durable("ab/f.1", &[(0, &pattern(5, 4096))])
        .unwrap();
    io.remove("ab/f.1").unwrap();
    assert!(!io.exists("ab/f.1"));
    assert_eq!(
        io.remove("ab/f.1").unwrap_err().kind(),
        io::ErrorKind::NotFound
    );
    assert_eq!(
        read(io, "ab/f.1", 0, 1).unwrap_err().kind(),
        io::ErrorKind::NotFound
    );
    let e = io.write_durable("ab/f.1", &[(0, b"x")]).unwrap_err();
    assert_eq!(
        e.kind(),
        io::ErrorKind::NotFound,
        "a write never recreates a file"
    );
    io.create("ab/f.1", 4096).unwrap();
    assert_eq!(read(io, "ab/f.1", 0, 4096).unwrap(), vec![0; 4096]);
}

fn more_files_than_descriptors_kept(io: &dyn BlockIo) {
    let n = super::psync::KEPT + 20;
    for i in 0..n {
        io.create(&format!("ab/f.{i}"), 4096).unwrap();
    }
    for round in 0..2u8 {
        for i in 0..n {
            let d = pattern(i as u8 ^ round, 4096);
            io.write_durable(&format!("ab/f.{i}"), &[(0, &d)]).unwrap();
        }
        for i in (0..n).rev() {
            assert_eq!(
                read(io, &format!("ab/f.{i}"), 0, 4096).unwrap(),
                pattern(i as u8 ^ round, 4096)
            );
        }
    }
    for i in 0..n {
        io.remove(&format!("ab/f.{i}")).unwrap();
    }
}

fn a_batch_longer_than_a_ring(io: &dyn BlockIo) {
    let n = 300usize;
    io.create("ab/big.1", (n * 4096) as u64).unwrap();
    let data: Vec<Vec<u8>> = (0..n).map(|i| pattern(i as u8, 4096)).collect();
    let writes: Vec<(u64, &[u8])> = data
        .iter()
        .enumerate()
        .map(|(i, d)| ((i * 4096) as u64, &d[..]))
        .collect();
    io.write_durable("ab/big.1", &writes).unwrap();
    let mut bufs = vec![vec![0u8; 4096]; n];
    let mut reads: Vec<(u64, &mut [u8])> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| ((i * 4096) as u64, &mut b[..]))
        .collect();
    assert!(
        io.read_many("ab/big.1", &mut reads)
            .iter()
            .all(Result::is_ok)
    );
    assert_eq!(bufs, data);
}

fn empty_batches(io: &dyn BlockIo) {
    io.create("ab/f.1", 4096).unwrap();
    io.write_durable("ab/f.1", &[]).unwrap();
    assert!(io.read_many("ab/f.1", &mut []).is_empty());
}

fn threads_write_blocks_of_one_file(io: &dyn BlockIo) {
    let bs = 64 << 10;
    io.create("ab/f.1", 16 * bs as u64).unwrap();
    std::thread::scope(|s| {
        for t in 0..4usize {
            s.spawn(move || {
                for i in (t..16).step_by(4) {
                    io.write_durable("ab/f.1", &[((i * bs) as u64, &pattern(i as u8, bs))])
                        .unwrap();
                    assert_eq!(
                        read(io, "ab/f.1", (i * bs) as u64, bs).unwrap(),
                        pattern(i as u8, bs)
                    );
                }
            });
        }
    });
    for i in 0..16 {
        assert_eq!(
            read(io, "ab/f.1", (i * bs) as u64, bs).unwrap(),
            pattern(i as u8, bs)
        );
    }
}

/// One step of [`differential`].
#[derive(Debug, Clone)]
pub(crate) enum Step {
    Create(usize, u64),
    /// File, then (block, seed) writes in one batch.
    Write(usize, Vec<(u64, u8)>),
    /// File, then blocks read in one batch.
    Read(usize, Vec<u64>),
    Remove(usize),
}

/// Random steps over a few files of up to 8 blocks of 4 KiB (reads and writes may reach
/// past the end).
pub(crate) fn steps() -> impl proptest::strategy::Strategy<Value = Vec<Step>> {
    use proptest::prelude::*;
    let step = prop_oneof![
        1 => (0..3usize, 0..8u64).prop_map(|(f, n)| Step::Create(f, n * 4096 + n * 7)),
        3 => (0..3usize, proptest::collection::vec((0..9u64, any::<u8>()), 0..5))
            .prop_map(|(f, w)| Step::Write(f, w)),
        3 => (0..3usize, proptest::collection::vec(0..9u64, 0..5)).prop_map(|(f, r)| Step::Read(f, r)),
        1 => (0..3usize).prop_map(Step::Remove),
    ];
    proptest::collection::vec(step, 1..30)
}

/// Runs `steps` on `io` and on the in-memory twin: every result (success, error kind,
/// bytes read) must be the same. Writes go to distinct blocks within a batch.
pub(crate) fn differential(io: &dyn BlockIo, steps: &[Step]) {
    let twin = super::mem::MemIo::new();
    let name = |f: usize| format!("ab/f.{f}");
    for step in steps {
        match step {
            Step::Create(f, size) => {
                assert_eq!(
                    io.create(&name(*f), *size).is_ok(),
                    twin.create(&name(*f), *size).is_ok()
                );
            }
            Step::Write(f, ws) => {
                let mut seen = std::collections::BTreeSet::new();
                let data: Vec<(u64, Vec<u8>)> = ws
                    .iter()
                    .filter(|(b, _)| seen.insert(*b))
                    .map(|(b, seed)| (b * 4096, pattern(*seed, 4096)))
                    .collect();
                let batch: Vec<(u64, &[u8])> = data.iter().map(|(o, d)| (*o, &d[..])).collect();
                let (a, b) = (
                    io.write_durable(&name(*f), &batch),
                    twin.write_durable(&name(*f), &batch),
                );
                assert_eq!(
                    a.as_ref().map_err(io::Error::kind),
                    b.as_ref().map_err(io::Error::kind),
                    "{step:?}"
                );
            }
            Step::Read(f, rs) => {
                let run = |e: &dyn BlockIo| {
                    let mut bufs = vec![vec![0u8; 4096]; rs.len()];
                    let mut reads: Vec<(u64, &mut [u8])> = rs
                        .iter()
                        .zip(bufs.iter_mut())
                        .map(|(b, buf)| (b * 4096, &mut buf[..]))
                        .collect();
                    let r: Vec<_> = e
                        .read_many(&name(*f), &mut reads)
                        .into_iter()
                        .map(|r| r.map_err(|e| e.kind()))
                        .collect();
                    // What a failed read left in its buffer is unspecified.
                    let got: Vec<_> = bufs
                        .into_iter()
                        .zip(&r)
                        .filter(|(_, r)| r.is_ok())
                        .map(|(b, _)| b)
                        .collect();
                    (r, got)
                };
                assert_eq!(run(io), run(&twin), "{step:?}");
            }
            Step::Remove(f) => {
                let (a, b) = (io.remove(&name(*f)), twin.remove(&name(*f)));
                assert_eq!(a.map_err(|e| e.kind()), b.map_err(|e| e.kind()), "{step:?}");
            }
        }
        for f in 0..3 {
            assert_eq!(io.exists(&name(f)), twin.exists(&name(f)));
        }
    }
}
