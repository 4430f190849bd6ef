//! One conformance suite for every [`Transport`]: plain functions over a [`Fixture`]
//! (a transport to a [`Script`]ed daemon, and the clock its time is kept on), run over
//! the in-memory fake on a manual clock, over the real Unix socket (the same script
//! served by a thread), and over both behind the [`FaultyTransport`] wrapper.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{request, response};
use shardcache_proto::wire::{self, FrameReader, WireError};

use super::fault::{Faults, FaultyTransport};
use super::mem::{Answer, Call, MemTransport, Script};
use super::unix::UnixTransport;
use super::{Connection, Transport};
use crate::clock::{Clock, ManualClock, SystemClock};

/// What the suite needs: a transport to a scripted daemon.
pub(crate) trait Fixture {
    fn transport(&self) -> Arc<dyn Transport>;
    fn script(&self) -> &Script;
    fn clock(&self) -> &dyn Clock;
    /// Makes the daemon absent (new connections fail) or present again.
    fn absent(&self, absent: bool);
}

/// Runs every check, each on a fresh fixture.
pub(crate) fn run_all(new: &dyn Fn() -> Box<dyn Fixture>) {
    an_exchange_returns_the_reply_to_its_request(&*new());
    requests_on_one_connection_are_answered_in_turn(&*new());
    descriptors_travel_both_ways(&*new());
    a_reply_within_the_timeout_arrives_after_its_delay(&*new());
    a_hung_daemon_times_out_after_the_timeout(&*new());
    a_late_reply_stays_on_its_connection(&*new());
    a_closed_connection_is_reported_closed(&*new());
    an_absent_daemon_refuses_connections(&*new());
}

fn status(id: u64) -> pb::Request {
    pb::Request {
        id,
        report: None,
        kind: Some(request::Kind::Status(pb::StatusRequest {})),
    }
}

fn version_reply(call: &Call) -> Answer {
    Answer::reply(response::Kind::Status(pb::StatusReply {
        daemon_version: format!("{}:{}", call.conn, call.req.id),
        ..Default::default()
    }))
}

fn exchange(c: &mut dyn Connection, id: u64) -> Result<pb::Response, WireError> {
    c.send(&status(id), &[], Duration::from_secs(1))?;
    Ok(c.recv(Duration::from_secs(5), Duration::ZERO)?.0)
}

fn version(r: &pb::Response) -> &str {
    match &r.kind {
        Some(response::Kind::Status(s)) => &s.daemon_version,
        other => panic!("{other:?}"),
    }
}

fn an_exchange_returns_the_reply_to_its_request(fx: &dyn Fixture) {
    fx.script().set(version_reply);
    let mut c = fx.transport().connect().unwrap();
    let r = exchange(&mut *c, 7).unwrap();
    assert_eq!(r.id, 7);
    assert_eq!(version(&r), "0:7");
    // A frame out of step (id 0: a refusal) comes through as it is.
    fx.script().set(|_| Answer::Frame {
        resp: pb::Response {
            id: 0,
            kind: Some(response::Kind::Error(pb::ErrorReply {
                message: "go away".into(),
                code: 0,
            })),
        },
        after: Duration::ZERO,
    });
    let r = exchange(&mut *c, 8).unwrap();
    assert_eq!(r.id, 0);
    let log = fx.script().take_log();
    assert_eq!(log.len(), 2);
    assert_eq!(log[1].req, status(8));
}

fn requests_on_one_connection_are_answered_in_turn(fx: &dyn Fixture) {
    fx.script().set(version_reply);
    let mut a = fx.transport().connect().unwrap();
    let mut b = fx.transport().connect().unwrap();
    assert_eq!(version(&exchange(&mut *a, 1).unwrap()), "0:1");
    assert_eq!(version(&exchange(&mut *b, 2).unwrap()), "1:2");
    assert_eq!(version(&exchange(&mut *a, 3).unwrap()), "0:3");
    assert_eq!(fx.script().connects(), 2);
    let conns: Vec<u64> = fx.script().take_log().iter().map(|c| c.conn).collect();
    assert_eq!(conns, [0, 1, 0]);
}

fn descriptors_travel_both_ways(fx: &dyn Fixture) {
    fx.script().set(|call| {
        // The descriptor sent along is readable here, and one goes back.
        let mut got = [0u8; 4];
        let f = std::fs::File::from(call.fds[0].try_clone().unwrap());
        f.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(&got, b"sent");
        let mut back = tempfile::tempfile().unwrap();
        back.write_all(b"back").unwrap();
        Answer::with_fds(
            response::Kind::Status(pb::StatusReply::default()),
            vec![OwnedFd::from(back)],
        )
    });
    let mut sent = tempfile::tempfile().unwrap();
    sent.write_all(b"sent").unwrap();
    let mut c = fx.transport().connect().unwrap();
    c.send(&status(1), &[sent.as_fd()], Duration::from_secs(1))
        .unwrap();
    let (r, fds) = c.recv(Duration::from_secs(5), Duration::ZERO).unwrap();
    assert_eq!(r.id, 1);
    assert_eq!(fds.len(), 1);
    let mut got = [0u8; 4];
    std::fs::File::from(fds.into_iter().next().unwrap())
        .read_exact_at(&mut got, 0)
        .unwrap();
    assert_eq!(&got, b"back");
    assert_eq!(fx.script().take_log()[0].fds.len(), 1);
}

fn a_reply_within_the_timeout_arrives_after_its_delay(fx: &dyn Fixture) {
    let delay = Duration::from_millis(30);
    fx.script()
        .set(move |_| Answer::after(delay, response::Kind::Status(pb::StatusReply::default())));
    let mut c = fx.transport().connect().unwrap();
    let t0 = fx.clock().now();
    c.send(&status(1), &[], Duration::from_secs(1)).unwrap();
    let (r, _) = c.recv(Duration::from_secs(5), Duration::ZERO).unwrap();
    assert_eq!(r.id, 1);
    let took = fx.clock().now() - t0;
    assert!(took >= delay && took < Duration::from_secs(5), "{took:?}");
}

fn a_hung_daemon_times_out_after_the_timeout(fx: &dyn Fixture) {
    fx.script().set(|_| Answer::Hang);
    let mut c = fx.transport().connect().unwrap();
    let timeout = Duration::from_millis(50);
    let t0 = fx.clock().now();
    c.send(&status(1), &[], Duration::from_secs(1)).unwrap();
    let e = c.recv(timeout, Duration::ZERO).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    let took = fx.clock().now() - t0;
    assert!(took >= timeout && took < Duration::from_secs(5), "{took:?}");
}

fn a_late_reply_stays_on_its_connection(fx: &dyn Fixture) {
    fx.script().set(|call| {
        Answer::after(
            Duration::from_millis(100),
            response::Kind::Status(pb::StatusReply {
                daemon_version: call.req.id.to_string(),
                ..Default::default()
            }),
        )
    });
    let mut c = fx.transport().connect().unwrap();
    c.send(&status(1), &[], Duration::from_secs(1)).unwrap();
    let e = c
        .recv(Duration::from_millis(20), Duration::ZERO)
        .unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    // The connection is out of step: what it receives next is the late answer to the
    // request that timed out, not to a new one. (Why a timed-out connection is dropped.)
    c.send(&status(2), &[], Duration::from_secs(1)).unwrap();
    let (r, _) = c.recv(Duration::from_secs(5), Duration::ZERO).unwrap();
    assert_eq!((r.id, version(&r)), (1, "1"));
}

fn a_closed_connection_is_reported_closed(fx: &dyn Fixture) {
    fx.script().set(|_| Answer::Close);
    let mut c = fx.transport().connect().unwrap();
    c.send(&status(1), &[], Duration::from_secs(1)).unwrap();
    let e = c.recv(Duration::from_secs(5), Duration::ZERO).unwrap_err();
    assert!(matches!(e, WireError::Closed), "{e:?}");
}

fn an_absent_daemon_refuses_connections(fx: &dyn Fixture) {
    fx.script().set(version_reply);
    fx.absent(true);
    assert!(fx.transport().connect().is_err());
    fx.absent(false);
    let mut c = fx.transport().connect().unwrap();
    assert_eq!(exchange(&mut *c, 1).unwrap().id, 1);
}

/// The fake on a manual clock.
struct MemFixture {
    script: Arc<Script>,
    clock: Arc<ManualClock>,
    transport: Arc<dyn Transport>,
}

impl MemFixture {
    fn new() -> Self {
        let script = Script::new(|_| Answer::Hang);
        let clock = Arc::new(ManualClock::default());
        let transport = Arc::new(MemTransport::new(script.clone(), clock.clone()));
        Self {
            script,
            clock,
            transport,
        }
    }
}

impl Fixture for MemFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    fn script(&self) -> &Script {
        &self.script
    }
    fn clock(&self) -> &dyn Clock {
        &*self.clock
    }
    fn absent(&self, absent: bool) {
        self.script.refuse_connections(absent);
    }
}

/// The script served over a real Unix socket, one thread per connection.
pub(crate) struct UnixFixture {
    script: Arc<Script>,
    _dir: tempfile::TempDir,
    path: PathBuf,
    transport: Arc<dyn Transport>,
}

impl UnixFixture {
    pub(crate) fn new(script: Arc<Script>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let s = script.clone();
        // The threads end with the test process (the listener's path goes with the
        // temporary directory).
        std::thread::spawn(move || {
            for sock in listener.incoming() {
                let Ok(sock) = sock else { return };
                let Ok(conn) = s.accept() else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(&s, conn, &sock));
            }
        });
        let transport = Arc::new(UnixTransport::new(path.clone()));
        Self {
            script,
            _dir: dir,
            path,
            transport,
        }
    }
}

fn serve(script: &Script, conn: u64, sock: &std::os::unix::net::UnixStream) {
    let mut reader = FrameReader::new();
    loop {
        let Ok((req, fds)) = reader.recv::<pb::Request>(sock) else {
            return;
        };
        let id = req.id;
        let (resp, fds, after) = match script.answer(Call { conn, req, fds }) {
            Answer::Reply { kind, fds, after } => (
                pb::Response {
                    id,
                    kind: Some(kind),
                },
                fds,
                after,
            ),
            Answer::Frame { resp, after } => (resp, Vec::new(), after),
            Answer::Hang => continue,
            Answer::Close => return,
        };
        std::thread::sleep(after);
        let fds: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        if wire::send(sock, &resp, &fds).is_err() {
            return;
        }
    }
}

impl Fixture for UnixFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    fn script(&self) -> &Script {
        &self.script
    }
    fn clock(&self) -> &dyn Clock {
        &SystemClock
    }
    fn absent(&self, absent: bool) {
        let away = self.path.with_extension("away");
        if absent {
            std::fs::rename(&self.path, away).unwrap();
        } else {
            std::fs::rename(away, &self.path).unwrap();
        }
    }
}

/// Any fixture behind the fault wrapper, every fault off.
struct Wrapped<F> {
    inner: F,
    transport: Arc<dyn Transport>,
}

impl<F: Fixture> Wrapped<F> {
    fn new(inner: F, clock: Arc<dyn Clock>) -> Self {
        let transport = Arc::new(FaultyTransport::new(
            inner.transport(),
            Arc::new(Faults::default()),
            clock,
        ));
        Self { inner, transport }
    }
}

impl<F: Fixture> Fixture for Wrapped<F> {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    fn script(&self) -> &Script {
        self.inner.script()
    }
    fn clock(&self) -> &dyn Clock {
        self.inner.clock()
    }
    fn absent(&self, absent: bool) {
        self.inner.absent(absent);
    }
}

fn mem() -> MemFixture {
    MemFixture::new()
}

fn unix() -> UnixFixture {
    UnixFixture::new(Script::new(|_| Answer::Hang))
}

#[test]
fn the_fake_conforms() {
    run_all(&|| Box::new(mem()));
}

#[test]
fn the_unix_socket_conforms() {
    run_all(&|| Box::new(unix()));
}

#[test]
fn the_fault_wrapper_with_no_fault_conforms_over_both() {
    run_all(&|| {
        let m = mem();
        let clock = m.clock.clone();
        Box::new(Wrapped::new(m, clock))
    });
    run_all(&|| Box::new(Wrapped::new(unix(), Arc::new(SystemClock))));
}

/// The wrapper's faults, over a fixture whose daemon answers at once.
fn faults_are_injected(inner: &dyn Fixture, clock: Arc<dyn Clock>) {
    inner.script().set(version_reply);
    let faults = Arc::new(Faults::default());
    let t = FaultyTransport::new(inner.transport(), faults.clone(), clock.clone());
    let mut c = t.connect().unwrap();
    assert_eq!(exchange(&mut *c, 1).unwrap().id, 1);

    faults.hang.store(true, Ordering::SeqCst);
    let t0 = clock.now();
    c.send(&status(2), &[], Duration::from_secs(1)).unwrap();
    let e = c
        .recv(Duration::from_millis(40), Duration::ZERO)
        .unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    assert!(clock.now() - t0 >= Duration::from_millis(40));
    faults.hang.store(false, Ordering::SeqCst);

    faults.close.store(true, Ordering::SeqCst);
    let mut c = t.connect().unwrap();
    assert!(c.send(&status(3), &[], Duration::from_secs(1)).is_err());
    assert!(matches!(
        c.recv(Duration::from_secs(1), Duration::ZERO),
        Err(WireError::Closed)
    ));
    faults.close.store(false, Ordering::SeqCst);

    faults.refuse.store(true, Ordering::SeqCst);
    assert!(t.connect().is_err());
    faults.refuse.store(false, Ordering::SeqCst);
    assert_eq!(exchange(&mut *t.connect().unwrap(), 4).unwrap().id, 4);
    assert_eq!(faults.connects.load(Ordering::SeqCst), 3);
}

#[test]
fn the_fault_wrapper_injects_hangs_closes_and_refusals_over_both() {
    let m = mem();
    let clock = m.clock.clone();
    faults_are_injected(&m, clock);
    faults_are_injected(&unix(), Arc::new(SystemClock));
}
