//! Trust suite: one hung backing root (issue 12, point 6).
//!
//! Two backing roots, one of them a FUSE passthrough (`tests/fuse/hangfs.py`) whose
//! server the test SIGSTOPs, as a hung network file system would hang: reads of the
//! other root must cost nothing more, and the hung root's own requests must be answered
//! (refused or declined, so that the client reads the backing store itself) within about
//! the client's `timeout`. FUSE needs root, `/dev/fuse`, and Debian's `fuse3` and
//! `python3-fusepy`, which `scripts/fuse-deps.sh` installs; without root or `/dev/fuse`
//! the test says so loudly and skips.
//!
//! Everything the test starts is stopped by pid, and the mount is released and unmounted
//! by a drop guard even when an assertion fails. Every wait is bounded; the whole test
//! takes well under a minute.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use shardcache_client::{Client, ClientConfig, proto as pb};
use shardcache_proto::wire;
use shardcache_tests::{Bed, content, read_all, write_file};

/// Block size the daemon runs with here (small files, many blocks).
const BS: u64 = 64 << 10;
/// The bound the issue asks for is the client's `timeout` (1 s by default); this is the
/// generous form a shared, noisy machine cannot break.
const BOUND: Duration = Duration::from_secs(3);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

/// `Some(why)` when FUSE cannot be used here at all (the test then skips, loudly).
/// Installs the Debian packages when they are missing; a failed install fails the test.
fn fuse_unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root: mounting a FUSE file system needs root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse on this machine".into());
    }
    let out = Command::new("bash")
        .arg(repo().join("scripts/fuse-deps.sh"))
        .stdin(Stdio::null())
        .output()
        .expect("running scripts/fuse-deps.sh");
    assert!(
        out.status.success(),
        "scripts/fuse-deps.sh could not install fuse3 and python3-fusepy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    None
}

/// Runs a short command, bounded by `limit` (killed past it); true when it succeeded.
fn run_bounded(cmd: &mut Command, limit: Duration) -> bool {
    let Ok(mut c) = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn() else {
        return false;
    };
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(st)) = c.try_wait() {
            return st.success();
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a child we spawned and have not reaped.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// The FUSE passthrough of `src` at `mnt`. Dropping it releases the server (SIGCONT),
/// unmounts (`fusermount3 -u`, then lazily) and kills it by pid.
struct HangFs {
    child: Child,
    mnt: PathBuf,
    log: PathBuf,
}

impl HangFs {
    fn mount(src: &Path, mnt: &Path, log: PathBuf) -> Self {
        let out = std::fs::File::create(&log).expect("fuse log");
        let child = Command::new("/usr/bin/python3")
            .arg(repo().join("tests/fuse/hangfs.py"))
            .arg(src)
            .arg(mnt)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("starting tests/fuse/hangfs.py");
        let mut fs = Self {
            child,
            mnt: mnt.to_owned(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while !fs.mounted() {
            if let Ok(Some(st)) = fs.child.try_wait() {
                panic!(
                    "hangfs.py exited ({st}) before mounting: {}",
                    std::fs::read_to_string(&fs.log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "hangfs.py not mounted after 15 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        fs
    }

    fn mounted(&self) -> bool {
        let want = format!(" {} ", self.mnt.display());
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains(&want) && l.contains(" - fuse"))
    }

    /// Hangs every call into the mount (the server stops answering). Returns once every
    /// thread of the server is stopped: `kill` returns before a busy process has taken
    /// the signal, and a request sent in that moment would still be answered (under
    /// load this made an open of a never-opened file succeed "while hung").
    fn hang(&self) {
        let pid = self.child.id();
        signal(pid as i32, libc::SIGSTOP);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_threads_stopped(pid) {
            assert!(
                Instant::now() < deadline,
                "the FUSE server (pid {pid}) did not stop within 10 s of SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Lets the server answer again.
    fn release(&self) {
        signal(self.child.id() as i32, libc::SIGCONT);
    }
}

/// True when every thread of `pid` is in the stopped state (`T` in its `stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|st| {
            // The state follows the command name, which is in parentheses.
            st.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    })
}

impl Drop for HangFs {
    fn drop(&mut self) {
        self.release();
        let limit = Duration::from_secs(5);
        if !run_bounded(Command::new("fusermount3").arg("-u").arg(&self.mnt), limit) {
            run_bounded(Command::new("fusermount3").arg("-uz").arg(&self.mnt), limit);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request on a fresh connection: the reply (`None` when none came within
/// `limit`) and how long it took.
fn raw_call(
    socket: &Path,
    kind: pb::request::Kind,
    limit: Duration,
) -> (Option<pb::response::Kind>, Duration) {
    let sock = UnixStream::connect(socket).expect("connect");
    sock.set_read_timeout(Some(limit)).expect("timeout");
    let req = pb::Request {
        id: 1,
        report: None,
        kind: Some(kind),
    };
    let t = Instant::now();
    wire::send(&sock, &req, &[]).expect("send");
    let reply = wire::FrameReader::new()
        .recv::<pb::Response>(&sock)
        .ok()
        .and_then(|(r, _)| r.kind);
    (reply, t.elapsed())
}

fn raw_open(socket: &Path, path: &Path, limit: Duration) -> (pb::open_reply::Result, Duration) {
    let kind = pb::request::Kind::Open(pb::OpenRequest {
        path: path.to_str().expect("utf-8").into(),
    });
    match raw_call(socket, kind, limit) {
        (Some(pb::response::Kind::Open(pb::OpenReply { result: Some(r) })), t) => (r, t),
        (other, t) => panic!(
            "open {}: no answer within {limit:?} ({t:?}): {other:?}",
            path.display()
        ),
    }
}

/// A client with the default timeouts (open 1 s, wait 10 s, retry after 2 s): those are
/// the bounds the issue speaks of.
fn default_client(socket: &Path) -> Client {
    Client::with_config(ClientConfig {
        socket: socket.to_owned(),
        ..ClientConfig::default()
    })
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn percentile(v: &[Duration], q: f64) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// Joins `h`, waiting at most until `deadline` (a thread still blocked past it is left
/// behind, and `None` returned).
fn join_by<T>(h: JoinHandle<T>, deadline: Instant) -> Option<T> {
    while !h.is_finished() {
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    h.join().ok()
}

#[test]
fn a_hung_backing_root_costs_other_roots_nothing_and_its_own_reads_fall_back_at_once() {
    let name = "a_hung_backing_root_costs_other_roots_nothing_and_its_own_reads_fall_back_at_once";
    if let Some(why) = fuse_unavailable() {
        eprintln!("SKIPPED {name}: {why}");
        return;
    }
    let started = Instant::now();
    let bed = Bed::new();
    let src = bed.tmp.path().join("fuse-src");
    let mnt = bed.tmp.path().join("fuse-mnt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let mnt = mnt.canonicalize().unwrap();
    // The hung root: 32-block files; the healthy root: 4-block files.
    const HUNG: u64 = 16;
    const HEALTHY: u64 = 32;
    for i in 0..HUNG {
        write_file(&src.join(format!("h{i}.bin")), 100 + i, 32 * BS);
    }
    for i in 0..HEALTHY {
        write_file(&bed.path(&format!("g{i}.bin")), i, 4 * BS);
    }
    // Declared before the mount, so dropped after it: a daemon thread blocked in a FUSE
    // flush cannot be killed until the server answers, so the guard releases the server
    // before the daemon is killed.
    let mut d;
    let fs = HangFs::mount(&src, &mnt, bed.tmp.path().join("hangfs.log"));
    let hung = |i: u64| mnt.join(format!("h{i}.bin"));
    // Metadata trusted for a minute: files opened before the hang are then opened from
    // the metadata cache while it lasts, and their missing blocks go to fill workers.
    d = bed.start(&[
        "--backing-root",
        mnt.to_str().unwrap(),
        "--block-size",
        "64KiB",
        "--metadata-ttl",
        "60s",
    ]);
    let socket = bed.socket.clone();

    // Both roots serve through the cache.
    let client = default_client(&socket);
    let (v, st) = read_all(&client, &hung(HUNG - 1)).unwrap();
    assert_eq!(v, content(100 + HUNG - 1, 32 * BS));
    assert_eq!(st.fallback_bytes, 0, "the FUSE root is served: {st:?}");
    // Files 0..8 of the hung root are opened (metadata cached, read-ahead filled) now.
    let mut versions = Vec::new();
    for i in 0..8 {
        match raw_open(&socket, &hung(i), BOUND).0 {
            pb::open_reply::Result::Opened(o) => versions.push(o.version),
            other => panic!("open of {} refused: {other:?}", hung(i).display()),
        }
    }

    fs.hang();
    eprintln!("FUSE server of {} stopped", mnt.display());

    // Readers of the hung root, as the daemon sees them: waits for blocks past the
    // read-ahead of files opened before the hang (their fills reach the hung store),
    // and opens of files never opened (their stat does). Each is timed to its answer.
    let mut asks: Vec<JoinHandle<(String, Duration, bool)>> = Vec::new();
    for (i, version) in versions.iter().enumerate() {
        let (socket, path, version) = (socket.clone(), hung(i as u64), *version);
        asks.push(std::thread::spawn(move || {
            let kind = pb::request::Kind::Wait(pb::WaitRequest {
                path: path.to_str().unwrap().into(),
                version,
                first_block: 24,
                count: 8,
                have_data_gen: 0,
                timeout_ms: 10_000,
                ..Default::default()
            });
            let (r, t) = raw_call(&socket, kind, Duration::from_secs(15));
            let fell_back = match r {
                Some(pb::response::Kind::Wait(pb::WaitReply {
                    result: Some(pb::wait_reply::Result::Waited(w)),
                })) => w.declined || (24..32).any(|b| w.present[b / 8] & (1 << (b % 8)) == 0),
                Some(pb::response::Kind::Wait(pb::WaitReply {
                    result: Some(pb::wait_reply::Result::Refused(_)),
                })) => true,
                _ => false,
            };
            (format!("wait {}", path.display()), t, fell_back)
        }));
    }
    for i in 8..12 {
        let (socket, path) = (socket.clone(), hung(i));
        asks.push(std::thread::spawn(move || {
            let kind = pb::request::Kind::Open(pb::OpenRequest {
                path: path.to_str().unwrap().into(),
            });
            let (r, t) = raw_call(&socket, kind, Duration::from_secs(15));
            let refused = matches!(
                r,
                Some(pb::response::Kind::Open(pb::OpenReply {
                    result: Some(pb::open_reply::Result::Refused(_))
                }))
            );
            (format!("open {}", path.display()), t, refused)
        }));
    }
    // And readers of the hung root through the same client as the healthy reads: their
    // reads fall back to the hung store itself and block in the kernel until the
    // server runs again (what they would do without the cache).
    let mut blocked: Vec<JoinHandle<bool>> = Vec::new();
    for i in 12..14 {
        let (client, path) = (client.clone(), hung(i));
        blocked.push(std::thread::spawn(move || {
            read_all(&client, &path).is_ok_and(|(v, _)| v == content(100 + i, 32 * BS))
        }));
    }

    // Meanwhile the healthy root, through the same client: every open and read is timed
    // (on a thread of its own, so that reads blocked before the fix cannot hold the test).
    let stop = Arc::new(AtomicBool::new(false));
    let reads = {
        let (client, stop, healthy) = (client.clone(), stop.clone(), bed.backing.clone());
        std::thread::spawn(move || -> Result<(Vec<Duration>, Option<String>), String> {
            let mut times = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut i = 0;
            while (i < 2 * HEALTHY || !stop.load(Ordering::Acquire)) && Instant::now() < deadline {
                let f = i % HEALTHY;
                let path = healthy.join(format!("g{f}.bin"));
                let t = Instant::now();
                let (v, st) = read_all(&client, &path).map_err(|e| format!("{e}"))?;
                let took = t.elapsed();
                if v != content(f, 4 * BS) {
                    return Err(format!("wrong bytes from {}", path.display()));
                }
                times.push(took);
                if took > BOUND || st.fallback_bytes > 0 {
                    let slow = format!(
                        "healthy-root read of {} took {:.1} s (fallback bytes {}) while another root hangs",
                        path.display(),
                        secs(took),
                        st.fallback_bytes
                    );
                    return Ok((times, Some(slow)));
                }
                if i >= HEALTHY && st.hit_bytes != 4 * BS {
                    return Err(format!(
                        "a second read of {} does not come from the cache: {st:?}",
                        path.display()
                    ));
                }
                i += 1;
            }
            Ok((times, None))
        })
    };
    let answers: Vec<_> = asks
        .into_iter()
        .map(|h| join_by(h, Instant::now() + Duration::from_secs(20)).expect("bounded"))
        .collect();
    stop.store(true, Ordering::Release);
    let (times, slow) = join_by(reads, Instant::now() + Duration::from_secs(30))
        .expect("healthy-root reads blocked for more than 30 s while another root hangs")
        .unwrap_or_else(|e| panic!("healthy-root reads: {e}"));
    let (p50, max) = (percentile(&times, 0.5), percentile(&times, 1.0));
    eprintln!(
        "healthy root while the other hangs: {} reads (open + whole file), p50 {:.4} s, max {:.4} s",
        times.len(),
        secs(p50),
        secs(max)
    );
    for (what, t, fell_back) in &answers {
        eprintln!(
            "hung root: {what}: answered in {:.3} s (fall back: {fell_back})",
            secs(*t)
        );
    }
    if let Some(slow) = slow {
        panic!("{slow}");
    }
    for (what, t, fell_back) in &answers {
        assert!(
            *t < BOUND && *fell_back,
            "hung root: {what}: answered in {:.1} s (fall back: {fell_back}); the bound is about the client's timeout (1 s)",
            secs(*t)
        );
    }

    // The server runs again: the blocked readers finish with the right bytes, and the
    // root serves through the cache again.
    fs.release();
    eprintln!("FUSE server released");
    for h in blocked {
        let ok = join_by(h, Instant::now() + Duration::from_secs(20));
        assert_eq!(
            ok,
            Some(true),
            "a hung-root reader got its bytes after the release"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let fresh = default_client(&socket);
    loop {
        let (v, st) = read_all(&fresh, &hung(14)).unwrap();
        assert_eq!(v, content(114, 32 * BS));
        if st.fallback_bytes == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the released root does not serve through the cache again: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, st) = read_all(&fresh, &hung(14)).unwrap();
    assert_eq!(st.hit_bytes, 32 * BS, "recovered: {st:?}");
    let c = d.counters();
    eprintln!(
        "counters: opens {} refused_other {} wait_timeouts {} fill_errors {}",
        c.opens, c.refused_other, c.wait_timeouts, c.fill_errors
    );

    // Shutdown does not hang on a fill stuck in the hung store: the daemon finishes its
    // orderly shutdown (the process itself can only be reaped once the kernel lets go of
    // the stuck thread, which for a FUSE request already read by the server is when the
    // server answers).
    fs.hang();
    let kind = pb::request::Kind::Wait(pb::WaitRequest {
        path: hung(0).to_str().unwrap().into(),
        version: versions[0],
        first_block: 16,
        count: 8,
        have_data_gen: 0,
        timeout_ms: 500,
        ..Default::default()
    });
    let (_, t) = raw_call(&socket, kind, Duration::from_secs(15));
    eprintln!(
        "a fill stuck in the hung store (wait answered in {:.3} s)",
        secs(t)
    );
    let t = Instant::now();
    d.signal(libc::SIGTERM);
    while !d.log_text().contains("shardcached stopped") {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no orderly shutdown within 15 s with a fill stuck in a hung store; log:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "orderly shutdown with a fill stuck: {:.2} s",
        secs(t.elapsed())
    );
    fs.release();
    d.stop();
    drop(fs);
    eprintln!("{name}: {:.1} s in all", secs(started.elapsed()));
}
