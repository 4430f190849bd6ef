//! The client's fallback logic, tested in-process: a [`Client`] over the scripted daemon
//! of [`crate::transport::mem`] on a [`ManualClock`], so that every bound of
//! docs/SEMANTICS.md section 2 is checked exactly (the clock moves only while the fake
//! daemon takes its time) and nothing sleeps. The trust suite's `stalls` tests hold the
//! same bounds end to end, against the real daemon.
//!
//! Also here, over the same fake: the reader's decisions about the local copy (a
//! replaced data file, an unreadable copy, a backing file changed under the reader,
//! `local_copy`) and what the client's calls send and make of refusals.

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
                read_backing: false,
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
    assert_eq!(r.fallback(), Some(crate::FallbackReason::Unavailable));
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
    assert_eq!(r.fallback(), None);
    assert_eq!(b.elapsed(), RETRY_AFTER, "nothing waited on the daemon");
}

#[test]
fn a_cold_file_the_daemon_fills_behind_its_reader_is_read_from_the_backing_store_without_a_wait() {
    let b = bed();
    let (path, data) = b.file("f", 1);
    let p = path.clone();
    b.script.set(move |_| {
        let Answer::Reply { kind, .. } = opened(&p, &[]) else {
            unreachable!()
        };
        let response::Kind::Open(mut o) = kind else {
            unreachable!()
        };
        if let Some(open_reply::Result::Opened(x)) = &mut o.result {
            x.read_backing = true;
            x.data_gen = 0;
        }
        Answer::reply(response::Kind::Open(o))
    });
    let r = b.client.open(&path).unwrap();
    assert_eq!(r.source(), Source::Backing);
    assert_eq!(r.fallback(), Some(crate::FallbackReason::Direct));
    assert_eq!(read_all(&r), data);
    assert_eq!(r.stats().fallback_bytes, data.len() as u64);
    // The shim's open: the caller opens the file itself; the open is counted.
    assert!(b.client.open_cached(&path).is_none());
    let calls = b.script.take_log();
    let kinds: Vec<_> = calls.iter().map(kind).collect();
    assert_eq!(kinds, ["open", "open"], "no wait asked for");
    assert_eq!(b.elapsed(), Duration::ZERO);
    // Each open is reported as a direct read of the backing store: the first with the
    // second request, the second still to send.
    let direct = |rep: &pb::ReadReport| {
        let f = rep
            .fallbacks
            .iter()
            .find(|f| f.reason == pb::FallbackReason::Direct as i32)
            .expect("direct fallbacks reported");
        (f.opens, f.reads, rep.fallback_opens)
    };
    let sent = calls[1].req.report.as_ref().expect("a report");
    assert_eq!(direct(sent), (1, 1, 1));
    let rest = b.client.inner.report.take().expect("a report");
    assert_eq!(direct(&rest), (1, 0, 1));
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

// The reader's own decisions over the local copy: which descriptor it reads, what it does
// when the backing file changed under it, and `local_copy`.

/// The daemon's "opened" for the file at `path` (its version), with blocks `present` of
/// the local copy `data` (generation `gen`).
fn opened_copy(path: &PathBuf, present: &[u64], data: File, data_gen: u64) -> Answer {
    let version = version_of(&File::open(path).unwrap()).unwrap();
    Answer::with_fds(
        response::Kind::Open(pb::OpenReply {
            result: Some(open_reply::Result::Opened(pb::Opened {
                version: Some(version),
                block_size: BS as u32,
                present: bitmap(present),
                data_gen,
                job_tag: 0,
                read_backing: false,
            })),
        }),
        vec![OwnedFd::from(data)],
    )
}

/// A local copy holding `bytes`.
fn copy_of(b: &Bed, name: &str, bytes: &[u8]) -> File {
    let p = b.dir.path().join(name);
    File::create(&p).unwrap().write_all(bytes).unwrap();
    File::open(p).unwrap()
}

#[test]
fn a_wait_that_replaces_the_data_file_brings_its_descriptor_and_reads_come_from_it() {
    let b = bed();
    let (path, data) = b.file("f", 1);
    // The first copy is stale garbage that is never read (no block present); the
    // daemon's wait answers with a new generation and its descriptor.
    let old = copy_of(&b, "old", &vec![0xee; BS as usize]);
    let new = copy_of(&b, "new", &data);
    let p = path.clone();
    let (mut old, mut new) = (Some(old), Some(new));
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened_copy(&p, &[], old.take().unwrap(), 1),
        Some(request::Kind::Wait(w)) => {
            assert_eq!(w.have_data_gen, 1);
            Answer::with_fds(
                response::Kind::Wait(pb::WaitReply {
                    result: Some(wait_reply::Result::Waited(pb::Waited {
                        present: bitmap(&[0]),
                        data_gen: 2,
                        declined: false,
                        filling: false,
                    })),
                }),
                vec![OwnedFd::from(new.take().unwrap())],
            )
        }
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    assert_eq!(read_all(&r), data);
    let s = r.stats();
    assert_eq!((s.filled_bytes, s.fallback_bytes), (BS, 0));
    assert_eq!(r.reason(), FallbackReason::Unspecified);
}

#[test]
fn a_new_generation_without_its_descriptor_is_a_protocol_fallback() {
    let b = bed();
    let (path, data) = b.file("f", 1);
    let p = path.clone();
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[]),
        Some(request::Kind::Wait(_)) => Answer::reply(response::Kind::Wait(pb::WaitReply {
            result: Some(wait_reply::Result::Waited(pb::Waited {
                present: bitmap(&[0]),
                data_gen: 2,
                declined: false,
                filling: false,
            })),
        })),
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    assert_eq!(read_all(&r), data);
    assert_eq!(r.reason(), FallbackReason::Protocol);
    assert_eq!(r.stats().fallback_bytes, BS);
}

#[test]
fn a_local_copy_that_cannot_be_read_falls_back_to_the_backing_file() {
    let b = bed();
    let (path, data) = b.file("f", 1);
    // A descriptor open for writing only: every read of it fails.
    let unreadable = std::fs::OpenOptions::new()
        .write(true)
        .open(b.dir.path().join("f"))
        .unwrap();
    let p = path.clone();
    let mut copy = Some(unreadable);
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened_copy(&p, &[0], copy.take().unwrap(), 1),
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    assert_eq!(read_all(&r), data);
    assert_eq!(r.reason(), FallbackReason::LocalError);
    let s = r.stats();
    assert_eq!((s.hit_bytes, s.fallback_bytes), (0, BS));
}

#[test]
fn a_file_changed_on_the_backing_store_is_read_new_before_anything_was_served_and_fails_after() {
    // Nothing served from the cache yet: the reader switches to the new version.
    let b = bed();
    let (path, _) = b.file("f", 2);
    let p = path.clone();
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[1]),
        Some(request::Kind::Wait(_)) => waited(&[1], false, true, Duration::ZERO),
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    let newer: Vec<u8> = vec![7u8; (3 * BS) as usize];
    // A new inode: a different version whatever the clock's resolution.
    std::fs::remove_file(&path).unwrap();
    File::create(&path).unwrap().write_all(&newer).unwrap();
    let mut buf = vec![0u8; BS as usize];
    assert_eq!(r.read_at(&mut buf, 0).unwrap(), BS as usize);
    assert_eq!(buf, newer[..BS as usize], "the new version");
    assert_eq!(r.reason(), FallbackReason::Stale);
    assert_eq!(r.len(), 3 * BS, "its size too");

    // A block served from the cache first: mixing versions is refused.
    let b = bed();
    let (path, data) = b.file("f", 2);
    let p = path.clone();
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[1]),
        Some(request::Kind::Wait(_)) => waited(&[1], false, true, Duration::ZERO),
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    let mut buf = vec![0u8; BS as usize];
    assert_eq!(r.read_at(&mut buf, BS).unwrap(), BS as usize);
    assert_eq!(buf, data[BS as usize..], "block 1 from the cache");
    std::fs::remove_file(&path).unwrap();
    File::create(&path).unwrap().write_all(&newer).unwrap();
    assert!(
        r.read_at(&mut buf, 0).is_err(),
        "no read mixes two versions"
    );
}

/// Opens `path` and takes its local copy, which must hold `data` whole; the waits it
/// took.
fn complete_copy(b: &Bed, path: &PathBuf, data: &[u8]) -> usize {
    let r = b.client.open(path).unwrap();
    let f = r.local_copy().expect("a complete copy");
    let mut got = vec![0u8; data.len()];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, 0).unwrap();
    assert_eq!(got, data);
    b.script.take_log().iter().filter_map(wait_req).count()
}

#[test]
fn local_copy_waits_for_every_block_and_hands_out_the_copy() {
    let b = bed();
    let (path, data) = b.file("f", 3);
    let p = path.clone();
    let n = AtomicU64::new(0);
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[0]),
        // Blocks land one wait at a time.
        Some(request::Kind::Wait(_)) => match n.fetch_add(1, Ordering::SeqCst) {
            0 => waited(&[0, 1], false, false, Duration::from_millis(10)),
            _ => waited(&[0, 1, 2], false, false, Duration::from_millis(10)),
        },
        _ => status_reply(),
    });
    let waits = complete_copy(&b, &path, &data);
    assert_eq!(waits, 2);
    assert_eq!(b.elapsed(), Duration::from_millis(20));

    // Declined: no copy, and the reader still reads the file.
    let b = bed();
    let (path, data) = b.file("f", 2);
    let p = path.clone();
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[0]),
        Some(request::Kind::Wait(_)) => waited(&[0], false, true, Duration::ZERO),
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    assert!(r.local_copy().is_none());
    assert_eq!(read_all(&r), data);
}

#[test]
fn local_copy_waits_for_a_file_that_lands_block_by_block() {
    // A large file on a slow link: each wait sees one more block land (the first one it
    // asked for). The copy is handed out once every block is there, however many waits
    // that takes; the shim read such files from the backing store after three waits.
    let b = bed();
    let (path, data) = b.file("f", 12);
    let p = path.clone();
    let landed = AtomicU64::new(1);
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[0]),
        Some(request::Kind::Wait(_)) => {
            let n = landed.fetch_add(1, Ordering::SeqCst) + 1;
            let present: Vec<u64> = (0..n).collect();
            waited(&present, n < 12, false, Duration::from_millis(400))
        }
        _ => status_reply(),
    });
    let waits = complete_copy(&b, &path, &data);
    assert_eq!(waits, 11);

    // A fill that stops making progress still ends the wait within `wait_timeout`.
    let b = bed();
    let (path, _) = b.file("f", 4);
    let p = path.clone();
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Open(_)) => opened(&p, &[0]),
        Some(request::Kind::Wait(w)) => waited(
            &[0],
            true,
            false,
            Duration::from_millis(u64::from(w.timeout_ms)),
        ),
        _ => status_reply(),
    });
    let r = b.client.open(&path).unwrap();
    assert!(r.local_copy().is_none());
    assert!(b.elapsed() <= b.client.inner.cfg.wait_timeout + b.client.inner.cfg.timeout);
}

// The client's calls: what goes by descriptor, and what the daemon's refusals become.

#[test]
fn a_manifest_over_one_request_goes_by_a_sealed_memfd() {
    let b = bed();
    let big = format!(
        r#"{{"version": 1, "job": "j", "pad": "{}"}}"#,
        "x".repeat(2 << 20)
    );
    let seen = Arc::new(std::sync::Mutex::new(None));
    let s = seen.clone();
    b.script.set(move |c| match &c.req.kind {
        Some(request::Kind::Register(r)) => {
            let fd = c.fds.first().map(|f| {
                let seals = rustix::fs::fcntl_get_seals(f).unwrap();
                // The descriptor's offset is the writer's (at the end): read from 0.
                let file = File::from(f.try_clone().unwrap());
                let mut text = vec![0u8; file.metadata().unwrap().len() as usize];
                std::os::unix::fs::FileExt::read_exact_at(&file, &mut text, 0).unwrap();
                (seals, text)
            });
            *s.lock().unwrap() = Some((r.manifest_fd, r.manifest_json.len(), fd));
            Answer::reply(response::Kind::Register(pb::RegisterReply {
                job: "j".into(),
                files: 3,
                ..Default::default()
            }))
        }
        _ => status_reply(),
    });
    let reg = b.client.register(&big).unwrap();
    assert_eq!((reg.job.as_str(), reg.files), ("j", 3));
    let (by_fd, inline, fd) = seen.lock().unwrap().take().unwrap();
    assert!(by_fd);
    assert_eq!(inline, 0, "nothing inline");
    let (seals, text) = fd.expect("a descriptor");
    use rustix::fs::SealFlags;
    assert!(
        seals.contains(SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
    );
    assert!(
        text == big.as_bytes(),
        "the manifest, whole ({} bytes)",
        text.len()
    );

    // A small one goes inline, with no descriptor.
    b.client.register(r#"{"version": 1}"#).unwrap();
    let (by_fd, inline, fd) = seen.lock().unwrap().take().unwrap();
    assert!(!by_fd && inline > 0 && fd.is_none());
}

#[test]
fn the_daemons_refusals_become_errors_of_their_kind() {
    use std::io::ErrorKind;
    for (code, kind) in [
        (pb::ErrorCode::NotFound, ErrorKind::NotFound),
        (pb::ErrorCode::PermissionDenied, ErrorKind::PermissionDenied),
        (pb::ErrorCode::Invalid, ErrorKind::InvalidInput),
        (pb::ErrorCode::Unspecified, ErrorKind::Other),
    ] {
        let b = bed();
        b.script.set(move |_| {
            Answer::reply(response::Kind::Error(pb::ErrorReply {
                message: "no".into(),
                code: code as i32,
            }))
        });
        let e = b
            .client
            .list(crate::ListQuery::default(), TIMEOUT)
            .unwrap_err();
        assert_eq!((e.kind(), e.to_string().as_str()), (kind, "no"), "{code:?}");
        let e = b
            .client
            .evict(crate::EvictTarget::All, TIMEOUT)
            .unwrap_err();
        assert_eq!(e.kind(), kind, "{code:?}");
        // A refused registration is always the manifest's fault.
        let e = b.client.register("{}").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
    // A reply of the wrong kind is a protocol error, not a panic.
    let b = bed();
    b.script.set(|_| status_reply());
    assert_eq!(
        b.client.verify(TIMEOUT).unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );
}
