//! Trust suite: registration (see main.rs). Issue 12, point 2: no registration changes
//! what another user may read or sees, and a plan makes the daemon fetch only what its
//! registrant could read (docs/SEMANTICS.md, "What a registration may change").
//!
//! Every test here registers as uid 65534 through the real `shardcache` CLI (run with
//! `setpriv`), so it needs root and says so when it skips.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use shardcache_tests::{Bed, bin, cache_data_file, content, read_all, write_file};

const MIB: u64 = 1 << 20;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// `shardcache ARGS` as root.
fn as_root(bed: &Bed, args: &[&str]) -> Output {
    Command::new(bin("shardcache"))
        .arg("--socket")
        .arg(&bed.socket)
        .args(args)
        .output()
        .expect("run shardcache")
}

/// Writes `manifest` (readable by anyone) into the bed; its path.
fn manifest_file(bed: &Bed, name: &str, manifest: &serde_json::Value) -> String {
    let path = bed.tmp.path().join(format!("{name}.json"));
    std::fs::write(&path, manifest.to_string()).expect("write manifest");
    std::fs::set_permissions(&path, PermissionsExt::from_mode(0o644)).expect("chmod");
    path.to_str().expect("utf-8 path").to_owned()
}

/// Registers `manifest` with `shardcache prefetch` (as uid 65534 when `nobody`); the
/// command's standard output.
fn prefetch(bed: &Bed, nobody: bool, name: &str, manifest: &serde_json::Value) -> String {
    let path = manifest_file(bed, name, manifest);
    let out = if nobody {
        bed.cli_as_nobody(&["prefetch", &path])
    } else {
        as_root(bed, &["prefetch", &path])
    };
    assert!(out.status.success(), "prefetch {name}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, PermissionsExt::from_mode(mode)).expect("chmod");
}

/// Rewrites `p` in place (same inode, same size) with the bytes of `seed`.
fn rewrite_in_place(p: &Path, seed: u64, len: u64) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .expect("open for writing");
    f.write_all(&content(seed, len)).expect("write");
    f.sync_all().expect("sync");
}

/// Polls `f` every 50 ms until it is true or `limit` passed; how long it took.
fn until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if f() {
            return Some(start.elapsed());
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The finding of issue 12, point 2, exactly: uid 65534 registers an immutable manifest
/// over a root-owned 0644 file and reads it; root rewrites it (same size) and makes it
/// 0600. Within `metadata_ttl` (1 s) plus a margin, uid 65534 gets no byte of it through
/// the cache (the daemon refuses, the client falls back, the kernel says EACCES), and
/// root's reads through the cache return the new bytes.
#[test]
fn an_unprivileged_immutable_manifest_does_not_freeze_another_users_file() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to run the CLI as uid 65534");
        return;
    }
    let bed = Bed::new();
    let file = bed.path("ds/s.bin");
    write_file(&file, 1, MIB);
    chmod(&file, 0o644);
    let d = bed.start(&["--block-size", "1MiB", "--metadata-ttl", "1s"]);
    let out = prefetch(
        &bed,
        true,
        "frozen",
        &serde_json::json!({
            "version": 1, "job": "frozen", "root": bed.path("ds"), "files": ["s.bin"],
            "immutable": true, "plan": {"kind": "sequence", "epochs": [["s.bin"]]}
        }),
    );
    assert!(out.contains("registered job frozen (1 files)"), "{out}");
    assert!(
        out.contains("immutable: held only for the files you own"),
        "the registrant is told: {out}"
    );
    let cat = || bed.cli_as_nobody(&["cat", file.to_str().expect("utf-8")]);
    let first = cat();
    assert!(first.status.success(), "{first:?}");
    assert_eq!(first.stdout, content(1, MIB), "uid 65534 reads it first");

    rewrite_in_place(&file, 2, MIB);
    chmod(&file, 0o600);
    let changed = Instant::now();
    // The bound: metadata_ttl (1 s) plus 2 s of margin for a loaded machine.
    let bound = Duration::from_secs(3);
    let denied = until(bound, || {
        let o = cat();
        !o.status.success() && o.stdout.is_empty()
    });
    println!(
        "uid 65534 lost access through the cache {:?} after the chmod (metadata_ttl 1 s)",
        denied.map(|_| changed.elapsed())
    );
    assert!(
        denied.is_some(),
        "uid 65534 still reads the file {bound:?} after it was made 0600"
    );
    let o = cat();
    assert!(!o.status.success() && o.stdout.is_empty(), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("Permission denied"),
        "its own direct read is refused by the kernel: {o:?}"
    );
    let client = bed.client();
    let fresh = until(bound, || {
        read_all(&client, &file).is_ok_and(|(b, _)| b == content(2, MIB))
    });
    assert!(
        fresh.is_some(),
        "root still reads the old bytes through the cache {bound:?} after its rewrite"
    );
    let (b, s) = read_all(&client, &file).expect("root reads");
    assert_eq!(b, content(2, MIB));
    assert_eq!(s.fallback_bytes, 0, "through the cache: {s:?}");
    let job = &d.status().jobs[0];
    assert_eq!(job.immutable_not_owned, 1, "{job:?}");
    drop(d);
}

/// An owner vouches for its own files: uid 65534's immutable manifest is honoured for
/// the file it owns (no backing stat per open, with `metadata_ttl` 0) and not for a
/// root-owned file of the same manifest (a stat per open, like any file). Its hold never
/// decides another user's access: when the owner makes its file 0600, root's next open
/// through the cache is refused (root reads it directly).
#[test]
fn an_owners_immutable_manifest_holds_only_its_own_files_and_only_for_itself() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to run the CLI as uid 65534");
        return;
    }
    let bed = Bed::new();
    let own = bed.path("ds/own.bin");
    let theirs = bed.path("ds/theirs.bin");
    write_file(&own, 1, MIB);
    write_file(&theirs, 2, MIB);
    chmod(&own, 0o644);
    chmod(&theirs, 0o644);
    std::os::unix::fs::chown(&own, Some(65534), Some(65534)).expect("chown");
    let d = bed.start(&[
        "--block-size",
        "1MiB",
        "--metadata-ttl",
        "0",
        "--prefetch-ahead",
        "0",
    ]);
    let out = prefetch(
        &bed,
        true,
        "mine",
        &serde_json::json!({
            "version": 1, "job": "mine", "root": bed.path("ds"),
            "files": ["own.bin", "theirs.bin"], "immutable": true,
            "plan": {"kind": "sequence", "epochs": [["own.bin", "theirs.bin"]]}
        }),
    );
    assert!(out.contains("registered job mine (2 files)"), "{out}");
    let cat = |p: &Path| {
        let o = bed.cli_as_nobody(&["cat", p.to_str().expect("utf-8")]);
        assert!(o.status.success(), "{o:?}");
        o.stdout
    };
    assert_eq!(cat(&own), content(1, MIB));
    assert_eq!(cat(&theirs), content(2, MIB));
    let stats = || d.counters().backing_stats;

    let before = stats();
    for _ in 0..3 {
        assert_eq!(cat(&own), content(1, MIB));
    }
    assert_eq!(
        stats(),
        before,
        "its own file: held, no backing stat per open"
    );
    let before = stats();
    for _ in 0..3 {
        assert_eq!(cat(&theirs), content(2, MIB));
    }
    assert!(
        stats() >= before + 3,
        "root's file: not held, a stat per open (metadata_ttl 0): {} stats",
        stats() - before
    );
    let job = &d.status().jobs[0];
    assert_eq!(
        (job.immutable_not_owned, job.files_denied),
        (1, 0),
        "{job:?}"
    );

    // Root (another user) reads the owner's file through the cache, then the owner
    // closes it.
    let client = bed.client();
    let (b, s) = read_all(&client, &own).expect("root reads");
    assert_eq!(b, content(1, MIB));
    assert_eq!(s.fallback_bytes, 0, "through the cache: {s:?}");
    let o = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "chmod",
            "600",
        ])
        .arg(&own)
        .output()
        .expect("chmod as 65534");
    assert!(o.status.success(), "{o:?}");
    let (b, s) = read_all(&client, &own).expect("root reads directly");
    assert_eq!(b, content(1, MIB));
    assert_eq!(
        (s.hit_bytes, s.filled_bytes, s.fallback_bytes),
        (0, 0, MIB),
        "root gets no byte of the owner's 0600 file through the cache"
    );
    assert_eq!(cat(&own), content(1, MIB), "the owner still reads it");
    drop(d);
}

/// A plan makes the daemon fetch only what its registrant could read: uid 65534's
/// manifests over a 0600 root file and a 0700 directory (as a glob, and as a list)
/// fetch none of them; the readable file is fetched once.
#[test]
fn a_plan_fetches_only_what_its_registrant_may_read() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to run the CLI as uid 65534");
        return;
    }
    let bed = Bed::new();
    write_file(&bed.path("ds/open/a.bin"), 1, MIB);
    write_file(&bed.path("ds/secret.bin"), 2, MIB);
    write_file(&bed.path("ds/closed/c.bin"), 3, MIB);
    chmod(&bed.path("ds/open/a.bin"), 0o644);
    chmod(&bed.path("ds/secret.bin"), 0o600);
    chmod(&bed.path("ds/closed/c.bin"), 0o644);
    chmod(&bed.path("ds/closed"), 0o700);
    let d = bed.start(&["--block-size", "1MiB"]);
    let glob = prefetch(
        &bed,
        true,
        "glob",
        &serde_json::json!({
            "version": 1, "job": "glob", "root": bed.path("ds"),
            "files": {"glob": "**/*.bin"},
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 1,
                     "epochs": 1, "world_size": 1, "ranks": [0]}
        }),
    );
    assert!(
        glob.contains("registered job glob (2 files)"),
        "the glob did not look into closed/: {glob}"
    );
    assert!(
        glob.contains("skipped 1 directory you may not list"),
        "{glob}"
    );
    let list = prefetch(
        &bed,
        true,
        "list",
        &serde_json::json!({
            "version": 1, "job": "list", "root": bed.path("ds"),
            "files": ["closed/c.bin", "secret.bin", "open/a.bin"],
            "plan": {"kind": "sequence", "epochs": [[0, 1, 2]]}
        }),
    );
    assert!(list.contains("registered job list (3 files)"), "{list}");
    let resident = |rel: &str| cache_data_file(&bed.cache, &bed.backing, rel).is_some();
    // Settled: the readable file cached and nothing being prefetched.
    let settled = until(Duration::from_secs(20), || {
        resident("ds/open/a.bin") && d.status().jobs.iter().all(|j| j.prefetching == 0)
    });
    assert!(settled.is_some(), "the readable file was never prefetched");
    assert!(!resident("ds/secret.bin"), "a 0600 root file was fetched");
    assert!(
        !resident("ds/closed/c.bin"),
        "a file in a 0700 root directory was fetched"
    );
    assert_eq!(
        d.counters().backing_reads,
        1,
        "one backing read: the one block of open/a.bin"
    );
    // Counted, per job: in the status, its text and the metrics.
    let counted = until(Duration::from_secs(20), || {
        let s = d.status();
        let job = |id: &str| s.jobs.iter().find(|j| j.job == id).cloned();
        job("glob").is_some_and(|j| (j.files_denied, j.dirs_denied) == (1, 1))
            && job("list").is_some_and(|j| (j.files_denied, j.dirs_denied) == (2, 0))
    });
    assert!(counted.is_some(), "{:?}", d.status().jobs);
    let text = String::from_utf8_lossy(&as_root(&bed, &["status"]).stdout).into_owned();
    assert!(
        text.contains("job list: 2 files its registrant may not read (not prefetched)"),
        "{text}"
    );
    let addr = d.metrics_addr().expect("metrics endpoint");
    let (code, body) = shardcache_tests::http_get(addr, "/metrics").expect("scrape");
    assert_eq!(code, 200);
    for line in [
        "shardcache_job_files_denied{job_id=\"list\"} 2",
        "shardcache_job_dirs_denied{job_id=\"glob\"} 1",
    ] {
        assert!(body.contains(line), "{line} missing from:\n{body}");
    }
    drop(d);
}

/// Root (an operator) vouches for the node's data: its immutable glob manifest covers
/// every file, unreadable to others or not, all of them are prefetched, and every open
/// after the first stat costs no backing stat.
#[test]
fn an_operators_registration_holds_and_fetches_every_file() {
    if !is_root() {
        eprintln!("SKIPPED: needs root (the operator) to own the test files");
        return;
    }
    let bed = Bed::new();
    write_file(&bed.path("ds/open/a.bin"), 1, MIB);
    write_file(&bed.path("ds/secret.bin"), 2, MIB);
    write_file(&bed.path("ds/closed/c.bin"), 3, MIB);
    chmod(&bed.path("ds/secret.bin"), 0o600);
    chmod(&bed.path("ds/closed"), 0o700);
    let d = bed.start(&["--block-size", "1MiB", "--metadata-ttl", "0"]);
    let out = prefetch(
        &bed,
        false,
        "all",
        &serde_json::json!({
            "version": 1, "job": "all", "root": bed.path("ds"),
            "files": {"glob": "**/*.bin"}, "immutable": true,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 1,
                     "epochs": 1, "world_size": 1, "ranks": [0]}
        }),
    );
    assert!(out.contains("registered job all (3 files)"), "{out}");
    let resident = |rel: &str| cache_data_file(&bed.cache, &bed.backing, rel).is_some();
    let all = ["ds/open/a.bin", "ds/secret.bin", "ds/closed/c.bin"];
    let fetched = until(Duration::from_secs(20), || all.iter().all(|f| resident(f)));
    assert!(fetched.is_some(), "root's plan fetches every file");
    let client = bed.client();
    for (i, f) in all.iter().enumerate() {
        let (b, _) = read_all(&client, &bed.path(f)).expect("root reads");
        assert_eq!(b, content(i as u64 + 1, MIB));
    }
    let before = d.counters().backing_stats;
    for f in all {
        read_all(&client, &bed.path(f)).expect("root reads");
    }
    assert_eq!(
        d.counters().backing_stats,
        before,
        "held for everyone: no backing stat per open"
    );
    let job = &d.status().jobs[0];
    assert_eq!(
        (
            job.files_denied,
            job.dirs_denied,
            job.immutable_not_owned,
            job.immutable_over_limit
        ),
        (0, 0, 0, 0),
        "nothing left out: {job:?}"
    );
    assert!(
        !out.contains("immutable:"),
        "no note for an operator: {out}"
    );
    drop(d);
}
