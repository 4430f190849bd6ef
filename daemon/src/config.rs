//! The daemon's settings as plain data: every field has a default, a unit and a doc
//! line, and [`Config::validate`] checks them once. Reading TOML, flags and the
//! environment lives in the binary (`main.rs`), not here. docs/CONFIGURATION.md lists
//! the same keys.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

pub use crate::units::{SizeSpec, parse_bytes, parse_duration};

/// Which engine the store runs (configuration key `io_engine`, flag `--io-engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngine {
    /// io_uring where the kernel allows it, psync otherwise.
    #[default]
    Auto,
    /// `pread` / `pwrite` / `fdatasync`.
    Psync,
    /// io_uring; the daemon does not start without it.
    Uring,
}

impl FromStr for IoEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "psync" => Ok(Self::Psync),
            "uring" | "io_uring" => Ok(Self::Uring),
            _ => Err(format!(
                "io_engine: {s:?} is not one of \"auto\", \"psync\", \"uring\""
            )),
        }
    }
}

impl fmt::Display for IoEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Psync => "psync",
            Self::Uring => "uring",
        })
    }
}

/// Who reads a cold small file from the backing store (configuration key `cold_reads`,
/// flag `--cold-reads`; docs/SEMANTICS.md, "Cold small files").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColdReads {
    /// `direct` on roots whose page cache outlives an open (local file systems, NFS,
    /// Lustre, GPFS, CephFS), `through` on FUSE mounts (which drop it at each open unless
    /// their server keeps it) and whenever peers are on.
    Auto,
    /// The reader reads the backing store itself and the daemon fills the cache from the
    /// page cache behind it: the cold read costs about what a plain read costs.
    Direct,
    /// The daemon reads the file and hands its bytes to the reader.
    #[default]
    Through,
}

impl FromStr for ColdReads {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "direct" => Ok(Self::Direct),
            "through" => Ok(Self::Through),
            _ => Err(format!(
                "cold_reads: {s:?} is not one of \"auto\", \"direct\", \"through\""
            )),
        }
    }
}

impl fmt::Display for ColdReads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Direct => "direct",
            Self::Through => "through",
        })
    }
}

/// The name peers' certificates carry unless configured otherwise (`peer_tls_name`).
pub const DEFAULT_TLS_NAME: &str = "shardcache-peer";

/// Where a node's TLS material is, and the name every peer's certificate carries (plain
/// data: `peer::tls` loads and checks the files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This node's certificate chain (PEM, the node's certificate first).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificates that peers' certificates must chain to (PEM).
    pub ca: PathBuf,
    /// The DNS name every node's certificate is valid for (a subject alternative name),
    /// checked by the connecting node.
    pub name: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Num(u64),
    Str(String),
}

fn de_size<'de, D: Deserializer<'de>>(d: D) -> Result<SizeSpec, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Num(n) => Ok(SizeSpec::Bytes(n)),
        NumOrStr::Str(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Num(n) => Ok(n),
        NumOrStr::Str(s) => parse_bytes(&s).map_err(serde::de::Error::custom),
    }
}

fn de_opt_count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let n = u64::deserialize(d)?;
    Ok((n > 0).then_some(n))
}

fn de_opt_usize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    let n = usize::deserialize(d)?;
    Ok((n > 0).then_some(n))
}

fn de_opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_bytes(d).map(|b| if b == 0 { None } else { Some(b) })
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Num(n) => Ok(Duration::from_secs(n)),
        NumOrStr::Str(s) => parse_duration(&s).map_err(serde::de::Error::custom),
    }
}

/// Where the metrics and probe endpoints (`/metrics`, `/healthz`, `/readyz`) listen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsListen {
    /// No HTTP endpoint (`off`).
    Off,
    /// A TCP address; port 0 picks a free port (the bound address is logged and shown by
    /// `shardcache status`).
    Addr(std::net::SocketAddr),
}

/// The default metrics address: loopback only, so that nothing is exposed off the node
/// unless asked for (the Helm chart sets `0.0.0.0:9477`).
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9477";

impl FromStr for MetricsListen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(MetricsListen::Off);
        }
        t.parse().map(MetricsListen::Addr).map_err(|_| {
            format!("`{s}` is not an address (expected host:port such as 127.0.0.1:9477, or off)")
        })
    }
}

impl fmt::Display for MetricsListen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsListen::Off => f.write_str("off"),
            MetricsListen::Addr(a) => write!(f, "{a}"),
        }
    }
}

fn de_io_engine<'de, D: Deserializer<'de>>(d: D) -> Result<IoEngine, D::Error> {
    String::deserialize(d)?
        .parse()
        .map_err(serde::de::Error::custom)
}

fn de_cold_reads<'de, D: Deserializer<'de>>(d: D) -> Result<ColdReads, D::Error> {
    String::deserialize(d)?
        .parse()
        .map_err(serde::de::Error::custom)
}

/// Which cluster placement shuffles run (configuration key `placement`, flag
/// `--placement`; `crate::planner::cluster`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Scheme {
    /// Every node simulates the cluster's reads (the simulation, `planner::placement`).
    #[default]
    Simulate,
    /// Each copy goes to its next reader (next-reader forwarding, `planner::forward`).
    Forward,
}

impl FromStr for Scheme {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "simulate" => Ok(Self::Simulate),
            "forward" => Ok(Self::Forward),
            _ => Err(format!(
                "placement: {s:?} is not one of \"simulate\", \"forward\""
            )),
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Simulate => "simulate",
            Self::Forward => "forward",
        })
    }
}

fn de_placement<'de, D: Deserializer<'de>>(d: D) -> Result<Scheme, D::Error> {
    String::deserialize(d)?
        .parse()
        .map_err(serde::de::Error::custom)
}

fn de_metrics_listen<'de, D: Deserializer<'de>>(d: D) -> Result<MetricsListen, D::Error> {
    String::deserialize(d)?
        .parse()
        .map_err(serde::de::Error::custom)
}

/// Client connections beyond `max_connections` that only root and the daemon's user may
/// hold, so that an operator's `shardcache status` is answered however busy the socket.
pub const OPERATOR_RESERVE: usize = 8;

/// Default socket path for the local API.
pub const DEFAULT_SOCKET: &str = "/run/shardcache/shardcached.sock";
/// Default cache directory.
pub const DEFAULT_CACHE_DIR: &str = "/var/cache/shardcache";

/// Everything `shardcached` can be told. TOML keys are the field names.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Directories on the shared file system the cache serves. Paths outside them are
    /// never read through the cache. Required (at least one).
    pub backing_roots: Vec<PathBuf>,
    /// Where cached data and the index live (local NVMe). Default `/var/cache/shardcache`.
    pub cache_dir: PathBuf,
    /// Unix socket for local clients. Default `/run/shardcache/shardcached.sock`.
    pub socket: PathBuf,
    /// Permission bits of the socket file. Default 0o666: every local user may connect;
    /// what each may read is decided per request from its credentials.
    pub socket_mode: u32,
    /// Most bytes of cached data, as bytes or a percentage of the cache file system.
    /// Default 80%.
    #[serde(deserialize_with = "de_size")]
    pub capacity: SizeSpec,
    /// Free space always left on the cache file system, as bytes or a percentage.
    /// Default 5%.
    #[serde(deserialize_with = "de_size")]
    pub min_free: SizeSpec,
    /// Block size in bytes: the unit of filling, checksumming and eviction. Default 4 MiB.
    /// Must be a multiple of 4 KiB. Entries already cached keep the block size they were
    /// written with.
    #[serde(deserialize_with = "de_bytes")]
    pub block_size: u64,
    /// How the store writes and checks its data files: `auto` (io_uring where the kernel
    /// allows it, else psync), `psync` (`pread`/`pwrite`/`fdatasync`) or `uring` (io_uring,
    /// or no start). Default `auto`. Clients read the same files either way.
    #[serde(deserialize_with = "de_io_engine")]
    pub io_engine: IoEngine,
    /// How long a backing file's metadata (version, owners, modes) is trusted before it
    /// is checked again, like NFS `actimeo`. `0` checks on every open. Default 1 s.
    #[serde(deserialize_with = "de_duration")]
    pub metadata_ttl: Duration,
    /// Blocks filled ahead of a client's position in a file. Default 8.
    pub readahead_blocks: u32,
    /// Threads reading each backing root and writing the cache (per root: a hung root
    /// holds only its own). Default 4.
    pub fill_workers: usize,
    /// Who reads a cold small file (one block, nothing cached) for its first reader:
    /// `direct` (the reader, from the backing store, while the daemon fills the cache
    /// from the page cache behind it), `through` (the daemon, handing the bytes over) or
    /// `auto` (direct unless the root is a FUSE mount or peers are on). Default `through`.
    #[serde(deserialize_with = "de_cold_reads")]
    pub cold_reads: ColdReads,
    /// The cluster placement of shuffles (peers on): `simulate` (every node simulates
    /// the cluster's reads) or `forward` (each copy goes to its next reader). Default
    /// `simulate`. See docs/ARCHITECTURE.md, "Placement by plan".
    #[serde(deserialize_with = "de_placement")]
    pub placement: Scheme,
    /// Most queued block fills; read-ahead beyond it is dropped (counted). Default 8192.
    pub fill_queue: usize,
    /// Longest a client may wait on one fill request before it reads the backing store
    /// itself. Default 30 s.
    #[serde(deserialize_with = "de_duration")]
    pub max_wait: Duration,
    /// Most bytes per second read from the backing store by this daemon; `0` = no limit.
    /// Default no limit.
    #[serde(deserialize_with = "de_opt_bytes")]
    pub backing_bandwidth: Option<u64>,
    /// How long a backing root may leave a call unanswered before it counts as hung: a
    /// file with a call stuck that long is refused, and a root with one stuck and no call
    /// completed for that long is refused whole (clients read it directly) until a call
    /// on it completes again. `0` never refuses. Default 1 s.
    #[serde(deserialize_with = "de_duration")]
    pub backing_stall_timeout: Duration,
    /// Most simultaneous client connections. When they are all held, a newcomer takes
    /// the place of an idle connection of the uid holding the most (or is refused, and
    /// reads the backing store, when none is idle). Root and the daemon's user have
    /// [`OPERATOR_RESERVE`] more. Default 1024.
    pub max_connections: usize,
    /// Most simultaneous client connections of one uid (root and the daemon's user
    /// excepted); beyond it, a newcomer of that uid takes the place of its connection
    /// idle longest (or is refused when none is idle). Unset or 0: a quarter of
    /// `max_connections` (see [`Config::connections_per_uid`]).
    #[serde(deserialize_with = "de_opt_usize")]
    pub max_connections_per_uid: Option<usize>,
    /// How long a connection thread keeps polling for a client's next request before it
    /// sleeps. Waking a sleeping thread costs tens of microseconds on virtual machines,
    /// more than a whole cached open; `0` never polls. Default 50 µs.
    #[serde(deserialize_with = "de_duration")]
    pub spin: Duration,
    /// Most files of registered jobs fetched ahead of their readers and not yet read.
    /// How far ahead the prefetcher runs within this bound follows the measured
    /// consumption rate and backing-store speed; what it keeps is bounded by the cache
    /// (a prefetch never evicts a file needed sooner), so this bounds bookkeeping, not
    /// bytes. `0` turns planned prefetch off (eviction and admission still follow the
    /// registered plans). Default 65536: at half cache an epoch opens with the kept half
    /// (thousands of hits), and everything missing behind it must be fetched while the
    /// readers pass the hits; 1024 left a 400 mbit link idle for seconds per epoch.
    pub prefetch_ahead: usize,
    /// Most prefetched files being fetched at once. Default 16.
    pub prefetch_concurrency: usize,
    /// Most bytes per second prefetch reads from the backing store (a budget that
    /// protects the shared file system; reads that clients wait on are not held back by
    /// it); `0` = no limit. Default no limit.
    #[serde(deserialize_with = "de_opt_bytes")]
    pub prefetch_bandwidth: Option<u64>,
    /// Most files per second prefetch opens on the backing store (a metadata budget);
    /// `0` = no limit. Default no limit.
    #[serde(deserialize_with = "de_opt_count")]
    pub prefetch_ops: Option<u64>,
    /// Where the peer service listens (`host:port`); unset (the default) keeps this node
    /// to itself. Sharing needs `peer_secret_file` and `peers` or `peer_dns`.
    pub peer_listen: Option<std::net::SocketAddr>,
    /// This node's address as the other nodes reach it. Default: `peer_listen`.
    pub peer_advertise: Option<String>,
    /// The other nodes (`host:port` each), a static list.
    pub peers: Vec<String>,
    /// A DNS name (`name:port`) whose addresses are the nodes, re-read every
    /// `peer_refresh` (a Kubernetes headless Service).
    pub peer_dns: Option<String>,
    /// A file holding the cluster's shared secret (at least 16 characters; the same on
    /// every node). Peers without it get nothing.
    pub peer_secret_file: Option<PathBuf>,
    /// Longest a fetch from a peer may take before the backing store is read instead.
    /// Default 2 s.
    #[serde(deserialize_with = "de_duration")]
    pub peer_timeout: Duration,
    /// How often `peer_dns` is resolved again. Default 30 s.
    #[serde(deserialize_with = "de_duration")]
    pub peer_refresh: Duration,
    /// TLS on the peer port (gRPC and the block stream; mutual): this node's
    /// certificate chain, a PEM file (a Kubernetes Secret's `tls.crt`). Set all of
    /// `peer_tls_cert`, `peer_tls_key` and `peer_tls_ca`, or none (the default: no TLS;
    /// every byte is still authenticated by the shared secret, not hidden).
    pub peer_tls_cert: Option<PathBuf>,
    /// The certificate's private key, a PEM file (`tls.key`).
    pub peer_tls_key: Option<PathBuf>,
    /// The CA certificates peers' certificates must chain to, a PEM file (`ca.crt`).
    pub peer_tls_ca: Option<PathBuf>,
    /// The DNS name every node's certificate carries (a subject alternative name), which
    /// a connecting node checks instead of the address it dialled. Default
    /// `shardcache-peer`.
    pub peer_tls_name: String,
    /// Where the HTTP endpoint for Prometheus (`/metrics`) and the probes (`/healthz`,
    /// `/readyz`) listens: `host:port` (port 0 picks a free one), or `off`. Default
    /// `127.0.0.1:9477`.
    #[serde(deserialize_with = "de_metrics_listen")]
    pub metrics_listen: MetricsListen,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            backing_roots: Vec::new(),
            cache_dir: PathBuf::from(DEFAULT_CACHE_DIR),
            socket: PathBuf::from(DEFAULT_SOCKET),
            socket_mode: 0o666,
            capacity: SizeSpec::Percent(80.0),
            min_free: SizeSpec::Percent(5.0),
            block_size: 4 << 20,
            io_engine: IoEngine::Auto,
            metadata_ttl: Duration::from_secs(1),
            readahead_blocks: 8,
            fill_workers: 4,
            cold_reads: ColdReads::Through,
            placement: Scheme::Simulate,
            fill_queue: 8192,
            backing_stall_timeout: crate::backing::watch::DEFAULT_STALL,
            max_wait: Duration::from_secs(30),
            backing_bandwidth: None,
            max_connections: 1024,
            max_connections_per_uid: None,
            spin: Duration::from_micros(50),
            prefetch_ahead: 65536,
            prefetch_concurrency: 16,
            prefetch_bandwidth: None,
            prefetch_ops: None,
            peer_listen: None,
            peer_advertise: None,
            peers: Vec::new(),
            peer_dns: None,
            peer_secret_file: None,
            peer_timeout: Duration::from_secs(2),
            peer_refresh: Duration::from_secs(30),
            peer_tls_cert: None,
            peer_tls_key: None,
            peer_tls_ca: None,
            peer_tls_name: DEFAULT_TLS_NAME.to_owned(),
            metrics_listen: MetricsListen::Addr(std::net::SocketAddr::from(([127, 0, 0, 1], 9477))),
        }
    }
}

impl Config {
    /// The most connections one uid may hold: `max_connections_per_uid`, by default a
    /// quarter of `max_connections` (at least 1).
    pub fn connections_per_uid(&self) -> usize {
        self.max_connections_per_uid
            .unwrap_or(self.max_connections / 4)
            .clamp(1, self.max_connections.max(1))
    }

    /// The peer port's TLS files, when all three are set.
    pub fn peer_tls(&self) -> Option<TlsFiles> {
        match (&self.peer_tls_cert, &self.peer_tls_key, &self.peer_tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
                name: self.peer_tls_name.clone(),
            }),
            _ => None,
        }
    }

    /// TLS keys: all or none, and only with `peer_listen` (whether the files load is
    /// [`Config::check_node`]'s to say: they are files of this machine).
    fn validate_peer_tls(&self) -> Result<(), String> {
        let set = [&self.peer_tls_cert, &self.peer_tls_key, &self.peer_tls_ca]
            .iter()
            .filter(|f| f.is_some())
            .count();
        if set == 0 {
            return Ok(());
        }
        if self.peer_tls().is_none() {
            return Err(
                "peer_tls_cert, peer_tls_key, peer_tls_ca: set all three (TLS on the peer port) or none"
                    .into(),
            );
        }
        if self.peer_listen.is_none() {
            return Err("peer_tls_cert: TLS needs peer_listen (it secures the peer port)".into());
        }
        Ok(())
    }

    /// Checks every field once; the message names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_peer_tls()?;
        if let Some(listen) = self.peer_listen {
            if self.peer_secret_file.is_none() {
                return Err("peer_secret_file: required with peer_listen (peers authenticate every call with it)".into());
            }
            if self.peers.is_empty() && self.peer_dns.is_none() {
                return Err(
                    "peers: list the other nodes, or set peer_dns, with peer_listen".into(),
                );
            }
            if self.peer_advertise.is_none() && listen.ip().is_unspecified() {
                return Err(format!(
                    "peer_advertise: required when peer_listen ({listen}) is a wildcard address: the address the other nodes reach this one at"
                ));
            }
            if self.peer_timeout.is_zero() || self.peer_refresh.is_zero() {
                return Err("peer_timeout, peer_refresh: must be more than 0".into());
            }
            if let Some(name) = &self.peer_dns {
                parse_dns(name)?;
            }
        } else if !self.peers.is_empty() || self.peer_dns.is_some() {
            return Err("peer_listen: required when peers or peer_dns is set".into());
        }
        if self.prefetch_ahead > 0 && self.prefetch_concurrency == 0 {
            return Err(
                "prefetch_concurrency: must be at least 1 while prefetch is on (prefetch_ahead > 0)"
                    .into(),
            );
        }
        if self.backing_roots.is_empty() {
            return Err(
                "backing_roots: at least one backing root is required (--backing-root DIR)".into(),
            );
        }
        for r in &self.backing_roots {
            if !r.is_absolute() {
                return Err(format!(
                    "backing_roots: `{}` must be an absolute path",
                    r.display()
                ));
            }
        }
        if self.block_size < 4096
            || !self.block_size.is_multiple_of(4096)
            || self.block_size > 1 << 30
        {
            return Err(format!(
                "block_size: {} must be a multiple of 4 KiB between 4 KiB and 1 GiB",
                self.block_size
            ));
        }
        if self.fill_workers == 0 || self.fill_workers > 256 {
            return Err("fill_workers: must be between 1 and 256".into());
        }
        if self.fill_queue == 0 {
            return Err("fill_queue: must be at least 1".into());
        }
        if self.max_connections == 0 {
            return Err("max_connections: must be at least 1".into());
        }
        if let Some(n) = self.max_connections_per_uid
            && n > self.max_connections
        {
            return Err(format!(
                "max_connections_per_uid: {n} is more than max_connections ({})",
                self.max_connections
            ));
        }
        if self.socket_mode > 0o777 {
            return Err(format!(
                "socket_mode: {:o} is not a permission mode",
                self.socket_mode
            ));
        }
        if self.spin > Duration::from_millis(10) {
            return Err("spin: at most 10ms (it keeps a core busy)".into());
        }
        if let SizeSpec::Bytes(0) = self.capacity {
            return Err("capacity: must be more than 0".into());
        }
        Ok(())
    }

    /// What start-up refuses that plain data and this machine's files say:
    /// [`Config::validate`], then what this machine must offer ([`Config::check_node`]).
    /// Whether the peer TLS files load is the peer layer's to say:
    /// `crate::daemon::check` (what `shardcached --check-config` and the daemon's start
    /// call) runs this and then loads them, so that the check passes exactly the
    /// configurations a start accepts (bar what another process holds; see `check_node`).
    pub fn check(&self) -> Result<(), String> {
        self.validate()?;
        self.check_node()
    }

    /// What the daemon needs of this machine, checked without changing anything: every
    /// backing root is a directory with a UTF-8 path; the cache directory and the
    /// socket's directory are directories this process may write (or can be created);
    /// the socket path is free or a socket; the peer secret file is readable and holds a
    /// valid secret ([`read_peer_secret`]); the listen addresses belong to this host.
    /// (That the peer TLS files load — read and parse, the key fits the certificate, the
    /// certificate verifies against the CA — `crate::daemon::check` adds.)
    ///
    /// Not checked, because they are not the configuration's doing and a new
    /// configuration must be checkable beside the running daemon: a port another process
    /// listens on, a socket a live daemon answers on, a cache directory another daemon
    /// has locked. Start-up refuses those with the key named.
    pub fn check_node(&self) -> Result<(), String> {
        for r in &self.backing_roots {
            let canonical = std::fs::canonicalize(r)
                .map_err(|e| format!("backing_roots: {}: {e}", r.display()))?;
            if !canonical.is_dir() {
                return Err(format!("backing_roots: {}: not a directory", r.display()));
            }
            if canonical.to_str().is_none() {
                return Err(format!(
                    "backing_roots: {}: backing root paths must be UTF-8",
                    canonical.display()
                ));
            }
        }
        writable_dir("cache_dir", &self.cache_dir)?;
        match std::fs::symlink_metadata(&self.socket) {
            Ok(m) if !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                return Err(format!(
                    "socket: {}: exists and is not a socket; refusing to replace it",
                    self.socket.display()
                ));
            }
            _ => {}
        }
        if let Some(dir) = self.socket.parent() {
            writable_dir("socket", dir)?;
        }
        if let MetricsListen::Addr(a) = self.metrics_listen {
            local_address("metrics_listen", a)?;
        }
        if let Some(a) = self.peer_listen {
            local_address("peer_listen", a)?;
            if let Some(f) = &self.peer_secret_file {
                read_peer_secret(f)?;
            }
        }
        Ok(())
    }
}

/// Splits a `peer_dns` value, `name:port`.
pub fn parse_dns(name: &str) -> Result<(String, u16), String> {
    name.rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
        .filter(|(h, _)| !h.is_empty())
        .ok_or_else(|| format!("peer_dns: `{name}`: expected name:port"))
}

/// Reads the cluster's shared secret from `file`: its text, trimmed, at least 16
/// characters of printable ASCII. The error names the key.
pub fn read_peer_secret(file: &std::path::Path) -> Result<String, String> {
    let bad = |why: String| format!("peer_secret_file: {}: {why}", file.display());
    let secret = std::fs::read_to_string(file)
        .map_err(|e| bad(format!("cannot read the peer secret ({e})")))?
        .trim()
        .to_owned();
    if secret.len() < 16 {
        return Err(bad(format!(
            "the peer secret must be at least 16 characters (it has {})",
            secret.chars().count()
        )));
    }
    if !secret
        .bytes()
        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
    {
        return Err(bad("the peer secret must be printable ASCII".into()));
    }
    Ok(secret)
}

/// `dir` is a directory this process may create entries in, or the nearest existing
/// directory above it is (it would be created).
fn writable_dir(key: &str, dir: &std::path::Path) -> Result<(), String> {
    use rustix::fs::Access;
    let mut at = dir;
    loop {
        match std::fs::metadata(at) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => {
                return Err(format!("{key}: {}: not a directory", at.display()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match at.parent() {
                Some(p) if !p.as_os_str().is_empty() => at = p,
                _ => return Ok(()),
            },
            Err(e) => return Err(format!("{key}: {}: {e}", at.display())),
        }
    }
    // As this process will create them: with its effective ids and capabilities.
    let ok = rustix::fs::accessat(
        rustix::fs::CWD,
        at,
        Access::WRITE_OK | Access::EXEC_OK,
        rustix::fs::AtFlags::EACCESS,
    );
    ok.map_err(|e| {
        let what = if at == dir {
            String::new()
        } else {
            format!(" (to create {})", dir.display())
        };
        format!(
            "{key}: {}: not writable by this user{what}: {}",
            at.display(),
            std::io::Error::from(e)
        )
    })
}

/// `addr`'s IP is one this host can listen on (checked on a free port, so that a port
/// the running daemon holds does not fail the check).
fn local_address(key: &str, addr: std::net::SocketAddr) -> Result<(), String> {
    std::net::TcpListener::bind(std::net::SocketAddr::new(addr.ip(), 0))
        .map(drop)
        .map_err(|e| format!("{key}: cannot listen on {addr}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_tls_is_all_or_nothing_with_peers() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("secret"), "0123456789abcdef-secret").unwrap();
        let base = Config {
            backing_roots: vec![dir.path().to_owned()],
            cache_dir: dir.path().join("cache"),
            socket: dir.path().join("sc.sock"),
            metrics_listen: MetricsListen::Off,
            peer_listen: Some("127.0.0.1:7070".parse().unwrap()),
            peers: vec!["127.0.0.1:7071".into()],
            peer_secret_file: Some(dir.path().join("secret")),
            ..Config::default()
        };
        assert_eq!(base.check(), Ok(()));
        assert_eq!(base.peer_tls(), None);
        let f = |n: &str| Some(dir.path().join(n));
        let partial = Config {
            peer_tls_cert: f("tls.crt"),
            peer_tls_key: f("tls.key"),
            ..base.clone()
        };
        let e = partial.validate().unwrap_err();
        assert!(e.contains("set all three"), "{e}");
        let all = Config {
            peer_tls_ca: f("ca.crt"),
            ..partial
        };
        assert_eq!(all.peer_tls().unwrap().name, "shardcache-peer");
        // The keys are right; whether the files load is this machine's to say (see
        // `daemon::tests::check_loads_the_peer_tls_files`).
        assert_eq!(all.validate(), Ok(()));
        let e = Config {
            peer_listen: None,
            peers: Vec::new(),
            ..all
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("needs peer_listen"), "{e}");
    }

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_bytes("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_bytes("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("123").unwrap(), 123);
        assert!(parse_bytes("4XB").is_err());
        assert_eq!("80%".parse::<SizeSpec>().unwrap(), SizeSpec::Percent(80.0));
        assert!("180%".parse::<SizeSpec>().is_err());
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("1 fortnight").is_err());
    }

    #[test]
    fn toml_round_trip_and_unknown_keys_are_errors() {
        let c: Config = toml::from_str(
            "backing_roots = [\"/data\"]\ncapacity = \"10GiB\"\nblock_size = \"1MiB\"\nmetadata_ttl = \"0\"\n",
        )
        .unwrap();
        assert_eq!(c.capacity, SizeSpec::Bytes(10 << 30));
        assert_eq!(c.block_size, 1 << 20);
        assert_eq!(c.metadata_ttl, Duration::ZERO);
        c.validate().unwrap();
        let e = toml::from_str::<Config>("capacty = 1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("capacty"), "{e}");
    }

    #[test]
    fn metrics_listen_is_an_address_or_off() {
        let c: Config = toml::from_str("metrics_listen = \"off\"").unwrap();
        assert_eq!(c.metrics_listen, MetricsListen::Off);
        let c: Config = toml::from_str("metrics_listen = \"0.0.0.0:9477\"").unwrap();
        assert_eq!(c.metrics_listen.to_string(), "0.0.0.0:9477");
        let e = toml::from_str::<Config>("metrics_listen = \"localhost\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("metrics_listen"), "{e}");
    }

    #[test]
    fn placement_is_simulate_or_forward() {
        let c: Config = toml::from_str("placement = \"forward\"\n").unwrap();
        assert_eq!(c.placement, Scheme::Forward);
        assert_eq!(Config::default().placement, Scheme::Simulate);
        let e = toml::from_str::<Config>("placement = \"hash\"\n").unwrap_err();
        assert!(e.to_string().contains("placement"), "{e}");
    }

    #[test]
    fn cold_reads_is_auto_direct_or_through() {
        let c: Config = toml::from_str("cold_reads = \"auto\"\n").unwrap();
        assert_eq!(c.cold_reads, ColdReads::Auto);
        assert_eq!(Config::default().cold_reads, ColdReads::Through);
        let e = toml::from_str::<Config>("cold_reads = \"never\"\n").unwrap_err();
        assert!(e.to_string().contains("cold_reads"), "{e}");
    }

    #[test]
    fn io_engine_is_auto_psync_or_uring() {
        let c: Config = toml::from_str("io_engine = \"psync\"\n").unwrap();
        assert_eq!(c.io_engine, IoEngine::Psync);
        assert_eq!(Config::default().io_engine, IoEngine::Auto);
        let e = toml::from_str::<Config>("io_engine = \"aio\"\n").unwrap_err();
        assert!(e.to_string().contains("io_engine"), "{e}");
    }

    #[test]
    fn validation_names_the_field() {
        let c = Config {
            backing_roots: vec!["/d".into()],
            block_size: 1000,
            ..Config::default()
        };
        assert!(c.validate().unwrap_err().starts_with("block_size"));
        assert!(
            Config::default()
                .validate()
                .unwrap_err()
                .starts_with("backing_roots")
        );
    }
}

#[cfg(test)]
mod packaged {
    use super::*;

    /// The example configuration shipped in packaging/ parses and matches the defaults.
    #[test]
    fn the_packaged_example_is_valid_and_documents_the_defaults() {
        let c: Config = toml::from_str(include_str!("../../packaging/shardcached.toml")).unwrap();
        c.validate().unwrap();
        let d = Config::default();
        assert_eq!(c.cache_dir, d.cache_dir);
        assert_eq!(c.socket, d.socket);
        assert_eq!(c.socket_mode, d.socket_mode);
        assert_eq!(c.capacity, d.capacity);
        assert_eq!(c.min_free, d.min_free);
        assert_eq!(c.block_size, d.block_size);
        assert_eq!(c.io_engine, d.io_engine);
        assert_eq!(c.cold_reads, d.cold_reads);
        assert_eq!(c.placement, d.placement);
        assert_eq!(c.metadata_ttl, d.metadata_ttl);
        assert_eq!(c.readahead_blocks, d.readahead_blocks);
        assert_eq!(c.fill_workers, d.fill_workers);
        assert_eq!(c.fill_queue, d.fill_queue);
        assert_eq!(c.max_wait, d.max_wait);
        assert_eq!(c.backing_bandwidth, d.backing_bandwidth);
        assert_eq!(c.max_connections, d.max_connections);
        assert_eq!(c.max_connections_per_uid, d.max_connections_per_uid);
        assert_eq!(c.spin, d.spin);
        assert_eq!(c.prefetch_ahead, d.prefetch_ahead);
        assert_eq!(c.prefetch_concurrency, d.prefetch_concurrency);
        assert_eq!(c.prefetch_bandwidth, d.prefetch_bandwidth);
        assert_eq!(c.prefetch_ops, d.prefetch_ops);
        assert_eq!(c.peer_listen, d.peer_listen);
        assert_eq!(c.peers, d.peers);
        assert_eq!(c.peer_timeout, d.peer_timeout);
        assert_eq!(c.peer_refresh, d.peer_refresh);
        assert_eq!(c.metrics_listen, d.metrics_listen);
        assert_eq!(
            d.metrics_listen,
            DEFAULT_METRICS_LISTEN.parse::<MetricsListen>().unwrap()
        );
    }
}
