//! Backing roots and the metadata cache.
//!
//! A client names files by absolute path; [`Roots::resolve`] finds the configured root
//! that contains it (or refuses), and [`Meta::stat`] returns the file's canonical path,
//! version and owners, from the backing store at most once per `metadata_ttl` per path.
//! This is what spares the shared file system a stat storm: within the TTL, an open
//! through the cache costs the backing store nothing. Files of a manifest registered as
//! `immutable` are stat'ed once and then trusted while the job is registered
//! ([`Meta::hold`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::backing::watch::{Watch, WatchedBacking};
use crate::backing::{Backing, BackingError, Stat};
use crate::stats::{Stats, inc};

/// One configured backing root.
#[derive(Debug)]
pub struct Root {
    /// Canonical absolute path of the root.
    pub path: PathBuf,
    /// The same as a string, used in cache keys.
    pub name: String,
    /// The store behind it.
    pub backing: Arc<dyn Backing>,
}

/// The configured roots, each behind a [`WatchedBacking`]: a root that stops answering
/// is refused at once instead of holding the daemon's threads.
#[derive(Debug)]
pub struct Roots {
    roots: Vec<Root>,
    watches: Vec<Arc<Watch>>,
}

/// Why a path cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The path is not under any configured backing root.
    #[error("{0}: not under a configured backing root")]
    NotUnderRoot(String),
    /// The backing store refused or failed.
    #[error(transparent)]
    Backing(#[from] BackingError),
}

impl Roots {
    /// Wraps the configured roots (their paths must be canonical), watched with the
    /// default stall bound ([`crate::backing::watch::DEFAULT_STALL`]).
    pub fn new(roots: Vec<Root>) -> Self {
        Self::watched(roots, crate::backing::watch::DEFAULT_STALL)
    }

    /// Wraps the configured roots, each behind a [`WatchedBacking`] with stall bound
    /// `stall` (zero: calls are counted and bounded, a root is never called stalled).
    pub fn watched(roots: Vec<Root>, stall: Duration) -> Self {
        let mut watches = Vec::with_capacity(roots.len());
        let roots = roots
            .into_iter()
            .map(|r| {
                let w = WatchedBacking::new(r.backing, r.name.clone(), stall);
                watches.push(w.watch().clone());
                Root {
                    backing: Arc::new(w),
                    ..r
                }
            })
            .collect();
        Self { roots, watches }
    }

    /// The watch over root `i`'s backing store calls.
    pub fn watch(&self, i: usize) -> &Arc<Watch> {
        &self.watches[i]
    }

    /// The root with index `i`.
    pub fn get(&self, i: usize) -> &Root {
        &self.roots[i]
    }

    /// All roots.
    pub fn all(&self) -> &[Root] {
        &self.roots
    }

    /// Finds the root containing `abs` and the path relative to it. The longest matching
    /// root wins; the relative part is not yet validated (the backing store does that).
    pub fn resolve<'a>(&self, abs: &'a str) -> Result<(usize, &'a str), ResolveError> {
        let not_under = || ResolveError::NotUnderRoot(abs.to_owned());
        if !abs.starts_with('/') {
            return Err(not_under());
        }
        let mut best: Option<(usize, &str)> = None;
        for (i, r) in self.roots.iter().enumerate() {
            let root = r.name.trim_end_matches('/');
            if let Some(rest) = abs
                .strip_prefix(root)
                .and_then(|rest| rest.strip_prefix('/'))
                && best.is_none_or(|(b, _)| self.roots[b].name.len() < r.name.len())
            {
                best = Some((i, rest));
            }
        }
        best.ok_or_else(not_under)
    }
}

#[derive(Debug)]
struct Cached {
    /// The path as asked (checked on every hit: the cache key is only its hash).
    rel: String,
    stat: Arc<Stat>,
    at: Instant,
}

/// Cache key: xxh3-128 of (root index, relative path as asked). Hashing spares an
/// allocation per lookup; a hit is confirmed against the stored path.
fn cache_key(root: usize, rel: &str) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&(root as u64).to_le_bytes());
    h.update(rel.as_bytes());
    h.digest128()
}

/// Most paths held as immutable at once (a bound on memory; beyond it, files of
/// immutable manifests are revalidated like any other).
pub const MAX_IMMUTABLE: usize = 4 << 20;

/// A path a registered manifest declared immutable: stat once, then trusted for as long
/// as some job holds it.
#[derive(Debug)]
struct Held {
    rel: String,
    /// Registrations holding it.
    refs: u32,
    stat: Option<Arc<Stat>>,
}

/// Metadata of backing files, trusted for `ttl` (or, for files of immutable manifests,
/// until the manifest is unregistered).
#[derive(Debug)]
pub struct Meta {
    roots: Arc<Roots>,
    ttl: Duration,
    cache: moka::sync::Cache<u128, Arc<Cached>, rustc_hash::FxBuildHasher>,
    held: RwLock<HashMap<u128, Held>>,
    /// `held` is not empty (spares the common case the lock).
    any_held: AtomicBool,
    stats: Arc<Stats>,
}

impl Meta {
    /// A cache of at most `max_entries` paths.
    pub fn new(roots: Arc<Roots>, ttl: Duration, max_entries: u64, stats: Arc<Stats>) -> Self {
        let cache = moka::sync::Cache::builder()
            .max_capacity(max_entries)
            .time_to_live(ttl.max(Duration::from_millis(1)))
            .build_with_hasher(rustc_hash::FxBuildHasher);
        Self {
            roots,
            ttl,
            cache,
            held: RwLock::new(HashMap::new()),
            any_held: AtomicBool::new(false),
            stats,
        }
    }

    /// Declares `files` (root index, relative path) immutable until [`Meta::release`]:
    /// each is stat'ed once more at most, then trusted. Returns how many are held (all,
    /// unless [`MAX_IMMUTABLE`] is reached).
    pub fn hold<'a>(&self, files: impl Iterator<Item = (usize, &'a str)>) -> usize {
        let mut held = self.held.write().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        for (root, rel) in files {
            let key = cache_key(root, rel);
            let full = held.len() >= MAX_IMMUTABLE;
            match held.get_mut(&key) {
                Some(h) if h.rel == rel => h.refs += 1,
                Some(_) => {} // a hash collision: this one is revalidated as usual
                None if full => break,
                None => {
                    held.insert(
                        key,
                        Held {
                            rel: rel.to_owned(),
                            refs: 1,
                            stat: None,
                        },
                    );
                }
            }
            n += 1;
        }
        self.any_held.store(!held.is_empty(), Ordering::Release);
        n
    }

    /// Undoes a [`Meta::hold`] of the same files (the first `n` of them).
    pub fn release<'a>(&self, files: impl Iterator<Item = (usize, &'a str)>, n: usize) {
        let mut held = self.held.write().unwrap_or_else(|e| e.into_inner());
        for (root, rel) in files.take(n) {
            let key = cache_key(root, rel);
            if let Some(h) = held.get_mut(&key)
                && h.rel == rel
            {
                h.refs -= 1;
                if h.refs == 0 {
                    held.remove(&key);
                }
            }
        }
        self.any_held.store(!held.is_empty(), Ordering::Release);
    }

    fn held_stat(&self, key: u128, rel: &str) -> Option<Option<Arc<Stat>>> {
        if !self.any_held.load(Ordering::Acquire) {
            return None;
        }
        let held = self.held.read().unwrap_or_else(|e| e.into_inner());
        held.get(&key)
            .filter(|h| h.rel == rel)
            .map(|h| h.stat.clone())
    }

    /// The roots this cache serves.
    pub fn roots(&self) -> &Arc<Roots> {
        &self.roots
    }

    /// The metadata of `rel` under root `root`, fresh within the TTL.
    pub fn stat(&self, root: usize, rel: &str) -> Result<Arc<Stat>, BackingError> {
        let key = cache_key(root, rel);
        let held = self.held_stat(key, rel);
        if let Some(Some(stat)) = held {
            return Ok(stat);
        }
        if !self.ttl.is_zero()
            && let Some(c) = self.cache.get(&key)
            && c.at.elapsed() < self.ttl
            && c.rel == rel
        {
            return Ok(c.stat.clone());
        }
        let at = Instant::now();
        inc(&self.stats.backing_stats);
        let stat = Arc::new(self.roots.get(root).backing.stat(rel)?);
        if held.is_some() {
            let mut all = self.held.write().unwrap_or_else(|e| e.into_inner());
            if let Some(h) = all.get_mut(&key)
                && h.rel == rel
            {
                h.stat = Some(stat.clone());
            }
        }
        if !self.ttl.is_zero() {
            let cached = Cached {
                rel: rel.to_owned(),
                stat: stat.clone(),
                at,
            };
            self.cache.insert(key, Arc::new(cached));
        }
        Ok(stat)
    }

    /// Forgets `rel` (after the backing store reported it changed).
    pub fn invalidate(&self, root: usize, rel: &str) {
        let key = cache_key(root, rel);
        self.cache.invalidate(&key);
        if self.any_held.load(Ordering::Acquire) {
            // The manifest said immutable, the store says otherwise: believe the store
            // (stat once more, then trust again).
            let mut held = self.held.write().unwrap_or_else(|e| e.into_inner());
            if let Some(h) = held.get_mut(&key)
                && h.rel == rel
            {
                h.stat = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::Owner;
    use crate::backing::mem::MemBacking;

    fn roots(names: &[&str]) -> (Arc<Roots>, Arc<MemBacking>) {
        let mem = Arc::new(MemBacking::new());
        let roots = names
            .iter()
            .map(|n| Root {
                path: n.into(),
                name: (*n).to_owned(),
                backing: mem.clone() as Arc<dyn Backing>,
            })
            .collect();
        (Arc::new(Roots::new(roots)), mem)
    }

    #[test]
    fn resolve_picks_the_longest_root_on_a_component_boundary() {
        let (r, _) = roots(&["/data", "/data/deep"]);
        assert_eq!(r.resolve("/data/a/b").unwrap(), (0, "a/b"));
        assert_eq!(r.resolve("/data/deep/x").unwrap(), (1, "x"));
        assert!(matches!(
            r.resolve("/database/x"),
            Err(ResolveError::NotUnderRoot(_))
        ));
        assert!(matches!(
            r.resolve("relative/x"),
            Err(ResolveError::NotUnderRoot(_))
        ));
        assert!(matches!(
            r.resolve("/etc/passwd"),
            Err(ResolveError::NotUnderRoot(_))
        ));
    }

    #[test]
    fn ttl_zero_always_asks_the_store_and_a_ttl_caches() {
        let (r, mem) = roots(&["/data"]);
        mem.put(
            "f",
            b"one".to_vec(),
            Owner {
                mode: 0o644,
                ..Owner::default()
            },
        );
        let stats = Arc::new(Stats::default());
        let fresh = Meta::new(r.clone(), Duration::ZERO, 100, stats.clone());
        let v1 = fresh.stat(0, "f").unwrap().version;
        mem.put(
            "f",
            b"two".to_vec(),
            Owner {
                mode: 0o644,
                ..Owner::default()
            },
        );
        assert_ne!(fresh.stat(0, "f").unwrap().version, v1);

        let cached = Meta::new(r, Duration::from_secs(3600), 100, stats);
        let a = cached.stat(0, "f").unwrap().version;
        mem.put(
            "f",
            b"three".to_vec(),
            Owner {
                mode: 0o644,
                ..Owner::default()
            },
        );
        assert_eq!(cached.stat(0, "f").unwrap().version, a, "within the TTL");
        cached.invalidate(0, "f");
        assert_ne!(
            cached.stat(0, "f").unwrap().version,
            a,
            "after invalidation"
        );
    }

    #[test]
    fn immutable_files_are_stated_once_while_held() {
        let (r, mem) = roots(&["/data"]);
        let put = |b: &[u8]| {
            mem.put(
                "f",
                b.to_vec(),
                Owner {
                    mode: 0o644,
                    ..Owner::default()
                },
            )
        };
        put(b"one");
        let stats = Arc::new(Stats::default());
        let m = Meta::new(r, Duration::ZERO, 100, stats.clone());
        let files = [(0usize, "f")];
        assert_eq!(m.hold(files.iter().copied()), 1);
        assert_eq!(
            m.hold(files.iter().copied()),
            1,
            "a second job holds it too"
        );
        let v1 = m.stat(0, "f").unwrap().version;
        put(b"two");
        let before = stats.snapshot().backing_stats;
        for _ in 0..10 {
            assert_eq!(m.stat(0, "f").unwrap().version, v1, "trusted while held");
        }
        assert_eq!(stats.snapshot().backing_stats, before, "no backing stat");
        m.invalidate(0, "f");
        let v2 = m.stat(0, "f").unwrap().version;
        assert_ne!(v2, v1, "a change the store reported is believed");
        m.release(files.iter().copied(), 1);
        assert_eq!(m.stat(0, "f").unwrap().version, v2, "still held by one job");
        m.release(files.iter().copied(), 1);
        put(b"three");
        assert_ne!(
            m.stat(0, "f").unwrap().version,
            v2,
            "released: TTL rules again"
        );
    }
}
