//! A discrete-event simulation of one node's cache under a shuffled multi-epoch plan,
//! driving the daemon's real planner and prefetch/admission decisions
//! (`shardcache_daemon::planner`), next to a demand-fetching LRU cache.
//!
//! Time is simulated (no clock, no noise): the backing store delivers `b` files per
//! second one after another (its bandwidth), the consumer reads `r` files per second
//! when the file it needs is cached and waits otherwise.

use shardcache_daemon::planner::prefetch::{self, Admission, CacheView};
use shardcache_daemon::planner::{FileRef, Planner, Source};

/// Steady-state figures of one run (epochs after the first, averaged).
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    /// Fraction of reads served by files cached before their epoch began.
    pub hit_rate: f64,
    /// Fraction of the time the consumer waited for data.
    pub stall: f64,
    /// Files fetched from the backing store for an epoch, ÷ files read in it.
    pub backing_per_epoch: f64,
}

struct Cache {
    resident: Vec<FileRef>,
    capacity: usize,
    in_flight: Option<FileRef>,
}

impl CacheView for Cache {
    fn is_resident(&self, _: &Planner, f: &FileRef) -> bool {
        self.resident.contains(f)
    }
    fn victim(&self, p: &mut Planner) -> Option<FileRef> {
        p.victim(&self.resident).map(|i| self.resident[i].clone())
    }
    fn in_flight(&self, f: &FileRef) -> bool {
        self.in_flight.as_ref() == Some(f)
    }
    fn has_room(&self, _: &FileRef) -> bool {
        self.resident.len() + usize::from(self.in_flight.is_some()) < self.capacity
    }
}

fn file(i: u32) -> FileRef {
    FileRef {
        root: 0,
        path: format!("f{i}").into(),
    }
}

/// The planned cache: `n` files, room for `c`, consumer `r` and backing `b` files/s,
/// at most `window` files fetched ahead of the reader.
pub fn planned(
    n: usize,
    c: usize,
    r: f64,
    b: f64,
    epochs: u64,
    seed: u64,
    window: usize,
) -> Outcome {
    planned_with(n, c, r, b, epochs, seed, window, None)
}

/// How a PyTorch DataLoader reads: files per batch, workers, batches each worker runs
/// ahead (`prefetch_factor`), and the seed of their uneven per-file times.
#[derive(Debug, Clone, Copy)]
pub struct Loader {
    /// Files per batch.
    pub batch: usize,
    /// Worker processes.
    pub workers: usize,
    /// Batches each worker reads ahead of the loop.
    pub prefetch: usize,
    /// Seed of the workers' uneven timing.
    pub seed: u64,
}

/// [`planned`], the files of each epoch read in the order `loader`'s workers read them
/// (one read at a time at the consumer's rate: the workers together read `r` files per
/// second), when given; else in plan order.
#[allow(clippy::too_many_arguments)]
pub fn planned_with(
    n: usize,
    c: usize,
    r: f64,
    b: f64,
    epochs: u64,
    seed: u64,
    window: usize,
    loader: Option<Loader>,
) -> Outcome {
    let mut p = Planner::new();
    let src = Source::Shuffle {
        seed,
        first: 0,
        count: epochs,
        world: 1,
        ranks: vec![0],
        drop_last: false,
    };
    p.register("job", (0..n as u32).map(file).collect(), src)
        .expect("valid plan");
    p.set_rate("job", r);
    let orders: Vec<Vec<u32>> = (0..epochs)
        .map(|e| {
            let plan: Vec<u32> =
                shardcache_plan::shuffle::node_order(n as u64, seed, e, 1, &[0], false)
                    .into_iter()
                    .map(|x| x as u32)
                    .collect();
            match loader {
                None => plan,
                Some(l) => shardcache_plan::loader::read_order(
                    n,
                    l.batch,
                    l.workers,
                    l.prefetch,
                    shardcache_plan::loader::uneven(l.seed ^ e),
                )
                .into_iter()
                .map(|pos| plan[pos])
                .collect(),
            }
        })
        .collect();
    let mut cache = Cache {
        resident: Vec::new(),
        capacity: c,
        in_flight: None,
    };
    let mut ahead: Vec<FileRef> = Vec::new();
    let mut fetched = vec![0usize; epochs as usize];
    let mut stall = vec![0f64; epochs as usize];
    let mut span = vec![(f64::NAN, 0f64); epochs as usize];
    let mut t = 0.0;
    // The fetch under way: (file, done at, for a waiting reader).
    let mut fetch: Option<(FileRef, f64, bool)> = None;
    for (e, order) in orders.iter().enumerate() {
        for &i in order {
            let want = file(i);
            if span[e].0.is_nan() {
                span[e].0 = t;
            }
            // Wait until `want` is cached, keeping the backing store busy meanwhile.
            let mut demand = false;
            loop {
                if cache.resident.contains(&want) {
                    break;
                }
                if fetch.is_none() {
                    if cache.in_flight(&want) {
                        unreachable!("in flight implies a fetch");
                    }
                    // A demand fetch for the waiting reader.
                    fetch = Some((want.clone(), t + 1.0 / b, true));
                    cache.in_flight = Some(want.clone());
                    fetched[e] += 1;
                }
                let (f, done, is_demand) = fetch.take().expect("a fetch is under way");
                stall[e] += done - t;
                t = done;
                cache.in_flight = None;
                if f == want && is_demand {
                    demand = true;
                    break;
                }
                ahead.push(f.clone());
                cache.resident.push(f);
                if let Some(next) = start_prefetch(
                    &mut p,
                    &mut cache,
                    &mut ahead,
                    &mut fetched,
                    window,
                    t,
                    b,
                    e,
                ) {
                    fetch = Some(next);
                }
            }
            // Read it (the backing store keeps working while the reader does).
            let read_done = t + 1.0 / r;
            loop {
                if fetch.is_none() {
                    fetch = start_prefetch(
                        &mut p,
                        &mut cache,
                        &mut ahead,
                        &mut fetched,
                        window,
                        t,
                        b,
                        e,
                    );
                }
                match &fetch {
                    Some((_, done, _)) if *done <= read_done => {
                        let (f, done, _) = fetch.take().expect("checked");
                        t = done;
                        cache.in_flight = None;
                        ahead.push(f.clone());
                        cache.resident.push(f);
                    }
                    _ => break,
                }
            }
            t = read_done;
            span[e].1 = t;
            ahead.retain(|x| *x != want);
            p.on_access(&want, shardcache_daemon::planner::READ_WINDOW);
            if demand {
                let next = p.need(&want);
                match prefetch::admit_demand(&mut p, &cache, &want, next) {
                    Admission::Keep(evict) => {
                        if let Some(v) = evict {
                            cache.resident.retain(|x| *x != v);
                            ahead.retain(|x| *x != v);
                        }
                        cache.resident.push(want);
                    }
                    Admission::Bypass => {}
                }
            } else {
                cache.resident.retain(|x| *x != want);
                cache.resident.push(want);
            }
        }
    }
    summarize(n, &fetched, &stall, &span)
}

#[allow(clippy::too_many_arguments)]
fn start_prefetch(
    p: &mut Planner,
    cache: &mut Cache,
    ahead: &mut Vec<FileRef>,
    fetched: &mut [usize],
    window: usize,
    t: f64,
    b: f64,
    epoch: usize,
) -> Option<(FileRef, f64, bool)> {
    if ahead.len() >= window {
        return None;
    }
    // Prefetch only when some upcoming deadline needs the backing store now.
    let pace = prefetch::Pace {
        max_ahead: cache.capacity + window + 1,
        max_walk: cache.capacity + window + 1,
        secs_per_file: 1.0 / b,
        margin: 2.0 / b,
    };
    let fx = prefetch::next_prefetch(p, cache, pace)?;
    if let Some(v) = &fx.evict {
        cache.resident.retain(|x| x != v);
        ahead.retain(|x| x != v);
    }
    // Count the fetch in the epoch that reads the file.
    let use_epoch = p
        .use_epoch(&fx.file)
        .map_or(epoch, |e| e as usize)
        .min(fetched.len() - 1);
    fetched[use_epoch] += 1;
    cache.in_flight = Some(fx.file.clone());
    Some((fx.file, t + 1.0 / b, false))
}

/// The LRU baseline: fetch on demand, evict the least recently used.
pub fn lru(n: usize, c: usize, r: f64, b: f64, epochs: u64, seed: u64) -> Outcome {
    let mut resident: Vec<u32> = Vec::new();
    let mut fetched = vec![0usize; epochs as usize];
    let mut stall = vec![0f64; epochs as usize];
    let mut span = vec![(f64::NAN, 0f64); epochs as usize];
    let mut t = 0.0;
    for e in 0..epochs {
        let order = shardcache_plan::shuffle::node_order(n as u64, seed, e, 1, &[0], false);
        let e = e as usize;
        span[e].0 = t;
        for i in order {
            let i = i as u32;
            if let Some(k) = resident.iter().position(|x| *x == i) {
                resident.remove(k);
            } else {
                fetched[e] += 1;
                stall[e] += 1.0 / b;
                t += 1.0 / b;
                if resident.len() >= c {
                    resident.remove(0);
                }
            }
            resident.push(i);
            t += 1.0 / r;
        }
        span[e].1 = t;
    }
    summarize(n, &fetched, &stall, &span)
}

fn summarize(n: usize, fetched: &[usize], stall: &[f64], span: &[(f64, f64)]) -> Outcome {
    let steady: Vec<usize> = (1..fetched.len()).collect();
    let k = steady.len().max(1) as f64;
    let backing = steady
        .iter()
        .map(|&e| fetched[e] as f64 / n as f64)
        .sum::<f64>()
        / k;
    let stall = steady
        .iter()
        .map(|&e| stall[e] / (span[e].1 - span[e].0))
        .sum::<f64>()
        / k;
    Outcome {
        hit_rate: 1.0 - backing,
        stall,
        backing_per_epoch: backing,
    }
}

/// The least possible stall fraction with the backing store always busy.
pub fn stall_floor(cn: f64, r: f64, b: f64) -> f64 {
    (1.0 - b / (r * (1.0 - cn))).max(0.0)
}
