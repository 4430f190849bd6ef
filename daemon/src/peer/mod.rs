//! Peers: daemons on other nodes share cached blocks, so that the shared file system is
//! read about once per block per cluster.
//!
//! Every block has an owner among the healthy peers ([`crate::planner::ring`], rendezvous hashing over
//! [`membership`]). A fill that misses locally asks the owner: the owner serves the
//! block from its cache, or fetches it from the backing store first (its own fill
//! engine: one backing read however many nodes ask), and the requester checks the
//! checksum before it trusts the bytes. Any error or timeout falls through to the
//! backing store: a read never fails because a peer did.
//!
//! Peers authenticate every byte they accept from each other with the cluster's shared
//! secret, which itself never travels: without it a caller gets nothing, and nothing it
//! injects into another node's connections is taken. The peer port speaks two
//! protocols: the block stream ([`wire`]), which carries the bytes of blocks as they
//! are, on connections that proved the secret both ways by a challenge, with a MAC per
//! request and per block under keys fresh for each connection, kept for the next block;
//! and gRPC (the `Peer` service: `Ranks`), whose requests prove the secret over a fresh
//! nonce and whose replies carry a MAC bound to it ([`auth`]). Fills use the block
//! stream: gRPC's framing and copies held a fetch to under half of what the same TCP
//! path carries.
//!
//! Two halves, built in this order by the daemon: [`Peers`], the client (membership,
//! the rank map, fetches; [`source::PeerSource`] makes it a fill's source), and
//! [`PeerServer`], the port, serving through a [`crate::blocks::BlockProvider`] (the
//! fill engine, built over the client). Both read the plans through the
//! [`crate::policy::Plans`] cell they are handed; nothing here imports the fill engine,
//! the jobs or the store.

pub mod auth;
mod data;
pub mod membership;
mod service;
pub mod source;
pub mod tls;
pub mod wire;

use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};

use crate::backing::Stat;
use crate::blocks::BlockProvider;
use crate::meta::Meta;
use crate::policy::Plans;
use crate::stats::{Stats, add, inc};
use membership::{Membership, Outcome};

/// The generated gRPC code.
#[allow(missing_docs, clippy::all, clippy::pedantic, unreachable_pub)]
pub mod proto {
    tonic::include_proto!("shardcache.peer.v1");
}

/// Largest block a peer sends or accepts (the largest configurable block size).
const MAX_BLOCK: usize = 64 << 20;
/// Bytes the block-stream receiver reads before it hashes them (while they are still in
/// the CPU's cache).
const STEP: usize = 256 << 10;
/// Idle block-stream connections kept per peer: as many as may be in use at once
/// ([`MAX_STREAMS`]), so that a burst of fetches finds every stream the last one opened
/// (with 8 kept, each burst past 8 fetches at once dialled the rest again: a TCP
/// connection, TLS and stream handshakes and a serving thread at the peer each).
const POOL: usize = MAX_STREAMS;
/// Most block-stream connections this node has open to one peer at once (in use and
/// idle together). A fill worker's fetch takes one; when all are in use it waits for
/// one, up to its deadline, and then reads the next source. Without the bound a node's
/// pool of fill workers (up to 64 per root while readers wait) opened one each: three
/// busy nodes opened more than a peer serves at once ([`data::MAX_CONNS_PER_CALLER`]),
/// the peer closed the extra ones, and their fetches failed, marked the peer down, and
/// read the backing store (docs/PYTHON.md's example under `torchrun` on 4 nodes of the
/// testbed: peers flapping down and up every few hundred milliseconds). Sixteen streams
/// carry a 10 gbit link: each keeps a block in flight.
pub(crate) const MAX_STREAMS: usize = 16;
/// How long an idle block-stream connection is kept for the next block (the serving end
/// keeps it for longer, so a kept connection is normally still open).
const KEEP_IDLE: Duration = Duration::from_secs(30);
/// HTTP/2 flow-control window: HTTP/2's default (64 KiB) would cost a round trip per
/// 64 KiB of a block.
const WINDOW: u32 = 16 << 20;
/// HTTP/2 frame size (the default, 16 KiB, costs a frame header and a wake-up per 16 KiB).
const FRAME: u32 = 1 << 20;

/// How this node takes part.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// Where the peer service listens.
    pub listen: SocketAddr,
    /// This node's id as the others know it (`host:port`).
    pub advertise: String,
    /// Where the member list comes from.
    pub source: membership::Source,
    /// The cluster's shared secret.
    pub secret: String,
    /// Longest a fetch from a peer may take before the backing store is read instead.
    pub timeout: Duration,
    /// How often the member list is read again.
    pub refresh: Duration,
    /// TLS on the peer port (both protocols), when set.
    pub tls: Option<tls::TlsFiles>,
}

pub use crate::policy::Shuffle;

/// How often the rank map is checked: peers are asked again at once while a registered
/// shuffle has ranks no node is known to run (a job starting on every node), and every
/// [`RANKS_REFRESH`] anyway (a job that moved, a node that left).
const RANKS_CHECK: Duration = Duration::from_millis(100);
const RANKS_REFRESH: Duration = Duration::from_secs(5);
/// The largest world (ranks of one job) a cluster placement is computed for.
const MAX_WORLD: u64 = 1 << 20;
/// Set in a node's slots (as [`Peers`] keeps them) when they are bytes, not files.
const SLOTS_IN_BYTES: u64 = 1 << 63;
/// Set in a node's slots (as [`Peers`] keeps them) when it places by next-reader
/// forwarding (`placement = forward`), not by the simulation.
const SLOTS_FORWARD: u64 = 1 << 62;

/// A node's slots as [`Peers`] keeps them: `slots`, flagged when they are bytes and when
/// the node places by forwarding (no cache holds 2^62 bytes).
fn flagged(slots: u64, bytes: bool, forward: bool) -> u64 {
    if slots == 0 {
        return 0; // not known yet
    }
    let mut s = slots.min(SLOTS_FORWARD - 1);
    if bytes {
        s |= SLOTS_IN_BYTES;
    }
    if forward {
        s |= SLOTS_FORWARD;
    }
    s
}

/// The nodes' slots without their flags, and whether they are bytes: `None` unless every
/// node counts in files or every node in bytes (the same manifest, sizes and all, on
/// every node of a job), and every node places by the same scheme.
fn unflagged(slots: Vec<u64>) -> Option<(Vec<u64>, bool)> {
    let flags = SLOTS_IN_BYTES | SLOTS_FORWARD;
    let first = slots.first().map_or(0, |s| s & flags);
    if slots.iter().any(|s| s & flags != first) {
        return None;
    }
    Some((
        slots.into_iter().map(|s| s & !flags).collect(),
        first & SLOTS_IN_BYTES != 0,
    ))
}

/// Nodes asked for a block before its owner (each "not here" costs a round trip).
const MAX_HOLDERS: usize = 3;
/// The longest a read waits on a peer that does not answer at all before it reads the
/// backing store instead (the peer is then down until a probe gets an answer): a dial
/// whose connection is not accepted in this long; or a request whose bytes the peer's
/// host has not acknowledged within one step (`8 ×` the connection's smoothed round
/// trip, within `STEP_MIN..=STEP_MAX`: 20–50 ms) *and* to which a new connection is not
/// accepted within a second step — the peer's kernel accepts a connection at once
/// whatever its daemon does, while an acknowledgement may wait for the daemon to read
/// the request or for a delayed-ack timer. A peer that acknowledged the request, or
/// accepts a connection, is alive (it may be reading the backing store for the
/// request, once for the cluster) and gets `peer_timeout`.
pub const SILENCE_MAX: Duration = Duration::from_millis(100);
/// Bounds of one step of [`SILENCE_MAX`] (two steps fit in it).
const STEP_MIN: Duration = Duration::from_millis(20);
const STEP_MAX: Duration = Duration::from_millis(50);

pub use crate::planner::ring::{file_id, file_owner};

/// This node's side of sharing: the service other nodes call, and the client fills use.
pub struct Peers {
    /// The runtime of the service and the client; taken and shut down by
    /// [`Peers::close`] on the caller's thread (a runtime must not be dropped inside one).
    rt: Mutex<Option<tokio::runtime::Runtime>>,
    closed: std::sync::atomic::AtomicBool,
    membership: Arc<Membership>,
    /// The shared secret: what the keys of every MAC are derived from.
    key: Vec<u8>,
    channels: Mutex<HashMap<String, Channel>>,
    /// This node's block size (every peer must use the same).
    block_size: u32,
    /// TLS on the peer port, when configured.
    tls: Option<Arc<tls::Tls>>,
    /// Idle block-stream connections, authenticated, by peer.
    idle: Mutex<HashMap<String, Vec<(Conn, Instant)>>>,
    /// Block-stream connections in use, and fetches waiting for one, by peer (see
    /// [`MAX_STREAMS`]).
    streams: Mutex<HashMap<String, Streams>>,
    streams_cv: parking_lot::Condvar,
    /// Block-stream connections dialled (past their handshakes) since the start.
    #[cfg(test)]
    dials: std::sync::atomic::AtomicU64,
    timeout: Duration,
    stats: Arc<Stats>,
    plans: Arc<Plans>,
    /// (job, rank) → the node that runs it, from every healthy peer's `Ranks`.
    ranks: Mutex<HashMap<(String, u64), String>>,
    /// (job, node) → the job's files that node's cache holds, or its bytes with
    /// [`SLOTS_IN_BYTES`] set.
    slots: Mutex<HashMap<(String, String), u64>>,
    /// The shuffles whose layout inputs are all known (every rank's node and every such
    /// node's slots), with their world, as of the last refresh of the rank map.
    complete: Mutex<HashMap<String, u64>>,
    /// Down peers being probed now (one probe at a time each).
    probing: Mutex<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("me", &self.membership.me())
            .finish()
    }
}

/// The peer port: the block stream and gRPC, serving through a [`BlockProvider`] on the
/// client's runtime. Closed before the client ([`PeerServer::close`], then
/// [`Peers::close`]).
pub struct PeerServer {
    stop: tokio::sync::watch::Sender<bool>,
    data: Arc<data::DataServer>,
}

impl std::fmt::Debug for PeerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServer").finish_non_exhaustive()
    }
}

/// Binds the peer port (before anything else of the peers starts: a taken port stops
/// the daemon early).
pub fn bind(listen: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    use anyhow::Context;
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("binding the peer service to {listen}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The member list of `cfg`, looked up once (a failure is retried by the refresh).
pub fn member_list(cfg: &PeerConfig) -> Arc<Membership> {
    let membership = Arc::new(Membership::new(
        cfg.source.clone(),
        cfg.advertise.clone(),
        membership::HealthPolicy::default(),
    ));
    if let Err(e) = membership.refresh() {
        tracing::warn!(error = %e, "peer list: first lookup failed; will retry");
    }
    membership
}

fn load_tls(cfg: &PeerConfig) -> anyhow::Result<Option<Arc<tls::Tls>>> {
    match &cfg.tls {
        Some(files) => Ok(Some(Arc::new(
            tls::Tls::load(files).map_err(|e| anyhow::anyhow!(e))?,
        ))),
        None => Ok(None),
    }
}

impl PeerServer {
    /// Serves the peer port on `listener` (from [`bind`]) on `peers`' runtime: blocks
    /// from `provider`, ranks from `peers`' plans.
    pub fn start(
        cfg: &PeerConfig,
        listener: std::net::TcpListener,
        peers: &Peers,
        meta: Arc<Meta>,
        provider: Arc<dyn BlockProvider>,
    ) -> anyhow::Result<Self> {
        let tls = peers.tls.clone();
        let stats = peers.stats.clone();
        let svc = Arc::new(service::Service {
            provider,
            meta,
            stats: stats.clone(),
            timeout: cfg.timeout,
            plans: peers.plans.clone(),
            handoffs: Mutex::new(HashMap::new()),
            secret: cfg.secret.as_bytes().to_vec(),
        });
        let data = Arc::new(data::DataServer::new(
            cfg.secret.as_bytes().to_vec(),
            svc.clone(),
        ));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let expected = cfg.secret.as_bytes().to_vec();
        let refused = stats;
        let (grpc_tx, grpc_rx) = tokio::sync::mpsc::channel(data::MAX_CONNS);
        let (d, mut s, timeout) = (data.clone(), stopped.clone(), cfg.timeout);
        let accept_tls = tls.clone();
        let rt = peers
            .rt
            .lock()
            .as_ref()
            .map(|rt| rt.handle().clone())
            .ok_or_else(|| anyhow::anyhow!("the peer runtime is closed"))?;
        rt.spawn(async move {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "peer service: cannot use the listener");
                    return;
                }
            };
            tokio::spawn(data::accept(
                listener, grpc_tx, d, accept_tls, stopped, timeout,
            ));
            // Every call proves the secret over a fresh nonce; the handler MACs its
            // reply with that nonce.
            let auth = move |mut req: tonic::Request<()>| match auth::check_request(
                &expected,
                req.metadata(),
            ) {
                Some(nonce) => {
                    req.extensions_mut().insert(auth::Verified(nonce));
                    Ok(req)
                }
                None => {
                    inc(&refused.peer_refused);
                    Err(tonic::Status::unauthenticated(
                        "shardcache peer: bad or missing proof of the shared secret",
                    ))
                }
            };
            let server = tonic::transport::Server::builder()
                .initial_stream_window_size(WINDOW)
                .initial_connection_window_size(2 * WINDOW)
                .max_frame_size(FRAME)
                .add_service(tonic::service::interceptor::InterceptedService::new(
                    proto::peer_server::PeerServer::from_arc(svc),
                    auth,
                ))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::ReceiverStream::new(grpc_rx),
                    async move {
                        let _ = s.wait_for(|s| *s).await;
                    },
                );
            if let Err(e) = server.await {
                tracing::error!(error = %e, "peer service stopped");
            }
        });
        tracing::info!(listen = %cfg.listen, me = %cfg.advertise, tls = tls.is_some(), "peer service ready");
        Ok(Self { stop, data })
    }

    /// Stops serving peers: the port stops accepting, and block-stream connections end
    /// (one answering a request finishes it first).
    pub fn close(&self) {
        let _ = self.stop.send(true);
        // Each thread left behind (stuck in the backing store) is logged by its task.
        self.data.close();
    }
}

impl Peers {
    /// Starts the client side: the runtime it shares with the [`PeerServer`], the
    /// periodic member refresh of `membership` (from [`member_list`]) and the rank map,
    /// for a store of blocks of `block_size` bytes; the plans are read from `plans`.
    pub fn start(
        cfg: &PeerConfig,
        membership: Arc<Membership>,
        plans: Arc<Plans>,
        stats: Arc<Stats>,
        block_size: u32,
    ) -> anyhow::Result<Arc<Self>> {
        use anyhow::Context;
        let tls = load_tls(cfg)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("sc-peer")
            .enable_all()
            .build()
            .context("starting the peer runtime")?;
        let m = membership.clone();
        let every = cfg.refresh;
        rt.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let m = m.clone();
                match tokio::task::spawn_blocking(move || m.refresh()).await {
                    Ok(Err(e)) => tracing::warn!(error = %e, "peer list: lookup failed; keeping the last list"),
                    Err(e) => tracing::warn!(error = %e, "peer list: refresh task failed"),
                    Ok(Ok(())) => {}
                }
            }
        });
        let peers = Arc::new(Self {
            membership,
            key: cfg.secret.as_bytes().to_vec(),
            channels: Mutex::new(HashMap::new()),
            block_size,
            idle: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            streams_cv: parking_lot::Condvar::new(),
            #[cfg(test)]
            dials: std::sync::atomic::AtomicU64::new(0),
            tls,
            timeout: cfg.timeout,
            stats,
            plans,
            ranks: Mutex::new(HashMap::new()),
            slots: Mutex::new(HashMap::new()),
            probing: Mutex::new(std::collections::HashSet::new()),
            complete: Mutex::new(HashMap::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            rt: Mutex::new(None),
        });
        // Learns which node runs which rank (a weak reference: the task ends with them).
        let weak = Arc::downgrade(&peers);
        rt.spawn(async move {
            let mut tick = tokio::time::interval(RANKS_CHECK);
            let mut last = tokio::time::Instant::now();
            loop {
                tick.tick().await;
                let Some(p) = weak.upgrade() else { return };
                if p.ranks_incomplete() || last.elapsed() >= RANKS_REFRESH {
                    p.refresh_ranks().await;
                    last = tokio::time::Instant::now();
                }
            }
        });
        // Probes the peers that are down: only an answer brings one back into the read
        // path (a weak reference: the task ends with them).
        let weak = Arc::downgrade(&peers);
        rt.spawn(async move {
            let every = match weak.upgrade() {
                Some(p) => p.membership.probe_every(),
                None => return,
            };
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(p) = weak.upgrade() else { return };
                if p.closed.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                for peer in p.membership.down() {
                    if !p.probing.lock().insert(peer.clone()) {
                        continue;
                    }
                    let weak = Arc::downgrade(&p);
                    tokio::task::spawn_blocking(move || {
                        if let Some(p) = weak.upgrade() {
                            p.probe(&peer);
                            p.probing.lock().remove(&peer);
                        }
                    });
                }
            }
        });
        *peers.rt.lock() = Some(rt);
        Ok(peers)
    }

    /// True when a shuffle registered here has a rank no node is known to run, or run
    /// by a node whose slots for it are not known (none yet: a node that just started,
    /// this one included, answers before it has computed them). Either keeps the
    /// layout from forming: the peers are asked again at once, not in [`RANKS_REFRESH`].
    fn ranks_incomplete(&self) -> bool {
        let complete = self.complete.lock();
        self.plans
            .shuffles()
            .into_iter()
            .any(|s| complete.get(&s.job) != Some(&s.world))
    }

    /// The shuffles whose every rank (of a world of `world`) has a node, and every such
    /// node its slots, in `map` and `slots`: job → world. One pass over the map, at
    /// each refresh (every rank counted, however large the world).
    fn completeness(
        map: &HashMap<(String, u64), String>,
        slots: &HashMap<(String, String), u64>,
        worlds: &HashMap<String, u64>,
    ) -> HashMap<String, u64> {
        let mut known: HashMap<String, (u64, bool)> = HashMap::new();
        for ((job, rank), node) in map {
            let Some(&world) = worlds.get(job) else {
                continue;
            };
            let e = known.entry(job.clone()).or_insert((0, true));
            if *rank < world {
                e.0 += 1;
            }
            e.1 &= slots
                .get(&(job.clone(), node.clone()))
                .is_some_and(|&n| n > 0);
        }
        known
            .into_iter()
            .filter(|(job, (n, ok))| *ok && worlds.get(job) == Some(n))
            .map(|(job, (n, _))| (job, n))
            .collect()
    }

    /// Asks every healthy peer which ranks it runs, and replaces the rank map.
    async fn refresh_ranks(&self) {
        let local = self.plans.shuffles();
        if local.is_empty() {
            return; // nothing to place by plan here
        }
        let me = self.membership.me().to_owned();
        let mut map = HashMap::new();
        let mut slots = HashMap::new();
        let worlds: HashMap<String, u64> = local.iter().map(|s| (s.job.clone(), s.world)).collect();
        for s in local {
            for r in s.ranks {
                map.insert((s.job.clone(), r), me.clone());
            }
            slots.insert((s.job, me.clone()), flagged(s.slots, s.bytes, s.forward));
        }
        let down = self.membership.down();
        for (peer, _) in self.membership.all() {
            if peer == me {
                continue;
            }
            if down.contains(&peer) {
                // Down for now: what it said last still stands (its health never changes
                // a job's layout); it is asked again once a probe brought it back.
                self.keep_ranks_of(&peer, &mut map, &mut slots);
                continue;
            }
            let ask = async {
                let mut client = proto::peer_client::PeerClient::new(self.channel(&peer)?);
                let mut r = tonic::Request::new(proto::RanksRequest {});
                let nonce =
                    auth::sign_request(&self.key, r.metadata_mut()).map_err(|e| e.to_string())?;
                let reply = client
                    .ranks(r)
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(|s| s.to_string())?;
                Ok::<_, String>(self.open_ranks(&peer, &nonce, &reply))
            };
            match tokio::time::timeout(self.timeout, ask).await {
                Ok(Ok(Some(reply))) => {
                    for j in reply.jobs {
                        for r in j.ranks {
                            map.insert((j.job.clone(), r), peer.clone());
                        }
                        slots.insert(
                            (j.job, peer.clone()),
                            flagged(j.slots, j.slots_in_bytes, j.placement_forward),
                        );
                    }
                }
                Ok(Ok(None)) => self.keep_ranks_of(&peer, &mut map, &mut slots),
                Ok(Err(e)) => {
                    tracing::debug!(peer = %peer, error = %e, "peer ranks: no answer");
                    self.keep_ranks_of(&peer, &mut map, &mut slots);
                }
                Err(_) => {
                    tracing::debug!(peer = %peer, "peer ranks: timed out");
                    self.keep_ranks_of(&peer, &mut map, &mut slots);
                }
            }
        }
        *self.complete.lock() = Self::completeness(&map, &slots, &worlds);
        *self.ranks.lock() = map;
        *self.slots.lock() = slots;
    }

    /// The content of a `Ranks` reply from `peer` to the request that carried `nonce`,
    /// once its MAC verified; `None` (counted, logged) when it did not or does not
    /// decode: the reply was forged or changed on the way, and steers nothing.
    fn open_ranks(
        &self,
        peer: &str,
        nonce: &[u8; wire::NONCE],
        reply: &proto::RanksReply,
    ) -> Option<proto::RanksReply> {
        if !auth::check_reply(&self.key, "Ranks", nonce, &reply.sealed, &reply.mac) {
            inc(&self.stats.peer_forged);
            tracing::warn!(peer = %peer, "peer ranks: the reply failed its MAC (forged or changed on the way); ignored");
            return None;
        }
        match prost::Message::decode(reply.sealed.as_slice()) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(peer = %peer, error = %e, "peer ranks: a malformed reply; ignored");
                None
            }
        }
    }

    /// Keeps what a peer that did not answer this time (busy, or down) said last time (a
    /// busy or silent peer is not a changed one: the cluster placement stays as it is).
    fn keep_ranks_of(
        &self,
        peer: &str,
        map: &mut HashMap<(String, u64), String>,
        slots: &mut HashMap<(String, String), u64>,
    ) {
        let old = self.ranks.lock();
        map.extend(
            old.iter()
                .filter(|(_, n)| n.as_str() == peer)
                .map(|(k, n)| (k.clone(), n.clone())),
        );
        let old = self.slots.lock();
        slots.extend(
            old.iter()
                .filter(|((_, n), _)| n.as_str() == peer)
                .map(|(k, v)| (k.clone(), *v)),
        );
    }

    /// The cluster layout of shuffle `job` over `world` ranks, once every rank's node
    /// and every such node's slots are known (see [`crate::planner::placement`]).
    pub fn layout(&self, job: &str, world: u64) -> Option<crate::planner::placement::Layout> {
        if world == 0 || world > MAX_WORLD || self.complete.lock().get(job) != Some(&world) {
            return None;
        }
        let map = self.ranks.lock();
        let owners: Vec<&String> = (0..world)
            .map(|r| map.get(&(job.to_owned(), r)))
            .collect::<Option<_>>()?;
        let mut nodes: Vec<String> = owners.iter().map(|s| (*s).clone()).collect();
        nodes.sort_unstable();
        nodes.dedup();
        if nodes.len() >= usize::from(u16::MAX) {
            return None; // node indexes are u16, one value meaning none
        }
        let slots = self.slots.lock();
        let slots: Vec<u64> = nodes
            .iter()
            .map(|n| {
                slots
                    .get(&(job.to_owned(), n.clone()))
                    .copied()
                    .filter(|&s| s > 0)
            })
            .collect::<Option<_>>()?;
        let Some((slots, bytes)) = unflagged(slots) else {
            tracing::debug!(
                job,
                "cluster placement: nodes disagree on files or bytes, or on the scheme"
            );
            return None;
        };
        let node_of_rank = owners
            .iter()
            .map(|o| nodes.iter().position(|n| n == *o).map(|i| i as u16))
            .collect();
        Some(crate::planner::placement::Layout {
            nodes,
            node_of_rank,
            slots,
            bytes,
        })
    }

    /// The other healthy nodes likely to hold the file now, most likely first: those
    /// running the ranks that read it last or read it next (see [`Plans::holders`]).
    fn holders(&self, root: &str, path: &str, healthy: &[String]) -> Vec<String> {
        let ranks = self.plans.holders(root, path);
        let map = self.ranks.lock();
        let mut out: Vec<String> = Vec::new();
        for key in ranks {
            if let Some(node) = map.get(&key)
                && node != self.membership.me()
                && healthy.contains(node)
                && !out.contains(node)
            {
                out.push(node.clone());
            }
        }
        out.truncate(MAX_HOLDERS);
        out
    }

    /// Tells the nodes the cluster placement says held file `stat` under `root` before
    /// this node (which has it whole and keeps it now) that their copies may go: they
    /// keep a copy they were moved away from until its new holder took it, and this one
    /// did not need to fetch it. Best effort: a node that does not answer keeps its copy
    /// a little longer.
    pub fn release(&self, root: &str, stat: &Stat) {
        let Some(sources) = self.plans.placed(root, &stat.path) else {
            return;
        };
        let (healthy, me) = self.view();
        let req = proto::FetchRequest {
            keep: true,
            release: true,
            ..self.request(root, stat, 0)
        };
        let mut buf = Vec::new();
        for s in sources.iter().filter(|s| **s != me && healthy.contains(s)) {
            if let Err(e) = self.fetch_from(s, &req, 0, Instant::now() + self.timeout, &mut buf) {
                tracing::debug!(peer = %s, path = %stat.path, error = %e, "release not delivered");
            }
        }
    }

    /// The request for block `index` of file version `stat` under `root` (no fill, not
    /// kept, not a release).
    fn request(&self, root: &str, stat: &Stat, index: u64) -> proto::FetchRequest {
        let v = &stat.version;
        proto::FetchRequest {
            root: root.to_owned(),
            path: stat.path.clone(),
            size: v.size,
            mtime_ns: v.mtime_ns,
            ctime_ns: v.ctime_ns,
            ino: v.ino,
            dev: v.dev,
            index,
            block_size: self.block_size,
            fill: false,
            keep: false,
            release: false,
        }
    }

    /// True when the cluster placement places the file and not on this node (a
    /// prefetch of it is no longer wanted).
    pub fn placed_elsewhere(&self, root: &str, path: &str) -> bool {
        self.plans.placed_elsewhere(root, path)
    }

    /// The members and their health.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Fills stop asking peers (they read the backing store), and the runtime (the
    /// [`PeerServer`]'s too: close that first) stops.
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.idle.lock().clear();
        if let Some(rt) = self.rt.lock().take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }

    /// The healthy members, sorted (the list every node computes owners over), and this
    /// node's id.
    pub fn view(&self) -> (Vec<String>, String) {
        crate::policy::Members::view(&*self.membership)
    }

    /// The owner of a file among `healthy` (sorted): by the plan that places it, else by
    /// rendezvous hashing. Files, not blocks, have owners: a shard is read whole from one
    /// node, and a file keeps its owner across versions.
    fn owner(&self, root: &str, path: &str, healthy: &[String]) -> Option<String> {
        self.plans.owner(root, path, healthy).or_else(|| {
            file_owner(healthy.iter().map(String::as_str), root, path).map(str::to_owned)
        })
    }

    /// Block `index` of the file version `stat` under `root`, from the cluster. Under a
    /// cluster placement (see [`crate::planner::placement`]): from the node holding the
    /// cluster's copy and the ones that held it before, never filled there (no node
    /// holding it: the placement gave the backing read to this node, once for the
    /// cluster). Otherwise: first from the nodes the plan says read the file last or
    /// read it next (they likely hold it), then from the file's owner, which fills it
    /// from the backing store if no node has it (once for the cluster). `None` when no
    /// peer supplied it (the caller reads the backing store; `buf`'s contents are then
    /// unspecified); its xxh3-64 when one did, checked against the bytes (see
    /// `exchange`). `keep`: the caller stores the block in its cache (the sender's copy
    /// may then go; under a placement only when the placement gave the file to this
    /// node). The block lands in `buf` (a buffer kept from one block to the next
    /// spares an allocation and its page faults per block).
    pub fn fetch(
        &self,
        root: &str,
        stat: &Stat,
        index: usize,
        len: usize,
        keep: bool,
        buf: &mut Vec<u8>,
    ) -> Option<u64> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let req = |fill: bool| proto::FetchRequest {
            fill,
            keep,
            ..self.request(root, stat, index as u64)
        };
        let (healthy, me) = self.view();
        if let Some(sources) = self.plans.placed(root, &stat.path) {
            // Only the node the placement gave the copy to takes it over (the sender
            // may then drop its copy); another node's copy is a local one.
            let keep = keep && self.plans.keeps(root, &stat.path);
            let req = |fill: bool| proto::FetchRequest { keep, ..req(fill) };
            // The cluster placement says who holds it; nobody (an empty list): this
            // node reads the backing store, once for the cluster.
            let got = sources
                .iter()
                .filter(|s| **s != me && healthy.contains(s))
                .find_map(|s| self.fetch_one(s, &req(false), len, buf));
            if got.is_none() {
                tracing::debug!(me = %me, path = %stat.path, ?sources, keep, "placed: no source had it");
            }
            return got;
        }
        let owner = self.owner(root, &stat.path, &healthy).filter(|o| *o != me);
        for holder in self.holders(root, &stat.path, &healthy) {
            if Some(&holder) != owner.as_ref()
                && let Some(sum) = self.fetch_one(&holder, &req(false), len, buf)
            {
                return Some(sum);
            }
        }
        owner.and_then(|o| self.fetch_one(&o, &req(true), len, buf))
    }

    /// One block from one peer, checked (its xxh3-64); counted, and the peer's health
    /// reported.
    fn fetch_one(
        &self,
        peer: &str,
        req: &proto::FetchRequest,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Option<u64> {
        let got = self.fetch_from(peer, req, len, Instant::now() + self.timeout, buf);
        match got {
            Ok(sum) => {
                self.membership.report(peer, Outcome::Answered, "");
                inc(&self.stats.peer_blocks_in);
                add(&self.stats.peer_bytes_in, len as u64);
                Some(sum)
            }
            Err(e) => {
                // A peer that answers "not here" is healthy; one that fails is not.
                match e {
                    FetchError::NotFound(_) => {
                        tracing::debug!(peer = %peer, error = %e, "peer does not hold the block");
                    }
                    FetchError::Busy(_) => {
                        tracing::debug!(peer = %peer, error = %e, "no block stream to the peer free; trying the next source");
                    }
                    FetchError::Forged => {
                        tracing::warn!(peer = %peer, path = %req.path, index = req.index, error = %e, "peer fetch: refused the reply; reading elsewhere");
                        inc(&self.stats.peer_forged);
                        self.membership
                            .report(peer, Outcome::Failed, "a forged reply");
                        inc(&self.stats.peer_errors);
                    }
                    FetchError::Failed(ref why) => {
                        tracing::debug!(peer = %peer, error = %e, "peer fetch failed; trying the next source");
                        self.membership.report(peer, Outcome::Failed, why);
                        inc(&self.stats.peer_errors);
                    }
                    FetchError::Silent(ref why) => {
                        tracing::debug!(peer = %peer, error = %e, "peer did not answer; trying the next source");
                        self.membership.report(peer, Outcome::Silent, why);
                        inc(&self.stats.peer_errors);
                    }
                }
                None
            }
        }
    }

    fn channel(&self, peer: &str) -> Result<Channel, String> {
        let mut chans = self.channels.lock();
        if let Some(c) = chans.get(peer) {
            return Ok(c.clone());
        }
        let ep = Endpoint::from_shared(format!("http://{peer}"))
            .map_err(|e| e.to_string())?
            .connect_timeout(self.timeout)
            .initial_stream_window_size(WINDOW)
            .initial_connection_window_size(2 * WINDOW)
            .max_frame_size(FRAME)
            .tcp_nodelay(true);
        let c = match &self.tls {
            None => ep.connect_lazy(),
            // TLS by hand (tonic's own needs its TLS features): the same rustls
            // settings as the block stream's.
            Some(t) => {
                let (connector, name) = t.connector();
                let addr = peer.to_owned();
                ep.connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
                    let (connector, name, addr) = (connector.clone(), name.clone(), addr.clone());
                    async move {
                        let tcp = tokio::net::TcpStream::connect(&addr).await?;
                        tcp.set_nodelay(true)?;
                        let s = connector.connect(name, tcp).await?;
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                    }
                }))
            }
        };
        chans.insert(peer.to_owned(), c.clone());
        Ok(c)
    }

    /// Block `req` from `peer` over the block stream, `len` bytes, its reply's MAC
    /// checked, by `deadline`; the block's xxh3-64 as the peer announced it. A kept
    /// connection that turns out closed (the peer restarted, or closed it idle) is
    /// replaced by a new one once.
    fn fetch_from(
        &self,
        peer: &str,
        req: &proto::FetchRequest,
        len: usize,
        deadline: Instant,
        buf: &mut Vec<u8>,
    ) -> Result<u64, FetchError> {
        if len > MAX_BLOCK {
            return Err(FetchError::Failed(format!("block of {len} bytes")));
        }
        let _slot = self.stream_slot(peer, deadline)?;
        loop {
            let (mut conn, kept) = match self.take_idle(peer) {
                Some(c) => (c, true),
                None => (self.dial(peer, deadline, SILENCE_MAX)?, false),
            };
            match exchange(&mut conn, req, len, deadline, buf) {
                Ok(got) => {
                    // The connection is between exchanges again: keep it.
                    self.keep_idle(peer, conn);
                    return got;
                }
                // A kept connection the peer closed meanwhile: once more on a new one
                // (not when the peer is silent: that would only wait again).
                Err(Broken::BeforeAnswer(e)) if kept && !matches!(e, FetchError::Silent(_)) => {
                    continue;
                }
                Err(Broken::BeforeAnswer(e) | Broken::Midway(e)) => return Err(e),
            }
        }
    }

    /// One of the [`MAX_STREAMS`] block-stream connections to `peer`, in use until the
    /// slot is dropped: at once, or when another fetch gives one back, by `deadline`
    /// (else [`FetchError::Busy`]: this node's own load, not the peer's health).
    fn stream_slot(&self, peer: &str, deadline: Instant) -> Result<StreamSlot<'_>, FetchError> {
        let mut all = self.streams.lock();
        let mut waited = false;
        loop {
            let s = all.entry(peer.to_owned()).or_default();
            if s.in_use < MAX_STREAMS {
                s.in_use += 1;
                if waited {
                    s.waiting -= 1;
                }
                return Ok(StreamSlot {
                    peers: self,
                    peer: peer.to_owned(),
                });
            }
            if Instant::now() >= deadline {
                if waited {
                    s.waiting -= 1;
                }
                return Err(FetchError::Busy(format!(
                    "{MAX_STREAMS} block streams to the peer in use until the fetch's deadline"
                )));
            }
            if !waited {
                s.waiting += 1;
                waited = true;
            }
            self.streams_cv.wait_until(&mut all, deadline);
        }
    }

    /// Block-stream connections to `peer` in use now, and fetches waiting for one.
    #[cfg(test)]
    pub(crate) fn streams(&self, peer: &str) -> (usize, usize) {
        self.streams
            .lock()
            .get(peer)
            .map_or((0, 0), |s| (s.in_use, s.waiting))
    }

    fn take_idle(&self, peer: &str) -> Option<Conn> {
        let mut idle = self.idle.lock();
        let conns = idle.get_mut(peer)?;
        while let Some((c, since)) = conns.pop() {
            if since.elapsed() < KEEP_IDLE {
                return Some(c);
            }
        }
        None
    }

    fn keep_idle(&self, peer: &str, conn: Conn) {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let mut idle = self.idle.lock();
        let conns = idle.entry(peer.to_owned()).or_default();
        conns.retain(|(_, since)| since.elapsed() < KEEP_IDLE);
        if conns.len() < POOL {
            conns.push((conn, Instant::now()));
        }
    }

    /// A new block-stream connection to `peer`, past the handshake, by `deadline`; the
    /// connection itself accepted within `accept` (a peer that does not accept one in
    /// that long is silent).
    fn dial(&self, peer: &str, deadline: Instant, accept: Duration) -> Result<Conn, FetchError> {
        let failed = |what: &str, e: &std::io::Error| io_failure(what, e);
        let addr = peer
            .to_socket_addrs()
            .map_err(|e| failed("resolving", &e))?
            .next()
            .ok_or_else(|| FetchError::Failed("resolving: no address".into()))?;
        let t = left(deadline).map_err(|e| failed("connecting", &e))?;
        let s = TcpStream::connect_timeout(&addr, t.min(accept))
            .map_err(|e| failed("connecting", &e))?;
        let setup = s
            .set_nodelay(true)
            .and_then(|()| s.set_read_timeout(Some(left(deadline)?)))
            .and_then(|()| s.set_write_timeout(Some(left(deadline)?)));
        setup.map_err(|e| failed("connecting", &e))?;
        let mut s = match &self.tls {
            None => tls::Stream::Plain(s),
            Some(t) => t.connect(s).map_err(|e| failed("TLS", &e))?,
        };
        let session = wire::client_handshake(&mut s, &self.key)
            .map_err(|e| FetchError::Failed(format!("handshake: {e}")))?;
        #[cfg(test)]
        self.dials
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Conn { io: s, session })
    }

    /// Block-stream connections dialled since the start (each a TCP connection, a TLS
    /// handshake when configured, the stream's own handshake and a serving thread at
    /// the peer).
    #[cfg(test)]
    pub(crate) fn dials(&self) -> u64 {
        self.dials.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Probes down peer `peer`: a new block-stream connection past its handshake within
    /// `peer_timeout` brings it back (the connection is kept for the next fetch).
    fn probe(&self, peer: &str) {
        match self.dial(peer, Instant::now() + self.timeout, self.timeout) {
            Ok(conn) => {
                self.keep_idle(peer, conn);
                self.membership.report(peer, Outcome::Answered, "");
            }
            Err(e) => {
                tracing::debug!(peer, error = %e, "probe: still down");
                self.membership
                    .report(peer, Outcome::Failed, &e.to_string());
            }
        }
    }
}

/// A socket error as a fetch error: a timeout is a peer that did not answer.
fn io_failure(what: &str, e: &std::io::Error) -> FetchError {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            FetchError::Silent(format!("{what}: no answer ({e})"))
        }
        _ => FetchError::Failed(format!("{what}: {e}")),
    }
}

/// The smoothed round trip of a connected socket (`TCP_INFO`).
fn round_trip(tcp: &TcpStream) -> Option<Duration> {
    use std::os::fd::AsRawFd;
    // SAFETY: `tcp_info` is plain old data (zeroes are a valid value); getsockopt writes
    // at most `len` bytes into it and sets `len` to what it wrote.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: a valid descriptor, a buffer of `len` bytes, a pointer to `len`.
    let r = unsafe {
        libc::getsockopt(
            tcp.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &raw mut len,
        )
    };
    (r == 0).then(|| Duration::from_micros(info.tcpi_rtt.into()))
}

/// Bytes written to a connected socket that the peer's host has not acknowledged, sent
/// or not yet (`SIOCOUTQ`).
fn unacknowledged(tcp: &TcpStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: a valid descriptor; SIOCOUTQ writes one int.
    let r = unsafe { libc::ioctl(tcp.as_raw_fd(), libc::TIOCOUTQ, &raw mut n) };
    (r == 0).then_some(n.max(0) as u32)
}

/// One step of the silence check on a connection of smoothed round trip `rtt`: 8 round
/// trips, within [`STEP_MIN`]..=[`STEP_MAX`].
fn silence_step(rtt: Duration) -> Duration {
    (rtt * 8).clamp(STEP_MIN, STEP_MAX)
}

/// Waits up to one step for the first byte of the answer to the request just sent on
/// `tcp`; if none came and the peer's host has not acknowledged the request, a new
/// connection to the peer confirms it is there within another step — else the peer is
/// silent (dropped packets, a hung host): `Err`. A peer that acknowledged the request
/// or accepted the connection is alive and gets the rest of the deadline.
fn await_answer(tcp: &TcpStream, deadline: Instant) -> Result<(), FetchError> {
    let Some(rtt) = round_trip(tcp) else {
        return Ok(());
    };
    let bound = silence_step(rtt);
    let t = left(deadline)
        .map_err(|e| io_failure("waiting", &e))?
        .min(bound);
    tcp.set_read_timeout(Some(t))
        .map_err(|e| io_failure("waiting", &e))?;
    let mut one = [0u8; 1];
    match tcp.peek(&mut one) {
        // Bytes (or the peer's close, which the read below reports): it answers.
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ) =>
        {
            if unacknowledged(tcp).is_none_or(|n| n == 0) {
                return Ok(());
            }
            // Not acknowledged yet: the peer's daemon may not have read it (a busy or
            // starved thread, a delayed ack). Its kernel answers a new connection at
            // once if the host is there.
            let Ok(addr) = tcp.peer_addr() else {
                return Ok(());
            };
            match TcpStream::connect_timeout(&addr, bound) {
                Ok(_) => Ok(()),
                Err(e) => Err(match io_failure("confirming", &e) {
                    FetchError::Silent(_) => FetchError::Silent(format!(
                        "the request was not acknowledged in {} ms, nor a new connection accepted in {} ms more",
                        bound.as_millis(),
                        bound.as_millis()
                    )),
                    other => other,
                }),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
        Err(e) => Err(io_failure("waiting", &e)),
    }
}

/// Block-stream connections to one peer in use, and fetches waiting for one.
#[derive(Debug, Default)]
struct Streams {
    in_use: usize,
    waiting: usize,
}

/// One block-stream connection to a peer in use (see [`Peers::stream_slot`]); given
/// back, and a waiting fetch woken, when dropped.
struct StreamSlot<'a> {
    peers: &'a Peers,
    peer: String,
}

impl Drop for StreamSlot<'_> {
    fn drop(&mut self) {
        let mut all = self.peers.streams.lock();
        let mut waiting = false;
        if let Some(s) = all.get_mut(&self.peer) {
            s.in_use -= 1;
            waiting = s.waiting > 0;
            if s.in_use == 0 && !waiting {
                all.remove(&self.peer);
            }
        }
        drop(all);
        // Every waiter (of any peer: one condvar for all) looks again; one gets it.
        if waiting {
            self.peers.streams_cv.notify_all();
        }
    }
}

/// Why a fetch from a peer failed (either way the caller reads the backing store).
#[derive(Debug, thiserror::Error)]
enum FetchError {
    /// The peer does not have the block (and may not fill it): it is healthy.
    #[error("not found: {0}")]
    NotFound(String),
    /// This node had no block stream to the peer free in time (its own load: the peer's
    /// health is not judged by it).
    #[error("busy: {0}")]
    Busy(String),
    /// The peer failed, refused, or sent bytes that are not the block.
    #[error("{0}")]
    Failed(String),
    /// The peer did not answer in time (down at once, until a probe gets an answer).
    #[error("{0}")]
    Silent(String),
    /// The reply failed its MAC: forged, changed on the way, or replayed.
    #[error("{}", wire::WireError::Forged)]
    Forged,
}

/// A block-stream connection past its handshake: the socket and its session.
#[derive(Debug)]
struct Conn {
    io: tls::Stream,
    session: wire::Session,
}

/// How an exchange on a block-stream connection broke (the connection is dropped).
enum Broken {
    /// Before any byte of the answer arrived: on a kept connection, worth one retry on a
    /// new one.
    BeforeAnswer(FetchError),
    /// Later: the answer itself was wrong or cut short.
    Midway(FetchError),
}

/// Time left before `deadline` (socket timeouts must not be zero).
fn left(deadline: Instant) -> std::io::Result<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| std::io::ErrorKind::TimedOut.into())
}

/// One request and its answer on a block-stream connection. `Ok` leaves the connection
/// between exchanges (reusable) with the block in `data` and its xxh3-64, or the peer's
/// refusal; either only once the reply's MAC verified.
///
/// The MAC says who sent the bytes and that nothing changed on the way; the xxh3 says
/// the bytes are those the checksum was recorded for. Both are checked here, in one
/// pass over each step while it is in the CPU's cache: a node that holds the secret but
/// sends bytes other than its checksum says (a damaged copy or buffer, a bug) must not
/// put them in this cache. The checksum is then handed to the store with the bytes, so
/// that the write does not hash them once more (`Store::commit_fill_summed`).
fn exchange(
    conn: &mut Conn,
    req: &proto::FetchRequest,
    len: usize,
    deadline: Instant,
    data: &mut Vec<u8>,
) -> Result<Result<u64, FetchError>, Broken> {
    let before = |e: std::io::Error| Broken::BeforeAnswer(io_failure("sending", &e));
    let midway_io = |e: std::io::Error| Broken::Midway(io_failure("receiving", &e));
    let midway = |e: String| Broken::Midway(FetchError::Failed(e));
    let wire_err = |e: wire::WireError| match e {
        wire::WireError::Forged => Broken::Midway(FetchError::Forged),
        wire::WireError::Io(e) => midway_io(e),
    };
    let Conn { io: s, session } = conn;
    s.tcp()
        .set_write_timeout(Some(left(deadline).map_err(before)?))
        .map_err(before)?;
    session.send_request(s, req).map_err(before)?;
    await_answer(s.tcp(), deadline).map_err(Broken::BeforeAnswer)?;
    s.tcp()
        .set_read_timeout(Some(left(deadline).map_err(before)?))
        .map_err(before)?;
    let (head, mut opened) = match session.read_reply(s) {
        Ok(h) => h,
        Err(wire::WireError::Io(e)) => return Err(before(e)),
        Err(e @ wire::WireError::Forged) => return Err(wire_err(e)),
    };
    let code = tonic::Code::from(head.code as i32);
    if code != tonic::Code::Ok {
        session.finish_reply(s, opened).map_err(wire_err)?;
        return Ok(Err(match code {
            tonic::Code::NotFound => FetchError::NotFound(head.message),
            code => FetchError::Failed(format!("{code:?}: {}", head.message)),
        }));
    }
    if head.length != len as u64 {
        return Err(midway(format!(
            "peer sent a block of {} bytes, {len} expected",
            head.length
        )));
    }
    // Every byte is overwritten below: with a buffer kept from the last block (the same
    // length, most often) this is free. Each [`STEP`] of the block is checksummed and
    // MACed as soon as it is whole, while it is in the CPU's cache; whole, aligned steps
    // keep BLAKE3 on its widest SIMD path (reads return arbitrary lengths).
    data.resize(len, 0);
    let mut hash = crate::checksum::BlockHasher::new();
    let (mut at, mut hashed) = (0, 0);
    while at < len {
        let t = left(deadline).map_err(midway_io)?;
        s.tcp().set_read_timeout(Some(t)).map_err(midway_io)?;
        let end = ((at / STEP + 1) * STEP).min(len);
        let n = match s.read(&mut data[at..end]) {
            Ok(0) => return Err(midway(format!("{at} of {len} bytes"))),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(midway_io(e)),
        };
        at += n;
        if at == end {
            hash.update(&data[hashed..at]);
            opened.update(&data[hashed..at]);
            hashed = at;
        }
    }
    session.finish_reply(s, opened).map_err(wire_err)?;
    if hash.digest() != head.xxh3 {
        return Err(midway("checksum mismatch: bytes dropped".into()));
    }
    Ok(Ok(head.xxh3))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 15: every rank of a world of 2^20 is counted (a rank past the 4 096th
    /// missing keeps the layout incomplete), and a node whose slots are not known yet
    /// (0: it has just started) too.
    #[test]
    fn slots_in_bytes_make_a_layout_only_when_every_node_counts_bytes() {
        assert_eq!(
            unflagged(vec![flagged(10, false, false), flagged(12, false, false)]),
            Some((vec![10, 12], false))
        );
        assert_eq!(
            unflagged(vec![
                flagged(10 << 20, true, false),
                flagged(12 << 20, true, false)
            ]),
            Some((vec![10 << 20, 12 << 20], true))
        );
        assert_eq!(
            unflagged(vec![
                flagged(10 << 20, true, false),
                flagged(12, false, false)
            ]),
            None,
            "one node in files, one in bytes: no layout"
        );
        assert_eq!(flagged(0, true, true), 0, "no slots yet stays unknown");
        assert_eq!(
            unflagged(vec![flagged(u64::MAX, true, false)]),
            Some((vec![(1 << 62) - 1], true))
        );
    }

    /// Nodes that place by different schemes (`placement`) would disagree on where every
    /// copy is: they form no layout.
    #[test]
    fn nodes_of_different_placement_schemes_make_no_layout() {
        assert_eq!(
            unflagged(vec![flagged(10, true, true), flagged(12, true, true)]),
            Some((vec![10, 12], true))
        );
        assert_eq!(
            unflagged(vec![flagged(10, false, true), flagged(12, false, false)]),
            None
        );
        assert_eq!(
            unflagged(vec![flagged(10, true, false), flagged(12, true, true)]),
            None
        );
    }

    #[test]
    fn a_layout_is_complete_only_with_every_rank_and_every_nodes_slots() {
        let world = 1u64 << 20;
        let job = "j".to_owned();
        let worlds = HashMap::from([(job.clone(), world)]);
        let nodes = ["a:1", "b:1", "c:1"];
        let mut map: HashMap<(String, u64), String> = (0..world)
            .map(|r| ((job.clone(), r), nodes[(r % 3) as usize].to_owned()))
            .collect();
        let mut slots: HashMap<(String, String), u64> = nodes
            .iter()
            .map(|n| ((job.clone(), (*n).to_owned()), 10))
            .collect();
        assert_eq!(
            Peers::completeness(&map, &slots, &worlds).get(&job),
            Some(&world)
        );
        slots.insert((job.clone(), "b:1".to_owned()), 0);
        assert!(
            Peers::completeness(&map, &slots, &worlds).is_empty(),
            "b's slots"
        );
        slots.insert((job.clone(), "b:1".to_owned()), 10);
        map.remove(&(job.clone(), world - 7));
        assert!(
            Peers::completeness(&map, &slots, &worlds).is_empty(),
            "a rank far past 4096"
        );
    }
}
