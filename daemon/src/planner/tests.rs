//! Planner tests, including a simulated cache driven by the planner (Belady eviction,
//! admission, prefetch in order of need) checked against its invariants.

use super::*;
use proptest::prelude::*;

fn files(n: usize) -> Vec<FileRef> {
    (0..n)
        .map(|i| FileRef {
            root: 0,
            path: format!("f{i}").into(),
        })
        .collect()
}

fn seq(first: u64, epochs: Vec<Vec<u32>>) -> Source {
    Source::Sequence {
        first,
        epochs: epochs.into_iter().map(Arc::new).collect(),
    }
}

#[test]
fn need_follows_the_plan_across_epochs() {
    let mut p = Planner::new();
    let fs = files(3);
    p.register("j", fs.clone(), seq(0, vec![vec![0, 1, 2], vec![2, 0, 1]]))
        .unwrap();
    assert_eq!(p.need(&fs[0]), Need::In(0.0));
    assert_eq!(p.need(&fs[2]), Need::In(2.0));
    p.on_access(&fs[0], 4);
    p.on_access(&fs[1], 4);
    assert_eq!(p.position("j"), Some((0, 2)));
    // f0 next in epoch 1 at position 1: one step left in epoch 0, then 1.
    assert_eq!(p.need(&fs[0]), Need::In(2.0));
    p.on_access(&fs[2], 4);
    assert_eq!(p.position("j"), Some((1, 0)), "rolled into the next epoch");
    assert_eq!(p.need(&fs[2]), Need::In(0.0));
    assert_eq!(
        p.need(&FileRef {
            root: 0,
            path: "other".into()
        }),
        Need::Never
    );
    let resident = vec![fs[2].clone(), fs[1].clone(), fs[0].clone()];
    assert_eq!(p.victim(&resident), Some(1), "f1 is needed last");
    p.set_rate("j", 2.0);
    assert_eq!(p.need(&fs[1]), Need::In(1.0), "steps ÷ rate");
}

#[test]
fn reads_out_of_the_plan_do_not_move_the_position() {
    let mut p = Planner::new();
    let fs = files(10);
    p.register("j", fs.clone(), seq(0, vec![(0..10).collect()]))
        .unwrap();
    assert_eq!(
        p.on_access(&fs[9], 4),
        None,
        "too far ahead to be this job's read"
    );
    assert_eq!(p.position("j"), Some((0, 0)));
    // A read ahead within the window is recorded; the position (the low watermark)
    // moves once the reads before it are in.
    assert_eq!(p.on_access(&fs[2], 4), Some("j"));
    assert_eq!(p.position("j"), Some((0, 0)));
    p.on_access(&fs[1], 4);
    assert_eq!(p.position("j"), Some((0, 0)));
    p.on_access(&fs[0], 4);
    assert_eq!(p.position("j"), Some((0, 3)), "0, 1 and 2 read");
    assert_eq!(p.reads(), 3);
}

#[test]
fn registration_checks_the_plan() {
    let mut p = Planner::new();
    assert!(p.register("j", files(2), seq(0, vec![vec![0, 2]])).is_err());
    let bad = Source::Shuffle {
        seed: 1,
        first: 0,
        count: 1,
        world: 2,
        ranks: vec![2],
        drop_last: false,
    };
    assert!(p.register("j", files(2), bad).is_err());
    assert!(!p.unregister("j"));
}

/// A cache of whole files, for the planner's decisions to act on.
struct SimCache {
    resident: Vec<FileRef>,
    capacity: usize,
    /// Check every victim the planner's index gives against the exhaustive search.
    check: bool,
}

impl prefetch::CacheView for SimCache {
    fn is_resident(&self, _: &Planner, f: &FileRef) -> bool {
        self.resident.contains(f)
    }
    fn victim(&self, p: &mut Planner) -> Option<FileRef> {
        let exact = p.victim(&self.resident).map(|i| self.resident[i].clone());
        if self.check {
            let indexed = p.victim_indexed(&|f| self.resident.contains(f));
            let need = |p: &mut Planner, f: &Option<FileRef>| f.as_ref().map(|f| p.need(f));
            assert_eq!(
                need(p, &indexed),
                need(p, &exact),
                "the index chose {indexed:?}, the search {exact:?}"
            );
        }
        exact
    }
    fn in_flight(&self, _: &FileRef) -> bool {
        false // fetches complete at once in this step model
    }
    fn has_room(&self, _: &FileRef) -> bool {
        self.resident.len() < self.capacity
    }
}

impl SimCache {
    /// Evicts `v`, checking first that nothing kept is needed later than it.
    fn evict(&mut self, p: &mut Planner, v: &FileRef, check: bool) {
        if check {
            let nv = p.need(v);
            for f in &self.resident {
                assert!(
                    !p.need(f).later_than(nv),
                    "evicted a file needed sooner than one kept"
                );
            }
        }
        self.resident.retain(|x| x != v);
        p.set_resident(v, false);
    }
}

/// Missing files urgent only as a whole: 300 resident files ahead (the reader passes
/// them at its rate), then 300 missing ones, each taking the backing store longer than a
/// step takes the reader. The first missing file is 3 s away and takes 25 ms, but the
/// 300 take 7.5 s where the reader reaches the last in 6 s: prefetch starts now. Looking
/// at fewer missing files (as a fixed window did) finds none urgent.
#[test]
fn missing_files_urgent_as_a_whole_start_the_prefetch_now() {
    let mut p = Planner::new();
    let fs = files(600);
    p.register("j", fs.clone(), seq(0, vec![(0..600).collect()]))
        .unwrap();
    p.set_rate("j", 100.0);
    for f in &fs[..300] {
        p.set_resident(f, true);
    }
    let cache = SimCache {
        resident: fs[..300].to_vec(),
        capacity: 1000,
        check: false,
    };
    let pace = |max_ahead| prefetch::Pace {
        max_ahead,
        max_walk: 1000,
        secs_per_file: 0.025,
        margin: 0.0,
    };
    let fx = prefetch::next_prefetch(&mut p, &cache, pace(1000)).expect("urgent");
    assert_eq!(fx.file, fs[300]);
    // The k-th missing file is (299 + k) / 100 s away and needs 0.025 k s: urgent from
    // k = 200 on; over the first 199 the least slack is the 199th's.
    let (none, slack) = prefetch::next_prefetch_or_slack(&mut p, &cache, pace(199));
    assert!(none.is_none());
    assert!((slack - (2.99 - 0.015 * 199.0)).abs() < 1e-9, "{slack}");
    assert!(prefetch::next_prefetch(&mut p, &cache, pace(200)).is_some());
    // One walk, several decisions: the k-th missing file's slack is 2.99 - 0.015 k, and
    // when it is s <= 0 the first 1 + floor(-s / 0.025) are due. Over the first 210:
    // s = -0.16, seven due.
    let names = |v: &[(FileRef, Need)]| v.iter().map(|(f, _)| f.clone()).collect::<Vec<_>>();
    let (due, slack) = prefetch::urgent_missing(&mut p, &cache, pace(210), 100);
    assert_eq!((names(&due), slack), (fs[300..307].to_vec(), 0.0));
    // Asked for 16, the walk goes on until 16 are due (k = 225, s = -0.385).
    let (due, _) = prefetch::urgent_missing(&mut p, &cache, pace(1000), 16);
    assert_eq!(names(&due), fs[300..316].to_vec());
}

/// A cache of `capacity` files driven by the planner and the real prefetch and
/// admission decisions, reading the job's plan step by step, with at most `window`
/// files fetched ahead of the reader. Returns the files fetched in each epoch.
fn simulate(
    p: &mut Planner,
    job: &str,
    capacity: usize,
    window: usize,
    epochs: u64,
    check: bool,
) -> Vec<usize> {
    let mut cache = SimCache {
        resident: Vec::new(),
        capacity,
        check,
    };
    let mut ahead: Vec<FileRef> = Vec::new();
    let mut fetched = vec![0usize; epochs as usize];
    while let Some((e, s)) = p.position(job) {
        let ix = p
            .jobs
            .iter_mut()
            .find(|j| j.id == job)
            .and_then(|j| j.index(e));
        let Some(ix) = ix else { break };
        if s as usize >= ix.order.len() {
            break;
        }
        let slot = e as usize;
        while ahead.len() < window {
            let pace = prefetch::Pace {
                max_ahead: capacity + window + 1,
                max_walk: capacity + window + 1,
                secs_per_file: f64::INFINITY,
                margin: 0.0,
            };
            let Some(fx) = prefetch::next_prefetch(p, &cache, pace) else {
                break;
            };
            if let Some(v) = &fx.evict {
                cache.evict(p, v, check);
                ahead.retain(|x| x != v);
            }
            cache.resident.push(fx.file.clone());
            p.set_resident(&fx.file, true);
            ahead.push(fx.file);
            fetched[slot] += 1;
        }
        let f = p
            .jobs
            .iter()
            .find(|j| j.id == job)
            .map(|j| j.files[ix.order[s as usize] as usize].clone())
            .unwrap();
        ahead.retain(|x| *x != f);
        let hit = cache.resident.contains(&f);
        p.on_access(&f, 8);
        if hit {
            cache.resident.retain(|x| *x != f);
            cache.resident.push(f);
        } else {
            fetched[slot] += 1;
            let next = p.need(&f);
            match prefetch::admit_demand(p, &cache, &f, next) {
                prefetch::Admission::Keep(evict) => {
                    if let Some(v) = evict {
                        cache.evict(p, &v, check);
                        ahead.retain(|x| *x != v);
                    }
                    p.set_resident(&f, true);
                    cache.resident.push(f);
                }
                prefetch::Admission::Bypass => {}
            }
        }
        assert!(cache.resident.len() <= capacity, "over capacity");
        if p.position(job) == Some((e, s)) {
            break; // the last step of the last epoch
        }
    }
    fetched
}

#[test]
fn shuffled_epochs_reach_the_c_over_n_ceiling() {
    for window in [1, 4, 16, 64, 100] {
        ceiling_with_window(window);
    }
}

fn ceiling_with_window(window: usize) {
    // Whatever the prefetch window, after the first epoch the cache holds C/N of each
    // epoch's reads: the hit ratio is within 0.01 of its 0.5 ceiling (prefetch never
    // evicts a file still due in the epoch of the file it fetches).
    let n = 200;
    let c = 100;
    let mut p = Planner::new();
    let src = Source::Shuffle {
        seed: 7,
        first: 0,
        count: 4,
        world: 1,
        ranks: vec![0],
        drop_last: false,
    };
    p.register("j", files(n), src).unwrap();
    let fetched = simulate(&mut p, "j", c, window, 4, false);
    eprintln!("window {window}: fetched per epoch {fetched:?}");
    // Fetches count in the epoch they happen in: a few for epoch e+1 may happen at the
    // end of epoch e.
    assert!(
        (n..n + 4).contains(&fetched[0]),
        "the first epoch reads everything once: {fetched:?}"
    );
    for (e, f) in fetched.iter().enumerate().skip(1) {
        let hit = 1.0 - *f as f64 / n as f64;
        assert!(
            hit >= 0.49,
            "epoch {e}: hit ratio {hit} (fetched {f} of {n})"
        );
    }
}

fn plan_strategy() -> impl Strategy<Value = (usize, Vec<Vec<u32>>, usize, usize)> {
    (2usize..24).prop_flat_map(|n| {
        let epoch = proptest::collection::vec(0..n as u32, 1..3 * n);
        (
            Just(n),
            proptest::collection::vec(epoch, 1..4),
            1..n + 1,
            0usize..6,
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// For random plans and cache sizes, the planner-driven cache never evicts a file
    /// needed sooner than one it keeps, and never holds more than its capacity.
    #[test]
    fn never_evicts_a_file_needed_sooner_nor_exceeds_capacity((n, epochs, c, w) in plan_strategy()) {
        let mut p = Planner::new();
        let count = epochs.len() as u64;
        p.register("j", files(n), seq(0, epochs)).unwrap();
        simulate(&mut p, "j", c, w, count, true);
    }
}

fn shuffle_strategy() -> impl Strategy<Value = (usize, Source, usize, usize)> {
    (2usize..40, 1u64..5).prop_flat_map(|(n, world)| {
        (
            Just(n),
            (
                any::<u64>(),
                1u64..4,
                proptest::sample::subsequence((0..world).collect::<Vec<_>>(), 1..=world as usize),
                any::<bool>(),
            )
                .prop_map(move |(seed, count, ranks, drop_last)| Source::Shuffle {
                    seed,
                    first: 0,
                    count,
                    world,
                    ranks,
                    drop_last,
                }),
            1..n + 1,
            0usize..6,
        )
    })
}

/// Files, two jobs' sequence plans, positions and rates, and which files are cached.
type TwoJobs = (usize, Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<u64>, Vec<bool>);

/// Two jobs over overlapping files, at random positions and rates, and a random set of
/// cached files.
fn jobs_strategy() -> impl Strategy<Value = TwoJobs> {
    (3usize..20).prop_flat_map(|n| {
        let epoch = proptest::collection::vec(0..n as u32, 1..2 * n);
        (
            Just(n),
            proptest::collection::vec(epoch.clone(), 1..3),
            proptest::collection::vec(epoch, 1..3),
            proptest::collection::vec(0u64..40, 4),
            proptest::collection::vec(any::<bool>(), n),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// The same for shuffled plans (any world, ranks on this node, drop_last).
    #[test]
    fn shuffled_plans_never_evict_a_file_needed_sooner((n, source, c, w) in shuffle_strategy()) {
        let mut p = Planner::new();
        let count = match &source { Source::Shuffle { count, .. } => *count, _ => 1 };
        p.register("s", files(n), source).unwrap();
        simulate(&mut p, "s", c, w, count, true);
    }

    /// With several jobs (needs compared in seconds through their rates), the victim is
    /// never needed sooner than any other cached file.
    #[test]
    fn with_several_jobs_the_victim_is_needed_last((n, a, b, pos, cached) in jobs_strategy()) {
        let mut p = Planner::new();
        let fs = files(n);
        p.register("a", fs[..n - 1].to_vec(), seq(0, a.into_iter().map(|e| e.into_iter().map(|f| f % (n as u32 - 1)).collect()).collect())).unwrap();
        p.register("b", fs[1..].to_vec(), seq(0, b.into_iter().map(|e| e.into_iter().map(|f| f % (n as u32 - 1)).collect()).collect())).unwrap();
        // Positions outside a plan are refused; the rest are taken.
        let _ = p.set_position("a", pos[0] % 2, pos[1]);
        let _ = p.set_position("b", pos[2] % 2, pos[3]);
        p.set_rate("a", 1.0 + pos[0] as f64);
        p.set_rate("b", 1.0 + pos[3] as f64 / 3.0);
        let resident: Vec<FileRef> = fs.iter().zip(&cached).filter(|(_, c)| **c).map(|(f, _)| f.clone()).collect();
        prop_assume!(!resident.is_empty());
        let v = p.victim(&resident).unwrap();
        let nv = p.need(&resident[v]);
        for f in &resident {
            prop_assert!(!p.need(f).later_than(nv), "{f:?} is needed later than the victim");
        }
        // The eviction index agrees (here every job's candidates cover its files).
        for f in &resident {
            p.set_resident(f, true);
        }
        let indexed = p.victim_indexed(&|_| true).unwrap();
        prop_assert_eq!(p.need(&indexed), nv);
        // Several from one look: the same first, then farthest first, each once.
        let several = p.victims_indexed_with(&|_, _| true, 8);
        prop_assert_eq!(p.need(&several[0]), nv);
        prop_assert_eq!(several.len(), resident.len().min(8));
        for w in several.windows(2) {
            prop_assert!(!p.need(&w[1]).later_than(p.need(&w[0])), "farthest first");
            prop_assert!(w[0] != w[1]);
        }
        for f in &several {
            prop_assert!(resident.contains(f));
        }
    }
}

fn shuffle_of(world: u64, ranks: Vec<u64>, epochs: u64) -> Source {
    Source::Shuffle {
        seed: 7,
        first: 0,
        count: epochs,
        world,
        ranks,
        drop_last: false,
    }
}

/// The file another rank reads at per-rank step `k` of `epoch` (world order).
fn read_by(n: usize, epoch: u64, world: u64, rank: u64, k: usize) -> usize {
    shuffle::rank_order(n as u64, 7, epoch, world, rank, false)[k] as usize
}

/// The files rank 0 (this node's) reads in epochs 0 and 1.
fn read_by_rank_0(n: usize, world: u64) -> std::collections::HashSet<usize> {
    (0..2)
        .flat_map(|e| shuffle::rank_order(n as u64, 7, e, world, 0, false))
        .map(|f| f as usize)
        .collect()
}

#[test]
fn cluster_mode_keeps_what_other_ranks_read_next_until_they_took_it() {
    let (n, world) = (40usize, 4u64);
    let fs = files(n);
    let mut p = Planner::new();
    p.register("j", fs.clone(), shuffle_of(world, vec![0], 3))
        .unwrap();
    // Rank 2 reads `soon` at its first step of epoch 1; `late` is read by nobody but
    // rank 2, at its last step of epoch 1 (and this node's rank 0 reads neither in
    // epoch 0 or 1 — pick such files).
    let mine = read_by_rank_0(n, world);
    let soon = read_by(n, 1, world, 2, 0);
    let late = read_by(n, 1, world, 2, 9);
    if mine.contains(&soon) || mine.contains(&late) {
        return; // (the seed makes this case not arise; keep the test honest if it does)
    }
    // Without cluster mode, this node does not need either before epoch 2's reads.
    p.set_resident(&fs[soon], true);
    p.set_resident(&fs[late], true);
    let before = (p.need(&fs[soon]), p.need(&fs[late]));
    p.set_cluster(true);
    let (ns, nl) = (p.need(&fs[soon]), p.need(&fs[late]));
    assert!(nl.later_than(ns), "{ns:?} {nl:?}");
    assert!(
        before.0.later_than(ns),
        "another rank's read counts: {before:?} → {ns:?}"
    );
    // Among the two, the one another node reads last goes first.
    let v = p.victim_indexed(&|_| true).unwrap();
    assert_eq!(v, fs[late]);
    // Once another node fetched `soon` to keep it, this copy matters no more than the
    // farther one.
    p.set_handed(&fs[soon]);
    assert!(p.need(&fs[soon]).later_than(ns));
    // Who holds a file: the rank that read it last, or the next to read it.
    let h = p.holders(&fs[soon]);
    assert!(h.contains(&("j".to_owned(), 2)), "{h:?}");
}

/// Other ranks' reads re-key this node's resident copies (their next use moves on),
/// but not in the open that passes them (M × R world positions a round): in
/// `sync_placements`, as the placement follows.
#[test]
fn other_ranks_reads_rekey_resident_files_off_the_open_path() {
    let (n, world) = (40usize, 4u64);
    let fs = files(n);
    let mut p = Planner::new();
    p.set_cluster(true);
    p.register("j", fs.clone(), shuffle_of(world, vec![0], 3))
        .unwrap();
    let mine = read_by_rank_0(n, world);
    // Rank 2 reads `g` at its third step of epoch 0; this node's rank 0 never does.
    let g = read_by(n, 0, world, 2, 2);
    if mine.contains(&g) {
        return; // (the seed makes this case not arise; keep the test honest if it does)
    }
    p.set_resident(&fs[g], true);
    let key = |p: &Planner| p.jobs[0].rank_of[&(g as u32)];
    let k0 = key(&p);
    for &f in &shuffle::rank_order(n as u64, 7, 0, world, 0, false)[..5] {
        p.on_access(&fs[f as usize], READ_WINDOW);
    }
    assert_eq!(p.jobs[0].step, 5);
    assert_eq!(
        key(&p),
        k0,
        "the opens re-keyed nothing for other ranks' reads"
    );
    assert!(p.sync_placements(u64::MAX));
    assert!(
        key(&p) > 5,
        "next used after rank 2's read: {} -> {}",
        k0,
        key(&p)
    );
}

#[test]
fn plan_owners_are_balanced_and_shared_by_every_node() {
    let fs = files(101);
    let members: Vec<String> = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
    let id = |f: &FileRef| f.path.as_bytes().to_vec();
    let owners = |ranks: Vec<u64>| {
        let mut p = Planner::new();
        p.register("j", fs.clone(), shuffle_of(3, ranks, 2))
            .unwrap();
        fs.iter()
            .map(|f| p.plan_owner(f, &members, &id).unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let here = owners(vec![0]);
    assert_eq!(here, owners(vec![2]), "every node computes the same owners");
    for m in &members {
        let c = here.iter().filter(|o| *o == m).count();
        assert!((33..=34).contains(&c), "{m} owns {c}");
    }
    let mut p = Planner::new();
    p.register("s", fs.clone(), seq(0, vec![vec![0, 1]]))
        .unwrap();
    assert_eq!(p.plan_owner(&fs[0], &members, &id), None, "not a shuffle");
}

/// `n` files, a planner registered for rank 0 of a 2-rank shuffle of 3 epochs (seed 7),
/// and the layout of two nodes ("a" runs rank 0, "b" rank 1) of `n / 2` files each.
fn rank_0_of_two_nodes(n: usize) -> (Vec<FileRef>, Planner, placement::Layout) {
    let fs = files(n);
    let layout = placement::Layout {
        nodes: vec!["a".into(), "b".into()],
        node_of_rank: vec![Some(0), Some(1)],
        slots: vec![n as u64 / 2; 2],
        bytes: false,
    };
    let mut p = Planner::new();
    p.register("j", fs.clone(), shuffle_of(2, vec![0], 3))
        .unwrap();
    (fs, p, layout)
}

#[test]
fn a_cluster_placement_protects_what_it_puts_here_and_says_where_the_rest_is() {
    let (n, world) = (40usize, 2u64);
    let (fs, mut p, layout) = rank_0_of_two_nodes(n);
    assert_eq!(p.protects(&fs[0]), None, "no placement yet");
    assert_eq!(p.sources(&fs[0]), None);
    p.set_layout("j", Some(layout.clone()), "a");
    assert_eq!(p.layout("j"), Some(&layout));
    // Every file this node reads within the lookahead is moved here first.
    let (moved, claimed) = p.incoming(usize::MAX);
    assert!(claimed.is_empty());
    let first = shuffle::rank_order(n as u64, 7, 0, world, 0, false)[0] as usize;
    assert_eq!(moved[0], fs[first], "this node's first read comes first");
    assert!(p.is_mine(&fs[first]));
    assert_eq!(p.protects(&fs[first]), Some(true));
    // From the backing store: no node held it before.
    assert_eq!(p.sources(&fs[first]), Some(Vec::new()));
    // The other node's first read is placed there: fetched from there, not kept here.
    let theirs = shuffle::rank_order(n as u64, 7, 0, world, 1, false)[0] as usize;
    assert!(!p.is_mine(&fs[theirs]));
    assert_eq!(p.sources(&fs[theirs]), Some(vec!["b".to_owned()]));
    p.set_resident(&fs[theirs], true);
    assert_eq!(p.protects(&fs[theirs]), Some(false), "a local copy");
    // Reading through the plan keeps the placement ahead of the position: once this
    // node's copies are moved away, they are kept until taken.
    let order: Vec<usize> = (0..2)
        .flat_map(|e| shuffle::rank_order(n as u64, 7, e, world, 0, false))
        .map(|f| f as usize)
        .collect();
    for &f in &order {
        p.set_resident(&fs[f], true);
        p.on_access(&fs[f], 1);
        assert!(
            p.sync_placements(u64::MAX),
            "one call brings it to the position"
        );
    }
    let kept: Vec<usize> = (0..n)
        .filter(|&f| !p.is_mine(&fs[f]) && p.protects(&fs[f]) == Some(true))
        .collect();
    for &f in &kept {
        p.set_handed(&fs[f]);
        assert_eq!(p.protects(&fs[f]), Some(false), "file {f} taken: not kept");
    }
    // A new layout starts over; none clears the placement.
    p.set_layout("j", None, "a");
    assert_eq!(p.protects(&fs[first]), None);
}

/// A copy that lands after the simulation moved its file on from this node (the
/// simulation runs ahead of the fetches: under load this node's fetch of a file placed
/// here may land after the placement already gave the file to the node reading it next)
/// is the copy the new holder will take: it is kept for it, not made a local copy that
/// the store may drop before the new holder asked. Before, its arrival discharged the
/// debt: `peers::spread_sizes_given_in_the_manifest_are_placed_in_bytes_at_the_floor`
/// under load saw a node evict such a copy 1 ms before the new holder's fetch, which
/// then read the backing store (0.014 of the dataset in an epoch after the first).
#[test]
fn a_copy_landing_after_the_placement_moved_its_file_on_is_kept_for_the_new_holder() {
    let (n, world) = (40usize, 2u64);
    let (fs, mut p, layout) = rank_0_of_two_nodes(n);
    p.set_layout("j", Some(layout), "a");
    // The readers go through an epoch and a half; none of this node's copies has landed.
    let order: Vec<usize> = (0..2)
        .flat_map(|e| shuffle::rank_order(n as u64, 7, e, world, 0, false))
        .map(|f| f as usize)
        .take(n / 2 + n / 4)
        .collect();
    for &f in &order {
        p.on_access(&fs[f], 1);
        assert!(p.sync_placements(u64::MAX));
    }
    let owed: Vec<usize> = (0..n)
        .filter(|&f| !p.is_mine(&fs[f]) && p.protects(&fs[f]) == Some(true))
        .collect();
    assert!(!owed.is_empty(), "some files were moved on from this node");
    for &f in &owed {
        p.set_resident(&fs[f], true);
        assert_eq!(
            p.protects(&fs[f]),
            Some(true),
            "file {f}: kept for its new holder"
        );
    }
    // Taken by the new holder: a local copy from then on.
    for &f in &owed {
        p.set_handed(&fs[f]);
        assert_eq!(p.protects(&fs[f]), Some(false), "file {f} taken");
    }
    assert!(
        p.departing().iter().all(|(_, n)| *n == 0),
        "nothing kept for others"
    );
    // And the placement owes the new holder nothing more: the copies it keeps for new
    // holders count against their share of the node's slots (`Placement::owed_rounds`)
    // only until taken.
    let pl = p.jobs[0].placement.as_ref().unwrap();
    for &f in &owed {
        assert!(!pl.is_owed(f as u32), "file {f}: taken, owed nothing");
    }
}

/// A node whose copies all stay resident reads through `epochs` epochs of
/// [`rank_0_of_two_nodes`]'s shuffle, the two nodes with `slots` each; after each read,
/// the other node takes every copy the placement owes it (`set_handed`). `check` sees
/// the planner before each taking.
fn read_and_hand_over(
    n: usize,
    slots: [u64; 2],
    epochs: u64,
    mut check: impl FnMut(&Planner, &[FileRef], u64),
) -> (Vec<FileRef>, Planner, placement::Layout) {
    let (fs, mut p, layout) = rank_0_of_two_nodes(n);
    let layout = placement::Layout {
        slots: slots.to_vec(),
        ..layout
    };
    p.set_layout("j", Some(layout.clone()), "a");
    for f in &fs {
        p.set_resident(f, true);
    }
    let order: Vec<usize> = (0..epochs)
        .flat_map(|e| shuffle::rank_order(n as u64, 7, e, 2, 0, false))
        .map(|f| f as usize)
        .collect();
    for (k, &f) in order.iter().enumerate() {
        p.on_access(&fs[f], 1);
        assert!(p.sync_placements(u64::MAX));
        // The prefetcher's look: copies moved here that are here already are claimed.
        let _ = p.incoming(usize::MAX);
        check(&p, &fs, k as u64);
        let owed: Vec<usize> = {
            let pl = p.jobs[0].placement.as_ref().unwrap();
            (0..n).filter(|&i| pl.is_owed(i as u32)).collect()
        };
        for i in owed {
            p.set_handed(&fs[i]);
        }
    }
    (fs, p, layout)
}

/// A copy the other node took, then moved back here (claimed: this node's copy is the
/// cluster's again), then moved away again is owed to its new holder like any other:
/// the earlier taking says nothing of the new debt. Before, the handoff stayed recorded
/// while the copy was resident, and the copy was left unprotected (its new holder could
/// find it evicted and read the backing store). The other node has a quarter of the
/// room: copies it has no room for are parked here, without a read here (which would
/// have cleared the record).
#[test]
fn a_copy_taken_moved_back_and_moved_away_again_is_kept_for_its_new_holder() {
    let mut debts = 0;
    read_and_hand_over(40, [30, 10], 5, |p, fs, k| {
        let pl = p.jobs[0].placement.as_ref().unwrap();
        for (i, f) in fs.iter().enumerate() {
            if pl.is_owed(i as u32) {
                debts += 1;
                assert_eq!(
                    p.protects(f),
                    Some(true),
                    "read {k}: file {i} is owed to its new holder but not kept"
                );
            }
        }
    });
    assert!(debts > 0, "the placement moved copies away");
}

/// A placement started over (a new layout, or the job's position moved back) replays
/// the plan, and the replay moves away from this node again the copies other nodes
/// have taken already: it owes them nothing (they will not take them again) and they
/// do not count against the share of its slots kept for new holders.
#[test]
fn a_placement_started_over_owes_nothing_for_copies_already_taken() {
    let n = 40;
    let (_, mut p, layout) = read_and_hand_over(n, [20, 20], 3, |_, _, _| {});
    assert!(!p.jobs[0].handed.is_empty(), "the other node took copies");
    let wider = placement::Layout {
        slots: vec![n as u64 / 2 + 1; 2],
        ..layout
    };
    p.set_layout("j", Some(wider), "a");
    let job = &p.jobs[0];
    let pl = job.placement.as_ref().unwrap();
    assert!(
        pl.placed() > 0,
        "the new placement was brought to the position"
    );
    for &i in &job.handed {
        assert!(
            !pl.is_owed(i),
            "file {i}: taken before the replay, owed again"
        );
    }
    // The job's position moving back starts the placement over too.
    p.set_position("j", 0, 0).unwrap();
    assert!(p.sync_placements(u64::MAX));
    let job = &p.jobs[0];
    let pl = job.placement.as_ref().unwrap();
    for &i in &job.handed {
        assert!(
            !pl.is_owed(i),
            "file {i}: taken before the restart, owed again"
        );
    }
}

/// An open never runs the simulation of the cluster's reads (M simulated reads per
/// round of this node's ranks: 11.7 ms per open at 1 024 nodes and 1.28 M files,
/// `shardcache-bench placement-scale`): a read moves the job's position only, and
/// `sync_placements` brings the placement after it, a bounded chunk per call.
#[test]
fn a_read_moves_the_position_and_the_placement_follows_in_chunks() {
    let (n, world) = (4_000usize, 8u64);
    let fs = files(n);
    let layout = placement::Layout {
        nodes: vec!["a".into(), "b".into(), "c".into(), "d".into()],
        node_of_rank: (0..world).map(|r| Some((r / 2) as u16)).collect(),
        slots: vec![1_000; 4],
        bytes: false,
    };
    let mut p = Planner::new();
    p.register("j", fs.clone(), shuffle_of(world, vec![0, 1], 3))
        .unwrap();
    p.set_layout("j", Some(layout), "a");
    let placed = |p: &Planner| p.jobs[0].placement.as_ref().map(|x| x.placed());
    let lookahead = p.jobs[0].placement.as_ref().unwrap().lookahead();
    assert_eq!(
        placed(&p),
        Some(lookahead),
        "a new layout starts at the position"
    );
    let order = shuffle::node_order(n as u64, 7, 0, world, &[0, 1], false);
    for &f in &order[..400] {
        p.on_access(&fs[f as usize], READ_WINDOW);
    }
    // 400 reads of this node's two ranks: 200 rounds, none simulated by the reads.
    assert_eq!(p.jobs[0].round(), 200);
    assert_eq!(placed(&p), Some(lookahead));
    // At most one round (8 simulated reads) per call here: 200 calls to catch up.
    let mut calls = 0;
    while !p.sync_placements(world) {
        calls += 1;
        assert!(calls <= 1_000, "the placement never caught up");
    }
    assert_eq!(calls, 199);
    assert_eq!(placed(&p), Some(200 + lookahead));
    // A position report moves the position alone too.
    p.set_position("j", 1, 0).unwrap();
    assert_eq!(placed(&p), Some(200 + lookahead));
    assert!(p.sync_placements(u64::MAX));
    assert_eq!(placed(&p), Some(500 + lookahead));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Issue 14: DataLoader workers read out of order and far ahead of the slowest; the
    /// job's position (its low watermark) is always the first position not read yet —
    /// never more than the loader's in-flight window behind the fastest read — over
    /// three epochs, every read is recorded (and attributed to the job), and what the
    /// planner lists as upcoming never holds a file already read this epoch.
    #[test]
    fn the_position_follows_dataloader_workers(
        workers in 1usize..9,
        batch in prop::sample::select(vec![16usize, 64, 256]),
        prefetch in 1usize..4,
        seed in any::<u64>(),
    ) {
        let n = 3000usize;
        let epochs = 3u64;
        let fs = files(n);
        let mut p = Planner::new();
        let source = Source::Shuffle {
            seed: 5,
            first: 0,
            count: epochs,
            world: 1,
            ranks: vec![0],
            drop_last: false,
        };
        p.register("j", fs.clone(), source).unwrap();
        let mut pick = shardcache_plan::loader::uneven(seed);
        let window = (workers * prefetch * batch) as u64;
        for e in 0..epochs {
            let order = shuffle::rank_order(n as u64, 5, e, 1, 0, false);
            let reads = shardcache_plan::loader::read_order(n, batch, workers, prefetch, &mut pick);
            let mut read = vec![false; n];
            let (mut low, mut hi) = (0usize, 0usize);
            for (i, &pos) in reads.iter().enumerate() {
                let f = &fs[order[pos] as usize];
                prop_assert_eq!(p.on_access(f, READ_WINDOW), Some("j"));
                read[pos] = true;
                hi = hi.max(pos + 1);
                while low < n && read[low] {
                    low += 1;
                }
                if low == n {
                    prop_assert_eq!(p.position("j"), Some(((e + 1).min(epochs - 1), if e + 1 < epochs { 0 } else { n as u64 })));
                } else {
                    prop_assert_eq!(p.position("j"), Some((e, low as u64)), "after read {}", i);
                    prop_assert!(hi - low <= window as usize, "within the in-flight window");
                }
                if i % 97 == 0 && low < n {
                    // This epoch's files not read yet, in order, then the next epoch's.
                    let want: Vec<FileRef> = (low..n)
                        .filter(|&q| !read[q])
                        .take(256)
                        .map(|q| fs[order[q] as usize].clone())
                        .collect();
                    let up = p.upcoming_of("j", 256);
                    prop_assert_eq!(&up[..want.len()], &want[..]);
                }
            }
        }
        prop_assert_eq!(p.reads(), epochs * n as u64, "every read counted once");
    }
}

/// Reads never reported (a reader that died, a read that went around the cache) leave
/// holes: once more than `MAX_READ_AHEAD` reads are recorded ahead of one, the
/// watermark moves over it, and the job goes on into its next epoch.
#[test]
fn holes_in_the_reads_are_passed_once_enough_reads_are_ahead_of_them() {
    let n = 3 * MAX_READ_AHEAD;
    let fs = files(n);
    let mut p = Planner::new();
    p.register(
        "j",
        fs.clone(),
        seq(0, vec![(0..n as u32).collect(), (0..n as u32).collect()]),
    )
    .unwrap();
    // Position 0 is never read; every other one is.
    for f in &fs[1..=MAX_READ_AHEAD] {
        p.on_access(f, READ_WINDOW);
    }
    assert_eq!(
        p.position("j"),
        Some((0, 0)),
        "a hole, within the allowance"
    );
    p.on_access(&fs[MAX_READ_AHEAD + 1], READ_WINDOW);
    assert_eq!(
        p.position("j"),
        Some((0, MAX_READ_AHEAD as u64 + 2)),
        "past the allowance: the hole is passed, and every read after it"
    );
    for f in &fs[MAX_READ_AHEAD + 2..n - 1] {
        p.on_access(f, READ_WINDOW);
    }
    // The last file of epoch 0 is never read either: reads of epoch 1 end epoch 0.
    p.on_access(&fs[0], READ_WINDOW);
    assert_eq!(
        p.position("j"),
        Some((1, 1)),
        "epoch 0 ended by a read of epoch 1"
    );
    assert_eq!(p.reads(), n as u64 + 1, "holes counted as passed");
}

/// Issue 14: a position reported behind the reads of the epoch the job reads (a rank of a
/// node plan calling `set_epoch` after another rank began the epoch) moves nothing back
/// and forgets no read; one ahead moves it forward over the reads recorded after it; one
/// in another epoch sets it.
#[test]
fn a_report_behind_the_reads_moves_nothing_back() {
    let mut p = Planner::new();
    let fs = files(10);
    p.register(
        "j",
        fs.clone(),
        seq(0, vec![(0..10).collect(), (0..10).collect()]),
    )
    .unwrap();
    for f in [&fs[0], &fs[1], &fs[3]] {
        p.on_access(f, READ_WINDOW);
    }
    assert_eq!(p.position("j"), Some((0, 2)));
    assert_eq!(p.set_position("j", 0, 0), Ok(true));
    assert_eq!(p.position("j"), Some((0, 2)), "not moved back");
    p.on_access(&fs[2], READ_WINDOW);
    assert_eq!(p.position("j"), Some((0, 4)), "the read of 3 was kept");
    assert_eq!(p.set_position("j", 0, 6), Ok(true));
    assert_eq!(p.position("j"), Some((0, 6)));
    assert_eq!(p.set_position("j", 1, 0), Ok(true));
    assert_eq!(p.position("j"), Some((1, 0)));
    assert_eq!(p.set_position("j", 0, 5), Ok(true));
    assert_eq!(p.position("j"), Some((0, 5)), "another epoch: set as told");
}

/// The readers' spread (how far the fastest read ran past the watermark) is learned again
/// every epoch: one stray read far ahead does not inflate it for the rest of the job.
#[test]
fn the_readers_spread_is_learned_again_each_epoch() {
    let n = 64;
    let mut p = Planner::new();
    let fs = files(n);
    let all: Vec<u32> = (0..n as u32).collect();
    p.register("j", fs.clone(), seq(0, vec![all.clone(), all.clone(), all]))
        .unwrap();
    let spread = |p: &Planner| p.jobs[0].spread;
    p.on_access(&fs[40], READ_WINDOW);
    assert_eq!(spread(&p), 41);
    for (i, f) in fs.iter().enumerate().filter(|(i, _)| *i != 40) {
        assert_eq!(p.on_access(f, READ_WINDOW), Some("j"), "read {i}");
    }
    assert_eq!(p.position("j"), Some((1, 0)));
    assert_eq!(spread(&p), 41, "the last epoch's widest, for this one");
    // Epoch 1 read in order, two apart at most.
    for k in (0..n).step_by(2) {
        p.on_access(&fs[k + 1], READ_WINDOW);
        p.on_access(&fs[k], READ_WINDOW);
    }
    assert_eq!(p.position("j"), Some((2, 0)));
    assert_eq!(spread(&p), 2, "the stray read is forgotten");
}

proptest! {
    /// An epoch's index answers what a scan of its order answers, files listed any
    /// number of times (a shuffle's padding, an explicit order) or not at all.
    #[test]
    fn an_epoch_index_answers_as_a_scan_of_its_order(
        order in proptest::collection::vec(0u32..12, 0..60),
        f in 0u32..12,
        at in 0u64..64,
    ) {
        let ix = EpochIndex::new(Arc::new(order.clone()), 12);
        let all: Vec<u64> = order
            .iter()
            .enumerate()
            .filter(|&(_, &g)| g == f)
            .map(|(p, _)| p as u64)
            .collect();
        prop_assert_eq!(ix.next(f, at), all.iter().copied().find(|&p| p >= at));
        prop_assert_eq!(ix.prev(f, at), all.iter().copied().rev().find(|&p| p < at));
        prop_assert_eq!(
            ix.from(f, at).collect::<Vec<_>>(),
            all.iter().copied().filter(|&p| p >= at).collect::<Vec<_>>()
        );
    }
}
