//! Every hash the daemon uses.
//!
//! The block checksum: XXH3-64 with seed 0, recorded in the store's journal when a
//! block is written and checked whenever its bytes are trusted again (verification,
//! serving a peer, receiving from one). It tells damaged bytes from good ones; it proves
//! nothing about who sent them (anyone can compute it).
//!
//! The peer MAC ([`Mac`], [`derive_key`]): keyed BLAKE3, which proves that bytes come
//! from a holder of the cluster's shared secret and were not changed on the way. Peers
//! derive a key per purpose (and per block-stream session) from the secret, and MAC
//! every block, request and reply they exchange (see `peer::wire` and `peer::auth`).
//! BLAKE3 picks its SIMD width at run time (AVX-512 or AVX2 where the CPU has them) and
//! hashes several GB/s on one core, so a MAC over every block costs the peer path little
//! next to the copy through the kernel.
//!
//! Computed by `twox-hash`, which picks its SIMD width at run time (AVX2 where the CPU
//! has it: about twice the SSE2 speed that a default x86-64 build of `xxhash-rust` is
//! limited to). Both compute the same function, so checksums recorded by either stay
//! valid; the test below holds them to it.

use std::hash::Hasher as _;

/// The checksum of a whole block.
#[must_use]
pub fn block_xxh3(data: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(data)
}

/// [`block_xxh3`] of bytes that arrive in pieces.
#[derive(Clone)]
pub struct BlockHasher(twox_hash::XxHash3_64);

impl std::fmt::Debug for BlockHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockHasher").finish_non_exhaustive()
    }
}

impl Default for BlockHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockHasher {
    /// A hasher that has seen nothing yet.
    #[must_use]
    pub fn new() -> Self {
        Self(twox_hash::XxHash3_64::new())
    }

    /// Adds the next piece.
    pub fn update(&mut self, piece: &[u8]) {
        self.0.write(piece);
    }

    /// The checksum of every piece so far, in order.
    #[must_use]
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

/// Bytes of a MAC key and of a MAC tag.
pub const MAC_LEN: usize = 32;

/// A MAC key.
pub type MacKey = [u8; MAC_LEN];

/// The key for one purpose, derived from `parts` (a secret, nonces): BLAKE3 in key
/// derivation mode. `context` names the purpose, fixed in the code and unique to it
/// (BLAKE3's advice: application, date, purpose), so that keys for different purposes
/// are unrelated even from the same secret. Each part is length-prefixed, so that no
/// two lists of parts give the same input.
#[must_use]
pub fn derive_key(context: &str, parts: &[&[u8]]) -> MacKey {
    let mut h = blake3::Hasher::new_derive_key(context);
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    *h.finalize().as_bytes()
}

/// Keyed BLAKE3 over bytes that arrive in pieces: the tag proves that whoever computed
/// it held the key and saw exactly these bytes.
#[derive(Clone)]
pub struct Mac(blake3::Hasher);

impl std::fmt::Debug for Mac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The state depends on the key: never printed.
        f.debug_struct("Mac").finish_non_exhaustive()
    }
}

impl Mac {
    /// A MAC with `key` that has seen nothing yet.
    #[must_use]
    pub fn new(key: &MacKey) -> Self {
        Self(blake3::Hasher::new_keyed(key))
    }

    /// Adds the next piece.
    pub fn update(&mut self, piece: &[u8]) -> &mut Self {
        self.0.update(piece);
        self
    }

    /// Adds a piece of variable length, prefixed with its length (where the next piece
    /// begins is then part of what the tag covers).
    pub fn update_sized(&mut self, piece: &[u8]) -> &mut Self {
        self.0.update(&(piece.len() as u64).to_le_bytes());
        self.0.update(piece);
        self
    }

    /// The tag of every piece so far.
    #[must_use]
    pub fn tag(&self) -> [u8; MAC_LEN] {
        *self.0.finalize().as_bytes()
    }

    /// True when `given` is the tag of every piece so far, compared in time independent
    /// of where they differ.
    #[must_use]
    pub fn verify(&self, given: &[u8]) -> bool {
        // blake3::Hash compares in constant time; a slice of another length is unequal.
        self.0.finalize() == *given
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_depend_on_key_bytes_and_boundaries() {
        let k1 = derive_key("shardcache test purpose one", &[b"secret"]);
        let k2 = derive_key("shardcache test purpose two", &[b"secret"]);
        assert_ne!(k1, k2, "the purpose separates keys");
        assert_ne!(k1, derive_key("shardcache test purpose one", &[b"secreT"]));
        assert_ne!(
            derive_key("shardcache test purpose one", &[b"ab", b"c"]),
            derive_key("shardcache test purpose one", &[b"a", b"bc"]),
            "parts are length-prefixed"
        );
        let tag = Mac::new(&k1).update(b"block bytes").tag();
        let mut m = Mac::new(&k1);
        m.update(b"block ").update(b"bytes");
        assert!(m.verify(&tag), "pieces or whole: the same tag");
        assert!(
            !Mac::new(&k2).update(b"block bytes").verify(&tag),
            "another key"
        );
        assert!(
            !Mac::new(&k1).update(b"block bytez").verify(&tag),
            "other bytes"
        );
        assert!(
            !Mac::new(&k1).update(b"block bytes").verify(&tag[..31]),
            "cut short"
        );
        let (mut a, mut b) = (Mac::new(&k1), Mac::new(&k1));
        a.update_sized(b"ab").update_sized(b"c");
        b.update_sized(b"a").update_sized(b"bc");
        assert_ne!(a.tag(), b.tag(), "sized pieces keep their boundaries");
        assert_eq!(format!("{:?}", Mac::new(&k1)), "Mac { .. }");
    }

    /// The function is XXH3-64, seed 0, exactly as `xxhash-rust` computes it (existing
    /// caches recorded that), whole and in pieces, across the size classes.
    #[test]
    fn same_as_xxhash_rust() {
        let mut s = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let data: Vec<u8> = (0..(1 << 20) + 1000).map(|_| next() as u8).collect();
        let mut lens: Vec<usize> = (0..=300).collect();
        lens.extend([
            1023,
            1024,
            1025,
            4096,
            65_536,
            100_003,
            1 << 20,
            (1 << 20) + 999,
        ]);
        lens.extend((0..40).map(|_| (next() as usize) % data.len()));
        for len in lens {
            let off = (next() as usize) % (data.len() - len + 1);
            let d = &data[off..off + len];
            let want = xxhash_rust::xxh3::xxh3_64(d);
            assert_eq!(block_xxh3(d), want, "whole, {len} bytes");
            let mut h = BlockHasher::new();
            let mut at = 0;
            while at < len {
                let k = ((next() as usize) % 70_000).min(len - at);
                h.update(&d[at..at + k]);
                at += k;
            }
            assert_eq!(h.digest(), want, "in pieces, {len} bytes");
        }
    }
}
