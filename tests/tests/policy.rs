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
