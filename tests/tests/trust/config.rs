//! Trust suite: config (see main.rs). `shardcached --check-config` refuses everything a
//! start refuses, with the same message naming the same key: the Helm chart, the packages
//! and operators rely on it to say whether the daemon would start.
//!
//! One table of cases; each is run both ways (`--check-config`, and a real start that
//! must exit by itself within a bound), and every disagreement is reported at once.
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shardcache_tests::bin;

/// Longest a refused start may take to exit.
const START_BOUND: Duration = Duration::from_secs(15);

/// One case's files: a directory with a valid root, cache directory and socket path,
/// and the TOML keys (key → TOML value) and extra flags of the configuration.
struct Setup {
    dir: PathBuf,
    keys: BTreeMap<&'static str, String>,
    flags: Vec<OsString>,
}

impl Setup {
    fn new(dir: &Path) -> Self {
        let root = dir.join("root");
        std::fs::create_dir_all(&root).unwrap();
        let q = |p: PathBuf| format!("{:?}", p.to_str().unwrap());
        let mut keys = BTreeMap::new();
        keys.insert("backing_roots", format!("[{}]", q(root)));
        keys.insert("cache_dir", q(dir.join("cache")));
        keys.insert("socket", q(dir.join("s.sock")));
        keys.insert("metrics_listen", "\"127.0.0.1:0\"".into());
        Self {
            dir: dir.to_owned(),
            keys,
            flags: Vec::new(),
        }
    }

    /// A path in the case's directory, as a TOML string.
    fn path(&self, name: &str) -> String {
        format!("{:?}", self.dir.join(name).to_str().unwrap())
    }

    /// A regular file in the case's directory; its TOML string.
    fn file(&self, name: &str, text: &str) -> String {
        std::fs::write(self.dir.join(name), text).unwrap();
        self.path(name)
    }

    fn set(&mut self, key: &'static str, value: impl Into<String>) {
        self.keys.insert(key, value.into());
    }

    /// Sharing on, with a valid secret unless the case replaces it.
    fn peers(&mut self) {
        self.set("peer_listen", "\"127.0.0.1:0\"");
        self.set("peers", "[\"127.0.0.1:1\"]");
        let s = self.file("secret", "0123456789abcdef0123\n");
        self.set("peer_secret_file", s);
    }

    fn command(&self) -> Command {
        let toml: String = self
            .keys
            .iter()
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect();
        let file = self.dir.join("shardcached.toml");
        std::fs::write(&file, toml).unwrap();
        let mut c = Command::new(bin("shardcached"));
        c.arg("--config").arg(file).args(&self.flags);
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if k.starts_with("SHARDCACHED_") || k == "SHARDCACHE_SOCKET" {
                c.env_remove(&*k);
            }
        }
        // Messages are compared whole: no backtraces in them.
        c.env("RUST_BACKTRACE", "0").env("RUST_LIB_BACKTRACE", "0");
        c.stdin(Stdio::null());
        c
    }
}

/// A case: its name, the key its refusal must name, and how it spoils the setup.
type Case = (&'static str, &'static str, fn(&mut Setup));

const CASES: &[Case] = &[
    ("no backing root", "backing_roots", |s| {
        s.set("backing_roots", "[]")
    }),
    ("missing backing root", "backing_roots", |s| {
        let p = s.path("missing");
        s.set("backing_roots", format!("[{p}]"));
    }),
    ("backing root is a regular file", "backing_roots", |s| {
        let p = s.file("plain", "x");
        s.set("backing_roots", format!("[{p}]"));
    }),
    ("backing root is relative", "backing_roots", |s| {
        s.set("backing_roots", "[\"data\"]")
    }),
    ("backing root is not UTF-8", "backing_roots", |s| {
        let mut p = s.dir.clone().into_os_string().into_vec();
        p.extend_from_slice(b"/r\xff");
        let p = OsString::from_vec(p);
        std::fs::create_dir(&p).unwrap();
        s.flags.push("--backing-root".into());
        s.flags.push(p);
    }),
    ("peer secret of 3 characters", "peer_secret_file", |s| {
        s.peers();
        let f = s.file("short", "abc\n");
        s.set("peer_secret_file", f);
    }),
    ("peer secret file missing", "peer_secret_file", |s| {
        s.peers();
        let f = s.path("no-secret");
        s.set("peer_secret_file", f);
    }),
    ("peer secret file is a directory", "peer_secret_file", |s| {
        s.peers();
        let f = s.path("root");
        s.set("peer_secret_file", f);
    }),
    ("peer secret not printable ASCII", "peer_secret_file", |s| {
        s.peers();
        let f = s.file("utf8", &"é".repeat(20));
        s.set("peer_secret_file", f);
    }),
    ("peer_listen without a secret", "peer_secret_file", |s| {
        s.peers();
        s.keys.remove("peer_secret_file");
    }),
    (
        "peer TLS with two of its three files",
        "peer_tls_cert",
        |s| {
            s.peers();
            let (c, k) = (s.file("tls.crt", "x"), s.file("tls.key", "x"));
            s.set("peer_tls_cert", c);
            s.set("peer_tls_key", k);
        },
    ),
    ("peer TLS files missing", "peer_tls_cert", |s| {
        s.peers();
        let (c, k, a) = (s.path("tls.crt"), s.path("tls.key"), s.path("ca.crt"));
        s.set("peer_tls_cert", c);
        s.set("peer_tls_key", k);
        s.set("peer_tls_ca", a);
    }),
    ("peer TLS certificate not PEM", "peer_tls_cert", |s| {
        s.peers();
        let c = s.file("tls.crt", "not PEM");
        let (k, a) = (s.file("tls.key", "x"), s.file("ca.crt", "x"));
        s.set("peer_tls_cert", c);
        s.set("peer_tls_key", k);
        s.set("peer_tls_ca", a);
    }),
    ("peer_dns without a port", "peer_dns", |s| {
        s.peers();
        s.keys.remove("peers");
        s.set("peer_dns", "\"shardcache.svc\"");
    }),
    ("peer_listen not of this host", "peer_listen", |s| {
        s.peers();
        s.set("peer_listen", "\"[2001:db8::1]:7070\"");
    }),
    (
        "peer_listen a wildcard without peer_advertise",
        "peer_advertise",
        |s| {
            s.peers();
            s.set("peer_listen", "\"0.0.0.0:0\"");
        },
    ),
    ("metrics_listen not an address", "metrics_listen", |s| {
        s.set("metrics_listen", "\"localhost\"")
    }),
    ("metrics_listen not of this host", "metrics_listen", |s| {
        s.set("metrics_listen", "\"[2001:db8::1]:9477\"")
    }),
    ("capacity with an unknown unit", "capacity", |s| {
        s.set("capacity", "\"10XB\"")
    }),
    ("capacity of 0 bytes", "capacity", |s| {
        s.set("capacity", "0")
    }),
    ("min_free over 100%", "min_free", |s| {
        s.set("min_free", "\"150%\"")
    }),
    ("block_size not a multiple of 4 KiB", "block_size", |s| {
        s.set("block_size", "1000")
    }),
    ("metadata_ttl not a duration", "metadata_ttl", |s| {
        s.set("metadata_ttl", "\"1 fortnight\"")
    }),
    ("fill_workers 0", "fill_workers", |s| {
        s.set("fill_workers", "0")
    }),
    ("spin over 10ms", "spin", |s| s.set("spin", "\"1s\"")),
    ("max_connections 0", "max_connections", |s| {
        s.set("max_connections", "0")
    }),
    (
        "max_connections_per_uid above max_connections",
        "max_connections_per_uid",
        |s| {
            s.set("max_connections", "10");
            s.set("max_connections_per_uid", "11");
        },
    ),
    ("socket_mode not a mode", "socket_mode", |s| {
        s.set("socket_mode", "0o7777")
    }),
    ("cache_dir is a regular file", "cache_dir", |s| {
        let f = s.file("cache-file", "x");
        s.set("cache_dir", f);
    }),
    ("cache_dir below a regular file", "cache_dir", |s| {
        s.file("blocker", "x");
        let p = s.path("blocker/cache");
        s.set("cache_dir", p);
    }),
    ("socket is a regular file", "socket", |s| {
        let f = s.file("sock-file", "x");
        s.set("socket", f);
    }),
    ("socket below a regular file", "socket", |s| {
        s.file("sblocker", "x");
        let p = s.path("sblocker/s.sock");
        s.set("socket", p);
    }),
    ("an unknown key", "fill_wrokers", |s| {
        s.set("fill_wrokers", "4")
    }),
];

/// The error a run printed: from its `Error:` line to the end (log lines before it are
/// not part of it).
fn error_of(stderr: &str) -> Option<String> {
    stderr
        .find("Error: ")
        .map(|i| stderr[i..].trim_end().to_owned())
}

/// `--check-config`: exit status and output.
fn check(setup: &Setup, scope: Option<&str>) -> (bool, String) {
    let mut c = setup.command();
    c.arg(match scope {
        None => "--check-config".to_owned(),
        Some(s) => format!("--check-config={s}"),
    });
    let o = c.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    (o.status.success(), out)
}

/// A real start: `Err(stderr)` when it exits with a failure within [`START_BOUND`],
/// `Ok(())` when it is still running then (it is killed) or exits successfully.
fn start(setup: &Setup) -> Result<(), String> {
    let log = setup.dir.join("start.log");
    let mut c = setup.command();
    c.stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = c.spawn().unwrap();
    let deadline = Instant::now() + START_BOUND;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            return if st.success() { Ok(()) } else { Err(text) };
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What went wrong with one case (empty when both runs refuse it alike).
fn run_case(dir: &Path, (name, key, spoil): &Case) -> Vec<String> {
    let mut s = Setup::new(dir);
    spoil(&mut s);
    let mut bad = Vec::new();
    let (ok, out) = check(&s, None);
    let checked = error_of(&out);
    if ok {
        bad.push(format!(
            "{name}: --check-config accepted it: {}",
            out.trim()
        ));
    } else if !out.contains(key) {
        bad.push(format!(
            "{name}: --check-config does not name `{key}`: {out}"
        ));
    }
    match start(&s) {
        Ok(()) => bad.push(format!("{name}: a real start accepted it")),
        Err(log) => {
            let started = error_of(&log);
            if !started.as_deref().is_some_and(|e| e.contains(key)) {
                bad.push(format!("{name}: a real start does not name `{key}`: {log}"));
            } else if !ok && checked != started {
                bad.push(format!(
                    "{name}: different messages:\n  --check-config: {checked:?}\n  start:          {started:?}"
                ));
            }
        }
    }
    eprintln!(
        "{:<48} {:<24} {}",
        name,
        key,
        if bad.is_empty() {
            "refused alike"
        } else {
            "DIFFERS"
        }
    );
    bad
}

#[test]
fn check_config_refuses_every_configuration_a_start_refuses_with_the_same_message() {
    let tmp = tempfile::tempdir().unwrap();
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    // A few cases at a time: each starts a daemon.
    std::thread::scope(|sc| {
        for _ in 0..4 {
            sc.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(case) = CASES.get(i) else { break };
                    let dir = tmp.path().join(format!("case-{i}"));
                    std::fs::create_dir_all(&dir).unwrap();
                    let bad = run_case(&dir, case);
                    failures.lock().unwrap().extend(bad);
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        CASES.len(),
        failures.join("\n")
    );
}

#[test]
fn a_valid_configuration_passes_the_check_and_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = Setup::new(tmp.path());
    s.peers();
    let (ok, out) = check(&s, None);
    assert!(ok && out.contains("configuration ok"), "{out}");
    let socket = s.dir.join("s.sock");
    let mut child = s.command().stderr(Stdio::null()).spawn().unwrap();
    let client = shardcache_client::Client::at(&socket);
    let deadline = Instant::now() + START_BOUND;
    let status = loop {
        if let Ok(st) = client.status() {
            break Some(st);
        }
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        status.is_some(),
        "the daemon did not start on a configuration the check passed"
    );
}

#[test]
fn check_config_file_checks_a_configuration_written_for_other_machines() {
    // The packaging and Helm tests check a file rendered for the nodes, not for the
    // machine running them: `--check-config=file` checks keys, values and their
    // combinations, not the paths and addresses of this machine.
    let tmp = tempfile::tempdir().unwrap();
    let mut s = Setup::new(tmp.path());
    s.set("backing_roots", "[\"/lustre/datasets-not-here\"]");
    s.set("cache_dir", "\"/mnt/nvme-not-here/shardcache\"");
    let (ok, out) = check(&s, Some("file"));
    assert!(ok && out.contains("configuration ok"), "{out}");
    let (ok, out) = check(&s, None);
    assert!(!ok && out.contains("backing_roots"), "{out}");
    s.set("block_size", "1000");
    let (ok, out) = check(&s, Some("file"));
    assert!(!ok && out.contains("block_size"), "{out}");
}
