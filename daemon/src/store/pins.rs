//! Pins: files a reader is waiting on, kept from eviction until an instant.
//!
//! A reader told that its file is being filled has not yet been handed a descriptor
//! holding the blocks. Without a pin, a fill that completes could be evicted (the
//! reader's file is, by then, the one needed farthest in the future) before the
//! reader's reply, and the reader would fetch the same bytes again from the backing
//! store. Pins expire on their own, so a reader that goes away costs nothing lasting,
//! and their number is bounded ([`MAX_PINS`]). A pin only saves a refetch: when the map
//! is full of live pins, a new one is dropped.
//!
//! [`Pins`] lives in the index (eviction consults it under the index lock); it does no
//! I/O and knows nothing of readers.

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap as HashMap;

use super::key::Key;

/// Pins held at most at once (a bound on memory if readers vanish mid-wait).
pub const MAX_PINS: usize = 4096;

/// Files not evictable until the instant given.
#[derive(Debug)]
pub(super) struct Pins {
    until: HashMap<Key, Instant>,
    /// When the map may next be swept of expired entries.
    swept: Instant,
}

impl Default for Pins {
    fn default() -> Self {
        Self {
            until: HashMap::default(),
            swept: Instant::now(),
        }
    }
}

impl Pins {
    /// Keeps `key` until `until` at least (a later pin of the same key extends it).
    pub(super) fn pin(&mut self, key: &Key, until: Instant) {
        if self.until.len() >= MAX_PINS && !self.until.contains_key(key) {
            // Sweep expired pins, at most once per 100 ms (a full map of live pins
            // would otherwise cost a sweep per open).
            let now = Instant::now();
            if now < self.swept {
                return; // best effort: a pin only saves a refetch
            }
            self.until.retain(|_, u| *u > now);
            self.swept = now + Duration::from_millis(100);
            if self.until.len() >= MAX_PINS {
                return;
            }
        }
        let u = self.until.entry(*key).or_insert(until);
        *u = (*u).max(until);
    }

    /// Lets `key` go.
    pub(super) fn unpin(&mut self, key: &Key) {
        self.until.remove(key);
    }

    /// True when `key` is pinned past `now`.
    pub(super) fn holds(&self, key: &Key, now: Instant) -> bool {
        self.until.get(key).is_some_and(|until| *until > now)
    }
}
