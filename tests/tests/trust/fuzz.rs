//! Fuzz of the local socket protocol and of manifests, as an unprivileged user would send
//! them (promise 4: bad input gets an error and changes nothing).
//!
//! A proptest-driven sequence of batches against one real daemon. Each batch is a handful
//! of operations on connections made by uid 65534 (when the test runs as root; otherwise
//! by the test's own uid): raw bytes, frames whose announced length lies, well-formed
//! requests with arbitrary fields (paths with `..`, NUL, non-UTF-8 and 10 KB; counts at
//! their limits and beyond; huge numbers in the piggybacked read report), requests carrying
//! descriptors, and manifests that are structurally plausible or mutated byte by byte.
//! After every batch:
//! - the daemon process is still running and answers `status`;
//! - an honest client reads a file and gets exactly its bytes, from the cache;
//! - nothing the attacker received was a descriptor of a file it may not read (a private
//!   file of root's is among the paths it asks for).
//!
//! `SHARDCACHE_FUZZ_CASES` sets the number of batches (CI: 1 500; run more by hand, e.g.
//! `SHARDCACHE_FUZZ_CASES=50000 cargo nextest run -p shardcache-tests --test trust fuzz`).
//! A failing batch is shrunk by proptest and printed.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use shardcache_client::proto as pb;
use shardcache_client::proto::request::Kind;
use shardcache_proto::wire::{self, FrameReader};
use shardcache_tests::{Bed, Daemon, content, read_all, write_file};

const MIB: u64 = 1 << 20;
/// How long the attacker waits for a reply before moving on (a lying frame gets none).
const REPLY_WAIT: Duration = Duration::from_millis(300);

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn cases() -> u32 {
    std::env::var("SHARDCACHE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500)
}

/// Hands out connections to the daemon made by another uid: a small Python process
/// running as uid 65534 connects to the daemon's socket on demand and passes each
/// connected socket back over a hand-off socket (`SCM_RIGHTS`). The daemon records the
/// credentials at `connect()`, so every request on such a socket is judged as uid 65534's.
struct Attacker {
    handoff: UnixStream,
    reader: FrameReader,
    child: Option<Child>,
    /// Where to connect directly when the test does not run as root.
    socket: PathBuf,
}

const CONNECTOR: &str = r#"
import os, socket, sys
daemon, handoff = sys.argv[1], sys.argv[2]
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
h = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
h.connect(handoff)
while True:
    if not h.recv(1):
        break
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(daemon)
        socket.send_fds(h, [b"\0\0\0\0"], [s.fileno()])
    except OSError:
        h.sendall(b"\0\0\0\0")
    s.close()
"#;

impl Attacker {
    fn new(bed: &Bed) -> Self {
        let dir = bed.tmp.path().join("handoff");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::set_permissions(&dir, PermissionsExt::from_mode(0o777)).expect("chmod");
        let path = dir.join("h.sock");
        let listener = UnixListener::bind(&path).expect("bind hand-off");
        std::fs::set_permissions(&path, PermissionsExt::from_mode(0o777)).expect("chmod");
        if !is_root() {
            eprintln!("NOTE: not root: the fuzz connects as its own uid, not uid 65534");
            let (a, _b) = UnixStream::pair().expect("pair");
            return Self {
                handoff: a,
                reader: FrameReader::new(),
                child: None,
                socket: bed.socket.clone(),
            };
        }
        // Python drops to uid 65534 itself (before it connects to anything), so that the
        // interpreter may live where only root can reach it (pyenv under /root).
        let child = Command::new("python3")
            .arg("-c")
            .arg(CONNECTOR)
            .arg(&bed.socket)
            .arg(&path)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn the uid-65534 connector (python3)");
        listener.set_nonblocking(true).expect("nonblocking");
        let deadline = Instant::now() + Duration::from_secs(20);
        let handoff = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "connector did not connect");
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept hand-off: {e}"),
            }
        };
        handoff.set_nonblocking(false).expect("blocking");
        handoff
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Self {
            handoff,
            reader: FrameReader::new(),
            child: Some(child),
            socket: bed.socket.clone(),
        }
    }

    /// A fresh connection to the daemon, as the attacker's uid (`None`: the daemon
    /// refused the connection, which is its right).
    fn connect(&mut self) -> Option<UnixStream> {
        let s = if self.child.is_none() {
            UnixStream::connect(&self.socket).ok()?
        } else {
            self.handoff.write_all(b"c").expect("ask the connector");
            let (_, mut fds) = self
                .reader
                .recv::<pb::Request>(&self.handoff)
                .expect("connector reply");
            UnixStream::from(fds.pop()?)
        };
        s.set_read_timeout(Some(REPLY_WAIT)).expect("timeout");
        s.set_write_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        Some(s)
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        let _ = self.handoff.shutdown(std::net::Shutdown::Both);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One thing the attacker does.
#[derive(Debug, Clone)]
enum Op {
    /// Arbitrary bytes on the socket.
    Raw(Vec<u8>),
    /// A frame whose announced length need not match what follows.
    Lying { len: u32, body: Vec<u8> },
    /// A well-formed frame of an arbitrary request, with `fds` descriptors attached.
    Req { req: pb::Request, fds: u8 },
    /// A registration of this manifest text (then unregistered if it was taken).
    Register(String),
    /// Drop the connection (mid-exchange, possibly) and take a new one.
    Reconnect,
}

/// Paths worth asking for: the files of the test bed (one of them private to root),
/// tricks on them, and garbage.
fn path_strategy(root: String) -> BoxedStrategy<String> {
    let r = root.clone();
    let tricks = prop::sample::select(vec![
        "public.bin",
        "private.bin",
        "closed/inner.bin",
        "./public.bin",
        "closed/../private.bin",
        "../../../../etc/shadow",
        "closed//inner.bin",
        "closed/./inner.bin/",
        "link-out",
        "link-private",
        "",
        ".",
        "closed",
        "public.bin\0x",
        "nonexistent",
    ])
    .prop_map(move |t| format!("{r}/{t}"));
    let r2 = root.clone();
    prop_oneof![
        4 => tricks,
        1 => "\\PC{0,40}".prop_map(move |s| format!("{r2}/{s}")),
        1 => "\\PC{0,60}",
        1 => (1usize..12_000).prop_map(move |n| format!("{root}/{}", "a/".repeat(n / 2))),
    ]
    .boxed()
}

fn version_strategy() -> impl Strategy<Value = Option<pb::Version>> {
    prop::option::of(
        (
            any::<u64>(),
            any::<i64>(),
            any::<i64>(),
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(size, mtime_ns, ctime_ns, ino, dev)| pb::Version {
                size,
                mtime_ns,
                ctime_ns,
                ino,
                dev,
            }),
    )
}

fn report_strategy() -> impl Strategy<Value = Option<pb::ReadReport>> {
    let big = prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>(), 0u64..1000];
    let usage = (
        any::<u64>(),
        big.clone(),
        big.clone(),
        big.clone(),
        big.clone(),
    )
        .prop_map(
            |(job_tag, hit_bytes, filled_bytes, fallback_bytes, wait_ns)| pb::JobUsage {
                job_tag,
                hit_bytes,
                filled_bytes,
                fallback_bytes,
                wait_ns,
                ..Default::default()
            },
        );
    let fallback = (any::<i32>(), big.clone(), big.clone()).prop_map(|(reason, opens, reads)| {
        pb::FallbackCount {
            reason,
            opens,
            reads,
        }
    });
    prop::option::weighted(
        0.3,
        (
            prop::collection::vec(big.clone(), 7),
            prop::collection::vec(usage, 0..4),
            prop::collection::vec(fallback, 0..4),
        )
            .prop_map(|(n, jobs, fallbacks)| pb::ReadReport {
                hit_bytes: n[0],
                filled_bytes: n[1],
                fallback_bytes: n[2],
                hit_reads: n[3],
                filled_reads: n[4],
                fallback_reads: n[5],
                fallback_opens: n[6],
                jobs,
                fallbacks,
            }),
    )
}

fn kind_strategy(root: String) -> impl Strategy<Value = Option<Kind>> {
    let p = path_strategy(root.clone());
    let job = prop_oneof![
        Just("fuzz-job".to_owned()),
        Just("victim".to_owned()),
        "\\PC{0,200}"
    ];
    prop::option::weighted(
        0.95,
        prop_oneof![
            3 => p.clone().prop_map(|path| Kind::Open(pb::OpenRequest { path })),
            2 => prop::collection::vec(p.clone(), 0..70)
                .prop_map(|paths| Kind::OpenMany(pb::OpenManyRequest { paths })),
            3 => (
                (p.clone(), version_strategy(), any::<u64>(), any::<u32>()),
                (any::<u64>(), 0u32..3000, any::<bool>(), any::<bool>()),
            )
                .prop_map(
                    |((path, version, first_block, count), (have_data_gen, timeout_ms, resumed, more))| {
                        Kind::Wait(pb::WaitRequest {
                            path,
                            version,
                            first_block: first_block % 4,
                            count: count % 2000,
                            have_data_gen,
                            timeout_ms,
                            resumed,
                            more,
                        })
                    },
                ),
            1 => ("\\PC{0,40}", any::<bool>(), prop_oneof![Just(0u32), any::<u32>()], "\\PC{0,12}")
                .prop_map(|(manifest_json, manifest_fd, lease_s, holder)| {
                    Kind::Register(pb::RegisterRequest { manifest_json, manifest_fd, lease_s, holder })
                }),
            1 => Just(Kind::Status(pb::StatusRequest {})),
            1 => Just(Kind::Verify(pb::VerifyRequest {})),
            1 => (job.clone(), "\\PC{0,12}")
                .prop_map(|(job, holder)| Kind::Unregister(pb::UnregisterRequest { job, holder })),
            1 => (job.clone(), any::<u64>(), any::<u64>())
                .prop_map(|(job, epoch, step)| Kind::Progress(pb::ProgressRequest { job, epoch, step })),
            1 => (job, prop::option::of(p.clone()), any::<u32>(), any::<u64>()).prop_map(
                |(job, path, limit, offset)| {
                    let (job, path) = match path {
                        Some(p) => (String::new(), p),
                        None => (job, String::new()),
                    };
                    Kind::List(pb::ListRequest { job, path, limit, offset })
                }
            ),
            1 => (prop::collection::vec(p, 0..4), any::<bool>())
                .prop_map(|(paths, all)| Kind::Evict(pb::EvictRequest { paths, job: String::new(), all })),
        ],
    )
}

/// A manifest: structurally plausible (each field drawn from valid and invalid values),
/// or a valid one with bytes flipped, inserted or cut.
fn manifest_strategy(root: String) -> impl Strategy<Value = String> {
    let r = root.clone();
    let roots = prop_oneof![
        18 => Just(r.clone()),
        1 => Just(format!("{r}/closed")),
        1 => Just("/".to_owned()),
        1 => Just("/etc".to_owned()),
        1 => Just("relative".to_owned()),
        1 => Just(String::new()),
        1 => Just(format!("{r}/../..")),
    ];
    let file = prop_oneof![
        4 => Just(serde_json::json!("public.bin")),
        4 => Just(serde_json::json!("private.bin")),
        4 => Just(serde_json::json!("closed/inner.bin")),
        1 => Just(serde_json::json!("../outside")),
        1 => Just(serde_json::json!("/etc/passwd")),
        1 => Just(serde_json::json!({"path": "public.bin", "size": u64::MAX})),
        1 => Just(serde_json::json!({"path": "public.bin", "size": -1})),
        1 => Just(serde_json::json!(17)),
        1 => "\\PC{0,20}".prop_map(|s| serde_json::json!(s)),
    ];
    let names = vec![
        "public.bin",
        "private.bin",
        "closed/inner.bin",
        "link-private",
        "link-out",
        "missing/file",
    ];
    let files = prop_oneof![
        8 => prop::sample::subsequence(names.clone(), 1..=names.len())
            .prop_map(|v| serde_json::json!(v)),
        2 => prop::collection::vec(file, 0..6).prop_map(serde_json::Value::from),
        1 => prop::sample::select(vec!["**", "*", "closed/**", "**/../**", "[", "{a,b}", ""])
            .prop_map(|g| serde_json::json!({ "glob": g })),
        1 => Just(serde_json::json!({})),
    ];
    let num = prop_oneof![
        Just(serde_json::json!(0)),
        Just(serde_json::json!(1)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(1e300)),
        Just(serde_json::json!("7")),
        (0u64..10).prop_map(|n| serde_json::json!(n)),
        any::<u64>().prop_map(|n| serde_json::json!(n)),
    ];
    let plan = prop_oneof![
        (
            num.clone(),
            num.clone(),
            num.clone(),
            prop::collection::vec(num.clone(), 0..4),
            any::<bool>()
        )
            .prop_map(
                |(seed, epochs, world, ranks, drop_last)| serde_json::json!({
                    "kind": "shuffle",
                    "algorithm": "pcg64-fisher-yates/v1",
                    "seed": seed,
                    "epochs": epochs,
                    "world_size": world,
                    "ranks": ranks,
                    "drop_last": drop_last,
                })
            ),
        (
            prop::collection::vec(prop::collection::vec(num.clone(), 0..5), 0..3),
            num.clone()
        )
            .prop_map(|(epochs, first)| serde_json::json!({
                "kind": "sequence",
                "epochs": epochs,
                "first_epoch": first,
            })),
        Just(
            serde_json::json!({"kind": "sequence", "epochs": [[{"file": 0, "offset": u64::MAX, "length": u64::MAX}]]})
        ),
        Just(serde_json::json!({"kind": "teleport"})),
        Just(serde_json::json!(null)),
    ];
    let small = prop_oneof![
        (0u64..10).prop_map(|n| serde_json::json!(n)),
        Just(serde_json::json!(1)),
    ];
    let plan = prop_oneof![
        6 => (small.clone(), small.clone(), prop::collection::vec(small.clone(), 1..3))
            .prop_map(|(seed, epochs, ranks)| serde_json::json!({
                "kind": "shuffle",
                "algorithm": "pcg64-fisher-yates/v1",
                "seed": seed,
                "epochs": epochs,
                "world_size": 4,
                "ranks": ranks,
            })),
        2 => plan,
    ];
    let structured = (
        prop_oneof![12 => Just(serde_json::json!(1)), 1 => num],
        prop_oneof![12 => Just("fuzz-job".to_owned()), 1 => "\\PC{0,140}"],
        roots,
        files,
        any::<bool>(),
        plan,
    )
        .prop_map(|(version, job, root, files, immutable, plan)| {
            serde_json::json!({
                "version": version,
                "job": job,
                "root": root,
                "files": files,
                "immutable": immutable,
                "plan": plan,
            })
            .to_string()
        });
    let valid = serde_json::json!({
        "version": 1,
        "job": "fuzz-job",
        "root": root,
        "files": ["public.bin", "closed/inner.bin"],
        "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 1,
                 "epochs": 2, "world_size": 1, "ranks": [0]},
    })
    .to_string();
    let mutated = prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6)
        .prop_map(move |edits| {
            let mut b = valid.clone().into_bytes();
            for (at, byte, how) in edits {
                let i = at.index(b.len().max(1));
                match how {
                    0 if i < b.len() => b[i] = byte,
                    1 => b.insert(i.min(b.len()), byte),
                    _ if i < b.len() => {
                        b.remove(i);
                    }
                    _ => {}
                }
            }
            String::from_utf8_lossy(&b).into_owned()
        });
    prop_oneof![3 => structured, 2 => mutated]
}

fn op_strategy(root: String) -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Op::Raw),
        1 => (prop_oneof![any::<u32>(), 0u32..64, Just(u32::MAX), Just(16 << 20), Just((16 << 20) + 1)],
              prop::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(len, body)| Op::Lying { len, body }),
        6 => (any::<u64>(), report_strategy(), kind_strategy(root.clone()), prop_oneof![8 => Just(0u8), 1 => 1u8..4])
            .prop_map(|(id, report, kind, fds)| Op::Req { req: pb::Request { id, report, kind }, fds }),
        3 => manifest_strategy(root).prop_map(Op::Register),
        1 => Just(Op::Reconnect),
    ]
}

/// Reads one reply (if any comes within [`REPLY_WAIT`]) and checks what can be checked
/// of it: a descriptor must never come with the reply to an open of the private file.
fn reply(
    conn: &UnixStream,
    asked: Option<&Kind>,
    private: &[String],
) -> Result<Option<pb::Response>, TestCaseError> {
    let mut reader = FrameReader::new();
    match reader.recv::<pb::Response>(conn) {
        Ok((resp, fds)) => {
            if let (Some(Kind::Open(o)), Some(pb::response::Kind::Open(r))) = (asked, &resp.kind)
                && private.contains(&o.path)
            {
                prop_assert!(
                    !matches!(r.result, Some(pb::open_reply::Result::Opened(_))) && fds.is_empty(),
                    "uid 65534 was served a private file: {:?}",
                    o.path
                );
            }
            if let (Some(Kind::OpenMany(m)), Some(pb::response::Kind::OpenMany(r))) =
                (asked, &resp.kind)
            {
                for (p, res) in m.paths.iter().zip(&r.results) {
                    prop_assert!(
                        !(private.contains(p)
                            && matches!(res.result, Some(pb::open_reply::Result::Opened(_)))),
                        "uid 65534 was served a private file in open_many: {p:?}"
                    );
                }
            }
            Ok(Some(resp))
        }
        Err(wire::WireError::Decode(e)) => Err(TestCaseError::fail(format!(
            "the daemon sent a frame that does not decode: {e}"
        ))),
        Err(_) => Ok(None),
    }
}

/// What the fuzz reached, printed at the end (so that a run that only ever hit the
/// first parse error shows it).
#[derive(Debug, Default)]
struct Tally {
    replies: std::collections::BTreeMap<&'static str, u64>,
    no_reply: u64,
    registered: u64,
    /// Why manifests were refused (the first words of the error), with counts.
    refused_manifests: std::collections::BTreeMap<String, u64>,
}

impl Tally {
    fn saw(&mut self, r: &Option<pb::Response>) {
        use pb::response::Kind as R;
        let name = match r.as_ref().and_then(|r| r.kind.as_ref()) {
            None => {
                self.no_reply += 1;
                return;
            }
            Some(R::Open(o)) => match o.result {
                Some(pb::open_reply::Result::Opened(_)) => "opened",
                _ => "open refused",
            },
            Some(R::Wait(_)) => "wait",
            Some(R::Status(_)) => "status",
            Some(R::Verify(_)) => "verify",
            Some(R::OpenMany(_)) => "open_many",
            Some(R::Error(_)) => "error",
            Some(R::Register(_)) => "register",
            Some(R::Unregister(_)) => "unregister",
            Some(R::Progress(_)) => "progress",
            Some(R::List(_)) => "list",
            Some(R::Evict(_)) => "evict",
        };
        *self.replies.entry(name).or_default() += 1;
    }
}

struct World<'a> {
    tally: Tally,
    bed: &'a Bed,
    daemon: &'a mut Daemon,
    attacker: Attacker,
    private: Vec<String>,
    honest: shardcache_client::Client,
    public: Vec<u8>,
}

impl World<'_> {
    fn run(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        let mut conn = self.attacker.connect();
        for op in ops {
            let Some(c) = conn.as_ref() else {
                conn = self.attacker.connect();
                continue;
            };
            match op {
                Op::Raw(bytes) => {
                    let _ = (&*c).write_all(bytes);
                    let r = reply(c, None, &self.private)?;
                    self.tally.saw(&r);
                    conn = self.attacker.connect();
                }
                Op::Lying { len, body } => {
                    let _ = (&*c).write_all(&len.to_le_bytes());
                    let _ = (&*c).write_all(body);
                    let r = reply(c, None, &self.private)?;
                    self.tally.saw(&r);
                    conn = self.attacker.connect();
                }
                Op::Req { req, fds } => {
                    let files: Vec<std::fs::File> = (0..*fds)
                        .filter_map(|_| std::fs::File::open("/dev/null").ok())
                        .collect();
                    let borrowed: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
                    if wire::send(c, req, &borrowed).is_err() {
                        conn = self.attacker.connect();
                        continue;
                    }
                    let r = reply(c, req.kind.as_ref(), &self.private)?;
                    self.tally.saw(&r);
                    if r.is_none() {
                        // No answer in time (a long wait, or the daemon closed): start over.
                        conn = self.attacker.connect();
                    }
                }
                Op::Register(json) => {
                    let req = pb::Request {
                        id: 1,
                        report: None,
                        kind: Some(Kind::Register(pb::RegisterRequest {
                            manifest_json: json.clone(),
                            manifest_fd: false,
                            lease_s: 0,
                            holder: String::new(),
                        })),
                    };
                    if wire::send(c, &req, &[]).is_err() {
                        conn = self.attacker.connect();
                        continue;
                    }
                    let r = reply(c, None, &self.private)?;
                    self.tally.saw(&r);
                    match r {
                        Some(pb::Response {
                            kind: Some(pb::response::Kind::Register(r)),
                            ..
                        }) => {
                            self.tally.registered += 1;
                            let un = pb::Request {
                                id: 2,
                                report: None,
                                kind: Some(Kind::Unregister(pb::UnregisterRequest {
                                    job: r.job,
                                    holder: String::new(),
                                })),
                            };
                            let _ = wire::send(c, &un, &[]);
                            let _ = reply(c, None, &self.private)?;
                        }
                        Some(pb::Response {
                            kind: Some(pb::response::Kind::Error(e)),
                            ..
                        }) => {
                            let why: String = e.message.chars().take(50).collect();
                            *self.tally.refused_manifests.entry(why).or_default() += 1;
                        }
                        Some(_) => {}
                        None => conn = self.attacker.connect(),
                    }
                }
                Op::Reconnect => conn = self.attacker.connect(),
            }
        }
        drop(conn);
        self.check()
    }

    /// The daemon is up, answers, and serves an honest client the right bytes.
    fn check(&mut self) -> Result<(), TestCaseError> {
        prop_assert!(
            self.daemon.running(),
            "the daemon died; log:\n{}",
            self.daemon.log_text()
        );
        let st = self.honest.status();
        prop_assert!(st.is_ok(), "status not answered: {:?}", st.err());
        let (bytes, stats) = read_all(&self.honest, &self.bed.path("public.bin"))
            .map_err(|e| TestCaseError::fail(format!("honest read failed: {e}")))?;
        prop_assert!(bytes == self.public, "honest read got wrong bytes");
        prop_assert_eq!(
            stats.fallback_bytes,
            0,
            "the honest read fell back to the backing store"
        );
        Ok(())
    }
}

#[test]
fn the_local_protocol_and_manifests_survive_fuzzing_by_another_uid() {
    let bed = Bed::new();
    write_file(&bed.path("public.bin"), 1, MIB + 17);
    write_file(&bed.path("private.bin"), 2, 4096);
    std::fs::set_permissions(bed.path("private.bin"), PermissionsExt::from_mode(0o600)).unwrap();
    write_file(&bed.path("closed/inner.bin"), 3, 4096);
    std::fs::set_permissions(bed.path("closed"), PermissionsExt::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", bed.path("link-out")).unwrap();
    std::os::unix::fs::symlink("private.bin", bed.path("link-private")).unwrap();
    let mut daemon = bed.start(&["--block-size", "256KiB"]);
    let root = bed.backing.display().to_string();
    let private: Vec<String> = if is_root() {
        [
            "private.bin",
            "closed/inner.bin",
            "link-private",
            "closed/../private.bin",
        ]
        .iter()
        .map(|p| format!("{root}/{p}"))
        .collect()
    } else {
        Vec::new()
    };
    let honest = bed.client();
    // Root reads everything first: the private bytes are in the cache, ready to leak.
    for f in ["public.bin", "private.bin", "closed/inner.bin"] {
        read_all(&honest, &bed.path(f)).expect("warm read");
    }
    let world = World {
        tally: Tally::default(),
        bed: &bed,
        daemon: &mut daemon,
        attacker: Attacker::new(&bed),
        private,
        honest,
        public: content(1, MIB + 17),
    };
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 200,
        ..Config::default()
    });
    let started = Instant::now();
    let strategy = prop::collection::vec(op_strategy(root), 1..8);
    let world = std::cell::RefCell::new(world);
    let result = runner.run(&strategy, |ops| world.borrow_mut().run(&ops));
    let world = world.into_inner();
    eprintln!(
        "fuzz: {} batches in {:.1} s",
        cases(),
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{e}\nlog tail:\n{}", tail(&world.daemon.log_text(), 40));
    }
    eprintln!(
        "fuzz: replies {:?}, no reply {}, manifests registered {}",
        world.tally.replies, world.tally.no_reply, world.tally.registered
    );
    let mut why: Vec<_> = world.tally.refused_manifests.iter().collect();
    why.sort_by_key(|(_, n)| std::cmp::Reverse(**n));
    eprintln!(
        "fuzz: manifests refused, most common reasons: {:?}",
        &why[..why.len().min(8)]
    );
    let c = world.daemon.counters();
    eprintln!(
        "fuzz: opens {} refused_denied {} refused_path {} refused_other {}",
        c.opens, c.refused_denied, c.refused_path, c.refused_other
    );
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
