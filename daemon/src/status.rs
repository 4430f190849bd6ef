//! The daemon's status as plain data: what `shardcache status` shows and what the
//! metrics endpoint renders, assembled by the read path ([`crate::cache::ReadPath::status`]).
//!
//! It sits low in the module order (just above `checksum`) so that every part can hand
//! its share of it up ([`crate::stats::Stats::fallbacks`], the jobs' [`JobStatus`]es)
//! and `metrics/` can render it, without any of them knowing the wire. The Unix-socket
//! server maps it to the protobuf reply in one exhaustive conversion.
//!
//! The counters stay the stats table's generated [`pb::Counters`]: the stats table is a
//! macro over the counter names that fills that message directly, and a plain twin of
//! its forty-odd fields would only be a second list to keep equal to the first.
//!
//! Owns: the shape of a status. Must not touch: anything of the daemon's state (it is
//! data; its producers fill it in).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use shardcache_proto::local::v1 as pb;

/// A snapshot of the daemon: space, counters, backing roots, jobs and peers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    /// The daemon's version (the crate's).
    pub daemon_version: String,
    /// Time since the daemon started.
    pub uptime: Duration,
    /// The configured cache directory.
    pub cache_dir: PathBuf,
    /// The store's space and contents.
    pub space: Space,
    /// The store's block size, in bytes.
    pub block_size: u32,
    /// The store's I/O engine: "uring" or "psync".
    pub io_engine: String,
    /// Monotonic counters since the start (see `Counters` in local.proto for each
    /// one's meaning and unit: bytes, blocks, files or events).
    pub counters: pb::Counters,
    /// Client-reported fallbacks by reason, summed since the start: one entry per
    /// reason, zeros included, in the order of the reasons' values.
    pub fallbacks: Vec<Fallbacks>,
    /// Each configured backing root and the health of its calls, in the roots' order.
    pub roots: Vec<RootHealth>,
    /// The bound address of the HTTP endpoint (`/metrics`, `/healthz`, `/readyz`);
    /// `None` when `metrics_listen` is off.
    pub metrics_addr: Option<SocketAddr>,
    /// Client connections open now on the Unix socket (a gauge).
    pub connections: u64,
    /// Every registered job, in job id order.
    pub jobs: Vec<JobStatus>,
    /// Files being prefetched now, for every job together.
    pub prefetching: u64,
    /// This node and the members it knows, when peers are on.
    pub peers: Option<PeersStatus>,
}

/// The store's space and contents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Space {
    /// Capacity (resolved), in bytes.
    pub capacity_bytes: u64,
    /// Bytes of the blocks present.
    pub used_bytes: u64,
    /// Free bytes on the cache file system.
    pub fs_free_bytes: u64,
    /// Total size of the cache file system, in bytes.
    pub fs_size_bytes: u64,
    /// The free-space floor (resolved), in bytes.
    pub min_free_bytes: u64,
    /// Files with at least one block present.
    pub files: u64,
    /// Blocks present.
    pub blocks: u64,
    /// Blocks present not yet verified since this start.
    pub unverified_blocks: u64,
}

/// Client-reported fallbacks for one reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallbacks {
    /// Why the clients read the backing store themselves.
    pub reason: pb::FallbackReason,
    /// Opens that fell back (files).
    pub opens: u64,
    /// Reads that fell back (read calls).
    pub reads: u64,
}

/// One backing root and its calls in flight (docs/SEMANTICS.md, section 2).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RootHealth {
    /// The root's configured name (its path).
    pub root: String,
    /// Calls are refused: one is stuck and none completed for `backing_stall_timeout`.
    pub stalled: bool,
    /// Calls in flight now.
    pub calls_in_flight: u64,
    /// Calls in flight for at least `backing_stall_timeout`.
    pub calls_stuck: u64,
    /// Age of the oldest call in flight, in seconds (0 when none).
    pub oldest_call_seconds: f64,
    /// Calls refused since the start: stalled root, stuck file, too many in flight.
    pub calls_refused: u64,
}

/// This node's peer id and every member it knows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PeersStatus {
    /// This node's peer id.
    pub me: String,
    /// Every member, this node included.
    pub members: Vec<PeerStatus>,
}

/// One member of the cluster, as this node sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PeerStatus {
    /// Its peer id.
    pub id: String,
    /// Not left out of ownership for failures now.
    pub healthy: bool,
    /// Failed exchanges in a row.
    pub failures: u32,
    /// Time since the last successful exchange; `None` before the first.
    pub last_ok: Option<Duration>,
}

/// A registered prefetch manifest and how far its job has read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobStatus {
    /// The job id.
    pub job: String,
    /// The epoch the job reads now.
    pub epoch: u64,
    /// The next step of the epoch the job will read.
    pub step: u64,
    /// Steps in an epoch.
    pub epoch_len: u64,
    /// Files in the job's manifest.
    pub files: u64,
    /// The readiness window: what the job reads next, to the end of its current epoch,
    /// as far as the cache can hold it (at most 4096 files), in files.
    pub window: u64,
    /// Files of the readiness window cached whole.
    pub window_resident: u64,
    /// The readiness window, in bytes.
    pub window_bytes: u64,
    /// Bytes of the readiness window's files cached whole.
    pub window_resident_bytes: u64,
    /// Bytes the daemon read from the backing store for the job's files (its fills:
    /// prefetch, read-ahead and readers' waits; a file two jobs plan is charged to the
    /// one registered first).
    pub backing_bytes: u64,
    /// Bytes the job's clients read from blocks that were cached when they looked
    /// (reported by the clients).
    pub hit_bytes: u64,
    /// Bytes the job's clients had to wait for the daemon to fill.
    pub filled_bytes: u64,
    /// Bytes the job's clients read from the backing store themselves.
    pub fallback_bytes: u64,
    /// Opens of files of this job (counted by the daemon).
    pub opens: u64,
    /// Of those opens, how many found the file cached whole.
    pub opens_hit: u64,
    /// Time the job's readers were blocked waiting for the daemon to fill.
    pub wait: Duration,
    /// Time the job's readers spent reading the backing store themselves.
    pub fallback: Duration,
    /// Steps per second the job reads; `None` until measured.
    pub rate: Option<f64>,
    /// The job's cluster placement (peers on, a shuffle): the nodes it spans (0: not
    /// placed, fetches go by ownership).
    pub placement_nodes: u64,
    /// This node's slots in the placement (the job's files its cache holds), when the
    /// placement counts files (0 when it counts bytes).
    pub placement_slots: u64,
    /// This node's room for the job in the placement, in bytes: its slots in bytes, or
    /// its slots in files × the files' sampled mean size.
    pub placement_room_bytes: u64,
    /// Files the placement puts on this node now.
    pub placement_here: u64,
    /// Copies the placement moved away that this node keeps until their new holders
    /// take them (files).
    pub placement_departing: u64,
    /// Files the registrant may not read, as the prefetcher last checked them (never
    /// fetched for this job).
    pub files_denied: u64,
    /// Directories the registrant's glob did not list.
    pub dirs_denied: u64,
    /// Files of an immutable manifest not held as immutable because another user owns
    /// them (or a directory above them).
    pub immutable_not_owned: u64,
    /// Files of an immutable manifest not held as immutable because they are over the
    /// daemon's limit of held files.
    pub immutable_over_limit: u64,
    /// The job's lease in seconds (0: no lease, it lives until unregistered).
    pub lease_seconds: u32,
    /// Time before the lease runs out unless renewed or a holder is found alive.
    pub lease_remaining: Duration,
    /// Processes whose registrations hold the lease.
    pub lease_holders: u32,
    /// Of those, the ones the daemon sees alive.
    pub lease_holders_alive: u32,
}

/// `d` in seconds, as a float, computed from its nanoseconds (so that a duration built
/// from nanoseconds gives back exactly `ns / 1e9`).
pub fn seconds(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e9
}
