//! `shardcache-bench placement-scale`: what the cluster placement costs one node as the
//! cluster and the dataset grow (issue 15: 1 024 nodes, 10 M files).
//!
//! Every node runs the same deterministic simulation of the whole cluster's reads
//! (`planner::placement`), so one node is measured: the real `Planner` with a
//! shuffle of N files registered for node 0's R ranks of a world of M × R, the layout of
//! M nodes (a × N ÷ M files each, counted in files) set as the daemon sets it, then node
//! 0's own opens fed to `Planner::on_access` in its real order, epoch by epoch, as the
//! daemon does for each open, and the placement brought after them
//! (`Planner::sync_placements`, as the daemon's prefetcher does, woken by reads) after each round of its R opens. No
//! sockets, no store. It reports the CPU of each apart: what an open holds the planner
//! lock for, and what the simulation of the cluster's reads costs the node per epoch.
//!
//! Each cell (M, N) runs in a child process (this program again, with `--one`), so that
//! its memory is its own: the planner's bytes per file are the growth of the process's
//! resident set while the job is registered and placed, over N.
//!
//! Per cell: the simulation's CPU per epoch (the cold epoch, the first warm one, then a
//! steady one) on node 0, the planner's µs per open (the two warm epochs), the
//! placement's simulated reads over the two warm epochs (local, backing ÷ the dataset per
//! epoch, copies moved per read, and the moves per read of each: the first warm epoch
//! moves about twice what the next does, since its swaps send their victims to their
//! readers of the epoch after) and the planner's bytes per file.

use std::time::Instant;

use shardcache_daemon::planner::cluster::Scheme;
use shardcache_daemon::planner::placement::{self, Layout};
use shardcache_daemon::planner::{FileRef, PLACEMENT_CHUNK_READS, Planner, READ_WINDOW, Source};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Args {
    /// Nodes (M), one row each.
    pub nodes: Vec<u64>,
    /// Files (N), one column group each.
    pub files: Vec<u64>,
    /// Ranks per node (R).
    pub ranks_per_node: u64,
    /// Aggregate cache ÷ dataset.
    pub a: f64,
    /// Shuffle seed.
    pub seed: u64,
    /// The placement schemes, one group of rows each.
    pub schemes: Vec<Scheme>,
}

/// One cell's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cell {
    /// The placement scheme.
    pub scheme: Scheme,
    /// Nodes.
    pub m: u64,
    /// Files.
    pub n: u64,
    /// CPU seconds to register the job and set its layout.
    pub setup_s: f64,
    /// CPU seconds of the placement's simulation over the cold epoch.
    pub cold_s: f64,
    /// CPU seconds of the placement's simulation over the first warm epoch (the second).
    pub warm_s: f64,
    /// CPU seconds of the placement's simulation over the steady (third) epoch.
    pub steady_s: f64,
    /// CPU microseconds per open (`on_access`) over the two warm epochs.
    pub open_us: f64,
    /// Node 0's opens per epoch.
    pub opens: u64,
    /// Simulated reads that were local, over the two warm epochs (all nodes').
    pub local: f64,
    /// Simulated backing reads per warm epoch ÷ the dataset.
    pub backing: f64,
    /// Copies moved per simulated read over the two warm epochs.
    pub moves: f64,
    /// Copies moved per simulated read in the first warm epoch.
    pub moves_warm: f64,
    /// Copies moved per simulated read in the steady epoch.
    pub moves_steady: f64,
    /// Resident bytes the registered, placed job added, per file.
    pub bytes_per_file: f64,
}

/// Resident set size of this process, in bytes (0 when /proc is unreadable).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb << 10)
}

/// Measures one cell in this process (the child's side of `--one`).
pub fn cell(scheme: Scheme, m: u64, n: u64, r: u64, a: f64, seed: u64) -> anyhow::Result<Cell> {
    let fs: Vec<FileRef> = (0..n)
        .map(|i| FileRef {
            root: 0,
            path: format!("train/c{:04}/{i:09}.JPEG", i % 1000).into(),
        })
        .collect();
    let world = m * r;
    let ranks: Vec<u64> = (0..r).collect();
    let before = rss();
    let c0 = crate::cpu_secs();
    let mut p = Planner::new();
    p.set_cluster(true);
    p.set_scheme(scheme);
    p.register(
        "job",
        fs.clone(),
        Source::Shuffle {
            seed,
            first: 0,
            count: 4,
            world,
            ranks: ranks.clone(),
            drop_last: false,
        },
    )
    .map_err(|e| anyhow::anyhow!("register: {e}"))?;
    let slots = (a * n as f64 / m as f64).ceil() as u64;
    let nodes = u16::try_from(m).map_err(|_| anyhow::anyhow!("at most 65 535 nodes"))?;
    let layout = Layout {
        nodes: (0..nodes).map(|i| format!("n{i:05}")).collect(),
        node_of_rank: (0..world).map(|k| Some((k / r) as u16)).collect(),
        slots: vec![slots; m as usize],
        bytes: false,
    };
    p.set_layout("job", Some(layout), "n00000");
    let setup_s = crate::cpu_secs() - c0;
    let mut out = Cell {
        scheme,
        m,
        n,
        setup_s,
        ..Cell::default()
    };
    let mut warm = placement::SimStats::default();
    let mut opening_warm = 0.0;
    for epoch in 0..3 {
        let order = shardcache_plan::shuffle::node_order(n, seed, epoch, world, &ranks, false);
        let s0 = p.placement_stats("job").unwrap_or_default();
        let (mut opening, mut placing) = (0.0, 0.0);
        for batch in order.chunks(r as usize) {
            let c = crate::cpu_secs();
            for &i in batch {
                p.on_access(&fs[i as usize], READ_WINDOW);
            }
            let c2 = crate::cpu_secs();
            // Each call makes progress (or says it is done).
            while !p.sync_placements(PLACEMENT_CHUNK_READS) {}
            opening += c2 - c;
            placing += crate::cpu_secs() - c2;
        }
        let s1 = p.placement_stats("job").unwrap_or_default();
        out.opens = order.len() as u64;
        let reads = ((s1.local + s1.remote) - (s0.local + s0.remote)).max(1) as f64;
        let moves = (s1.moves - s0.moves) as f64 / reads;
        match epoch {
            0 => out.cold_s = placing,
            1 => {
                out.warm_s = placing;
                out.moves_warm = moves;
                warm = s0;
            }
            _ => {
                out.steady_s = placing;
                out.moves_steady = moves;
            }
        }
        if epoch > 0 {
            opening_warm += opening;
        }
        if epoch == 2 {
            out.open_us = opening_warm / (2 * out.opens).max(1) as f64 * 1e6;
            let reads = ((s1.local + s1.remote) - (warm.local + warm.remote)).max(1) as f64;
            out.local = (s1.local - warm.local) as f64 / reads;
            // The simulation counts the cluster's reads, forwarding this node's own.
            let epoch_reads = match scheme {
                Scheme::Simulate => n,
                Scheme::Forward => out.opens,
            };
            out.backing = (s1.backing - warm.backing) as f64 / epoch_reads as f64 / 2.0;
            out.moves = (s1.moves - warm.moves) as f64 / reads;
        }
    }
    out.bytes_per_file = rss().saturating_sub(before) as f64 / n as f64;
    drop(p);
    Ok(out)
}

/// The child's answer: one line (the parent reads it back).
pub fn cell_line(c: &Cell) -> String {
    format!(
        "CELL {} {} {} {} {} {} {} {} {} {} {} {} {} {} {}",
        u8::from(c.scheme == Scheme::Forward),
        c.m,
        c.n,
        c.setup_s,
        c.cold_s,
        c.warm_s,
        c.steady_s,
        c.open_us,
        c.opens,
        c.local,
        c.backing,
        c.moves,
        c.moves_warm,
        c.moves_steady,
        c.bytes_per_file
    )
}

fn parse_cell(out: &str) -> Option<Cell> {
    let line = out.lines().find_map(|l| l.strip_prefix("CELL "))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [
        forward,
        m,
        n,
        setup_s,
        cold_s,
        warm_s,
        steady_s,
        open_us,
        opens,
        local,
        backing,
        moves,
        moves_warm,
        moves_steady,
        bytes_per_file,
    ] = v[..]
    else {
        return None;
    };
    Some(Cell {
        scheme: if forward == 1.0 {
            Scheme::Forward
        } else {
            Scheme::Simulate
        },
        m: m as u64,
        n: n as u64,
        setup_s,
        cold_s,
        warm_s,
        steady_s,
        open_us,
        opens: opens as u64,
        local,
        backing,
        moves,
        moves_warm,
        moves_steady,
        bytes_per_file,
    })
}

/// Runs every cell, each in a child process (`exe placement-scale --one ...`), and
/// prints the table.
pub fn run(a: &Args) -> anyhow::Result<Vec<Cell>> {
    let exe = std::env::current_exe()?;
    println!(
        "shardcache placement at scale: one node's planner placing the cluster's copies (R = {} ranks per node, a = {}, counted in files; the real Planner, node 0's opens in order; `simulate`: the node simulates the cluster's reads, its figures the cluster's; `forward`: each copy goes to its next reader, the figures node 0's reads; CPU seconds of the placement per epoch: cold, first warm, steady; over the two warm epochs: µs of the planner per open, local reads, backing ÷ the reads per epoch, copies moved per read and, after it, in each)",
        a.ranks_per_node, a.a
    );
    println!(
        "{:>8} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>8} {:>18} {:>8}",
        "scheme",
        "M",
        "N",
        "setup s",
        "cold s",
        "warm s",
        "steady s",
        "µs/open",
        "local",
        "backing",
        "moves/read",
        "B/file"
    );
    let mut cells = Vec::new();
    for &scheme in &a.schemes {
        for &n in &a.files {
            for &m in &a.nodes {
                let t = Instant::now();
                let out = std::process::Command::new(&exe)
                    .args([
                        "placement-scale",
                        "--one",
                        "--placement",
                        &scheme.to_string(),
                        "--nodes",
                        &m.to_string(),
                        "--files",
                        &n.to_string(),
                        "--ranks-per-node",
                        &a.ranks_per_node.to_string(),
                        "--a",
                        &a.a.to_string(),
                        "--seed",
                        &a.seed.to_string(),
                    ])
                    .output()?;
                let text = String::from_utf8_lossy(&out.stdout);
                let Some(c) = parse_cell(&text).filter(|_| out.status.success()) else {
                    anyhow::bail!(
                        "cell M = {m}, N = {n} failed ({}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    );
                };
                println!(
                    "{:>8} {:>6} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.1} {:>7.3} {:>8.4} {:>18} {:>8.0}   ({:.0} s)",
                    c.scheme.to_string(),
                    c.m,
                    c.n,
                    c.setup_s,
                    c.cold_s,
                    c.warm_s,
                    c.steady_s,
                    c.open_us,
                    c.local,
                    c.backing,
                    format!(
                        "{:.3} ({:.2}, {:.2})",
                        c.moves, c.moves_warm, c.moves_steady
                    ),
                    c.bytes_per_file,
                    t.elapsed().as_secs_f64()
                );
                cells.push(c);
            }
        }
    }
    Ok(cells)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small cell in this process: the placement engages (nearly every read local at
    /// a = 1 after the cold epoch, nothing from the backing store), and the child's line
    /// parses back to the same figures.
    #[test]
    fn a_small_cell_places_its_reads_and_its_line_parses_back() {
        for scheme in [Scheme::Simulate, Scheme::Forward] {
            let c = cell(scheme, 4, 2_000, 2, 1.0, 7).expect("cell");
            assert_eq!(c.opens, 500);
            assert!(c.local > 0.9, "{c:?}");
            assert!(c.backing < 0.01, "{c:?}");
            // The two warm epochs' moves add up to the whole's.
            let whole = (c.moves_warm + c.moves_steady) / 2.0;
            assert!((c.moves - whole).abs() < 0.05, "{c:?}");
            let back = parse_cell(&cell_line(&c)).expect("parses");
            assert_eq!((back.m, back.n, back.opens), (c.m, c.n, c.opens));
            assert_eq!(back.scheme, c.scheme);
            assert_eq!(back.local, c.local);
            assert_eq!(back.moves_steady, c.moves_steady);
        }
        // Forwarding moves a copy at most once per read: (M − 1) ÷ M of them.
        let c = cell(Scheme::Forward, 4, 2_000, 2, 1.0, 7).expect("cell");
        assert!(c.moves <= 1.0 && c.moves > 0.6, "{c:?}");
    }
}
