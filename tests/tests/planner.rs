//! The epoch-aware planner in the real daemon: a shuffled 4-epoch job over a dataset
//! twice the cache size.
#![allow(clippy::unwrap_used)]

use shardcache_tests::{Bed, content, read_all, write_file};

const FILE: u64 = 16 << 10;

#[test]
fn a_shuffled_job_reaches_the_hit_ceiling_after_its_first_epoch() {
    four_shuffled_epochs(&["--prefetch-ahead", "0"]);
}

#[test]
fn with_prefetch_a_shuffled_job_still_reaches_the_hit_ceiling() {
    four_shuffled_epochs(&[]);
}

/// A 4-epoch shuffled job over twice the cache size, read in plan order, by a daemon
/// started with `extra` arguments.
fn four_shuffled_epochs(extra: &[&str]) {
    let ahead = extra.join(" ");
    let bed = Bed::new();
    let n = 200u64;
    for i in 0..n {
        write_file(&bed.path(&format!("ds/s{i:03}")), i, FILE);
    }
    // Room for exactly half the dataset.
    let cap = format!("{}", n / 2 * FILE);
    let mut args = vec![
        "--block-size",
        "16KiB",
        "--capacity",
        &cap,
        "--min-free",
        "0",
    ];
    args.extend_from_slice(extra);
    let d = bed.start(&args);
    let client = bed.client();
    let files: Vec<String> = (0..n).map(|i| format!("s{i:03}")).collect();
    let manifest = serde_json::json!({
        "version": 1, "job": "train", "root": bed.path("ds"), "files": files, "immutable": true,
        "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 5, "epochs": 4,
                 "world_size": 1, "ranks": [0]}
    });
    let reply = client.register(&manifest.to_string()).unwrap();
    assert_eq!((reply.job.as_str(), reply.files), ("train", n));
    // The readiness window is what the cache can hold of the first epoch: half of it.
    let job = &d.status().jobs[0];
    assert_eq!(
        (job.window, job.window_bytes),
        (n / 2, n / 2 * FILE),
        "{job:?}\ndaemon log:\n{}",
        d.log_text()
    );

    for epoch in 0..4u64 {
        let order = shardcache_plan::shuffle::node_order(n, 5, epoch, 1, &[0], false);
        let before = d.counters();
        for &i in &order {
            let (got, _) = read_all(&client, &bed.path(&format!("ds/s{i:03}"))).unwrap();
            assert!(got == content(i, FILE), "epoch {epoch}: file {i}");
        }
        // Deliver the client's read report before looking at the counters.
        client.status().unwrap();
        let after = d.counters();
        let fetched = (after.backing_bytes - before.backing_bytes)
            + (after.fallback_bytes - before.fallback_bytes);
        let hit = 1.0 - fetched as f64 / (n * FILE) as f64;
        eprintln!(
            "[{ahead}] epoch {epoch}: hit ratio {hit:.3}; backing reads {}, client fallback bytes {}, no-space {}, evicted {}, opens full {}",
            after.backing_reads - before.backing_reads,
            after.fallback_bytes - before.fallback_bytes,
            after.fills_no_space - before.fills_no_space,
            after.evicted_files - before.evicted_files,
            after.opens_full - before.opens_full
        );
        eprintln!(
            "  waits {} timeouts {} fallback opens {} fallback reads {} shed {} refused other {}",
            after.waits - before.waits,
            after.wait_timeouts - before.wait_timeouts,
            after.fallback_opens - before.fallback_opens,
            after.fallback_reads - before.fallback_reads,
            after.queue_shed - before.queue_shed,
            after.refused_other - before.refused_other,
        );
        let _ = std::fs::copy(
            bed.tmp.path().join("daemon.log"),
            format!("/tmp/plan-{ahead}.log"),
        );
        if epoch > 0 {
            assert!(hit >= 0.49, "epoch {epoch}: hit ratio {hit} (ceiling 0.5)");
        }
        // The daemon followed the reads: its position is where the plan says; and its
        // per-job figures (reported by the client) agree with the counters.
        let job = &d.status().jobs[0];
        let read = job.hit_bytes + job.filled_bytes + job.fallback_bytes;
        assert_eq!(
            read,
            (epoch + 1) * n * FILE,
            "every byte read is counted for the job"
        );
        assert_eq!(job.opens, (epoch + 1) * n);
        assert_eq!(
            (job.job.as_str(), job.epoch, job.step),
            ("train", (epoch + 1).min(3), if epoch == 3 { n } else { 0 })
        );
    }
}

#[test]
fn a_malformed_manifest_is_refused_with_the_field_and_changes_nothing() {
    let bed = Bed::new();
    write_file(&bed.path("ds/a"), 1, 100);
    let d = bed.start(&[]);
    let client = bed.client();
    let bad = serde_json::json!({
        "version": 1, "job": "j", "root": bed.path("ds"), "files": ["a"],
        "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 1, "epochs": 1,
                 "world_size": 2, "ranks": [2]}
    });
    let e = client.register(&bad.to_string()).unwrap_err();
    assert!(e.to_string().contains("plan.ranks[0]"), "{e}");
    let outside = serde_json::json!({
        "version": 1, "job": "j", "root": "/etc", "files": ["passwd"],
        "plan": {"kind": "sequence", "epochs": [[0]]}
    });
    let e = client.register(&outside.to_string()).unwrap_err();
    assert!(e.to_string().starts_with("root:"), "{e}");
    assert!(d.status().jobs.is_empty());
    assert!(!client.unregister("j").unwrap());

    // Progress reports outside the plan are refused with the reason and change nothing.
    let ok = serde_json::json!({
        "version": 1, "job": "j", "root": bed.path("ds"), "files": ["a"],
        "plan": {"kind": "sequence", "epochs": [[0], [0]]}
    });
    client.register(&ok.to_string()).unwrap();
    assert!(client.progress("j", 1, 0).unwrap());
    let e = client.progress("j", 5, 0).unwrap_err();
    assert!(e.to_string().contains("epoch 5 is outside the plan"), "{e}");
    let e = client.progress("j", 0, 2).unwrap_err();
    assert!(e.to_string().contains("past the end of epoch 0"), "{e}");
    assert_eq!((d.status().jobs[0].epoch, d.status().jobs[0].step), (1, 0));
    assert!(!client.progress("nobody", 0, 0).unwrap());
}

#[test]
fn the_cli_registers_a_manifest_and_waits_for_readiness() {
    let bed = Bed::new();
    let n = 40u64;
    for i in 0..n {
        write_file(&bed.path(&format!("ds/s{i:02}")), i, FILE);
    }
    let d = bed.start(&["--block-size", "16KiB", "--prefetch-ahead", "8"]);
    let files: Vec<String> = (0..n).map(|i| format!("s{i:02}")).collect();
    let manifest = serde_json::json!({
        "version": 1, "job": "prolog", "root": bed.path("ds"), "files": files,
        "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 9, "epochs": 2,
                 "world_size": 1, "ranks": [0]}
    });
    let mf = bed.tmp.path().join("manifest.json");
    std::fs::write(&mf, manifest.to_string()).unwrap();
    let out = std::process::Command::new(shardcache_tests::bin("shardcache"))
        .args(["--socket", bed.socket.to_str().unwrap(), "prefetch"])
        .arg(&mf)
        .args(["--wait", "0.1", "--timeout", "30"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("registered job prolog (40 files)"));
    let job = &d.status().jobs[0];
    assert_eq!(job.window, n, "the whole first epoch fits: {job:?}");
    assert_eq!(job.window_bytes, n * FILE);
    assert!(
        job.window_resident_bytes * 10 >= job.window_bytes,
        "ready: {job:?}"
    );
    // The prefetched files are the ones the plan reads first, and they read back right.
    let first = shardcache_plan::shuffle::node_order(n, 9, 0, 1, &[0], false)[0];
    let (got, st) = read_all(&bed.client(), &bed.path(&format!("ds/s{first:02}"))).unwrap();
    assert_eq!(got, content(first, FILE));
    assert_eq!(st.hit_bytes, FILE, "prefetched before the job read it");

    // A malformed manifest: a clear error naming the field, exit status non-zero.
    std::fs::write(&mf, r#"{"version": 1, "job": "x", "root": "/", "files": [], "plan": {"kind": "sequence", "epochs": [[]]}}"#).unwrap();
    let out = std::process::Command::new(shardcache_tests::bin("shardcache"))
        .args(["--socket", bed.socket.to_str().unwrap(), "prefetch"])
        .arg(&mf)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("files: lists no file"),
        "{out:?}"
    );
}

#[test]
fn a_glob_manifest_names_the_matching_files_and_immutable_files_are_stated_once() {
    let bed = Bed::new();
    for i in 0..6u64 {
        write_file(&bed.path(&format!("ds/train/{i}.tar")), i, 1000);
    }
    write_file(&bed.path("ds/train/index.json"), 99, 10);
    write_file(&bed.path("ds/val/0.tar"), 98, 10);
    // A zero TTL: without `immutable`, every open stats the backing file.
    let d = bed.start(&["--metadata-ttl", "0"]);
    let client = bed.client();
    let manifest = |glob: &str| {
        serde_json::json!({
            "version": 1, "job": "g", "root": bed.path("ds"), "files": {"glob": glob},
            "immutable": true,
            "plan": {"kind": "sequence", "epochs": [["train/5.tar", "train/0.tar"]]}
        })
        .to_string()
    };
    let r = client.register(&manifest("train/*.tar")).unwrap();
    assert_eq!(r.files, 6, "only the .tar files under train/");

    let stats = || d.counters().backing_stats;
    let read = |i: u64| {
        let (got, _) = read_all(&client, &bed.path(&format!("ds/train/{i}.tar"))).unwrap();
        assert_eq!(got, content(i, 1000));
    };
    for i in 0..6 {
        read(i);
    }
    let before = stats();
    for _ in 0..3 {
        for i in 0..6 {
            read(i);
        }
    }
    assert_eq!(stats(), before, "immutable files are not stat'ed again");
    assert!(client.unregister("g").unwrap());
    read(0);
    assert!(stats() > before, "unregistered: the TTL (0) applies again");

    // A glob that matches nothing, and a plan naming a file the glob did not select.
    let e = client.register(&manifest("test/*.tar")).unwrap_err();
    assert!(e.to_string().contains("matches no regular file"), "{e}");
    let bad = serde_json::json!({
        "version": 1, "job": "g", "root": bed.path("ds"), "files": {"glob": "train/*.tar"},
        "plan": {"kind": "sequence", "epochs": [["val/0.tar"]]}
    });
    let e = client.register(&bad.to_string()).unwrap_err();
    assert!(e.to_string().contains("plan.epochs[0][0]"), "{e}");
    assert!(d.status().jobs.is_empty());
}

/// Two jobs over two datasets, each as large as the cache, read in lockstep, plus a
/// reader of files no plan names: the jobs together reach the ceiling C / (N_a + N_b),
/// and the unplanned reads do not displace planned data.
#[test]
fn two_jobs_share_the_cache_by_their_future_needs() {
    let bed = Bed::new();
    let n = 80u64;
    for i in 0..n {
        write_file(&bed.path(&format!("a/{i:03}")), i, FILE);
        write_file(&bed.path(&format!("b/{i:03}")), 1000 + i, FILE);
    }
    for i in 0..40u64 {
        write_file(&bed.path(&format!("scratch/{i:03}")), 2000 + i, FILE);
    }
    let cap = format!("{}", n * FILE);
    let d = bed.start(&[
        "--block-size",
        "16KiB",
        "--capacity",
        &cap,
        "--min-free",
        "0",
    ]);
    let client = bed.client();
    let files: Vec<String> = (0..n).map(|i| format!("{i:03}")).collect();
    for (job, seed) in [("a", 1u64), ("b", 2)] {
        let m = serde_json::json!({
            "version": 1, "job": job, "root": bed.path(job), "files": files,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": seed,
                     "epochs": 3, "world_size": 1, "ranks": [0]}
        });
        client.register(&m.to_string()).unwrap();
    }
    for epoch in 0..3u64 {
        let oa = shardcache_plan::shuffle::node_order(n, 1, epoch, 1, &[0], false);
        let ob = shardcache_plan::shuffle::node_order(n, 2, epoch, 1, &[0], false);
        let before = d.counters();
        let mut scratch_bytes = 0;
        for k in 0..n as usize {
            let (a, b) = (oa[k], ob[k]);
            let (got, _) = read_all(&client, &bed.path(&format!("a/{a:03}"))).unwrap();
            assert!(got == content(a, FILE), "a/{a}");
            let (got, _) = read_all(&client, &bed.path(&format!("b/{b:03}"))).unwrap();
            assert!(got == content(1000 + b, FILE), "b/{b}");
            if k % 2 == 0 {
                let s = (k / 2) as u64;
                let (got, _) = read_all(&client, &bed.path(&format!("scratch/{s:03}"))).unwrap();
                assert!(got == content(2000 + s, FILE), "scratch/{s}");
                scratch_bytes += FILE;
            }
        }
        client.status().unwrap();
        let after = d.counters();
        let fetched = (after.backing_bytes - before.backing_bytes)
            + (after.fallback_bytes - before.fallback_bytes)
            - scratch_bytes;
        let hit = 1.0 - fetched as f64 / (2 * n * FILE) as f64;
        eprintln!("epoch {epoch}: planned hit ratio {hit:.3}");
        if epoch > 0 {
            assert!(hit >= 0.49, "epoch {epoch}: hit ratio {hit} (ceiling 0.5)");
        }
    }
    let jobs = d.status().jobs;
    assert_eq!(jobs.len(), 2);
    for j in &jobs {
        assert_eq!(
            j.hit_bytes + j.filled_bytes + j.fallback_bytes,
            3 * n * FILE,
            "{j:?}"
        );
    }
}

/// The prefetch budgets toward the shared file system hold: with `--prefetch-ops N` (or
/// `--prefetch-bandwidth B`) prefetch fetches at most about N files (B bytes) per second.
/// Only upper bounds are checked: a slow machine prefetches less, never more.
#[test]
fn prefetch_stays_within_its_ops_and_bandwidth_budgets() {
    for (flag, value, per_sec_files) in [
        ("--prefetch-ops", "10", 10.0),
        ("--prefetch-bandwidth", "80KiB", 5.0), // 16 KiB files
    ] {
        let bed = Bed::new();
        let n = 100u64;
        for i in 0..n {
            write_file(&bed.path(&format!("ds/s{i:03}")), i, FILE);
        }
        let d = bed.start(&["--block-size", "16KiB", flag, value]);
        let files: Vec<String> = (0..n).map(|i| format!("s{i:03}")).collect();
        let manifest = serde_json::json!({
            "version": 1, "job": "b", "root": bed.path("ds"), "files": files,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 1,
                     "epochs": 1, "world_size": 1, "ranks": [0]}
        });
        let start = std::time::Instant::now();
        bed.client().register(&manifest.to_string()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let filled = d.counters().blocks_filled;
        let secs = start.elapsed().as_secs_f64();
        // The bucket starts empty and saves up at most a tenth of a second (or one file);
        // one file may overdraw it.
        let most = (per_sec_files * secs).ceil() as u64 + 2;
        eprintln!("{flag} {value}: {filled} files prefetched in {secs:.2}s (at most {most})");
        assert!(filled >= 1, "{flag}: prefetch ran");
        assert!(
            filled <= most,
            "{flag} {value}: {filled} files in {secs:.2}s"
        );
    }
}

/// Issue 14, the Rust client's half of "jobs bound to their readers": a `JobLease` holds
/// its job (this process, alive, is its holder), registers it again when the daemon lost
/// it, and lets go of it when dropped; a scheduler's registration (no lease) under the
/// same id keeps its explicit lifetime, through the lease joining and letting go.
#[test]
fn a_job_lease_holds_its_job_until_dropped() {
    use shardcache_client::JobLease;
    let bed = Bed::new();
    for i in 0..4u64 {
        write_file(&bed.path(&format!("ds/s{i}")), i, FILE);
    }
    let d = bed.start(&[]);
    let client = bed.client();
    let manifest = serde_json::json!({
        "version": 1, "job": "leased", "root": bed.path("ds"), "files": ["s0", "s1", "s2", "s3"],
        "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 5, "epochs": 2,
                 "world_size": 1, "ranks": [0]}
    })
    .to_string();
    let lease = JobLease::with_lease(
        client.clone(),
        manifest.clone(),
        std::time::Duration::from_secs(1),
    )
    .unwrap();
    let job =
        |d: &shardcache_tests::Daemon| d.status().jobs.into_iter().find(|j| j.job == "leased");
    let j = job(&d).unwrap();
    assert_eq!(
        (j.lease_seconds, j.lease_holders, j.lease_holders_alive),
        (1, 1, 1)
    );
    // Lost (unregistered by hand; a daemon restart alike): the next report registers it.
    assert!(client.unregister("leased").unwrap());
    assert!(lease.progress(1, 0).unwrap());
    let j = job(&d).unwrap();
    assert_eq!((j.epoch, j.lease_holders), (1, 1));
    drop(lease);
    assert!(job(&d).is_none(), "let go when dropped");
    // A scheduler's registration first: the lease that joins it does not shorten it.
    client.register(&manifest).unwrap();
    let lease =
        JobLease::with_lease(client.clone(), manifest, std::time::Duration::from_secs(1)).unwrap();
    assert_eq!(job(&d).unwrap().lease_seconds, 0);
    drop(lease);
    assert_eq!(
        job(&d).unwrap().lease_seconds,
        0,
        "the rank letting go does not end it"
    );
    assert!(client.unregister("leased").unwrap());
}

/// Issue 15: registrations survive the daemon. A clean stop keeps each job's plan,
/// registrant, lease and position; a `kill -9` keeps the plan and its lease (the
/// position is as last saved); an unregistered job stays gone.
#[test]
fn registrations_survive_a_clean_stop_and_a_kill_9() {
    use shardcache_client::JobLease;
    let bed = Bed::new();
    let n = 8u64;
    for i in 0..n {
        write_file(&bed.path(&format!("ds/s{i}")), i, FILE);
    }
    let mut d = bed.start(&[]);
    let client = bed.client();
    let manifest = |job: &str, rank: u64| {
        serde_json::json!({
            "version": 1, "job": job, "root": bed.path("ds"),
            "files": (0..n).map(|i| format!("s{i}")).collect::<Vec<_>>(),
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 3,
                     "epochs": 4, "world_size": 2, "ranks": [rank]}
        })
        .to_string()
    };
    // Two ranks of one job, one by one, holding a lease (one holder: this process); a
    // scheduler's job; a job that is unregistered before the stop.
    let r0 = JobLease::register(client.clone(), manifest("train", 0)).unwrap();
    let r1 = JobLease::register(client.clone(), manifest("train", 1)).unwrap();
    client.register(&manifest("prolog", 0)).unwrap();
    client.register(&manifest("gone", 0)).unwrap();
    assert!(client.unregister("gone").unwrap());
    assert!(client.progress("train", 1, 2).unwrap());
    let jobs = |d: &shardcache_tests::Daemon| {
        let mut j: Vec<(String, u64, u64, u64, u32, u32)> = d
            .status()
            .jobs
            .into_iter()
            .map(|j| {
                (
                    j.job,
                    j.epoch,
                    j.step,
                    j.epoch_len,
                    j.lease_seconds,
                    j.lease_holders,
                )
            })
            .collect();
        j.sort();
        j
    };
    let before = jobs(&d);
    assert_eq!(
        before,
        [
            ("prolog".into(), 0, 0, 4, 0, 0),
            ("train".into(), 1, 2, 8, 60, 1)
        ]
    );
    assert!(d.stop(), "clean stop");
    d.restart();
    assert_eq!(
        jobs(&d),
        before,
        "a clean stop keeps plans, leases and positions"
    );
    // The ranks (alive: this process) still hold it: no registration was needed.
    d.kill9();
    d.restart();
    let after = jobs(&d);
    assert_eq!(
        after
            .iter()
            .map(|j| (&j.0, j.3, j.4, j.5))
            .collect::<Vec<_>>(),
        [
            (&"prolog".to_owned(), 4, 0, 0),
            (&"train".to_owned(), 8, 60, 1)
        ],
        "kill -9 keeps the plans and leases"
    );
    assert!(
        d.log_text().contains("registration restored"),
        "{}",
        d.log_text()
    );
    // The ranks letting go end the job, also on disk.
    drop((r0, r1));
    assert_eq!(jobs(&d).len(), 1);
    d.kill9();
    d.restart();
    assert_eq!(
        jobs(&d).iter().map(|j| j.0.as_str()).collect::<Vec<_>>(),
        ["prolog"]
    );
}
