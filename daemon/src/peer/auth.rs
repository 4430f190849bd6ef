//! Authentication of the peer port's gRPC calls (`Ranks`): a proof of the shared secret
//! over a fresh nonce on each request, and a MAC on each reply, bound to that nonce.
//!
//! - Request: metadata [`NONCE_HEADER`] (32 random bytes) and [`PROOF_HEADER`] (keyed
//!   BLAKE3 of the nonce, with a key derived from the secret for requests). The secret
//!   itself never travels: a listener on the path learns nothing that lets it call.
//! - Reply: its content travels as bytes (`sealed`, an encoded message) with a `mac`:
//!   keyed BLAKE3, with a key derived from the secret for replies, over the method, the
//!   request's nonce and `sealed`. The caller checks it before it decodes a byte, so a
//!   reply changed on the way, or one recorded for an earlier request, steers nothing.
//!   MACing the bytes as they travel, not a re-encoding of the decoded message, keeps
//!   the check exact across versions that add fields.
//!
//! A recorded request can be sent again: it gets a reply MACed for its old nonce, which
//! tells the sender what a listener on the path saw anyway (without TLS there is no
//! confidentiality), and `Ranks` changes nothing on the node that answers. The keys for
//! requests and for replies differ, so neither can stand for the other.

use tonic::metadata::{BinaryMetadataValue, MetadataMap};

use super::wire::{NONCE, nonce};
use crate::checksum::{MAC_LEN, Mac, derive_key};

/// The request's nonce (binary metadata: base64 on the wire).
pub const NONCE_HEADER: &str = "x-shardcache-nonce-bin";
/// The request's proof of the shared secret.
pub const PROOF_HEADER: &str = "x-shardcache-proof-bin";

const REQUEST_KEY: &str = "shardcache 2026-12 peer grpc request";
const REPLY_KEY: &str = "shardcache 2026-12 peer grpc reply";

/// The nonce of a request whose proof was checked: the server's check puts it in the
/// request's extensions, for the handler to MAC its reply with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified(pub [u8; NONCE]);

fn proof(secret: &[u8], nonce: &[u8; NONCE]) -> Mac {
    let mut m = Mac::new(&derive_key(REQUEST_KEY, &[secret]));
    m.update(nonce);
    m
}

/// Puts a fresh nonce and the proof of `secret` into a request's metadata; returns the
/// nonce, to check the reply with ([`check_reply`]).
pub fn sign_request(secret: &[u8], md: &mut MetadataMap) -> std::io::Result<[u8; NONCE]> {
    let n = nonce()?;
    md.insert_bin(NONCE_HEADER, BinaryMetadataValue::from_bytes(&n));
    md.insert_bin(
        PROOF_HEADER,
        BinaryMetadataValue::from_bytes(&proof(secret, &n).tag()),
    );
    Ok(n)
}

/// The request's nonce when its metadata proves `secret`; `None` otherwise (missing,
/// malformed or wrong).
pub fn check_request(secret: &[u8], md: &MetadataMap) -> Option<[u8; NONCE]> {
    let n = md.get_bin(NONCE_HEADER)?.to_bytes().ok()?;
    let n: [u8; NONCE] = n.as_ref().try_into().ok()?;
    let given = md.get_bin(PROOF_HEADER)?.to_bytes().ok()?;
    proof(secret, &n).verify(&given).then_some(n)
}

fn reply(secret: &[u8], method: &str, nonce: &[u8; NONCE], sealed: &[u8]) -> Mac {
    let mut m = Mac::new(&derive_key(REPLY_KEY, &[secret]));
    m.update_sized(method.as_bytes())
        .update(nonce)
        .update(sealed);
    m
}

/// The MAC of a reply to `method` (e.g. `"Ranks"`) whose content is `sealed`, for the
/// request that carried `nonce`.
#[must_use]
pub fn reply_mac(secret: &[u8], method: &str, nonce: &[u8; NONCE], sealed: &[u8]) -> [u8; MAC_LEN] {
    reply(secret, method, nonce, sealed).tag()
}

/// True when `mac` is [`reply_mac`] of `sealed` (compared in constant time).
#[must_use]
pub fn check_reply(
    secret: &[u8],
    method: &str,
    nonce: &[u8; NONCE],
    sealed: &[u8],
    mac: &[u8],
) -> bool {
    reply(secret, method, nonce, sealed).verify(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_prove_the_secret_without_carrying_it() {
        let secret = b"a cluster's shared secret";
        let mut md = MetadataMap::new();
        let n = sign_request(secret, &mut md).unwrap();
        assert_eq!(check_request(secret, &md), Some(n));
        assert_eq!(check_request(b"another secret, same length", &md), None);
        for (k, v) in md.iter().filter_map(|kv| match kv {
            tonic::metadata::KeyAndValueRef::Binary(k, v) => Some((k, v)),
            tonic::metadata::KeyAndValueRef::Ascii(..) => None,
        }) {
            let v = v.to_bytes().unwrap();
            assert!(
                !v.windows(secret.len()).any(|w| w == secret),
                "{k:?} carries the secret"
            );
        }
        // A proof for another nonce does not do.
        let mut other = MetadataMap::new();
        sign_request(secret, &mut other).unwrap();
        let mut mixed = md.clone();
        mixed.insert_bin(PROOF_HEADER, other.get_bin(PROOF_HEADER).unwrap().clone());
        assert_eq!(check_request(secret, &mixed), None);
        assert_eq!(check_request(secret, &MetadataMap::new()), None);
    }

    #[test]
    fn replies_are_bound_to_the_request_the_method_and_the_bytes() {
        let secret = b"a cluster's shared secret";
        let (n, m) = ([1u8; NONCE], [2u8; NONCE]);
        let mac = reply_mac(secret, "Ranks", &n, b"reply bytes");
        assert!(check_reply(secret, "Ranks", &n, b"reply bytes", &mac));
        assert!(
            !check_reply(secret, "Ranks", &m, b"reply bytes", &mac),
            "nonce"
        );
        assert!(
            !check_reply(secret, "Fetch", &n, b"reply bytes", &mac),
            "method"
        );
        assert!(
            !check_reply(secret, "Ranks", &n, b"reply bytez", &mac),
            "bytes"
        );
        assert!(
            !check_reply(b"other", "Ranks", &n, b"reply bytes", &mac),
            "secret"
        );
        assert!(
            !check_reply(secret, "Ranks", &n, b"reply bytes", &[]),
            "missing"
        );
        // A request's proof is no reply MAC.
        let mut md = MetadataMap::new();
        let n = sign_request(secret, &mut md).unwrap();
        let p = md.get_bin(PROOF_HEADER).unwrap().to_bytes().unwrap();
        assert!(!check_reply(secret, "", &n, b"", &p));
    }
}
