//! `shardcache-demo`: the cache working on generated data, end to end, in one command.
//!
//! Generates a small dataset, starts a real `shardcached` on it (in a temporary
//! directory, on a private socket), reads every file twice through the client library
//! — the first read comes from the backing store while the daemon fills local NVMe, the
//! second from the local copy — prints what happened, and stops the daemon.

use std::io::Read;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use shardcache_client::{Client, ReaderStats};
use shardcache_tests::{Bed, bin, content, drop_page_cache, write_file};
use xxhash_rust::xxh3::xxh3_64;

#[derive(Debug, Parser)]
#[command(name = "shardcache-demo")]
struct Args {
    /// Where to create the temporary dataset and cache.
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Number of shard files.
    #[arg(long, default_value_t = 16)]
    files: u64,
    /// Size of each shard in MiB.
    #[arg(long, default_value_t = 32)]
    mib: u64,
    /// Bandwidth of the stand-in shared file system (the daemon's backing_bandwidth),
    /// e.g. 200MiB; "0" reads the local disk unthrottled.
    #[arg(long, default_value = "200MiB")]
    backing_bandwidth: String,
}

struct Pass {
    secs: f64,
    stats: ReaderStats,
}

fn pass(client: &Client, files: &[PathBuf], sums: &[u64]) -> Pass {
    let mut total = ReaderStats::default();
    let mut buf = Vec::new();
    let t = Instant::now();
    for (p, sum) in files.iter().zip(sums) {
        buf.clear();
        let mut r = client.open(p).expect("open");
        r.read_to_end(&mut buf).expect("read");
        assert_eq!(xxh3_64(&buf), *sum, "{}: wrong bytes", p.display());
        let s = r.stats();
        total.hit_bytes += s.hit_bytes;
        total.filled_bytes += s.filled_bytes;
        total.fallback_bytes += s.fallback_bytes;
    }
    Pass {
        secs: t.elapsed().as_secs_f64(),
        stats: total,
    }
}

fn main() {
    let a = Args::parse();
    let bed = Bed::new_in(&a.dir);
    let files: Vec<PathBuf> = (0..a.files)
        .map(|i| bed.path(&format!("shards/shard-{i:04}.tar")))
        .collect();
    let total = (a.files * a.mib) << 20;
    println!("shardcache demo");
    println!(
        "  dataset: {} shards × {} MiB in {}",
        a.files,
        a.mib,
        bed.backing.display()
    );
    let mut sums = Vec::new();
    for (i, p) in files.iter().enumerate() {
        write_file(p, i as u64, a.mib << 20);
        drop_page_cache(p).expect("fadvise");
        sums.push(xxh3_64(&content(i as u64, a.mib << 20)));
    }
    let throttled = a.backing_bandwidth != "0";
    if throttled {
        println!(
            "  backing store: throttled to {}/s to stand in for a shared file system",
            a.backing_bandwidth
        );
    }
    let mut daemon = bed.start(&["--backing-bandwidth", &a.backing_bandwidth, "--log", "warn"]);
    println!(
        "  daemon: pid {}, socket {}",
        daemon.pid(),
        bed.socket.display()
    );
    let client = bed.client();

    let mib = |b: u64| b as f64 / 1048576.0;
    let show = |name: &str, p: &Pass| {
        println!(
            "  {name}: {:>7.1} MiB in {:>6.2} s = {:>7.0} MiB/s   (already local {:.0} MiB, waited for a fill {:.0} MiB, read from backing by the client {:.0} MiB)",
            mib(total),
            p.secs,
            mib(total) / p.secs,
            mib(p.stats.hit_bytes),
            mib(p.stats.filled_bytes),
            mib(p.stats.fallback_bytes)
        );
    };
    println!();
    let cold = pass(&client, &files, &sums);
    show("first read (cold) ", &cold);
    let warm = pass(&client, &files, &sums);
    show("second read (warm)", &warm);
    println!(
        "  the second read was {:.1}× faster; every byte was checked against the source",
        cold.secs / warm.secs
    );
    println!();
    // Dropping the client delivers its last read report to the daemon.
    drop(client);
    println!("$ shardcache status");
    let status = Command::new(bin("shardcache"))
        .args(["--socket", bed.socket.to_str().expect("utf8"), "status"])
        .status()
        .expect("run shardcache status");
    assert!(status.success());
    // The same counters, as Prometheus scrapes them.
    if let Some(addr) = daemon.metrics_addr() {
        println!();
        println!("$ curl -s http://{addr}/metrics | grep shardcache_read_bytes_total");
        let (_, text) = shardcache_tests::http_get(addr, "/metrics").expect("scrape /metrics");
        for l in text
            .lines()
            .filter(|l| l.starts_with("shardcache_read_bytes_total"))
        {
            println!("{l}");
        }
    }
    let clean = daemon.stop();
    println!();
    println!(
        "daemon stopped ({}); temporary files removed",
        if clean { "cleanly" } else { "forcibly" }
    );
}
