//! The HTTP endpoint: `GET /metrics` (Prometheus text format), `GET /healthz` (liveness)
//! and `GET /readyz` (readiness), nothing else.
//!
//! It runs on a thread of its own with a current-thread tokio runtime and hyper's HTTP/1
//! server (both already in the daemon for the peer service), so that a slow or hostile
//! client of this port can never hold up the request threads. It is kept small and
//! bounded: at most [`MAX_CONNECTIONS`] connections (more are closed at once), request
//! heads of at most [`MAX_HEAD`] bytes read within [`HEAD_TIMEOUT`], a connection lives
//! at most [`MAX_CONNECTION_LIFE`], and a render runs on the blocking pool, one at a time
//! (scrapes are serialized, so that a burst of them cannot multiply the work).
//!
//! What the answers mean is the [`Endpoint`]'s business (the daemon's wiring decides
//! what "alive" and "ready" are).

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

/// Most connections served at once.
pub const MAX_CONNECTIONS: usize = 32;
/// Largest request head accepted (hyper's smallest allowed buffer).
pub const MAX_HEAD: usize = 8192;
/// Longest wait for a request head (also bounds an idle keep-alive connection).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
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
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
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
        let thread = std::thread::Builder::new()
            .name("sc-metrics".into())
            .spawn(move || {
                rt.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => serve(l, endpoint, stopped).await,
                        Err(e) => tracing::error!(error = %e, "metrics endpoint cannot start"),
                    }
                });
                // Connections still open are dropped with the runtime.
                rt.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// True while the server thread runs.
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops accepting, drops open connections and waits for the thread.
    pub fn close(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.close();
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    endpoint: Arc<dyn Endpoint>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let render = Arc::new(tokio::sync::Mutex::new(()));
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "metrics endpoint: too many connections; closing one");
            continue;
        };
        let (endpoint, render) = (endpoint.clone(), render.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                respond(req, endpoint.clone(), render.clone())
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD)
                .serve_connection(TokioIo::new(stream), service);
            // Past its lifetime the connection is dropped (closed); the scraper reconnects.
            if let Ok(Err(e)) = tokio::time::timeout(MAX_CONNECTION_LIFE, conn).await {
                tracing::debug!(%peer, error = %e, "metrics connection ended");
            }
            drop(slot);
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
