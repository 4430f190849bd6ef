//! Who holds the local socket's connections, and which one gives way to a newcomer.
//!
//! Every connection costs a thread, so their number is bounded (`max_connections`); a
//! bound alone would let one user hold them all, idle, and switch the cache off for
//! everyone else. So the bound is shared out by uid, and a full table makes room rather
//! than turn the newcomer away:
//!
//! - a uid other than root and the daemon's own (the operators) holds at most `per_uid`
//!   connections: past it, its own connection idle longest is closed for the newcomer;
//! - when `max` connections are held, the newcomer takes the place of the connection
//!   idle longest of the uid holding the most (if that uid holds more than the
//!   newcomer's, or is the newcomer's);
//! - operators may hold `reserve` connections beyond `max`, so that `shardcache status`
//!   is answered however busy the socket;
//! - a connection with a request in progress is never closed: when no connection that
//!   could give way is idle, the newcomer is refused (and told why; its client reads the
//!   backing store).
//!
//! Closing an idle connection costs its client nothing but a reconnect: a client finds
//! its pooled connection closed at its next request and opens another (requests are
//! idempotent). A uid that opens connections as fast as it can only ever replaces its
//! own.
//!
//! The table is plain data ([`Table`]): the accept loop decides with it under a lock,
//! and the connection threads mark their [`Activity`] without one.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The bounds of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most connections (`max_connections`).
    pub max: usize,
    /// Most connections of one uid other than the operators' (`max_connections_per_uid`).
    pub per_uid: usize,
    /// Connections beyond `max` only operators may hold.
    pub reserve: usize,
}

/// Why a connection was refused, or closed to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The uid held `per_uid` connections.
    UidLimit,
    /// The table held `max` (an operator: `max + reserve`) connections.
    Full,
}

/// What to do with a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Serve it.
    Admit,
    /// Close connection `victim` (idle), then serve it.
    Evict {
        /// The connection to close.
        victim: u64,
        /// Which limit was reached.
        why: Why,
    },
    /// Refuse it: no connection that could give way is idle.
    Refuse(Why),
}

/// A request in progress on a connection (see [`Activity::busy`]).
#[derive(Debug)]
pub struct Busy<'a>(&'a Activity);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// What a connection's thread is doing, kept up to date without a lock.
#[derive(Debug)]
pub struct Activity {
    epoch: Instant,
    busy: AtomicBool,
    /// Nanoseconds from `epoch` to the end of the last request (or the connection's
    /// admission).
    idle_since: AtomicU64,
}

impl Activity {
    fn new(epoch: Instant) -> Self {
        let a = Self {
            epoch,
            busy: AtomicBool::new(false),
            idle_since: AtomicU64::new(0),
        };
        a.idle_since.store(a.now(), Ordering::Relaxed);
        a
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// [`Activity::begin`] now, and [`Activity::end`] when the guard is dropped.
    pub fn busy(&self) -> Busy<'_> {
        self.begin();
        Busy(self)
    }

    /// A request arrived: the connection may not be closed until [`Activity::end`].
    pub fn begin(&self) {
        self.busy.store(true, Ordering::Release);
    }

    /// Its reply is sent: the connection is idle from now.
    pub fn end(&self) {
        self.idle_since.store(self.now(), Ordering::Relaxed);
        self.busy.store(false, Ordering::Release);
    }

    /// `Some(when it became idle)` while idle.
    fn idle(&self) -> Option<u64> {
        (!self.busy.load(Ordering::Acquire)).then(|| self.idle_since.load(Ordering::Relaxed))
    }
}

#[derive(Debug)]
struct Entry<S> {
    uid: u32,
    activity: Arc<Activity>,
    handle: S,
}

/// The connections held, by id, with what each holds to close it (`S`).
#[derive(Debug)]
pub struct Table<S> {
    limits: Limits,
    epoch: Instant,
    next_id: u64,
    entries: HashMap<u64, Entry<S>>,
    by_uid: HashMap<u32, usize>,
}

impl<S> Table<S> {
    /// An empty table.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            epoch: Instant::now(),
            next_id: 0,
            entries: HashMap::new(),
            by_uid: HashMap::new(),
        }
    }

    /// Connections held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Connections `uid` holds.
    pub fn held_by(&self, uid: u32) -> usize {
        self.by_uid.get(&uid).copied().unwrap_or(0)
    }

    /// What to do with a newcomer of `uid` (`operator`: root or the daemon's user).
    pub fn decide(&self, uid: u32, operator: bool) -> Verdict {
        let mine = self.held_by(uid);
        if !operator && mine >= self.limits.per_uid {
            return match self.oldest_idle().get(&uid) {
                Some(&(_, victim)) => Verdict::Evict {
                    victim,
                    why: Why::UidLimit,
                },
                None => Verdict::Refuse(Why::UidLimit),
            };
        }
        let cap = if operator {
            self.limits.max + self.limits.reserve
        } else {
            self.limits.max
        };
        if self.entries.len() < cap {
            return Verdict::Admit;
        }
        // Full: the uid holding the most gives way, as long as it holds more than this
        // one (or is this one).
        let idle = self.oldest_idle();
        let mut holders: Vec<(usize, u32)> = self
            .by_uid
            .iter()
            .filter(|&(&u, &n)| u == uid || n > mine)
            .map(|(&u, &n)| (n, u))
            .collect();
        holders.sort_unstable_by(|a, b| b.cmp(a));
        holders.iter().find_map(|(_, u)| idle.get(u)).map_or(
            Verdict::Refuse(Why::Full),
            |&(_, victim)| Verdict::Evict {
                victim,
                why: Why::Full,
            },
        )
    }

    /// For every uid with an idle connection, the one idle longest: (since, id).
    fn oldest_idle(&self) -> HashMap<u32, (u64, u64)> {
        let mut m: HashMap<u32, (u64, u64)> = HashMap::new();
        for (&id, e) in &self.entries {
            if let Some(since) = e.activity.idle() {
                let slot = m.entry(e.uid).or_insert((since, id));
                if (since, id) < *slot {
                    *slot = (since, id);
                }
            }
        }
        m
    }

    /// Adds a connection of `uid`: its id, and the activity its thread keeps.
    pub fn insert(&mut self, uid: u32, handle: S) -> (u64, Arc<Activity>) {
        let id = self.next_id;
        self.next_id += 1;
        let activity = Arc::new(Activity::new(self.epoch));
        self.entries.insert(
            id,
            Entry {
                uid,
                activity: activity.clone(),
                handle,
            },
        );
        *self.by_uid.entry(uid).or_default() += 1;
        (id, activity)
    }

    /// Removes connection `id` (its thread ended, or it was chosen to give way): its
    /// handle, if it was still held.
    pub fn remove(&mut self, id: u64) -> Option<S> {
        let e = self.entries.remove(&id)?;
        if let Some(n) = self.by_uid.get_mut(&e.uid) {
            *n -= 1;
            if *n == 0 {
                self.by_uid.remove(&e.uid);
            }
        }
        Some(e.handle)
    }

    /// Every handle held.
    pub fn handles(&self) -> impl Iterator<Item = &S> {
        self.entries.values().map(|e| &e.handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OP: u32 = 0;

    fn table(max: usize, per_uid: usize, reserve: usize) -> Table<()> {
        Table::new(Limits {
            max,
            per_uid,
            reserve,
        })
    }

    /// Admits a newcomer as the accept loop does; the victim, if any.
    fn admit(t: &mut Table<()>, uid: u32) -> Result<Option<u64>, Why> {
        let victim = match t.decide(uid, uid == OP) {
            Verdict::Admit => None,
            Verdict::Evict { victim, .. } => {
                t.remove(victim).unwrap();
                Some(victim)
            }
            Verdict::Refuse(why) => return Err(why),
        };
        let (_, a) = t.insert(uid, ());
        a.end();
        Ok(victim)
    }

    #[test]
    fn a_uid_over_its_share_replaces_its_own_oldest_idle_connection() {
        let mut t = table(8, 3, 2);
        for _ in 0..3 {
            assert_eq!(admit(&mut t, 10), Ok(None));
        }
        // The first (id 0) is idle longest, and gives way; then the second.
        assert_eq!(admit(&mut t, 10), Ok(Some(0)));
        assert_eq!(admit(&mut t, 10), Ok(Some(1)));
        assert_eq!(t.held_by(10), 3);
        // Another uid is not touched by it.
        assert_eq!(admit(&mut t, 11), Ok(None));
        assert_eq!(t.held_by(11), 1);
    }

    #[test]
    fn busy_connections_never_give_way() {
        let mut t = table(8, 2, 2);
        let (_, a) = t.insert(10, ());
        let (_, b) = t.insert(10, ());
        a.begin();
        b.begin();
        assert_eq!(t.decide(10, false), Verdict::Refuse(Why::UidLimit));
        b.end();
        assert_eq!(
            t.decide(10, false),
            Verdict::Evict {
                victim: 1,
                why: Why::UidLimit
            }
        );
    }

    #[test]
    fn a_full_table_takes_from_the_uid_holding_the_most() {
        let mut t = table(6, 6, 2);
        for _ in 0..4 {
            admit(&mut t, 10).unwrap();
        }
        for _ in 0..2 {
            admit(&mut t, 11).unwrap();
        }
        // uid 12 holds none: uid 10 (4) gives way, not uid 11 (2).
        let v = admit(&mut t, 12).unwrap().unwrap();
        assert_eq!(
            (t.held_by(10), t.held_by(11), t.held_by(12)),
            (3, 2, 1),
            "{v}"
        );
        admit(&mut t, 12).unwrap();
        assert_eq!((t.held_by(10), t.held_by(11), t.held_by(12)), (2, 2, 2));
        // All hold 2: a newcomer of 12 takes from 12 (a tie is no reason to close
        // another uid's).
        admit(&mut t, 12).unwrap();
        assert_eq!((t.held_by(10), t.held_by(11), t.held_by(12)), (2, 2, 2));
        // Every connection busy: refused.
        let mut busy = table(1, 1, 0);
        let (_, a) = busy.insert(10, ());
        a.begin();
        assert_eq!(busy.decide(11, false), Verdict::Refuse(Why::Full));
    }

    #[test]
    fn operators_have_a_reserve_and_no_per_uid_limit() {
        let mut t = table(4, 1, 2);
        for u in 10..14 {
            admit(&mut t, u).unwrap();
        }
        t.entries.values().for_each(|e| e.activity.begin());
        assert_eq!(t.decide(20, false), Verdict::Refuse(Why::Full));
        // Every connection busy and the table full: root is still admitted, twice.
        assert_eq!(t.decide(OP, true), Verdict::Admit);
        t.insert(OP, ()).1.begin();
        assert_eq!(t.decide(OP, true), Verdict::Admit);
        t.insert(OP, ()).1.begin();
        assert_eq!(t.decide(OP, true), Verdict::Refuse(Why::Full));
        assert_eq!(t.len(), 6);
        assert_eq!(t.remove(0), Some(()));
        assert_eq!(t.remove(0), None);
        assert_eq!(t.held_by(10), 0);
    }
}
