//! What a training job tells the cache about its future: the prefetch manifest
//! ([`manifest`]) and the named, versioned shuffle algorithms ([`shuffle`]) that turn a
//! seed into each epoch's access order; and, for simulations and tests, the order a
//! PyTorch DataLoader's workers read a plan in ([`loader`]).
//!
//! This crate is shared, unchanged, by the daemon (which computes every future epoch
//! from a manifest) and by the clients (the Rust library, the Python package's
//! samplers), so that a sampler and the daemon always agree on the order. It does no
//! I/O.

pub mod loader;
pub mod manifest;
pub mod shuffle;
