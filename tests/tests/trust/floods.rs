//! Trust suite: floods (see main.rs). Connections held open to starve the daemon's
//! metrics port: the kubelet's liveness probe and Prometheus must still be answered.
//!
//! Every flood is bounded in count and time; the figures (how long a probe took under
//! the flood, how many of the flood's connections the daemon closed) are printed.
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use shardcache_tests::{Bed, http_get};

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
