//! `shardcache-bench restart`: what the first epoch after a restart costs now that no
//! start trusts a block it did not check (docs/SEMANTICS.md section 1).
//!
//! A warm cache of large files (many blocks each) and small files (one block each) is
//! read once, every file, by parallel readers, with the page cache dropped before each
//! pass, in three ways per round:
//! - raw: the cache's data files read directly (the floor: the same bytes off the same
//!   disk, no daemon);
//! - warm: through the client, the daemon having checked every block already;
//! - first epoch: through the client right after an orderly restart (SIGTERM, start), so
//!   that every block is checked on first use while the background scrub runs.
//!
//! Raw and warm alternate which goes first; ratios are per round, their median printed.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use shardcache_client::{Client, ClientConfig};

use crate::{Bed, cache_data_file, drop_page_cache, median, write_file};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Args {
    /// Directory for the generated data and the cache (local disk).
    pub dir: PathBuf,
    /// Large files and their size in MiB.
    pub large_files: u64,
    /// Size of each large file in MiB.
    pub large_mib: u64,
    /// Small files and their size in KiB.
    pub small_files: u64,
    /// Size of each small file in KiB.
    pub small_kib: u64,
    /// Cache block size (a size string: "4MiB").
    pub block_size: String,
    /// Rounds.
    pub rounds: usize,
    /// Parallel readers.
    pub readers: usize,
}

/// Seconds to read the large files and the small files once.
#[derive(Debug, Clone, Copy)]
struct Pass {
    large: f64,
    small: f64,
}

fn read_through(r: &mut impl Read, buf: &mut [u8]) -> u64 {
    let mut total = 0;
    loop {
        match r.read(buf) {
            Ok(0) => return total,
            Ok(n) => total += n as u64,
            Err(e) => panic!("read failed: {e}"),
        }
    }
}

/// Reads every file of `files` once, `readers` threads each taking every `readers`-th
/// file; `open` opens one. Seconds.
fn parallel<R: Read>(
    files: &[PathBuf],
    readers: usize,
    buf_size: usize,
    open: &(dyn Fn(&Path) -> R + Sync),
) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for r in 0..readers {
            s.spawn(move || {
                let mut buf = vec![0u8; buf_size];
                for p in files.iter().skip(r).step_by(readers) {
                    read_through(&mut open(p), &mut buf);
                }
            });
        }
    });
    t.elapsed().as_secs_f64()
}

fn drop_all(paths: &[&[PathBuf]]) {
    for p in paths.iter().flat_map(|v| v.iter()) {
        drop_page_cache(p).expect("fadvise");
    }
}

/// Runs the benchmark and prints its table.
pub fn run(a: &Args) -> anyhow::Result<()> {
    let bed = Bed::new_in(&a.dir);
    let large: Vec<PathBuf> = (0..a.large_files)
        .map(|i| bed.path(&format!("large/L{i}.bin")))
        .collect();
    let small: Vec<PathBuf> = (0..a.small_files)
        .map(|i| bed.path(&format!("small/{:03}/S{i:06}.bin", i % 256)))
        .collect();
    eprintln!(
        "generating {} × {} MiB and {} × {} KiB in {} ...",
        a.large_files,
        a.large_mib,
        a.small_files,
        a.small_kib,
        bed.tmp.path().display()
    );
    for (i, p) in large.iter().enumerate() {
        write_file(p, i as u64, a.large_mib << 20);
    }
    for (i, p) in small.iter().enumerate() {
        write_file(p, 1000 + i as u64, a.small_kib << 10);
    }
    let args = [
        "--block-size",
        a.block_size.as_str(),
        "--min-free",
        "1GiB",
        "--log",
        "info",
    ];
    let mut daemon = bed.start(&args);
    let client = || {
        Client::with_config(ClientConfig {
            socket: bed.socket.clone(),
            ..ClientConfig::default()
        })
    };
    // Fill the cache.
    {
        let c = client();
        let open = |p: &Path| c.open(p).expect("open");
        parallel(&large, a.readers, 4 << 20, &open);
        parallel(&small, a.readers, 256 << 10, &open);
    }
    let s = daemon.status();
    anyhow::ensure!(
        s.files == a.large_files + a.small_files,
        "only {} of {} files cached: give the cache more room",
        s.files,
        a.large_files + a.small_files
    );
    let rel = |p: &PathBuf| -> String {
        p.strip_prefix(&bed.backing)
            .expect("under the root")
            .to_str()
            .expect("UTF-8")
            .to_owned()
    };
    let copies = |v: &[PathBuf]| -> Vec<PathBuf> {
        v.iter()
            .map(|p| cache_data_file(&bed.cache, &bed.backing, &rel(p)).expect("cached"))
            .collect()
    };
    let (large_data, small_data) = (copies(&large), copies(&small));
    let everything: [&[PathBuf]; 4] = [&large, &small, &large_data, &small_data];

    let raw_pass = || {
        drop_all(&everything);
        let open = |p: &Path| File::open(p).expect("open");
        Pass {
            large: parallel(&large_data, a.readers, 4 << 20, &open),
            small: parallel(&small_data, a.readers, 256 << 10, &open),
        }
    };
    let cache_pass = || {
        drop_all(&everything);
        let c = client();
        let open = |p: &Path| c.open(p).expect("open");
        let pass = Pass {
            large: parallel(&large, a.readers, 4 << 20, &open),
            small: parallel(&small, a.readers, 256 << 10, &open),
        };
        let st = c.status().expect("status");
        let fb = st.counters.fallback_bytes;
        assert_eq!(
            fb, 0,
            "the client read the backing store: not a cache measurement"
        );
        (pass, st.unverified_blocks)
    };

    let mut rows: Vec<(Pass, Pass, Pass)> = Vec::new();
    for r in 0..a.rounds {
        let (raw, warm) = if r % 2 == 0 {
            let raw = raw_pass();
            (raw, cache_pass().0)
        } else {
            let warm = cache_pass().0;
            (raw_pass(), warm)
        };
        assert!(daemon.stop(), "orderly shutdown");
        let t = Instant::now();
        daemon.restart();
        let start = t.elapsed().as_secs_f64();
        let unverified = daemon.status().unverified_blocks;
        let (first, left) = cache_pass();
        let c = daemon.counters();
        eprintln!(
            "  round {r}: large raw {:.2} s, warm {:.2} s, first epoch {:.2} s; small raw {:.2} s, warm {:.2} s, first epoch {:.2} s; start {start:.2} s; unverified {unverified} at start, {left} after the epoch; {} checked, {} corrupt",
            raw.large,
            warm.large,
            first.large,
            raw.small,
            warm.small,
            first.small,
            c.blocks_verified,
            c.corrupt_blocks,
        );
        rows.push((raw, warm, first));
    }
    daemon.stop();

    let large_bytes = (a.large_files * a.large_mib) as f64; // MiB
    let med =
        |f: &dyn Fn(&(Pass, Pass, Pass)) -> f64| median(&rows.iter().map(f).collect::<Vec<_>>());
    println!();
    println!(
        "shardcache restart benchmark: {} × {} MiB and {} × {} KiB, block {}, {} readers, {} rounds, page cache dropped before each pass",
        a.large_files, a.large_mib, a.small_files, a.small_kib, a.block_size, a.readers, a.rounds
    );
    println!(
        "{:<16}{:>12}{:>12}{:>14}{:>16}{:>16}{:>14}",
        "(medians)", "raw", "warm", "first epoch", "first ÷ warm", "first ÷ raw", "warm ÷ raw"
    );
    println!(
        "{:<16}{:>8.0} MiB/s{:>6.0} MiB/s{:>8.0} MiB/s{:>16.3}{:>16.3}{:>14.3}",
        "large files",
        large_bytes / med(&|r| r.0.large),
        large_bytes / med(&|r| r.1.large),
        large_bytes / med(&|r| r.2.large),
        med(&|r| r.1.large / r.2.large),
        med(&|r| r.0.large / r.2.large),
        med(&|r| r.0.large / r.1.large),
    );
    let n = a.small_files as f64;
    println!(
        "{:<16}{:>10.0} f/s{:>8.0} f/s{:>10.0} f/s{:>16.3}{:>16.3}{:>14.3}",
        "small files",
        n / med(&|r| r.0.small),
        n / med(&|r| r.1.small),
        n / med(&|r| r.2.small),
        med(&|r| r.1.small / r.2.small),
        med(&|r| r.0.small / r.2.small),
        med(&|r| r.0.small / r.1.small),
    );
    println!("ratios are throughputs (higher is better; 1.0 = as fast as the reference)");
    Ok(())
}
