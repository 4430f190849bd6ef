//! The shardcache client: read training data through the node-local cache, and read the
//! shared file system directly whenever the cache cannot help.
//!
//! ```no_run
//! use std::io::Read;
//! let client = shardcache_client::Client::connect();
//! let mut r = client.open("/datasets/imagenet/train-0001.tar")?;
//! let mut bytes = Vec::new();
//! r.read_to_end(&mut bytes)?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! How a read is served (see docs/SEMANTICS.md):
//! - `open` asks the local `shardcached` over its Unix socket. When the daemon may serve
//!   the file to this process, it answers with a descriptor of the local copy and which
//!   blocks of it are present; the reader then reads those blocks directly from local
//!   NVMe (no data crosses the socket).
//! - A block that is not present: the reader asks the daemon to fetch it with priority
//!   and waits (bounded), then reads it locally. Many readers missing the same block
//!   cause one backing read.
//! - Whenever the daemon is absent, slow, refuses, or fails, the reader reads the backing
//!   file itself. A cache problem never fails a read that the backing store would serve.
//!
//! The client is synchronous (no async runtime in the training process) and
//! thread-safe; a [`Client`] keeps a small pool of connections.

mod api;
mod client;
mod clock;
mod lease;
mod link;
mod reader;
mod report;
mod transport;

#[cfg(test)]
mod fallback_tests;

pub use api::{
    BackingHealth, Counters, Dataset, EvictTarget, Evicted, FallbackCount, FallbackReason,
    FileEntry, JobStatus, ListQuery, ListTarget, Listing, PeerStatus, Registered, Status, Verified,
};
pub use client::{Client, ClientConfig, DEFAULT_SOCKET};
pub use lease::{DEFAULT_LEASE, JobLease};
pub use reader::{OpenAhead, Reader, ReaderStats, Source};
/// The local protocol's messages: the wire schema, for callers that print the daemon's
/// answers as JSON (every type above converts to its message) or speak the protocol
/// themselves. The calls of [`Client`] take and return the plain types above.
pub use shardcache_proto::local::v1 as proto;
