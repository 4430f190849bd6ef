//! Prefetch and admission decisions, on top of the [`Planner`]: which file to fetch
//! next and what it may evict, and whether a demand miss is kept. Pure logic over a
//! [`CacheView`], so that the daemon (over the NVMe store) and the policy benchmark
//! (over a simulated cache) run exactly the same decisions.

use super::{FileRef, Need, Planner};

/// What the decisions need to know about the cache.
pub trait CacheView {
    /// Resident files, least recently used first.
    fn resident(&self) -> Vec<FileRef>;
    /// True when `f` is resident.
    fn is_resident(&self, f: &FileRef) -> bool;
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

/// The next prefetch to start, looking at most `max_ahead` upcoming files: the first
/// that is neither resident nor being fetched, if there is room, or if the file needed
/// farthest in the future is needed later than it and is next read in a later epoch
/// (see [`Planner::may_evict_for_prefetch`]). `None`: nothing worth fetching now.
pub fn next_prefetch(p: &mut Planner, cache: &dyn CacheView, max_ahead: usize) -> Option<Fetch> {
    for (file, need) in p.upcoming(max_ahead) {
        if cache.is_resident(&file) || cache.in_flight(&file) {
            continue;
        }
        if cache.has_room(&file) {
            return Some(Fetch {
                file,
                need,
                evict: None,
            });
        }
        let resident = cache.resident();
        let v = p.victim(&resident)?;
        let victim = resident[v].clone();
        let incoming = p.use_epoch(&file);
        if p.need(&victim).later_than(need) && p.may_evict_for_prefetch(&victim, incoming) {
            return Some(Fetch {
                file,
                need,
                evict: Some(victim),
            });
        }
        // The next file in need order cannot be fetched without harm: nothing after it
        // can either (it is needed no sooner).
        return None;
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
    let resident = cache.resident();
    match p.victim(&resident) {
        Some(v) if p.need(&resident[v]).later_than(next_need) => {
            Admission::Keep(Some(resident[v].clone()))
        }
        _ => Admission::Bypass,
    }
}
