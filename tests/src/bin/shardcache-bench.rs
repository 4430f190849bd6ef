//! `shardcache-bench`: measures shardcache against raw baselines taken in the same run
//! (absolute numbers on shared machines are noise; ratios are what we compare).
//!
//! `shardcache-bench foundation` (the README's benchmark command):
//! - cold fill: reading files through a cold cache (the daemon fills NVMe durably while
//!   the client reads) ÷ a raw durable copy of the same backing files (read, write,
//!   fsync), backing page cache dropped before each;
//! - warm sequential: reading the cached files through the client ÷ reading the same
//!   local cache files directly, from disk (page cache dropped) and from page cache;
//! - small files: warm open+read+close of 100 KiB files through the client ÷ the same
//!   on the local cache files directly (p50, p99, files/s).
//! - store engine: cold fill and `shardcache verify` (every block read back from disk and
//!   checked) with `--io-engine uring` ÷ `--io-engine psync`, each on an empty cache, on
//!   the same files in the same run (`--engine-rounds`, 0 leaves it out; skipped where
//!   io_uring cannot run).
//!
//! Rounds alternate which side goes first; the median ratio is reported.
//!
//! `shardcache-bench restart`: the first epoch after a restart ÷ the same read before it
//! and ÷ a raw read of the cache's data files (see `restartbench.rs`).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use shardcache_client::{Client, ClientConfig};
use shardcache_tests::{
    Bed, Daemon, cache_data_file, drop_page_cache, median, quantile_us, write_file,
};

#[derive(Debug, Parser)]
#[command(name = "shardcache-bench")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, clap::Args)]
struct SmallArgs {
    /// Directory for the generated data and the cache (local disk).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Number of files.
    #[arg(long, default_value_t = 4000)]
    files: u64,
    /// Size of each file in KiB.
    #[arg(long, default_value_t = 100)]
    kib: u64,
    /// Readers at once (repeat for several rows).
    #[arg(long, default_values_t = COLD_READERS)]
    readers: Vec<usize>,
    /// Rounds per row (alternating which side goes first).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Read the files already under this directory, subdirectories included (the first
    /// `--files` of them by path; fewer is an error) instead of generating them: a mount of shared storage, say
    /// `../shared/testbed/slow-storage.sh`'s. It is the daemon's backing root.
    #[arg(long)]
    root: Option<PathBuf>,
    /// The daemon's `cold_reads` (who reads a cold small file first): through, direct or
    /// auto.
    #[arg(long, default_value = "through")]
    cold_reads: String,
    /// Files each reader opens per exchange with the daemon (`open_many`, as a loader's
    /// `__getitems__` does; the plain side reads the same batches); 1 opens one by one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    batch: u64,
    /// More arguments for the daemon (repeat; e.g. `--daemon-arg=--fill-workers=8`).
    #[arg(long, allow_hyphen_values = true)]
    daemon_arg: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The single-node data path: cold fill, warm sequential, small files.
    Foundation(Foundation),
    /// Cold small files only: N readers through the cache ÷ N plain readers.
    Small(SmallArgs),
    /// The planner's retention and prefetch against LRU: in a simulated node, then in the
    /// real daemon over a throttled in-memory backing store.
    Policy(PolicyArgs),
    /// Peers: block transfer ÷ raw TCP, and placement across nodes (real daemons on
    /// loopback addresses, in this process).
    Peers {
        /// Directory for the data and the caches.
        #[arg(long, default_value_os_t = std::env::temp_dir())]
        dir: PathBuf,
        /// MiB transferred per measurement.
        #[arg(long, default_value_t = 256)]
        mib: u64,
        /// Transfer rounds (each measures the peer fetch and both raw baselines once,
        /// in a rotating order).
        #[arg(long, default_value_t = 9)]
        rounds: usize,
        /// Transfer over mutual TLS on the peer port (the placement part is left out).
        #[arg(long)]
        tls: bool,
        /// Transfer between two network namespaces of the testbed (root only; placement
        /// is left out), the link shaped to this `tc` rate (`1gbit`, `10gbit`; `none`:
        /// unshaped veth), instead of loopback.
        #[arg(long, requires = "testbed")]
        link: Option<String>,
        /// The testbed script (`cluster-net.sh`: up / addr / down of namespaces sc-n1,
        /// sc-n2 behind a bridge); it is taken down at the end, on failure too.
        #[arg(long, env = "SHARDCACHE_TESTBED")]
        testbed: Option<PathBuf>,
    },
    /// Cluster placement with real size spreads: per epoch, backing bytes ÷ the dataset
    /// against the floor, local reads, and cache use against capacity (daemons on
    /// loopback, in this process).
    Placement {
        /// Directory for the data and the caches.
        #[arg(long, default_value_os_t = std::env::temp_dir())]
        dir: PathBuf,
        /// Nodes (one rank each).
        #[arg(long, default_value_t = 4)]
        nodes: usize,
        /// Aggregate cache ÷ dataset (repeat for several runs).
        #[arg(long, default_values_t = [1.0])]
        a: Vec<f64>,
        /// File sizes: fixed, lognormal (σ 0.5, as JPEGs), mix (one file in ten 8×) or
        /// shards (uniform over 1 : 16 around the mean, as tar shards).
        #[arg(long, value_enum, default_value = "lognormal")]
        sizes: shardcache_tests::peerbench::Sizes,
        /// Files in the dataset.
        #[arg(long, default_value_t = 400)]
        files: u64,
        /// Mean file size in KiB.
        #[arg(long, default_value_t = 128)]
        kib: u64,
        /// Epochs (the first is cold).
        #[arg(long, default_value_t = 10)]
        epochs: u64,
        /// Whether the manifest gives every file's size (the placement then counts
        /// bytes): repeat for both (`--declare-sizes true --declare-sizes false`).
        #[arg(long, default_values_t = [true])]
        declare_sizes: Vec<bool>,
        /// Ranks out of lockstep: each reads at 1 ± this of the mean pace (drawn per
        /// epoch; the epoch ends when the slowest is done). 0: lockstep.
        #[arg(long, default_value_t = 0.0)]
        drift: f64,
        /// Ranks out of lockstep: each reads at 1 ± this of the mean pace, drawn again
        /// at every step (they wander apart and back). 0: lockstep.
        #[arg(long, default_value_t = 0.0)]
        jitter: f64,
        /// Ranks per node (as `torchrun --nproc-per-node`): each registers its own
        /// manifest with the node's daemon, which merges them into one plan.
        #[arg(long, default_value_t = 1)]
        ranks_per_node: usize,
        /// Run the nodes in network namespaces of this testbed script (`cluster-net.sh`,
        /// root only; taken down at the end, on failure too) instead of on loopback.
        #[arg(long)]
        testbed: Option<PathBuf>,
        /// The testbed links' `tc` rate (`none`: unshaped veth).
        #[arg(long, default_value = "1gbit", requires = "testbed")]
        link: String,
        /// The daemons' cluster placement (`placement`): simulate or forward.
        #[arg(long, default_value_t = shardcache_daemon::planner::cluster::Scheme::Simulate)]
        placement: shardcache_daemon::planner::cluster::Scheme,
    },
    /// A silent peer: read latency on the healthy nodes of a 4-node testbed while one
    /// node drops every packet (root only; `cluster-net.sh` with nftables).
    Silent {
        /// Directory for the data and the caches.
        #[arg(long, default_value_os_t = std::env::temp_dir())]
        dir: PathBuf,
        /// The testbed script (`cluster-net.sh`); taken down at the end, on failure too.
        #[arg(long, env = "SHARDCACHE_TESTBED")]
        testbed: PathBuf,
        /// The links' `tc` rate.
        #[arg(long, default_value = "1gbit")]
        link: String,
        /// Files in the dataset.
        #[arg(long, default_value_t = 400)]
        files: u64,
        /// Size of each file in KiB.
        #[arg(long, default_value_t = 1024)]
        file_kib: u64,
        /// Seconds the node is silent.
        #[arg(long, default_value_t = 15)]
        outage: u64,
    },
    /// The first epoch after a restart (every block checked on first use) against the
    /// same read before it and a raw read of the cache's data files.
    Restart(RestartArgs),
    /// The cluster placement at scale: one node's planner simulating M nodes × R ranks
    /// over N files (the real planner and placement, no sockets), each (M, N) in a child
    /// process: CPU per epoch on the open path, µs per open, local reads, backing,
    /// copies moved per read, bytes per file.
    PlacementScale {
        /// Nodes (repeat for several rows).
        #[arg(long, default_values_t = [8, 64, 256, 1024])]
        nodes: Vec<u64>,
        /// Files (repeat for several columns of rows).
        #[arg(long, default_values_t = [100_000, 1_280_000])]
        files: Vec<u64>,
        /// Ranks per node.
        #[arg(long, default_value_t = 8)]
        ranks_per_node: u64,
        /// Aggregate cache ÷ dataset.
        #[arg(long, default_value_t = 1.0)]
        a: f64,
        /// Shuffle seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Placement schemes: simulate, forward (repeat for several groups of rows).
        #[arg(long, default_values_t = [shardcache_daemon::planner::cluster::Scheme::Simulate])]
        placement: Vec<shardcache_daemon::planner::cluster::Scheme>,
        /// One cell (the first of `--placement`, `--nodes` and `--files`) in this
        /// process, printed as a line for the parent.
        #[arg(long, hide = true)]
        one: bool,
    },
    /// The planner's eviction index against an exhaustive search, at scale.
    PlannerScale {
        /// Files in the dataset (half of them cached).
        #[arg(long, default_value_t = 100_000)]
        files: usize,
    },
}

#[derive(Debug, clap::Args)]
struct RestartArgs {
    /// Directory for the generated data and the cache (local disk).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Number of large files.
    #[arg(long, default_value_t = 8)]
    large_files: u64,
    /// Size of each large file in MiB.
    #[arg(long, default_value_t = 256)]
    large_mib: u64,
    /// Number of small files.
    #[arg(long, default_value_t = 20_000)]
    small_files: u64,
    /// Size of each small file in KiB.
    #[arg(long, default_value_t = 100)]
    small_kib: u64,
    /// Cache block size.
    #[arg(long, default_value = "4MiB")]
    block_size: String,
    /// Rounds (each: raw and warm, alternating, then a restart and the first epoch).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Parallel readers.
    #[arg(long, default_value_t = 8)]
    readers: usize,
}

#[derive(Debug, clap::Args)]
struct PolicyArgs {
    /// Files in the dataset (all the same size).
    #[arg(long, default_value_t = 1000)]
    files: usize,
    /// Epochs simulated (the first is cold and not counted).
    #[arg(long, default_value_t = 5)]
    epochs: u64,
    /// Shuffle seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Most files fetched ahead of the reader; 0 = as many as the cache holds (the
    /// planner's rules are what bound prefetch).
    #[arg(long, default_value_t = 0)]
    window: usize,
    /// Files in the live run's dataset.
    #[arg(long, default_value_t = 200)]
    live_files: u64,
    /// Size of each file in the live run (one cache block).
    #[arg(long, default_value = "256KiB")]
    live_file_size: String,
    /// Backing bandwidth B of the live run.
    #[arg(long, default_value = "48MiB")]
    live_bandwidth: String,
    /// Epochs of the live run (the first is cold and not counted).
    #[arg(long, default_value_t = 4)]
    live_epochs: u64,
    /// Where the live run's cache lives [default: /dev/shm if present, else the
    /// temporary directory]: the policy is measured, not the disk.
    #[arg(long)]
    live_cache_dir: Option<PathBuf>,
    /// Skip the live run.
    #[arg(long)]
    sim_only: bool,
    /// Skip the simulation.
    #[arg(long)]
    live_only: bool,
}

/// Time per eviction choice with the planner's index (`victim_indexed`) and with an
/// exhaustive search over the cached files (`victim`), and per planned read.
fn planner_scale(n: usize) {
    use shardcache_daemon::planner::{FileRef, Planner, Source};
    let fs: Vec<FileRef> = (0..n)
        .map(|i| FileRef {
            root: 0,
            path: format!("train/{i:08}.jpg").into(),
        })
        .collect();
    let mut p = Planner::new();
    let source = Source::Shuffle {
        seed: 1,
        first: 0,
        count: 3,
        world: 1,
        ranks: vec![0],
        drop_last: false,
    };
    p.register("j", fs.clone(), source).expect("register");
    let cached: Vec<FileRef> = fs.iter().step_by(2).cloned().collect();
    for f in &cached {
        p.set_resident(f, true);
    }
    let per = |k: u32, t: Instant| t.elapsed().as_secs_f64() / k as f64 * 1e6;
    let t = Instant::now();
    let mut a = None;
    for _ in 0..10_000 {
        a = std::hint::black_box(p.victim_indexed(&|_| true));
    }
    let idx = per(10_000, t);
    let t = Instant::now();
    let mut b = None;
    for _ in 0..5 {
        b = std::hint::black_box(p.victim(&cached)).map(|i| cached[i].clone());
    }
    let scan = per(5, t);
    let same = a.as_ref().map(|f| p.need(f)) == b.as_ref().map(|f| p.need(f));
    let order = shardcache_plan::shuffle::node_order(n as u64, 1, 0, 1, &[0], false);
    let t = Instant::now();
    for &i in order.iter().take(10_000) {
        p.on_access(&fs[i as usize], 8);
    }
    let read = per(10_000, t);
    println!(
        "{} files, {} cached: eviction choice {idx:.1} µs with the index, {scan:.0} µs by exhaustive search ({:.0}× faster, same choice: {same}); a planned read updates the index in {read:.1} µs",
        n,
        cached.len(),
        scan / idx
    );
}

fn policy(a: &PolicyArgs) {
    if !a.live_only {
        policy_sim(a);
    }
    if !a.sim_only {
        if !a.live_only {
            println!();
        }
        policy_live(a);
    }
}

fn policy_live(a: &PolicyArgs) {
    use shardcache_tests::live::{Params, run};
    let size = shardcache_daemon::config::parse_bytes(&a.live_file_size).expect("--live-file-size");
    let bw = shardcache_daemon::config::parse_bytes(&a.live_bandwidth).expect("--live-bandwidth");
    let shm = Path::new("/dev/shm");
    let cache_parent = a.live_cache_dir.clone().unwrap_or_else(|| {
        if shm.is_dir() {
            shm.to_owned()
        } else {
            std::env::temp_dir()
        }
    });
    println!(
        "live: the daemon (planner, prefetcher, store in {}, fill workers, request handlers) over an in-memory store throttled to B = {} ({:.0} files/s); {} files of {}, {} epochs (first not counted)",
        cache_parent.display(),
        a.live_bandwidth,
        bw as f64 / size as f64,
        a.live_files,
        a.live_file_size,
        a.live_epochs
    );
    println!(
        "{:>5} {:>5} | {:>13} {:>13} | {:>8} {:>8} {:>8} | {:>9} {:>8} | {:>9}",
        "C/N",
        "R/B",
        "hit÷(C/N)",
        "LRU hit÷(C/N)",
        "stall",
        "floor",
        "LRU",
        "backing",
        "floor",
        "open hits"
    );
    for cn in [0.25, 0.5, 0.75] {
        for rb in [0.5, 2.0, 4.0] {
            let p = Params {
                files: a.live_files,
                file_size: size,
                cn,
                bandwidth: bw,
                rb,
                epochs: a.live_epochs,
                seed: a.seed,
                planned: true,
                cache_parent: cache_parent.clone(),
            };
            let ours = run(&p).expect("live run");
            let base = run(&Params {
                planned: false,
                ..p
            })
            .expect("live LRU run");
            let row = policy_row(
                cn,
                rb,
                [ours.hit_rate, base.hit_rate],
                [ours.stall, base.stall],
                ours.backing_per_epoch,
            );
            println!("{row} | {:>9.3}", ours.open_hits);
        }
    }
    println!(
        "hit = 1 − backing bytes ÷ bytes read; open hits = reads that found their file cached whole (prefetched or kept)"
    );
}

/// One row of a policy table: hit rates (planned, LRU) ÷ C/N, stalls (planned, floor,
/// LRU), backing traffic per epoch and its floor.
fn policy_row(cn: f64, rb: f64, hit: [f64; 2], stall: [f64; 2], backing: f64) -> String {
    use shardcache_tests::policy::stall_floor;
    format!(
        "{:>5.2} {:>5.1} | {:>13.3} {:>13.3} | {:>8.3} {:>8.3} {:>8.3} | {:>9.3} {:>8.3}",
        cn,
        rb,
        hit[0] / cn,
        hit[1] / cn,
        stall[0],
        stall_floor(cn, rb, 1.0),
        stall[1],
        backing,
        1.0 - cn
    )
}

fn policy_sim(a: &PolicyArgs) {
    use shardcache_tests::policy::{lru, planned};
    println!(
        "policy benchmark: {} files, {} epochs (first not counted), shuffled, prefetch window {}; backing bandwidth B = 1 file/s",
        a.files,
        a.epochs,
        if a.window == 0 {
            "= cache size".to_owned()
        } else {
            format!("{} files", a.window)
        }
    );
    println!(
        "{:>5} {:>5} | {:>13} {:>13} | {:>8} {:>8} {:>8} | {:>9} {:>8}",
        "C/N", "R/B", "hit÷(C/N)", "LRU hit÷(C/N)", "stall", "floor", "LRU", "backing", "floor"
    );
    for cn in [0.25, 0.5, 0.75] {
        for rb in [0.5, 2.0, 4.0] {
            let c = (a.files as f64 * cn).round() as usize;
            let window = if a.window == 0 { c } else { a.window };
            let ours = planned(a.files, c, rb, 1.0, a.epochs, a.seed, window);
            let base = lru(a.files, c, rb, 1.0, a.epochs, a.seed);
            let row = policy_row(
                cn,
                rb,
                [ours.hit_rate, base.hit_rate],
                [ours.stall, base.stall],
                ours.backing_per_epoch,
            );
            println!("{row}");
        }
    }
    println!(
        "goals: hit÷(C/N) ≥ 0.99; stall within 0.01 of its floor; backing within 0.01 of its floor"
    );
}

#[derive(Debug, clap::Args)]
struct Foundation {
    /// Directory for the generated data and the cache (local disk).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Number of large files.
    #[arg(long, default_value_t = 6)]
    large_files: u64,
    /// Size of each large file in MiB.
    #[arg(long, default_value_t = 512)]
    large_mib: u64,
    /// Number of small files.
    #[arg(long, default_value_t = 4000)]
    small_files: u64,
    /// Size of each small file in KiB.
    #[arg(long, default_value_t = 100)]
    small_kib: u64,
    /// Cache block size.
    #[arg(long, default_value = "4MiB")]
    block_size: String,
    /// Rounds per measurement (alternating order).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Rounds of the store I/O engine comparison (cold fill and verify with io_uring ÷
    /// psync, alternating which goes first); 0 leaves it out.
    #[arg(long, default_value_t = 3)]
    engine_rounds: usize,
}

const BUF: usize = 4 << 20;
const MIB: f64 = 1048576.0;

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

fn secs<F: FnOnce()>(f: F) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// Readers of the cold small-file rows.
const COLD_READERS: [usize; 2] = [8, 32];

/// Small files, cold, N readers at once: every file read once by a pool of N threads
/// sharing one work list, the page cache of the files dropped first; through the cache
/// it is also empty (a fresh daemon). The baseline is the same N threads reading the
/// same files directly. Files per second, (plain, cache) per round, for each number of
/// readers; and per round how the cache caught up after its pass (a cold small file may
/// be read by its reader while the daemon fills the cache behind it: `cold_reads`).
fn cold_small_rows(
    bed: &Bed,
    daemon: &mut Daemon,
    small: &[PathBuf],
    readers: &[usize],
    rounds: usize,
    batch: usize,
) -> ColdRows {
    let before = create_cost(bed);
    let mut out = Vec::new();
    for &threads in readers {
        let mut row = ColdRow {
            threads,
            rates: Vec::new(),
            caught_up: Vec::new(),
        };
        for r in 0..rounds {
            let mut plain = || {
                drop_all(small);
                parallel_batches(small, threads, batch, &|ps: &[PathBuf], b: &mut [u8]| {
                    for p in ps {
                        read_through(&mut File::open(p).expect("open"), b);
                    }
                })
            };
            let mut caught_up = None;
            let mut cached = || {
                daemon.stop();
                std::fs::remove_dir_all(bed.cache.join("shardcache-v1")).expect("clear cache");
                daemon.restart();
                drop_all(small);
                let c = Client::at(&bed.socket);
                let rate = if batch == 1 {
                    parallel_pass(small, threads, &|p: &Path, b: &mut [u8]| {
                        read_through(&mut c.open(p).expect("open"), b);
                    })
                } else {
                    parallel_batches(small, threads, batch, &|ps: &[PathBuf], b: &mut [u8]| {
                        for rd in c.open_many(ps) {
                            read_through(&mut rd.expect("open"), b);
                        }
                    })
                };
                // Not part of the rate: how long after the pass the cache holds every
                // file (or what it holds after CATCH_UP), before the next side runs.
                caught_up = Some(catch_up(&c, small.len() as u64));
                rate
            };
            let (x, y) = alternate(r, &mut plain, &mut cached);
            let (kept, after) = caught_up.expect("the cache side ran");
            eprintln!(
                "small cold, {threads} readers, round {r}: plain {x:.0} f/s, cache {y:.0} f/s; {kept} of {} files kept {after:.2} s after the pass",
                small.len()
            );
            row.rates.push((x, y));
            row.caught_up.push((kept, after));
        }
        out.push(row);
    }
    ColdRows {
        rows: out,
        create_us: [before, create_cost(bed)],
    }
}

/// The cold small-file rows, and what creating a file cost in the cache's directory
/// before and after them.
struct ColdRows {
    rows: Vec<ColdRow>,
    create_us: [f64; 2],
}

/// Microseconds to create an empty file in the bed's directory (the cache's file
/// system), the mean of 256 (left there: they go with the bed). The cache creates a
/// data file for every small file it keeps, and on ext4 without a journal (this
/// project's VMs) a create skips every inode freed in the last minute or more (up to
/// six while their inode table block is unwritten), one inode-table lookup each: within
/// minutes of other work deleting many files (this benchmark's own passes remove the
/// cache before the next) a create cost 0.3–1.3 ms of CPU here, against 17–31 µs after
/// six quiet minutes (README.md, "Benchmark").
fn create_cost(bed: &Bed) -> f64 {
    static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = bed.tmp.path().join(format!("create-probe-{n}"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let t = Instant::now();
    for i in 0..256 {
        File::create(dir.join(format!("{i}"))).expect("create");
    }
    t.elapsed().as_secs_f64() * 1e6 / 256.0
}

/// One row of cold small-file reads: per round (plain, cache) files per second, and the
/// files the cache held when its fills settled with the seconds that took after the pass.
struct ColdRow {
    threads: usize,
    rates: Vec<(f64, f64)>,
    caught_up: Vec<(u64, f64)>,
}

/// Longest the cold small-file rows wait for the cache to settle after a pass.
const CATCH_UP: Duration = Duration::from_secs(60);

/// Waits until the daemon has filled `files` blocks (one per small file) or its fills
/// stop moving for a second, at most [`CATCH_UP`]: blocks filled and seconds waited.
fn catch_up(c: &Client, files: u64) -> (u64, f64) {
    let t = Instant::now();
    let filled = || c.status().expect("status").counters.blocks_filled;
    let (mut last, mut moved) = (filled(), Instant::now());
    while last < files && t.elapsed() < CATCH_UP && moved.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(20));
        let now = filled();
        if now != last {
            (last, moved) = (now, Instant::now());
        }
    }
    (last, t.elapsed().as_secs_f64())
}

/// Prints the rows of [`cold_small_rows`].
fn cold_small_table(cold: &ColdRows, files: usize) {
    let rows = &cold.rows;
    for r in rows {
        row(
            &format!("small files cold, {} readers (÷ plain)", r.threads),
            "f/s",
            &r.rates,
            "≥ 0.9",
        );
    }
    for r in rows {
        let kept: Vec<f64> = r.caught_up.iter().map(|c| c.0 as f64).collect();
        let after: Vec<f64> = r.caught_up.iter().map(|c| c.1).collect();
        println!(
            "  {} readers: the cache held {:.0} of {files} files {:.2} s after the pass (medians)",
            r.threads,
            median(&kept),
            median(&after)
        );
    }
    let [before, after] = cold.create_us;
    println!(
        "  creating an empty file in the cache's file system: {before:.0} µs before the rows, {after:.0} µs after (hundreds: a file system that skips recently freed inodes, after other work deleted many files; the cache creates one per small file)"
    );
}

/// The `small` subcommand: only the cold small-file rows.
fn small(a: &SmallArgs) {
    let mut bed = Bed::new_in(&a.dir);
    let small: Vec<PathBuf> = match &a.root {
        Some(root) => {
            bed.backing = root.canonicalize().expect("--root");
            // Every regular file below it (datasets keep files in subdirectories).
            let mut v: Vec<PathBuf> = Vec::new();
            let mut dirs = vec![bed.backing.clone()];
            while let Some(d) = dirs.pop() {
                for e in std::fs::read_dir(&d).expect("list --root") {
                    let e = e.expect("entry");
                    let t = e.file_type().expect("file type");
                    if t.is_dir() {
                        dirs.push(e.path());
                    } else if t.is_file() {
                        v.push(e.path());
                    }
                }
            }
            v.sort();
            v.truncate(a.files as usize);
            if v.len() < a.files as usize {
                eprintln!(
                    "--root {}: {} files below it, --files asks for {}",
                    bed.backing.display(),
                    v.len(),
                    a.files
                );
                std::process::exit(2);
            }
            v
        }
        None => {
            let v: Vec<PathBuf> = (0..a.files)
                .map(|i| bed.path(&format!("small/S{i:05}.bin")))
                .collect();
            for (i, p) in v.iter().enumerate() {
                write_file(p, 1000 + i as u64, a.kib << 10);
            }
            v
        }
    };
    let mut args = vec![
        "--min-free",
        "1GiB",
        "--log",
        "warn",
        "--cold-reads",
        &a.cold_reads,
    ];
    args.extend(a.daemon_arg.iter().map(String::as_str));
    let mut daemon = bed.start(&args);
    let rows = cold_small_rows(
        &bed,
        &mut daemon,
        &small,
        &a.readers,
        a.rounds,
        a.batch as usize,
    );
    let c = Client::at(&bed.socket).status().expect("status").counters;
    daemon.stop();
    println!();
    println!(
        "shardcache small-file benchmark: {} files in {}, cold (page cache dropped, cache empty), {} rounds, cold_reads = {}, {} per exchange",
        small.len(),
        bed.backing.display(),
        a.rounds,
        a.cold_reads,
        a.batch
    );
    println!(
        "{:<48}{:>16}{:>16}{:>8}  goal",
        "measure (medians)", "baseline", "shardcache", "ratio"
    );
    cold_small_table(&rows, small.len());
    println!(
        "last daemon: {} waits, {} handed over before landing, {} blocks filled ({} syncs of the cache disk), {} landed by their workers (backlog full)",
        c.waits, c.handoffs, c.blocks_filled, c.data_syncs, c.backlog_full
    );
}

/// `threads` threads read every path once with `read` (each path by one thread, taken
/// from a shared list in order); files per second.
fn parallel_pass(
    paths: &[PathBuf],
    threads: usize,
    read: &(dyn Fn(&Path, &mut [u8]) + Sync),
) -> f64 {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut b = vec![0u8; 256 << 10];
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(p) = paths.get(i) else { break };
                    read(p, &mut b);
                }
            });
        }
    });
    paths.len() as f64 / t.elapsed().as_secs_f64()
}

/// [`parallel_pass`] by batches: each thread takes the next `batch` paths at once.
fn parallel_batches(
    paths: &[PathBuf],
    threads: usize,
    batch: usize,
    read: &(dyn Fn(&[PathBuf], &mut [u8]) + Sync),
) -> f64 {
    let chunks: Vec<&[PathBuf]> = paths.chunks(batch).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut b = vec![0u8; 256 << 10];
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(ps) = chunks.get(i) else { break };
                    read(ps, &mut b);
                }
            });
        }
    });
    paths.len() as f64 / t.elapsed().as_secs_f64()
}

fn drop_all(paths: &[PathBuf]) {
    for p in paths {
        drop_page_cache(p).expect("fadvise");
    }
}

/// The local cache files holding `paths` (each must be cached).
fn cached_copies(bed: &Bed, paths: &[PathBuf]) -> Vec<PathBuf> {
    paths
        .iter()
        .map(|p| {
            let rel = p
                .strip_prefix(&bed.backing)
                .expect("under root")
                .to_str()
                .expect("utf8");
            cache_data_file(&bed.cache, &bed.backing, rel).expect("file cached")
        })
        .collect()
}

/// Per-file latencies of one pass and its files per second.
type Timed = (Vec<Duration>, f64);

/// Prints one result line: the medians of each side and the median of the per-round
/// ratios (shardcache ÷ baseline).
fn row(label: &str, unit: &str, v: &[(f64, f64)], goal: &str) {
    let side = |f: fn(&(f64, f64)) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
    let ratio = median(&v.iter().map(|(x, y)| y / x).collect::<Vec<_>>());
    println!(
        "{label:<48}{:>10.0} {unit:<5}{:>10.0} {unit:<5}{ratio:>8.3}  {goal}",
        side(|p| p.0),
        side(|p| p.1)
    );
}

/// Runs both sides, the baseline first in even rounds and second in odd ones.
fn alternate<T>(round: usize, raw: &mut dyn FnMut() -> T, ours: &mut dyn FnMut() -> T) -> (T, T) {
    if round.is_multiple_of(2) {
        let x = raw();
        (x, ours())
    } else {
        let y = ours();
        (raw(), y)
    }
}

/// `rounds` alternating measurements of a baseline and shardcache.
fn paired<T>(
    rounds: usize,
    raw: &mut dyn FnMut() -> T,
    ours: &mut dyn FnMut() -> T,
) -> Vec<(T, T)> {
    (0..rounds).map(|r| alternate(r, raw, ours)).collect()
}

fn main() {
    // The daemons run in this process: `RUST_LOG` shows their logs.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    match Cli::parse().cmd {
        Cmd::Foundation(a) => foundation(&a),
        Cmd::Small(a) => small(&a),
        Cmd::Policy(a) => policy(&a),
        Cmd::PlacementScale {
            nodes,
            files,
            ranks_per_node,
            a,
            seed,
            placement,
            one,
        } => {
            use shardcache_tests::placementscale as ps;
            if one {
                let c = ps::cell(placement[0], nodes[0], files[0], ranks_per_node, a, seed)
                    .expect("placement-scale cell");
                println!("{}", ps::cell_line(&c));
            } else {
                ps::run(&ps::Args {
                    nodes,
                    files,
                    ranks_per_node,
                    a,
                    seed,
                    schemes: placement,
                })
                .expect("placement-scale");
            }
        }
        Cmd::PlannerScale { files } => planner_scale(files),
        Cmd::Restart(a) => {
            shardcache_tests::restartbench::run(&shardcache_tests::restartbench::Args {
                dir: a.dir,
                large_files: a.large_files,
                large_mib: a.large_mib,
                small_files: a.small_files,
                small_kib: a.small_kib,
                block_size: a.block_size,
                rounds: a.rounds,
                readers: a.readers,
            })
            .expect("restart benchmark")
        }
        Cmd::Placement {
            dir,
            nodes,
            a,
            sizes,
            files,
            kib,
            epochs,
            declare_sizes,
            drift,
            jitter,
            ranks_per_node,
            testbed,
            link,
            placement,
        } => shardcache_tests::peerbench::run_placement(
            &dir,
            nodes,
            ranks_per_node,
            &a,
            sizes,
            files,
            kib,
            epochs,
            &declare_sizes,
            shardcache_tests::peerbench::Pace { drift, jitter },
            &shardcache_tests::peerbench::Where { testbed, link },
            placement,
        )
        .expect("placement benchmark"),
        Cmd::Silent {
            dir,
            testbed,
            link,
            files,
            file_kib,
            outage,
        } => {
            shardcache_tests::peerbench::run_silent(&dir, &testbed, &link, files, file_kib, outage)
                .expect("silent-peer benchmark")
        }
        Cmd::Peers {
            dir,
            mib,
            rounds,
            tls,
            link,
            testbed,
        } => {
            let net = match (link, testbed) {
                (Some(rate), Some(script)) => {
                    shardcache_tests::peerbench::Net::Link { script, rate }
                }
                _ => shardcache_tests::peerbench::Net::Loopback,
            };
            shardcache_tests::peerbench::run(&dir, mib, rounds, tls, &net).expect("peers benchmark")
        }
    }
}

fn foundation(a: &Foundation) {
    let bed = Bed::new_in(&a.dir);
    let large: Vec<PathBuf> = (0..a.large_files)
        .map(|i| bed.path(&format!("large/L{i}.bin")))
        .collect();
    let small: Vec<PathBuf> = (0..a.small_files)
        .map(|i| bed.path(&format!("small/S{i:05}.bin")))
        .collect();
    let large_bytes = (a.large_files * a.large_mib) << 20;
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
    drop_all(&large);
    let args = [
        "--block-size",
        a.block_size.as_str(),
        "--min-free",
        "1GiB",
        "--log",
        "warn",
    ];
    let mut daemon = bed.start(&args);
    let client = || {
        Client::with_config(ClientConfig {
            socket: bed.socket.clone(),
            ..ClientConfig::default()
        })
    };
    let mut buf = vec![0u8; BUF];
    let scratch = bed.tmp.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("mkdir");

    // Cold fill vs a raw durable copy.
    let mut cold = Vec::new();
    for r in 0..a.rounds {
        let mut raw_copy = || {
            drop_all(&large);
            let t = secs(|| {
                for (i, p) in large.iter().enumerate() {
                    let mut src = File::open(p).expect("open");
                    let mut dst = File::create(scratch.join(format!("{i}"))).expect("create");
                    loop {
                        let n = src.read(&mut buf).expect("read");
                        if n == 0 {
                            break;
                        }
                        dst.write_all(&buf[..n]).expect("write");
                    }
                    dst.sync_all().expect("fsync");
                }
            });
            for i in 0..large.len() {
                let _ = std::fs::remove_file(scratch.join(format!("{i}")));
            }
            large_bytes as f64 / t
        };
        let mut cached = || {
            // A fresh, empty cache.
            daemon.stop();
            std::fs::remove_dir_all(bed.cache.join("shardcache-v1")).expect("clear cache");
            daemon.restart();
            drop_all(&large);
            let c = client();
            let mut b = vec![0u8; BUF];
            let t = secs(|| {
                for p in &large {
                    let mut rd = c.open(p).expect("open");
                    assert_eq!(read_through(&mut rd, &mut b), a.large_mib << 20);
                }
            });
            let fb = c.status().expect("status").counters.fallback_bytes;
            assert_eq!(
                fb, 0,
                "the client read the backing store itself: not a cache measurement"
            );
            large_bytes as f64 / t
        };
        let (raw, ours) = alternate(r, &mut raw_copy, &mut cached);
        eprintln!(
            "  cold round {r}: raw copy {:.0} MiB/s, through cache {:.0} MiB/s",
            raw / MIB,
            ours / MIB
        );
        cold.push((raw, ours));
    }

    // Warm sequential: the cache now holds every large file.
    let data = cached_copies(&bed, &large);
    let mut warm_disk = Vec::new();
    let mut warm_hot = Vec::new();
    let c = client();
    // File by file, alternating which side goes first, so that the disk's drift hits both.
    for r in 0..a.rounds {
        for (hot, out) in [(false, &mut warm_disk), (true, &mut warm_hot)] {
            let (mut t_raw, mut t_ours) = (0.0, 0.0);
            for (i, (d, p)) in data.iter().zip(&large).enumerate() {
                let raw = |buf: &mut [u8]| {
                    if !hot {
                        drop_page_cache(d).expect("fadvise");
                    }
                    secs(|| {
                        read_through(&mut File::open(d).expect("open"), buf);
                    })
                };
                let through = |buf: &mut [u8]| {
                    if !hot {
                        drop_page_cache(d).expect("fadvise");
                    }
                    secs(|| {
                        let mut rd = c.open(p).expect("open");
                        read_through(&mut rd, buf);
                        assert_eq!(
                            rd.stats().hit_bytes,
                            a.large_mib << 20,
                            "warm read not all hits"
                        );
                    })
                };
                if hot {
                    raw(&mut buf); // bring the file into the page cache
                }
                if (r + i) % 2 == 0 {
                    t_raw += raw(&mut buf);
                    t_ours += through(&mut buf);
                } else {
                    t_ours += through(&mut buf);
                    t_raw += raw(&mut buf);
                }
            }
            let (x, y) = (large_bytes as f64 / t_raw, large_bytes as f64 / t_ours);
            eprintln!(
                "  warm round {r} ({}): raw {:.0} MiB/s, client {:.0} MiB/s",
                if hot { "page cache" } else { "disk" },
                x / MIB,
                y / MIB
            );
            out.push((x, y));
        }
    }

    let cold_small = cold_small_rows(&bed, &mut daemon, &small, &COLD_READERS, a.rounds, 1);

    // Small files: populate, then warm open+read+close.
    let c = client();
    for p in &small {
        read_through(&mut c.open(p).expect("open"), &mut buf);
    }
    // A reader gets its bytes before they land: wait until the last ones have.
    let landed = |bed: &Bed| {
        small.iter().all(|p| {
            let rel = p.strip_prefix(&bed.backing).expect("under root");
            cache_data_file(&bed.cache, &bed.backing, rel.to_str().expect("utf8")).is_some()
        })
    };
    let t = Instant::now();
    while !landed(&bed) {
        if t.elapsed() > Duration::from_secs(10) {
            let missing = small
                .iter()
                .filter(|p| {
                    let rel = p.strip_prefix(&bed.backing).expect("under root");
                    cache_data_file(&bed.cache, &bed.backing, rel.to_str().expect("utf8")).is_none()
                })
                .count();
            panic!(
                "{missing} small files not cached within 10 s: {:?}",
                c.status().expect("status").counters
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let small_data = cached_copies(&bed, &small);
    let time_each = |paths: &[PathBuf], f: &mut dyn FnMut(&Path)| -> (Vec<Duration>, f64) {
        let t0 = Instant::now();
        let lat = paths
            .iter()
            .map(|p| {
                let t = Instant::now();
                f(p);
                t.elapsed()
            })
            .collect();
        (lat, paths.len() as f64 / t0.elapsed().as_secs_f64())
    };
    let mut b = vec![0u8; 256 << 10];
    let mut b2 = vec![0u8; 256 << 10];
    let raw_pass = |b: &mut [u8]| {
        let t = Instant::now();
        for p in &small_data {
            read_through(&mut File::open(p).expect("open"), b);
        }
        small_data.len() as f64 / t.elapsed().as_secs_f64()
    };
    // One open per exchange with the daemon, timed file by file.
    let small_rounds = paired(
        a.rounds,
        &mut || {
            time_each(&small_data, &mut |p| {
                read_through(&mut File::open(p).expect("open"), &mut b);
            })
        },
        &mut || {
            time_each(&small, &mut |p| {
                read_through(&mut c.open(p).expect("open"), &mut b2);
            })
        },
    );
    // `open_many`: 64 files per exchange.
    let batched = paired(a.rounds, &mut || raw_pass(&mut b), &mut || {
        let t = Instant::now();
        for chunk in small.chunks(64) {
            for rd in c.open_many(chunk) {
                read_through(&mut rd.expect("open"), &mut b2);
            }
        }
        small.len() as f64 / t.elapsed().as_secs_f64()
    });
    // `open_ahead`: the daemon opens the next 32 while the client reads.
    let ahead = paired(a.rounds, &mut || raw_pass(&mut b), &mut || {
        let t = Instant::now();
        for rd in c.open_ahead(&small, 32) {
            read_through(&mut rd.expect("open"), &mut b2);
        }
        small.len() as f64 / t.elapsed().as_secs_f64()
    });
    let st = c.status().expect("status").counters;
    daemon.stop();
    let engines = engine_rounds(a, &bed, &large, &args);

    let mib = |v: &[(f64, f64)]| {
        v.iter()
            .map(|(x, y)| (x / MIB, y / MIB))
            .collect::<Vec<_>>()
    };
    let files_per_sec = |v: &[(Timed, Timed)]| {
        v.iter()
            .map(|((_, x), (_, y))| (*x, *y))
            .collect::<Vec<_>>()
    };
    println!();
    println!(
        "shardcache foundation benchmark: {} × {} MiB large files ({:.1} GiB), {} × {} KiB small files, block {}, {} rounds",
        a.large_files,
        a.large_mib,
        large_bytes as f64 / (1u64 << 30) as f64,
        a.small_files,
        a.small_kib,
        a.block_size,
        a.rounds
    );
    println!(
        "{:<48}{:>16}{:>16}{:>8}  goal",
        "measure (medians)", "baseline", "shardcache", "ratio"
    );
    row(
        "cold fill ÷ raw durable copy",
        "MiB/s",
        &mib(&cold),
        "≥ 0.95",
    );
    row(
        "warm sequential ÷ raw read of cache files (disk)",
        "MiB/s",
        &mib(&warm_disk),
        "≥ 0.97",
    );
    row("  same, from page cache", "MiB/s", &mib(&warm_hot), "");
    row(
        "small files: warm open+read, one open each",
        "f/s",
        &files_per_sec(&small_rounds),
        "≥ 0.8",
    );
    let lat = |side: usize, q: f64| {
        let mut all: Vec<Duration> = small_rounds
            .iter()
            .flat_map(|(r, o)| if side == 0 { r.0.clone() } else { o.0.clone() })
            .collect();
        quantile_us(&mut all, q)
    };
    println!(
        "{:<48}{:>13.1} µs{:>13.1} µs",
        "  p50 latency",
        lat(0, 0.5),
        lat(1, 0.5)
    );
    println!(
        "{:<48}{:>13.1} µs{:>13.1} µs",
        "  p99 latency",
        lat(0, 0.99),
        lat(1, 0.99)
    );
    row(
        "small files, open_many (64 per exchange)",
        "f/s",
        &batched,
        "≥ 0.8",
    );
    row("small files, open_ahead (32 ahead)", "f/s", &ahead, "≥ 0.8");
    cold_small_table(&cold_small, small.len());
    match engines {
        Some((fill, verify)) => {
            row(
                "store engine: cold fill, io_uring ÷ psync",
                "MiB/s",
                &mib(&fill),
                "≥ 1",
            );
            row(
                "store engine: verify from disk, io_uring ÷ psync",
                "MiB/s",
                &mib(&verify),
                "≥ 1",
            );
        }
        None if a.engine_rounds > 0 => {
            println!("store engine rows: io_uring is not available here, nothing to compare")
        }
        None => {}
    }
    println!(
        "daemon: {} backing reads, {:.0} MiB from backing, {} client fallback bytes",
        st.backing_reads,
        st.backing_bytes as f64 / MIB,
        st.fallback_bytes
    );
}

/// The store's I/O engines side by side on the same data in this run: per round, a
/// daemon with `--io-engine psync` and one with `--io-engine uring` (which goes first
/// alternates), each on an empty cache: the large files read through it cold (the
/// backing files' page cache dropped: the fill writes and syncs every block), then
/// `shardcache verify` with the cache files' page cache dropped (every block read back
/// from disk and checked). (psync, uring) in bytes/s per round for each; `None` when
/// io_uring cannot run here or no round was asked for.
#[allow(clippy::type_complexity)]
fn engine_rounds(
    a: &Foundation,
    bed: &Bed,
    large: &[PathBuf],
    args: &[&str],
) -> Option<(Vec<(f64, f64)>, Vec<(f64, f64)>)> {
    if a.engine_rounds == 0 {
        return None;
    }
    let probe = bed.tmp.path().join("uring-probe");
    std::fs::create_dir_all(&probe).expect("mkdir");
    if let Err(e) =
        shardcache_daemon::store::io::open(shardcache_daemon::store::io::IoEngine::Uring, &probe)
    {
        eprintln!("  {e}");
        return None;
    }
    let large_bytes = (a.large_files * a.large_mib) << 20;
    let one = |engine: &str| -> (f64, f64) {
        let _ = std::fs::remove_dir_all(bed.cache.join("shardcache-v1"));
        let mut with: Vec<&str> = args.to_vec();
        with.extend(["--io-engine", engine]);
        let mut d = bed.start(&with);
        assert_eq!(
            d.status().io_engine,
            engine,
            "the daemon runs the engine asked for"
        );
        drop_all(large);
        let c = Client::with_config(ClientConfig {
            socket: bed.socket.clone(),
            ..ClientConfig::default()
        });
        let mut b = vec![0u8; BUF];
        let fill = secs(|| {
            for p in large {
                let mut rd = c.open(p).expect("open");
                assert_eq!(read_through(&mut rd, &mut b), a.large_mib << 20);
            }
        });
        drop_all(&cached_copies(bed, large));
        let mut checked = 0;
        let verify = secs(|| {
            let r = c.verify(Duration::from_secs(3600)).expect("verify");
            assert_eq!(r.corrupt_blocks, 0);
            checked = r.bytes_checked;
        });
        assert_eq!(checked, large_bytes, "verify read every cached byte");
        d.stop();
        (large_bytes as f64 / fill, large_bytes as f64 / verify)
    };
    let mut fill = Vec::new();
    let mut verify = Vec::new();
    for r in 0..a.engine_rounds {
        let (p, u) = alternate(r, &mut || one("psync"), &mut || one("uring"));
        eprintln!(
            "  engine round {r}: cold fill psync {:.0} / uring {:.0} MiB/s, verify psync {:.0} / uring {:.0} MiB/s",
            p.0 / MIB,
            u.0 / MIB,
            p.1 / MIB,
            u.1 / MIB
        );
        fill.push((p.0, u.0));
        verify.push((p.1, u.1));
    }
    Some((fill, verify))
}
