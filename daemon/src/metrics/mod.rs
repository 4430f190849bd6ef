//! Prometheus metrics: every name, type, unit, help text and label set the daemon
//! exports is defined here, once ([`ALL`]), and the same list is in docs/METRICS.md (a
//! test keeps the two equal). [`http`] serves them with the probes.
//!
//! The daemon's counters already live in one place (`stats::Stats`, per-job usage in
//! `jobs`, space in `store`), and `shardcache status` reports them. A scrape renders that
//! same status ([`crate::status::Status`], which the read path assembles and the socket
//! server maps to its reply): it builds a fresh recorder, describes every metric, sets
//! every series from the status (counters to their absolute values) and renders it. So
//! nothing is counted twice, the endpoint and `status` can never disagree, and the series
//! of a job that was unregistered, or a peer that left, are gone at the next scrape. Only what the
//! status does not hold is recorded as it happens, into a recorder that lives as long as
//! the daemon: the prefetch lead-time histogram and the count of late prefetches
//! ([`PrefetchInstruments`]).
//!
//! Label values are bounded: fixed sets (below), registered job ids (bounded by the
//! registered jobs), peer ids (bounded by the membership) and the configured backing
//! roots (bounded by the configuration); never the paths of files.
//!
//! This module reads a status and hands out instruments; it never reaches into the
//! other modules' state.

pub mod http;

use metrics::{Counter, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use shardcache_proto::local::v1 as pb;

use crate::status::{JobStatus, Status, seconds};

/// What kind of Prometheus metric a definition is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic (its name ends in `_total`).
    Counter,
    /// A value that goes up and down.
    Gauge,
    /// A distribution of observations, in buckets.
    Histogram,
}

/// One exported metric: its name (with its unit in it, Prometheus style), kind, unit,
/// label names and help text.
#[derive(Debug)]
pub struct Def {
    /// The metric name, `shardcache_` prefixed.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// The base unit, when it has one.
    pub unit: Option<Unit>,
    /// Label names, in the order the values are given.
    pub labels: &'static [&'static str],
    /// The help text.
    pub help: &'static str,
}

macro_rules! defs {
    ($($id:ident: $kind:ident $name:literal $unit:expr, [$($label:literal),*], $help:literal;)*) => {
        $(
            #[doc = $help]
            pub const $id: Def = Def {
                name: $name,
                kind: Kind::$kind,
                unit: $unit,
                labels: &[$($label),*],
                help: $help,
            };
        )*
        /// Every metric the daemon exports.
        pub const ALL: &[&Def] = &[$(&$id),*];
    };
}

const BYTES: Option<Unit> = Some(Unit::Bytes);
const SECONDS: Option<Unit> = Some(Unit::Seconds);
const COUNT: Option<Unit> = Some(Unit::Count);
const NONE: Option<Unit> = None;

defs! {
    BUILD_INFO: Gauge "shardcache_build_info" NONE, ["version"],
        "Always 1; the version label is the daemon's version.";
    UPTIME: Gauge "shardcache_uptime_seconds" SECONDS, [],
        "Seconds since the daemon started.";
    IO_ENGINE: Gauge "shardcache_store_io_engine" NONE, ["engine"],
        "Always 1; the engine label is the store's I/O engine (uring or psync).";

    READ_BYTES: Counter "shardcache_read_bytes_total" BYTES, ["result"],
        "Bytes clients read, by where they came from: hit (the local copy, already present), filled (the local copy, after waiting for a fill from a peer or the backing store), fallback (the backing store, read by the client itself). Reported by clients with their next request.";
    READS: Counter "shardcache_reads_total" COUNT, ["result"],
        "Read calls of clients, by where they were served from (as shardcache_read_bytes_total).";
    FALLBACK_OPENS: Counter "shardcache_fallback_opens_total" COUNT, ["reason"],
        "Opens a client served from the backing store itself because the cache could not help, by reason.";
    FALLBACK_READS: Counter "shardcache_fallback_reads_total" COUNT, ["reason"],
        "Read calls a client served from the backing store itself, by the reason it turned to it.";

    OPENS: Counter "shardcache_opens_total" COUNT, ["cached"],
        "Opens the daemon allowed, by how much of the file was cached: full, partial, none.";
    REFUSALS: Counter "shardcache_refusals_total" COUNT, ["reason"],
        "Open and wait requests the daemon refused (the client then reads the backing store): denied, path (not under a root, escaping it, malformed), not_found, other.";
    WAITS: Counter "shardcache_waits_total" COUNT, [],
        "Client requests to wait for missing blocks.";
    WAIT_TIMEOUTS: Counter "shardcache_wait_timeouts_total" COUNT, [],
        "Waits for blocks that ran out of time.";

    CONNECTIONS: Gauge "shardcache_connections" COUNT, [],
        "Client connections open on the Unix socket.";
    CONNECTIONS_REFUSED: Counter "shardcache_connections_refused_total" COUNT, ["reason"],
        "Client connections refused (the client reads the backing store): uid_limit (its uid held max_connections_per_uid, none idle), full (max_connections held, none idle to close), other (no credentials, thread or descriptor).";
    CONNECTIONS_CLOSED: Counter "shardcache_connections_closed_total" COUNT, ["reason"],
        "Idle client connections closed to admit another: uid_limit (the same uid's oldest idle one), full (the oldest idle one of the uid holding the most).";

    BACKING_READS: Counter "shardcache_backing_reads_total" COUNT, [],
        "Block reads of the daemon from the backing store.";
    BACKING_READ_BYTES: Counter "shardcache_backing_read_bytes_total" BYTES, [],
        "Bytes the daemon read from the backing store.";
    BACKING_METADATA_OPS: Counter "shardcache_backing_metadata_ops_total" COUNT, [],
        "Metadata lookups (stat of a path) on the backing store; at most one per path per metadata_ttl.";
    BLOCKS_FILLED: Counter "shardcache_blocks_filled_total" COUNT, [],
        "Blocks written to the cache.";
    FILL_ERRORS: Counter "shardcache_fill_errors_total" COUNT, [],
        "Fills that failed (backing or local I/O error, or the file changed).";
    FILLS_NO_SPACE: Counter "shardcache_fills_no_space_total" COUNT, [],
        "Fills refused because nothing could be evicted to make room.";
    FILL_QUEUE_SHED: Counter "shardcache_fill_queue_shed_total" COUNT, [],
        "Fill requests (read-ahead, prefetch) dropped because the fill queue was full.";
    HANDOFFS: Counter "shardcache_handoffs_total" COUNT, [],
        "Opens of a cold small file and waits answered with blocks read for the reader before they landed (the reader did not wait for the store's durable write).";
    STORE_DATA_SYNCS: Counter "shardcache_store_data_syncs_total" COUNT, [],
        "Syncs of the store's data files, their directories and its file system (fsync, fdatasync, syncfs; not the index journal's): each a wait for the cache disk. Two for a small file landed alone, one for a batch of new small files (Linux 5.8 and later), one for a block written to a file already on disk.";
    FILL_BACKLOG_FULL: Counter "shardcache_fill_backlog_full_total" COUNT, [],
        "Small files handed to their readers while the store landed as many blocks as it may and the backlog landed behind the readers was full: their fill workers landed them, each with up to 31 files waiting in the backlog as one batch (the store's writes set the pace of the fills).";
    BACKING_STALLED: Gauge "shardcache_backing_stalled" NONE, ["root"],
        "1 while the backing root is stalled (a call stuck and none completed for backing_stall_timeout: its calls are refused, clients read it directly), else 0.";
    BACKING_STUCK_CALLS: Gauge "shardcache_backing_stuck_calls" COUNT, ["root"],
        "Calls on the backing root in flight for at least backing_stall_timeout (threads held by it).";
    BACKING_REFUSED_CALLS: Counter "shardcache_backing_refused_calls_total" COUNT, ["root"],
        "Calls on the backing root refused at once: the root stalled, the file stuck, or too many calls in flight.";

    PEER_BYTES: Counter "shardcache_peer_bytes_total" BYTES, ["direction"],
        "Block bytes exchanged with peers: received (checked, then cached or passed on) and sent.";
    PEER_BLOCKS: Counter "shardcache_peer_blocks_total" COUNT, ["direction"],
        "Blocks exchanged with peers: received and sent.";
    PEER_ERRORS: Counter "shardcache_peer_errors_total" COUNT, [],
        "Fetches from peers that failed (the backing store was read instead).";
    PEER_REFUSED: Counter "shardcache_peer_refused_total" COUNT, [],
        "Peer requests refused for a bad or missing secret.";
    PEER_FORGED: Counter "shardcache_peer_forged_total" COUNT, [],
        "Messages from peers whose MAC did not verify (forged, changed on the way, or replayed): dropped.";
    PEERS: Gauge "shardcache_peers" COUNT, ["state"],
        "Other members of the cluster, by health: healthy, down (0 and 0 when sharing is off).";
    PEER_UP: Gauge "shardcache_peer_up" NONE, ["peer"],
        "1 while a peer is healthy, 0 while it is down (one series per other member).";

    BLOCKS_VERIFIED: Counter "shardcache_blocks_verified_total" COUNT, [],
        "Blocks whose checksum was checked (after a start, before first use or by the background scrub; or by verify).";
    CORRUPT_BLOCKS: Counter "shardcache_corrupt_blocks_total" COUNT, [],
        "Blocks that failed their checksum (dropped, fetched again on next use).";
    JOURNAL_RECOVERIES: Counter "shardcache_journal_recoveries_total" COUNT, [],
        "Starts that found the index journal damaged (unreadable, not a journal, a torn or corrupt record): it was set aside as journal.bad-(unix seconds), and the cache started from the intact records before the damage.";
    EVICTED_FILES: Counter "shardcache_evicted_files_total" COUNT, [],
        "Files evicted to respect capacity or min_free, or by shardcache evict.";
    EVICTED_BYTES: Counter "shardcache_evicted_bytes_total" BYTES, [],
        "Bytes of the files evicted.";

    CAPACITY: Gauge "shardcache_cache_capacity_bytes" BYTES, [],
        "Most bytes of cached data (capacity, resolved).";
    USED: Gauge "shardcache_cache_used_bytes" BYTES, [],
        "Bytes of cached blocks.";
    FS_FREE: Gauge "shardcache_cache_fs_free_bytes" BYTES, [],
        "Free bytes on the cache file system.";
    FS_SIZE: Gauge "shardcache_cache_fs_size_bytes" BYTES, [],
        "Total size of the cache file system.";
    MIN_FREE: Gauge "shardcache_cache_min_free_bytes" BYTES, [],
        "Free space always left on the cache file system (min_free, resolved).";
    CACHED_FILES: Gauge "shardcache_cache_files" COUNT, [],
        "Cached files (with at least one block).";
    CACHED_BLOCKS: Gauge "shardcache_cache_blocks" COUNT, [],
        "Cached blocks.";
    UNVERIFIED_BLOCKS: Gauge "shardcache_cache_unverified_blocks" COUNT, [],
        "Cached blocks not yet verified since this start (checked before first use, or by the background scrub).";

    JOBS: Gauge "shardcache_jobs" COUNT, [],
        "Registered jobs (prefetch manifests).";
    PREFETCH_IN_FLIGHT: Gauge "shardcache_prefetch_in_flight_files" COUNT, [],
        "Files being prefetched now (for all jobs).";
    PREFETCH_LEAD: Histogram "shardcache_prefetch_lead_seconds" SECONDS, [],
        "For each file a job opened that the prefetcher had made resident: seconds between it becoming resident and the open.";
    PREFETCH_LATE: Counter "shardcache_prefetch_late_total" COUNT, [],
        "Opens of a job's file while its prefetch was still in flight (the prefetch came too late).";

    JOB_FILES: Gauge "shardcache_job_files" COUNT, ["job_id"],
        "Files in the job's manifest.";
    JOB_EPOCH: Gauge "shardcache_job_epoch" NONE, ["job_id"],
        "The epoch the job reads.";
    JOB_STEP: Gauge "shardcache_job_step" NONE, ["job_id"],
        "The next step of its epoch the job will read.";
    JOB_EPOCH_STEPS: Gauge "shardcache_job_epoch_steps" COUNT, ["job_id"],
        "Steps in the job's epoch.";
    JOB_RATE: Gauge "shardcache_job_steps_per_second" NONE, ["job_id"],
        "Steps per second the job reads (measured; 0 until measured).";
    JOB_READ_BYTES: Counter "shardcache_job_read_bytes_total" BYTES, ["job_id", "result"],
        "Bytes the job's readers read, by where they came from (hit, filled, fallback); reported when a reader is closed. The job's hit ratio is the hit share.";
    JOB_OPENS: Counter "shardcache_job_opens_total" COUNT, ["job_id"],
        "Opens of the job's files.";
    JOB_OPENS_CACHED: Counter "shardcache_job_opens_cached_total" COUNT, ["job_id"],
        "Opens of the job's files that found the file cached whole.";
    JOB_BACKING_BYTES: Counter "shardcache_job_backing_read_bytes_total" BYTES, ["job_id"],
        "Bytes the daemon read from the backing store for the job's files (prefetch and fills).";
    JOB_STALL: Counter "shardcache_job_stall_seconds_total" SECONDS, ["job_id", "cause"],
        "Seconds the job's readers were blocked on data (data stall): fill_wait (waiting for the daemon to fetch blocks), fallback_read (reading the backing store themselves).";
    JOB_WINDOW_FILES: Gauge "shardcache_job_window_files" COUNT, ["job_id"],
        "Files in the job's readiness window: what it reads next, to the end of its epoch, as far as the cache can hold it.";
    JOB_WINDOW_RESIDENT_FILES: Gauge "shardcache_job_window_resident_files" COUNT, ["job_id"],
        "Files of the readiness window cached whole.";
    JOB_WINDOW_BYTES: Gauge "shardcache_job_window_bytes" BYTES, ["job_id"],
        "Bytes of the readiness window.";
    JOB_WINDOW_RESIDENT_BYTES: Gauge "shardcache_job_window_resident_bytes" BYTES, ["job_id"],
        "Bytes of the readiness window that are cached.";
    JOB_WINDOW_RESIDENT_RATIO: Gauge "shardcache_job_window_resident_ratio" NONE, ["job_id"],
        "Fraction (0-1) of the readiness window's bytes that are cached (1 for an empty window).";
    JOB_PLACEMENT_NODES: Gauge "shardcache_job_placement_nodes" COUNT, ["job_id"],
        "Nodes the job's cluster placement spans (0: not placed; fetches go by ownership).";
    JOB_PLACEMENT_SLOTS: Gauge "shardcache_job_placement_slots_files" COUNT, ["job_id"],
        "The job's files this node's cache holds under its cluster placement (0 when it counts bytes).";
    JOB_PLACEMENT_ROOM: Gauge "shardcache_job_placement_room_bytes" BYTES, ["job_id"],
        "This node's room for the job under its cluster placement, in bytes.";
    JOB_PLACEMENT_HERE: Gauge "shardcache_job_placement_here_files" COUNT, ["job_id"],
        "Files the job's cluster placement puts on this node now.";
    JOB_PLACEMENT_DEPARTING: Gauge "shardcache_job_placement_departing_files" COUNT, ["job_id"],
        "Copies the cluster placement moved to other nodes that this node keeps until they take them.";
    JOB_FILES_DENIED: Gauge "shardcache_job_files_denied" COUNT, ["job_id"],
        "Files of the job its registrant may not read (as the prefetcher last checked them): never fetched for it.";
    JOB_DIRS_DENIED: Gauge "shardcache_job_dirs_denied" COUNT, ["job_id"],
        "Directories the job's glob did not list because its registrant may not list or search them.";
    JOB_LEASE_SECONDS: Gauge "shardcache_job_lease_seconds" SECONDS, ["job_id"],
        "The job's lease (0: no lease, it lives until unregistered).";
    JOB_LEASE_REMAINING: Gauge "shardcache_job_lease_remaining_seconds" SECONDS, ["job_id"],
        "Seconds before the job's lease runs out unless renewed or a holder is found alive.";
    JOB_LEASE_HOLDERS_ALIVE: Gauge "shardcache_job_lease_holders_alive" COUNT, ["job_id"],
        "Processes holding the job's lease that the daemon sees alive.";
    JOB_IMMUTABLE_NOT_HELD: Gauge "shardcache_job_immutable_not_held_files" COUNT, ["job_id", "reason"],
        "Files of an immutable manifest not held as immutable (they follow metadata_ttl), by reason: not_owned (another user owns the file or a directory above it), over_limit (the daemon holds its most).";
}

/// Label values of the fixed sets.
pub mod label {
    /// `result` of client reads.
    pub const RESULT: [&str; 3] = ["hit", "filled", "fallback"];
    /// `cached` of opens.
    pub const CACHED: [&str; 3] = ["full", "partial", "none"];
    /// `reason` of refusals.
    pub const REFUSAL: [&str; 4] = ["denied", "path", "not_found", "other"];
    /// `reason` of refused client connections.
    pub const CONN_REFUSAL: [&str; 3] = ["uid_limit", "full", "other"];
    /// `reason` of idle client connections closed to make room.
    pub const CONN_CLOSED: [&str; 2] = ["uid_limit", "full"];
    /// `direction` of peer traffic.
    pub const DIRECTION: [&str; 2] = ["received", "sent"];
    /// `state` of peers.
    pub const PEER_STATE: [&str; 2] = ["healthy", "down"];
    /// `cause` of a data stall.
    pub const STALL: [&str; 2] = ["fill_wait", "fallback_read"];
    /// `reason` a file of an immutable manifest is not held.
    pub const NOT_HELD: [&str; 2] = ["not_owned", "over_limit"];
}

/// The `reason` label of a client fallback (exhaustive: a new reason must be named here).
pub fn fallback_reason(r: pb::FallbackReason) -> &'static str {
    use pb::FallbackReason as F;
    match r {
        F::Unspecified => "unknown",
        F::Unavailable => "unavailable",
        F::Timeout => "timeout",
        F::Refused => "refused",
        F::Declined => "declined",
        F::WaitTimeout => "wait_timeout",
        F::Stale => "stale",
        F::LocalError => "local_error",
        F::Protocol => "protocol",
        F::Direct => "direct",
    }
}

/// Buckets of the prefetch lead time (seconds): from "just in time" to an hour ahead.
const LEAD_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

fn metadata() -> Metadata<'static> {
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()))
}

fn key(def: &Def, values: &[&str]) -> Key {
    debug_assert_eq!(def.labels.len(), values.len(), "{}", def.name);
    let labels: Vec<Label> = def
        .labels
        .iter()
        .zip(values)
        .map(|(k, v)| Label::new(*k, (*v).to_owned()))
        .collect();
    Key::from_parts(def.name, labels)
}

fn describe(rec: &PrometheusRecorder, def: &Def) {
    let (name, help) = (
        KeyName::from_const_str(def.name),
        SharedString::const_str(def.help),
    );
    match def.kind {
        Kind::Counter => rec.describe_counter(name, def.unit, help),
        Kind::Gauge => rec.describe_gauge(name, def.unit, help),
        Kind::Histogram => rec.describe_histogram(name, def.unit, help),
    }
}

/// Instruments the prefetcher records into (cheap to clone).
#[derive(Debug, Clone)]
pub struct PrefetchInstruments {
    /// [`PREFETCH_LEAD`].
    pub lead: Histogram,
    /// [`PREFETCH_LATE`].
    pub late: Counter,
}

/// The daemon's metrics: renders statuses, and holds the event instruments.
#[derive(Debug)]
pub struct Metrics {
    events: PrometheusRecorder,
    prefetch: PrefetchInstruments,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every event instrument registered (at 0) and described.
    pub fn new() -> Self {
        let events = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(PREFETCH_LEAD.name.into()), LEAD_BUCKETS)
            .map(PrometheusBuilder::build_recorder)
            // The buckets are constant and not empty, so this cannot fail; were it to,
            // the lead time would be rendered as a summary instead.
            .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
        for d in [&PREFETCH_LEAD, &PREFETCH_LATE] {
            describe(&events, d);
        }
        let prefetch = PrefetchInstruments {
            lead: events.register_histogram(&key(&PREFETCH_LEAD, &[]), &metadata()),
            late: events.register_counter(&key(&PREFETCH_LATE, &[]), &metadata()),
        };
        Self { events, prefetch }
    }

    /// The prefetcher's instruments.
    pub fn prefetch(&self) -> PrefetchInstruments {
        self.prefetch.clone()
    }

    /// The Prometheus text exposition of `s` (the daemon's status) and the event
    /// instruments.
    pub fn render(&self, s: &Status) -> String {
        let rec = PrometheusBuilder::new().build_recorder();
        for d in ALL {
            if ![PREFETCH_LEAD.name, PREFETCH_LATE.name, JOB_STALL.name].contains(&d.name) {
                describe(&rec, d);
            }
        }
        let w = Writer { rec: &rec };
        w.gauge(&BUILD_INFO, &[&s.daemon_version], 1.0);
        w.gauge(&UPTIME, &[], s.uptime.as_secs() as f64);
        w.gauge(&IO_ENGINE, &[&s.io_engine], 1.0);
        let c = &s.counters;
        for (v, (bytes, reads)) in label::RESULT.iter().zip([
            (c.hit_bytes, c.hit_reads),
            (c.filled_bytes, c.filled_reads),
            (c.fallback_bytes, c.fallback_reads),
        ]) {
            w.counter(&READ_BYTES, &[v], bytes);
            w.counter(&READS, &[v], reads);
        }
        for f in &s.fallbacks {
            let reason = fallback_reason(f.reason);
            w.counter(&FALLBACK_OPENS, &[reason], f.opens);
            w.counter(&FALLBACK_READS, &[reason], f.reads);
        }
        for (v, n) in label::CACHED
            .iter()
            .zip([c.opens_full, c.opens_partial, c.opens_empty])
        {
            w.counter(&OPENS, &[v], n);
        }
        for (v, n) in label::REFUSAL.iter().zip([
            c.refused_denied,
            c.refused_path,
            c.refused_not_found,
            c.refused_other,
        ]) {
            w.counter(&REFUSALS, &[v], n);
        }
        for (v, n) in label::CONN_REFUSAL.iter().zip([
            c.conns_refused_uid_limit,
            c.conns_refused_full,
            c.conns_refused_other,
        ]) {
            w.counter(&CONNECTIONS_REFUSED, &[v], n);
        }
        for (v, n) in label::CONN_CLOSED
            .iter()
            .zip([c.conns_closed_uid_limit, c.conns_closed_full])
        {
            w.counter(&CONNECTIONS_CLOSED, &[v], n);
        }
        for (d, n) in [
            (&WAITS, c.waits),
            (&WAIT_TIMEOUTS, c.wait_timeouts),
            (&BACKING_READS, c.backing_reads),
            (&BACKING_READ_BYTES, c.backing_bytes),
            (&BACKING_METADATA_OPS, c.backing_stats),
            (&BLOCKS_FILLED, c.blocks_filled),
            (&FILL_ERRORS, c.fill_errors),
            (&FILLS_NO_SPACE, c.fills_no_space),
            (&FILL_QUEUE_SHED, c.queue_shed),
            (&HANDOFFS, c.handoffs),
            (&FILL_BACKLOG_FULL, c.backlog_full),
            (&STORE_DATA_SYNCS, c.data_syncs),
            (&PEER_ERRORS, c.peer_errors),
            (&PEER_REFUSED, c.peer_refused),
            (&PEER_FORGED, c.peer_forged),
            (&BLOCKS_VERIFIED, c.blocks_verified),
            (&CORRUPT_BLOCKS, c.corrupt_blocks),
            (&JOURNAL_RECOVERIES, c.journal_recoveries),
            (&EVICTED_FILES, c.evicted_files),
            (&EVICTED_BYTES, c.evicted_bytes),
        ] {
            w.counter(d, &[], n);
        }
        for (v, (bytes, blocks)) in label::DIRECTION.iter().zip([
            (c.peer_bytes_in, c.peer_blocks_in),
            (c.peer_bytes_out, c.peer_blocks_out),
        ]) {
            w.counter(&PEER_BYTES, &[v], bytes);
            w.counter(&PEER_BLOCKS, &[v], blocks);
        }
        let others: Vec<_> = s
            .peers
            .iter()
            .flat_map(|p| p.members.iter().filter(move |m| m.id != p.me))
            .collect();
        let healthy = others.iter().filter(|p| p.healthy).count();
        w.gauge(&PEERS, &["healthy"], healthy as f64);
        w.gauge(&PEERS, &["down"], (others.len() - healthy) as f64);
        for p in &others {
            w.gauge(&PEER_UP, &[&p.id], if p.healthy { 1.0 } else { 0.0 });
        }
        for b in &s.roots {
            w.gauge(
                &BACKING_STALLED,
                &[&b.root],
                if b.stalled { 1.0 } else { 0.0 },
            );
            w.gauge(&BACKING_STUCK_CALLS, &[&b.root], b.calls_stuck as f64);
            w.counter(&BACKING_REFUSED_CALLS, &[&b.root], b.calls_refused);
        }
        for (d, n) in [
            (&CAPACITY, s.space.capacity_bytes),
            (&USED, s.space.used_bytes),
            (&FS_FREE, s.space.fs_free_bytes),
            (&FS_SIZE, s.space.fs_size_bytes),
            (&MIN_FREE, s.space.min_free_bytes),
            (&CACHED_FILES, s.space.files),
            (&CACHED_BLOCKS, s.space.blocks),
            (&UNVERIFIED_BLOCKS, s.space.unverified_blocks),
            (&CONNECTIONS, s.connections),
            (&JOBS, s.jobs.len() as u64),
            (
                &PREFETCH_IN_FLIGHT,
                // 0 without jobs, as `shardcache status` shows it (in each job's).
                if s.jobs.is_empty() { 0 } else { s.prefetching },
            ),
        ] {
            w.gauge(d, &[], n as f64);
        }
        for j in &s.jobs {
            w.job(j);
        }
        let mut out = rec.handle().render();
        let stall: Vec<(Vec<&str>, f64)> = s
            .jobs
            .iter()
            .flat_map(|j| {
                label::STALL
                    .iter()
                    .zip([seconds(j.wait), seconds(j.fallback)])
                    .map(|(cause, secs)| (vec![j.job.as_str(), *cause], secs))
            })
            .collect();
        write_float_counter(&mut out, &JOB_STALL, &stall);
        out.push_str(&self.events.handle().render());
        out
    }
}

/// Sets series on a scrape's recorder.
struct Writer<'a> {
    rec: &'a PrometheusRecorder,
}

impl Writer<'_> {
    fn counter(&self, def: &Def, values: &[&str], n: u64) {
        debug_assert_eq!(def.kind, Kind::Counter, "{}", def.name);
        self.rec
            .register_counter(&key(def, values), &metadata())
            .absolute(n);
    }

    fn gauge(&self, def: &Def, values: &[&str], v: f64) {
        debug_assert_eq!(def.kind, Kind::Gauge, "{}", def.name);
        self.rec
            .register_gauge(&key(def, values), &metadata())
            .set(v);
    }

    fn job(&self, j: &JobStatus) {
        let id = j.job.as_str();
        for (d, v) in [
            (&JOB_FILES, j.files as f64),
            (&JOB_EPOCH, j.epoch as f64),
            (&JOB_STEP, j.step as f64),
            (&JOB_EPOCH_STEPS, j.epoch_len as f64),
            (&JOB_RATE, j.rate.unwrap_or(0.0)),
            (&JOB_WINDOW_FILES, j.window as f64),
            (&JOB_WINDOW_RESIDENT_FILES, j.window_resident as f64),
            (&JOB_WINDOW_BYTES, j.window_bytes as f64),
            (&JOB_WINDOW_RESIDENT_BYTES, j.window_resident_bytes as f64),
            (&JOB_PLACEMENT_NODES, j.placement_nodes as f64),
            (&JOB_PLACEMENT_SLOTS, j.placement_slots as f64),
            (&JOB_PLACEMENT_ROOM, j.placement_room_bytes as f64),
            (&JOB_PLACEMENT_HERE, j.placement_here as f64),
            (&JOB_PLACEMENT_DEPARTING, j.placement_departing as f64),
            (&JOB_FILES_DENIED, j.files_denied as f64),
            (&JOB_DIRS_DENIED, j.dirs_denied as f64),
            (&JOB_LEASE_SECONDS, f64::from(j.lease_seconds)),
            (&JOB_LEASE_REMAINING, j.lease_remaining.as_secs_f64()),
            (&JOB_LEASE_HOLDERS_ALIVE, f64::from(j.lease_holders_alive)),
            (
                &JOB_WINDOW_RESIDENT_RATIO,
                if j.window_bytes == 0 {
                    1.0
                } else {
                    j.window_resident_bytes as f64 / j.window_bytes as f64
                },
            ),
        ] {
            self.gauge(d, &[id], v);
        }
        for (v, n) in label::RESULT
            .iter()
            .zip([j.hit_bytes, j.filled_bytes, j.fallback_bytes])
        {
            self.counter(&JOB_READ_BYTES, &[id, v], n);
        }
        self.counter(&JOB_OPENS, &[id], j.opens);
        self.counter(&JOB_OPENS_CACHED, &[id], j.opens_hit);
        self.counter(&JOB_BACKING_BYTES, &[id], j.backing_bytes);
        for (v, n) in label::NOT_HELD
            .iter()
            .zip([j.immutable_not_owned, j.immutable_over_limit])
        {
            self.gauge(&JOB_IMMUTABLE_NOT_HELD, &[id, v], n as f64);
        }
    }
}

/// Writes a counter family with fractional values, which the exporter cannot hold (its
/// counters are integers) — seconds of data stall must not be rounded to whole seconds.
/// Same text format: HELP, TYPE, then one line per series.
fn write_float_counter(out: &mut String, def: &Def, series: &[(Vec<&str>, f64)]) {
    use std::fmt::Write;
    debug_assert_eq!(def.kind, Kind::Counter, "{}", def.name);
    if series.is_empty() {
        return;
    }
    let _ = writeln!(out, "# HELP {} {}", def.name, escape(def.help, false));
    let _ = writeln!(out, "# TYPE {} counter", def.name);
    for (values, v) in series {
        debug_assert_eq!(def.labels.len(), values.len(), "{}", def.name);
        let labels: Vec<String> = def
            .labels
            .iter()
            .zip(values)
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v, true)))
            .collect();
        let _ = writeln!(out, "{}{{{}}} {v}", def.name, labels.join(","));
    }
}

/// Escapes a help text or (`quotes`) a label value for the text format.
fn escape(s: &str, quotes: bool) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '"' if quotes => o.push_str("\\\""),
            c => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::status::{Fallbacks, PeerStatus, PeersStatus, RootHealth, Space};

    /// A status with every part present: two jobs, peers (one down), fallbacks.
    fn sample() -> Status {
        let job = |id: &str, n: u64| JobStatus {
            job: id.into(),
            files: 10 * n,
            window: 4,
            window_resident: 3,
            window_bytes: 400,
            window_resident_bytes: 300,
            hit_bytes: 100 * n,
            filled_bytes: 10 * n,
            fallback_bytes: n,
            opens: 7,
            opens_hit: 5,
            wait: Duration::from_millis(250),
            fallback: Duration::from_millis(1500),
            rate: Some(2.0),
            ..Default::default()
        };
        Status {
            daemon_version: "9.9.9".into(),
            uptime: Duration::from_secs(42),
            space: Space {
                capacity_bytes: 1000,
                used_bytes: 600,
                fs_free_bytes: 300,
                fs_size_bytes: 2000,
                ..Default::default()
            },
            counters: pb::Counters {
                hit_bytes: 123,
                filled_bytes: 45,
                fallback_bytes: 6,
                hit_reads: 3,
                peer_bytes_in: 77,
                ..Default::default()
            },
            fallbacks: (0..=8)
                .map(|r| Fallbacks {
                    reason: pb::FallbackReason::try_from(r).unwrap(),
                    opens: r as u64,
                    reads: 2 * r as u64,
                })
                .collect(),
            jobs: vec![job("resnet", 1), job("llm \"x\"", 2)],
            prefetching: 3,
            peers: Some(PeersStatus {
                me: "a:1".into(),
                members: vec![
                    PeerStatus {
                        id: "a:1".into(),
                        healthy: true,
                        ..Default::default()
                    },
                    PeerStatus {
                        id: "b:1".into(),
                        healthy: false,
                        ..Default::default()
                    },
                ],
            }),
            roots: vec![RootHealth {
                root: "/data".into(),
                stalled: true,
                calls_stuck: 4,
                calls_refused: 9,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// The samples of `name` in an exposition: (labels text, value).
    fn samples<'a>(text: &'a str, name: &str) -> Vec<(&'a str, f64)> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                let (n, labels) = match series.split_once('{') {
                    Some((n, rest)) => (n, rest.trim_end_matches('}')),
                    None => (series, ""),
                };
                let v: f64 = value.parse().ok()?;
                (n == name).then_some((labels, v))
            })
            .collect()
    }

    #[test]
    fn every_metric_is_rendered_with_its_type_help_and_labels() {
        let m = Metrics::new();
        m.prefetch().lead.record(0.3);
        let text = m.render(&sample());
        for d in ALL {
            let kind = match d.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            assert!(
                text.contains(&format!("# TYPE {} {kind}\n", d.name)),
                "{}",
                d.name
            );
            assert!(text.contains(&format!("# HELP {} ", d.name)), "{}", d.name);
            assert!(d.name.starts_with("shardcache_"), "{}", d.name);
            assert_eq!(
                d.kind == Kind::Counter,
                d.name.ends_with("_total"),
                "{}",
                d.name
            );
            let series = match d.kind {
                Kind::Histogram => format!("{}_count", d.name),
                _ => d.name.to_owned(),
            };
            let found = samples(&text, &series);
            assert!(!found.is_empty(), "{series} has no series");
            for (labels, _) in found {
                let names: Vec<&str> = labels
                    .split(',')
                    .filter(|l| !l.is_empty())
                    .filter_map(|l| l.split_once('=').map(|x| x.0))
                    .collect();
                assert_eq!(names, d.labels, "{series}: {labels}");
            }
        }
    }

    #[test]
    fn values_come_from_the_status() {
        let text = Metrics::new().render(&sample());
        let one = |name: &str, labels: &str| {
            let v: Vec<f64> = samples(&text, name)
                .into_iter()
                .filter(|(l, _)| *l == labels)
                .map(|x| x.1)
                .collect();
            assert_eq!(v.len(), 1, "{name}{{{labels}}} in\n{text}");
            v[0]
        };
        assert_eq!(one("shardcache_read_bytes_total", "result=\"hit\""), 123.0);
        assert_eq!(
            one("shardcache_read_bytes_total", "result=\"filled\""),
            45.0
        );
        assert_eq!(one("shardcache_reads_total", "result=\"hit\""), 3.0);
        assert_eq!(
            one("shardcache_peer_bytes_total", "direction=\"received\""),
            77.0
        );
        assert_eq!(
            one("shardcache_fallback_reads_total", "reason=\"declined\""),
            8.0
        );
        assert_eq!(
            one("shardcache_fallback_opens_total", "reason=\"unknown\""),
            0.0
        );
        assert_eq!(one("shardcache_peers", "state=\"down\""), 1.0);
        assert_eq!(one("shardcache_peer_up", "peer=\"b:1\""), 0.0);
        assert!(
            samples(&text, "shardcache_peer_up").len() == 1,
            "self excluded"
        );
        assert_eq!(
            one(
                "shardcache_job_read_bytes_total",
                "job_id=\"resnet\",result=\"hit\""
            ),
            100.0
        );
        assert_eq!(
            one(
                "shardcache_job_stall_seconds_total",
                "job_id=\"resnet\",cause=\"fallback_read\""
            ),
            1.5
        );
        // A job id is a label value, escaped.
        assert_eq!(
            one(
                "shardcache_job_stall_seconds_total",
                "job_id=\"llm \\\"x\\\"\",cause=\"fill_wait\""
            ),
            0.25
        );
        assert_eq!(
            one("shardcache_job_window_resident_ratio", "job_id=\"resnet\""),
            0.75
        );
        assert_eq!(one("shardcache_prefetch_in_flight_files", ""), 3.0);
        assert_eq!(one("shardcache_cache_fs_size_bytes", ""), 2000.0);
    }

    #[test]
    fn an_unregistered_job_leaves_no_series() {
        let m = Metrics::new();
        let mut s = sample();
        assert!(m.render(&s).contains("job_id=\"resnet\""));
        s.jobs.retain(|j| j.job != "resnet");
        let text = m.render(&s);
        assert!(!text.contains("job_id=\"resnet\""), "{text}");
        assert!(text.contains("job_id=\"llm"));
    }

    #[test]
    fn the_event_instruments_accumulate_across_scrapes() {
        let m = Metrics::new();
        let p = m.prefetch();
        p.lead.record(0.02);
        p.lead.record(7.0);
        p.late.increment(2);
        let text = m.render(&Status::default());
        assert_eq!(
            samples(&text, "shardcache_prefetch_lead_seconds_count")[0].1,
            2.0
        );
        assert_eq!(samples(&text, "shardcache_prefetch_late_total")[0].1, 2.0);
        let le = |b: &str| {
            samples(&text, "shardcache_prefetch_lead_seconds_bucket")
                .into_iter()
                .find(|(l, _)| *l == format!("le=\"{b}\""))
                .map(|x| x.1)
        };
        assert_eq!(le("0.05"), Some(1.0));
        assert_eq!(le("10"), Some(2.0));
        p.lead.record(1.0);
        let text = m.render(&Status::default());
        assert_eq!(
            samples(&text, "shardcache_prefetch_lead_seconds_count")[0].1,
            3.0
        );
    }

    /// docs/METRICS.md lists exactly the metrics defined here, each with its type and
    /// labels.
    #[test]
    fn the_docs_list_every_metric() {
        let doc = include_str!("../../../docs/METRICS.md");
        let mut documented: Vec<&str> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `shardcache_"))
            .filter_map(|l| l.split('`').next())
            .collect();
        documented.sort_unstable();
        let mut defined: Vec<&str> = ALL
            .iter()
            .map(|d| d.name.strip_prefix("shardcache_").unwrap_or(d.name))
            .collect();
        defined.sort_unstable();
        assert_eq!(documented, defined);
        for d in ALL {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{}` |", d.name)))
                .unwrap_or_default();
            let kind = format!("{:?}", d.kind).to_lowercase();
            assert!(row.contains(&format!("| {kind} |")), "{}: {row}", d.name);
            for l in d.labels {
                assert!(
                    row.contains(&format!("`{l}`")),
                    "{}: label {l}: {row}",
                    d.name
                );
            }
        }
    }
}
