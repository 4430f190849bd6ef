//! Trust suite: floods (see main.rs). Connections held open to starve the daemon's two
//! listeners: the metrics port (the kubelet's liveness probe and Prometheus must still be
//! answered) and the Unix socket (one uid must not take the cache from the others, and an
//! operator's `status` always answers).
//!
//! Every flood is bounded in count and time; the figures (how long a probe took under
//! the flood, how many of the flood's connections the daemon closed) are printed.
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use shardcache_tests::{Bed, bin, content, http_get, read_all, write_file};

/// Longest a probe or a scrape may take under a flood (the kubelet's default probe
/// timeout is 1 s; generous for a loaded test machine).
const PROBE_BOUND: Duration = Duration::from_secs(3);

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Raises this process's soft limit on open files to at least `n` (to its hard limit,
/// which root may raise too).
fn raise_nofile(n: u64) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current.is_some_and(|c| c >= n) {
        return;
    }
    if l.maximum.is_some_and(|m| m < n) && is_root() {
        l.maximum = Some(n);
    }
    l.current = l.maximum.map(|m| m.min(n.max(4096)));
    setrlimit(Resource::Nofile, l).unwrap();
}

/// `GET path`, timed; panics unless it answers 200 within [`PROBE_BOUND`].
fn probe(addr: SocketAddr, path: &str, when: &str) -> Duration {
    let t = Instant::now();
    let r = http_get(addr, path);
    let took = t.elapsed();
    let (code, body) =
        r.unwrap_or_else(|e| panic!("{when}: GET {path} failed after {took:?}: {e}"));
    assert_eq!(code, 200, "{when}: GET {path}: {body}");
    assert!(took < PROBE_BOUND, "{when}: GET {path} took {took:?}");
    eprintln!("{when}: GET {path} answered in {took:?}");
    took
}

/// Opens up to `n` connections to `addr` within 30 s, each after `prepare` ran on it.
fn tcp_flood(addr: SocketAddr, n: usize, prepare: impl Fn(&mut TcpStream)) -> Vec<TcpStream> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut v = Vec::with_capacity(n);
    while v.len() < n && Instant::now() < deadline {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(mut s) => {
                prepare(&mut s);
                v.push(s);
            }
            Err(e) => eprintln!("flood connection {} failed: {e}", v.len()),
        }
    }
    eprintln!("flood: {} connections open", v.len());
    assert!(v.len() >= n / 2, "the flood itself could not connect");
    v
}

/// How many of `conns` the daemon has closed (a read sees the end of the stream or an
/// error rather than blocking).
fn closed_by_peer(conns: &[impl AsRawFdRead]) -> usize {
    conns.iter().filter(|c| c.peer_closed()).count()
}

trait AsRawFdRead {
    fn peer_closed(&self) -> bool;
}

impl<T: std::os::fd::AsFd> AsRawFdRead for T {
    fn peer_closed(&self) -> bool {
        use rustix::net::RecvFlags;
        let mut b = [0u8; 4096];
        // Anything unread (a reply) is skipped: only the end of the stream counts.
        loop {
            match rustix::net::recv(self, &mut b, RecvFlags::DONTWAIT) {
                Ok((0, _)) => return true,
                Ok(_) => continue,
                Err(rustix::io::Errno::AGAIN) => return false,
                Err(_) => return true,
            }
        }
    }
}

#[test]
fn metrics_probes_answer_while_idle_connections_flood_the_port() {
    raise_nofile(4096);
    let bed = Bed::new();
    let d = bed.start(&[]);
    let addr = d.metrics_addr().unwrap();
    probe(addr, "/healthz", "before the flood");

    let flood = tcp_flood(addr, 1500, |_| {});
    let mut worst = Duration::ZERO;
    for _ in 0..3 {
        worst = worst.max(probe(addr, "/healthz", "1500 idle connections"));
        worst = worst.max(probe(addr, "/readyz", "1500 idle connections"));
        worst = worst.max(probe(addr, "/metrics", "1500 idle connections"));
    }
    eprintln!(
        "idle flood: worst probe {worst:?}; {} of {} flood connections closed by the daemon",
        closed_by_peer(&flood),
        flood.len()
    );
    drop(flood);
    probe(addr, "/healthz", "after the flood");
    probe(addr, "/metrics", "after the flood");
}

#[test]
fn metrics_probes_answer_while_slowloris_connections_trickle_their_heads() {
    raise_nofile(4096);
    let bed = Bed::new();
    let d = bed.start(&[]);
    let addr = d.metrics_addr().unwrap();

    // Each connection starts a request and then sends its head one header at a time.
    let mut flood = tcp_flood(addr, 1500, |s| {
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n");
    });
    let mut worst = Duration::ZERO;
    for round in 0..4 {
        for s in &mut flood {
            let _ = s.write_all(format!("X-Slow-{round}: 1\r\n").as_bytes());
        }
        worst = worst.max(probe(addr, "/healthz", "1500 slowloris connections"));
        worst = worst.max(probe(addr, "/metrics", "1500 slowloris connections"));
    }
    eprintln!(
        "slowloris: worst probe {worst:?}; {} of {} flood connections closed by the daemon",
        closed_by_peer(&flood),
        flood.len()
    );
    drop(flood);
    probe(addr, "/healthz", "after the slowloris flood");
}

#[test]
fn metrics_probes_answer_while_connections_never_read_their_replies() {
    raise_nofile(4096);
    let bed = Bed::new();
    let d = bed.start(&[]);
    let addr = d.metrics_addr().unwrap();

    // Each connection pipelines requests and never reads: the daemon's replies fill the
    // (small) receive window and its writes block.
    let pipelined = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".repeat(2000);
    let flood = tcp_flood(addr, 300, |s| {
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&*s, 4096);
        s.set_write_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let _ = s.write_all(pipelined.as_bytes());
    });
    let mut worst = Duration::ZERO;
    for _ in 0..3 {
        worst = worst.max(probe(addr, "/healthz", "300 connections not reading"));
        worst = worst.max(probe(addr, "/metrics", "300 connections not reading"));
    }
    eprintln!(
        "not reading: worst probe {worst:?}; {} of {} flood connections closed by the daemon",
        closed_by_peer(&flood),
        flood.len()
    );
}

/// Connects `n` times to `socket` as `uid` (and its group, no supplementary groups):
/// the kernel records the connecting thread's credentials, so a thread that takes on
/// `uid` for itself alone opens them (the rest of the test keeps running as root).
fn unix_flood_as(uid: u32, socket: &Path, n: usize) -> Vec<UnixStream> {
    let socket = socket.to_owned();
    std::thread::spawn(move || {
        use rustix::process::{Gid, Uid};
        use rustix::thread::{set_thread_groups, set_thread_res_gid, set_thread_res_uid};
        let (u, g) = (Uid::from_raw(uid), Gid::from_raw(uid));
        set_thread_groups(&[]).unwrap();
        set_thread_res_gid(g, g, g).unwrap();
        set_thread_res_uid(u, u, u).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut v = Vec::with_capacity(n);
        while v.len() < n && Instant::now() < deadline {
            match UnixStream::connect(&socket) {
                Ok(s) => v.push(s),
                Err(e) => {
                    eprintln!("flood connection {} failed: {e}", v.len());
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        v
    })
    .join()
    .unwrap()
}

/// Runs `shardcache ARGS` as `uid` (its group, no supplementary groups).
fn cli_as(uid: u32, socket: &Path, args: &[&str]) -> Output {
    Command::new("setpriv")
        .args([
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".into(),
        ])
        .arg(bin("shardcache"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

/// Parses `cat --stats`' line: (hit, filled, backing) bytes.
fn cat_stats(stderr: &str) -> (u64, u64, u64) {
    let num = |key: &str| -> u64 {
        let rest = stderr
            .split(key)
            .nth(1)
            .unwrap_or_else(|| panic!("{stderr}"));
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    (num("hit "), num("filled "), num("backing "))
}

#[test]
fn one_uid_holding_idle_connections_does_not_switch_the_cache_off_for_others() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to connect as other uids");
        return;
    }
    raise_nofile(8192);
    let bed = Bed::new();
    let f = bed.path("shared/data.bin");
    write_file(&f, 7, 3 << 20);
    let d = bed.start(&["--block-size", "1MiB"]);
    // Root reads it once: it is cached whole.
    let (bytes, _) = read_all(&bed.client(), &f).unwrap();
    assert_eq!(bytes, content(7, 3 << 20));

    // uid 65534 holds more idle connections than the daemon serves at all (1024).
    let t = Instant::now();
    let flood = unix_flood_as(65534, &bed.socket, 1100);
    eprintln!(
        "uid 65534 opened {} connections in {:?}",
        flood.len(),
        t.elapsed()
    );
    assert_eq!(flood.len(), 1100);

    // An operator's status answers.
    let t = Instant::now();
    let status = shardcache_client::Client::with_config(shardcache_client::ClientConfig {
        socket: bed.socket.clone(),
        timeout: PROBE_BOUND,
        retry_after: Duration::ZERO,
        ..Default::default()
    })
    .status();
    let took = t.elapsed();
    let status = status.unwrap_or_else(|e| panic!("root's status under the flood: {e}"));
    eprintln!("root status under the flood: {took:?}");
    assert!(took < PROBE_BOUND, "{took:?}");

    // Another uid is served from the cache, not sent to the backing store.
    let path = f.to_str().unwrap();
    let t = Instant::now();
    let o = cli_as(65533, &bed.socket, &["cat", "--stats", path]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "uid 65533: {err}");
    assert!(
        o.stdout == content(7, 3 << 20),
        "uid 65533 read the right bytes"
    );
    let (hit, filled, backing) = cat_stats(&err);
    eprintln!("uid 65533 under the flood: {err} in {:?}", t.elapsed());
    assert_eq!(
        (hit + filled, backing),
        (3 << 20, 0),
        "served by the cache: {err}"
    );

    // The flooding uid's own honest client still reads right (from the cache or, at
    // worst, the backing store).
    let o = cli_as(65534, &bed.socket, &["cat", "--stats", path]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "uid 65534: {err}");
    assert!(
        o.stdout == content(7, 3 << 20),
        "uid 65534 read the right bytes"
    );
    eprintln!("uid 65534's own client under its flood: {err}");

    // The flood got no more than its share: the daemon closed its oldest idle
    // connections (or refused new ones), and counted it.
    let closed = closed_by_peer(&flood);
    let (_, m) = http_get(d.metrics_addr().unwrap(), "/metrics").unwrap();
    let shed = sample(
        &m,
        "shardcache_connections_closed_total{reason=\"uid_limit\"}",
    ) + sample(
        &m,
        "shardcache_connections_refused_total{reason=\"uid_limit\"}",
    );
    let open = sample(&m, "shardcache_connections");
    eprintln!(
        "flood: {closed} of {} connections closed by the daemon; counted {shed}; {open} connections open",
        flood.len(),
    );
    assert!(closed >= 1100 - 1024 / 4, "{closed}");
    assert!(shed >= (1100 - 1024 / 4) as f64, "{shed}");
    assert!(open <= (1024 / 4 + 8) as f64, "{open}");
    drop(status);
    drop(flood);
    d.status();
}

/// The value of the series `series` (name and labels exactly as rendered); 0 if absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn root_and_other_uids_are_served_when_one_uid_takes_every_connection() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to connect as other uids");
        return;
    }
    raise_nofile(8192);
    let bed = Bed::new();
    // Few connections, one uid may take them all: the operators' reserve is what
    // answers root.
    let cfg = bed.tmp.path().join("c.toml");
    std::fs::write(&cfg, "max_connections = 16\nmax_connections_per_uid = 16\n").unwrap();
    let d = bed.start(&["--config", cfg.to_str().unwrap()]);
    // The harness's own status connection is gone first (its thread ends a moment after
    // the client closes it), so that uid 65534 gets all 16.
    let addr = d.metrics_addr().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sample(
        &http_get(addr, "/metrics").unwrap().1,
        "shardcache_connections",
    ) > 0.0
    {
        assert!(Instant::now() < deadline, "connections left open");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut flood = unix_flood_as(65534, &bed.socket, 16);
    // Each asks for status once and reads the answer: every connection is admitted
    // (answered) and now idle.
    let req = shardcache_client::proto::Request {
        id: 7,
        report: None,
        kind: Some(shardcache_client::proto::request::Kind::Status(
            Default::default(),
        )),
    };
    for s in &mut flood {
        shardcache_proto::wire::send(&*s, &req, &[]).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let (r, _) = shardcache_proto::wire::FrameReader::new()
            .recv::<shardcache_client::proto::Response>(&*s)
            .unwrap();
        assert_eq!(r.id, 7);
    }
    // Root, and a newcomer of another uid, are still answered.
    let t = Instant::now();
    d.status();
    eprintln!("root status with every connection taken: {:?}", t.elapsed());
    let o = cli_as(65533, &bed.socket, &["status"]);
    assert!(
        o.status.success(),
        "uid 65533: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        closed_by_peer(&flood) >= 1,
        "one of uid 65534's idle connections made room"
    );
}
