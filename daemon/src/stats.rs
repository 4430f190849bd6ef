//! Counters of what the daemon did, shared by every part of it and reported by
//! `shardcache status`. They are the single source of truth: the Prometheus endpoint
//! (`metrics/`) renders the same status at each scrape instead of counting again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use shardcache_proto::local::v1 as pb;

use crate::status::Fallbacks;

/// Number of `FallbackReason` values (the unspecified one included: what an older or
/// newer client reports without a known reason is counted there).
pub const FALLBACK_REASONS: usize = pb::FallbackReason::Direct as usize + 1;

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Monotonic counters; see `Counters` in local.proto for each one's meaning.
        #[derive(Debug, Default)]
        pub struct Stats {
            $(#[allow(missing_docs)] pub $name: AtomicU64,)*
            /// Client-reported fallback opens, by `FallbackReason` (indexed by its value).
            pub fallback_opens_by: [AtomicU64; FALLBACK_REASONS],
            /// Client-reported fallback reads, by `FallbackReason`.
            pub fallback_reads_by: [AtomicU64; FALLBACK_REASONS],
            /// Client connections open now (a gauge, reported as `StatusReply.connections`).
            pub connections: AtomicU64,
            /// Where backing reads are charged to jobs.
            pub charge: Charge,
        }

        impl Stats {
            /// A consistent-enough copy for reporting (each counter read once).
            pub fn snapshot(&self) -> pb::Counters {
                pb::Counters {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                    // The store's engine counts its own (`Store::data_syncs`).
                    ..Default::default()
                }
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
    conns_refused_uid_limit,
    conns_refused_full,
    conns_refused_other,
    conns_closed_uid_limit,
    conns_closed_full,
    journal_recoveries,
    peer_forged,
    handoffs,
    backlog_full,
);

/// Charges bytes a fill read from a backing store to the job whose plan holds the file
/// (`jobs` implements it; the daemon wires it once at start, through [`Charge::set`]).
pub trait ChargeReads: Send + Sync {
    /// `bytes` of `rel` under root `root` were read from the backing store.
    fn backing_read(&self, root: usize, rel: &str, bytes: u64);
}

/// The slot a [`ChargeReads`] is set in once; until then (and in parts tested alone)
/// nothing is charged.
#[derive(Default)]
pub struct Charge(OnceLock<Arc<dyn ChargeReads>>);

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Charge")
            .field(&self.0.get().is_some())
            .finish()
    }
}

impl Charge {
    /// Sets where reads are charged; a second call changes nothing.
    pub fn set(&self, to: Arc<dyn ChargeReads>) {
        let _ = self.0.set(to);
    }

    /// Charges a backing read (see [`ChargeReads::backing_read`]).
    pub fn backing_read(&self, root: usize, rel: &str, bytes: u64) {
        if let Some(c) = self.0.get() {
            c.backing_read(root, rel, bytes);
        }
    }
}

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
        for f in &r.fallbacks {
            // Unknown values (a newer client) count as unspecified.
            let i = usize::try_from(f.reason)
                .ok()
                .filter(|&i| i < FALLBACK_REASONS)
                .unwrap_or(0);
            add(&self.fallback_opens_by[i], f.opens);
            add(&self.fallback_reads_by[i], f.reads);
        }
    }

    /// Fallbacks by reason, one entry per reason (zeros included).
    pub fn fallbacks(&self) -> Vec<Fallbacks> {
        (0..FALLBACK_REASONS)
            .map(|i| Fallbacks {
                // Every index below FALLBACK_REASONS is a reason's value.
                reason: pb::FallbackReason::try_from(i as i32)
                    .unwrap_or(pb::FallbackReason::Unspecified),
                opens: self.fallback_opens_by[i].load(Ordering::Relaxed),
                reads: self.fallback_reads_by[i].load(Ordering::Relaxed),
            })
            .collect()
    }
}
