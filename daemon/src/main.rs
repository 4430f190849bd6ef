//! `shardcached`: reads settings (defaults ← TOML file ← environment ← flags), runs the
//! daemon until SIGTERM or SIGINT, then shuts it down in order.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use shardcache_daemon::config::{self, Config, SizeSpec};
use shardcache_daemon::daemon::Daemon;

/// The shardcache node daemon: caches training data from shared storage on local NVMe.
///
/// Every setting can come from the TOML file (`--config`), an environment variable, or
/// a flag; a flag beats the environment, which beats the file. See
/// docs/CONFIGURATION.md.
#[derive(Debug, Parser)]
#[command(name = "shardcached", version)]
struct Args {
    /// TOML configuration file.
    #[arg(long, env = "SHARDCACHED_CONFIG")]
    config: Option<PathBuf>,
    /// A backing root (repeat for several): the shared-storage directory to cache.
    #[arg(
        long = "backing-root",
        env = "SHARDCACHED_BACKING_ROOTS",
        value_delimiter = ','
    )]
    backing_roots: Vec<PathBuf>,
    /// Cache directory on local NVMe [default: /var/cache/shardcache].
    #[arg(long, env = "SHARDCACHED_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Unix socket for clients [default: /run/shardcache/shardcached.sock].
    #[arg(long, env = "SHARDCACHE_SOCKET")]
    socket: Option<PathBuf>,
    /// Most cached bytes: a size (500GiB) or a percentage of the cache file system [default: 80%].
    #[arg(long, env = "SHARDCACHED_CAPACITY")]
    capacity: Option<SizeSpec>,
    /// Free space to keep on the cache file system: a size or a percentage [default: 5%].
    #[arg(long, env = "SHARDCACHED_MIN_FREE")]
    min_free: Option<SizeSpec>,
    /// Block size [default: 4MiB].
    #[arg(long, env = "SHARDCACHED_BLOCK_SIZE", value_parser = config::parse_bytes)]
    block_size: Option<u64>,
    /// How the store writes and checks its data files: auto, psync or uring [default: auto].
    #[arg(long, env = "SHARDCACHED_IO_ENGINE")]
    io_engine: Option<config::IoEngine>,
    /// How long backing metadata is trusted, e.g. 1s, 250ms, 0 [default: 1s].
    #[arg(long, env = "SHARDCACHED_METADATA_TTL", value_parser = config::parse_duration)]
    metadata_ttl: Option<std::time::Duration>,
    /// Blocks to read ahead of a client [default: 8].
    #[arg(long, env = "SHARDCACHED_READAHEAD_BLOCKS")]
    readahead_blocks: Option<u32>,
    /// Who reads a cold small file first: auto, direct (the reader) or through (the daemon) [default: through].
    #[arg(long, env = "SHARDCACHED_COLD_READS")]
    cold_reads: Option<config::ColdReads>,
    /// The cluster placement of shuffles: simulate or forward [default: simulate].
    #[arg(long, env = "SHARDCACHED_PLACEMENT")]
    placement: Option<shardcache_daemon::planner::cluster::Scheme>,
    /// Fill worker threads [default: 4].
    #[arg(long, env = "SHARDCACHED_FILL_WORKERS")]
    fill_workers: Option<usize>,
    /// Most bytes/s read from the backing store, e.g. 200MiB; 0 = unlimited [default: 0].
    #[arg(long, env = "SHARDCACHED_BACKING_BANDWIDTH", value_parser = config::parse_bytes)]
    backing_bandwidth: Option<u64>,
    /// Longest a client waits on a fill before reading the backing store itself [default: 30s].
    #[arg(long, env = "SHARDCACHED_MAX_WAIT", value_parser = config::parse_duration)]
    max_wait: Option<std::time::Duration>,
    /// How long a connection thread polls for the next request before sleeping, e.g.
    /// 50us, 0 [default: 50us].
    #[arg(long, env = "SHARDCACHED_SPIN", value_parser = config::parse_duration)]
    spin: Option<std::time::Duration>,
    /// Most files of registered jobs prefetched ahead of their readers; 0 = planned
    /// prefetch off [default: 1024].
    #[arg(long, env = "SHARDCACHED_PREFETCH_AHEAD")]
    prefetch_ahead: Option<usize>,
    /// Most prefetched files being fetched at once [default: 16].
    #[arg(long, env = "SHARDCACHED_PREFETCH_CONCURRENCY")]
    prefetch_concurrency: Option<usize>,
    /// Most bytes/s prefetch reads from the backing store, e.g. 100MiB; 0 = unlimited
    /// [default: 0].
    #[arg(long, env = "SHARDCACHED_PREFETCH_BANDWIDTH", value_parser = config::parse_bytes)]
    prefetch_bandwidth: Option<u64>,
    /// Most files/s prefetch opens on the backing store; 0 = unlimited [default: 0].
    #[arg(long, env = "SHARDCACHED_PREFETCH_OPS")]
    prefetch_ops: Option<u64>,
    /// Where the peer service listens, e.g. 0.0.0.0:7070 [default: peers off].
    #[arg(long, env = "SHARDCACHED_PEER_LISTEN")]
    peer_listen: Option<std::net::SocketAddr>,
    /// This node's address as the others reach it [default: --peer-listen].
    #[arg(long, env = "SHARDCACHED_PEER_ADVERTISE")]
    peer_advertise: Option<String>,
    /// Another node's host:port (repeat for each).
    #[arg(long = "peer", env = "SHARDCACHED_PEERS", value_delimiter = ',')]
    peers: Vec<String>,
    /// A DNS name:port whose addresses are the nodes (a headless Service).
    #[arg(long, env = "SHARDCACHED_PEER_DNS")]
    peer_dns: Option<String>,
    /// File with the cluster's shared secret.
    #[arg(long, env = "SHARDCACHED_PEER_SECRET_FILE")]
    peer_secret_file: Option<PathBuf>,
    /// How long a backing root may leave a call unanswered before its calls are refused
    /// (clients read it directly) until one completes, e.g. 1s; 0 never [default: 1s].
    #[arg(long, env = "SHARDCACHED_BACKING_STALL_TIMEOUT", value_parser = config::parse_duration)]
    backing_stall_timeout: Option<std::time::Duration>,
    /// TLS on the peer port: this node's certificate chain (PEM); with --peer-tls-key and
    /// --peer-tls-ca [default: no TLS].
    #[arg(long, env = "SHARDCACHED_PEER_TLS_CERT")]
    peer_tls_cert: Option<PathBuf>,
    /// The private key of --peer-tls-cert (PEM).
    #[arg(long, env = "SHARDCACHED_PEER_TLS_KEY")]
    peer_tls_key: Option<PathBuf>,
    /// The CA certificates peers' certificates must chain to (PEM).
    #[arg(long, env = "SHARDCACHED_PEER_TLS_CA")]
    peer_tls_ca: Option<PathBuf>,
    /// The name every peer's certificate carries [default: shardcache-peer].
    #[arg(long, env = "SHARDCACHED_PEER_TLS_NAME")]
    peer_tls_name: Option<String>,
    /// Longest fetch from a peer before reading the backing store, e.g. 2s [default: 2s].
    #[arg(long, env = "SHARDCACHED_PEER_TIMEOUT", value_parser = config::parse_duration)]
    peer_timeout: Option<std::time::Duration>,
    /// Address of the HTTP endpoint for /metrics, /healthz and /readyz, e.g.
    /// 0.0.0.0:9477; port 0 picks a free port; `off` disables it [default: 127.0.0.1:9477].
    #[arg(long, env = "SHARDCACHED_METRICS_LISTEN")]
    metrics_listen: Option<config::MetricsListen>,
    /// Log filter (tracing EnvFilter syntax) [default: info].
    #[arg(long, env = "SHARDCACHED_LOG", default_value = "info")]
    log: String,
    /// Load and check the settings (file, environment and flags), print the outcome and
    /// exit: 0 when the daemon would start with them, 1 with the offending key named
    /// otherwise (the message a start would print). Changes nothing on disk. `node` (the
    /// default) checks everything a start checks, on this machine (roots, cache and
    /// socket directories, peer secret, listen addresses); `file` only the keys, values
    /// and their combinations, for a file written for other machines (CI, packaging).
    #[arg(
        long,
        value_enum,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "node",
        value_name = "SCOPE"
    )]
    check_config: Option<CheckScope>,
}

/// What `--check-config` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CheckScope {
    /// Everything a start checks, on this machine.
    Node,
    /// The keys, their values and their combinations only.
    File,
}

fn load(args: &Args) -> anyhow::Result<Config> {
    let mut cfg = match &args.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            toml::from_str(&text).with_context(|| format!("parsing {}", p.display()))?
        }
        None => Config::default(),
    };
    if !args.backing_roots.is_empty() {
        cfg.backing_roots = args.backing_roots.clone();
    }
    macro_rules! set {
        ($($f:ident),*) => { $(if let Some(v) = args.$f.clone() { cfg.$f = v; })* };
    }
    set!(
        cache_dir,
        socket,
        capacity,
        min_free,
        block_size,
        io_engine,
        metadata_ttl,
        readahead_blocks,
        fill_workers,
        cold_reads,
        placement,
        max_wait,
        spin,
        prefetch_ahead,
        prefetch_concurrency,
        peer_timeout,
        backing_stall_timeout,
        peer_tls_name,
        metrics_listen
    );
    if args.peer_listen.is_some() {
        cfg.peer_listen = args.peer_listen;
    }
    if args.peer_advertise.is_some() {
        cfg.peer_advertise = args.peer_advertise.clone();
    }
    if !args.peers.is_empty() {
        cfg.peers = args.peers.clone();
    }
    if args.peer_dns.is_some() {
        cfg.peer_dns = args.peer_dns.clone();
    }
    if args.peer_secret_file.is_some() {
        cfg.peer_secret_file = args.peer_secret_file.clone();
    }
    for (arg, field) in [
        (&args.peer_tls_cert, &mut cfg.peer_tls_cert),
        (&args.peer_tls_key, &mut cfg.peer_tls_key),
        (&args.peer_tls_ca, &mut cfg.peer_tls_ca),
    ] {
        if arg.is_some() {
            field.clone_from(arg);
        }
    }
    if let Some(bw) = args.backing_bandwidth {
        cfg.backing_bandwidth = (bw > 0).then_some(bw);
    }
    if let Some(bw) = args.prefetch_bandwidth {
        cfg.prefetch_bandwidth = (bw > 0).then_some(bw);
    }
    if let Some(ops) = args.prefetch_ops {
        cfg.prefetch_ops = (ops > 0).then_some(ops);
    }
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
    Ok(cfg)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&args.log).context("--log")?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cfg = load(&args)?;
    if let Some(scope) = args.check_config {
        if scope == CheckScope::Node {
            // What Daemon::start checks first, with the same message.
            shardcache_daemon::daemon::check(&cfg)
                .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
        }
        println!(
            "shardcached: configuration ok ({}{})",
            args.config
                .as_deref()
                .map_or_else(|| "no file".into(), |p| p.display().to_string()),
            match scope {
                CheckScope::Node => "",
                CheckScope::File => "; this machine's paths and addresses not checked",
            }
        );
        return Ok(());
    }
    raise_open_files(&cfg);
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("installing signal handlers")?;
    let daemon = Daemon::start(&cfg)?;
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "shutting down");
    }
    daemon.close()
}

/// Raises the soft limit on open descriptors to the hard one (a shell's soft limit is
/// often 1024, fewer than `max_connections` clients and the metrics endpoint need; the
/// packaged unit and the container set the hard one high), and warns when even that is
/// short.
fn raise_open_files(cfg: &Config) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    let hard = l.maximum;
    if l.current != hard {
        l.current = hard;
        if let Err(e) = setrlimit(Resource::Nofile, l) {
            tracing::warn!(error = %e, "cannot raise the limit on open files");
        }
    }
    let need = cfg.max_connections
        + config::OPERATOR_RESERVE
        + shardcache_daemon::metrics::http::MAX_CONNECTIONS
        + 1024;
    let have = getrlimit(Resource::Nofile).current;
    if let Some(have) = have
        && have < need as u64
    {
        tracing::warn!(
            open_files = have,
            need,
            "the limit on open files is below what max_connections clients need; raise it (LimitNOFILE=, ulimit -n)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "backing_roots = [\"/a\"]\ncapacity = \"1GiB\"\nreadahead_blocks = 3\n",
        )
        .unwrap();
        let args = Args::parse_from([
            "shardcached",
            "--config",
            f.to_str().unwrap(),
            "--capacity",
            "50%",
            "--block-size",
            "1MiB",
            "--metrics-listen",
            "off",
        ]);
        let cfg = load(&args).unwrap();
        assert_eq!(cfg.backing_roots, [PathBuf::from("/a")]);
        assert_eq!(cfg.capacity, SizeSpec::Percent(50.0));
        assert_eq!(cfg.block_size, 1 << 20);
        assert_eq!(cfg.readahead_blocks, 3);
        assert_eq!(cfg.metrics_listen, config::MetricsListen::Off);
    }

    #[test]
    fn check_config_accepts_the_packaged_file_and_names_a_bad_key() {
        let packaged = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/shardcached.toml");
        let ok = Args::parse_from(["shardcached", "--check-config", "--config", packaged]);
        assert_eq!(ok.check_config, Some(CheckScope::Node));
        let file = Args::parse_from(["shardcached", "--check-config=file", "--config", packaged]);
        assert_eq!(file.check_config, Some(CheckScope::File));
        load(&ok).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.toml");
        std::fs::write(&f, "backing_roots = [\"/a\"]\nblock_sise = \"1MiB\"\n").unwrap();
        let bad = Args::parse_from([
            "shardcached",
            "--check-config",
            "--config",
            f.to_str().unwrap(),
        ]);
        let e = format!("{:#}", load(&bad).unwrap_err());
        assert!(e.contains("block_sise"), "{e}");
    }
}
