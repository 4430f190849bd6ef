//! The peers benchmark (`shardcache-bench peers`): real daemons in this process, on
//! loopback addresses, sharing one backing directory.
//!
//! 1. Transfer: node B fetches every block of a file node A owns and holds, through the
//!    peer block stream (a MAC per block, the sender's checksum check, with `--tls` inside
//!    mutual TLS; 4 fetches in flight as the fill engine does), ÷ raw TCP moving the
//!    same bytes from the same page-cached file on the same loopback path: one stream,
//!    and 4 streams at once (as many as the peer fetches in flight), whichever is
//!    faster. The three are
//!    measured in turn, in a rotating order, for several rounds; medians are compared.
//!    With `--link RATE` the two nodes are not on loopback but in two network
//!    namespaces of the testbed script (`cluster-net.sh`: a veth each, a bridge between,
//!    `tbf` at RATE on both ends of each link, or unshaped with `none`): node A's daemon
//!    and the raw baseline's sending side run on threads inside node A's namespace,
//!    node B's daemon, its fetches and the raw receivers inside node B's (a thread's
//!    sockets belong to the namespace it is in when it makes them; the daemons' own
//!    threads inherit it). The same code path as between two hosts, across a real
//!    network stack and a rate-limited link, in this one process.
//! 2. Placement: M nodes run a distributed shuffle (one rank each, or several: each
//!    registers its own manifest with its node's daemon) with aggregate cache
//!    a = M·C/N; per epoch after the first, the backing traffic ÷ the dataset (floor
//!    max(0, 1 − a)) and the fraction of opens that found the file on the local NVMe.
//!    On loopback, or (`shardcache-bench placement --testbed`) each daemon in its own
//!    namespace of the testbed, as the transfer's nodes are.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::Context;
use shardcache_client::Client;
use shardcache_daemon::config::{Config, Scheme, SizeSpec};
use shardcache_daemon::daemon::Daemon;

use crate::{content, write_file};

const SECRET: &str = "benchmark cluster shared secret";

/// The two transfer nodes' places on the testbed: node A's namespace and address, then
/// node B's.
#[derive(Debug, Clone)]
pub struct Link {
    /// `(network namespace, IPv4 address)` of node A, then node B (then the others, on a
    /// testbed of more nodes).
    pub nodes: Vec<(String, String)>,
}

/// Moves the calling thread into network namespace `ns` (`ip netns` name); `None`: stays.
/// Sockets it makes from then on, and threads it starts, are in that namespace.
fn enter(ns: Option<&str>) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let Some(ns) = ns else { return Ok(()) };
    let f = std::fs::File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("network namespace {ns} (is the testbed up? root?)"))?;
    // SAFETY: setns only reads the descriptor, which is open for the call.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("setns into {ns} (root only)"));
    }
    Ok(())
}

/// `f` on a new thread inside network namespace `ns`.
fn inside<T: Send>(
    ns: Option<&str>,
    f: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(ns)?;
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("panicked"))?
    })
}

/// The testbed of two nodes (`cluster-net.sh up 2 RATE`), taken down when dropped, on
/// failure too.
#[derive(Debug)]
pub struct Testbed {
    script: PathBuf,
    /// Where the nodes are.
    pub link: Link,
}

impl Testbed {
    /// Brings up two nodes at `rate` (`none`: unshaped veth). Refuses when a testbed
    /// is already up (someone else's: it is left alone).
    pub fn up(script: &Path, rate: &str) -> anyhow::Result<Self> {
        Self::up_nodes(script, 2, rate)
    }

    /// Brings up `n` nodes at `rate`, as [`Testbed::up`] does.
    pub fn up_nodes(script: &Path, n: usize, rate: &str) -> anyhow::Result<Self> {
        let list = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .context("ip netns list")?;
        let list = String::from_utf8_lossy(&list.stdout);
        anyhow::ensure!(
            !list
                .lines()
                .any(|l| l.starts_with("sc-br") || l.starts_with("sc-n")),
            "a testbed is already up (`ip netns list` shows sc-*): take it down first"
        );
        let me = Self {
            script: script.to_owned(),
            link: Link {
                nodes: (1..=n)
                    .map(|k| (format!("sc-n{k}"), String::new()))
                    .collect(),
            },
        };
        // From here on, dropping `me` takes down whatever `up` made.
        me.call(&["up", &n.to_string(), rate])?;
        let mut me = me;
        for (k, node) in me.link.nodes.iter_mut().enumerate() {
            let out = std::process::Command::new(&me.script)
                .args(["addr", &(k + 1).to_string()])
                .output()?;
            node.1 = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        }
        Ok(me)
    }

    /// Runs the testbed script with `args` (e.g. `blackhole 4`, `heal 4`).
    pub fn call(&self, args: &[&str]) -> anyhow::Result<()> {
        let st = std::process::Command::new(&self.script)
            .args(args)
            .status()
            .with_context(|| format!("{}", self.script.display()))?;
        anyhow::ensure!(
            st.success(),
            "{} {}: {st}",
            self.script.display(),
            args.join(" ")
        );
        Ok(())
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if let Err(e) = self.call(&["down"]) {
            eprintln!("taking the testbed down: {e:#}");
        }
    }
}

/// Starts `m` daemons sharing `backing`, each with `capacity` bytes of cache; with
/// `tls`, mutual TLS on the peer port (certificates from one test CA). On loopback, or
/// (`link`: a `(namespace, address)` per node) each in its namespace of the testbed;
/// `scheme`: their cluster placement.
#[allow(clippy::too_many_arguments)]
fn cluster(
    dir: &Path,
    backing: &Path,
    m: usize,
    block: u64,
    capacity: u64,
    tls: bool,
    link: Option<&[(String, String)]>,
    scheme: Scheme,
) -> anyhow::Result<(Vec<Daemon>, Vec<String>, Vec<PathBuf>)> {
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET)?;
    let ca = tls.then(|| crate::certs::Ca::new("bench"));
    anyhow::ensure!(
        link.is_none_or(|l| l.len() == m),
        "the testbed has a node per daemon"
    );
    let ns = |i: usize| link.map(|l| l[i].0.as_str());
    let addrs: Vec<String> = (0..m)
        .map(|i| match link {
            // Fresh namespaces: nothing else listens there.
            Some(l) => Ok(format!("{}:7411", l[i].1)),
            None => Ok(format!("127.0.0.1:{}", crate::free_port())),
        })
        .collect::<anyhow::Result<_>>()?;
    let mut nodes = Vec::new();
    let mut sockets = Vec::new();
    for i in 0..m {
        let socket = dir.join(format!("node-{i}.sock"));
        let files = ca
            .as_ref()
            .map(|ca| ca.issue(&dir.join(format!("tls-{i}")), &[ca]));
        let cfg = Config {
            peer_tls_cert: files.as_ref().map(|f| f.cert.clone()),
            peer_tls_key: files.as_ref().map(|f| f.key.clone()),
            peer_tls_ca: files.as_ref().map(|f| f.ca.clone()),
            backing_roots: vec![backing.to_owned()],
            cache_dir: dir.join(format!("cache-{i}")),
            socket: socket.clone(),
            capacity: SizeSpec::Bytes(capacity),
            min_free: SizeSpec::Bytes(0),
            block_size: block,
            peer_listen: Some(addrs[i].parse()?),
            peers: addrs
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, a)| a.clone())
                .collect(),
            peer_secret_file: Some(secret.clone()),
            metrics_listen: shardcache_daemon::config::MetricsListen::Off,
            fill_workers: std::env::var("SHARDCACHE_BENCH_FILL_WORKERS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(Config::default().fill_workers),
            placement: scheme,
            ..Config::default()
        };
        let node = inside(ns(i), || Daemon::start(&cfg)).with_context(|| format!("node {i}"))?;
        nodes.push(node);
        sockets.push(socket);
    }
    Ok((nodes, addrs, sockets))
}

/// Fetches in flight in the peer transfer (the fill engine's default worker count), and
/// streams in the raw baseline that matches it.
pub const IN_FLIGHT: usize = 4;

/// Medians over the transfer rounds.
#[derive(Debug, Clone, Copy)]
pub struct Transfer {
    /// Peer fetch ([`IN_FLIGHT`] at once), MiB/s.
    pub peer: f64,
    /// One raw TCP stream, MiB/s.
    pub raw_one: f64,
    /// [`IN_FLIGHT`] raw TCP streams at once, MiB/s.
    pub raw_many: f64,
    /// Per round: the peer fetch ÷ the faster raw configuration of the same round (the
    /// three measured back to back, so that load from outside the benchmark weighs on
    /// them alike).
    pub ratio: f64,
    /// The lowest and highest per-round ratio.
    pub ratio_range: (f64, f64),
    /// Per round: the peer fetch ÷ one raw TCP stream of the same round (the issue's
    /// baseline: "a raw TCP stream on the same loopback path"), median.
    pub ratio_one: f64,
    /// A whole read through node B's cache of a file node A holds (fetch, durable
    /// landing, the client's read), MiB/s.
    pub whole: f64,
    /// Per round: the whole read ÷ one raw TCP stream of the same round, median.
    pub ratio_whole: f64,
    /// The lowest and highest per-round `ratio_whole`.
    pub ratio_whole_range: (f64, f64),
    /// CPU seconds (user + system, this whole process: both nodes) per GiB moved by the
    /// peer fetch, median: less swayed than the speeds by load from outside.
    pub peer_cpu: f64,
    /// The same for one raw TCP stream.
    pub raw_cpu: f64,
}

/// `f`'s result and the CPU seconds per GiB of `len` bytes it used.
fn with_cpu<T>(len: u64, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<(T, f64)> {
    let c = crate::cpu_secs();
    let r = f()?;
    Ok((
        r,
        (crate::cpu_secs() - c) / (len as f64 / (1u64 << 30) as f64),
    ))
}

/// Peer transfer (over TLS with `tls`) and raw TCP, both on loopback or both across
/// `link`, `rounds` rounds of `mib` MiB each.
pub fn transfer(
    dir: &Path,
    mib: u64,
    rounds: usize,
    tls: bool,
    link: Option<&Link>,
) -> anyhow::Result<Transfer> {
    let ns = |i: usize| link.map(|l| l.nodes[i].0.as_str());
    let block = 4u64 << 20;
    let tmp = tempfile::tempdir_in(dir)?;
    let backing = tmp.path().join("backing");
    std::fs::create_dir_all(&backing)?;
    let backing = backing.canonicalize()?;
    let (nodes, addrs, sockets) = cluster(
        tmp.path(),
        &backing,
        2,
        block,
        (8 * mib) << 20,
        tls,
        link.map(|l| &l.nodes[..]),
        Scheme::default(),
    )?;
    let root = backing.display().to_string();
    // A file node 0 owns.
    let rel = (0..1000)
        .map(|i| format!("f{i}"))
        .find(|p| {
            shardcache_daemon::peer::file_owner(addrs.iter().map(String::as_str), &root, p)
                == Some(addrs[0].as_str())
        })
        .context("no file owned by node 0")?;
    let len = mib << 20;
    write_file(&backing.join(&rel), 1, len);
    // Node 0 reads it: now it holds every block.
    let mut r = Client::at(&sockets[0]).open(backing.join(&rel))?;
    let mut sink = Vec::new();
    r.read_to_end(&mut sink)?;
    anyhow::ensure!(sink == content(1, len), "node 0 read wrong bytes");
    let stat = nodes[1].ctx().meta.stat(0, &rel)?;
    let peers = nodes[1].peers().context("peers on")?.clone();
    let nblocks = len.div_ceil(block) as usize;
    let data_path = crate::cache_data_file(&tmp.path().join("cache-0"), &backing, &rel)
        .context("node 0's copy")?;
    let peer = || -> anyhow::Result<f64> {
        let t = Instant::now();
        let next = AtomicUsize::new(0);
        let got = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..IN_FLIGHT {
                s.spawn(|| {
                    // Node B's fetches connect from its namespace.
                    if enter(ns(1)).is_err() {
                        return;
                    }
                    // Each fill worker keeps one block buffer.
                    let mut d = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= nblocks {
                            return;
                        }
                        let want = (len - i as u64 * block).min(block) as usize;
                        if peers.fetch(&root, &stat, i, want, true, &mut d).is_some() {
                            got.fetch_add(d.len() as u64, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        anyhow::ensure!(got.into_inner() == len, "a peer fetch failed");
        Ok(len as f64 / 1048576.0 / t.elapsed().as_secs_f64())
    };
    // The whole read a user makes: node B's client opens the file node A holds and
    // reads it through node B's cache (B fetches its blocks from A, lands them durably,
    // the client reads the local copy); dropped from B's cache before each round.
    let client_b = Client::at(&sockets[1]);
    let path_b = backing.join(&rel);
    let whole = || -> anyhow::Result<f64> {
        client_b.evict(
            shardcache_client::EvictTarget::Paths(vec![path_b.display().to_string()]),
            std::time::Duration::from_secs(30),
        )?;
        let backing_before = client_b.status()?.counters.backing_bytes;
        let t = Instant::now();
        let mut got = Vec::with_capacity(len as usize);
        client_b.open(&path_b)?.read_to_end(&mut got)?;
        let speed = len as f64 / 1048576.0 / t.elapsed().as_secs_f64();
        anyhow::ensure!(got.len() as u64 == len, "node B read {} bytes", got.len());
        anyhow::ensure!(
            client_b.status()?.counters.backing_bytes == backing_before,
            "node B read the backing store: the whole read did not come from node A"
        );
        Ok(speed)
    };
    let (mut p, mut one, mut many, mut w) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut ratios, mut ratios_one, mut ratios_whole) = (Vec::new(), Vec::new(), Vec::new());
    let (mut p_cpu, mut one_cpu) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for k in 0..4 {
            match (round + k) % 4 {
                3 => w.push(whole()?),
                0 => {
                    let (v, c) = with_cpu(len, peer)?;
                    p.push(v);
                    p_cpu.push(c);
                }
                1 => {
                    let (v, c) = with_cpu(len, || raw_tcp(&data_path, len, block, 1, link))?;
                    one.push(v);
                    one_cpu.push(c);
                }
                _ => many.push(raw_tcp(&data_path, len, block, IN_FLIGHT, link)?),
            }
        }
        ratios.push(p[round] / one[round].max(many[round]));
        ratios_one.push(p[round] / one[round]);
        ratios_whole.push(w[round] / one[round]);
    }
    drop(nodes);
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(0.0, f64::max);
    Ok(Transfer {
        peer: crate::median(&p),
        raw_one: crate::median(&one),
        raw_many: crate::median(&many),
        ratio: crate::median(&ratios),
        ratio_range: (lo, hi),
        ratio_one: crate::median(&ratios_one),
        whole: crate::median(&w),
        ratio_whole: crate::median(&ratios_whole),
        ratio_whole_range: (
            ratios_whole.iter().copied().fold(f64::INFINITY, f64::min),
            ratios_whole.iter().copied().fold(0.0, f64::max),
        ),
        peer_cpu: crate::median(&p_cpu),
        raw_cpu: crate::median(&one_cpu),
    })
}

/// `len` bytes of `file` (page-cached) over `streams` TCP connections on loopback (or
/// from node A to node B of `link`) at once, stream `k` carrying blocks `k`,
/// `k + streams`, ... of `block` bytes, each sent 1 MiB at a time (`pread`, `write`):
/// MiB/s as the receivers see it.
fn raw_tcp(
    file: &Path,
    len: u64,
    block: u64,
    streams: usize,
    link: Option<&Link>,
) -> anyhow::Result<f64> {
    let ns = |i: usize| link.map(|l| l.nodes[i].0.clone());
    let (a, b) = (ns(0), ns(1));
    let host = link.map_or("127.0.0.1".to_owned(), |l| l.nodes[0].1.clone());
    // The sending side's socket (and threads) in node A's namespace.
    let l = inside(a.as_deref(), || Ok(TcpListener::bind((host.as_str(), 0))?))?;
    let addr = l.local_addr()?;
    let f = std::fs::File::open(file)?;
    let nblocks = len.div_ceil(block);
    // The bytes stream `k` carries.
    let share = |k: u64| {
        (k..nblocks)
            .step_by(streams)
            .map(|i| (len - i * block).min(block))
            .sum::<u64>()
    };
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        // Accepted sockets are the listener's; the threads follow node A anyway.
        enter(a.as_deref()).map_err(std::io::Error::other)?;
        let mut conns = Vec::new();
        for _ in 0..streams {
            conns.push(l.accept()?.0);
        }
        std::thread::scope(|s| {
            let hs: Vec<_> = conns
                .into_iter()
                .enumerate()
                .map(|(k, mut c)| {
                    let f = &f;
                    s.spawn(move || -> std::io::Result<()> {
                        c.set_nodelay(true)?;
                        let mut buf = vec![0u8; 1 << 20];
                        for i in (k as u64..nblocks).step_by(streams) {
                            let (mut off, end) = (i * block, (i * block + block).min(len));
                            while off < end {
                                let n = (end - off).min(buf.len() as u64) as usize;
                                f.read_exact_at(&mut buf[..n], off)?;
                                c.write_all(&buf[..n])?;
                                off += n as u64;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            hs.into_iter().try_for_each(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("panicked")))
            })
        })
    });
    let conns = inside(b.as_deref(), || {
        (0..streams)
            .map(|_| Ok(TcpStream::connect(addr)?))
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let t = Instant::now();
    let got: anyhow::Result<()> = std::thread::scope(|s| {
        let hs: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(k, mut c)| {
                let want = share(k as u64);
                s.spawn(move || -> anyhow::Result<()> {
                    let mut buf = vec![0u8; 1 << 20];
                    let mut got = 0u64;
                    while got < want {
                        let n = c.read(&mut buf)?;
                        anyhow::ensure!(n > 0, "stream ended early");
                        got += n as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")))
        })
    });
    let secs = t.elapsed().as_secs_f64();
    got?;
    server
        .join()
        .map_err(|_| anyhow::anyhow!("server panicked"))??;
    Ok(len as f64 / 1048576.0 / secs)
}

/// One placement run's figures (epochs after the first).
#[derive(Debug, Clone, Copy)]
pub struct Placed {
    /// Backing-store bytes read ÷ the dataset, per epoch.
    pub backing: f64,
    /// Opens that found the file whole on the local NVMe.
    pub local: f64,
    /// Cache use ÷ capacity, sampled on every node every 4th step: the mean and the
    /// highest (over 1 while nodes exchange copies, see `crate::planner::placement`).
    pub use_mean: f64,
    /// See `use_mean`.
    pub use_peak: f64,
}

/// One epoch of a placement run, summed over the nodes.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlacedEpoch {
    /// Backing-store bytes read (the daemons' and the clients' fallbacks) ÷ the dataset.
    pub backing: f64,
    /// Opens that found the file whole on the reader's node ÷ opens.
    pub local: f64,
    /// Blocks that came from a peer ÷ the dataset's blocks.
    pub peer_blocks: u64,
    /// Fills that found no room in the store.
    pub no_space: u64,
    /// Files evicted by the stores.
    pub evicted: u64,
    /// Cache use ÷ capacity over the epoch, sampled on every node every 4th step: mean
    /// and highest.
    pub use_mean: f64,
    /// See `use_mean`.
    pub use_peak: f64,
}

/// How the files of a placement run are sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Sizes {
    /// Every file the same size.
    Fixed,
    /// Log-normal (σ = 0.5 of the log, as ImageNet-like JPEGs), the given mean.
    #[value(name = "lognormal")]
    LogNormal,
    /// Nine files in ten log-normal around the mean, one in ten eight times larger.
    Mix,
    /// Tar shards: uniform over a 1 : 16 range around the mean (`--kib 278528`: 32–512
    /// MiB, as WebDataset shards).
    Shards,
}

/// `files` sizes of `kind` around `mean_kib` (the same for the same arguments).
pub fn file_sizes(kind: Sizes, files: u64, mean_kib: u64) -> Vec<u64> {
    let mean = (mean_kib << 10) as f64;
    let unit = |x: u64| -> f64 {
        // splitmix64: uniform in (0, 1).
        let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 + 0.5 / (1u64 << 53) as f64
    };
    let lognormal = |i: u64, mean: f64| -> u64 {
        const SIGMA: f64 = 0.5;
        let (u1, u2) = (unit(2 * i), unit(2 * i + 1));
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let median = mean / (SIGMA * SIGMA / 2.0).exp();
        (median * (SIGMA * z).exp()).clamp(4096.0, 16.0 * mean) as u64
    };
    (0..files)
        .map(|i| match kind {
            Sizes::Fixed => mean as u64,
            Sizes::LogNormal => lognormal(i, mean),
            Sizes::Mix if i % 10 == 9 => lognormal(i, 8.0 * mean),
            Sizes::Mix => lognormal(i, mean),
            Sizes::Shards => (mean * (2.0 + 30.0 * unit(i)) / 17.0) as u64,
        })
        .collect()
}

/// How the ranks of a placement run keep pace with each other.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pace {
    /// Each rank reads at 1 ± `drift` of the mean pace, drawn for each epoch, which ends
    /// when the slowest rank is done (0: in lockstep).
    pub drift: f64,
    /// Each rank reads at 1 ± `jitter` of the mean pace, drawn again at every step.
    pub jitter: f64,
}

/// How one placement run is set up.
#[derive(Debug, Clone, Copy)]
pub struct Setting<'a> {
    /// Nodes (daemons).
    pub nodes: usize,
    /// Ranks on each node (as `torchrun --nproc-per-node`): ranks `k·R … k·R + R − 1`
    /// run on node `k`, each registering its own manifest (the node merges them into one
    /// plan) and reading through the node's socket.
    pub ranks_per_node: usize,
    /// Aggregate cache ÷ the dataset's bytes.
    pub a: f64,
    /// The manifest gives every file's size (the placement counts bytes).
    pub declare: bool,
    /// Epochs (the first is cold).
    pub epochs: u64,
    /// How the ranks keep pace.
    pub pace: Pace,
    /// Each node in its namespace of the testbed (`(namespace, address)` per node), or
    /// all on loopback (`None`).
    pub link: Option<&'a [(String, String)]>,
    /// The daemons' cluster placement.
    pub scheme: Scheme,
}

/// The cache block size for files of `mean` bytes: a sixteenth of the mean, a power of
/// two from 64 KiB to the daemon's default 4 MiB.
fn block_for(mean: u64) -> u64 {
    (mean / 16).next_power_of_two().clamp(64 << 10, 4 << 20)
}

/// One placement run (see [`Setting`]) of files of `sizes`, each cache `a` × the
/// dataset's bytes ÷ the nodes. With `SHARDCACHE_BENCH_VERBOSE` set, each node's
/// counters per epoch go to stderr.
pub fn placement_epochs(
    dir: &Path,
    sizes: &[u64],
    set: Setting<'_>,
) -> anyhow::Result<Vec<PlacedEpoch>> {
    let Setting {
        nodes: m,
        ranks_per_node,
        a,
        declare,
        epochs,
        pace,
        link,
        scheme,
    } = set;
    let Pace { drift, jitter } = pace;
    let rpn = ranks_per_node.max(1);
    let world = (m * rpn) as u64;
    let files = sizes.len() as u64;
    let block = block_for(sizes.iter().sum::<u64>() / files.max(1));
    let tmp = tempfile::tempdir_in(dir)?;
    let backing = tmp.path().join("backing");
    std::fs::create_dir_all(backing.join("ds"))?;
    let backing = backing.canonicalize()?;
    for (i, &size) in sizes.iter().enumerate() {
        write_file(&backing.join(format!("ds/s{i:05}")), i as u64, size);
    }
    let total: u64 = sizes.iter().sum();
    let capacity = ((a * total as f64 / m as f64).round() as u64).max(block);
    let (nodes, addrs, sockets) = cluster(
        tmp.path(),
        &backing,
        m,
        block,
        capacity,
        false,
        link,
        scheme,
    )?;
    let verbose = std::env::var_os("SHARDCACHE_BENCH_VERBOSE").is_some();
    if verbose {
        for (i, a) in addrs.iter().enumerate() {
            eprintln!(
                "node {i}: {a}, cache {}",
                tmp.path().join(format!("cache-{i}")).display()
            );
        }
    }
    let names: Vec<serde_json::Value> = (0..files)
        .map(|i| {
            let path = format!("s{i:05}");
            if declare {
                serde_json::json!({"path": path, "size": sizes[i as usize]})
            } else {
                serde_json::json!(path)
            }
        })
        .collect();
    let clients: Vec<Client> = sockets.iter().map(Client::at).collect();
    // Rank `r` runs on node `r / rpn`, and registers its own manifest there.
    for rank in 0..world {
        let manifest = serde_json::json!({
            "version": 1, "job": "bench", "root": backing.join("ds"),
            "files": names, "immutable": true,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 3,
                     "epochs": epochs + 1, "world_size": world, "ranks": [rank]}
        });
        clients[rank as usize / rpn].register(&manifest.to_string())?;
    }
    let counters = || -> anyhow::Result<Vec<shardcache_client::Counters>> {
        clients.iter().map(|c| Ok(c.status()?.counters)).collect()
    };
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for epoch in 0..epochs {
        let (mut use_sum, mut use_n, mut use_peak) = (0.0f64, 0u64, 0.0f64);
        let before = counters()?;
        // The ranks read in lockstep, as the ranks of one job do.
        let orders: Vec<Vec<u64>> = (0..world)
            .map(|r| shardcache_plan::shuffle::rank_order(files, 3, epoch, world, r, false))
            .collect();
        // Each rank reads at its own pace this epoch (1 ± `drift` files per tick), and
        // the epoch ends when the slowest is done (as `set_epoch` after a barrier); with
        // `jitter`, a pace drawn again for every tick instead (the ranks wander apart
        // and back, as per-step times that vary do).
        let pace = |r: u64, tick: u64, spread: f64| -> f64 {
            let h = xxhash_rust::xxh3::xxh3_64(&[epoch, r, tick].map(u64::to_le_bytes).concat());
            1.0 - spread + 2.0 * spread * (h >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut speed: Vec<f64> = (0..world).map(|r| pace(r, 0, drift)).collect();
        let mut at = vec![0usize; world as usize];
        let mut budget = vec![0f64; world as usize];
        let len = orders[0].len();
        let mut tick = 0usize;
        while at.iter().any(|&a| a < len) {
            if jitter > 0.0 {
                for (r, s) in speed.iter_mut().enumerate() {
                    *s = pace(r as u64, tick as u64 + 1, jitter);
                }
            }
            for r in 0..world as usize {
                budget[r] += speed[r];
                while budget[r] >= 1.0 && at[r] < len {
                    budget[r] -= 1.0;
                    let i = orders[r][at[r]];
                    at[r] += 1;
                    buf.clear();
                    clients[r / rpn]
                        .open(backing.join(format!("ds/s{i:05}")))?
                        .read_to_end(&mut buf)?;
                    anyhow::ensure!(
                        buf.len() as u64 == sizes[i as usize],
                        "file {i}: short read"
                    );
                }
            }
            tick += 1;
            if tick.is_multiple_of(4) {
                for c in &clients {
                    let st = c.status()?;
                    let u = st.used_bytes as f64 / st.capacity_bytes.max(1) as f64;
                    use_sum += u;
                    use_n += 1;
                    use_peak = use_peak.max(u);
                }
            }
        }
        for c in &clients {
            c.status()?; // deliver the read reports
        }
        let after = counters()?;
        if verbose {
            for (i, c) in clients.iter().enumerate() {
                let st = c.status()?;
                let pos: Vec<(u64, u64)> = st.jobs.iter().map(|j| (j.epoch, j.step)).collect();
                let placed: Vec<(u64, u64)> = st
                    .jobs
                    .iter()
                    .map(|j| (j.placement_here, j.placement_departing))
                    .collect();
                eprintln!(
                    "a={a} epoch {epoch} node {i}: position {pos:?} used {} of {}; placed here, departing {placed:?}",
                    st.used_bytes, st.capacity_bytes
                );
            }
            for (i, (b, x)) in before.iter().zip(&after).enumerate() {
                eprintln!(
                    "a={a} epoch {epoch} node {i}: backing_reads {} peer_in {} peer_out {} peer_errors {} opens_full {}/{} evicted {} no_space {} fallback_bytes {}",
                    x.backing_reads - b.backing_reads,
                    x.peer_blocks_in - b.peer_blocks_in,
                    x.peer_blocks_out - b.peer_blocks_out,
                    x.peer_errors - b.peer_errors,
                    x.opens_full - b.opens_full,
                    x.opens - b.opens,
                    x.evicted_files - b.evicted_files,
                    x.fills_no_space - b.fills_no_space,
                    x.fallback_bytes - b.fallback_bytes,
                );
            }
        }
        let mut e = PlacedEpoch {
            use_mean: use_sum / use_n.max(1) as f64,
            use_peak,
            ..PlacedEpoch::default()
        };
        let (mut backing_bytes, mut local, mut opens) = (0u64, 0u64, 0u64);
        for (b, x) in before.iter().zip(&after) {
            backing_bytes +=
                (x.backing_bytes - b.backing_bytes) + (x.fallback_bytes - b.fallback_bytes);
            local += x.opens_full - b.opens_full;
            opens += x.opens - b.opens;
            e.peer_blocks += x.peer_blocks_in - b.peer_blocks_in;
            e.no_space += x.fills_no_space - b.fills_no_space;
            e.evicted += x.evicted_files - b.evicted_files;
        }
        e.backing = backing_bytes as f64 / total as f64;
        e.local = local as f64 / opens.max(1) as f64;
        out.push(e);
    }
    drop(nodes);
    Ok(out)
}

/// One placement run of fixed-size files, summed over the epochs after the first.
pub fn placement(
    dir: &Path,
    m: usize,
    a: f64,
    files: u64,
    file_kib: u64,
    epochs: u64,
) -> anyhow::Result<Placed> {
    let sizes = file_sizes(Sizes::Fixed, files, file_kib);
    let set = Setting {
        nodes: m,
        ranks_per_node: 1,
        a,
        declare: false,
        epochs,
        pace: Pace::default(),
        link: None,
        scheme: Scheme::default(),
    };
    let per = placement_epochs(dir, &sizes, set)?;
    let later = &per[1..];
    let n = later.len().max(1) as f64;
    Ok(Placed {
        backing: later.iter().map(|e| e.backing).sum::<f64>() / n,
        local: later.iter().map(|e| e.local).sum::<f64>() / n,
        use_mean: later.iter().map(|e| e.use_mean).sum::<f64>() / n,
        use_peak: later.iter().map(|e| e.use_peak).fold(0.0, f64::max),
    })
}

/// Where the nodes of a placement run are: loopback, or the namespaces of the testbed
/// script (`cluster-net.sh`) with links shaped to a rate.
#[derive(Debug, Clone, Default)]
pub struct Where {
    /// The testbed script; `None`: loopback.
    pub testbed: Option<PathBuf>,
    /// The links' `tc` rate on the testbed (`none`: unshaped veth).
    pub link: String,
}

/// The placement benchmark (`shardcache-bench placement`): per epoch, for each `a`, the
/// manifest giving every file's size (`declare`), or not, or both.
#[allow(clippy::too_many_arguments)]
pub fn run_placement(
    dir: &Path,
    m: usize,
    ranks_per_node: usize,
    avals: &[f64],
    kind: Sizes,
    files: u64,
    kib: u64,
    epochs: u64,
    declare: &[bool],
    pace: Pace,
    at: &Where,
    scheme: Scheme,
) -> anyhow::Result<()> {
    let Pace { drift, jitter } = pace;
    let sizes = file_sizes(kind, files, kib);
    let total: u64 = sizes.iter().sum();
    let (lo, hi) = (
        sizes.iter().min().copied().unwrap_or(0),
        sizes.iter().max().copied().unwrap_or(0),
    );
    // Up once for every run, down at the end (on failure too).
    let bed = match &at.testbed {
        Some(script) => Some(Testbed::up_nodes(script, m, &at.link)?),
        None => None,
    };
    let net = match &bed {
        Some(_) => format!(
            "in network namespaces of the testbed (tbf {} on both ends of each link)",
            at.link
        ),
        None => "on loopback".to_owned(),
    };
    println!(
        "placement ({scheme}): {m} nodes {net}, {ranks_per_node} rank(s) per node, distributed shuffle ({}), {files} files of {kind:?} sizes (mean {:.0} KiB, {:.0}–{:.0} KiB; {:.2} GiB), block {} KiB, {epochs} epochs",
        if drift > 0.0 {
            format!("each rank at 1 ± {drift} of the mean pace per epoch")
        } else if jitter > 0.0 {
            format!("each rank at 1 ± {jitter} of the mean pace per step")
        } else {
            "lockstep".to_owned()
        },
        total as f64 / files.max(1) as f64 / 1024.0,
        lo as f64 / 1024.0,
        hi as f64 / 1024.0,
        total as f64 / (1u64 << 30) as f64,
        block_for(total / files.max(1)) >> 10,
    );
    println!(
        "{:>6} {:>5} {:>5} | {:>8} {:>6} | {:>6} | {:>11} | {:>9} {:>7} | cache use mean / peak",
        "sizes", "a", "epoch", "backing", "floor", "local", "peer blocks", "no space", "evicted"
    );
    for &d in declare {
        for &a in avals {
            let set = Setting {
                nodes: m,
                ranks_per_node,
                a,
                declare: d,
                epochs,
                pace,
                link: bed.as_ref().map(|b| b.link.nodes.as_slice()),
                scheme,
            };
            let per = placement_epochs(dir, &sizes, set)?;
            for (e, p) in per.iter().enumerate() {
                let floor = if e == 0 { 1.0 } else { (1.0f64 - a).max(0.0) };
                println!(
                    "{:>6} {a:>5.1} {e:>5} | {:>8.3} {floor:>6.3} | {:>6.3} | {:>11} | {:>9} {:>7} | {:.2} / {:.2}",
                    if d { "given" } else { "none" },
                    p.backing,
                    p.local,
                    p.peer_blocks,
                    p.no_space,
                    p.evicted,
                    p.use_mean,
                    p.use_peak
                );
            }
        }
    }
    drop(bed);
    println!(
        "sizes: given = the manifest gives every file's size (placement in bytes); none = it does not (placement in files of the sampled mean size)"
    );
    println!(
        "goals (epochs after the first): backing ≤ max(0, 1 − a) + 0.01; local reads ≥ 0.95 at a ≥ 1"
    );
    Ok(())
}

/// Where the transfer runs: loopback, or a testbed link at a rate.
#[derive(Debug, Clone)]
pub enum Net {
    /// Both nodes on loopback addresses of this network namespace.
    Loopback,
    /// Each node in a namespace of the testbed script `script` (`cluster-net.sh`), the
    /// link between them shaped to `rate` (a `tc` rate such as `1gbit`; `none`:
    /// unshaped veth).
    Link {
        /// The testbed script.
        script: PathBuf,
        /// The link rate.
        rate: String,
    },
}

/// Prints the benchmark; with `tls`, the transfer runs over mutual TLS, and with `tls`
/// or a testbed link placement is left out (neither changes placement).
pub fn run(dir: &Path, mib: u64, rounds: usize, tls: bool, net: &Net) -> anyhow::Result<()> {
    if rounds > 0 {
        let (t, path) = match net {
            Net::Loopback => (
                transfer(dir, mib, rounds, tls, None)?,
                "over loopback".to_owned(),
            ),
            Net::Link { script, rate } => {
                let bed = Testbed::up(script, rate)?;
                let t = transfer(dir, mib, rounds, tls, Some(&bed.link));
                drop(bed);
                let shaped = if rate == "none" {
                    "unshaped veth".to_owned()
                } else {
                    format!("tbf {rate} on both ends")
                };
                (
                    t?,
                    format!("across two network namespaces, veth + bridge, {shaped}"),
                )
            }
        };
        println!(
            "transfer: {mib} MiB in 4 MiB blocks, node to node {path}, {rounds} rounds in rotating order (medians)"
        );
        println!(
            "  peer fetch (block stream{}: a MAC per block (keyed BLAKE3) and xxh3, the sender reads, checks the xxh3, MACs then writes, the receiver checks MAC and xxh3 in one pass; {IN_FLIGHT} in flight as the fill engine does) {:.0} MiB/s",
            if tls { " over mutual TLS 1.3" } else { "" },
            t.peer
        );
        println!(
            "  raw TCP, same bytes from the same page-cached file (pread + write, 1 MiB): 1 stream {:.0} MiB/s, {IN_FLIGHT} streams {:.0} MiB/s",
            t.raw_one, t.raw_many
        );
        println!(
            "  ratio peer ÷ one raw TCP stream of the same round: median {:.2} (goal ≥ 0.9)",
            t.ratio_one
        );
        println!(
            "  ratio peer ÷ the faster raw configuration of the same round (stricter): median {:.2} (rounds {:.2}–{:.2})",
            t.ratio, t.ratio_range.0, t.ratio_range.1
        );
        println!(
            "  whole read through node B's cache of the file node A holds (open, fetch, durable landing, the client's read; evicted from B before each round) {:.0} MiB/s: ÷ one raw TCP stream of the same round median {:.2} (rounds {:.2}–{:.2}; goal ≥ 0.9)",
            t.whole, t.ratio_whole, t.ratio_whole_range.0, t.ratio_whole_range.1
        );
        println!(
            "  CPU per GiB moved (both ends, user + system, medians): peer fetch {:.2} s, one raw stream {:.2} s",
            t.peer_cpu, t.raw_cpu
        );
    }
    if tls || matches!(net, Net::Link { .. }) {
        return Ok(());
    }
    let (m, files, kib, epochs) = (4usize, 240u64, 128u64, 4u64);
    println!(
        "placement: {m} nodes, distributed shuffle (one rank each), {files} files of {kib} KiB, {epochs} epochs (first not counted)"
    );
    println!(
        "{:>6} | {:>16} {:>8} | {:>12} | {:>22}",
        "a", "backing/epoch", "floor", "local reads", "cache use: mean / peak"
    );
    // `SHARDCACHE_BENCH_A=1,2` runs only those.
    let only: Option<Vec<f64>> = std::env::var("SHARDCACHE_BENCH_A")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect());
    for a in [0.5, 1.0, 2.0] {
        if only.as_ref().is_some_and(|o| !o.contains(&a)) {
            continue;
        }
        let p = placement(dir, m, a, files, kib, epochs)?;
        println!(
            "{a:>6.1} | {:>16.3} {:>8.3} | {:>12.3} | {:>15.2} / {:.2}",
            p.backing,
            (1.0f64 - a).max(0.0),
            p.local,
            p.use_mean,
            p.use_peak
        );
    }
    println!("goals: backing within 0.01 of its floor; local reads ≥ 0.95 at a ≥ 1");
    println!(
        "cache use: the nodes' caches hold up to their capacity, plus the copies they keep until another node has taken them"
    );
    Ok(())
}

/// Read latencies of one phase of [`silent`].
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// Every read's latency.
    pub reads: Vec<std::time::Duration>,
}

impl Phase {
    /// The `q` quantile in milliseconds (0 without reads).
    fn ms(&self, q: f64) -> f64 {
        if self.reads.is_empty() {
            return 0.0;
        }
        crate::quantile_us(&mut self.reads.clone(), q) / 1e3
    }
}

/// The silent-peer benchmark (`shardcache-bench silent`): `n` nodes on the testbed
/// (`cluster-net.sh up n rate`), each a daemon of this process in its namespace with a
/// cache of an eighth of the dataset (so reads keep crossing to the files' owners, a
/// quarter of them the node that goes silent) and the default `peer_timeout` (2 s).
/// The other nodes' readers read files of `file_kib` KiB at random, one reader per node,
/// through `before` seconds of a healthy cluster, `outage` seconds with the last node
/// black-holed (`cluster-net.sh blackhole`: every frame to and from it dropped, no RST,
/// no ICMP), and `after` seconds once it is healed. Returns each phase's latencies.
pub fn silent(
    dir: &Path,
    script: &Path,
    n: usize,
    rate: &str,
    files: u64,
    file_kib: u64,
    phases: [std::time::Duration; 3],
) -> anyhow::Result<[Phase; 3]> {
    anyhow::ensure!(n >= 2, "two nodes at least");
    let size = file_kib << 10;
    let tmp = tempfile::tempdir_in(dir)?;
    let backing = tmp.path().join("backing");
    std::fs::create_dir_all(backing.join("ds"))?;
    let backing = backing.canonicalize()?;
    for i in 0..files {
        write_file(&backing.join(format!("ds/f{i:05}")), i, size);
    }
    let bed = Testbed::up_nodes(script, n, rate)?;
    let capacity = (files * size / 8).max(size);
    let (nodes, _addrs, sockets) = cluster(
        tmp.path(),
        &backing,
        n,
        1 << 20,
        capacity,
        false,
        Some(&bed.link.nodes[..]),
        Scheme::default(),
    )?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let phase = AtomicUsize::new(0);
    let out: std::sync::Mutex<[Phase; 3]> = std::sync::Mutex::new(Default::default());
    let silent_node = n.to_string();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let mut readers = Vec::new();
        for (r, socket) in sockets.iter().enumerate().take(n - 1) {
            let (stop, phase, out, backing) = (&stop, &phase, &out, &backing);
            readers.push(s.spawn(move || -> anyhow::Result<()> {
                let client = Client::at(socket);
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ r as u64;
                let mut buf = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let i = x % files;
                    let p = phase.load(Ordering::Relaxed);
                    let t = Instant::now();
                    buf.clear();
                    client
                        .open(backing.join(format!("ds/f{i:05}")))?
                        .read_to_end(&mut buf)?;
                    let took = t.elapsed();
                    anyhow::ensure!(buf == content(i, size), "file {i}: wrong bytes");
                    out.lock().unwrap_or_else(|e| e.into_inner())[p]
                        .reads
                        .push(took);
                }
                Ok(())
            }));
        }
        std::thread::sleep(phases[0]);
        bed.call(&["blackhole", &silent_node])?;
        phase.store(1, Ordering::Relaxed);
        std::thread::sleep(phases[1]);
        bed.call(&["heal", &silent_node])?;
        phase.store(2, Ordering::Relaxed);
        std::thread::sleep(phases[2]);
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join()
                .map_err(|_| anyhow::anyhow!("a reader panicked"))??;
        }
        Ok(())
    })?;
    drop(nodes);
    drop(bed);
    Ok(out.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// Prints [`silent`]'s table.
pub fn run_silent(
    dir: &Path,
    script: &Path,
    rate: &str,
    files: u64,
    file_kib: u64,
    outage_s: u64,
) -> anyhow::Result<()> {
    use std::time::Duration;
    let n = 4;
    let phases = [
        Duration::from_secs(5),
        Duration::from_secs(outage_s),
        Duration::from_secs(5),
    ];
    let got = silent(dir, script, n, rate, files, file_kib, phases)?;
    println!(
        "silent peer: {n} nodes on the testbed (tbf {rate}), {files} files of {file_kib} KiB, each cache 1/8 of them, peer_timeout 2 s; \
         one reader on each of nodes 1-{}, random files; node {n} black-holed (every frame dropped) for {outage_s} s",
        n - 1
    );
    println!(
        "{:<28} {:>7} {:>9} {:>9} {:>9} {:>12}",
        "phase", "reads", "p50 ms", "p99 ms", "max ms", "> 100 ms"
    );
    for (name, p) in ["healthy (5 s)", "node silent", "healed (5 s)"]
        .iter()
        .zip(&got)
    {
        println!(
            "{:<28} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>12}",
            name,
            p.reads.len(),
            p.ms(0.5),
            p.ms(0.99),
            p.ms(1.0),
            p.reads
                .iter()
                .filter(|&&t| t > Duration::from_millis(100))
                .count()
        );
    }
    Ok(())
}
