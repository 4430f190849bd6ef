//! Counters of what the daemon did, shared by every part of it and reported by
//! `shardcache status`. (Prometheus export builds on these in a later change.)

use std::sync::atomic::{AtomicU64, Ordering};

use shardcache_proto::local::v1 as pb;

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Monotonic counters; see `Counters` in local.proto for each one's meaning.
        #[derive(Debug, Default)]
        pub struct Stats {
            $(#[allow(missing_docs)] pub $name: AtomicU64,)*
        }

        impl Stats {
            /// A consistent-enough copy for reporting (each counter read once).
            pub fn snapshot(&self) -> pb::Counters {
                pb::Counters { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

counters!(
    opens,
    opens_full,
    opens_partial,
    opens_empty,
    refused_denied,
    refused_path,
    refused_not_found,
    refused_other,
    waits,
    wait_timeouts,
    backing_reads,
    backing_bytes,
    backing_stats,
    blocks_filled,
    fill_errors,
    fills_no_space,
    corrupt_blocks,
    evicted_files,
    evicted_bytes,
    blocks_verified,
    hit_bytes,
    filled_bytes,
    fallback_bytes,
    hit_reads,
    filled_reads,
    fallback_reads,
    fallback_opens,
    queue_shed,
    peer_blocks_in,
    peer_bytes_in,
    peer_errors,
    peer_blocks_out,
    peer_bytes_out,
    peer_refused,
);

/// Adds `n` to a counter.
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Adds one to a counter.
pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Stats {
    /// Adds what a client reported about its own reads.
    pub fn add_report(&self, r: &pb::ReadReport) {
        add(&self.hit_bytes, r.hit_bytes);
        add(&self.filled_bytes, r.filled_bytes);
        add(&self.fallback_bytes, r.fallback_bytes);
        add(&self.hit_reads, r.hit_reads);
        add(&self.filled_reads, r.filled_reads);
        add(&self.fallback_reads, r.fallback_reads);
        add(&self.fallback_opens, r.fallback_opens);
    }
}
