//! The order in which a PyTorch `DataLoader`'s workers read a plan, for simulations and
//! tests of anything that follows a job by its reads (the daemon's planner).
//!
//! Batch `k` (of `batch` consecutive plan positions) belongs to worker `k mod workers`;
//! each worker reads its batches in order, one file at a time; the training loop
//! consumes batches in order, and each worker may run at most `prefetch` batches
//! (`prefetch_factor`) ahead of it. Which ready worker reads next is the caller's
//! choice (`pick`), standing for uneven per-file times.

/// The plan positions `0..n` in the order the workers read them. `pick(m)` chooses one
/// of the `m` workers ready to read (returns an index `< m`).
pub fn read_order(
    n: usize,
    batch: usize,
    workers: usize,
    prefetch: usize,
    mut pick: impl FnMut(usize) -> usize,
) -> Vec<usize> {
    let (batch, workers, prefetch) = (batch.max(1), workers.max(1), prefetch.max(1));
    let batches = n.div_ceil(batch);
    let size = |k: usize| batch.min(n - k * batch);
    let mut read = vec![0usize; batches]; // files of each batch read so far
    let mut consumed = 0; // batches the loop has consumed
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        while consumed < batches && read[consumed] == size(consumed) {
            consumed += 1;
        }
        // Each worker's current batch (its first not fully read), if the loop is close
        // enough behind for the worker to read it.
        let ready: Vec<usize> = (0..workers)
            .filter_map(|w| {
                let k = (w..batches).step_by(workers).find(|&k| read[k] < size(k))?;
                (k < consumed + workers * prefetch).then_some(k)
            })
            .collect();
        let k = ready[pick(ready.len()).min(ready.len() - 1)];
        out.push(k * batch + read[k]);
        read[k] += 1;
    }
    out
}

/// A small reproducible `pick` (xorshift64 from `seed`): uneven per-file times.
pub fn uneven(seed: u64) -> impl FnMut(usize) -> usize {
    let mut x = seed | 1;
    move |m| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % m as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_worker_reads_in_order_and_many_read_every_position_once_within_their_window() {
        assert_eq!(read_order(10, 3, 1, 2, |_| 0), (0..10).collect::<Vec<_>>());
        let (n, batch, workers, prefetch) = (1000, 16, 4, 2);
        let order = read_order(n, batch, workers, prefetch, uneven(7));
        let mut seen = vec![false; n];
        let mut low = 0;
        for &p in &order {
            assert!(!seen[p], "{p} read twice");
            seen[p] = true;
            while low < n && seen[low] {
                low += 1;
            }
            assert!(
                p < low + batch * workers * prefetch,
                "{p} beyond the window at {low}"
            );
        }
        assert!(seen.iter().all(|&s| s));
        assert_ne!(order, (0..n).collect::<Vec<_>>(), "out of order");
    }
}
