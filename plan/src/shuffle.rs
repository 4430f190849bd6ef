//! Named, versioned shuffle algorithms.
//!
//! A name like `pcg64-fisher-yates/v1` fixes every detail of the order it produces; a
//! change that alters any order gets a new name, and the known-answer tests below pin
//! the current ones. The daemon and every client compute orders with this module only.
//!
//! ## `pcg64-fisher-yates/v1`
//!
//! For dataset size `n`, seed `s` and epoch `e`:
//! 1. A PCG64 generator (XSL-RR 128/64, `rand_pcg::Pcg64`) created with
//!    `Pcg64::new(state, stream)`, `state = (s << 64) | e` and
//!    `stream = 0x5348_4152_4443_4143` (ASCII "SHARDCAC"). In full: the increment is
//!    `inc = (stream << 1) | 1`, the state starts at `state + inc` and is advanced once
//!    (`state = state * M + inc` mod 2^128, `M = 0x2360ED051FC65DA44385DF649FCCF645`);
//!    each output advances the state, then returns
//!    `rotr64(hi64(state) ^ lo64(state), state >> 122)`.
//! 2. A uniform integer below `m` is drawn with Lemire's multiply-shift method: take
//!    `x = next_u64()`, `p = x * m` as 128 bits; if the low 64 bits of `p` are below
//!    `2^64 mod m`, draw again; else the answer is the high 64 bits.
//! 3. Fisher–Yates: start from `[0, 1, …, n-1]`; for `i` from `n-1` down to `1`, swap
//!    positions `i` and `uniform(i + 1)`.
//!
//! Per-rank slicing follows PyTorch's `DistributedSampler`: with `world` ranks, without
//! `drop_last` the permutation is padded to `ceil(n / world) * world` by repeating it
//! from its start; with `drop_last` it is cut to `floor(n / world) * world`; rank `r`
//! takes positions `r, r + world, r + 2·world, …`.

use rand_core::Rng;
use rand_pcg::Pcg64;

/// The only algorithm today.
pub const PCG64_FISHER_YATES_V1: &str = "pcg64-fisher-yates/v1";

/// Every algorithm name this build implements.
pub const ALGORITHMS: &[&str] = &[PCG64_FISHER_YATES_V1];

const STREAM: u128 = 0x5348_4152_4443_4143;

fn uniform(rng: &mut Pcg64, m: u64) -> u64 {
    debug_assert!(m > 0);
    let threshold = m.wrapping_neg() % m; // 2^64 mod m
    loop {
        let p = rng.next_u64() as u128 * m as u128;
        if (p as u64) >= threshold {
            return (p >> 64) as u64;
        }
    }
}

/// The permutation of `0..n` for `seed` and `epoch`.
pub fn permutation(n: u64, seed: u64, epoch: u64) -> Vec<u64> {
    let mut rng = Pcg64::new(((seed as u128) << 64) | epoch as u128, STREAM);
    let mut v: Vec<u64> = (0..n).collect();
    for i in (1..n).rev() {
        let j = uniform(&mut rng, i + 1);
        v.swap(i as usize, j as usize);
    }
    v
}

/// How many samples each rank gets per epoch.
pub fn samples_per_rank(n: u64, world: u64, drop_last: bool) -> u64 {
    if world == 0 {
        return 0;
    }
    if drop_last {
        n / world
    } else {
        n.div_ceil(world)
    }
}

/// The order in which `rank` (of `world`) reads the dataset in `epoch`.
///
/// Panics if `world` is 0 or `rank >= world` (manifests are validated before this).
pub fn rank_order(
    n: u64,
    seed: u64,
    epoch: u64,
    world: u64,
    rank: u64,
    drop_last: bool,
) -> Vec<u64> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} outside world of {world}"
    );
    let perm = permutation(n, seed, epoch);
    let per = samples_per_rank(n, world, drop_last);
    let total = per * world;
    (0..per)
        .map(|k| {
            let pos = rank + k * world;
            // Padding repeats the permutation from its start (pos < total ≤ n + world - 1).
            perm[(pos % total.max(1)) as usize % perm.len().max(1)]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers_pin_the_algorithm() {
        // If this fails, the algorithm changed: give it a new name instead.
        assert_eq!(permutation(10, 42, 0), KNOWN_10_42_0);
        assert_eq!(permutation(10, 42, 1), KNOWN_10_42_1);
        assert_eq!(rank_order(10, 7, 3, 4, 1, false), KNOWN_RANK);
    }

    // Computed independently from the description in the module docs (a Python
    // transcription), and matching this implementation.
    const KNOWN_10_42_0: [u64; 10] = [1, 0, 2, 7, 9, 6, 8, 4, 3, 5];
    const KNOWN_10_42_1: [u64; 10] = [6, 5, 8, 0, 1, 9, 7, 2, 3, 4];
    const KNOWN_RANK: [u64; 3] = [5, 3, 2];

    #[test]
    fn a_permutation_holds_every_index_once() {
        for n in [0, 1, 2, 3, 100, 1001] {
            let mut p = permutation(n, 9, 2);
            p.sort_unstable();
            assert_eq!(p, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn epochs_and_seeds_differ_but_repeat() {
        assert_eq!(permutation(1000, 1, 1), permutation(1000, 1, 1));
        assert_ne!(permutation(1000, 1, 1), permutation(1000, 1, 2));
        assert_ne!(permutation(1000, 1, 1), permutation(1000, 2, 1));
    }

    #[test]
    fn ranks_follow_distributed_sampler() {
        // n = 10, world = 4, no drop_last: total 12, padded with the first two.
        let perm = permutation(10, 5, 0);
        let mut padded = perm.clone();
        padded.extend_from_slice(&perm[..2]);
        for r in 0..4 {
            let want: Vec<u64> = padded.iter().skip(r).step_by(4).copied().collect();
            assert_eq!(rank_order(10, 5, 0, 4, r as u64, false), want);
        }
        // drop_last: total 8.
        for r in 0..4 {
            let want: Vec<u64> = perm[..8].iter().skip(r).step_by(4).copied().collect();
            assert_eq!(rank_order(10, 5, 0, 4, r as u64, true), want);
        }
        // More ranks than samples: padding repeats the permutation as needed.
        let tiny = permutation(2, 5, 0);
        let all: Vec<u64> = (0..5)
            .flat_map(|r| rank_order(2, 5, 0, 5, r, false))
            .collect();
        assert_eq!(all, vec![tiny[0], tiny[1], tiny[0], tiny[1], tiny[0]]);
        assert_eq!(samples_per_rank(10, 4, false), 3);
        assert_eq!(samples_per_rank(10, 4, true), 2);
    }

    #[test]
    fn uniform_is_unbiased_enough() {
        let mut rng = Pcg64::new(1, STREAM);
        let mut counts = [0u32; 3];
        for _ in 0..30_000 {
            counts[uniform(&mut rng, 3) as usize] += 1;
        }
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
    }
}

/// The order in which one node reads the dataset in `epoch`, when it runs `ranks` of a
/// `world`: the ranks' orders interleaved step by step (rank `ranks[0]`'s first sample,
/// then `ranks[1]`'s first, …), as ranks that consume at the same rate do.
pub fn node_order(
    n: u64,
    seed: u64,
    epoch: u64,
    world: u64,
    ranks: &[u64],
    drop_last: bool,
) -> Vec<u64> {
    let orders: Vec<Vec<u64>> = ranks
        .iter()
        .map(|&r| rank_order(n, seed, epoch, world, r, drop_last))
        .collect();
    let per = samples_per_rank(n, world, drop_last) as usize;
    let mut out = Vec::with_capacity(per * ranks.len());
    for k in 0..per {
        out.extend(orders.iter().map(|o| o[k]));
    }
    out
}

#[cfg(test)]
mod node_tests {
    use super::*;

    #[test]
    fn a_node_interleaves_its_ranks() {
        let a = rank_order(50, 3, 1, 8, 2, false);
        let b = rank_order(50, 3, 1, 8, 5, false);
        let n = node_order(50, 3, 1, 8, &[2, 5], false);
        assert_eq!(n.len(), a.len() + b.len());
        for k in 0..a.len() {
            assert_eq!((n[2 * k], n[2 * k + 1]), (a[k], b[k]));
        }
        // All ranks of the world on one node read every sample (padding included).
        let all: Vec<u64> = (0..8).collect();
        let mut every = node_order(50, 3, 1, 8, &all, false);
        assert_eq!(every.len(), 56);
        every.sort_unstable();
        every.dedup();
        assert_eq!(every, (0..50).collect::<Vec<_>>());
    }
}
