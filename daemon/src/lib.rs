//! shardcached: the node-local NVMe read cache for training data on shared storage.
//!
//! The crate is a library so that tests and benchmarks can drive its parts directly;
//! the binary (`main.rs`) only reads configuration and runs a [`daemon::Daemon`].
//! docs/ARCHITECTURE.md walks through the modules:
//!
//! - [`backing`]: the shared file system behind the cache (trait + POSIX, in-memory,
//!   throttled);
//! - [`meta`]: backing roots and the metadata cache (the TTL that spares the shared file
//!   system a stat per open);
//! - [`access`]: who may read what through the cache;
//! - [`checksum`]: the block checksum (XXH3-64) the store records and peers check;
//! - [`store`]: blocks on NVMe, the index journal, capacity and eviction;
//! - [`blocks`]: the seams blocks travel through: where a fill gets them
//!   ([`blocks::BlockSource`]) and what the peer server serves ([`blocks::BlockProvider`]);
//! - [`planner`]: the pure epoch-aware planner; [`policy`]: the plans as the store's
//!   eviction policy and the peers' placement view see them (the cell created first);
//! - [`fill`]: single-flight block fills with a bounded priority queue;
//! - [`peer`]: sharing between nodes (the client a fill's source, the server over a
//!   provider); [`jobs`]: registered jobs and the prefetcher;
//! - [`cache`]: the read path as a service (open, wait), typed, wire-free;
//! - [`server`]: the local Unix-socket API (descriptors, not bytes), an adapter over
//!   [`cache`];
//! - [`clock`], [`ratelimit`]: time as a seam, and the one token bucket;
//! - [`metrics`]: every exported metric, and the HTTP endpoint for Prometheus and the
//!   probes;
//! - [`lifecycle`]: named threads with stop, join and liveness, and the ordered shutdown;
//! - [`status`]: the daemon's status as plain data (what `shardcache status` shows and
//!   the metrics render), assembled by [`cache`];
//! - [`config`], [`units`], [`stats`], [`daemon`]: settings, sizes and durations,
//!   counters, wiring (every part built in one pass; imports point downward only, in
//!   the order docs/ARCHITECTURE.md gives and `daemon/tests/layers.rs` checks).

pub mod access;
pub mod backing;
pub mod blocks;
pub mod cache;
pub mod checksum;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod fill;
pub mod glob;
pub mod jobs;
pub mod lifecycle;
pub mod meta;
pub mod metrics;
pub mod peer;
pub mod planner;
pub mod policy;
pub mod ratelimit;
pub mod server;
pub mod stats;
pub mod status;
pub mod store;
pub mod units;
