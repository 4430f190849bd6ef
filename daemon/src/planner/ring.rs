//! Rendezvous (highest-random-weight) hashing: every block has one owner among the
//! healthy peers, every node computes the same owner from the same peer list, and a
//! change of membership moves only the blocks whose owner joined or left — no
//! coordination, no consensus, no virtual nodes to tune.
//!
//! Pure functions of ids and member lists, so they sit in the planner next to
//! [`super::placement`]: the planner spreads a shuffle's files with [`balanced`], the
//! peers ask [`file_owner`] for everything else. Nothing here knows of connections.

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

/// Owners for a known set of items (a dataset's files, in an order every node agrees
/// on) with balanced load: each item goes to the highest-weight peer that owns fewer
/// than ⌈items ÷ peers⌉ so far (rendezvous hashing with bounded loads). Plain rendezvous
/// gives some peers noticeably more than their share (binomial spread), and a peer that
/// owns more than its cache holds sends the rest to the backing store every epoch; with
/// bounded loads every peer owns its share to within one item. A membership change
/// still moves mostly the items of the peer that changed. Returns, per item, the index of
/// its owner in `peers`.
pub fn balanced(peers: &[&PeerId], items: impl IntoIterator<Item = Vec<u8>>) -> Vec<u16> {
    let items: Vec<Vec<u8>> = items.into_iter().collect();
    if peers.is_empty() {
        return Vec::new();
    }
    let cap = items.len().div_ceil(peers.len());
    let mut load = vec![0usize; peers.len()];
    let mut out = Vec::with_capacity(items.len());
    let mut order: Vec<(u64, usize)> = Vec::with_capacity(peers.len());
    for item in &items {
        order.clear();
        order.extend(peers.iter().enumerate().map(|(i, p)| (weight(p, item), i)));
        order.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| peers[a.1].cmp(peers[b.1])));
        let pick = order
            .iter()
            .map(|&(_, i)| i)
            .find(|&i| load[i] < cap)
            .unwrap_or(order[0].1);
        load[pick] += 1;
        out.push(pick as u16);
    }
    out
}

/// The owner of file `path` under `root` among `members` (what every node computes).
pub fn file_owner<'a>(
    members: impl IntoIterator<Item = &'a str>,
    root: &str,
    path: &str,
) -> Option<&'a str> {
    owner(members, &file_id(root, path))
}

/// A file's identity for ownership: its root and canonical path.
pub fn file_id(root: &str, path: &str) -> Vec<u8> {
    let mut id = Vec::with_capacity(root.len() + path.len() + 1);
    id.extend_from_slice(root.as_bytes());
    id.push(0);
    id.extend_from_slice(path.as_bytes());
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn block(i: u64) -> [u8; 8] {
        i.to_le_bytes()
    }

    #[test]
    fn balanced_owners_are_within_one_of_an_even_share() {
        let peers = ["a:1", "b:1", "c:1", "d:1"];
        for n in [1u64, 7, 240, 1001] {
            let owners = balanced(&peers, (0..n).map(|i| block(i).to_vec()));
            let mut count = [0usize; 4];
            for &o in &owners {
                count[o as usize] += 1;
            }
            let cap = (n as usize).div_ceil(4);
            assert!(count.iter().all(|&c| c <= cap), "{n}: {count:?}");
            assert_eq!(count.iter().sum::<usize>(), n as usize);
            // Every node computes the same.
            assert_eq!(owners, balanced(&peers, (0..n).map(|i| block(i).to_vec())));
        }
        // A node leaving moves its items, and few others.
        let all = balanced(&peers, (0..1000u64).map(|i| block(i).to_vec()));
        let three = balanced(&peers[..3], (0..1000u64).map(|i| block(i).to_vec()));
        let moved = all
            .iter()
            .zip(&three)
            .filter(|(a, b)| **a != 3 && a != b)
            .count();
        assert!(moved < 250, "{moved} of the remaining nodes' items moved");
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
