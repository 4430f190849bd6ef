//! The daemon's answers as plain Rust types: what [`crate::Client`]'s calls take and
//! return ([`Status`], [`Registered`], [`Listing`], [`Evicted`], [`Verified`],
//! [`ListQuery`], [`EvictTarget`], [`FallbackReason`]), so that a caller of the library
//! never handles a protobuf message.
//!
//! Each type mirrors one message of the local protocol field for field, and converts to
//! and from it with one exhaustive destructuring each way: a field added to the protocol
//! fails the build here until it is mirrored. The conversion back to the message is for
//! callers that print the daemon's answer as JSON (`shardcache ... --json`, the Python
//! package's `status()`), whose field names and shape are the protocol's; nothing else
//! in this module knows the wire.

use shardcache_proto::local::v1 as pb;

/// Why a client read the backing store itself instead of the cache (the `reason` label
/// of the daemon's fallback metric).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// Not said (or a reason this client does not know).
    #[default]
    Unspecified,
    /// No daemon answered (no socket, connection refused, or recently unreachable).
    Unavailable,
    /// The daemon did not answer in time.
    Timeout,
    /// The daemon refused the file (not under a root, not a regular file, denied).
    Refused,
    /// The daemon would not fill the file (no room, a failed fill, a store error).
    Declined,
    /// A wait for missing blocks ran out of time.
    WaitTimeout,
    /// The file changed on the backing store.
    Stale,
    /// Reading the local copy failed.
    LocalError,
    /// A malformed or unexpected reply.
    Protocol,
    /// Not a failure: the daemon had a cold small file read from the backing store
    /// directly while it fills the cache behind the reader.
    Direct,
}

impl FallbackReason {
    /// Its name, as the metric's `reason` label spells it (`"wait_timeout"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::Refused => "refused",
            Self::Declined => "declined",
            Self::WaitTimeout => "wait_timeout",
            Self::Stale => "stale",
            Self::LocalError => "local_error",
            Self::Protocol => "protocol",
            Self::Direct => "direct",
        }
    }

    /// The reason a wire value names (unknown values: [`FallbackReason::Unspecified`]).
    pub(crate) fn from_wire(v: i32) -> Self {
        pb::FallbackReason::try_from(v).map_or(Self::Unspecified, Self::from)
    }
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<pb::FallbackReason> for FallbackReason {
    fn from(r: pb::FallbackReason) -> Self {
        match r {
            pb::FallbackReason::Unspecified => Self::Unspecified,
            pb::FallbackReason::Unavailable => Self::Unavailable,
            pb::FallbackReason::Timeout => Self::Timeout,
            pb::FallbackReason::Refused => Self::Refused,
            pb::FallbackReason::Declined => Self::Declined,
            pb::FallbackReason::WaitTimeout => Self::WaitTimeout,
            pb::FallbackReason::Stale => Self::Stale,
            pb::FallbackReason::LocalError => Self::LocalError,
            pb::FallbackReason::Protocol => Self::Protocol,
            pb::FallbackReason::Direct => Self::Direct,
        }
    }
}

impl From<FallbackReason> for pb::FallbackReason {
    fn from(r: FallbackReason) -> Self {
        match r {
            FallbackReason::Unspecified => Self::Unspecified,
            FallbackReason::Unavailable => Self::Unavailable,
            FallbackReason::Timeout => Self::Timeout,
            FallbackReason::Refused => Self::Refused,
            FallbackReason::Declined => Self::Declined,
            FallbackReason::WaitTimeout => Self::WaitTimeout,
            FallbackReason::Stale => Self::Stale,
            FallbackReason::LocalError => Self::LocalError,
            FallbackReason::Protocol => Self::Protocol,
            FallbackReason::Direct => Self::Direct,
        }
    }
}

/// What [`crate::Client::list`] lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ListTarget {
    /// Every registered job, and per backing root the cached files no job plans.
    #[default]
    Datasets,
    /// A registered job's files, in manifest order.
    Job(String),
    /// An absolute path under a backing root: that file, or the entries directly inside
    /// that directory (never recursive).
    Path(String),
}

/// A listing request: what, and which page of its file entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    pub target: ListTarget,
    /// Most file entries in the reply (0: 100; at most 10000). A page also ends before
    /// its entries pass 8 MiB: page on with `offset += files + hidden` until `total`.
    pub limit: u32,
    /// File entries to skip.
    pub offset: u64,
}

impl From<ListQuery> for pb::ListRequest {
    fn from(q: ListQuery) -> Self {
        let ListQuery {
            target,
            limit,
            offset,
        } = q;
        let (job, path) = match target {
            ListTarget::Datasets => (String::new(), String::new()),
            ListTarget::Job(j) => (j, String::new()),
            ListTarget::Path(p) => (String::new(), p),
        };
        Self {
            job,
            path,
            limit,
            offset,
        }
    }
}

/// What [`crate::Client::evict`] drops from the cache (never anything on the backing
/// store).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictTarget {
    /// Absolute paths under a backing root: a file, or every cached file under a
    /// directory.
    Paths(Vec<String>),
    /// Every cached file a registered job plans.
    Job(String),
    /// Everything.
    All,
}

impl From<EvictTarget> for pb::EvictRequest {
    fn from(t: EvictTarget) -> Self {
        match t {
            EvictTarget::Paths(paths) => Self {
                paths,
                ..Self::default()
            },
            EvictTarget::Job(job) => Self {
                job,
                ..Self::default()
            },
            EvictTarget::All => Self {
                all: true,
                ..Self::default()
            },
        }
    }
}

/// Declares a plain struct mirroring the message `pb::$wire` field for field, with one
/// exhaustive conversion each way. A field's conversion: none (the same type), `message`
/// (an optional message, absent read as its default), `list` (repeated messages) or
/// `reason` (a [`FallbackReason`] as its wire value).
macro_rules! mirror {
    (
        $(#[$meta:meta])*
        pub struct $name:ident = $wire:ident {
            $( $(#[$fmeta:meta])* $field:ident : $ty:ty $(as $conv:ident)? ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
        }

        impl From<pb::$wire> for $name {
            fn from(m: pb::$wire) -> Self {
                let pb::$wire { $($field),* } = m;
                Self { $( $field: mirror!(@in $($conv)? $field) ),* }
            }
        }

        impl From<$name> for pb::$wire {
            fn from(m: $name) -> Self {
                let $name { $($field),* } = m;
                Self { $( $field: mirror!(@out $($conv)? $field) ),* }
            }
        }
    };
    (@in $f:ident) => { $f };
    (@in message $f:ident) => { $f.unwrap_or_default().into() };
    (@in list $f:ident) => { $f.into_iter().map(Into::into).collect() };
    (@in reason $f:ident) => { FallbackReason::from_wire($f) };
    (@out $f:ident) => { $f };
    (@out message $f:ident) => { Some($f.into()) };
    (@out list $f:ident) => { $f.into_iter().map(Into::into).collect() };
    (@out reason $f:ident) => { pb::FallbackReason::from($f) as i32 };
}

mirror! {
    /// The daemon's status ([`crate::Client::status`]).
    pub struct Status = StatusReply {
        daemon_version: String,
        uptime_seconds: u64,
        backing_roots: Vec<String>,
        cache_dir: String,
        capacity_bytes: u64,
        used_bytes: u64,
        fs_free_bytes: u64,
        min_free_bytes: u64,
        files: u64,
        blocks: u64,
        block_size: u32,
        unverified_blocks: u64,
        counters: Counters as message,
        jobs: Vec<JobStatus> as list,
        /// This node's peer id and every member it knows (itself included), when peers are on.
        peer_id: String,
        peers: Vec<PeerStatus> as list,
        /// The bound address of the HTTP endpoint (/metrics, /healthz, /readyz); empty when
        /// metrics_listen is off.
        metrics_addr: String,
        /// Client-reported fallbacks by reason, summed since the daemon started (one entry per
        /// reason, zeros included).
        fallbacks: Vec<FallbackCount> as list,
        /// Total size of the cache file system.
        fs_size_bytes: u64,
        /// Client connections open now (on the Unix socket).
        connections: u64,
        /// Each backing root's calls: whether it is stalled (its calls refused), in the order
        /// of backing_roots.
        backing_health: Vec<BackingHealth> as list,
        /// The store's I/O engine running (`psync`, `uring`).
        io_engine: String,
    }
}

mirror! {
    /// The calls in flight on one backing root (see docs/SEMANTICS.md, section 2).
    pub struct BackingHealth = BackingHealth {
        root: String,
        /// Calls are refused: one is stuck and none completed for backing_stall_timeout.
        stalled: bool,
        calls_in_flight: u64,
        /// Calls in flight for at least backing_stall_timeout.
        calls_stuck: u64,
        /// Age of the oldest call in flight (0 when none).
        oldest_call_seconds: f64,
        /// Calls refused since the start: stalled root, stuck file, too many in flight.
        calls_refused: u64,
    }
}

mirror! {
    pub struct PeerStatus = PeerStatus {
        id: String,
        healthy: bool,
        /// Failed exchanges in a row.
        failures: u32,
        /// Seconds since the last successful exchange (-1: none yet).
        last_ok_seconds: f64,
    }
}

mirror! {
    /// A registered prefetch manifest and how far its job has read.
    pub struct JobStatus = JobStatus {
        job: String,
        epoch: u64,
        /// The next step of the epoch the job will read.
        step: u64,
        epoch_len: u64,
        files: u64,
        /// Of the next `window` files the job reads (its readiness window), how many are cached.
        window: u64,
        window_resident: u64,
        /// Reads so far, measured by the clients (bytes by where they came from) and the
        /// daemon (opens of files of this job, and how many found the file cached whole).
        hit_bytes: u64,
        filled_bytes: u64,
        fallback_bytes: u64,
        opens: u64,
        opens_hit: u64,
        /// Seconds the job's readers were blocked: waiting for the daemon to fill, and
        /// reading the backing store themselves.
        wait_seconds: f64,
        fallback_seconds: f64,
        /// Steps per second the job reads (0 until measured).
        rate: f64,
        /// Files being prefetched for any job now.
        prefetching: u64,
        /// The readiness window (`window` files: what the job reads next, to the end of its
        /// current epoch, as far as the cache holds it) in bytes, and its bytes cached.
        window_bytes: u64,
        window_resident_bytes: u64,
        /// The job's cluster placement (peers on, a shuffle; docs/ARCHITECTURE.md): the nodes
        /// it spans (0: not placed, fetches go by ownership), this node's slots (the job's
        /// files its cache holds), the files the placement puts on this node now, and the
        /// copies it moved away that this node keeps until their new holders take them.
        placement_nodes: u64,
        placement_slots: u64,
        placement_here: u64,
        placement_departing: u64,
        /// This node's room for the job in the placement, in bytes (a placement counts
        /// bytes when the manifest gives every file's size; `placement_slots` is then 0).
        placement_room_bytes: u64,
        /// What the registrant's rights kept out of the job (docs/SEMANTICS.md, "What a
        /// registration may change"): files it may not read, as the prefetcher last checked
        /// them (never fetched for this job), and directories its glob did not list.
        files_denied: u64,
        dirs_denied: u64,
        /// Files of an immutable manifest not held as immutable (they follow metadata_ttl):
        /// not the registrant's to vouch for (found at their first stat: another user owns the
        /// file or a directory above it), and over the daemon's limit of held files.
        immutable_not_owned: u64,
        immutable_over_limit: u64,
        /// The job's lease ([`crate::Client::register_leased`]; docs/MANIFEST.md, "Leases"):
        /// its length in seconds (0: no lease, the job lives until unregistered), the
        /// seconds left before it runs out unless renewed or a holder is found alive, and
        /// its holders (the processes whose registrations hold it) and how many of them the
        /// daemon sees alive.
        lease_seconds: u32,
        lease_remaining_seconds: f64,
        lease_holders: u32,
        lease_holders_alive: u32,
        /// Bytes the daemon read from the backing store for the job's files (prefetch and
        /// fills); with `fallback_bytes`, what the job cost the shared file system here.
        backing_bytes: u64,
    }
}

mirror! {
    /// The daemon's counters since it started.
    pub struct Counters = Counters {
        opens: u64,
        opens_full: u64,
        opens_partial: u64,
        opens_empty: u64,
        refused_denied: u64,
        refused_path: u64,
        refused_not_found: u64,
        refused_other: u64,
        waits: u64,
        wait_timeouts: u64,
        backing_reads: u64,
        backing_bytes: u64,
        backing_stats: u64,
        blocks_filled: u64,
        fill_errors: u64,
        fills_no_space: u64,
        corrupt_blocks: u64,
        evicted_files: u64,
        evicted_bytes: u64,
        blocks_verified: u64,
        /// Client-reported (ReadReport), summed.
        hit_bytes: u64,
        filled_bytes: u64,
        fallback_bytes: u64,
        hit_reads: u64,
        filled_reads: u64,
        fallback_reads: u64,
        fallback_opens: u64,
        queue_shed: u64,
        /// Peers: blocks and bytes received from peers (checked), fetches from peers that
        /// failed (then the backing store was read), blocks and bytes served to peers, and
        /// peer requests refused (bad or missing secret).
        peer_blocks_in: u64,
        peer_bytes_in: u64,
        peer_errors: u64,
        peer_blocks_out: u64,
        peer_bytes_out: u64,
        peer_refused: u64,
        /// Client connections the daemon refused (the client then reads the backing store), and
        /// idle ones it closed to make room (the client opens another when it next asks), by
        /// why: the uid held max_connections_per_uid; the daemon held max_connections; other
        /// (credentials unreadable, no thread or descriptor to serve it).
        conns_refused_uid_limit: u64,
        conns_refused_full: u64,
        conns_refused_other: u64,
        conns_closed_uid_limit: u64,
        conns_closed_full: u64,
        /// Starts that found the index journal damaged (unreadable, not a journal, or a torn
        /// or corrupt record): it was set aside as `journal.bad-<unix time>` and the cache
        /// started from what could be proven (0 or 1 per run of the daemon).
        journal_recoveries: u64,
        /// Messages from peers (blocks, requests, Ranks replies) whose MAC did not verify:
        /// forged, changed on the way, or replayed. Each was dropped (a block: read from the
        /// backing store instead) and its connection closed.
        peer_forged: u64,
        /// Waits answered with blocks read for the waiting reader and not yet landed.
        handoffs: u64,
        /// Small files handed to their readers that the backlog landed behind readers
        /// had no room for: their fill workers landed them, each with up to 31 waiting
        /// in the backlog (the store's writes set the pace of the fills).
        backlog_full: u64,
        /// Syncs of the store's data files, their directories and its file system (each
        /// a wait for the cache disk): two for a small file landed alone, one for a
        /// batch of new small files.
        data_syncs: u64,
    }
}

mirror! {
    /// Fallback opens and reads for one reason.
    pub struct FallbackCount = FallbackCount {
        reason: FallbackReason as reason,
        opens: u64,
        reads: u64,
    }
}

mirror! {
    /// A registered job ([`crate::Client::register`]).
    pub struct Registered = RegisterReply {
        job: String,
        files: u64,
        /// Directories the glob did not list because the registering user may not list or
        /// search them (their files are not part of the job).
        dirs_denied: u64,
        /// Files of an immutable manifest held as immutable, and those not held because the
        /// daemon holds its most already. With `immutable_owner_only` (the registrant is not
        /// root or the daemon's user) a held file is trusted only if the registrant owns it and
        /// the directories above it (else another user does), which each file's first stat
        /// decides: status counts the others (JobStatus.immutable_not_owned).
        immutable_held: u64,
        immutable_over_limit: u64,
        immutable_owner_only: bool,
    }
}

mirror! {
    /// A page of what the cache holds ([`crate::Client::list`]).
    pub struct Listing = ListReply {
        datasets: Vec<Dataset> as list,
        files: Vec<FileEntry> as list,
        /// File entries the listing has in all (the reply holds those from `offset`, at most
        /// `limit` of them), before `hidden` were left out.
        total: u64,
        /// Entries of this page left out because the caller may not read them.
        hidden: u64,
    }
}

mirror! {
    /// A registered job's files (`job` set), or the cached files under backing root `root`
    /// that no registered job plans (`job` empty).
    pub struct Dataset = DatasetEntry {
        job: String,
        /// The backing root (for a job: the root its files are under).
        root: String,
        files: u64,
        /// Sum of the sizes known to the daemon (declared by the manifest, or seen since);
        /// `unsized_files` files are not counted in it.
        bytes: u64,
        unsized_files: u64,
        /// Bytes of blocks held in the cache, and files cached whole.
        resident_bytes: u64,
        resident_files: u64,
    }
}

mirror! {
    /// One entry of a listing: a file or a directory.
    pub struct FileEntry = FileEntry {
        /// Absolute path (as the backing root names it).
        path: String,
        /// Size on the backing store (0 for a directory, or when unknown: see `size_known`).
        size: u64,
        size_known: bool,
        /// Bytes of the current version held in the cache (its present blocks; after an
        /// unclean restart some may still await their checksum check).
        resident_bytes: u64,
        is_dir: bool,
    }
}

mirror! {
    /// What an eviction dropped ([`crate::Client::evict`]).
    pub struct Evicted = EvictReply {
        /// Files and bytes dropped from the cache.
        files: u64,
        bytes: u64,
        /// Matching files left in place because blocks of them are being written right now.
        busy: u64,
        /// Paths of the request that matched no cached file.
        unmatched: Vec<String>,
    }
}

mirror! {
    /// What a verification checked ([`crate::Client::verify`]).
    pub struct Verified = VerifyReply {
        blocks_checked: u64,
        corrupt_blocks: u64,
        missing_files: u64,
        /// Cached files whose blocks were checked, and the bytes read to check them.
        files_checked: u64,
        bytes_checked: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mirror_converts_back_to_the_same_message() {
        let status = pb::StatusReply {
            daemon_version: "0.1.0".into(),
            uptime_seconds: 7,
            backing_roots: vec!["/a".into(), "/b".into()],
            block_size: 4096,
            counters: Some(pb::Counters {
                opens: 3,
                peer_forged: 41,
                ..Default::default()
            }),
            jobs: vec![pb::JobStatus {
                job: "j".into(),
                rate: 1.5,
                immutable_over_limit: 26,
                ..Default::default()
            }],
            peers: vec![pb::PeerStatus {
                id: "n".into(),
                healthy: true,
                failures: 2,
                last_ok_seconds: -1.0,
            }],
            fallbacks: (0..9)
                .map(|r| pb::FallbackCount {
                    reason: r,
                    opens: r as u64,
                    reads: 2 * r as u64,
                })
                .collect(),
            backing_health: vec![pb::BackingHealth {
                root: "/a".into(),
                stalled: true,
                oldest_call_seconds: 2.5,
                ..Default::default()
            }],
            ..Default::default()
        };
        let s = Status::from(status.clone());
        assert_eq!(s.counters.peer_forged, 41);
        assert_eq!(s.fallbacks[5].reason, FallbackReason::WaitTimeout);
        assert_eq!(pb::StatusReply::from(s), status);

        let listing = pb::ListReply {
            datasets: vec![pb::DatasetEntry {
                job: "j".into(),
                unsized_files: 2,
                ..Default::default()
            }],
            files: vec![pb::FileEntry {
                path: "/a/x".into(),
                size_known: true,
                ..Default::default()
            }],
            total: 5,
            hidden: 1,
        };
        assert_eq!(pb::ListReply::from(Listing::from(listing.clone())), listing);
        let reg = pb::RegisterReply {
            job: "j".into(),
            files: 3,
            immutable_owner_only: true,
            ..Default::default()
        };
        assert_eq!(pb::RegisterReply::from(Registered::from(reg.clone())), reg);
        let ev = pb::EvictReply {
            files: 1,
            bytes: 2,
            busy: 3,
            unmatched: vec!["/x".into()],
        };
        assert_eq!(pb::EvictReply::from(Evicted::from(ev.clone())), ev);
        let v = pb::VerifyReply {
            blocks_checked: 1,
            corrupt_blocks: 2,
            missing_files: 3,
            files_checked: 4,
            bytes_checked: 5,
        };
        assert_eq!(pb::VerifyReply::from(Verified::from(v)), v);
    }

    #[test]
    fn a_missing_message_reads_as_its_default_and_an_unknown_reason_as_unspecified() {
        let s = Status::from(pb::StatusReply::default());
        assert_eq!(s.counters, Counters::default());
        assert_eq!(FallbackReason::from_wire(99), FallbackReason::Unspecified);
        // Names as the metric's `reason` label spells them.
        assert_eq!(FallbackReason::WaitTimeout.to_string(), "wait_timeout");
        assert_eq!(FallbackReason::LocalError.as_str(), "local_error");
    }

    #[test]
    fn requests_set_exactly_the_fields_of_their_target() {
        let q = pb::ListRequest::from(ListQuery {
            target: ListTarget::Path("/a/b".into()),
            limit: 10,
            offset: 20,
        });
        assert_eq!(
            (q.job.as_str(), q.path.as_str(), q.limit, q.offset),
            ("", "/a/b", 10, 20)
        );
        let q = pb::ListRequest::from(ListQuery {
            target: ListTarget::Job("j".into()),
            ..Default::default()
        });
        assert_eq!((q.job.as_str(), q.path.as_str()), ("j", ""));
        assert_eq!(
            pb::ListRequest::from(ListQuery::default()),
            pb::ListRequest::default()
        );
        let all = pb::EvictRequest::from(EvictTarget::All);
        assert!(all.all && all.paths.is_empty() && all.job.is_empty());
        let job = pb::EvictRequest::from(EvictTarget::Job("j".into()));
        assert!(!job.all && job.paths.is_empty() && job.job == "j");
        let paths = pb::EvictRequest::from(EvictTarget::Paths(vec!["/a".into()]));
        assert!(!paths.all && paths.paths == ["/a"] && paths.job.is_empty());
    }
}
