//! The metrics endpoint of the real daemon: where it listens (status names it), what it
//! serves, what a taken port does at start-up, and why clients fell back arriving in the
//! daemon's counters. (A real Prometheus scraping it: tests/ops.)
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use shardcache_client::FallbackReason;
use shardcache_tests::{Bed, bin, content, http_get, read_all, write_file};

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    http_get(addr, path).unwrap()
}

/// The value of the series `series` (name and labels exactly as rendered).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn the_endpoint_serves_metrics_and_probes_on_the_port_status_names() {
    let bed = Bed::new();
    let p = bed.path("ds/a.bin");
    write_file(&p, 1, 300_000);
    let d = bed.start(&["--block-size", "64KiB"]);
    let addr = d.metrics_addr().expect("the harness turns metrics on");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    assert_eq!(get(addr, "/healthz"), (200, "ok\n".into()));
    assert_eq!(get(addr, "/readyz"), (200, "ok\n".into()));
    assert_eq!(get(addr, "/metrics/x").0, 404);

    let (_, before) = get(addr, "/metrics");
    assert_eq!(
        sample(&before, "shardcache_read_bytes_total{result=\"hit\"}"),
        Some(0.0)
    );
    let client = bed.client();
    assert_eq!(read_all(&client, &p).unwrap().0, content(1, 300_000));
    assert_eq!(read_all(&client, &p).unwrap().0, content(1, 300_000));
    client.status().unwrap(); // delivers the read report
    let (code, text) = get(addr, "/metrics");
    assert_eq!(code, 200);
    let c = d.counters();
    let by = |r: &str| {
        sample(
            &text,
            &format!("shardcache_read_bytes_total{{result=\"{r}\"}}"),
        )
    };
    assert_eq!(by("hit"), Some(c.hit_bytes as f64));
    assert_eq!(by("filled"), Some(c.filled_bytes as f64));
    assert_eq!(
        by("hit").unwrap() + by("filled").unwrap() + by("fallback").unwrap(),
        600_000.0
    );
    // The second read is all hits (read-ahead may have made part of the first one hits).
    assert!(by("hit").unwrap() >= 300_000.0, "{text}");
    assert_eq!(
        sample(&text, "shardcache_backing_read_bytes_total"),
        Some(300_000.0)
    );
}

#[test]
fn off_means_no_endpoint_and_a_taken_port_stops_the_start() {
    let bed = Bed::new();
    let d = bed.start(&["--metrics-listen", "off"]);
    assert_eq!(d.metrics_addr(), None);
    drop(d);

    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let socket = bed.tmp.path().join("other.sock");
    let out = Command::new(bin("shardcached"))
        .args(["--backing-root", bed.backing.to_str().unwrap()])
        .args(["--cache-dir", bed.cache.to_str().unwrap()])
        .args(["--socket", socket.to_str().unwrap()])
        .args(["--metrics-listen", &addr])
        .env_remove("SHARDCACHE_SOCKET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("metrics_listen") && err.contains(&addr),
        "{err}"
    );
    assert!(
        !socket.exists(),
        "nothing started before the port was bound"
    );

    let out = Command::new(bin("shardcached"))
        .args(["--backing-root", bed.backing.to_str().unwrap()])
        .args(["--metrics-listen", "localhost"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-listen"));
}

#[test]
fn clients_report_why_they_read_the_backing_store() {
    let bed = Bed::new();
    let inside = bed.path("a.bin");
    write_file(&inside, 1, 100_000);
    let outside = bed.tmp.path().join("outside.bin");
    write_file(&outside, 2, 50_000);

    // No daemon yet: the client reads the backing store and keeps the count.
    let client = bed.client();
    assert_eq!(read_all(&client, &inside).unwrap().0, content(1, 100_000));
    let d = bed.start(&[]);
    // The client waits `retry_after` (200 ms) before trying the daemon again.
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.status().is_err() {
        assert!(
            Instant::now() < deadline,
            "the client never reached the daemon"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A file outside the backing roots is refused: read directly, counted as refused.
    assert_eq!(read_all(&client, &outside).unwrap().0, content(2, 50_000));
    client.status().unwrap();

    let s = d.status();
    let of = |r: FallbackReason| {
        s.fallbacks
            .iter()
            .find(|f| f.reason == r)
            .map(|f| (f.opens, f.reads > 0))
    };
    assert_eq!(s.fallbacks.len(), 10, "every reason is reported");
    assert_eq!(of(FallbackReason::Unavailable), Some((1, true)));
    assert_eq!(of(FallbackReason::Refused), Some((1, true)));
    assert_eq!(of(FallbackReason::Declined), Some((0, false)));
    let c = s.counters;
    assert_eq!(c.fallback_opens, 2);
    assert_eq!(
        s.fallbacks.iter().map(|f| f.reads).sum::<u64>(),
        c.fallback_reads
    );
    let (_, text) = get(d.metrics_addr().unwrap(), "/metrics");
    assert_eq!(
        sample(
            &text,
            "shardcache_fallback_opens_total{reason=\"unavailable\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "shardcache_fallback_opens_total{reason=\"refused\"}"),
        Some(1.0)
    );
}
