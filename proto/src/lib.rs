//! Message definitions shared by the shardcache daemon and its clients, generated from
//! the `.proto` files in `proto/` by prost (compiled with protox: no system `protoc`), and
//! the framing of the local Unix-socket protocol ([`wire`]) on the length-prefixed frames
//! both prost protocols share ([`frame`]; the daemons' block stream uses them too).
//!
//! This crate owns no policy: it says what travels and how it is framed, nothing about
//! what either side does with it.

pub mod frame;
pub mod json;
pub mod wire;

/// The local client ↔ daemon API (Unix socket).
pub mod local {
    /// Version 1 of the local API.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/shardcache.local.v1.rs"));
    }
}

/// Records of the NVMe store's index journal.
pub mod store {
    /// Version 1 of the journal record format.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/shardcache.store.v1.rs"));
    }
}
