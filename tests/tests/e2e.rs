//! End-to-end tests of the foundation: the real `shardcached` process, the real client
//! library and CLI, real files.
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use shardcache_client::{Client, ClientConfig, Source, proto as pb};
use shardcache_tests::{Bed, bin, content, read_all, write_file};

const MIB: u64 = 1 << 20;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

#[test]
fn cold_and_warm_reads_equal_the_backing_bytes() {
    let bed = Bed::new();
    let sizes = [0, 1, MIB - 1, MIB, MIB + 1, 3 * MIB + MIB / 2];
    for (i, s) in sizes.iter().enumerate() {
        write_file(&bed.path(&format!("d/f{i}")), i as u64, *s);
    }
    let d = bed.start(&["--block-size", "1MiB"]);
    let client = bed.client();
    for (i, s) in sizes.iter().enumerate() {
        let p = bed.path(&format!("d/f{i}"));
        let want = content(i as u64, *s);
        let (cold, _) = read_all(&client, &p).unwrap();
        assert_eq!(cold, want, "cold read of {s} bytes");
        // The cold reader may have had its bytes before they landed: read again (the
        // same bytes every time) until the read is all local hits, bounded.
        let t = Instant::now();
        let st = loop {
            let (warm, st) = read_all(&client, &p).unwrap();
            assert_eq!(warm, want, "warm read of {s} bytes");
            if st.hit_bytes == *s || t.elapsed() > Duration::from_secs(10) {
                break st;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(st.hit_bytes, *s, "warm read is all local hits");
        assert_eq!(st.fallback_bytes, 0);
    }
    // Positioned reads across block boundaries, a seek, and a mapping.
    let p = bed.path("d/f5");
    let want = content(5, sizes[5]);
    let mut r = client.open(&p).unwrap();
    assert_eq!(r.source(), Source::Cache);
    let mut buf = vec![0u8; 2 * MIB as usize];
    let n = r.read_at(&mut buf, MIB - 10).unwrap();
    assert_eq!(
        &buf[..n],
        &want[(MIB - 10) as usize..(MIB - 10) as usize + n]
    );
    r.seek(SeekFrom::End(-100)).unwrap();
    let mut tail = Vec::new();
    r.read_to_end(&mut tail).unwrap();
    assert_eq!(tail, want[want.len() - 100..]);
    // SAFETY: nothing modifies the file while mapped.
    let map = unsafe { r.mmap() }.unwrap();
    assert_eq!(&map[..], &want[..]);
    let c = d.counters();
    assert_eq!(
        c.fallback_bytes, 0,
        "no client read the backing store itself"
    );
    assert_eq!(
        c.backing_bytes,
        sizes.iter().sum::<u64>(),
        "each byte read from backing once"
    );
}

#[test]
fn a_rewritten_backing_file_gives_new_bytes_never_old() {
    let bed = Bed::new();
    let p = bed.path("f.bin");
    write_file(&p, 1, 3 * MIB);
    let d = bed.start(&["--block-size", "1MiB", "--metadata-ttl", "0"]);
    let client = bed.client();
    assert_eq!(read_all(&client, &p).unwrap().0, content(1, 3 * MIB));
    assert_eq!(
        read_all(&client, &p).unwrap().1.hit_bytes,
        3 * MIB,
        "cached"
    );

    // Rewrite in place: same inode, same size, new content.
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&content(2, 3 * MIB), 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let fetched = d.counters().backing_bytes;
    let (got, _) = read_all(&client, &p).unwrap();
    assert_eq!(got, content(2, 3 * MIB), "in-place rewrite");
    assert_eq!(
        d.counters().backing_bytes,
        fetched + 3 * MIB,
        "the new version was fetched"
    );

    // Replace by rename: new inode, same size.
    let tmp = bed.path("f.bin.tmp");
    write_file(&tmp, 3, 3 * MIB);
    std::fs::rename(&tmp, &p).unwrap();
    let (got, _) = read_all(&client, &p).unwrap();
    assert_eq!(got, content(3, 3 * MIB), "replaced file");
    assert_eq!(
        d.counters().backing_bytes,
        fetched + 6 * MIB,
        "the replacement was fetched"
    );
    assert_eq!(
        read_all(&client, &p).unwrap().1.hit_bytes,
        3 * MIB,
        "the new version is cached"
    );
}

#[test]
fn kill_9_during_a_fill_keeps_complete_blocks_and_serves_nothing_partial() {
    let bed = Bed::new();
    let p = bed.path("big.bin");
    let size = 48 * MIB;
    write_file(&p, 7, size);
    let args = [
        "--block-size",
        "1MiB",
        "--backing-bandwidth",
        "12MiB",
        "--readahead-blocks",
        "4",
    ];
    let mut d = bed.start(&args);
    // A reader streams the file while the daemon fills it slowly.
    let reader = {
        let client = bed.client();
        let p = p.clone();
        std::thread::spawn(move || read_all(&client, &p).map(|r| r.0))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while d.status().blocks < 8 {
        assert!(Instant::now() < deadline, "fill made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    d.kill9();
    // The reader in flight falls back to the backing store and still gets every byte.
    assert_eq!(reader.join().unwrap().unwrap(), content(7, size));

    d.restart();
    let s = d.status();
    let kept = s.blocks;
    assert!(kept >= 8, "complete blocks survive the crash ({kept})");
    assert!(kept < 48, "the crash happened mid-fill ({kept})");
    assert!(s.unverified_blocks <= kept);
    let (got, _) = read_all(&bed.client(), &p).unwrap();
    assert_eq!(got, content(7, size));
    let c = d.counters();
    assert_eq!(c.corrupt_blocks, 0);
    assert!(
        c.blocks_verified >= kept,
        "after an unclean stop every block is checked (on first use or by the scrub)"
    );
    assert_eq!(
        c.backing_reads,
        48 - kept,
        "kept blocks are not fetched again"
    );
}

fn data_file(bed: &Bed) -> std::path::PathBuf {
    let data = bed.cache.join("shardcache-v1/data");
    let mut found = Vec::new();
    for sub in std::fs::read_dir(&data).unwrap().flatten() {
        for f in std::fs::read_dir(sub.path()).unwrap().flatten() {
            found.push(f.path());
        }
    }
    assert_eq!(
        found.len(),
        1,
        "exactly one cached file expected: {found:?}"
    );
    found.pop().unwrap()
}

#[test]
fn a_corrupt_cache_block_is_detected_not_served_and_refetched() {
    let bed = Bed::new();
    let p = bed.path("f.bin");
    write_file(&p, 11, 4 * MIB);
    let mut d = bed.start(&["--block-size", "1MiB"]);
    let client = bed.client();
    read_all(&client, &p).unwrap();
    assert_eq!(d.status().blocks, 4);

    // While running: corruption is found by `shardcache verify`.
    let df = data_file(&bed);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&df)
        .unwrap()
        .write_all_at(b"bit rot", MIB + 5)
        .unwrap();
    let out = Command::new(bin("shardcache"))
        .args(["--socket", bed.socket.to_str().unwrap(), "verify"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("checked 4 blocks (4.0 MiB) of 1 cached files: 1 corrupt"),
        "{text}"
    );
    let before = d.counters().backing_reads;
    let (got, _) = read_all(&bed.client(), &p).unwrap();
    assert_eq!(got, content(11, 4 * MIB), "corrupt block not served");
    assert_eq!(
        d.counters().backing_reads,
        before + 1,
        "only the corrupt block is refetched"
    );

    // After an unclean stop: corruption is found before the block is first used.
    d.kill9();
    std::fs::OpenOptions::new()
        .write(true)
        .open(data_file(&bed))
        .unwrap()
        .write_all_at(b"torn", 3 * MIB)
        .unwrap();
    d.restart();
    let (got, st) = read_all(&bed.client(), &p).unwrap();
    assert_eq!(got, content(11, 4 * MIB));
    assert_eq!(st.hit_bytes, 3 * MIB, "the three good blocks are reused");
    let c = d.counters();
    assert_eq!(c.corrupt_blocks, 1);
    assert_eq!(c.backing_reads, 1);
}

#[test]
fn reads_succeed_from_backing_when_the_daemon_is_absent_stopped_or_hung() {
    let bed = Bed::new();
    let p = bed.path("f.bin");
    write_file(&p, 5, 2 * MIB + 3);
    let want = content(5, 2 * MIB + 3);

    // Each phase uses a fresh client, so that one phase's breaker does not decide the next.
    let new_client = || {
        Client::with_config(ClientConfig {
            socket: bed.socket.clone(),
            timeout: Duration::from_millis(300),
            wait_timeout: Duration::from_secs(5),
            retry_after: Duration::from_secs(60),
            pool: 2,
            ..ClientConfig::default()
        })
    };

    // Never started.
    let client = new_client();
    let mut r = client.open(&p).unwrap();
    assert_eq!(r.source(), Source::Backing);
    let mut got = Vec::new();
    r.read_to_end(&mut got).unwrap();
    assert_eq!(got, want);
    assert!(client.open(bed.path("missing")).unwrap_err().kind() == std::io::ErrorKind::NotFound);

    // Started, used, then stopped: the pooled connection is dead; reads still succeed.
    let mut d = bed.start(&["--block-size", "1MiB"]);
    let client = new_client();
    assert_eq!(read_all(&client, &p).unwrap().0, want);
    let (_, st) = read_all(&client, &p).unwrap();
    assert_eq!(
        st.hit_bytes + st.filled_bytes,
        want.len() as u64,
        "served from the cache"
    );
    let mut open_reader = client.open(&p).unwrap();
    assert!(d.stop(), "clean shutdown");
    assert_eq!(read_all(&client, &p).unwrap().0, want);
    let mut got = Vec::new();
    open_reader.read_to_end(&mut got).unwrap();
    assert_eq!(
        got, want,
        "a reader opened before the stop keeps its local copy"
    );

    // Hung (SIGSTOP): the open times out and the client reads the backing store.
    d.restart();
    d.signal(libc::SIGSTOP);
    let client = new_client();
    let mut r = client.open(&p).unwrap();
    let mut got = Vec::new();
    r.read_to_end(&mut got).unwrap();
    d.signal(libc::SIGCONT);
    assert_eq!(got, want);
    assert_eq!(r.source(), Source::Backing);
    let why = r.fallback_reason().unwrap_or_default();
    assert!(
        why.contains("did not answer in time") || why.contains("timed out"),
        "{why}"
    );
}

#[test]
fn thirty_two_concurrent_readers_cause_one_backing_read_per_block() {
    let bed = Bed::new();
    let p = bed.path("shared.bin");
    let blocks = 16;
    write_file(&p, 9, blocks * MIB);
    // Throttled so that the readers really overlap on every block.
    let d = bed.start(&["--block-size", "1MiB", "--backing-bandwidth", "64MiB"]);
    let barrier = Arc::new(Barrier::new(32));
    let threads: Vec<_> = (0..32)
        .map(|_| {
            let (client, p, barrier) = (bed.client(), p.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut r = client.open(&p).unwrap();
                let mut v = Vec::new();
                r.read_to_end(&mut v).unwrap();
                (v, r.stats(), r.fallback_reason())
            })
        })
        .collect();
    let want = content(9, blocks * MIB);
    for t in threads {
        let (got, st, why) = t.join().unwrap();
        assert!(got == want, "wrong bytes");
        assert_eq!(
            st.fallback_bytes, 0,
            "no reader went to the backing store itself ({why:?})"
        );
    }
    let c = d.counters();
    assert_eq!(c.backing_reads, blocks, "one backing read per block");
    assert_eq!(c.backing_bytes, blocks * MIB);
}

#[test]
fn a_second_uid_is_denied_what_it_cannot_read_on_backing() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to run a client as another uid");
        return;
    }
    let bed = Bed::new();
    write_file(&bed.path("private.bin"), 1, MIB);
    std::fs::set_permissions(bed.path("private.bin"), PermissionsExt::from_mode(0o600)).unwrap();
    write_file(&bed.path("public.bin"), 2, MIB);
    std::fs::set_permissions(bed.path("public.bin"), PermissionsExt::from_mode(0o644)).unwrap();
    write_file(&bed.path("closed/inner.bin"), 3, MIB);
    std::fs::set_permissions(bed.path("closed"), PermissionsExt::from_mode(0o700)).unwrap();
    write_file(&bed.path("group.bin"), 4, MIB);
    std::fs::set_permissions(bed.path("group.bin"), PermissionsExt::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(bed.path("group.bin"), Some(0), Some(4242)).unwrap();
    let d = bed.start(&["--block-size", "1MiB"]);
    // Root reads everything first, so the private data is in the cache.
    for f in ["private.bin", "public.bin", "closed/inner.bin", "group.bin"] {
        read_all(&bed.client(), &bed.path(f)).unwrap();
    }

    let cat_as = |groups: &str, f: &str| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534"])
            .args(if groups.is_empty() {
                vec!["--clear-groups".to_owned()]
            } else {
                vec![format!("--groups={groups}")]
            })
            .arg(bin("shardcache"))
            .args(["--socket", bed.socket.to_str().unwrap(), "cat", "--stats"])
            .arg(bed.path(f))
            .output()
            .unwrap()
    };
    let before = d.counters();
    for f in ["private.bin", "closed/inner.bin", "group.bin"] {
        let out = cat_as("", f);
        assert!(
            !out.status.success(),
            "{f} must not be readable by uid 65534"
        );
        assert!(out.stdout.is_empty(), "no byte of {f} leaked");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
            "{:?}",
            out
        );
    }
    let after = d.counters();
    assert_eq!(
        after.refused_denied - before.refused_denied,
        3,
        "the daemon refused all three"
    );
    assert_eq!(
        after.hit_bytes + after.filled_bytes,
        before.hit_bytes + before.filled_bytes
    );

    let out = cat_as("", "public.bin");
    assert!(out.status.success());
    assert_eq!(out.stdout, content(2, MIB));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("hit {MIB} B")),
        "served from the cache"
    );
    let out = cat_as("4242", "group.bin");
    assert!(
        out.status.success(),
        "a supplementary group grants read: {out:?}"
    );
    assert_eq!(out.stdout, content(4, MIB));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("hit {MIB} B")));
}

/// Sends one raw Open request and returns the reply and how many descriptors came.
fn raw_open(bed: &Bed, path: &str) -> (pb::open_reply::Result, usize) {
    let sock = std::os::unix::net::UnixStream::connect(&bed.socket).unwrap();
    let req = pb::Request {
        id: 1,
        report: None,
        kind: Some(pb::request::Kind::Open(pb::OpenRequest {
            path: path.into(),
        })),
    };
    shardcache_proto::wire::send(&sock, &req, &[]).unwrap();
    let (resp, fds): (pb::Response, _) = shardcache_proto::wire::FrameReader::new()
        .recv(&sock)
        .unwrap();
    match resp.kind {
        Some(pb::response::Kind::Open(pb::OpenReply { result: Some(r) })) => (r, fds.len()),
        other => panic!("unexpected reply {other:?}"),
    }
}

#[test]
fn path_escapes_are_refused() {
    let bed = Bed::new();
    let outside = bed.tmp.path().join("outside.txt");
    write_file(&outside, 1, 1001);
    write_file(&bed.path("in/ok.bin"), 2, 1000);
    std::os::unix::fs::symlink(&outside, bed.path("abs-link")).unwrap();
    std::os::unix::fs::symlink("../outside.txt", bed.path("rel-link")).unwrap();
    std::os::unix::fs::symlink("in", bed.path("dir-link")).unwrap();
    let d = bed.start(&[]);
    let root = bed.backing.to_str().unwrap();
    let refused = |p: &str, want: pb::Reason| {
        let (r, fds) = raw_open(&bed, p);
        match r {
            pb::open_reply::Result::Refused(r) => {
                assert_eq!(r.reason(), want, "{p}: {}", r.message)
            }
            other => panic!("{p} was not refused: {other:?}"),
        }
        assert_eq!(fds, 0, "{p}: no descriptor");
    };
    refused(&format!("{root}/../outside.txt"), pb::Reason::EscapesRoot);
    refused(
        &format!("{root}/in/../../outside.txt"),
        pb::Reason::EscapesRoot,
    );
    refused(&format!("{root}/abs-link"), pb::Reason::EscapesRoot);
    refused(&format!("{root}/rel-link"), pb::Reason::EscapesRoot);
    refused(outside.to_str().unwrap(), pb::Reason::NotUnderRoot);
    refused("/etc/passwd", pb::Reason::NotUnderRoot);
    refused("relative/path", pb::Reason::NotUnderRoot);
    refused(&format!("{root}/in"), pb::Reason::NotAFile);
    refused(&format!("{root}/nope"), pb::Reason::NotFound);
    // A symlink that stays inside the root is followed.
    assert!(matches!(
        raw_open(&bed, &format!("{root}/dir-link/ok.bin")).0,
        pb::open_reply::Result::Opened(_)
    ));
    // Through the client, an escaping path is read from the backing store by the
    // client itself, with its own rights; the cache holds nothing of it.
    let (got, st) = read_all(&bed.client(), &bed.path("abs-link")).unwrap();
    assert_eq!(got, content(1, 1001));
    assert_eq!(st.fallback_bytes, 1001);
    let s = d.status();
    assert_eq!(
        s.counters.refused_path, 8,
        "seven raw escapes or outside paths, plus the client's"
    );
    let data = bed.cache.join("shardcache-v1/data");
    for sub in std::fs::read_dir(&data).unwrap().flatten() {
        for f in std::fs::read_dir(sub.path()).unwrap().flatten() {
            assert_ne!(
                f.metadata().unwrap().len(),
                1001,
                "nothing outside the root was cached"
            );
        }
    }
}

#[test]
fn capacity_is_respected_by_evicting() {
    let bed = Bed::new();
    for i in 0..4 {
        write_file(&bed.path(&format!("f{i}")), i, 2 * MIB);
    }
    let d = bed.start(&[
        "--block-size",
        "1MiB",
        "--capacity",
        "5MiB",
        "--min-free",
        "0",
    ]);
    let client = bed.client();
    for round in 0..2 {
        for i in 0..4 {
            let (got, _) = read_all(&client, &bed.path(&format!("f{i}"))).unwrap();
            assert_eq!(got, content(i, 2 * MIB), "round {round} file {i}");
            assert!(d.status().used_bytes <= 5 * MIB);
        }
    }
    let c = d.counters();
    assert!(
        c.evicted_files >= 4,
        "evictions happened ({}): {c:?}",
        c.evicted_files
    );
    assert_eq!(
        c.fallback_bytes, 0,
        "eviction never sent a reader to the backing store"
    );
}

#[test]
fn status_cli_prints_a_table_and_json() {
    let bed = Bed::new();
    write_file(&bed.path("f"), 1, MIB);
    let _d = bed.start(&[]);
    read_all(&bed.client(), &bed.path("f")).unwrap();
    // Landed before the second read (a reader of a one-block file may get its bytes
    // before they land): both reads are then served locally, and the status counts it.
    bed.until_cached(&[bed.path("f")]);
    read_all(&bed.client(), &bed.path("f")).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(bin("shardcache"))
            .env("SHARDCACHE_SOCKET", &bed.socket)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let table = run(&["status"]);
    for word in ["capacity", "local hit", "backing", "refused", "integrity"] {
        assert!(table.contains(word), "{word} missing from:\n{table}");
    }
    let json: serde_json::Value = serde_json::from_str(&run(&["status", "--json"])).unwrap();
    assert_eq!(json["files"], 1);
    let local = json["counters"]["hit_bytes"].as_u64().unwrap()
        + json["counters"]["filled_bytes"].as_u64().unwrap();
    assert_eq!(local, 2 * MIB, "both reads were served locally");
    // Without a daemon the CLI says what to do.
    let out = Command::new(bin("shardcache"))
        .args(["--socket", "/nonexistent/sock", "status"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is the daemon running?"));
}

#[test]
fn cold_small_files_read_directly_are_filled_behind_their_readers() {
    let bed = Bed::new();
    let n = 40u64;
    let paths: Vec<_> = (0..n).map(|i| bed.path(&format!("d/{i:03}"))).collect();
    for (i, p) in paths.iter().enumerate() {
        write_file(p, i as u64, 5000 + i as u64 * 101);
    }
    write_file(&bed.path("d/big"), 99, 3 << 20);
    // A temporary directory keeps its page cache from one open to the next (not FUSE):
    // `auto` has cold small files read by their readers.
    let d = bed.start(&["--cold-reads", "auto", "--block-size", "1MiB"]);
    assert!(
        d.log_text().contains("cold small files") && d.log_text().contains("direct"),
        "the choice is logged: {}",
        d.log_text()
    );
    let client = bed.client();
    let before = d.counters();
    for (i, p) in paths.iter().enumerate() {
        let mut r = client.open(p).unwrap();
        assert_eq!(r.source(), Source::Backing, "file {i}");
        assert_eq!(
            r.fallback(),
            Some(shardcache_client::FallbackReason::Direct)
        );
        let mut v = Vec::new();
        r.read_to_end(&mut v).unwrap();
        assert_eq!(v, content(i as u64, 5000 + i as u64 * 101), "file {i}");
    }
    let small = d.counters();
    assert_eq!(small.waits, before.waits, "no small file waited: {small:?}");
    assert_eq!(small.handoffs, before.handoffs);
    // A file of several blocks is read through the cache.
    let (got, _) = read_all(&client, &bed.path("d/big")).unwrap();
    assert_eq!(got, content(99, 3 << 20));
    // The fills queued behind the readers land without anyone reading again (bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.counters().blocks_filled - before.blocks_filled < n + 3 {
        assert!(Instant::now() < deadline, "{:?}", d.counters());
        std::thread::sleep(Duration::from_millis(10));
    }
    // Each open was reported as a direct read of the backing store, by name.
    let direct = d
        .status()
        .fallbacks
        .iter()
        .find(|f| f.reason == shardcache_client::FallbackReason::Direct)
        .map(|f| f.opens);
    assert_eq!(direct, Some(n));
    // The next reader of each finds it cached, byte for byte.
    for (i, p) in paths.iter().enumerate() {
        let mut r = client.open(p).unwrap();
        assert_eq!(r.source(), Source::Cache, "file {i}");
        let mut v = Vec::new();
        r.read_to_end(&mut v).unwrap();
        assert_eq!(v, content(i as u64, 5000 + i as u64 * 101), "file {i}");
        assert_eq!(r.stats().hit_bytes, v.len() as u64, "file {i}");
    }
}

#[test]
fn open_many_gives_each_path_what_open_would() {
    let bed = Bed::new();
    for i in 0..70 {
        write_file(&bed.path(&format!("s/{i:03}")), i, 1000 + i * 37);
    }
    let d = bed.start(&[]);
    let client = bed.client();
    // Warm half of them.
    for i in (0..70).step_by(2) {
        read_all(&client, &bed.path(&format!("s/{i:03}"))).unwrap();
    }
    let warmed: Vec<_> = (0..70)
        .step_by(2)
        .map(|i| bed.path(&format!("s/{i:03}")))
        .collect();
    bed.until_cached(&warmed);
    let mut paths: Vec<std::path::PathBuf> =
        (0..70).map(|i| bed.path(&format!("s/{i:03}"))).collect();
    paths.push(bed.path("s/missing"));
    paths.push("/etc/hostname".into());
    let readers = client.open_many(&paths);
    assert_eq!(
        readers.len(),
        72,
        "70 files over two exchanges, plus two odd ones"
    );
    for (i, r) in readers.into_iter().take(70).enumerate() {
        let mut r = r.unwrap();
        assert_eq!(r.source(), Source::Cache, "file {i}");
        let mut v = Vec::new();
        r.read_to_end(&mut v).unwrap();
        assert_eq!(v, content(i as u64, 1000 + i as u64 * 37), "file {i}");
    }
    let mut rest = client.open_many(&paths[70..]).into_iter();
    assert_eq!(
        rest.next().unwrap().unwrap_err().kind(),
        std::io::ErrorKind::NotFound
    );
    if std::path::Path::new("/etc/hostname").exists() {
        assert_eq!(
            rest.next().unwrap().unwrap().source(),
            Source::Backing,
            "outside the roots: read directly"
        );
    }
    let c = d.counters();
    assert_eq!(c.fallback_bytes, 0);
    assert!(c.opens_full >= 35, "the warmed half was complete at open");
}

#[test]
fn a_full_cache_degrades_to_backing_reads() {
    let bed = Bed::new();
    write_file(&bed.path("f.bin"), 3, 3 * MIB + 5);
    // A free-space floor of the whole file system: nothing can ever be admitted.
    let d = bed.start(&["--block-size", "1MiB", "--min-free", "100%"]);
    let client = bed.client();
    for _ in 0..2 {
        let (got, st) = read_all(&client, &bed.path("f.bin")).unwrap();
        assert_eq!(got, content(3, 3 * MIB + 5));
        assert_eq!(
            st.fallback_bytes,
            3 * MIB + 5,
            "every byte read from the backing store"
        );
    }
    let c = d.counters();
    assert!(c.fills_no_space > 0, "the daemon reported the full cache");
    assert_eq!(d.status().used_bytes, 0);
}

#[test]
fn open_ahead_yields_every_file_in_order_even_if_the_daemon_stops() {
    let bed = Bed::new();
    let n = 100;
    for i in 0..n {
        write_file(&bed.path(&format!("s/{i:03}")), i, 500 + i * 11);
    }
    let mut d = bed.start(&[]);
    let client = bed.client();
    let paths: Vec<_> = (0..n).map(|i| bed.path(&format!("s/{i:03}"))).collect();
    for round in 0..2 {
        let mut seen = 0;
        for (i, r) in client.open_ahead(&paths, 16).enumerate() {
            let mut r = r.unwrap();
            let mut v = Vec::new();
            r.read_to_end(&mut v).unwrap();
            assert_eq!(
                v,
                content(i as u64, 500 + i as u64 * 11),
                "round {round} file {i}"
            );
            seen += 1;
        }
        assert_eq!(seen, n);
        bed.until_cached(&paths);
    }
    assert!(
        d.counters().opens_full >= n,
        "the second round was served from the cache"
    );
    // The daemon stops between batches: the rest is read directly, in order.
    let mut it = client.open_ahead(&paths, 16);
    for i in 0..n {
        if i == 20 {
            assert!(d.stop());
        }
        let mut v = Vec::new();
        it.next().unwrap().unwrap().read_to_end(&mut v).unwrap();
        assert_eq!(v, content(i, 500 + i * 11), "file {i}");
    }
    assert!(it.next().is_none());
}

#[test]
fn bad_requests_get_errors_and_change_nothing() {
    use std::io::Write;
    let bed = Bed::new();
    write_file(&bed.path("f"), 1, 1000);
    let d = bed.start(&[]);
    // A frame announcing 100 MiB: an error naming the request limit, and nothing is
    // allocated for it (the daemon skips it; tests/tests/trust/stalls.rs goes on).
    let mut sock = std::os::unix::net::UnixStream::connect(&bed.socket).unwrap();
    sock.write_all(&(100u32 << 20).to_le_bytes()).unwrap();
    let mut reader = shardcache_proto::wire::FrameReader::new();
    let (resp, _) = reader.recv::<pb::Response>(&sock).expect("an error reply");
    assert!(
        matches!(&resp.kind, Some(pb::response::Kind::Error(e)) if e.message.contains("1 MiB")),
        "{resp:?}"
    );
    drop(sock);
    // Garbage that is not a request.
    let mut sock = std::os::unix::net::UnixStream::connect(&bed.socket).unwrap();
    sock.write_all(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff])
        .unwrap();
    assert!(
        shardcache_proto::wire::FrameReader::new()
            .recv::<pb::Response>(&sock)
            .is_err()
    );
    // An overlong path is refused with a reason.
    let long = format!("{}/{}", bed.backing.display(), "x/".repeat(3000));
    match raw_open(&bed, &long).0 {
        pb::open_reply::Result::Refused(r) => assert_eq!(r.reason(), pb::Reason::Invalid),
        other => panic!("not refused: {other:?}"),
    }
    // An OpenMany of more than 64 paths is an error, not a partial answer.
    let sock = std::os::unix::net::UnixStream::connect(&bed.socket).unwrap();
    let paths = vec![bed.path("f").to_str().unwrap().to_owned(); 65];
    let req = pb::Request {
        id: 9,
        report: None,
        kind: Some(pb::request::Kind::OpenMany(pb::OpenManyRequest { paths })),
    };
    shardcache_proto::wire::send(&sock, &req, &[]).unwrap();
    let (resp, fds): (pb::Response, _) = shardcache_proto::wire::FrameReader::new()
        .recv(&sock)
        .unwrap();
    assert!(
        matches!(resp.kind, Some(pb::response::Kind::Error(_))),
        "{resp:?}"
    );
    assert!(fds.is_empty());
    // The daemon is still serving, and nothing was cached by any of this.
    assert_eq!(
        read_all(&bed.client(), &bed.path("f")).unwrap().0,
        content(1, 1000)
    );
    assert_eq!(
        d.counters().opens,
        2,
        "the refused long path and the good read"
    );
}

#[test]
fn concurrent_readers_never_see_torn_or_mixed_versions() {
    // Eight readers read whole files while a writer replaces them (new content, same
    // size) and the daemon is restarted and killed. Every whole read must equal one
    // complete version of its file: never a mix, never a partial block.
    let bed = Bed::new();
    let size = 3 * MIB + 123;
    let versions = 6u64;
    for f in 0..3u64 {
        write_file(&bed.path(&format!("f{f}")), f * 100, size);
    }
    let mut d = bed.start(&["--block-size", "1MiB", "--metadata-ttl", "0"]);
    let sums: Arc<Vec<Vec<u64>>> = Arc::new(
        (0..3u64)
            .map(|f| {
                (0..versions)
                    .map(|v| xxhash_rust::xxh3::xxh3_64(&content(f * 100 + v, size)))
                    .collect()
            })
            .collect(),
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..8)
        .map(|t| {
            let (client, sums, stop, bed_paths) = (
                bed.client(),
                sums.clone(),
                stop.clone(),
                (0..3)
                    .map(|f| bed.path(&format!("f{f}")))
                    .collect::<Vec<_>>(),
            );
            std::thread::spawn(move || {
                let mut reads = 0;
                let deadline = Instant::now() + Duration::from_secs(60);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline
                {
                    let f = (t + reads) % 3;
                    let (got, _) = match read_all(&client, &bed_paths[f]) {
                        Ok(x) => x,
                        // The file changed under a reader that had served cached bytes.
                        Err(e) if e.raw_os_error() == Some(libc::ESTALE) => continue,
                        Err(e) => panic!("read failed: {e}"),
                    };
                    let sum = xxhash_rust::xxh3::xxh3_64(&got);
                    assert!(
                        sums[f].contains(&sum),
                        "f{f}: bytes match no version (len {})",
                        got.len()
                    );
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    for v in 1..versions {
        for f in 0..3u64 {
            let tmp = bed.path(&format!("f{f}.tmp"));
            write_file(&tmp, f * 100 + v, size);
            std::fs::rename(&tmp, bed.path(&format!("f{f}"))).unwrap();
        }
        match v {
            2 => {
                assert!(d.stop());
                d.restart();
            }
            4 => {
                d.kill9();
                d.restart();
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let total: usize = readers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(total >= 8, "readers made progress ({total})");
}

/// `Reader::local_copy` (what the preload shim hands a program): a descriptor holding
/// every byte, after the daemon fetched what was missing; none without a daemon.
#[test]
fn local_copy_holds_the_whole_file_or_is_none() {
    use std::io::Read;
    let bed = Bed::new();
    let len = 5 * 64 * 1024 + 17;
    write_file(&bed.path("ds/f"), 7, len);
    let mut d = bed.start(&["--block-size", "64KiB", "--readahead-blocks", "0"]);
    let client = bed.client();
    let r = client.open(bed.path("ds/f")).unwrap();
    let mut f = r.local_copy().expect("a local copy");
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert!(got == content(7, len), "every byte, right");
    assert!(d.counters().opens_empty >= 1, "it was cold");
    d.stop();
    let r = bed.client().open(bed.path("ds/f")).unwrap();
    assert!(r.local_copy().is_none(), "no daemon, no local copy");
}
