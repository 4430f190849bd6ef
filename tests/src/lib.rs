//! Harness for end-to-end tests, the demo and the benchmarks: temporary directories,
//! generated data, and the real `shardcached` started as a process and stopped by pid.
//!
//! The binaries come from the same target directory as the test executable
//! (`cargo build --workspace --bins` puts them there; the README's test command does).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shardcache_client::{Client, ClientConfig};

pub mod certs;
pub mod live;
pub mod peerbench;
pub mod placementscale;
pub mod policy;
pub mod restartbench;

/// Path of a workspace binary next to the running executable.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_owned();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: build the binaries first (cargo build --workspace --bins{})",
        p.display(),
        if dir.ends_with("release") {
            " --release"
        } else {
            ""
        }
    );
    p
}

/// Deterministic pseudo-random bytes: the same (seed, offset) always gives the same byte.
pub fn fill_bytes(seed: u64, offset: u64, buf: &mut [u8]) {
    let word = |w: u64| xxhash_rust::xxh3::xxh3_64_with_seed(&w.to_le_bytes(), seed).to_le_bytes();
    let mut i = 0;
    while i < buf.len() {
        let pos = offset + i as u64;
        let w = word(pos / 8);
        let skip = (pos % 8) as usize;
        let n = (8 - skip).min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&w[skip..skip + n]);
        i += n;
    }
}

/// The bytes of a generated file.
pub fn content(seed: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    fill_bytes(seed, 0, &mut v);
    v
}

/// Writes a generated file of `len` bytes (creating parent directories).
pub fn write_file(path: &Path, seed: u64, len: u64) {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    let mut f = File::create(path).expect("create");
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        fill_bytes(seed, off, &mut buf[..n]);
        f.write_all(&buf[..n]).expect("write");
        off += n as u64;
    }
    f.sync_all().expect("sync");
}

/// A test bed: a backing directory, a cache directory and a socket path in one temp dir.
#[derive(Debug)]
pub struct Bed {
    /// Keeps the directory alive.
    pub tmp: tempfile::TempDir,
    /// The backing root (canonical).
    pub backing: PathBuf,
    /// The cache directory.
    pub cache: PathBuf,
    /// The daemon's socket.
    pub socket: PathBuf,
}

impl Bed {
    /// A fresh bed under the system temp directory.
    pub fn new() -> Self {
        Self::new_in(&std::env::temp_dir())
    }

    /// A fresh bed in a new directory under `parent` (made, with its parents, if it is
    /// not there: a benchmark's `--dir` need not exist).
    pub fn new_in(parent: &Path) -> Self {
        std::fs::create_dir_all(parent)
            .unwrap_or_else(|e| panic!("making {}: {e}", parent.display()));
        let tmp = tempfile::Builder::new()
            .prefix("shardcache-test-")
            .tempdir_in(parent)
            .unwrap_or_else(|e| panic!("a temporary directory in {}: {e}", parent.display()));
        // World-searchable, so that tests can run clients as other users.
        std::fs::set_permissions(
            tmp.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        let backing = tmp.path().join("backing");
        let cache = tmp.path().join("cache");
        std::fs::create_dir_all(&backing).expect("mkdir");
        std::fs::create_dir_all(&cache).expect("mkdir");
        let backing = backing.canonicalize().expect("canonicalize");
        let socket = tmp.path().join("shardcached.sock");
        Self {
            tmp,
            backing,
            cache,
            socket,
        }
    }

    /// A path under the backing root.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.backing.join(rel)
    }

    /// Waits (at most 10 s) until every one of `paths` (under the backing root, each at
    /// least one byte long) is cached whole, as the daemon's listing says (its landed
    /// blocks: a data file exists from the start of its landing, before its bytes are
    /// durable and visible): a reader of a small file gets its bytes before they land,
    /// so a read alone does not say they have, and a fill that did not land (declined,
    /// failed) leaves its file uncached until it is read again — which this does for
    /// each file still missing after a second (and every second after), as the next
    /// reader of it would.
    pub fn until_cached(&self, paths: &[PathBuf]) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let client = self.client();
        let whole = |p: &PathBuf| {
            let q = shardcache_client::ListQuery {
                target: shardcache_client::ListTarget::Path(p.display().to_string()),
                limit: 1,
                offset: 0,
            };
            client
                .list(q, Duration::from_secs(5))
                .ok()
                .and_then(|l| l.files.into_iter().next())
                .is_some_and(|f| f.size > 0 && f.resident_bytes == f.size)
        };
        let mut last_read = std::time::Instant::now();
        loop {
            let missing: Vec<&PathBuf> = paths.iter().filter(|p| !whole(p)).collect();
            if missing.is_empty() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} files not cached after 10 s",
                missing.len()
            );
            std::thread::sleep(Duration::from_millis(10));
            // A landing in progress ends on its own; a file still missing after a
            // second did not land, and is read again (once a second at most).
            if last_read.elapsed() >= Duration::from_secs(1) {
                for p in missing {
                    read_all(&client, p).expect("read again");
                }
                last_read = std::time::Instant::now();
            }
        }
    }

    /// Starts the daemon on this bed with extra flags.
    pub fn start(&self, extra: &[&str]) -> Daemon {
        Daemon::start(self, &self.cache, &self.socket, "daemon.log", extra)
    }

    /// Starts daemon number `node` of several sharing this bed's backing root (another
    /// node of a cluster): its own cache directory, socket and log.
    pub fn start_node(&self, node: usize, extra: &[&str]) -> Daemon {
        let cache = self.tmp.path().join(format!("cache-{node}"));
        std::fs::create_dir_all(&cache).expect("mkdir");
        let socket = self.node_socket(node);
        Daemon::start(self, &cache, &socket, &format!("daemon-{node}.log"), extra)
    }

    /// Starts daemon number `node` as [`Bed::start_node`] does, inside network namespace
    /// `netns` (`ip netns exec`: the process is the daemon itself, stopped by its pid).
    pub fn start_node_in(&self, node: usize, netns: &str, extra: &[&str]) -> Daemon {
        let cache = self.tmp.path().join(format!("cache-{node}"));
        std::fs::create_dir_all(&cache).expect("mkdir");
        let socket = self.node_socket(node);
        let mut d = Daemon::new(self, &cache, &socket, &format!("daemon-{node}.log"), extra);
        d.netns = Some(netns.to_owned());
        d.spawn();
        d
    }

    /// The socket of daemon `node` (see [`Bed::start_node`]).
    pub fn node_socket(&self, node: usize) -> PathBuf {
        self.tmp.path().join(format!("node-{node}.sock"))
    }

    /// A client of daemon `node`.
    pub fn node_client(&self, node: usize) -> Client {
        client_at(&self.node_socket(node))
    }

    /// A client for this bed's socket with short timeouts.
    pub fn client(&self) -> Client {
        client_at(&self.socket)
    }

    /// `program` with the preload shim, talking to this bed's daemon.
    pub fn shimmed(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        c.env("LD_PRELOAD", bin("libshardcache_preload.so"))
            .env("SHARDCACHE_SOCKET", &self.socket)
            .env_remove("SHARDCACHE_PRELOAD")
            .stdin(Stdio::null());
        c
    }

    /// `shardcache ARGS` against this bed's daemon, as uid 65534 with no groups (the
    /// caller must be root).
    pub fn cli_as_nobody<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> std::process::Output {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(bin("shardcache"))
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run setpriv")
    }
}

/// A client of the daemon at `socket`, with the tests' timeouts.
fn client_at(socket: &Path) -> Client {
    Client::with_config(ClientConfig {
        socket: socket.to_owned(),
        timeout: Duration::from_secs(5),
        wait_timeout: Duration::from_secs(60),
        retry_after: Duration::from_millis(200),
        pool: 4,
        ..ClientConfig::default()
    })
}

impl Default for Bed {
    fn default() -> Self {
        Self::new()
    }
}

/// A running `shardcached` process, killed by pid when dropped.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    args: Vec<String>,
    socket: PathBuf,
    log: PathBuf,
    starts: u32,
    /// The network namespace it runs in (`None`: the test's own).
    netns: Option<String>,
}

impl Daemon {
    fn start(bed: &Bed, cache: &Path, socket: &Path, log: &str, extra: &[&str]) -> Self {
        let mut d = Self::new(bed, cache, socket, log, extra);
        d.spawn();
        d
    }

    fn new(bed: &Bed, cache: &Path, socket: &Path, log: &str, extra: &[&str]) -> Self {
        let mut args: Vec<String> = vec![
            "--backing-root".into(),
            bed.backing.display().to_string(),
            "--cache-dir".into(),
            cache.display().to_string(),
            "--socket".into(),
            socket.display().to_string(),
        ];
        if !extra.contains(&"--log") {
            args.extend(["--log".into(), "info,shardcache_daemon=debug".into()]);
        }
        // Never the default port: tests run side by side (the bound one is in status).
        if !extra.contains(&"--metrics-listen") {
            args.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        Self {
            child: None,
            args,
            socket: socket.to_owned(),
            log: bed.tmp.path().join(log),
            starts: 0,
            netns: None,
        }
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = match &self.netns {
            None => Command::new(bin("shardcached")),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(bin("shardcached"));
                c
            }
        };
        let child = cmd
            .args(&self.args)
            .env_remove("SHARDCACHE_SOCKET")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn shardcached");
        self.child = Some(child);
        // Ready when it answers a status request (bounded: 20 s).
        let client = Client::with_config(ClientConfig {
            socket: self.socket.clone(),
            timeout: Duration::from_secs(2),
            retry_after: Duration::ZERO,
            ..ClientConfig::default()
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if client.status().is_ok() {
                return;
            }
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "shardcached exited during start-up ({st}); log:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "shardcached not ready after 20 s; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// True while the daemon process has not exited (it is reaped if it has).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child
            .as_ref()
            .map(|c| c.id() as i32)
            .expect("daemon running")
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// `kill -9`, and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait (bounded: 20 s, then SIGKILL). Returns true on a clean exit.
    pub fn stop(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        // SAFETY: as in `signal`.
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return st.success();
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the daemon again with the same arguments.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill the daemon first");
        self.spawn();
    }

    /// The daemon's status (panics if it does not answer).
    pub fn status(&self) -> shardcache_client::Status {
        Client::at(&self.socket).status().expect("status")
    }

    /// The bound address of the daemon's metrics endpoint (`None` when it is off).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        let a = self.status().metrics_addr;
        (!a.is_empty()).then(|| a.parse().expect("metrics_addr is an address"))
    }

    /// The daemon's counters.
    pub fn counters(&self) -> shardcache_client::Counters {
        self.status().counters
    }

    /// The daemon's counters once `holds` is true of them (a count the daemon makes
    /// after its answer went out, e.g. a block served to a peer), asking at most for
    /// 10 s; panics with `what` if it never holds.
    pub fn counters_once(
        &self,
        what: &str,
        holds: impl Fn(&shardcache_client::Counters) -> bool,
    ) -> shardcache_client::Counters {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let c = self.counters();
            if holds(&c) {
                return c;
            }
            assert!(Instant::now() < deadline, "never counted: {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A TCP port on 127.0.0.1 free now, for a daemon to listen on (a peer port). Taken
/// below the kernel's ephemeral range (32768 and up here), each call of a process a
/// different one: a port from binding port 0 comes from that range, where any test's
/// outgoing connection, or another test's next port-0 bind, may take it again before
/// the daemon binds it (seen: a node restarted on its port found it in use).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const BASE: u32 = 20_000;
    const SPAN: u32 = 12_000;
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (BASE + start.wrapping_add(n) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {BASE}..{}", BASE + SPAN);
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Reads a whole file through `client`.
pub fn read_all(
    client: &Client,
    path: &Path,
) -> std::io::Result<(Vec<u8>, shardcache_client::ReaderStats)> {
    use std::io::Read;
    let mut r = client.open(path)?;
    let mut v = Vec::new();
    r.read_to_end(&mut v)?;
    Ok((v, r.stats()))
}

/// `GET path` from an HTTP endpoint on `addr` (the daemon's metrics endpoint): the status
/// code and the body.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: shardcache\r\nConnection: close\r\n\r\n"
    )?;
    let mut r = String::new();
    s.read_to_string(&mut r)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response");
    let code = r
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    let body = r.split_once("\r\n\r\n").ok_or_else(bad)?.1.to_owned();
    Ok((code, body))
}

/// Drops a file's pages from the page cache, so that the next read comes from disk.
pub fn drop_page_cache(path: &Path) -> std::io::Result<()> {
    let f = File::open(path)?;
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)?;
    Ok(())
}

/// The data file holding the cached copy of `rel` (under backing root `root`), if any.
pub fn cache_data_file(cache_dir: &Path, root: &Path, rel: &str) -> Option<PathBuf> {
    use shardcache_daemon::backing::Backing;
    let backing = shardcache_daemon::backing::posix::PosixBacking::new(root).ok()?;
    let st = backing.stat(rel).ok()?;
    let key = shardcache_daemon::store::Key::of(root.to_str()?, &st.path, &st.version).hex();
    let dir = cache_dir.join("shardcache-v1/data").join(&key[..2]);
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{key}.")))
        })
}

/// Median of a non-empty slice.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// The `q` quantile (0..=1) of durations, in microseconds.
pub fn quantile_us(v: &mut [Duration], q: f64) -> f64 {
    v.sort();
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i].as_secs_f64() * 1e6
}

/// CPU seconds (user + system) this process has used so far.
pub fn cpu_secs() -> f64 {
    // SAFETY: getrusage writes only into the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return f64::NAN;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_bytes_do_not_depend_on_how_they_are_cut() {
        let whole = content(3, 1000);
        let mut part = vec![0u8; 997];
        fill_bytes(3, 3, &mut part);
        assert_eq!(part, whole[3..]);
        assert_ne!(content(4, 1000), whole);
    }
}

/// Two network namespaces joined by a veth pair, made for one test and removed when
/// dropped (root only): `a` at 169.254.1.1, `b` at 169.254.1.2, loopback up in each.
/// [`NetPair::silence_b`] makes `b` drop every packet silently (its end of the link goes
/// down: no RST, no ICMP, as a hung host or a firewall's DROP), [`NetPair::heal_b`]
/// brings it back.
#[derive(Debug)]
pub struct NetPair {
    /// The namespaces' names.
    pub a: String,
    /// See `a`.
    pub b: String,
    b_if: String,
}

impl NetPair {
    /// `a`'s address.
    pub const A: &str = "169.254.1.1";
    /// `b`'s address.
    pub const B: &str = "169.254.1.2";

    /// Makes the pair, named after this process (tests in other processes make their own).
    pub fn up() -> Self {
        let id = std::process::id();
        let me = Self {
            a: format!("sc-t{id}-a"),
            b: format!("sc-t{id}-b"),
            b_if: format!("sct{id}b"),
        };
        let a_if = format!("sct{id}a");
        me.ip(&["netns", "add", &me.a]);
        me.ip(&["netns", "add", &me.b]);
        me.ip(&[
            "link", "add", &a_if, "netns", &me.a, "type", "veth", "peer", "name", &me.b_if,
            "netns", &me.b,
        ]);
        for (ns, dev, addr) in [(&me.a, &a_if, Self::A), (&me.b, &me.b_if, Self::B)] {
            me.ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev]);
            me.ip(&["-n", ns, "link", "set", dev, "up"]);
            me.ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        me
    }

    fn ip(&self, args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(
            out.status.success(),
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `b` drops every packet, silently.
    pub fn silence_b(&self) {
        self.ip(&["-n", &self.b, "link", "set", &self.b_if, "down"]);
    }

    /// `b` answers again.
    pub fn heal_b(&self) {
        self.ip(&["-n", &self.b, "link", "set", &self.b_if, "up"]);
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}
