//! The client's fallback logic, tested in-process: a [`Client`] over the scripted daemon
//! of [`crate::transport::mem`] on a [`ManualClock`], so that every bound of
//! docs/SEMANTICS.md section 2 is checked exactly (the clock moves only while the fake
//! daemon takes its time) and nothing sleeps. The trust suite's `stalls` tests hold the
//! same bounds end to end, against the real daemon.

#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::{FallbackReason, open_reply, request, response, wait_reply};

use crate::clock::ManualClock;
use crate::reader::version_of;
use crate::transport::mem::{Answer, Call, MemTransport, Script};
use crate::{Client, ClientConfig, Source};

const BS: u64 = 4096;
const TIMEOUT: Duration = Duration::from_secs(1);
const RETRY_AFTER: Duration = Duration::from_secs(2);

/// A client over a scripted daemon (dropped first: a dropped client may still call the
/// script, which may look at the files).
struct Bed {
    client: Client,
    clock: Arc<ManualClock>,
    script: Arc<Script>,
    dir: tempfile::TempDir,
}

fn config() -> ClientConfig {
    ClientConfig {
        socket: "/nonexistent/mem.sock".into(),
        timeout: TIMEOUT,
        wait_timeout: Duration::from_secs(10),
        retry_after: RETRY_AFTER,
        pool: 8,
        spin: Duration::ZERO,
    }
}

fn bed_with(cfg: ClientConfig) -> Bed {
    let clock = Arc::new(ManualClock::default());
    let script = Script::new(|_| Answer::Hang);
    let transport = Arc::new(MemTransport::new(script.clone(), clock.clone()));
    Bed {
        dir: tempfile::tempdir().unwrap(),
        client: Client::with_transport(cfg, transport, clock.clone()),
        clock,
        script,
    }
}

fn bed() -> Bed {
    bed_with(config())
}

impl Bed {
    /// A backing file of `blocks` blocks of [`BS`] bytes.
    fn file(&self, name: &str, blocks: u64) -> (PathBuf, Vec<u8>) {
        let path = self.dir.path().join(name);
        let data: Vec<u8> = (0..blocks * BS).map(|i| (i % 251) as u8).collect();
        File::create(&path).unwrap().write_all(&data).unwrap();
        (path, data)
    }

    fn elapsed(&self) -> Duration {
        self.clock.elapsed()
    }

    /// Kinds of the requests the daemon received, with their connections.
    fn log(&self) -> Vec<(u64, &'static str)> {
        self.script
            .take_log()
            .iter()
            .map(|c| (c.conn, kind(c)))
            .collect()
    }
}

fn kind(c: &Call) -> &'static str {
    match &c.req.kind {
        Some(request::Kind::Open(_)) => "open",
        Some(request::Kind::OpenMany(_)) => "open_many",
        Some(request::Kind::Wait(_)) => "wait",
        Some(request::Kind::Status(_)) => "status",
        _ => "other",
    }
}

/// The daemon's "opened" for the backing file at `path`, with blocks `present`; the
/// data descriptor is the backing file itself (its bytes are the cached copy's).
fn opened(path: &PathBuf, present: &[u64]) -> Answer {
    let f = File::open(path).unwrap();
    let version = version_of(&f).unwrap();
    Answer::with_fds(
        response::Kind::Open(pb::OpenReply {
            result: Some(open_reply::Result::Opened(pb::Opened {
                version: Some(version),
                block_size: BS as u32,
                present: bitmap(present),
                data_gen: 1,
                job_tag: 0,
            })),
        }),
        vec![OwnedFd::from(f)],
    )
}

fn bitmap(blocks: &[u64]) -> Vec<u8> {
    let mut b = vec![0u8; 8];
    for &i in blocks {
        b[(i / 8) as usize] |= 1 << (i % 8);
    }
    b
}

/// A wait's answer: `present`, still `filling` or not, after `after` (the daemon's
/// long poll runs until its slice ends when the block does not land).
fn waited(present: &[u64], filling: bool, declined: bool, after: Duration) -> Answer {
    Answer::after(
        after,
        response::Kind::Wait(pb::WaitReply {
            result: Some(wait_reply::Result::Waited(pb::Waited {
                present: bitmap(present),
                data_gen: 1,
                declined,
                filling,
            })),
        }),
    )
}

fn wait_req(c: &Call) -> Option<&pb::WaitRequest> {
    match &c.req.kind {
        Some(request::Kind::Wait(w)) => Some(w),
        _ => None,
    }
}

fn status_reply() -> Answer {
    Answer::reply(response::Kind::Status(pb::StatusReply::default()))
}

fn read_all(r: &crate::Reader) -> Vec<u8> {
    let mut out = vec![0u8; r.len() as usize];
    let mut off = 0;
    while off < out.len() {
        let n = r.read_at(&mut out[off..], off as u64).unwrap();
        assert!(n > 0);
        off += n;
    }
    out
}

#[test]
fn an_absent_daemon_sends_opens_to_the_backing_store_and_is_retried_after_retry_after() {
    let b = bed();
    let (path, data) = b.file("f", 2);
    b.script.refuse_connections(true);
    let r = b.client.open(&path).unwrap();
    assert_eq!(r.source(), Source::Backing);
    assert_eq!(r.reason(), FallbackReason::Unavailable);
    assert_eq!(read_all(&r), data);
    assert_eq!(b.script.refused(), 1);
    // Down for retry_after: not even a connection is tried.
    b.clock.advance(RETRY_AFTER - Duration::from_millis(1));
    let r = b.client.open(&path).unwrap();
    assert_eq!(r.source(), Source::Backing);
    assert_eq!(r.reason(), FallbackReason::Unavailable);
    assert_eq!(b.script.refused(), 1, "the breaker kept the client off");
    // Then it tries again, and the daemon is back.
    b.clock.advance(Duration::from_millis(1));
    b.script.refuse_connections(false);
    let p = path.clone();
    b.script.set(move |_| opened(&p, &[0, 1]));
    let r = b.client.open(&path).unwrap();
    assert_eq!(r.source(), Source::Cache);
    assert_eq!(read_all(&r), data);
    assert_eq!(r.stats().hit_bytes, 2 * BS);
    assert_eq!(b.elapsed(), RETRY_AFTER, "nothing waited on the daemon");
}

#[test]
fn a_hung_daemon_costs_an_open_timeout_once_per_retry_after() {
    let b = bed();
    let (path, data) = b.file("f", 1);
    b.script.set(|_| Answer::Hang);
    let r = b.client.open(&path).unwrap();
    assert_eq!(b.elapsed(), TIMEOUT, "the open waited exactly `timeout`");
    assert_eq!(r.source(), Source::Backing);
    assert_eq!(r.reason(), FallbackReason::Timeout);
    assert_eq!(read_all(&r), data);
    // Every open for retry_after goes straight to the backing store.
    for _ in 0..5 {
        let r = b.client.open(&path).unwrap();
        assert_eq!(r.reason(), FallbackReason::Unavailable);
    }
    assert_eq!(b.elapsed(), TIMEOUT);
    assert_eq!(b.log(), [(0, "open")]);
    // After retry_after the daemon is asked again, on a new connection.
    b.clock.advance(RETRY_AFTER);
    let r = b.client.open(&path).unwrap();
    assert_eq!(r.reason(), FallbackReason::Timeout);
    assert_eq!(b.log(), [(1, "open")]);
    assert_eq!(b.elapsed(), 2 * TIMEOUT + RETRY_AFTER);
}

#[test]
fn a_connection_that_timed_out_is_never_reused() {
    let b = bed();
    let (path, _) = b.file("f", 1);
    let p = path.clone();
    // The first open is answered (its connection is pooled); the second only after
    // 1.5 s, past the timeout; every later one at once.
    let n = AtomicU64::new(0);
    b.script
        .set(move |_| match n.fetch_add(1, Ordering::SeqCst) {
            1 => {
                let Answer::Reply { kind, fds, .. } = opened(&p, &[0]) else {
                    unreachable!()
                };
                Answer::Reply {
                    kind,
                    fds,
                    after: Duration::from_millis(1500),
                }
            }
            _ => opened(&p, &[0]),
        });
    assert_eq!(b.client.open(&path).unwrap().source(), Source::Cache);
    let r = b.client.open(&path).unwrap();
    assert_eq!(r.reason(), FallbackReason::Timeout);
    b.clock.advance(RETRY_AFTER);
    for _ in 0..3 {
        let r = b.client.open(&path).unwrap();
        assert_eq!(r.source(), Source::Cache, "{:?}", r.fallback_reason());
    }
    // Connection 0 carried the late answer's request and was dropped; the next opens
    // went on a new one (which, answered in time, was pooled and reused).
    assert_eq!(
        b.log(),
        [
            (0, "open"),
            (0, "open"),
            (1, "open"),
            (1, "open"),
            (1, "open")
        ]
    );
}

#[test]
fn a_stale_pooled_connection_is_retried_on_a_fresh_one() {
    let b = bed();
    b.script.set(|_| status_reply());
    b.client.status().unwrap();
    // The daemon restarted: the pooled connection is closed. The call goes on, on a
    // new connection, at once, and the daemon is not marked down.
    b.script.set(|c| {
        if c.conn == 0 {
            Answer::Close
        } else {
            status_reply()
        }
    });
    b.client.status().unwrap();
    b.client.status().unwrap();
    assert_eq!(
        b.log(),
        [(0, "status"), (0, "status"), (1, "status"), (1, "status")]
    );
    assert_eq!(b.elapsed(), Duration::ZERO);
}

#[test]
fn a_fresh_connection_closed_unanswered_marks_the_daemon_down() {
    let b = bed();
    b.script.set(|_| Answer::Close);
    let e = b.client.status().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    b.script.set(|_| status_reply());
    assert!(b.client.status().is_err(), "down for retry_after");
    b.clock.advance(RETRY_AFTER);
    b.client.status().unwrap();
    assert_eq!(b.script.connects(), 2);
}

#[test]
fn a_live_fill_is_waited_for_in_slices_of_half_the_timeout() {
    let b = bed();
    let (path, data) = b.file("f", 2);
    let p = path.clone();
    let slice = TIMEOUT / 2;
    let n = AtomicU64::new(0);
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[1]),
        // Three slices end with the block still being filled; it lands in the fourth.
        Some(request::Kind::Wait(_)) if n.fetch_add(1, Ordering::SeqCst) < 3 => {
            waited(&[1], true, false, slice)
        }
        Some(request::Kind::Wait(_)) => waited(&[0, 1], false, false, Duration::from_millis(200)),
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    let mut buf = vec![0u8; BS as usize];
    assert_eq!(r.read_at(&mut buf, 0).unwrap(), BS as usize);
    assert_eq!(buf, data[..BS as usize]);
    let s = r.stats();
    assert_eq!((s.filled_bytes, s.fallback_bytes), (BS, 0));
    assert_eq!(s.wait_time, 3 * slice + Duration::from_millis(200));
    assert_eq!(b.elapsed(), s.wait_time);
    let log = b.script.take_log();
    let waits: Vec<&pb::WaitRequest> = log.iter().filter_map(wait_req).collect();
    assert_eq!(waits.len(), 4);
    for (i, w) in waits.iter().enumerate() {
        assert_eq!(w.timeout_ms, 500, "slice {i}");
        assert_eq!(w.resumed, i > 0, "slice {i}");
        assert!(w.more, "slice {i}: wait_timeout is far");
        assert_eq!((w.first_block, w.count), (0, 1));
    }
    // Every slice went on the one pooled connection.
    assert!(log.iter().all(|c| c.conn == 0));
}

#[test]
fn a_fill_slower_than_wait_timeout_falls_back_when_the_budget_is_spent() {
    let b = bed_with(ClientConfig {
        wait_timeout: Duration::from_millis(1800),
        ..config()
    });
    let (path, data) = b.file("f", 1);
    let p = path.clone();
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[]),
        Some(request::Kind::Wait(w)) => {
            waited(&[], true, false, Duration::from_millis(w.timeout_ms.into()))
        }
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    assert_eq!(read_all(&r), data);
    assert_eq!(r.reason(), FallbackReason::WaitTimeout);
    assert_eq!(
        b.elapsed(),
        Duration::from_millis(1800),
        "exactly wait_timeout"
    );
    let s = r.stats();
    assert_eq!((s.fallback_bytes, s.filled_bytes + s.hit_bytes), (BS, 0));
    let log = b.script.take_log();
    let slices: Vec<(u32, bool, bool)> = log
        .iter()
        .filter_map(wait_req)
        .map(|w| (w.timeout_ms, w.resumed, w.more))
        .collect();
    // The last slice asks for what is left of the budget, and says it is the last.
    assert_eq!(
        slices,
        [
            (500, false, true),
            (500, true, true),
            (500, true, true),
            (300, true, false)
        ]
    );
}

#[test]
fn a_daemon_that_hangs_during_a_wait_costs_the_reader_at_most_timeout() {
    let b = bed();
    let (path, data) = b.file("f", 1);
    let p = path.clone();
    let n = AtomicU64::new(0);
    let slice = TIMEOUT / 2;
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[]),
        // Two slices of a live fill, then the daemon stops answering.
        Some(request::Kind::Wait(_)) if n.fetch_add(1, Ordering::SeqCst) < 2 => {
            waited(&[], true, false, slice)
        }
        _ => Answer::Hang,
    });
    let r = b.client.open(&path).unwrap();
    assert_eq!(read_all(&r), data);
    assert_eq!(r.reason(), FallbackReason::Timeout);
    assert_eq!(
        b.elapsed(),
        2 * slice + TIMEOUT,
        "the hang cost one `timeout`"
    );
    // The next read of the file, and of another, does not wait again.
    let (other, _) = b.file("g", 1);
    let r2 = b.client.open(&other).unwrap();
    assert_eq!(r2.source(), Source::Backing);
    assert_eq!(b.elapsed(), 2 * slice + TIMEOUT);
}

#[test]
fn a_declined_or_refused_wait_and_an_idle_queue_fall_back_at_once() {
    // (the answer, the reason, how many waits two reads make: a declined or refused
    // file is not asked about again; a block nothing fills (a full queue) is asked for
    // again by the next read)
    for (answer, reason, waits) in [
        (
            waited(&[], false, true, Duration::ZERO),
            FallbackReason::Declined,
            1,
        ),
        (
            waited(&[], false, false, Duration::ZERO),
            FallbackReason::Declined,
            2,
        ),
        (
            Answer::reply(response::Kind::Wait(pb::WaitReply {
                result: Some(wait_reply::Result::Refused(pb::Refused {
                    reason: pb::Reason::Stale as i32,
                    message: "changed".into(),
                })),
            })),
            FallbackReason::Stale,
            1,
        ),
        (
            Answer::reply(response::Kind::Status(pb::StatusReply::default())),
            FallbackReason::Protocol,
            2,
        ),
    ] {
        let b = bed();
        let (path, data) = b.file("f", 1);
        let p = path.clone();
        let mut answer = Some(answer);
        b.script.set(move |c| match &c.req.kind {
            Some(request::Kind::Open(_)) => opened(&p, &[]),
            Some(request::Kind::Wait(_)) => answer
                .take()
                .unwrap_or_else(|| waited(&[], false, true, Duration::ZERO)),
            _ => status_reply(),
        });
        let r = b.client.open(&path).unwrap();
        assert_eq!(read_all(&r), data);
        assert_eq!(r.reason(), reason);
        assert_eq!(b.elapsed(), Duration::ZERO);
        let mut buf = [0u8; 1];
        r.read_at(&mut buf, 0).unwrap();
        let n = b.script.take_log().iter().filter_map(wait_req).count();
        assert_eq!(n, waits, "{reason:?}");
    }
}

#[test]
fn open_many_and_open_ahead_fall_back_together_when_the_daemon_hangs() {
    let b = bed();
    let files: Vec<PathBuf> = (0..5).map(|i| b.file(&format!("f{i}"), 1).0).collect();
    b.script.set(|_| Answer::Hang);
    let rs = b.client.open_many(&files);
    assert_eq!(b.elapsed(), TIMEOUT);
    for r in &rs {
        assert_eq!(r.as_ref().unwrap().reason(), FallbackReason::Timeout);
    }
    b.clock.advance(RETRY_AFTER);
    let rs: Vec<_> = b.client.open_ahead(&files, 2).collect();
    assert_eq!(rs.len(), 5);
    // The first batch timed out; the rest were not sent (the daemon is down).
    assert_eq!(b.elapsed(), 2 * TIMEOUT + RETRY_AFTER);
    let reasons: Vec<FallbackReason> = rs.iter().map(|r| r.as_ref().unwrap().reason()).collect();
    use FallbackReason::{Timeout, Unavailable};
    assert_eq!(
        reasons,
        [Timeout, Timeout, Unavailable, Unavailable, Unavailable]
    );
}

#[test]
fn read_reports_ride_on_the_next_request_and_come_back_when_it_fails() {
    let b = bed();
    let (path, _) = b.file("f", 1);
    b.script.refuse_connections(true);
    let r = b.client.open(&path).unwrap();
    read_all(&r);
    b.clock.advance(RETRY_AFTER);
    b.script.refuse_connections(false);
    // The daemon hangs: the report sent with the status is not delivered.
    b.script.set(|_| Answer::Hang);
    assert!(b.client.status().is_err());
    b.clock.advance(RETRY_AFTER);
    b.script.set(|_| status_reply());
    b.client.status().unwrap();
    let log = b.script.take_log();
    let reports: Vec<Option<pb::ReadReport>> = log.into_iter().map(|c| c.req.report).collect();
    let sent = reports[0].clone().unwrap();
    assert_eq!((sent.fallback_opens, sent.fallback_reads), (1, 1));
    assert_eq!(sent.fallbacks[0].reason, FallbackReason::Unavailable as i32);
    assert_eq!(reports[1], Some(sent), "given back, then delivered");
    b.client.status().unwrap();
    assert_eq!(b.script.take_log()[0].req.report, None, "delivered once");
}

#[test]
fn a_client_dropped_with_reads_unreported_delivers_them() {
    let b = bed();
    let (path, _) = b.file("f", 1);
    b.script.refuse_connections(true);
    read_all(&b.client.open(&path).unwrap());
    b.clock.advance(RETRY_AFTER);
    b.script.refuse_connections(false);
    b.script.set(|_| status_reply());
    let Bed { client, script, .. } = b;
    drop(client);
    let log = script.take_log();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].req.report.as_ref().unwrap().fallback_reads, 1);
}
