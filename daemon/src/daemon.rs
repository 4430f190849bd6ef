//! Wiring: builds every part from a [`Config`], runs them, and shuts them down in
//! order (stop clients, stop fills, then mark the store clean).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::backing::Backing;
use crate::backing::posix::PosixBacking;
use crate::backing::throttle::ThrottledBacking;
use crate::config::{Config, MetricsListen};
use crate::fill::Filler;
use crate::jobs::{Jobs, PlannedPolicy};
use crate::meta::{Meta, Root, Roots};
use crate::metrics::Metrics;
use crate::metrics::http::{self, Endpoint, HttpServer};
use crate::peer::membership::Source;
use crate::peer::{PeerConfig, Peers};
use crate::server::{self, Ctx, Server};
use crate::stats::Stats;
use crate::store::{Store, StoreConfig};

/// A running daemon.
#[derive(Debug)]
pub struct Daemon {
    server: Server,
    ctx: Arc<Ctx>,
    peers: Option<Arc<Peers>>,
    filler: Arc<Filler>,
    store: Arc<Store>,
    scrub: Option<Scrub>,
    jobs: Arc<Jobs>,
    prefetch: Option<Scrub>,
    http: Option<HttpServer>,
    /// What the probes look at; `ready` is cleared when shutdown begins.
    probes: Arc<Probes>,
}

/// The background verification after an unclean start: its stop flag and thread.
type Scrub = (Arc<AtomicBool>, std::thread::JoinHandle<()>);

/// Marks a long-running thread as alive for as long as it is held: its drop (the thread
/// ending, by return or by panic) clears the flag the liveness probe reads.
#[derive(Debug)]
pub struct Alive(Arc<AtomicBool>);

impl Alive {
    /// Holds `flag` (already set by the caller) until dropped.
    pub fn new(flag: Arc<AtomicBool>) -> Self {
        Self(flag)
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
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
        self.metrics.render(&server::status(&self.ctx))
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
    /// Validates `cfg`, opens the store, binds the socket and starts serving.
    pub fn start(cfg: &Config) -> anyhow::Result<Self> {
        cfg.validate().map_err(anyhow::Error::msg)?;
        let mut roots = Vec::new();
        for r in &cfg.backing_roots {
            // Directories are trusted as long as file metadata (metadata_ttl).
            let posix = PosixBacking::with_dir_ttl(r, cfg.metadata_ttl)
                .with_context(|| format!("backing root {}", r.display()))?;
            let path = posix.root().to_owned();
            let name = path
                .to_str()
                .context("backing root paths must be UTF-8")?
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
        let roots = Arc::new(Roots::new(roots));
        let meta = Arc::new(Meta::new(roots, cfg.metadata_ttl, 1 << 20, stats.clone()));
        let store_cfg = StoreConfig {
            dir: cfg.cache_dir.clone(),
            capacity: cfg.capacity,
            min_free: cfg.min_free,
            block_size: u32::try_from(cfg.block_size).context("block_size")?,
        };
        let jobs = Arc::new(Jobs::new(meta.clone(), metrics.prefetch()));
        let policy = Box::new(PlannedPolicy::new(jobs.clone()));
        let store = Arc::new(
            Store::open_with_policy(&store_cfg, stats.clone(), policy)
                .with_context(|| format!("opening the cache in {}", cfg.cache_dir.display()))?,
        );
        let filler = Arc::new(
            Filler::new(
                store.clone(),
                meta.clone(),
                stats.clone(),
                cfg.fill_workers,
                cfg.fill_queue,
            )
            .context("starting fill workers")?,
        );
        let peers = match cfg.peer_listen {
            Some(listen) => Some(Self::start_peers(
                cfg, listen, &store, &meta, &stats, &filler, &jobs,
            )?),
            None => None,
        };
        let listener = server::bind(&cfg.socket, cfg.socket_mode)
            .with_context(|| format!("binding the socket {}", cfg.socket.display()))?;
        let meta_for_prefetch = meta.clone();
        let ctx = Arc::new(Ctx {
            meta,
            store: store.clone(),
            filler: filler.clone(),
            jobs: jobs.clone(),
            peers: peers.clone(),
            stats,
            readahead: cfg.readahead_blocks,
            max_wait: cfg.max_wait,
            started: Instant::now(),
            cache_dir: cfg.cache_dir.clone(),
            spin: cfg.spin,
            spinners: Default::default(),
            metrics_addr,
        });
        let server = Server::start(
            listener,
            cfg.socket.clone(),
            ctx.clone(),
            cfg.max_connections,
        )
        .context("starting the server")?;
        tracing::info!(socket = %cfg.socket.display(), "shardcached ready");
        let scrub = Self::start_scrub(&store)?;
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
        Ok(Self {
            server,
            ctx,
            peers,
            filler,
            store,
            scrub,
            jobs,
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

    /// Starts the peer service and lets fills ask peers.
    fn start_peers(
        cfg: &Config,
        listen: std::net::SocketAddr,
        store: &Arc<Store>,
        meta: &Arc<Meta>,
        stats: &Arc<Stats>,
        filler: &Arc<Filler>,
        jobs: &Arc<Jobs>,
    ) -> anyhow::Result<Arc<Peers>> {
        let file = cfg
            .peer_secret_file
            .as_ref()
            .context("peer_secret_file is required with peer_listen")?;
        let secret = std::fs::read_to_string(file)
            .with_context(|| format!("reading the peer secret {}", file.display()))?
            .trim()
            .to_owned();
        anyhow::ensure!(
            secret.len() >= 16,
            "{}: the peer secret must be at least 16 characters",
            file.display()
        );
        let source = match &cfg.peer_dns {
            Some(name) => {
                let (host, port) = name
                    .rsplit_once(':')
                    .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
                    .with_context(|| format!("peer_dns `{name}`: expected name:port"))?;
                Source::Dns { name: host, port }
            }
            None => Source::Static(cfg.peers.clone()),
        };
        let pc = PeerConfig {
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
        };
        let (peers, fill_cell) = Peers::start(&pc, store.clone(), meta.clone(), stats.clone())?;
        let _ = fill_cell.set(filler.clone());
        filler.use_peers(peers.clone());
        jobs.set_peers(peers.clone());
        Ok(peers)
    }

    /// After an unclean start, checks every block in the background (blocks are also
    /// checked on first use; this makes sure the rest are too, so that the next orderly
    /// shutdown can mark the cache clean).
    fn start_scrub(store: &Arc<Store>) -> anyhow::Result<Option<Scrub>> {
        if store.status().unverified == 0 {
            return Ok(None);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (st, s) = (store.clone(), stop.clone());
        let h = std::thread::Builder::new()
            .name("sc-scrub".into())
            .spawn(move || {
                let r = st.verify_unverified(&|| s.load(Ordering::Relaxed));
                tracing::info!(
                    checked = r.checked,
                    corrupt = r.corrupt,
                    "background verification finished"
                );
            })
            .context("starting the scrub thread")?;
        Ok(Some((stop, h)))
    }

    /// Orderly shutdown: clients are disconnected (they fall back to the backing store),
    /// fills stop, the journal is flushed and the store marked clean.
    pub fn close(mut self) -> anyhow::Result<()> {
        self.probes.ready.store(false, Ordering::Release);
        self.server.close();
        if let Some(p) = &self.peers {
            p.close();
        }
        if let Some((stop, h)) = self.prefetch.take() {
            stop.store(true, Ordering::Relaxed);
            self.jobs.stop_prefetcher();
            let _ = h.join();
        }
        self.filler.close();
        if let Some((stop, h)) = self.scrub.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = h.join();
        }
        let left = self.server.drain(Duration::from_secs(5));
        if left > 0 {
            tracing::warn!(left, "client threads still running at shutdown");
        }
        if let Some(h) = &mut self.http {
            h.close();
        }
        self.store.close().context("closing the store")?;
        tracing::info!("shardcached stopped cleanly");
        Ok(())
    }
}
