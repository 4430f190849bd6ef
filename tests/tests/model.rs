//! Reference-model property test against the real daemon: random reads, backing-file
//! rewrites (in place and by rename), clean restarts, crashes, on-disk corruption and
//! verification. The model is a map of the backing files; the invariant is that no read
//! through the client ever returns bytes that differ from the model.
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::os::unix::fs::FileExt;

use proptest::prelude::*;
use shardcache_tests::{Bed, cache_data_file, content, write_file};

const BS: u64 = 64 << 10;
const SIZES: [u64; 3] = [BS * 5 / 2, BS, 3 * BS + 17];
const NEW_SIZES: [u64; 4] = [0, 1, BS + 1, 2 * BS];

#[derive(Debug, Clone)]
enum Op {
    Read { file: usize, at: f64, len: u64 },
    ReadAll(usize),
    RewriteInPlace(usize),
    Replace(usize),
    Resize(usize, usize),
    Restart,
    Crash,
    CorruptThenCrash(usize),
    Verify,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, 0.0..1.0f64, 1..3 * BS).prop_map(|(file, at, len)| Op::Read { file, at, len }),
        3 => (0..3usize).prop_map(Op::ReadAll),
        1 => (0..3usize).prop_map(Op::RewriteInPlace),
        1 => (0..3usize).prop_map(Op::Replace),
        1 => (0..3usize, 0..4usize).prop_map(|(f, s)| Op::Resize(f, s)),
        1 => Just(Op::Restart),
        1 => Just(Op::Crash),
        1 => (0..3usize).prop_map(Op::CorruptThenCrash),
        1 => Just(Op::Verify),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, max_shrink_iters: 20, ..ProptestConfig::default() })]
    #[test]
    fn reads_through_the_daemon_always_match_the_backing_files(
        ops in proptest::collection::vec(op(), 10..35),
        small_cache in any::<bool>(),
    ) {
        let bed = Bed::new();
        let mut seeds = [1u64, 2, 3];
        let mut sizes = SIZES;
        let name = |f: usize| format!("f{f}");
        for f in 0..3 {
            write_file(&bed.path(&name(f)), seeds[f], SIZES[f]);
        }
        // A cache of three blocks forces evictions on nearly every read.
        let capacity = if small_cache { "192KiB" } else { "1GiB" };
        let mut d = bed.start(&["--block-size", "64KiB", "--metadata-ttl", "0", "--capacity", capacity, "--min-free", "0"]);
        let client = bed.client();
        let mut next_seed = 10;
        for op in ops {
            match op {
                Op::Read { file, at, len } => {
                    let want = content(seeds[file], sizes[file]);
                    let off = (at * sizes[file] as f64) as u64;
                    if sizes[file] == 0 {
                        let r = client.open(bed.path(&name(file))).unwrap();
                        prop_assert_eq!(r.read_at(&mut [0u8; 16], 0).unwrap(), 0);
                        continue;
                    }
                    let r = client.open(bed.path(&name(file))).unwrap();
                    let mut buf = vec![0u8; len as usize];
                    let n = r.read_at(&mut buf, off).unwrap();
                    let end = (off + len).min(sizes[file]);
                    prop_assert!(n as u64 <= end - off);
                    prop_assert!(buf[..n] == want[off as usize..off as usize + n], "read of {} at {off}", name(file));
                }
                Op::ReadAll(file) => {
                    let (got, _) = shardcache_tests::read_all(&client, &bed.path(&name(file))).unwrap();
                    prop_assert!(got == content(seeds[file], sizes[file]), "whole read of {}", name(file));
                }
                Op::RewriteInPlace(file) => {
                    next_seed += 1;
                    seeds[file] = next_seed;
                    let f = std::fs::OpenOptions::new().write(true).open(bed.path(&name(file))).unwrap();
                    f.write_all_at(&content(next_seed, sizes[file]), 0).unwrap();
                    f.sync_all().unwrap();
                }
                Op::Replace(file) => {
                    next_seed += 1;
                    seeds[file] = next_seed;
                    let tmp = bed.path(&format!("{}.tmp", name(file)));
                    write_file(&tmp, next_seed, sizes[file]);
                    std::fs::rename(&tmp, bed.path(&name(file))).unwrap();
                }
                Op::Resize(file, s) => {
                    next_seed += 1;
                    seeds[file] = next_seed;
                    sizes[file] = NEW_SIZES[s];
                    let tmp = bed.path(&format!("{}.tmp", name(file)));
                    write_file(&tmp, next_seed, sizes[file]);
                    std::fs::rename(&tmp, bed.path(&name(file))).unwrap();
                }
                Op::Restart => {
                    prop_assert!(d.stop(), "clean shutdown");
                    d.restart();
                }
                Op::Crash => {
                    d.kill9();
                    d.restart();
                }
                Op::CorruptThenCrash(file) => {
                    d.kill9();
                    if let Some(df) = cache_data_file(&bed.cache, &bed.backing, &name(file)) {
                        let f = std::fs::OpenOptions::new().write(true).open(&df).unwrap();
                        f.write_all_at(b"corrupted!", BS / 2).unwrap();
                    }
                    d.restart();
                }
                Op::Verify => {
                    client.verify(std::time::Duration::from_secs(60)).unwrap();
                }
            }
        }
        d.stop();
    }
}
