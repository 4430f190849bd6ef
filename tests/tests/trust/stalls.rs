//! Trust suite: stalls and limits (see main.rs; issue 12, points 5 and 9).
//!
//! A daemon that stops answering costs a reader at most the client's `timeout`, on an
//! open and inside a file alike, while a slow but live fill still gets its whole
//! `wait_timeout` (docs/SEMANTICS.md, section 2). Every documented limit is the real one,
//! end to end, and anything over a limit gets an error that names it (section 4).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use shardcache_client::{Client, ClientConfig, Source, proto as pb};
use shardcache_proto::local::v1::{request, response};
use shardcache_proto::wire::{self, FrameReader};
use shardcache_tests::{Bed, bin, content, write_file};

const MIB: u64 = 1 << 20;

/// A client with the library's default bounds (not the test harness's long ones), so
/// that what is measured is what a job gets.
fn default_client(bed: &Bed) -> Client {
    Client::with_config(default_config(bed))
}

fn default_config(bed: &Bed) -> ClientConfig {
    ClientConfig {
        socket: bed.socket.clone(),
        timeout: Duration::from_secs(1),
        wait_timeout: Duration::from_secs(10),
        retry_after: Duration::from_secs(2),
        pool: 4,
        ..ClientConfig::default()
    }
}

fn cli(socket: &Path, args: &[&str]) -> Output {
    Command::new(bin("shardcache"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env_remove("SHARDCACHE_SOCKET")
        .output()
        .expect("run shardcache")
}

/// Polls `cond` every 10 ms for at most `limit`; true when it held.
fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// One request on a raw connection, with `fds` attached; the reply (bounded wait).
fn raw_call(sock: &UnixStream, reader: &mut FrameReader, kind: request::Kind) -> pb::Response {
    raw_call_fds(sock, reader, kind, &[])
}

fn raw_call_fds(
    sock: &UnixStream,
    reader: &mut FrameReader,
    kind: request::Kind,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> pb::Response {
    let req = pb::Request {
        id: 77,
        report: None,
        kind: Some(kind),
    };
    wire::send(sock, &req, fds).expect("send");
    let (resp, _): (pb::Response, _) = reader.recv(sock).expect("a reply");
    resp
}

fn error_message(resp: &pb::Response) -> String {
    match &resp.kind {
        Some(response::Kind::Error(e)) => e.message.clone(),
        other => panic!("expected an ErrorReply, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Point 5: a hung daemon costs a reader at most `timeout`, even inside a wait.

#[test]
fn a_reader_waiting_on_a_fill_falls_back_within_timeout_when_the_daemon_hangs() {
    let bed = Bed::new();
    let p = bed.path("slow.bin");
    let len = 4 * MIB;
    write_file(&p, 51, len);
    // One 4 MiB block through a 256 KiB/s backing: the fill needs ~12 s, so the reader
    // is still waiting for it when the daemon is stopped.
    let mut d = bed.start(&[
        "--block-size",
        "4MiB",
        "--backing-bandwidth",
        "256KiB",
        "--readahead-blocks",
        "0",
    ]);
    let client = default_client(&bed);
    let r = client.open(&p).unwrap();
    assert_eq!(r.source(), Source::Cache, "the daemon serves the open");
    let waits_before = d.counters().waits;
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; len as usize];
        let mut got = 0;
        while got < buf.len() {
            let n = r.read_at(&mut buf[got..], got as u64).unwrap();
            assert!(n > 0, "early end of file");
            got += n;
        }
        (buf, r.stats(), r.fallback_reason())
    });
    // Stop the daemon once the reader is inside its wait.
    assert!(
        eventually(Duration::from_secs(10), || d.counters().waits
            > waits_before),
        "the reader never asked the daemon to wait"
    );
    d.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    // Bounded: the reader returns within wait_timeout + timeout even before the fix.
    let (got, stats, why) = reader.join().unwrap();
    let took = stopped.elapsed();
    d.signal(libc::SIGCONT);
    d.stop();
    println!(
        "stalled {:.2} s after the daemon stopped (timeout 1 s, wait_timeout 10 s); reason: {why:?}",
        took.as_secs_f64()
    );
    assert_eq!(got, content(51, len), "the backing store's bytes");
    assert_eq!(stats.fallback_bytes, len, "read from the backing store");
    assert!(
        took < Duration::from_secs(3),
        "a hung daemon stalled the reader {:.2} s inside a read (bound: timeout = 1 s)",
        took.as_secs_f64()
    );
    let why = why.unwrap_or_default();
    assert!(
        why.contains("did not answer in time") || why.contains("timed out"),
        "the reason is the daemon's timeout, not the wait's: {why}"
    );
}

#[test]
fn a_slow_but_live_fill_is_waited_for_not_fallen_back_from() {
    let bed = Bed::new();
    let p = bed.path("slow.bin");
    let len = 4 * MIB;
    write_file(&p, 52, len);
    // One 4 MiB block through 1 MiB/s (1 MiB burst): the fill needs ~3 s, three times
    // the client's `timeout`, well inside its `wait_timeout`.
    let d = bed.start(&[
        "--block-size",
        "4MiB",
        "--backing-bandwidth",
        "1MiB",
        "--readahead-blocks",
        "0",
    ]);
    let client = default_client(&bed);
    let started = Instant::now();
    let mut r = client.open(&p).unwrap();
    let mut got = Vec::new();
    r.read_to_end(&mut got).unwrap();
    let took = started.elapsed();
    println!(
        "a ~3 s fill waited for in {:.2} s; stats {:?}",
        took.as_secs_f64(),
        r.stats()
    );
    assert_eq!(got, content(52, len));
    assert_eq!(r.source(), Source::Cache);
    let st = r.stats();
    assert_eq!(
        st.hit_bytes + st.filled_bytes,
        len,
        "every byte came from the cache"
    );
    assert!(
        st.filled_bytes > 0 && st.filled_reads == 1,
        "after one wait: {st:?}"
    );
    assert_eq!(st.fallback_bytes, 0, "{:?}", r.fallback_reason());
    assert_eq!(
        d.counters().wait_timeouts,
        0,
        "no slice counts as a wait timeout"
    );
}

#[test]
fn a_fill_slower_than_wait_timeout_falls_back_once_with_the_wait_timeout_reason() {
    let bed = Bed::new();
    let p = bed.path("slow.bin");
    let len = 4 * MIB;
    write_file(&p, 55, len);
    // A ~3 s fill against a 1.5 s wait_timeout: the reader waits slice after slice for
    // its whole wait_timeout, then reads the backing store.
    let d = bed.start(&[
        "--block-size",
        "4MiB",
        "--backing-bandwidth",
        "1MiB",
        "--readahead-blocks",
        "0",
    ]);
    let client = Client::with_config(ClientConfig {
        wait_timeout: Duration::from_millis(1500),
        ..default_config(&bed)
    });
    let before = d.counters();
    let r = client.open(&p).unwrap();
    let mut buf = vec![0u8; len as usize];
    let started = Instant::now();
    let n = r.read_at(&mut buf, 0).unwrap();
    let took = started.elapsed();
    println!(
        "fell back after {:.2} s (wait_timeout 1.5 s): {:?}",
        took.as_secs_f64(),
        r.fallback_reason()
    );
    assert_eq!(n, len as usize);
    assert_eq!(buf, content(55, len));
    assert_eq!(r.stats().fallback_bytes, len);
    let why = r.fallback_reason().unwrap_or_default();
    assert!(
        why.contains("wait_timeout"),
        "the wait's own timeout: {why}"
    );
    assert!(
        took >= Duration::from_millis(1400),
        "waited its whole wait_timeout"
    );
    let after = d.counters();
    assert_eq!(
        (
            after.waits - before.waits,
            after.wait_timeouts - before.wait_timeouts
        ),
        (1, 1),
        "one wait and one wait timeout, however many slices"
    );
}

// ---------------------------------------------------------------------------------------
// Point 9: the documented limits are the real ones, and every refusal names its limit.

/// A manifest of `n` files (they need not exist: registering does not open them).
fn big_manifest(job: &str, root: &Path, n: usize) -> String {
    let mut s = String::with_capacity(n * 24 + 512);
    s.push_str(&format!(
        r#"{{"version": 1, "job": "{job}", "root": "{}", "files": ["#,
        root.display()
    ));
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!("\"shard/f{i:07}.tar\""));
    }
    s.push_str(
        r#"], "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 1, "epochs": 1, "world_size": 1, "ranks": [0]}}"#,
    );
    s
}

#[test]
fn a_million_file_manifest_registers_through_the_client_and_the_cli() {
    let bed = Bed::new();
    let d = bed.start(&["--prefetch-ahead", "0"]);
    let json = big_manifest("million", &bed.backing, 1_000_000);
    println!("manifest: {} bytes", json.len());
    assert!(json.len() > 16 << 20, "bigger than one frame");
    let client = default_client(&bed);
    let started = Instant::now();
    let r = client
        .register(&json)
        .expect("a 10^6-file manifest registers");
    println!(
        "registered through the client in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!((r.job.as_str(), r.files), ("million", 1_000_000));
    // (Unregistering and a status over a 10^6-file job take seconds in a debug build.)
    let admin = Client::with_config(ClientConfig {
        timeout: Duration::from_secs(120),
        ..default_config(&bed)
    });
    assert!(admin.unregister("million").unwrap());

    let file = bed.tmp.path().join("million.json");
    std::fs::write(&file, &json).unwrap();
    let started = Instant::now();
    let out = cli(&bed.socket, &["prefetch", file.to_str().unwrap()]);
    println!(
        "registered through the CLI in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("registered job million (1000000 files)"),
        "{stdout}"
    );
    let started = Instant::now();
    let jobs = admin.status().unwrap().jobs;
    println!(
        "status with the job in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(jobs.len(), 1);
    assert!(admin.unregister("million").unwrap());
    drop(d);
}

#[test]
fn a_manifest_over_64_mib_is_refused_naming_the_limit() {
    let bed = Bed::new();
    let d = bed.start(&[]);
    // A valid manifest padded with whitespace past 64 MiB.
    let mut json = big_manifest("huge", &bed.backing, 1);
    json.push_str(&" ".repeat((64 << 20) + 1 - json.len() + 16));
    let client = default_client(&bed);
    let e = client.register(&json).unwrap_err();
    println!("client: {e}");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("64 MiB"), "names the limit: {e}");

    let file = bed.tmp.path().join("huge.json");
    std::fs::write(&file, &json).unwrap();
    let out = cli(&bed.socket, &["prefetch", file.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("cli: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("64 MiB"), "names the limit: {stderr}");
    assert!(!stderr.contains("is the daemon running"), "{stderr}");

    // A client that passes the descriptor itself, past the client's own check: the
    // daemon reads no more than the limit and says so.
    let memfd = rustix::fs::memfd_create("manifest", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut f = std::fs::File::from(memfd);
    f.write_all(json.as_bytes()).unwrap();
    let sock = UnixStream::connect(&bed.socket).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reader = FrameReader::new();
    let resp = raw_call_fds(
        &sock,
        &mut reader,
        request::Kind::Register(pb::RegisterRequest {
            manifest_fd: true,
            ..Default::default()
        }),
        &[f.as_fd()],
    );
    let msg = error_message(&resp);
    println!("daemon: {msg}");
    assert!(msg.contains("64 MiB"), "{msg}");
    assert!(d.status().jobs.is_empty(), "nothing registered");
}

#[test]
fn an_oversized_frame_gets_an_error_reply_naming_the_limit_and_the_connection_goes_on() {
    let bed = Bed::new();
    let _d = bed.start(&[]);
    let mut sock = UnixStream::connect(&bed.socket).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    sock.set_write_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // A 2 MiB request: over the 1 MiB request limit.
    let body = vec![0u8; 2 << 20];
    sock.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    sock.write_all(&body).unwrap();
    let mut reader = FrameReader::new();
    let (resp, _): (pb::Response, _) = reader
        .recv(&sock)
        .expect("an error reply, not a closed connection");
    let msg = error_message(&resp);
    println!("daemon: {msg}");
    assert!(msg.contains("1 MiB"), "names the request limit: {msg}");
    // The frame was skipped whole: the next request on the connection is served.
    let resp = raw_call(
        &sock,
        &mut reader,
        request::Kind::Status(pb::StatusRequest {}),
    );
    assert!(
        matches!(resp.kind, Some(response::Kind::Status(_))),
        "{resp:?}"
    );

    // The other per-request limits answer on the same connection, each naming its limit.
    let paths: Vec<String> = (0..65)
        .map(|i| bed.path(&format!("f{i}")).display().to_string())
        .collect();
    let resp = raw_call(
        &sock,
        &mut reader,
        request::Kind::OpenMany(pb::OpenManyRequest { paths }),
    );
    assert!(error_message(&resp).contains("64"), "{resp:?}");
    write_file(&bed.path("w.bin"), 1, 4096);
    let st = std::fs::metadata(bed.path("w.bin")).unwrap();
    let resp = raw_call(
        &sock,
        &mut reader,
        request::Kind::Open(pb::OpenRequest {
            path: bed.path("w.bin").display().to_string(),
        }),
    );
    let Some(response::Kind::Open(pb::OpenReply {
        result: Some(pb::open_reply::Result::Opened(o)),
    })) = resp.kind
    else {
        panic!("open: {resp:?}");
    };
    assert_eq!(o.version.unwrap().size, st.len());
    let resp = raw_call(
        &sock,
        &mut reader,
        request::Kind::Wait(pb::WaitRequest {
            path: bed.path("w.bin").display().to_string(),
            version: o.version,
            first_block: 0,
            count: 1025,
            timeout_ms: 100,
            ..Default::default()
        }),
    );
    match resp.kind {
        Some(response::Kind::Wait(pb::WaitReply {
            result: Some(pb::wait_reply::Result::Refused(r)),
        })) => assert!(r.message.contains("1024"), "{r:?}"),
        other => panic!("a wait over 1024 blocks is refused, got {other:?}"),
    }
}

#[test]
fn a_wait_for_a_block_past_the_1024th_is_filled() {
    let bed = Bed::new();
    let p = bed.path("many-blocks.bin");
    let bs = 4096u64;
    let len = 1100 * bs;
    write_file(&p, 53, len);
    let _d = bed.start(&["--block-size", "4KiB", "--readahead-blocks", "0"]);
    let client = default_client(&bed);
    let r = client.open(&p).unwrap();
    let mut buf = vec![0u8; bs as usize];
    let n = r.read_at(&mut buf, 1050 * bs).unwrap();
    assert_eq!(n, bs as usize);
    assert_eq!(
        buf,
        content(53, len)[(1050 * bs) as usize..(1051 * bs) as usize]
    );
    let st = r.stats();
    assert_eq!(
        (st.filled_bytes, st.fallback_bytes),
        (bs, 0),
        "block 1050 came from the cache: {:?}",
        r.fallback_reason()
    );
}

#[test]
fn an_over_long_path_does_not_cut_the_client_off_the_daemon() {
    let bed = Bed::new();
    let p = bed.path("ok.bin");
    write_file(&p, 54, 4096);
    let _d = bed.start(&[]);
    let client = Client::with_config(ClientConfig {
        retry_after: Duration::from_secs(60),
        ..default_config(&bed)
    });
    for len in [4097, 2 << 20] {
        let long = format!("{}/{}", bed.backing.display(), "x/".repeat(len / 2));
        let e = client.open(&long).unwrap_err();
        println!("{len}-byte path: {e}");
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ENAMETOOLONG),
            "the kernel's own error: {e}"
        );
        let r = client.open(&p).unwrap();
        assert_eq!(
            r.source(),
            Source::Cache,
            "after a {len}-byte path the daemon still serves: {:?}",
            r.fallback_reason()
        );
        // In a batch, the long path is read directly and the others still come from
        // the cache.
        let mut rs = client.open_many(&[Path::new(&long), &p]).into_iter();
        let e = rs.next().unwrap().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENAMETOOLONG), "{e}");
        let r = rs.next().unwrap().unwrap();
        assert_eq!(r.source(), Source::Cache, "{:?}", r.fallback_reason());
    }
}

#[test]
fn a_listing_over_the_frame_limit_comes_in_pages_that_fit() {
    let bed = Bed::new();
    // 5 000 files whose absolute paths are ~4 000 bytes: 20 MB of names, over the
    // 16 MiB reply limit in one page of 10 000.
    let mut dir = bed.backing.clone();
    while dir.as_os_str().len() < 3600 {
        dir.push("d".repeat(200));
    }
    std::fs::create_dir_all(&dir).unwrap();
    let n = 5000;
    for i in 0..n {
        std::fs::File::create(dir.join(format!("{i:05}{}", "n".repeat(240)))).unwrap();
    }
    let _d = bed.start(&[]);
    let client = bed.client();
    let mut req = shardcache_client::ListQuery {
        target: shardcache_client::ListTarget::Path(dir.display().to_string()),
        limit: 10_000,
        offset: 0,
    };
    let mut seen = 0u64;
    let mut pages = 0;
    while pages < 100 {
        let r = client
            .list(req.clone(), Duration::from_secs(60))
            .expect("a page that fits, not a closed connection");
        pages += 1;
        assert_eq!(r.total, n);
        let got = r.files.len() as u64 + r.hidden;
        assert!(got > 0, "progress");
        seen += got;
        req.offset += got;
        if req.offset >= r.total {
            break;
        }
    }
    println!("{seen} entries in {pages} pages");
    assert_eq!(seen, n);
    assert!(pages > 1, "split to fit the frame limit");
}
