//! Prefetch and admission decisions, on top of the [`Planner`]: which file to fetch
//! next and what it may evict, and whether a demand miss is kept. Pure logic over a
//! [`CacheView`], so that the daemon (over the NVMe store) and the policy benchmark
//! (over a simulated cache) run exactly the same decisions.

use std::ops::ControlFlow;

use super::{FileRef, Need, Planner};

/// What the decisions need to know about the cache.
pub trait CacheView {
    /// True when `f` is resident.
    fn is_resident(&self, p: &Planner, f: &FileRef) -> bool;
    /// [`CacheView::is_resident`] of a file the planner says has a cache entry or not
    /// (`entry`, from [`Planner::walk_upcoming`]); a view that follows the planner's
    /// entries answers without a lookup of `f` for most files.
    fn is_resident_given(&self, p: &Planner, f: &FileRef, entry: bool) -> bool {
        let _ = entry;
        self.is_resident(p, f)
    }
    /// The file to evict next (the planner's choice among the files that may go now):
    /// [`Planner::victim_indexed`] over the daemon's store, [`Planner::victim`] over a
    /// simulated cache.
    fn victim(&self, p: &mut Planner) -> Option<FileRef>;
    /// True when a fetch of `f` is under way.
    fn in_flight(&self, f: &FileRef) -> bool;
    /// True when `f` fits without evicting anything (fetches under way counted).
    fn has_room(&self, f: &FileRef) -> bool;
}

/// A fetch to start.
#[derive(Debug, Clone, PartialEq)]
pub struct Fetch {
    /// The file to fetch.
    pub file: FileRef,
    /// When it is needed.
    pub need: Need,
    /// The file to evict first, if the cache is full.
    pub evict: Option<FileRef>,
}

/// How eagerly to prefetch.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Upcoming missing files (neither resident nor being fetched) examined at most.
    pub max_ahead: usize,
    /// Upcoming files of each job walked at most to find them (resident ones are
    /// passed over: at half cache the next thousands of files may all be resident).
    pub max_walk: usize,
    /// Seconds the backing store takes per file (measured); `f64::INFINITY` prefetches
    /// every missing file as soon as the rules allow.
    pub secs_per_file: f64,
    /// Slack added to every deadline, in seconds.
    pub margin: f64,
}

/// The next prefetch to start: the first upcoming file that is neither resident nor
/// being fetched, when starting now is needed to have some upcoming missing file in time
/// (the `k`-th missing file is due within `k × secs_per_file + margin`), and when there
/// is room, or the file needed farthest in the future is needed later than it and is next
/// read in a later epoch (see [`Planner::may_evict_for_prefetch`]). `None`: nothing to
/// fetch now.
///
/// Fetching only when some deadline requires it keeps the backing store busy exactly
/// when it is the bottleneck, and otherwise leaves files cached for the next epoch alone
/// for as long as possible.
pub fn next_prefetch(p: &mut Planner, cache: &dyn CacheView, pace: Pace) -> Option<Fetch> {
    next_prefetch_or_slack(p, cache, pace).0
}

/// [`next_prefetch`], and when nothing is urgent yet, the slack: how long until some
/// upcoming missing file would be, if the readers keep their measured rates (the least
/// `t_k − (k × secs_per_file + margin)` over the missing files looked at; 0 when a
/// fetch is returned, or when it is refused for want of a victim, infinite when nothing
/// is missing). A caller may look again no sooner than that.
pub fn next_prefetch_or_slack(
    p: &mut Planner,
    cache: &dyn CacheView,
    pace: Pace,
) -> (Option<Fetch>, f64) {
    let (due, slack) = urgent_missing(p, cache, pace, 1);
    match due.into_iter().next() {
        Some((file, need)) => (admit_prefetch(p, cache, file, need), 0.0),
        None => (None, slack),
    }
}

/// The upcoming missing files (neither resident nor being fetched) whose fetches must
/// start now, in order of need, at most `max`, and the slack as [`next_prefetch_or_slack`]
/// says it (0 when some are due). When the `k`-th missing file has a slack of `s ≤ 0`,
/// the first `1 + ⌊−s / secs_per_file⌋` of the `k` are due (each one started moves the
/// `k`-th one place forward): one walk past thousands of resident files serves several
/// decisions (it goes on past the first urgent file until `max` are known due, or to
/// `max_ahead` missing files). Each is still admitted one by one ([`admit_prefetch`]).
pub fn urgent_missing(
    p: &mut Planner,
    cache: &dyn CacheView,
    pace: Pace,
    max: usize,
) -> (Vec<(FileRef, Need)>, f64) {
    // One walk, nothing cloned but the files to fetch: at half cache an epoch opens
    // with thousands of resident files, and the missing ones past them may be urgent
    // only as a whole (thousands of them, each taking the backing store's time).
    let mut first: Vec<(FileRef, Need)> = Vec::new();
    let mut missing = 0usize;
    let mut slack = f64::INFINITY;
    // Past the first urgent file the walk goes on while fewer than `max` are known
    // due: the least slack says how many.
    let enough = if max <= 1 {
        0.0
    } else {
        -((max - 1) as f64) * pace.secs_per_file
    };
    p.walk_upcoming(pace.max_walk, &mut |p, file, need, entry| {
        if cache.is_resident_given(p, file, entry) || cache.in_flight(file) {
            return ControlFlow::Continue(());
        }
        missing += 1;
        if first.len() < max {
            first.push((file.clone(), need));
        }
        if let Need::In(t) = need {
            slack = slack.min(t - (missing as f64 * pace.secs_per_file + pace.margin));
        }
        if (first.len() >= max && slack <= enough) || missing >= pace.max_ahead {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    if first.is_empty() {
        return (Vec::new(), f64::INFINITY);
    }
    if slack > 0.0 {
        return (Vec::new(), slack);
    }
    let due = if pace.secs_per_file.is_finite() && pace.secs_per_file > 0.0 {
        1 + (-slack / pace.secs_per_file).floor().min(usize::MAX as f64) as usize
    } else {
        usize::MAX
    };
    first.truncate(due.max(1));
    (first, 0.0)
}

/// Whether a due prefetch of `file` may start now: when there is room, or when the
/// file needed farthest in the future is needed later than it and is next read in a
/// later epoch (see [`Planner::may_evict_for_prefetch`]); then the fetch, with the
/// file to evict first. `None`: refused for want of a victim.
pub fn admit_prefetch(
    p: &mut Planner,
    cache: &dyn CacheView,
    file: FileRef,
    need: Need,
) -> Option<Fetch> {
    if cache.has_room(&file) {
        let evict = None;
        return Some(Fetch { file, need, evict });
    }
    let victim = cache.victim(p)?;
    let incoming = p.use_epoch(&file);
    if p.need(&victim).later_than(need) && p.may_evict_for_prefetch(&victim, incoming) {
        let evict = Some(victim);
        return Some(Fetch { file, need, evict });
    }
    None
}

/// What to do with a file a reader is waiting for.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Cache it, evicting this file first if given.
    Keep(Option<FileRef>),
    /// Serve it without caching: everything cached is needed sooner.
    Bypass,
}

/// Admission of a demand miss (Belady with bypass): keep it when there is room or when
/// the file needed farthest in the future is needed later than this one next is.
pub fn admit_demand(
    p: &mut Planner,
    cache: &dyn CacheView,
    file: &FileRef,
    next_need: Need,
) -> Admission {
    if cache.has_room(file) {
        return Admission::Keep(None);
    }
    match cache.victim(p) {
        Some(v) if p.need(&v).later_than(next_need) => Admission::Keep(Some(v)),
        _ => Admission::Bypass,
    }
}
