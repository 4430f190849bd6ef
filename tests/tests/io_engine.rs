//! The store's I/O engine in the real daemon: `--io-engine` picks it, status and the
//! metrics name it, a cold fill, hits, `shardcache verify` and a restart work on each,
//! and a cache written by one engine is served by the other (the files on disk are the
//! same whichever engine wrote them).
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::time::Duration;

use shardcache_tests::{Bed, content, http_get, read_all, write_file};

/// The engines that can run here (io_uring only where the kernel allows it).
fn engines() -> Vec<&'static str> {
    let probe = tempfile::tempdir().unwrap();
    let uring = shardcache_daemon::store::io::open(
        shardcache_daemon::store::io::IoEngine::Uring,
        probe.path(),
    );
    match uring {
        Ok(_) => vec!["psync", "uring"],
        Err(e) => {
            eprintln!("{e}: psync only");
            vec!["psync"]
        }
    }
}

#[test]
fn each_engine_fills_serves_verifies_and_restarts_and_reads_the_others_cache() {
    let bed = Bed::new();
    let p = bed.path("ds/a.bin");
    let size = 1_000_000;
    write_file(&p, 3, size);
    let list = engines();
    // Each engine starts on the cache the previous one left (the first on an empty one).
    for (n, engine) in list.iter().chain(list.iter().rev()).enumerate() {
        let mut d = bed.start(&["--block-size", "64KiB", "--io-engine", engine]);
        assert_eq!(d.status().io_engine, *engine);
        let (_, text) = http_get(d.metrics_addr().unwrap(), "/metrics").unwrap();
        assert!(
            text.contains(&format!(
                "shardcache_store_io_engine{{engine=\"{engine}\"}} 1"
            )),
            "{text}"
        );
        let client = bed.client();
        let (bytes, stats) = read_all(&client, &p).unwrap();
        assert_eq!(bytes, content(3, size), "{engine}");
        if n > 0 {
            assert_eq!(stats.hit_bytes, size, "{engine} serves the cache it found");
        }
        let (bytes, stats) = read_all(&client, &p).unwrap();
        assert_eq!(bytes, content(3, size));
        assert_eq!(stats.hit_bytes, size, "{engine}: a second read is all hits");
        let v = client.verify(Duration::from_secs(60)).unwrap();
        assert_eq!((v.corrupt_blocks, v.bytes_checked), (0, size), "{engine}");
        d.stop();
        d.restart();
        let (bytes, stats) = read_all(&bed.client(), &p).unwrap();
        assert_eq!(bytes, content(3, size));
        assert_eq!(
            stats.hit_bytes, size,
            "{engine}: the cache survives a restart"
        );
        d.stop();
    }
}
