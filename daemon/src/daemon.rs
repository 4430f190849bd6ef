//! Wiring: builds every part from a [`Config`] in one pass, each handed what it uses at
//! construction (imports point downward only; nothing is set later), runs them, and
//! shuts them down in order (stop clients, stop fills, then mark the store clean).
//!
//! The order of construction: the roots and the metadata cache; the member list (with
//! peers); the plans cell ([`Plans`]: what the store's eviction policy, the peers and
//! the jobs share); the store over the plan-aware policy; the peers' client; the fill
//! engine over its sources (the peers, then each root's backing store); the peer port
//! serving through the fill engine; the jobs; the socket server; the prefetcher.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::backing::Backing;
use crate::backing::posix::PosixBacking;
use crate::backing::throttle::{Bucket, ThrottledBacking};
use crate::blocks::{BlockSource, Sources};
use crate::cache::{ReadPath, ReadPathConfig};
use crate::config::{Config, MetricsListen};
use crate::fill::Filler;
use crate::jobs::Jobs;
use crate::lifecycle::{Shutdown, Task, Wake};
use crate::meta::{Meta, Root, Roots};
use crate::metrics::Metrics;
use crate::metrics::http::{self, Endpoint, HttpServer};
use crate::peer::membership::Source;
use crate::peer::source::PeerSource;
use crate::peer::{PeerConfig, PeerServer, Peers};
use crate::policy::planned::PlannedPolicy;
use crate::policy::{Members, Plans};
use crate::server::{self, Ctx, Server};
use crate::stats::Stats;
use crate::store::{Store, StoreConfig};

/// The stall bound the roots are watched with: `backing_stall_timeout`, but never less
/// than a read may legitimately wait for `backing_bandwidth` tokens (a piece of each of
/// twice `fill_workers` reads ahead of it), so that throttling is not taken for a hang.
fn stall_bound(cfg: &Config) -> Duration {
    let stall = cfg.backing_stall_timeout;
    match cfg.backing_bandwidth {
        Some(bw) if !stall.is_zero() => {
            let pieces = 2.0 * cfg.fill_workers as f64 + 1.0;
            let wait = pieces * crate::backing::watch::READ_PIECE as f64 / bw.max(1) as f64;
            stall.max(Duration::from_secs_f64(2.0 * wait))
        }
        _ => stall,
    }
}

/// Per root, whether a cold small file's first reader reads the backing store itself
/// (`cold_reads`; [`crate::cache::ReadPathConfig::direct`]). `auto` says yes where the
/// fill queued behind the reader will find the bytes in the page cache: not on a FUSE
/// mount (the kernel drops a FUSE file's pages at each open unless its server asks to
/// keep them, so the fill would read the link a second time), and not with peers on
/// (the fill may take the file from a peer, which the reader's read would bypass).
/// Each root's choice is logged once.
fn direct_cold_reads(cfg: &Config, roots: &crate::meta::Roots, peers: bool) -> Vec<bool> {
    use crate::config::ColdReads;
    roots
        .all()
        .iter()
        .map(|r| {
            let (direct, why) = match cfg.cold_reads {
                ColdReads::Direct => (true, "cold_reads = direct"),
                ColdReads::Through => (false, "cold_reads = through"),
                ColdReads::Auto if peers => (false, "peers are on"),
                ColdReads::Auto => match crate::backing::posix::keeps_page_cache(&r.path) {
                    Some(true) => (true, "its page cache outlives an open"),
                    Some(false) => (false, "a FUSE mount drops its page cache at each open"),
                    None => (false, "its file system type is unknown"),
                },
            };
            tracing::info!(
                root = %r.name,
                reader = if direct { "direct" } else { "through the daemon" },
                why,
                "cold small files"
            );
            direct
        })
        .collect()
}

/// Everything start-up refuses of `cfg`: [`Config::check`] (the settings, and what this
/// machine must offer), then that the peer TLS files load ([`crate::peer::tls::Tls::load`]:
/// they parse, the key fits the certificate, the certificate verifies against the CA).
/// `shardcached --check-config` and [`Daemon::start`] both call it, so that the check
/// passes exactly the configurations a start accepts.
pub fn check(cfg: &Config) -> Result<(), String> {
    cfg.check()?;
    if let Some(files) = cfg.peer_tls() {
        crate::peer::tls::Tls::load(&files)?;
    }
    Ok(())
}

/// A running daemon.
#[derive(Debug)]
pub struct Daemon {
    server: Server,
    ctx: Arc<Ctx>,
    peers: Option<Arc<Peers>>,
    peer_server: Option<PeerServer>,
    filler: Arc<Filler>,
    store: Arc<Store>,
    scrub: Option<Task>,
    prefetch: Option<Task>,
    http: Option<HttpServer>,
    /// What the probes look at; `ready` is cleared when shutdown begins.
    probes: Arc<Probes>,
}

/// Longest shutdown waits for a task (the prefetcher, the scrub) to end.
const TASK_STOP: Duration = Duration::from_secs(5);

/// Longest shutdown waits for the backing stores' watch threads (every root's together):
/// a healthy one ends at once when woken, and one stuck in a hung store would not come
/// back for any wait.
const BACKING_STOP: Duration = Duration::from_secs(1);

/// Most bytes per second the background scrub reads while clients are quiet (a fraction
/// of an NVMe drive's read rate).
pub const SCRUB_RATE: u64 = 256 << 20;

/// Most bytes per second the background scrub reads while clients or peers are active
/// (blocks they want are checked on first use anyway).
pub const SCRUB_RATE_BUSY: u64 = 16 << 20;

/// The parts a start has built that run threads of their own and have no `Drop` that
/// stops them: closed, in shutdown order, when a later step of the start fails, so
/// that a failed start leaves no fill worker or peer thread behind. (Tasks stop when
/// dropped; the store is closed by its own drop.)
struct Partial {
    peer_server: Option<PeerServer>,
    peers: Option<Arc<Peers>>,
    filler: Option<Arc<Filler>>,
}

impl Partial {
    /// The start succeeded: nothing is closed; the peer server goes to the daemon.
    fn started(&mut self) -> Option<PeerServer> {
        self.peers = None;
        self.filler = None;
        self.peer_server.take()
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if let Some(p) = &self.peer_server {
            p.close();
        }
        if let Some(p) = &self.peers {
            p.close();
        }
        if let Some(f) = &self.filler {
            f.close();
        }
    }
}

/// What `/metrics`, `/healthz` and `/readyz` answer from.
#[derive(Debug)]
struct Probes {
    ctx: Arc<Ctx>,
    metrics: Metrics,
    socket: std::path::PathBuf,
    accepting: Arc<AtomicBool>,
    prefetch: bool,
    /// Set once every part has started, cleared when shutdown begins.
    ready: AtomicBool,
}

impl Endpoint for Probes {
    fn render(&self) -> String {
        self.metrics.render(&self.ctx.cache.status())
    }

    fn healthy(&self) -> Result<(), String> {
        if !self.ready.load(Ordering::Acquire) {
            // Shutting down: the loops stop on purpose (readiness already says so).
            return Ok(());
        }
        if !self.accepting.load(Ordering::Acquire) {
            return Err("the client accept loop has stopped".into());
        }
        let (alive, started) = (self.ctx.filler.workers_alive(), self.ctx.filler.workers());
        if alive < started {
            return Err(format!(
                "{} of {started} fill workers have stopped",
                started - alive
            ));
        }
        if self.prefetch && !self.ctx.jobs.prefetcher_alive() {
            return Err("the prefetch thread has stopped".into());
        }
        if !self.ctx.store.journal_alive() {
            return Err("the journal writer has stopped (nothing new can be cached)".into());
        }
        Ok(())
    }

    fn ready(&self) -> Result<(), String> {
        if !self.ready.load(Ordering::Acquire) {
            return Err("starting or shutting down".into());
        }
        // The socket accepts: a connection is taken (and closed at once; its thread sees
        // the end of the stream and exits).
        std::os::unix::net::UnixStream::connect(&self.socket)
            .map(drop)
            .map_err(|e| format!("the socket {} does not accept: {e}", self.socket.display()))
    }
}

impl Daemon {
    /// Checks `cfg` ([`check`], as `shardcached --check-config` does), opens the
    /// store, binds the socket and starts serving.
    pub fn start(cfg: &Config) -> anyhow::Result<Self> {
        check(cfg).map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
        let mut roots = Vec::new();
        for r in &cfg.backing_roots {
            // Directories are trusted as long as file metadata (metadata_ttl).
            let posix = PosixBacking::with_dir_ttl(r, cfg.metadata_ttl)
                .with_context(|| format!("backing_roots: {}", r.display()))?;
            let path = posix.root().to_owned();
            let name = path
                .to_str()
                .context("backing_roots: backing root paths must be UTF-8")?
                .to_owned();
            let backing: Arc<dyn Backing> = match cfg.backing_bandwidth {
                Some(bw) => Arc::new(ThrottledBacking::new(Arc::new(posix), bw)),
                None => Arc::new(posix),
            };
            roots.push(Root {
                path,
                name,
                backing,
            });
        }
        Self::start_with_roots(cfg, roots)
    }

    /// [`Daemon::start`] over the given backing roots instead of `cfg.backing_roots`
    /// (benchmarks drive the daemon over a throttled in-memory store this way).
    pub fn start_with_roots(cfg: &Config, roots: Vec<Root>) -> anyhow::Result<Self> {
        // Bound first: a taken port stops the daemon before anything else starts.
        let metrics_listener = match cfg.metrics_listen {
            MetricsListen::Off => None,
            MetricsListen::Addr(a) => Some(
                http::bind(a).with_context(|| format!("metrics_listen: cannot listen on {a}"))?,
            ),
        };
        let metrics_addr = metrics_listener
            .as_ref()
            .map(std::net::TcpListener::local_addr)
            .transpose()
            .context("metrics_listen")?;
        let metrics = Metrics::new();
        let stats = Arc::new(Stats::default());
        let roots = Arc::new(Roots::watched(roots, stall_bound(cfg)));
        let meta = Arc::new(Meta::new(roots, cfg.metadata_ttl, 1 << 20, stats.clone()));
        let store_cfg = StoreConfig {
            dir: cfg.cache_dir.clone(),
            capacity: cfg.capacity,
            min_free: cfg.min_free,
            block_size: u32::try_from(cfg.block_size).context("block_size")?,
        };
        // With peers: the port is bound first (a taken port stops the start here), and
        // the member list exists before the store's policy, which asks it who owns what.
        let peer_cfg = match cfg.peer_listen {
            Some(listen) => {
                let pc = Self::peer_config(cfg, listen)?;
                let listener = crate::peer::bind(listen).with_context(|| {
                    format!("peer_listen: starting the peer service on {listen}")
                })?;
                Some((pc, listener))
            }
            None => None,
        };
        let membership = peer_cfg
            .as_ref()
            .map(|(pc, _)| crate::peer::member_list(pc));
        let plans = Arc::new(Plans::new(meta.roots().clone(), membership.is_some()));
        plans.planner().set_scheme(cfg.placement);
        let members = membership.clone().map(|m| m as Arc<dyn Members>);
        let policy = Box::new(PlannedPolicy::new(plans.clone(), members));
        let store = Arc::new(
            Store::open_with(&store_cfg, stats.clone(), policy, &|dir| {
                crate::store::io::open(cfg.io_engine, dir)
            })
            .with_context(|| {
                format!(
                    "cache_dir: opening the cache in {}",
                    cfg.cache_dir.display()
                )
            })?,
        );
        let peers = match (&peer_cfg, membership) {
            (Some((pc, _)), Some(m)) => Some(
                Peers::start(pc, m, plans.clone(), stats.clone(), store.block_size())
                    .with_context(|| format!("peer_listen: starting the peers on {}", pc.listen))?,
            ),
            _ => None,
        };
        // From here on, a failed step closes what was started before it.
        let mut partial = Partial {
            peer_server: None,
            peers: peers.clone(),
            filler: None,
        };
        let mut sources = Sources::backing(&meta, &stats);
        if let Some(p) = &peers {
            let first: Arc<dyn BlockSource> = Arc::new(PeerSource::new(p.clone()));
            sources = sources.ask_first(first);
        }
        // What the prefetcher sleeps on: created before the fill engine, which wakes it
        // when a fetch it asked for ends.
        let prefetch_wake = Arc::new(Wake::default());
        let filler = Arc::new(
            Filler::new(
                store.clone(),
                meta.clone(),
                stats.clone(),
                sources,
                cfg.fill_workers,
                cfg.fill_queue,
                prefetch_wake.clone(),
            )
            .context("starting fill workers")?,
        );
        partial.filler = Some(filler.clone());
        if let (Some((pc, listener)), Some(p)) = (peer_cfg, &peers) {
            partial.peer_server = Some(
                PeerServer::start(&pc, listener, p, meta.clone(), filler.clone()).with_context(
                    || format!("peer_listen: starting the peer service on {}", pc.listen),
                )?,
            );
        }
        let jobs = Arc::new(
            Jobs::new(
                meta.clone(),
                plans,
                peers.clone(),
                metrics.prefetch(),
                prefetch_wake,
            )
            .keep_registrations_in(cfg.cache_dir.join("jobs"))
            .with_context(|| format!("jobs: {}", cfg.cache_dir.join("jobs").display()))?,
        );
        stats.charge.set(jobs.charger());
        let restored = jobs.restore();
        if restored > 0 {
            tracing::info!(
                restored,
                "registrations kept from before this start restored"
            );
        }
        let listener = server::bind(&cfg.socket, cfg.socket_mode)
            .with_context(|| format!("socket: binding {}", cfg.socket.display()))?;
        let meta_for_prefetch = meta.clone();
        let cache = Arc::new(ReadPath::new(
            meta.clone(),
            store.clone(),
            filler.clone(),
            jobs.clone(),
            peers.clone(),
            stats.clone(),
            ReadPathConfig {
                readahead: cfg.readahead_blocks,
                max_wait: cfg.max_wait,
                cache_dir: cfg.cache_dir.clone(),
                started: Instant::now(),
                metrics_addr,
                direct: direct_cold_reads(cfg, meta.roots(), peers.is_some()),
            },
        ));
        let ctx = Arc::new(Ctx {
            meta,
            store: store.clone(),
            filler: filler.clone(),
            jobs: jobs.clone(),
            stats,
            cache,
            spin: cfg.spin,
            spinners: Default::default(),
        });
        let limits = server::Limits {
            max: cfg.max_connections,
            per_uid: cfg.connections_per_uid(),
            reserve: crate::config::OPERATOR_RESERVE,
        };
        let server = Server::start(listener, cfg.socket.clone(), ctx.clone(), limits)
            .context("starting the server")?;
        tracing::info!(socket = %cfg.socket.display(), "shardcached ready");
        let scrub = Self::start_scrub(&store, &ctx.stats)?;
        let prefetch = match cfg.prefetch_ahead {
            0 => None,
            ahead => Some(
                jobs.start_prefetcher(
                    store.clone(),
                    filler.clone(),
                    meta_for_prefetch,
                    crate::jobs::PrefetchConfig {
                        ahead,
                        concurrency: cfg.prefetch_concurrency,
                        bandwidth: cfg.prefetch_bandwidth,
                        ops: cfg.prefetch_ops,
                    },
                )
                .context("starting the prefetcher")?,
            ),
        };
        let probes = Arc::new(Probes {
            ctx: ctx.clone(),
            metrics,
            socket: cfg.socket.clone(),
            accepting: server.accepting(),
            prefetch: prefetch.is_some(),
            ready: AtomicBool::new(false),
        });
        let http = match metrics_listener {
            Some(l) => {
                let h = HttpServer::start(l, probes.clone())
                    .context("metrics_listen: starting the endpoint")?;
                tracing::info!(addr = %h.addr(), "metrics endpoint listening (/metrics, /healthz, /readyz)");
                Some(h)
            }
            None => None,
        };
        probes.ready.store(true, Ordering::Release);
        let peer_server = partial.started();
        Ok(Self {
            server,
            ctx,
            peers,
            peer_server,
            filler,
            store,
            scrub,
            prefetch,
            http,
            probes,
        })
    }

    /// The bound address of the metrics endpoint, when it is on.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.http.as_ref().map(HttpServer::addr)
    }

    /// The peers, when this node shares with others (benchmarks drive them directly).
    pub fn peers(&self) -> Option<&Arc<Peers>> {
        self.peers.as_ref()
    }

    /// What the request handlers share: [`server::handle_request`] serves a request with
    /// it exactly as a connection thread does, without the socket.
    pub fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// The peers' settings from `cfg` (the secret read from its file).
    fn peer_config(cfg: &Config, listen: std::net::SocketAddr) -> anyhow::Result<PeerConfig> {
        let file = cfg
            .peer_secret_file
            .as_ref()
            .context("peer_secret_file: required with peer_listen")?;
        let secret = crate::config::read_peer_secret(file).map_err(anyhow::Error::msg)?;
        let source = match &cfg.peer_dns {
            Some(name) => {
                let (name, port) = crate::config::parse_dns(name).map_err(anyhow::Error::msg)?;
                Source::Dns { name, port }
            }
            None => Source::Static(cfg.peers.clone()),
        };
        Ok(PeerConfig {
            listen,
            advertise: cfg
                .peer_advertise
                .clone()
                .unwrap_or_else(|| listen.to_string()),
            source,
            secret,
            timeout: cfg.peer_timeout,
            refresh: cfg.peer_refresh,
            tls: cfg.peer_tls(),
        })
    }

    /// After every start, checks in the background every block kept from before it
    /// (blocks are also checked on first use; this checks the ones nobody reads, so that
    /// corruption is found and counted). One thread, paced as a RAID resync is: at most
    /// [`SCRUB_RATE`] bytes per second while clients and peers are quiet, at most
    /// [`SCRUB_RATE_BUSY`] while they open, wait or fetch (they check what they read
    /// themselves), so that fills and readers keep the disk.
    fn start_scrub(store: &Arc<Store>, stats: &Arc<Stats>) -> anyhow::Result<Option<Task>> {
        let unverified = store.status().unverified;
        if unverified == 0 {
            return Ok(None);
        }
        let (st, stats) = (store.clone(), stats.clone());
        // Its end is not a failure (it ends when done): no probe reads its liveness.
        let task = Task::spawn("sc-scrub", Arc::new(AtomicBool::new(false)), move |s| {
            let started = Instant::now();
            let (idle, busy) = (Bucket::new(SCRUB_RATE), Bucket::new(SCRUB_RATE_BUSY));
            let activity = || {
                let c = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
                c(&stats.opens) + c(&stats.waits) + c(&stats.peer_blocks_out)
            };
            let mut seen = activity();
            let r = st.verify_unverified(&mut |bytes| {
                let now = activity();
                if now != seen {
                    busy.take(bytes as usize);
                } else {
                    idle.take(bytes as usize);
                }
                seen = now;
                !s.is_stopped()
            });
            tracing::info!(
                checked = r.checked,
                corrupt = r.corrupt,
                bytes = r.bytes,
                seconds = started.elapsed().as_secs_f64(),
                "background verification finished"
            );
        })
        .context("starting the scrub thread")?;
        tracing::info!(unverified, "background verification started");
        Ok(Some(task))
    }

    /// Orderly shutdown, one step after the other (docs/ARCHITECTURE.md, the
    /// concurrency table): readiness goes first; clients are disconnected (they fall
    /// back to the backing store); the peer port closes, then the peers' client (fills
    /// stop asking peers); the prefetcher stops (no new fills), then the fill engine
    /// (queued fills released, stuck workers left behind) and the scrub; connection
    /// threads are waited for; then, nothing calling the backing stores any more, their
    /// watch threads stop; the metrics endpoint closes; last, the journal is flushed and
    /// the store marked clean.
    pub fn close(mut self) -> anyhow::Result<()> {
        Self::shutdown().run(&mut self);
        self.store.close().context("closing the store")?;
        tracing::info!("shardcached stopped cleanly");
        Ok(())
    }

    /// The shutdown order ([`Daemon::close`]; the store's close follows it).
    fn shutdown() -> Shutdown<Self> {
        Shutdown::<Self>::default()
            .then("readiness", |d| {
                d.probes.ready.store(false, Ordering::Release)
            })
            .then("socket server", |d| d.server.close())
            .then("peer server", |d| {
                if let Some(p) = &d.peer_server {
                    p.close();
                }
            })
            .then("peers", |d| {
                if let Some(p) = &d.peers {
                    p.close();
                }
            })
            .then("prefetcher", |d| {
                if let Some(t) = &mut d.prefetch {
                    t.shutdown(TASK_STOP);
                }
            })
            .then("fill engine", |d| d.filler.close())
            .then("scrub", |d| {
                if let Some(t) = &mut d.scrub {
                    t.shutdown(TASK_STOP);
                }
            })
            .then("connection threads", |d| {
                let left = d.server.drain(Duration::from_secs(5));
                if left > 0 {
                    tracing::warn!(left, "client threads still running at shutdown");
                }
            })
            .then("backing store threads", |d| {
                d.ctx.meta.roots().close_threads(BACKING_STOP);
            })
            .then("metrics endpoint", |d| {
                if let Some(h) = &mut d.http {
                    h.close();
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of this process's threads.
    fn threads() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|c| c.trim().to_owned())
            .collect()
    }

    use rusty_fork::rusty_fork_test;

    // In a process of its own (the test binary run again for this test alone): it counts
    // the process's fill threads, which tests running beside it in one process start
    // too (under `cargo test`, not `cargo nextest`, it failed every run).
    rusty_fork_test! {
    /// A start that fails after the fill engine started (here: the socket path is taken
    /// by a regular file) leaves none of its workers behind.
    #[test]
    fn a_failed_start_leaves_no_fill_worker_behind() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            backing_roots: vec![dir.path().to_owned()],
            cache_dir: dir.path().join("cache"),
            // Not a socket: the server refuses to replace it.
            socket: dir.path().join("a-file"),
            metrics_listen: MetricsListen::Off,
            prefetch_ahead: 0,
            ..Config::default()
        };
        let roots = vec![Root {
            path: "/r".into(),
            name: "/r".into(),
            backing: Arc::new(crate::backing::mem::MemBacking::new()),
        }];
        std::fs::write(dir.path().join("a-file"), "keep me").unwrap();
        let Err(e) = Daemon::start_with_roots(&cfg, roots) else {
            panic!("started over a regular file")
        };
        assert!(format!("{e:#}").contains("socket"), "{e:#}");
        let left: Vec<String> = threads()
            .into_iter()
            .filter(|t| t.starts_with("sc-fill"))
            .collect();
        assert!(left.is_empty(), "still running: {left:?}");
    }
    }

    /// The order docs/ARCHITECTURE.md's concurrency table gives.
    #[test]
    fn shutdown_goes_in_the_documented_order() {
        assert_eq!(
            Daemon::shutdown().names(),
            [
                "readiness",
                "socket server",
                "peer server",
                "peers",
                "prefetcher",
                "fill engine",
                "scrub",
                "connection threads",
                "backing store threads",
                "metrics endpoint",
            ]
        );
    }

    /// The TLS half of `config::tests::peer_tls_is_all_or_nothing_with_peers`: whether
    /// the files load is checked here (the peer layer loads them), with the key named.
    #[test]
    fn check_loads_the_peer_tls_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("secret"), "0123456789abcdef-secret").unwrap();
        let f = |n: &str| Some(dir.path().join(n));
        let base = Config {
            backing_roots: vec![dir.path().to_owned()],
            cache_dir: dir.path().join("cache"),
            socket: dir.path().join("sc.sock"),
            metrics_listen: MetricsListen::Off,
            peer_listen: Some("127.0.0.1:7070".parse().unwrap()),
            peers: vec!["127.0.0.1:7071".into()],
            peer_secret_file: f("secret"),
            ..Config::default()
        };
        assert_eq!(check(&base), Ok(()));
        let all = Config {
            peer_tls_cert: f("tls.crt"),
            peer_tls_key: f("tls.key"),
            peer_tls_ca: f("ca.crt"),
            ..base
        };
        assert_eq!(all.validate(), Ok(()));
        // Missing files: the key that names them.
        let e = check(&all).unwrap_err();
        assert!(e.starts_with("peer_tls_cert:"), "{e}");
        std::fs::write(dir.path().join("tls.crt"), "not PEM").unwrap();
        let e = check(&all).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");
    }
}
