//! The planner's policy in a simulated node (simulated time: deterministic, no timing
//! noise): after the first epoch of a shuffled plan it holds C/N of every epoch, stalls
//! the reader no more than the bandwidth floor, and reads the backing store no more than
//! 1 − C/N per epoch; LRU does much worse.
#![allow(clippy::unwrap_used)]

use shardcache_tests::policy::{Loader, lru, planned, planned_with, stall_floor};

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

/// Issue 14: readers that read as a PyTorch DataLoader's workers do — out of order, far
/// ahead of the slowest — are followed by their reads: at every cache size and rate the
/// planner holds the hit ceiling C/N (within 3 %; within 2 % at C/N = 0.5, the issue's
/// bound) and reads the backing store within 2 % of its floor 1 − C/N. The simulation
/// serialises the workers' reads (the next read in the interleaved order waits for its
/// file), which overstates stall against a real loop that waits only for the batch it
/// consumes: the stall bound here (floor + 0.3) only guards against losing the readers'
/// window again (before it was kept, stall ran to 0.46 above the floor); the real stall
/// is the torch benchmark's to show.
#[test]
fn the_planner_reaches_the_floors_with_dataloader_readers() {
    let n = 400;
    for (workers, batch) in [(4, 4), (4, 16), (8, 16)] {
        let loader = Loader {
            batch,
            workers,
            prefetch: 2,
            seed: 7,
        };
        for cn in [0.25, 0.5, 0.75] {
            for rb in [0.5, 2.0, 4.0] {
                let c = (n as f64 * cn) as usize;
                let ours = planned_with(n, c, rb, 1.0, 4, 7, c, Some(loader));
                let at = format!("{loader:?}, C/N {cn}, R/B {rb}: {ours:?}");
                let ceiling = if cn == 0.5 { 0.98 } else { 0.97 };
                assert!(ours.hit_rate >= ceiling * cn, "hit rate: {at}");
                assert!(ours.backing_per_epoch <= (1.0 - cn) * 1.02, "backing: {at}");
                assert!(ours.stall <= stall_floor(cn, rb, 1.0) + 0.3, "stall: {at}");
            }
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
