//! Read accounting: what readers read, by source, per job and per fallback reason,
//! summed in the client until it rides to the daemon on the next request
//! ([`crate::link`] attaches it, and gives it back when that request is not delivered).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use shardcache_proto::local::v1 as pb;

/// Number of `FallbackReason` values (as the daemon counts them).
const FALLBACK_REASONS: usize = pb::FallbackReason::Direct as usize + 1;

#[derive(Default)]
pub(crate) struct Report {
    pub hit_bytes: AtomicU64,
    pub filled_bytes: AtomicU64,
    pub fallback_bytes: AtomicU64,
    pub hit_reads: AtomicU64,
    pub filled_reads: AtomicU64,
    pub fallback_reads: AtomicU64,
    pub fallback_opens: AtomicU64,
    /// Fallback opens and reads by `FallbackReason` (indexed by its value).
    fallback_opens_by: [AtomicU64; FALLBACK_REASONS],
    fallback_reads_by: [AtomicU64; FALLBACK_REASONS],
    /// Per registered job (by tag), from dropped readers.
    pub(crate) jobs: Mutex<HashMap<u64, pb::JobUsage>>,
}

impl Report {
    pub(crate) fn take(&self) -> Option<pb::ReadReport> {
        let r = pb::ReadReport {
            hit_bytes: self.hit_bytes.swap(0, Ordering::Relaxed),
            filled_bytes: self.filled_bytes.swap(0, Ordering::Relaxed),
            fallback_bytes: self.fallback_bytes.swap(0, Ordering::Relaxed),
            hit_reads: self.hit_reads.swap(0, Ordering::Relaxed),
            filled_reads: self.filled_reads.swap(0, Ordering::Relaxed),
            fallback_reads: self.fallback_reads.swap(0, Ordering::Relaxed),
            fallback_opens: self.fallback_opens.swap(0, Ordering::Relaxed),
            fallbacks: (0..FALLBACK_REASONS)
                .map(|i| pb::FallbackCount {
                    reason: i as i32,
                    opens: self.fallback_opens_by[i].swap(0, Ordering::Relaxed),
                    reads: self.fallback_reads_by[i].swap(0, Ordering::Relaxed),
                })
                .filter(|f| f.opens + f.reads > 0)
                .collect(),
            jobs: std::mem::take(&mut *self.jobs.lock().unwrap_or_else(|e| e.into_inner()))
                .into_values()
                .collect(),
        };
        (r != pb::ReadReport::default()).then_some(r)
    }

    /// Counts a fallback open (`open`) or read for `reason`.
    pub(crate) fn add_fallback(&self, reason: pb::FallbackReason, open: bool) {
        let i = (reason as usize).min(FALLBACK_REASONS - 1);
        let by = if open {
            &self.fallback_opens_by
        } else {
            &self.fallback_reads_by
        };
        by[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Adds a reader's totals to what is reported for job `tag`.
    pub(crate) fn add_job(&self, tag: u64, u: &pb::JobUsage) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let e = jobs.entry(tag).or_insert_with(|| pb::JobUsage {
            job_tag: tag,
            ..Default::default()
        });
        e.hit_bytes += u.hit_bytes;
        e.filled_bytes += u.filled_bytes;
        e.fallback_bytes += u.fallback_bytes;
        e.wait_ns += u.wait_ns;
        e.fallback_ns += u.fallback_ns;
    }

    pub(crate) fn give_back(&self, r: &pb::ReadReport) {
        self.hit_bytes.fetch_add(r.hit_bytes, Ordering::Relaxed);
        self.filled_bytes
            .fetch_add(r.filled_bytes, Ordering::Relaxed);
        self.fallback_bytes
            .fetch_add(r.fallback_bytes, Ordering::Relaxed);
        self.hit_reads.fetch_add(r.hit_reads, Ordering::Relaxed);
        self.filled_reads
            .fetch_add(r.filled_reads, Ordering::Relaxed);
        self.fallback_reads
            .fetch_add(r.fallback_reads, Ordering::Relaxed);
        self.fallback_opens
            .fetch_add(r.fallback_opens, Ordering::Relaxed);
        for u in &r.jobs {
            self.add_job(u.job_tag, u);
        }
        for f in &r.fallbacks {
            let i = usize::try_from(f.reason)
                .unwrap_or(0)
                .min(FALLBACK_REASONS - 1);
            self.fallback_opens_by[i].fetch_add(f.opens, Ordering::Relaxed);
            self.fallback_reads_by[i].fetch_add(f.reads, Ordering::Relaxed);
        }
    }
}
