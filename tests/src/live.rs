//! The policy benchmark on the real daemon: a [`Daemon`] in this process — its planner,
//! prefetcher, store on local disk, fill workers and request handlers — over an
//! in-memory backing store throttled to `B` bytes per second, read by a simulated
//! consumer that wants `R` files per second in the order a shuffled plan gives.
//!
//! The consumer goes through [`handle_request`], the code a connection thread runs for
//! every request, so only the socket is skipped; it follows the client library's reader
//! (open; read a cached file from its descriptor; otherwise wait for the daemon to fill
//! it and read the descriptor; read the backing store itself when the daemon declines).
//! Its own backing reads go through the same throttle, as a client's would share the
//! shared file system's bandwidth with the daemon.
//!
//! Time is real, so the figures carry the machine's noise (unlike the simulation in
//! [`crate::policy`], which runs the same planner decisions on simulated time).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shardcache_daemon::access::Creds;
use shardcache_daemon::backing::mem::MemBacking;
use shardcache_daemon::backing::throttle::ThrottledBacking;
use shardcache_daemon::backing::{Backing, Owner};
use shardcache_daemon::config::{Config, SizeSpec};
use shardcache_daemon::daemon::Daemon;
use shardcache_daemon::meta::Root;
use shardcache_daemon::server::{Ctx, handle_request};
use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{open_reply, request, response, wait_reply};

/// One run's parameters.
#[derive(Debug, Clone)]
pub struct Params {
    /// Files in the dataset.
    pub files: u64,
    /// Bytes per file (one cache block each).
    pub file_size: u64,
    /// Cache capacity ÷ dataset size.
    pub cn: f64,
    /// Backing bandwidth, bytes per second.
    pub bandwidth: u64,
    /// Consumer rate ÷ backing rate (both in files per second).
    pub rb: f64,
    /// Epochs read (the first is not counted).
    pub epochs: u64,
    /// Shuffle seed.
    pub seed: u64,
    /// Register the plan (`false`: the same reads with no plan, i.e. LRU and no prefetch).
    pub planned: bool,
    /// Where the cache lives (a temporary directory is made in it).
    pub cache_parent: PathBuf,
}

/// Steady-state figures (epochs after the first, together).
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    /// 1 − backing bytes ÷ bytes read.
    pub hit_rate: f64,
    /// Fraction of the time the consumer waited for data.
    pub stall: f64,
    /// Backing bytes per epoch ÷ dataset bytes.
    pub backing_per_epoch: f64,
    /// Reads that found their file cached whole, ÷ reads.
    pub open_hits: f64,
}

const ROOT: &str = "/bench";

fn byte(i: u64, j: u64) -> u8 {
    (i.wrapping_mul(31).wrapping_add(j.wrapping_mul(7)) % 251) as u8
}

/// Runs one configuration.
pub fn run(p: &Params) -> anyhow::Result<Outcome> {
    let tmp = tempfile::tempdir_in(&p.cache_parent)?;
    let mem = Arc::new(MemBacking::new());
    for i in 0..p.files {
        let data: Vec<u8> = (0..p.file_size).map(|j| byte(i, j)).collect();
        mem.put(
            &format!("f{i:06}"),
            data,
            Owner {
                mode: 0o644,
                ..Owner::default()
            },
        );
    }
    let backing: Arc<dyn Backing> = Arc::new(ThrottledBacking::new(mem, p.bandwidth));
    let cap = (p.files as f64 * p.cn).round() as u64 * p.file_size;
    let cfg = Config {
        backing_roots: vec![PathBuf::from(ROOT)],
        cache_dir: tmp.path().join("cache"),
        socket: tmp.path().join("sock"),
        capacity: SizeSpec::Bytes(cap),
        min_free: SizeSpec::Bytes(0),
        block_size: p.file_size,
        metadata_ttl: Duration::from_secs(3600),
        metrics_listen: shardcache_daemon::config::MetricsListen::Off,
        ..Config::default()
    };
    let roots = vec![Root {
        path: PathBuf::from(ROOT),
        name: ROOT.to_owned(),
        backing: backing.clone(),
    }];
    let d = Daemon::start_with_roots(&cfg, roots).context("starting the daemon")?;
    let ctx = d.ctx().clone();
    let creds = Creds {
        pid: std::process::id() as i32,
        uid: 0,
        gid: 0,
        groups: Vec::new(),
    };
    if p.planned {
        let files: Vec<String> = (0..p.files).map(|i| format!("f{i:06}")).collect();
        // One epoch more than is read, so that every epoch read has a next one.
        let m = serde_json::json!({
            "version": 1, "job": "bench", "root": ROOT, "files": files, "immutable": true,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": p.seed,
                     "epochs": p.epochs + 1, "world_size": 1, "ranks": [0]}
        });
        let (r, _) = call(
            &ctx,
            &creds,
            request::Kind::Register(pb::RegisterRequest {
                manifest_json: m.to_string(),
                ..Default::default()
            }),
        );
        if !matches!(r, response::Kind::Register(_)) {
            bail!("registration failed: {r:?}");
        }
    }
    let backing_rate = p.bandwidth as f64 / p.file_size as f64;
    let period = Duration::from_secs_f64(1.0 / (p.rb * backing_rate));
    let mut buf = vec![0u8; p.file_size as usize];
    let (mut stall, mut total, mut fetched, mut hits, mut reads) =
        (Duration::ZERO, Duration::ZERO, 0u64, 0u64, 0u64);
    for epoch in 0..p.epochs {
        let order = shardcache_plan::shuffle::node_order(p.files, p.seed, epoch, 1, &[0], false);
        let before = ctx.stats.snapshot().backing_bytes;
        let mut fallback = 0u64;
        let start = Instant::now();
        let mut due = start;
        let mut waited = Duration::ZERO;
        let mut epoch_hits = 0;
        for &i in &order {
            wait_until(due);
            let r = read_file(&ctx, &creds, &*backing, i, &mut buf)?;
            if buf.first() != Some(&byte(i, 0)) || buf.last() != Some(&byte(i, p.file_size - 1)) {
                bail!("file {i}: wrong bytes");
            }
            fallback += r.fallback;
            let ready = if r.hit {
                epoch_hits += 1;
                due
            } else {
                let now = Instant::now();
                waited += now.saturating_duration_since(due);
                now.max(due)
            };
            due = ready + period;
        }
        if epoch > 0 {
            stall += waited;
            total += due - start;
            fetched += ctx.stats.snapshot().backing_bytes - before + fallback;
            hits += epoch_hits;
            reads += order.len() as u64;
        }
    }
    d.close()?;
    let measured = (p.epochs - 1) as f64;
    let bytes = measured * (p.files * p.file_size) as f64;
    Ok(Outcome {
        hit_rate: 1.0 - fetched as f64 / bytes,
        stall: stall.as_secs_f64() / total.as_secs_f64(),
        backing_per_epoch: fetched as f64 / bytes,
        open_hits: hits as f64 / reads as f64,
    })
}

/// Sleeps, then spins for the last moments, until `t` (a sleep alone overshoots by up to
/// a tenth of a millisecond on virtual machines).
fn wait_until(t: Instant) {
    const SPIN: Duration = Duration::from_micros(200);
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        let left = t - now;
        if left > SPIN {
            std::thread::sleep(left - SPIN);
        } else {
            std::hint::spin_loop();
        }
    }
}

fn call(ctx: &Ctx, creds: &Creds, kind: request::Kind) -> (response::Kind, Vec<File>) {
    let (resp, fds) = handle_request(
        ctx,
        creds,
        pb::Request {
            id: 1,
            report: None,
            kind: Some(kind),
        },
    );
    (
        resp.kind
            .unwrap_or(response::Kind::Error(pb::ErrorReply::default())),
        fds,
    )
}

struct Read {
    hit: bool,
    fallback: u64,
}

fn all_set(bm: &[u8], n: u64) -> bool {
    (0..n).all(|b| {
        bm.get((b / 8) as usize)
            .is_some_and(|x| x & (1 << (b % 8)) != 0)
    })
}

/// Reads file `i` whole into `buf` the way the client library's reader does.
fn read_file(
    ctx: &Ctx,
    creds: &Creds,
    backing: &dyn Backing,
    i: u64,
    buf: &mut [u8],
) -> anyhow::Result<Read> {
    let path = format!("{ROOT}/f{i:06}");
    let (r, mut fds) = call(
        ctx,
        creds,
        request::Kind::Open(pb::OpenRequest { path: path.clone() }),
    );
    let opened = match r {
        response::Kind::Open(pb::OpenReply {
            result: Some(open_reply::Result::Opened(o)),
        }) => o,
        other => bail!("open {path}: {other:?}"),
    };
    let nblocks = buf.len().div_ceil(opened.block_size as usize) as u64;
    if all_set(&opened.present, nblocks) {
        let f = fds.pop().context("no descriptor with a whole file")?;
        f.read_exact_at(buf, 0)?;
        return Ok(Read {
            hit: true,
            fallback: 0,
        });
    }
    let (r, mut fds2) = call(
        ctx,
        creds,
        request::Kind::Wait(pb::WaitRequest {
            path: path.clone(),
            version: opened.version,
            first_block: 0,
            count: nblocks as u32,
            have_data_gen: opened.data_gen,
            timeout_ms: 30_000,
            ..Default::default()
        }),
    );
    if let response::Kind::Wait(pb::WaitReply {
        result: Some(wait_reply::Result::Waited(w)),
    }) = r
        && !w.declined
        && all_set(&w.present, nblocks)
        && let Some(f) = fds2.pop().or_else(|| fds.pop())
    {
        f.read_exact_at(buf, 0)?;
        return Ok(Read {
            hit: false,
            fallback: 0,
        });
    }
    // The daemon could not help: read the backing store, through the same throttle.
    let stat = backing.stat(&format!("f{i:06}"))?;
    let f = backing.open(&stat)?;
    let mut off = 0;
    while off < buf.len() {
        let n = f.read_at(&mut buf[off..], off as u64)?;
        if n == 0 {
            bail!("file {i}: short read from the backing store");
        }
        off += n;
    }
    Ok(Read {
        hit: false,
        fallback: buf.len() as u64,
    })
}
