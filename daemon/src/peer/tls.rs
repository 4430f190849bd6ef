//! Optional TLS on the peer port, for clusters whose network must not see block bytes.
//!
//! Mutual TLS 1.3 (rustls, `ring` provider): every node presents its certificate and
//! checks the other's against the cluster's CA, on both protocols of the port alike —
//! the whole connection is TLS, and the first 8 bytes that tell gRPC from the block
//! stream are read inside it. The certificate, its key and the CA come from PEM files
//! (as a Kubernetes Secret mounts them: `tls.crt`, `tls.key`, `ca.crt`). A connecting
//! node checks the serving node's certificate for one name, the same on every node
//! ([`TlsFiles::name`], default `shardcache-peer`), not for its address: peers are
//! reached at addresses (pod IPs) no certificate lists.
//!
//! TLS adds confidentiality and a second, independent proof of membership; it replaces
//! nothing: the shared secret's challenge and the per-block MACs run inside it as they
//! do without it. A plaintext node and a TLS node cannot talk (each reads the backing
//! store instead).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection, StreamOwned,
};

pub use crate::config::{DEFAULT_TLS_NAME as DEFAULT_NAME, TlsFiles};

/// Loaded TLS settings: one for serving, one for connecting.
pub struct Tls {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            format!(
                "{what}: cannot read certificates from {}: {e}",
                path.display()
            )
        })?;
    if certs.is_empty() {
        return Err(format!(
            "{what}: no PEM certificate (-----BEGIN CERTIFICATE-----) in {}",
            path.display()
        ));
    }
    Ok(certs)
}

impl Tls {
    /// Reads and checks the files: they parse, the key matches the certificate, and the
    /// certificate chains to the CA and is valid now for the name (so that a node that
    /// would be refused by every peer does not start). Errors name the config key.
    pub fn load(files: &TlsFiles) -> Result<Self, String> {
        let chain = certs("peer_tls_cert", &files.cert)?;
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| {
            format!(
                "peer_tls_key: cannot read a PEM private key from {}: {e}",
                files.key.display()
            )
        })?;
        let mut roots = RootCertStore::empty();
        for c in certs("peer_tls_ca", &files.ca)? {
            roots
                .add(c)
                .map_err(|e| format!("peer_tls_ca: {}: {e}", files.ca.display()))?;
        }
        let roots = Arc::new(roots);
        let name = ServerName::try_from(files.name.clone())
            .map_err(|e| format!("peer_tls_name: `{}`: {e}", files.name))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls13: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        // The node's own certificate must pass the check its peers will make.
        let own = rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| format!("peer_tls_ca: {e}"))?;
        own.verify_server_cert(&chain[0], &chain[1..], &name, &[], UnixTime::now())
            .map_err(|e| {
                format!(
                    "peer_tls_cert: {} does not verify against peer_tls_ca {} for the name `{}` (peer_tls_name): {e}",
                    files.cert.display(),
                    files.ca.display(),
                    files.name
                )
            })?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| format!("peer_tls_ca: {e}"))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(tls13)
            .map_err(|e| format!("peer TLS: {e}"))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| format!("peer_tls_key: does not fit peer_tls_cert: {e}"))?;
        // No resumption: connections are long-lived and a ticket is one more secret.
        server.send_tls13_tickets = 0;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(tls13)
            .map_err(|e| format!("peer TLS: {e}"))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("peer_tls_key: does not fit peer_tls_cert: {e}"))?;
        Ok(Self {
            server: Arc::new(server),
            client: Arc::new(client),
            name,
        })
    }

    /// Accepts TLS on connections to the peer port (async: the accept loop's side).
    pub(super) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.server.clone())
    }

    /// Connects TLS to a peer (async: gRPC's side).
    pub(super) fn connector(&self) -> (tokio_rustls::TlsConnector, ServerName<'static>) {
        (
            tokio_rustls::TlsConnector::from(self.client.clone()),
            self.name.clone(),
        )
    }

    /// TLS over a fresh connection to a peer, handshake done (blocking: the block
    /// stream's side; bounded by the socket's timeouts).
    pub(super) fn connect(&self, mut tcp: TcpStream) -> io::Result<Stream> {
        let mut conn = ClientConnection::new(self.client.clone(), self.name.clone())
            .map_err(io::Error::other)?;
        while conn.is_handshaking() {
            conn.complete_io(&mut tcp)?;
        }
        Ok(Stream::Client(Box::new(StreamOwned::new(conn, tcp))))
    }
}

/// A block-stream connection with blocking I/O: plain TCP, or TLS over it.
#[derive(Debug)]
pub(crate) enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS, this node connecting.
    Client(Box<StreamOwned<ClientConnection, TcpStream>>),
    /// TLS, this node serving.
    Server(Box<StreamOwned<ServerConnection, TcpStream>>),
}

impl Stream {
    /// The TCP connection underneath (timeouts, shutdown, addresses).
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Client(s) => s.get_ref(),
            Stream::Server(s) => s.get_ref(),
        }
    }

    /// A served TLS connection taken over from the async accept loop (TLS handshake
    /// done, possibly with bytes already read into `conn`).
    pub(super) fn served(tcp: TcpStream, conn: ServerConnection) -> Self {
        Stream::Server(Box::new(StreamOwned::new(conn, tcp)))
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Client(s) => s.read(buf),
            Stream::Server(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Client(s) => s.write(buf),
            Stream::Server(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write_vectored(bufs),
            Stream::Client(s) => s.write_vectored(bufs),
            Stream::Server(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Client(s) => s.flush(),
            Stream::Server(s) => s.flush(),
        }
    }
}
