//! Backing roots and the metadata cache.
//!
//! A client names files by absolute path; [`Roots::resolve`] finds the configured root
//! that contains it (or refuses), and [`Meta::stat`] returns the file's canonical path,
//! version and owners, from the backing store at most once per `metadata_ttl` per path.
//! This is what spares the shared file system a stat storm: within the TTL, an open
//! through the cache costs the backing store nothing. Files of a manifest registered as
//! `immutable` are stat'ed once and then trusted while the job is registered
//! ([`Meta::hold`]), as far as its registrant may vouch for them: an operator (root, the
//! daemon's user) for everyone, another user only for its own files and its own
//! lookups ([`Meta::stat_for`]). No registration changes what another user's lookup
//! sees.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::RwLock;
use std::time::{Duration, Instant};

use crate::backing::watch::{Watch, WatchThreads, WatchedBacking};
use crate::backing::{Backing, BackingError, Stat};
use crate::stats::{Stats, add};

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
    /// Each root's watch threads (`sc-stat`, `sc-close`), stopped at shutdown.
    threads: Vec<WatchThreads>,
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
        let mut threads = Vec::with_capacity(roots.len());
        let roots = roots
            .into_iter()
            .map(|r| {
                let w = WatchedBacking::new(r.backing, r.name.clone(), stall);
                watches.push(w.watch().clone());
                threads.push(w.threads());
                Root {
                    backing: Arc::new(w),
                    ..r
                }
            })
            .collect();
        Self {
            roots,
            watches,
            threads,
        }
    }

    /// Stops every root's watch threads (they finish the stats and closes queued) and
    /// joins them, all together within `within`; a thread stuck in a store is left
    /// behind (logged). Call at shutdown, once nothing calls the stores. Returns how
    /// many threads were left behind.
    pub fn close_threads(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        self.threads.iter().map(|t| t.close(deadline)).sum()
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

/// Who vouches that a manifest's files do not change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Voucher {
    /// Root or the daemon's own user: the node's administrator vouches for the dataset,
    /// for every reader.
    Operator,
    /// Another user: it vouches only for the files it owns, below directories that only
    /// it or an operator own, and only for its own reads.
    User(u32),
}

/// One registration's hold on its files (see [`Meta::hold`]): who vouches, and how many
/// of its files the first stat found not to be its to vouch for.
#[derive(Debug)]
pub struct Hold {
    voucher: Voucher,
    not_owned: AtomicU64,
}

impl Hold {
    /// A hold in `voucher`'s name.
    pub fn new(voucher: Voucher) -> Arc<Self> {
        Arc::new(Self {
            voucher,
            not_owned: AtomicU64::new(0),
        })
    }

    /// Who vouches.
    pub fn voucher(&self) -> Voucher {
        self.voucher
    }

    /// Files of this hold not held because another user owns them or a directory above
    /// them (counted at each file's first stat).
    pub fn not_owned(&self) -> u64 {
        self.not_owned.load(Ordering::Relaxed)
    }
}

/// Whose lookups a held stat answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trust {
    /// Everyone's (an operator holds it).
    Everyone,
    /// Only those of this uid: the owner that holds it.
    Owner(u32),
    /// Nobody's: no holder may vouch for it (it follows the TTL).
    Nobody,
}

/// A path some registered manifest declared immutable: stat once, then trusted (by
/// whom its holders may vouch to) for as long as some job holds it.
#[derive(Debug)]
struct Held {
    rel: String,
    /// The registrations holding it, each with whether its vouching for this file was
    /// decided (and counted) yet.
    holds: Vec<(Arc<Hold>, bool)>,
    /// The stat every holder trusts, and whose lookups it answers; `None` until stat'ed.
    stat: Option<(Arc<Stat>, Trust)>,
}

impl Held {
    /// Decides whom `stat` is trusted for under the current holders, counting each
    /// holder's refusal once.
    fn trust(&mut self, stat: &Stat, operators: [u32; 2]) -> Trust {
        let mut trust = Trust::Nobody;
        for (h, decided) in &mut self.holds {
            let vouches = match h.voucher {
                Voucher::Operator => {
                    trust = Trust::Everyone;
                    true
                }
                Voucher::User(uid) => {
                    let mine =
                        |o: &crate::backing::Owner| o.uid == uid || operators.contains(&o.uid);
                    let owns = stat.owner.uid == uid && stat.dirs.iter().all(mine);
                    if owns && trust == Trust::Nobody {
                        trust = Trust::Owner(uid);
                    }
                    owns
                }
            };
            if !*decided {
                *decided = true;
                if !vouches {
                    h.not_owned.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        trust
    }
}

/// What the held map says about a path, for one caller.
enum HeldView {
    /// Not held: the TTL rules.
    No,
    /// Held, not yet stat'ed: the next stat is the one its holders trust.
    Unknown,
    /// Held and trusted for this caller.
    Trusted(Arc<Stat>),
    /// Held, but not for this caller: the TTL rules for it.
    NotForYou,
}

/// Metadata of backing files, trusted for `ttl` (or, for files of immutable manifests,
/// until the manifest is unregistered, for the readers their registrant may vouch to).
#[derive(Debug)]
pub struct Meta {
    roots: Arc<Roots>,
    ttl: Duration,
    cache: moka::sync::Cache<u128, Arc<Cached>, rustc_hash::FxBuildHasher>,
    held: RwLock<HashMap<u128, Held>>,
    /// `held` is not empty (spares the common case the lock).
    any_held: AtomicBool,
    /// Owners whose directories a user's hold accepts above its files: root and the
    /// daemon's user.
    operators: [u32; 2],
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
            operators: [0, rustix::process::geteuid().as_raw()],
            stats,
        }
    }

    /// Declares `files` (root index, relative path) immutable in `hold`'s name until
    /// [`Meta::release`]: each is stat'ed once more at most, then trusted as far as the
    /// voucher may vouch for it (an operator: for everyone; a user: for its own lookups,
    /// of files it owns below directories only it or an operator own, which the first
    /// stat decides). Returns how many are held (all, unless [`MAX_IMMUTABLE`] is
    /// reached).
    pub fn hold<'a>(
        &self,
        files: impl Iterator<Item = (usize, &'a str)>,
        hold: &Arc<Hold>,
    ) -> usize {
        let mut held = self.held.write();
        let mut n = 0;
        for (root, rel) in files {
            let key = cache_key(root, rel);
            let full = held.len() >= MAX_IMMUTABLE;
            match held.get_mut(&key) {
                Some(h) if h.rel == rel => {
                    h.holds.push((hold.clone(), false));
                    if let Some((stat, _)) = &h.stat {
                        let stat = stat.clone();
                        let trust = h.trust(&stat, self.operators);
                        h.stat = Some((stat, trust));
                    }
                }
                Some(_) => {} // a hash collision: this one is revalidated as usual
                None if full => break,
                None => {
                    held.insert(
                        key,
                        Held {
                            rel: rel.to_owned(),
                            holds: vec![(hold.clone(), false)],
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

    /// Undoes a [`Meta::hold`] of the same files (the first `n` of them) by `hold`.
    pub fn release<'a>(
        &self,
        files: impl Iterator<Item = (usize, &'a str)>,
        n: usize,
        hold: &Arc<Hold>,
    ) {
        let mut held = self.held.write();
        for (root, rel) in files.take(n) {
            let key = cache_key(root, rel);
            if let Some(h) = held.get_mut(&key)
                && h.rel == rel
            {
                if let Some(i) = h.holds.iter().position(|(x, _)| Arc::ptr_eq(x, hold)) {
                    h.holds.swap_remove(i);
                }
                if h.holds.is_empty() {
                    held.remove(&key);
                } else if let Some((stat, _)) = &h.stat {
                    let stat = stat.clone();
                    let trust = h.trust(&stat, self.operators);
                    h.stat = Some((stat, trust));
                }
            }
        }
        self.any_held.store(!held.is_empty(), Ordering::Release);
    }

    fn held_view(&self, key: u128, rel: &str, uid: Option<u32>) -> HeldView {
        if !self.any_held.load(Ordering::Acquire) {
            return HeldView::No;
        }
        let held = self.held.read();
        match held.get(&key).filter(|h| h.rel == rel).map(|h| &h.stat) {
            None => HeldView::No,
            Some(None) => HeldView::Unknown,
            Some(Some((stat, trust))) => match (*trust, uid) {
                (Trust::Everyone, _) => HeldView::Trusted(stat.clone()),
                (Trust::Owner(o), Some(u)) if o == u => HeldView::Trusted(stat.clone()),
                _ => HeldView::NotForYou,
            },
        }
    }

    /// The roots this cache serves.
    pub fn roots(&self) -> &Arc<Roots> {
        &self.roots
    }

    /// The metadata of `rel` under root `root`, fresh within the TTL, for the daemon's
    /// own use (prefetch, status, peers): a held file's stat when an operator holds it.
    pub fn stat(&self, root: usize, rel: &str) -> Result<Arc<Stat>, BackingError> {
        self.lookup(root, rel, None)
    }

    /// The metadata of `rel` under root `root` for a lookup on behalf of user `uid` (a
    /// client's open, the prefetch of a job `uid` registered): fresh within the TTL, or
    /// a held stat trusted for `uid`. Another user's hold never answers it, so what
    /// `uid` may read is never decided on a stat older than the TTL unless `uid` itself
    /// or an operator vouched for the file.
    pub fn stat_for(&self, root: usize, rel: &str, uid: u32) -> Result<Arc<Stat>, BackingError> {
        self.lookup(root, rel, Some(uid))
    }

    fn lookup(&self, root: usize, rel: &str, uid: Option<u32>) -> Result<Arc<Stat>, BackingError> {
        self.lookup_many(root, &[rel], uid)
            .pop()
            .expect("one path, one answer")
    }

    /// [`Meta::stat_for`] of each of `rels` under root `root`, in order: what is not
    /// held or fresh in the cache is asked of the backing store in one batch
    /// ([`crate::backing::Backing::stat_many`]: a loader's batch of opens costs the
    /// root's stat pool a few hops, not one per file).
    pub fn stat_many_for(
        &self,
        root: usize,
        rels: &[&str],
        uid: u32,
    ) -> Vec<Result<Arc<Stat>, BackingError>> {
        self.lookup_many(root, rels, Some(uid))
    }

    /// [`Meta::stat`] of each of `rels` under root `root`, in order, in one batch (see
    /// [`Meta::stat_many_for`]): for the daemon's own use (the status's window, the
    /// prefetcher's sizes).
    pub fn stat_many(&self, root: usize, rels: &[&str]) -> Vec<Result<Arc<Stat>, BackingError>> {
        self.lookup_many(root, rels, None)
    }

    fn lookup_many(
        &self,
        root: usize,
        rels: &[&str],
        uid: Option<u32>,
    ) -> Vec<Result<Arc<Stat>, BackingError>> {
        let mut out: Vec<Option<Result<Arc<Stat>, BackingError>>> = Vec::new();
        let mut missed = Vec::new();
        for (i, rel) in rels.iter().enumerate() {
            match self.known(root, rel, uid) {
                Ok(stat) => out.push(Some(Ok(stat))),
                Err(held) => {
                    out.push(None);
                    missed.push((i, held));
                }
            }
        }
        if !missed.is_empty() {
            let at = Instant::now();
            add(&self.stats.backing_stats, missed.len() as u64);
            let paths: Vec<&str> = missed.iter().map(|&(i, _)| rels[i]).collect();
            let got = self.roots.get(root).backing.stat_many(&paths);
            for ((i, held), r) in missed.into_iter().zip(got) {
                out[i] = Some(r.map(|stat| self.remember(root, rels[i], held, stat, at)));
            }
        }
        out.into_iter()
            .map(|r| r.expect("every path answered"))
            .collect()
    }

    /// The stat of `rel` without asking the backing store: a held file's trusted stat,
    /// or one fresh within the TTL; else what the hold says of it, for
    /// [`Meta::remember`].
    fn known(&self, root: usize, rel: &str, uid: Option<u32>) -> Result<Arc<Stat>, HeldView> {
        let key = cache_key(root, rel);
        let held = self.held_view(key, rel, uid);
        if let HeldView::Trusted(stat) = held {
            return Ok(stat);
        }
        if !self.ttl.is_zero()
            && let Some(c) = self.cache.get(&key)
            && c.at.elapsed() < self.ttl
            && c.rel == rel
        {
            return Ok(c.stat.clone());
        }
        Err(held)
    }

    /// Keeps `stat` of `rel`, asked of the backing store at `at`: in its hold (when it
    /// has none yet) and in the cache.
    fn remember(
        &self,
        root: usize,
        rel: &str,
        held: HeldView,
        stat: Stat,
        at: Instant,
    ) -> Arc<Stat> {
        let key = cache_key(root, rel);
        let stat = Arc::new(stat);
        if matches!(held, HeldView::Unknown) {
            let mut all = self.held.write();
            if let Some(h) = all.get_mut(&key)
                && h.rel == rel
                && h.stat.is_none()
            {
                let trust = h.trust(&stat, self.operators);
                h.stat = Some((stat.clone(), trust));
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
        stat
    }

    /// Forgets `rel` (after the backing store reported it changed).
    pub fn invalidate(&self, root: usize, rel: &str) {
        let key = cache_key(root, rel);
        self.cache.invalidate(&key);
        if self.any_held.load(Ordering::Acquire) {
            // The manifest said immutable, the store says otherwise: believe the store
            // (stat once more, then trust again).
            let mut held = self.held.write();
            if let Some(h) = held.get_mut(&key)
                && h.rel == rel
            {
                h.stat = None;
            }
        }
    }
}

/// What the daemon's unit tests build their parts over.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// One backing root, mounted and named `/r`, over `backing`, its metadata trusted
    /// for an hour; and the counters it reports to.
    pub(crate) fn one_root(backing: Arc<dyn Backing>) -> (Arc<Meta>, Arc<Stats>) {
        let roots = Arc::new(Roots::new(vec![Root {
            path: "/r".into(),
            name: "/r".into(),
            backing,
        }]));
        let stats = Arc::new(Stats::default());
        let meta = Arc::new(Meta::new(
            roots,
            Duration::from_secs(3600),
            1000,
            stats.clone(),
        ));
        (meta, stats)
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
        let (a, b) = (Hold::new(Voucher::Operator), Hold::new(Voucher::Operator));
        assert_eq!(m.hold(files.iter().copied(), &a), 1);
        assert_eq!(
            m.hold(files.iter().copied(), &b),
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
        m.release(files.iter().copied(), 1, &a);
        assert_eq!(m.stat(0, "f").unwrap().version, v2, "still held by one job");
        m.release(files.iter().copied(), 1, &b);
        put(b"three");
        assert_ne!(
            m.stat(0, "f").unwrap().version,
            v2,
            "released: TTL rules again"
        );
    }

    fn owned(uid: u32, mode: u32) -> Owner {
        Owner {
            uid,
            gid: uid,
            mode,
            acl: false,
        }
    }

    /// A store with `mine` (uid 1000's), `theirs` (root's), and `shared/f` (uid 1000's,
    /// in a directory of uid 2000); a meta cache with a zero TTL over it.
    fn three_files() -> (Meta, Arc<MemBacking>, Arc<Stats>) {
        let (r, mem) = roots(&["/data"]);
        mem.put("mine", b"1".to_vec(), owned(1000, 0o644));
        mem.put("theirs", b"2".to_vec(), owned(0, 0o644));
        mem.put("shared/f", b"3".to_vec(), owned(1000, 0o644));
        mem.set_dir("shared", owned(2000, 0o755));
        let stats = Arc::new(Stats::default());
        (Meta::new(r, Duration::ZERO, 100, stats.clone()), mem, stats)
    }

    #[test]
    fn a_users_hold_answers_only_its_own_lookups_of_its_own_files() {
        let (m, mem, stats) = three_files();
        let files = [(0usize, "mine"), (0, "theirs"), (0, "shared/f")];
        let hold = Hold::new(Voucher::User(1000));
        assert_eq!(m.hold(files.iter().copied(), &hold), 3);
        for (_, f) in files {
            m.stat_for(0, f, 1000).unwrap();
        }
        assert_eq!(
            hold.not_owned(),
            2,
            "root's file, and one below uid 2000's directory"
        );
        let v1 = m.stat_for(0, "mine", 1000).unwrap().version;
        mem.rewrite_in_place("mine", b"x".to_vec());
        mem.rewrite_in_place("theirs", b"y".to_vec());
        mem.set_dir("", owned(0, 0o700));
        let stats_now = || stats.snapshot().backing_stats;

        let before = stats_now();
        assert_eq!(
            m.stat_for(0, "mine", 1000).unwrap().version,
            v1,
            "held for its owner"
        );
        assert_eq!(stats_now(), before, "no backing stat");
        let other = m.stat_for(0, "mine", 2000).unwrap();
        assert_ne!(other.version, v1, "another user sees the store (TTL 0)");
        assert_eq!(
            other.dirs[1].mode, 0o700,
            "and decides on fresh owners (the root, after `/`)"
        );
        assert_ne!(m.stat(0, "mine").unwrap().version, v1, "so does the daemon");
        assert_eq!(
            m.stat_for(0, "mine", 1000).unwrap().version,
            v1,
            "another user's lookup does not replace the owner's held stat"
        );
        let before = stats_now();
        m.stat_for(0, "theirs", 1000).unwrap();
        m.stat_for(0, "shared/f", 1000).unwrap();
        assert_eq!(stats_now(), before + 2, "not its to vouch for: TTL rules");
        assert_eq!(hold.not_owned(), 2, "counted once");
    }

    #[test]
    fn an_operators_hold_answers_everyone_and_outlives_a_users_hold() {
        let (m, mem, stats) = three_files();
        let files = [(0usize, "theirs"), (0, "mine")];
        let user = Hold::new(Voucher::User(1000));
        let op = Hold::new(Voucher::Operator);
        m.hold(files.iter().copied(), &user);
        let v_mine = m.stat_for(0, "mine", 1000).unwrap().version;
        assert_eq!(m.hold(files.iter().copied(), &op), 2);
        let v_theirs = m.stat(0, "theirs").unwrap().version;
        assert_eq!(op.not_owned(), 0);
        mem.rewrite_in_place("theirs", b"y".to_vec());
        mem.rewrite_in_place("mine", b"x".to_vec());
        let before = stats.snapshot().backing_stats;
        for uid in [0, 1000, 2000] {
            assert_eq!(m.stat_for(0, "theirs", uid).unwrap().version, v_theirs);
            assert_eq!(m.stat_for(0, "mine", uid).unwrap().version, v_mine);
        }
        assert_eq!(m.stat(0, "mine").unwrap().version, v_mine);
        assert_eq!(stats.snapshot().backing_stats, before, "held for everyone");

        m.release(files.iter().copied(), 2, &op);
        assert_eq!(
            m.stat_for(0, "mine", 1000).unwrap().version,
            v_mine,
            "its owner's still"
        );
        assert_ne!(m.stat_for(0, "mine", 2000).unwrap().version, v_mine);
        assert_ne!(m.stat_for(0, "theirs", 1000).unwrap().version, v_theirs);
        m.release(files.iter().copied(), 2, &user);
        assert_ne!(
            m.stat_for(0, "mine", 1000).unwrap().version,
            v_mine,
            "released"
        );
    }
}
