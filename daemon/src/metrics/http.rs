//! The HTTP endpoint: `GET /metrics` (Prometheus text format), `GET /healthz` (liveness)
//! and `GET /readyz` (readiness), nothing else.
//!
//! It runs on a thread of its own with a current-thread tokio runtime and hyper's HTTP/1
//! server (both already in the daemon for the peer service), so that a slow or hostile
//! client of this port can never hold up the request threads. It is kept small and
//! bounded: at most [`MAX_CONNECTIONS`] connections, request heads of at most
//! [`MAX_HEAD`] bytes read within [`HEAD_TIMEOUT`] (which also closes a keep-alive
//! connection idle that long: hyper's header-read timer runs from the moment it waits
//! for a head), a connection lives at most [`MAX_CONNECTION_LIFE`], and a render runs on
//! the blocking pool, one at a time (scrapes are serialized, so that a burst of them
//! cannot multiply the work).
//!
//! The kubelet's liveness probe must be answered however many connections others hold
//! (a refused probe restarts a healthy daemon). So every connection is accepted (the
//! listen backlog never fills), and at the bound the newcomer takes the place of the
//! connection that has done least lately: one waiting for a request (idle longest,
//! whether it sent nothing, trickles a head, or idles between requests) first, then one
//! whose reply its client does not read (blocked longest), and only then one with a
//! request in progress (the longest). A flood of idle, trickling or unread connections
//! thus costs a probe nothing: it is the newest connection, and answered at once.
//!
//! What the answers mean is the [`Endpoint`]'s business (the daemon's wiring decides
//! what "alive" and "ready" are).

use crate::lifecycle::Task;
use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

/// Most connections held at once; a newcomer beyond takes the place of one (see the
/// module's doc).
pub const MAX_CONNECTIONS: usize = 256;
/// Largest request head accepted (hyper's smallest allowed buffer).
pub const MAX_HEAD: usize = 8192;
/// Longest wait for a whole request head, however it trickles in (also bounds an idle
/// keep-alive connection).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a connection is kept (a scraper simply connects again).
pub const MAX_CONNECTION_LIFE: Duration = Duration::from_secs(300);

/// What the endpoint serves.
pub trait Endpoint: Send + Sync + 'static {
    /// The Prometheus text exposition (may block: it runs on the blocking pool).
    fn render(&self) -> String;
    /// `Ok` while the daemon's loops are alive; else what is not.
    fn healthy(&self) -> Result<(), String>;
    /// `Ok` when the daemon serves clients; else why not.
    fn ready(&self) -> Result<(), String>;
}

/// Longest [`HttpServer::close`] waits for the server thread (its runtime gives open
/// connections 1 s).
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Binds `addr` (before anything else starts, so that a taken port stops the daemon at
/// once).
pub fn bind(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// The running endpoint.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    /// The server thread (stopping it tells the runtime to stop).
    task: Task,
}

impl HttpServer {
    /// Serves `listener` (from [`bind`]) until [`HttpServer::close`].
    pub fn start(listener: std::net::TcpListener, endpoint: Arc<dyn Endpoint>) -> io::Result<Self> {
        let addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(2)
            .thread_name("sc-metrics-blocking")
            .build()?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task = Task::spawn("sc-metrics", alive, move |_| {
            rt.block_on(async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => serve(l, endpoint, stopped).await,
                    Err(e) => tracing::error!(error = %e, "metrics endpoint cannot start"),
                }
            });
            // Connections still open are dropped with the runtime.
            rt.shutdown_timeout(Duration::from_secs(1));
        })?
        .with_wake(move || {
            let _ = stop.send(true);
        });
        Ok(Self { addr, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// True while the server thread runs.
    pub fn is_alive(&self) -> bool {
        self.task.alive()
    }

    /// Stops accepting, drops open connections and waits (bounded) for the thread.
    pub fn close(&mut self) {
        self.task.shutdown(CLOSE_WAIT);
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.close();
    }
}

/// What one connection is doing, as the accept loop sees it when it needs room:
/// nanoseconds since the server's epoch (0: not so).
#[derive(Debug, Default)]
struct Activity {
    /// Since when it waits for a request (its acceptance, or the end of its last reply).
    idle_since: AtomicU64,
    /// Since when a request is in the service (the render included).
    busy_since: AtomicU64,
    /// Since when its reply cannot be written (its client does not read).
    blocked_since: AtomicU64,
}

impl Activity {
    /// The order in which connections give way: smallest first.
    fn rank(&self) -> (u8, u64) {
        let blocked = self.blocked_since.load(Ordering::Relaxed);
        let busy = self.busy_since.load(Ordering::Relaxed);
        if blocked != 0 {
            (1, blocked)
        } else if busy != 0 {
            (2, busy)
        } else {
            (0, self.idle_since.load(Ordering::Relaxed))
        }
    }
}

/// Nanoseconds since `epoch`, never 0.
fn since(epoch: Instant) -> u64 {
    (epoch.elapsed().as_nanos() as u64).max(1)
}

/// A connection held: what it does, and how to close it.
struct Held {
    activity: Arc<Activity>,
    close: Arc<tokio::sync::Notify>,
}

/// Marks a request in the service until dropped (the reply is built, or the connection
/// dropped).
struct InService(Arc<Activity>, Instant);

impl InService {
    fn new(a: &Arc<Activity>, epoch: Instant) -> Self {
        a.busy_since.store(since(epoch), Ordering::Relaxed);
        Self(a.clone(), epoch)
    }
}

impl Drop for InService {
    fn drop(&mut self) {
        self.0.idle_since.store(since(self.1), Ordering::Relaxed);
        self.0.busy_since.store(0, Ordering::Relaxed);
    }
}

/// The socket, noting when its writes are blocked (its client does not read its reply).
struct Watched {
    io: tokio::net::TcpStream,
    activity: Arc<Activity>,
    epoch: Instant,
}

impl Watched {
    fn note<T>(&self, p: Poll<T>) -> Poll<T> {
        let b = &self.activity.blocked_since;
        match p {
            Poll::Pending => {
                if b.load(Ordering::Relaxed) == 0 {
                    b.store(since(self.epoch), Ordering::Relaxed);
                }
            }
            Poll::Ready(_) => b.store(0, Ordering::Relaxed),
        }
        p
    }
}

impl tokio::io::AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let p = Pin::new(&mut self.io).poll_write(cx, buf);
        self.note(p)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let p = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.note(p)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let p = Pin::new(&mut self.io).poll_flush(cx);
        self.note(p)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

type Table = Arc<parking_lot::Mutex<HashMap<u64, Held>>>;

/// Makes room for one more connection: closes the one that gives way first (see the
/// module's doc).
fn make_room(table: &Table) {
    let mut t = table.lock();
    if t.len() < MAX_CONNECTIONS {
        return;
    }
    let victim = t
        .iter()
        .min_by_key(|(id, h)| (h.activity.rank(), **id))
        .map(|(id, _)| *id);
    if let Some(h) = victim.and_then(|id| t.remove(&id)) {
        h.close.notify_one();
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    endpoint: Arc<dyn Endpoint>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let table: Table = Arc::default();
    let render = Arc::new(tokio::sync::Mutex::new(()));
    let epoch = Instant::now();
    let mut next_id = 0u64;
    loop {
        let (stream, peer) = tokio::select! {
            _ = stopped.changed() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors, most likely: back off instead of spinning.
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        make_room(&table);
        let id = next_id;
        next_id += 1;
        let activity = Arc::new(Activity::default());
        activity.idle_since.store(since(epoch), Ordering::Relaxed);
        let close = Arc::new(tokio::sync::Notify::new());
        table.lock().insert(
            id,
            Held {
                activity: activity.clone(),
                close: close.clone(),
            },
        );
        let (endpoint, render, table) = (endpoint.clone(), render.clone(), table.clone());
        tokio::spawn(async move {
            let a = activity.clone();
            let service = hyper::service::service_fn(move |req| {
                let busy = InService::new(&a, epoch);
                let (endpoint, render) = (endpoint.clone(), render.clone());
                async move {
                    let r = respond(req, endpoint, render).await;
                    drop(busy);
                    r
                }
            });
            let io = Watched {
                io: stream,
                activity,
                epoch,
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD)
                .serve_connection(TokioIo::new(io), service);
            // Past its lifetime, or chosen to make room, the connection is dropped
            // (closed); a scraper simply connects again.
            tokio::select! {
                r = tokio::time::timeout(MAX_CONNECTION_LIFE, conn) => {
                    if let Ok(Err(e)) = r {
                        tracing::debug!(%peer, error = %e, "metrics connection ended");
                    }
                }
                _ = close.notified() => {
                    tracing::debug!(%peer, "metrics connection closed to make room");
                }
            }
            table.lock().remove(&id);
        });
    }
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

const TEXT: &str = "text/plain; charset=utf-8";
/// The Prometheus text exposition format.
const EXPOSITION: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn respond(
    req: Request<Incoming>,
    endpoint: Arc<dyn Endpoint>,
    render: Arc<tokio::sync::Mutex<()>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, TEXT, "only GET\n");
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return Ok(r);
    }
    let probe = |r: Result<(), String>| match r {
        Ok(()) => reply(StatusCode::OK, TEXT, "ok\n"),
        Err(why) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{why}\n")),
    };
    Ok(match req.uri().path() {
        "/metrics" => {
            let _one = render.lock().await;
            let ep = endpoint.clone();
            match tokio::task::spawn_blocking(move || ep.render()).await {
                Ok(text) => reply(StatusCode::OK, EXPOSITION, text),
                Err(e) => {
                    tracing::warn!(error = %e, "rendering metrics failed");
                    reply(StatusCode::INTERNAL_SERVER_ERROR, TEXT, "render failed\n")
                }
            }
        }
        "/healthz" => probe(endpoint.healthy()),
        "/readyz" => probe(endpoint.ready()),
        _ => reply(
            StatusCode::NOT_FOUND,
            TEXT,
            "not found: /metrics, /healthz, /readyz\n",
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};

    struct Fake {
        ready: AtomicBool,
    }

    impl Endpoint for Fake {
        fn render(&self) -> String {
            "# TYPE x counter\nx 1\n".into()
        }
        fn healthy(&self) -> Result<(), String> {
            Ok(())
        }
        fn ready(&self) -> Result<(), String> {
            if self.ready.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("not yet".into())
            }
        }
    }

    fn get(addr: SocketAddr, req: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // (A server refusing an oversized head may close before all of it is written.)
        let _ = s.write_all(req.as_bytes());
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    #[test]
    fn connections_give_way_idle_first_then_unread_then_in_progress() {
        let at = |idle: u64, busy: u64, blocked: u64| {
            let a = Activity::default();
            a.idle_since.store(idle, Ordering::Relaxed);
            a.busy_since.store(busy, Ordering::Relaxed);
            a.blocked_since.store(blocked, Ordering::Relaxed);
            a.rank()
        };
        let idle_long = at(1, 0, 0);
        let idle_new = at(9, 0, 0);
        let unread = at(1, 0, 5);
        let in_progress = at(1, 2, 0);
        assert!(idle_long < idle_new && idle_new < unread && unread < in_progress);
    }

    #[test]
    fn serves_the_three_paths_and_nothing_else() {
        let fake = Arc::new(Fake {
            ready: AtomicBool::new(false),
        });
        let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut srv = HttpServer::start(l, fake.clone()).unwrap();
        let a = srv.addr();
        assert_ne!(a.port(), 0);
        let close = "Connection: close\r\n\r\n";
        let r = get(a, &format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{close}"));
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("version=0.0.4") && r.ends_with("x 1\n"), "{r}");
        let r = get(a, &format!("GET /readyz HTTP/1.1\r\nHost: x\r\n{close}"));
        assert!(
            r.starts_with("HTTP/1.1 503") && r.contains("not yet"),
            "{r}"
        );
        fake.ready.store(true, Ordering::Relaxed);
        let r = get(a, &format!("GET /readyz HTTP/1.1\r\nHost: x\r\n{close}"));
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        let r = get(a, &format!("GET /healthz HTTP/1.1\r\nHost: x\r\n{close}"));
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        let r = get(
            a,
            &format!("GET /etc/passwd HTTP/1.1\r\nHost: x\r\n{close}"),
        );
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = get(
            a,
            &format!("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n{close}"),
        );
        assert!(r.starts_with("HTTP/1.1 405"), "{r}");
        // An oversized head is refused, and the server goes on serving.
        let huge = format!(
            "GET /metrics HTTP/1.1\r\nX: {}\r\n{close}",
            "a".repeat(64 << 10)
        );
        let r = get(a, &huge);
        assert!(!r.starts_with("HTTP/1.1 200"), "{r}");
        let r = get(a, &format!("GET /healthz HTTP/1.1\r\nHost: x\r\n{close}"));
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(srv.is_alive());
        srv.close();
        assert!(!srv.is_alive());
        assert!(std::net::TcpStream::connect(a).is_err(), "closed");
    }
}
