//! The block checksum: XXH3-64 with seed 0, recorded in the store's journal when a
//! block is written and checked whenever its bytes are trusted again (verification,
//! serving a peer, receiving from one).
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

#[cfg(test)]
mod tests {
    use super::*;

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
