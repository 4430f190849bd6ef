//! The cluster side of a job's plan: this node's slots for each shuffle, and the
//! layout the peers report, handed to the planner (which computes the placement).

use super::*;

/// The part of a node's share of the cache (in thousandths) a placement in bytes leaves
/// unplaced: the store also holds, beside the files the placement puts on the node, the
/// fills under way (their room is reserved before they land) and the files its readers
/// read from other nodes. Filled to the byte before declined waits let go of their pins,
/// the store declined fills of files placed on it and the placement never recovered
/// (`shardcache-bench placement`, log-normal sizes, 400 files, a = 0.5: local reads 0.95
/// falling to 0.60), and 2 % only delayed that loop. With the pins let go
/// (`ReadPath::wait`), measured over 10–20 epochs at 4 nodes (backing ÷ dataset after the
/// first epoch; 2 000 log-normal files, then 400):
///
/// | margin | a = 1, 2 000 files | a = 0.5, 2 000 | a = 1, 400 | a = 0.5, 400 |
/// |---|---|---|---|---|
/// | 1 % | 0.011–0.015 | 0.507–0.512 | 0.020–0.039 | 0.516–0.541 |
/// | 0.3 % | 0.005–0.008 | 0.505–0.509 | 0.013–0.030 | 0.510–0.533 |
/// | 0.1 % | 0.003–0.007 | 0.503–0.508 | 0.009–0.024 | 0.512–0.536 |
/// | 0 | 0.002–0.005 | 0.504–0.507 | 0.010–0.023 | 0.514–0.534 |
///
/// Below 0.3 % the backing bytes barely move and local reads at a = 0.5 start to drop
/// (0.982 at 0.1 % against 0.995): 0.3 % keeps a little room for what the store holds
/// beside the placement. What is left above the floor with few files per node is whole
/// files not fitting the room left, not the margin.
const BYTES_HEADROOM_PER_MILLE: u64 = 3;

/// Most time one prefetch round spends bringing the placements after the positions
/// ([`Jobs::sync_placements`]); the rest waits for the next round, which starts at once.
const PLACEMENT_SYNC_BUDGET: Duration = Duration::from_millis(50);

/// How long one chunk of the cluster placement's simulation may hold the planner lock,
/// about: every fetch from a peer asks the planner who holds the file, and the status
/// waits for it too. A fixed chunk of [`crate::planner::PLACEMENT_CHUNK_READS`] reads
/// held it for seconds under docs/PYTHON.md's example on the testbed (stack samples: 62
/// fill workers and the status waiting on the lock, its holder in the simulation's
/// victim scan).
pub(super) const PLACEMENT_CHUNK_TIME: Duration = Duration::from_millis(5);

/// Fewest simulated reads per chunk.
const MIN_CHUNK_READS: u64 = 256;

/// The next chunk after one of `chunk` reads that held the planner lock for `took`:
/// halved past [`PLACEMENT_CHUNK_TIME`], doubled under a quarter of it, within
/// [`MIN_CHUNK_READS`] and [`crate::planner::PLACEMENT_CHUNK_READS`].
fn next_chunk(chunk: u64, took: Duration) -> u64 {
    if took > PLACEMENT_CHUNK_TIME {
        (chunk / 2).max(MIN_CHUNK_READS)
    } else if took < PLACEMENT_CHUNK_TIME / 4 {
        chunk
            .saturating_mul(2)
            .min(crate::planner::PLACEMENT_CHUNK_READS)
    } else {
        chunk
    }
}

impl Jobs {
    /// Brings every shuffle's cluster placement after its position (reads and position
    /// reports only move positions: [`crate::planner::Planner::sync_placements`]), in
    /// chunks of simulated reads, one taking of the planner lock each, for at most
    /// [`PLACEMENT_SYNC_BUDGET`]; past it, another round is asked for at once. A chunk
    /// is fitted to hold the lock about [`PLACEMENT_CHUNK_TIME`] ([`next_chunk`]).
    pub(super) fn sync_placements(&self) {
        let start = Instant::now();
        loop {
            let chunk = self.placement_chunk.load(Ordering::Relaxed);
            let done = {
                let mut p = self.plans.planner();
                let t = Instant::now();
                let done = p.sync_placements(chunk);
                let took = t.elapsed();
                drop(p);
                self.placement_chunk
                    .store(next_chunk(chunk, took), Ordering::Relaxed);
                done
            };
            if done {
                return;
            }
            if start.elapsed() >= PLACEMENT_SYNC_BUDGET {
                self.wake.notify();
                return;
            }
        }
    }

    /// Computes this node's slots for every shuffle that has none yet, and gives each
    /// its cluster layout as the peers report it (none until every rank's node and
    /// every node's slots are known: eviction and fetches then go by ownership).
    pub(super) fn update_layouts(&self, store: &Store) {
        let Some(peers) = &self.peers else {
            return;
        };
        let shuffles = self.plans.planner().shuffles();
        let n = shuffles.len() as u64;
        let me = peers.view().1;
        for (job, world, _) in shuffles {
            if !self.plans.slots().contains_key(&job) {
                let share = store.capacity() / n.max(1);
                let slots = if self.plans.planner().has_sizes(&job) {
                    // The manifest gave every file's size: the placement counts bytes,
                    // all but a little of the share (see `BYTES_HEADROOM_PER_MILLE`).
                    Slots {
                        units: (share / 1000 * (1000 - BYTES_HEADROOM_PER_MILLE)).max(1),
                        unit_bytes: 1,
                        bytes: true,
                    }
                } else {
                    let Some(files) = self.files_of(&job) else {
                        continue;
                    };
                    // The mean size over up to 16 files spread over the manifest. (A
                    // larger sample does not help: counted in files, the nodes holding
                    // larger files than the mean overflow their stores whatever the
                    // mean; give the sizes in the manifest for a placement in bytes.)
                    let every = (files.len() / 16).max(1);
                    let sizes: Vec<u64> = files
                        .iter()
                        .step_by(every)
                        .take(16)
                        .filter_map(|f| self.size_of(f))
                        .collect();
                    if sizes.is_empty() {
                        continue;
                    }
                    let mean = (sizes.iter().sum::<u64>() / sizes.len() as u64).max(1);
                    Slots {
                        units: (share / mean).max(1),
                        unit_bytes: mean,
                        bytes: false,
                    }
                };
                tracing::debug!(job = %job, slots = slots.units, unit = slots.unit_bytes, "cluster placement: this node's slots");
                self.plans.slots().insert(job.clone(), slots);
            }
            let Some(layout) = peers.layout(&job, world) else {
                self.plans.planner().set_layout(&job, None, &me);
                continue;
            };
            let made = self.plans.planner().placement_for(&job, layout, &me);
            if let Some((mut p, target)) = made {
                // The replay from the start of the plan, without the planner lock.
                p.advance(target);
                self.plans.planner().install_placement(&job, p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunk halves while a taking holds the planner lock too long, down to its
    /// floor, and grows back, up to its ceiling, while takings are short.
    #[test]
    fn the_placement_chunk_follows_how_long_it_held_the_lock() {
        let max = crate::planner::PLACEMENT_CHUNK_READS;
        let slow = PLACEMENT_CHUNK_TIME * 40;
        let mut c = max;
        let mut halvings = 0;
        while c > MIN_CHUNK_READS {
            c = next_chunk(c, slow);
            halvings += 1;
            assert!(halvings <= 64);
        }
        assert_eq!(c, MIN_CHUNK_READS);
        assert_eq!(
            next_chunk(c, slow),
            MIN_CHUNK_READS,
            "never below the floor"
        );
        assert_eq!(
            next_chunk(c, PLACEMENT_CHUNK_TIME / 2),
            c,
            "kept when about right"
        );
        while c < max {
            c = next_chunk(c, Duration::ZERO);
        }
        assert_eq!(next_chunk(c, Duration::ZERO), max, "never past the ceiling");
    }
}
