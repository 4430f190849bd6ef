//! The cluster side of a job's plan: this node's slots for each shuffle, and the
//! layout the peers report, handed to the planner (which computes the placement).

use super::*;

impl Jobs {
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
                let Some(files) = self.files_of(&job) else {
                    continue;
                };
                // The mean size over up to 16 files spread over the manifest.
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
                let slots = (store.capacity() / n.max(1) / mean).max(1);
                tracing::debug!(job = %job, slots, mean, "cluster placement: this node's slots");
                self.plans.slots().insert(
                    job.clone(),
                    Slots {
                        files: slots,
                        mean_size: mean,
                    },
                );
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
