//! Rendezvous (highest-random-weight) hashing: every block has one owner among the
//! healthy peers, every node computes the same owner from the same peer list, and a
//! change of membership moves only the blocks whose owner joined or left — no
//! coordination, no consensus, no virtual nodes to tune.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A peer's stable identity (its advertised `host:port`).
pub type PeerId = str;

/// The weight of `peer` for `block` (a block's identity: file key and index, as bytes).
fn weight(peer: &PeerId, block: &[u8]) -> u64 {
    // Seed the block hash with the peer's hash: independent per (peer, block) pair.
    xxh3_64_with_seed(
        block,
        xxh3_64_with_seed(peer.as_bytes(), 0x5348_4152_4443_4143),
    )
}

/// The owner of `block` among `peers` (the one with the highest weight; ties, which
/// need a 64-bit collision, go to the smaller id). `None` when `peers` is empty.
pub fn owner<'a>(peers: impl IntoIterator<Item = &'a PeerId>, block: &[u8]) -> Option<&'a PeerId> {
    peers
        .into_iter()
        .map(|p| (weight(p, block), p))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, p)| p)
}

/// The peers in the order a block should be asked for: owner first, then the next
/// highest weights (the fallbacks when the owner fails).
pub fn ranked<'a>(peers: impl IntoIterator<Item = &'a PeerId>, block: &[u8]) -> Vec<&'a PeerId> {
    let mut v: Vec<(u64, &PeerId)> = peers.into_iter().map(|p| (weight(p, block), p)).collect();
    v.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    v.into_iter().map(|(_, p)| p).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn block(i: u64) -> [u8; 8] {
        i.to_le_bytes()
    }

    #[test]
    fn blocks_spread_evenly_over_peers() {
        let peers = [
            "10.0.0.1:7070",
            "10.0.0.2:7070",
            "10.0.0.3:7070",
            "10.0.0.4:7070",
        ];
        let mut count = [0usize; 4];
        for i in 0..40_000u64 {
            let o = owner(peers.iter().copied(), &block(i)).unwrap();
            count[peers.iter().position(|p| *p == o).unwrap()] += 1;
        }
        for c in count {
            assert!((9_000..11_000).contains(&c), "{count:?}");
        }
        assert_eq!(owner(std::iter::empty(), &block(1)), None);
    }

    proptest! {
        /// Removing a peer moves exactly the blocks it owned; adding one moves only
        /// blocks to it; every node computes the same owner whatever the list order.
        #[test]
        fn membership_changes_move_only_the_blocks_of_the_peer_that_changed(
            n in 2usize..8, gone in 0usize..8, blocks in proptest::collection::vec(any::<u64>(), 1..200)
        ) {
            let peers: Vec<String> = (0..n).map(|i| format!("node-{i}:7070")).collect();
            let gone = gone % n;
            let rest: Vec<&str> = peers.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, p)| p.as_str()).collect();
            let mut reversed: Vec<&str> = peers.iter().map(String::as_str).collect();
            reversed.reverse();
            for b in blocks {
                let before = owner(peers.iter().map(String::as_str), &block(b)).unwrap();
                prop_assert_eq!(owner(reversed.iter().copied(), &block(b)).unwrap(), before);
                let after = owner(rest.iter().copied(), &block(b)).unwrap();
                if before == peers[gone] {
                    prop_assert_ne!(after, before);
                    // The new owner is the old second choice.
                    prop_assert_eq!(after, ranked(peers.iter().map(String::as_str), &block(b))[1]);
                } else {
                    prop_assert_eq!(after, before);
                }
            }
        }
    }
}
