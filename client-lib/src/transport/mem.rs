//! A scripted daemon in the same process, for unit tests of everything above the
//! transport: a [`Script`] decides what each request gets ([`Answer`]: a reply after
//! some time, a frame out of step, a hang, a closed connection), and [`MemTransport`]
//! plays it out on a [`Clock`]. With a [`crate::clock::ManualClock`] nothing really
//! waits: an answer that takes 300 ms moves the clock 300 ms, a hang moves it by the
//! caller's whole timeout, and a reply later than the timeout stays queued on its
//! connection, where a caller that wrongly reused the connection would find it.
//!
//! The same [`Script`] is served over a real socket by the conformance suite's fixture,
//! so that what the fake does is what the socket does.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::response;
use shardcache_proto::wire::WireError;

use super::{Connection, Transport, timed_out};
use crate::clock::Clock;

/// What the scripted daemon does with one request.
#[derive(Debug)]
pub(crate) enum Answer {
    /// Answers with `kind` (and the request's id), `fds` attached, `after` the request.
    Reply {
        kind: response::Kind,
        fds: Vec<OwnedFd>,
        after: Duration,
    },
    /// Sends `resp` as it is (another request's id, or id 0), `after` the request.
    Frame { resp: pb::Response, after: Duration },
    /// Never answers (a stopped or hung daemon).
    Hang,
    /// Closes the connection without answering.
    Close,
}

impl Answer {
    /// An immediate reply.
    pub(crate) fn reply(kind: response::Kind) -> Self {
        Self::Reply {
            kind,
            fds: Vec::new(),
            after: Duration::ZERO,
        }
    }

    /// A reply after `after`.
    pub(crate) fn after(after: Duration, kind: response::Kind) -> Self {
        Self::Reply {
            kind,
            fds: Vec::new(),
            after,
        }
    }

    /// An immediate reply with descriptors.
    pub(crate) fn with_fds(kind: response::Kind, fds: Vec<OwnedFd>) -> Self {
        Self::Reply {
            kind,
            fds,
            after: Duration::ZERO,
        }
    }
}

/// One request as the daemon received it.
#[derive(Debug)]
pub(crate) struct Call {
    /// Which connection it came on (numbered from 0 in the order they were made).
    pub conn: u64,
    pub req: pb::Request,
    /// The descriptors that came with it.
    pub fds: Vec<OwnedFd>,
}

type Handler = Box<dyn FnMut(&Call) -> Answer + Send>;

/// The scripted daemon: a handler deciding each answer, a switch refusing connections,
/// and the log of what it was sent.
pub(crate) struct Script {
    handler: Mutex<Handler>,
    refuse: AtomicBool,
    connects: AtomicU64,
    refused: AtomicU64,
    log: Mutex<Vec<Call>>,
}

impl fmt::Debug for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Script")
            .field("connects", &self.connects)
            .finish_non_exhaustive()
    }
}

impl Script {
    /// A daemon answering every request with `handler`.
    pub(crate) fn new(handler: impl FnMut(&Call) -> Answer + Send + 'static) -> Arc<Self> {
        Arc::new(Self {
            handler: Mutex::new(Box::new(handler)),
            refuse: AtomicBool::new(false),
            connects: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
        })
    }

    /// Replaces the handler (the daemon changes its behaviour from now on).
    pub(crate) fn set(&self, handler: impl FnMut(&Call) -> Answer + Send + 'static) {
        *self.handler.lock().unwrap_or_else(|e| e.into_inner()) = Box::new(handler);
    }

    /// Refuses (`true`) or accepts new connections, as an absent or present daemon.
    pub(crate) fn refuse_connections(&self, refuse: bool) {
        self.refuse.store(refuse, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub(crate) fn connects(&self) -> u64 {
        self.connects.load(Ordering::SeqCst)
    }

    /// Connections refused so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// Takes the log of requests received so far.
    pub(crate) fn take_log(&self) -> Vec<Call> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A new connection's number, or the refusal.
    pub(crate) fn accept(&self) -> io::Result<u64> {
        if self.refuse.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "mem: connection refused",
            ));
        }
        Ok(self.connects.fetch_add(1, Ordering::SeqCst))
    }

    /// The answer to `call`, which is then logged.
    pub(crate) fn answer(&self, call: Call) -> Answer {
        let a = (self.handler.lock().unwrap_or_else(|e| e.into_inner()))(&call);
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(call);
        a
    }
}

/// Connections to a [`Script`], in time kept by a [`Clock`].
#[derive(Debug, Clone)]
pub(crate) struct MemTransport {
    script: Arc<Script>,
    clock: Arc<dyn Clock>,
}

impl MemTransport {
    pub(crate) fn new(script: Arc<Script>, clock: Arc<dyn Clock>) -> Self {
        Self { script, clock }
    }
}

impl Transport for MemTransport {
    fn connect(&self) -> io::Result<Box<dyn Connection>> {
        let id = self.script.accept()?;
        Ok(Box::new(MemConnection {
            id,
            script: self.script.clone(),
            clock: self.clock.clone(),
            queue: VecDeque::new(),
            closed: false,
        }))
    }
}

/// An answer on its way: what, and from when it can be received.
enum Queued {
    Frame {
        resp: Box<pb::Response>,
        fds: Vec<OwnedFd>,
        at: Instant,
    },
    Hang,
    Close,
}

struct MemConnection {
    id: u64,
    script: Arc<Script>,
    clock: Arc<dyn Clock>,
    queue: VecDeque<Queued>,
    closed: bool,
}

impl Connection for MemConnection {
    fn send(
        &mut self,
        req: &pb::Request,
        fds: &[BorrowedFd<'_>],
        _timeout: Duration,
    ) -> Result<(), WireError> {
        if self.closed {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe).into());
        }
        let fds = fds
            .iter()
            .map(|f| f.try_clone_to_owned())
            .collect::<io::Result<Vec<_>>>()?;
        let call = Call {
            conn: self.id,
            req: req.clone(),
            fds,
        };
        let now = self.clock.now();
        let q = match self.script.answer(call) {
            Answer::Reply { kind, fds, after } => Queued::Frame {
                resp: Box::new(pb::Response {
                    id: req.id,
                    kind: Some(kind),
                }),
                fds,
                at: now + after,
            },
            Answer::Frame { resp, after } => Queued::Frame {
                resp: Box::new(resp),
                fds: Vec::new(),
                at: now + after,
            },
            Answer::Hang => Queued::Hang,
            Answer::Close => Queued::Close,
        };
        self.queue.push_back(q);
        Ok(())
    }

    fn recv(
        &mut self,
        timeout: Duration,
        _spin: Duration,
    ) -> Result<(pb::Response, Vec<OwnedFd>), WireError> {
        let now = self.clock.now();
        match self.queue.front() {
            _ if self.closed => Err(WireError::Closed),
            Some(Queued::Close) => {
                self.closed = true;
                self.queue.clear();
                Err(WireError::Closed)
            }
            Some(Queued::Frame { at, .. }) if at.saturating_duration_since(now) <= timeout => {
                self.clock.sleep(at.saturating_duration_since(now));
                match self.queue.pop_front() {
                    Some(Queued::Frame { resp, fds, .. }) => Ok((*resp, fds)),
                    _ => unreachable!("the front was a frame"),
                }
            }
            // Not (yet) answered: the whole timeout passes.
            Some(Queued::Frame { .. } | Queued::Hang) | None => {
                self.clock.sleep(timeout);
                Err(timed_out())
            }
        }
    }
}
