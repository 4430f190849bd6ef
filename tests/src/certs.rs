//! Test certificates for the peer port's TLS (`peer_tls_*`): a CA, and node
//! certificates it issues, written as PEM files the way a Kubernetes Secret mounts them.

use std::path::{Path, PathBuf};

/// The name every test node's certificate carries (the daemon's default
/// `peer_tls_name`).
pub const PEER_NAME: &str = "shardcache-peer";

/// A certificate authority.
pub struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// A node's TLS files.
#[derive(Debug, Clone)]
pub struct NodeTls {
    /// `tls.crt`: the node's certificate.
    pub cert: PathBuf,
    /// `tls.key`: its private key.
    pub key: PathBuf,
    /// `ca.crt`: the CA certificates the node trusts.
    pub ca: PathBuf,
}

impl NodeTls {
    /// The daemon's flags for these files.
    pub fn flags(&self) -> Vec<String> {
        let p = |p: &Path| p.display().to_string();
        vec![
            "--peer-tls-cert".into(),
            p(&self.cert),
            "--peer-tls-key".into(),
            p(&self.key),
            "--peer-tls-ca".into(),
            p(&self.ca),
        ]
    }
}

impl Ca {
    /// A new CA named `name` (a fresh key).
    pub fn new(name: &str) -> Self {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} CA"));
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = p.self_signed(&key).expect("CA certificate");
        Self { cert, key }
    }

    /// A node's files in `dir`: `tls.crt` (for [`PEER_NAME`], server and client use,
    /// issued by this CA), `tls.key`, and `ca.crt` holding the certificates of `trust`.
    pub fn issue(&self, dir: &Path, trust: &[&Ca]) -> NodeTls {
        std::fs::create_dir_all(dir).expect("mkdir");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut p = rcgen::CertificateParams::new(vec![PEER_NAME.to_owned()]).expect("params");
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = p
            .signed_by(&key, &self.cert, &self.key)
            .expect("certificate");
        let ca: String = trust.iter().map(|c| c.cert.pem()).collect();
        let files = NodeTls {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            ca: dir.join("ca.crt"),
        };
        for (path, pem) in [
            (&files.cert, cert.pem()),
            (&files.key, key.serialize_pem()),
            (&files.ca, ca),
        ] {
            std::fs::write(path, pem).expect("write PEM");
        }
        files
    }
}
