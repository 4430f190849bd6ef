//! The peers benchmark (`shardcache-bench peers`): real daemons in this process, on
//! loopback addresses, sharing one backing directory.
//!
//! 1. Transfer: node B fetches every block of a file node A owns and holds, through the
//!    peer protocol (gRPC, checksums on both ends), ÷ a raw TCP stream of the same bytes
//!    on the same loopback path.
//! 2. Placement: M nodes run a distributed shuffle (one rank each) with aggregate cache
//!    a = M·C/N; per epoch after the first, the backing traffic ÷ the dataset (floor
//!    max(0, 1 − a)) and the fraction of opens that found the file on the local NVMe.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use shardcache_client::Client;
use shardcache_daemon::config::{Config, SizeSpec};
use shardcache_daemon::daemon::Daemon;

use crate::{content, write_file};

const SECRET: &str = "benchmark cluster shared secret";

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `m` daemons sharing `backing`, each with `capacity` bytes of cache.
fn cluster(
    dir: &Path,
    backing: &Path,
    m: usize,
    block: u64,
    capacity: u64,
) -> anyhow::Result<(Vec<Daemon>, Vec<String>, Vec<PathBuf>)> {
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET)?;
    let addrs: Vec<String> = (0..m)
        .map(|_| free_port().map(|p| format!("127.0.0.1:{p}")))
        .collect::<Result<_, _>>()?;
    let mut nodes = Vec::new();
    let mut sockets = Vec::new();
    for i in 0..m {
        let socket = dir.join(format!("node-{i}.sock"));
        let cfg = Config {
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
            ..Config::default()
        };
        nodes.push(Daemon::start(&cfg).with_context(|| format!("node {i}"))?);
        sockets.push(socket);
    }
    Ok((nodes, addrs, sockets))
}

/// Peer transfer ÷ raw TCP, both on loopback: (peer MiB/s, raw MiB/s).
pub fn transfer(dir: &Path, mib: u64, rounds: usize) -> anyhow::Result<(f64, f64)> {
    let block = 4u64 << 20;
    let tmp = tempfile::tempdir_in(dir)?;
    let backing = tmp.path().join("backing");
    std::fs::create_dir_all(&backing)?;
    let backing = backing.canonicalize()?;
    let (nodes, addrs, sockets) = cluster(tmp.path(), &backing, 2, block, (8 * mib) << 20)?;
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
    let (mut peer, mut raw) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // As the fill engine does: 4 fetches in flight (its default worker count).
        let p = || -> anyhow::Result<f64> {
            let t = Instant::now();
            let next = std::sync::atomic::AtomicUsize::new(0);
            let got = std::sync::atomic::AtomicU64::new(0);
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| {
                        // Each fill worker keeps one block buffer.
                        let mut d = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if i >= nblocks {
                                return;
                            }
                            let want = (len - i as u64 * block).min(block) as usize;
                            if peers.fetch(&root, &stat, i, block as u32, want, &mut d) {
                                got.fetch_add(d.len() as u64, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            anyhow::ensure!(got.into_inner() == len, "a peer fetch failed");
            Ok(len as f64 / 1048576.0 / t.elapsed().as_secs_f64())
        };
        let r = || raw_tcp(&data_path, len);
        if round % 2 == 0 {
            peer.push(p()?);
            raw.push(r()?);
        } else {
            raw.push(r()?);
            peer.push(p()?);
        }
    }
    drop(nodes);
    Ok((crate::median(&peer), crate::median(&raw)))
}

/// One TCP stream of `len` bytes read from `file` (page-cached), 1 MiB at a time, over
/// loopback: MiB/s as the receiver sees it.
fn raw_tcp(file: &Path, len: u64) -> anyhow::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let f = std::fs::File::open(file)?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..n], off)?;
            s.write_all(&buf[..n])?;
            off += n as u64;
        }
        Ok(())
    });
    let t = Instant::now();
    let mut c = TcpStream::connect(addr)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    while got < len {
        let n = c.read(&mut buf)?;
        anyhow::ensure!(n > 0, "stream ended early");
        got += n as u64;
    }
    let secs = t.elapsed().as_secs_f64();
    server
        .join()
        .map_err(|_| anyhow::anyhow!("server panicked"))??;
    Ok(len as f64 / 1048576.0 / secs)
}

/// One placement run: (backing ÷ dataset per epoch after the first, local open fraction).
pub fn placement(
    dir: &Path,
    m: usize,
    a: f64,
    files: u64,
    file_kib: u64,
    epochs: u64,
) -> anyhow::Result<(f64, f64)> {
    let block = 64u64 << 10;
    let size = file_kib << 10;
    let tmp = tempfile::tempdir_in(dir)?;
    let backing = tmp.path().join("backing");
    std::fs::create_dir_all(backing.join("ds"))?;
    let backing = backing.canonicalize()?;
    for i in 0..files {
        write_file(&backing.join(format!("ds/s{i:05}")), i, size);
    }
    let capacity = ((a * files as f64 / m as f64).round() as u64).max(1) * size;
    let (nodes, _, sockets) = cluster(tmp.path(), &backing, m, block, capacity)?;
    let names: Vec<String> = (0..files).map(|i| format!("s{i:05}")).collect();
    let clients: Vec<Client> = sockets.iter().map(Client::at).collect();
    for (rank, c) in clients.iter().enumerate() {
        let manifest = serde_json::json!({
            "version": 1, "job": format!("bench.r{rank}"), "root": backing.join("ds"),
            "files": names, "immutable": true,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 3,
                     "epochs": epochs + 1, "world_size": m, "ranks": [rank]}
        });
        c.register(&manifest.to_string())?;
    }
    let counters = || -> anyhow::Result<Vec<shardcache_client::proto::Counters>> {
        clients
            .iter()
            .map(|c| Ok(c.status()?.counters.unwrap_or_default()))
            .collect()
    };
    let (mut backing_bytes, mut local, mut opens) = (0u64, 0u64, 0u64);
    let mut buf = Vec::new();
    for epoch in 0..epochs {
        let before = counters()?;
        // The ranks read in lockstep, as the ranks of one job do.
        let orders: Vec<Vec<u64>> = (0..m as u64)
            .map(|r| shardcache_plan::shuffle::rank_order(files, 3, epoch, m as u64, r, false))
            .collect();
        for step in 0..orders[0].len() {
            for (order, c) in orders.iter().zip(&clients) {
                let i = order[step];
                buf.clear();
                c.open(backing.join(format!("ds/s{i:05}")))?
                    .read_to_end(&mut buf)?;
                anyhow::ensure!(buf.len() as u64 == size, "file {i}: short read");
            }
        }
        for c in &clients {
            c.status()?; // deliver the read reports
        }
        let after = counters()?;
        if epoch > 0 {
            for (b, x) in before.iter().zip(&after) {
                backing_bytes +=
                    (x.backing_bytes - b.backing_bytes) + (x.fallback_bytes - b.fallback_bytes);
                local += x.opens_full - b.opens_full;
                opens += x.opens - b.opens;
            }
        }
    }
    drop(nodes);
    let measured = (epochs - 1) as f64 * (files * size) as f64;
    Ok((backing_bytes as f64 / measured, local as f64 / opens as f64))
}

/// Prints the benchmark.
pub fn run(dir: &Path, mib: u64, rounds: usize) -> anyhow::Result<()> {
    let (peer, raw) = transfer(dir, mib, rounds)?;
    println!(
        "transfer: {mib} MiB in 4 MiB blocks, node to node over loopback, {rounds} alternating rounds (medians)"
    );
    println!(
        "  peer fetch (gRPC, checksums both ends, 4 in flight as the fill engine does) {peer:.0} MiB/s; raw TCP stream {raw:.0} MiB/s; ratio {:.2} (goal ≥ 0.9)",
        peer / raw
    );
    let (m, files, kib, epochs) = (4usize, 240u64, 128u64, 4u64);
    println!(
        "placement: {m} nodes, distributed shuffle (one rank each), {files} files of {kib} KiB, {epochs} epochs (first not counted)"
    );
    println!(
        "{:>6} | {:>16} {:>8} | {:>12}",
        "a", "backing/epoch", "floor", "local reads"
    );
    for a in [0.5, 1.0, 2.0] {
        let (backing, local) = placement(dir, m, a, files, kib, epochs)?;
        println!(
            "{a:>6.1} | {backing:>16.3} {:>8.3} | {local:>12.3}",
            (1.0f64 - a).max(0.0)
        );
    }
    println!("goals: backing within 0.01 of its floor; local reads ≥ 0.95 at a ≥ 1");
    Ok(())
}
