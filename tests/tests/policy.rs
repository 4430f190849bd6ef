//! The planner's policy in a simulated node (simulated time: deterministic, no timing
//! noise): after the first epoch of a shuffled plan it holds C/N of every epoch, stalls
//! the reader no more than the bandwidth floor, and reads the backing store no more than
//! 1 − C/N per epoch; LRU does much worse.
#![allow(clippy::unwrap_used)]

use shardcache_tests::policy::{lru, planned, stall_floor};

#[test]
fn the_planner_reaches_the_floors_and_lru_does_not() {
    let n = 400;
    for cn in [0.25, 0.5, 0.75] {
        for rb in [0.5, 2.0, 4.0] {
            let c = (n as f64 * cn) as usize;
            let ours = planned(n, c, rb, 1.0, 4, 7, c);
            let base = lru(n, c, rb, 1.0, 4, 7);
            let at = format!("C/N {cn}, R/B {rb}: {ours:?} vs LRU {base:?}");
            assert!(ours.hit_rate / cn >= 0.99, "hit rate: {at}");
            assert!(ours.stall <= stall_floor(cn, rb, 1.0) + 0.01, "stall: {at}");
            assert!(ours.backing_per_epoch <= 1.0 - cn + 0.01, "backing: {at}");
            assert!(
                base.hit_rate < ours.hit_rate && base.stall >= ours.stall,
                "LRU better? {at}"
            );
        }
    }
}

/// The live policy benchmark's harness (the real daemon over a throttled in-memory store)
/// on a small dataset: every byte read is right, no run reads the backing store less
/// than the physical floor 1 − C/N (else the accounting is wrong), and the planned cache
/// reads it no more than LRU does. Timing is real, so no stall figure is asserted.
#[test]
fn the_live_policy_harness_reads_right_and_accounts_backing_bytes() {
    use shardcache_tests::live::{Params, run};
    for cn in [0.25, 0.5] {
        let p = Params {
            files: 48,
            file_size: 64 << 10,
            cn,
            bandwidth: 64 << 20,
            rb: 2.0,
            epochs: 3,
            seed: 3,
            planned: true,
            cache_parent: std::env::temp_dir(),
        };
        let ours = run(&p).unwrap();
        let base = run(&Params {
            planned: false,
            ..p.clone()
        })
        .unwrap();
        let at = format!("C/N {cn}: {ours:?} vs LRU {base:?}");
        assert!(ours.backing_per_epoch >= 1.0 - cn - 0.01, "{at}");
        assert!(base.backing_per_epoch >= 1.0 - cn - 0.01, "{at}");
        assert!(ours.backing_per_epoch <= base.backing_per_epoch, "{at}");
    }
}
