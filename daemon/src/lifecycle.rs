//! The daemon's long-lived threads: how each is named, stopped, joined and seen alive.
//!
//! Owns no part of the cache; every part that runs a thread of its own uses it, and
//! `daemon.rs` stops them in one order. Imports nothing of the daemon's parts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Marks a long-running thread as alive for as long as it is held: its drop (the thread
/// ending, by return or by panic) clears the flag the liveness probe reads.
#[derive(Debug)]
pub struct Alive(Arc<AtomicBool>);

impl Alive {
    /// Holds `flag` (already set by the caller) until dropped.
    pub fn new(flag: Arc<AtomicBool>) -> Self {
        Self(flag)
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
