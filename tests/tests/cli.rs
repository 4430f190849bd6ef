//! End-to-end tests of the operator CLI: the real `shardcache` binary against the real
//! `shardcached`: `ls`, `evict`, `wait`, and what the errors say.
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use shardcache_tests::{Bed, Daemon, bin, content, read_all, write_file};

const MIB: u64 = 1 << 20;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Runs `shardcache ARGS` against `socket`, as uid 65534 when `nobody`.
fn cli_as(socket: &Path, nobody: bool, args: &[&str]) -> Output {
    let mut cmd = if nobody {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(bin("shardcache"));
        c
    } else {
        Command::new(bin("shardcache"))
    };
    cmd.arg("--socket").arg(socket).args(args).output().unwrap()
}

fn cli(socket: &Path, args: &[&str]) -> Output {
    cli_as(socket, false, args)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs a command that must succeed; its standard output.
fn ok(socket: &Path, args: &[&str]) -> String {
    let o = cli(socket, args);
    assert!(o.status.success(), "shardcache {args:?}: {o:?}");
    stdout(&o)
}

fn json(socket: &Path, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(socket, args)).unwrap()
}

/// Writes (readable by anyone) a manifest of job `job` reading `files` (relative to the
/// bed's root) in one epoch, in order, as `NAME.json` in the bed; its path.
fn manifest(bed: &Bed, name: &str, job: &str, files: &[&str]) -> String {
    let manifest = serde_json::json!({
        "version": 1, "job": job, "root": bed.backing, "files": files,
        "plan": {"kind": "sequence", "epochs": [files]}
    });
    let path = bed.tmp.path().join(format!("{name}.json"));
    std::fs::write(&path, manifest.to_string()).unwrap();
    std::fs::set_permissions(&path, PermissionsExt::from_mode(0o644)).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Registers a job reading `files` (relative to the bed's root) in one epoch, in order.
fn register(bed: &Bed, job: &str, files: &[&str]) {
    let path = manifest(bed, job, job, files);
    let out = ok(&bed.socket, &["prefetch", &path]);
    assert!(out.contains(&format!("registered job {job}")), "{out}");
}

fn p(bed: &Bed, rel: &str) -> String {
    bed.path(rel).to_str().unwrap().to_owned()
}

/// A bed whose cache is only filled by reads: no prefetch, no read-ahead past a file.
fn start_quiet(bed: &Bed) -> Daemon {
    bed.start(&["--block-size", "1MiB", "--prefetch-ahead", "0"])
}

#[test]
fn ls_lists_datasets_job_files_and_paths_with_resident_fractions() {
    let bed = Bed::new();
    write_file(&bed.path("a"), 1, 2 * MIB);
    write_file(&bed.path("b"), 2, 3 * MIB);
    write_file(&bed.path("sub/c"), 3, MIB);
    let d = start_quiet(&bed);
    register(&bed, "train", &["a", "b"]);
    let s = &bed.socket;

    // Nothing read yet: the job's files are known (the datasets view never stats), none
    // cached.
    let v = json(s, &["ls", "--json"]);
    let job = &v["datasets"][0];
    assert_eq!(job["job"], "train");
    assert_eq!(job["files"], 2);
    assert_eq!(job["resident_bytes"], 0);

    read_all(&bed.client(), &bed.path("a")).unwrap();
    read_all(&bed.client(), &bed.path("sub/c")).unwrap();
    bed.until_cached(&[bed.path("a"), bed.path("sub/c")]);

    // A job's files: exact sizes and resident bytes.
    let v = json(s, &["ls", "--json", "train"]);
    let files = v[0]["files"].as_array().unwrap();
    assert_eq!(v[0]["kind"], "job");
    assert_eq!(v[0]["total"], 2);
    assert_eq!(files.len(), 2);
    assert_eq!(files[0]["path"], p(&bed, "a"));
    assert_eq!(files[0]["size"], 2 * MIB);
    assert_eq!(files[0]["resident_bytes"], 2 * MIB);
    assert_eq!(files[1]["path"], p(&bed, "b"));
    assert_eq!(files[1]["size"], 3 * MIB);
    assert_eq!(files[1]["resident_bytes"], 0);
    let text = ok(s, &["ls", "train"]);
    let line = |name: &str| {
        text.lines()
            .find(|l| l.ends_with(&format!("/{name}")))
            .unwrap_or_else(|| panic!("{name} missing from:\n{text}"))
            .to_owned()
    };
    assert!(line("a").contains("100.0%"), "{text}");
    assert!(line("b").contains("0.0%"), "{text}");

    // The datasets: the job (its sizes now seen), and the cached file no job plans.
    let v = json(s, &["ls", "--json"]);
    let ds = v["datasets"].as_array().unwrap();
    assert_eq!(ds.len(), 2, "{v}");
    assert_eq!(ds[0]["job"], "train");
    assert_eq!(ds[0]["bytes"], 5 * MIB);
    assert_eq!(ds[0]["unsized_files"], 0);
    assert_eq!(ds[0]["resident_bytes"], 2 * MIB);
    assert_eq!(ds[0]["resident_files"], 1);
    assert_eq!(ds[1]["job"], "");
    assert_eq!(ds[1]["root"], p(&bed, "").trim_end_matches('/'));
    assert_eq!(ds[1]["files"], 1);
    assert_eq!(ds[1]["resident_bytes"], MIB);
    let text = ok(s, &["ls"]);
    let train = text.lines().find(|l| l.starts_with("train")).unwrap();
    assert!(train.contains("40.0%"), "2 of 5 MiB: {text}");
    assert!(text.lines().any(|l| l.starts_with("(no job)")), "{text}");

    // Right after reading the rest, the fraction follows.
    read_all(&bed.client(), &bed.path("b")).unwrap();
    let v = json(s, &["ls", "--json"]);
    assert_eq!(v["datasets"][0]["resident_bytes"], 5 * MIB);
    assert_eq!(v["datasets"][0]["resident_files"], 2);

    // A directory: its entries, one level, sorted; a file: just it.
    let v = json(s, &["ls", "--json", &p(&bed, "")]);
    let names: Vec<(&str, bool)> = v[0]["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), f["is_dir"].as_bool().unwrap()))
        .collect();
    let (a, b, sub) = (p(&bed, "a"), p(&bed, "b"), p(&bed, "sub"));
    assert_eq!(
        names,
        [
            (a.as_str(), false),
            (b.as_str(), false),
            (sub.as_str(), true)
        ]
    );
    let v = json(s, &["ls", "--json", &p(&bed, "sub/c")]);
    assert_eq!(v[0]["files"][0]["resident_bytes"], MIB);
    assert!(ok(s, &["ls", &p(&bed, "sub")]).contains("100.0%"));

    // A limit says how many were left out; --all lists them.
    let text = ok(s, &["ls", "train", "--limit", "1"]);
    assert!(text.contains("... 1 more not shown"), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains('%')).count(), 1);
    let text = ok(s, &["ls", "train", "--all"]);
    assert_eq!(
        text.lines().filter(|l| l.contains('%')).count(),
        2,
        "{text}"
    );
    assert!(!text.contains("not shown"), "{text}");

    // Unknown jobs and paths say what there is.
    let o = cli(s, &["ls", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no job `nope` is registered on this node (registered: train)"),
        "{o:?}"
    );
    let o = cli(s, &["ls", "/definitely/not/a/root"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not under a backing root"), "{o:?}");
    let o = cli(s, &["ls", &p(&bed, "missing")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not found"), "{o:?}");
    drop(d);
}

#[test]
fn evict_by_path_directory_job_and_all_frees_the_bytes_and_reads_stay_right() {
    let bed = Bed::new();
    let files = [
        ("a", 1, 2 * MIB),
        ("b", 2, 3 * MIB),
        ("dir/c", 3, MIB),
        ("dir/d", 4, MIB),
        ("e", 5, MIB),
    ];
    for (f, seed, len) in files {
        write_file(&bed.path(f), seed, len);
    }
    let d = start_quiet(&bed);
    register(&bed, "train", &["b"]);
    let read_everything = || {
        for (f, seed, len) in files {
            let (got, _) = read_all(&bed.client(), &bed.path(f)).unwrap();
            assert_eq!(got, content(seed, len), "{f}");
        }
        let paths: Vec<_> = files.iter().map(|(f, _, _)| bed.path(f)).collect();
        bed.until_cached(&paths);
    };
    read_everything();
    let s = &bed.socket;
    assert_eq!(d.status().used_bytes, 8 * MIB);

    // One file.
    let out = ok(s, &["evict", &p(&bed, "a")]);
    assert!(out.contains("evicted 1 files (2.0 MiB)"), "{out}");
    let st = d.status();
    assert_eq!(st.used_bytes, 6 * MIB);
    assert_eq!(st.files, 4);
    let c = st.counters;
    assert_eq!((c.evicted_files, c.evicted_bytes), (1, 2 * MIB));
    let status = ok(s, &["status"]);
    assert!(status.contains("evicted 1 files (2.0 MiB)"), "{status}");
    // Nothing left to evict there: said, and not an error.
    let o = cli(s, &["evict", &p(&bed, "a")]);
    assert!(o.status.success(), "{o:?}");
    assert!(stderr(&o).contains("nothing cached at"), "{o:?}");

    // A directory: everything under it.
    let out = ok(s, &["evict", &p(&bed, "dir")]);
    assert!(out.contains("evicted 2 files (2.0 MiB)"), "{out}");
    assert_eq!(d.status().used_bytes, 4 * MIB);

    // A job's files.
    let out = ok(s, &["evict", "--job", "train"]);
    assert!(out.contains("evicted 1 files (3.0 MiB)"), "{out}");
    assert_eq!(d.status().used_bytes, MIB, "only e is left");
    let o = cli(s, &["evict", "--job", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("registered: train"), "{o:?}");

    // Reads after eviction return the right bytes (and fill the cache again).
    read_everything();
    assert_eq!(d.status().used_bytes, 8 * MIB);

    // Everything, while a reader holds a file open: it keeps reading the same bytes.
    let mut r = bed.client().open(bed.path("b")).unwrap();
    let mut head = vec![0u8; MIB as usize];
    r.read_exact(&mut head).unwrap();
    let out = ok(s, &["evict", "--all"]);
    assert!(out.contains("evicted 5 files (8.0 MiB)"), "{out}");
    let st = d.status();
    assert_eq!((st.used_bytes, st.files, st.blocks), (0, 0, 0));
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).unwrap();
    head.extend(rest);
    assert_eq!(head, content(2, 3 * MIB), "the open reader saw no change");
    assert_eq!(
        r.stats().hit_bytes,
        3 * MIB,
        "read from the evicted (unlinked) copy it holds"
    );
    let v = json(s, &["ls", "--json"]);
    assert_eq!(v["datasets"][0]["resident_bytes"], 0);
    read_everything();

    // Nothing on the backing store was touched.
    for (f, seed, len) in files {
        assert_eq!(std::fs::read(bed.path(f)).unwrap(), content(seed, len));
    }

    // Usage: exactly one of paths, --job, --all.
    assert_eq!(cli(s, &["evict"]).status.code(), Some(2));
    assert_eq!(
        cli(s, &["evict", "--all", &p(&bed, "a")]).status.code(),
        Some(2)
    );
}

#[test]
fn other_users_may_not_evict_and_see_only_what_they_may_read() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to run the CLI as another uid");
        return;
    }
    let bed = Bed::new();
    write_file(&bed.path("public"), 1, MIB);
    std::fs::set_permissions(bed.path("public"), PermissionsExt::from_mode(0o644)).unwrap();
    write_file(&bed.path("private"), 2, MIB);
    std::fs::set_permissions(bed.path("private"), PermissionsExt::from_mode(0o600)).unwrap();
    write_file(&bed.path("closed/inner"), 3, MIB);
    std::fs::set_permissions(bed.path("closed"), PermissionsExt::from_mode(0o700)).unwrap();
    let d = start_quiet(&bed);
    for f in ["public", "private", "closed/inner"] {
        read_all(&bed.client(), &bed.path(f)).unwrap();
    }
    bed.until_cached(&["public", "private", "closed/inner"].map(|f| bed.path(f)));
    register(&bed, "train", &["public", "private"]);
    let s = &bed.socket;
    let used = d.status().used_bytes;
    assert_eq!(used, 3 * MIB);

    for args in [
        vec!["evict", "--all"],
        vec!["evict", "--job", "train"],
        vec!["evict", bed.path("public").to_str().unwrap()],
    ] {
        let o = cli_as(s, true, &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {o:?}");
        let e = stderr(&o);
        assert!(
            e.contains("only root or the daemon's user") && e.contains("not uid 65534"),
            "{e}"
        );
        assert_eq!(d.status().used_bytes, used, "nothing evicted");
    }

    // Listing: what uid 65534 may read, and a count of the rest.
    let o = cli_as(s, true, &["ls", "--json", &p(&bed, "")]);
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let files = v[0]["files"].as_array().unwrap();
    assert_eq!(files.len(), 1, "{v}");
    assert_eq!(files[0]["path"], p(&bed, "public"));
    assert_eq!(files[0]["resident_bytes"], MIB);
    assert_eq!(v[0]["hidden"], 2, "private and the directory closed");
    let o = cli_as(s, true, &["ls", "train"]);
    assert!(o.status.success(), "{o:?}");
    let text = stdout(&o);
    assert!(
        text.contains("/public") && !text.contains("/private"),
        "{text}"
    );
    assert!(text.contains("1 entries hidden"), "{text}");
    let o = cli_as(s, true, &["ls", &p(&bed, "private")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("permission denied"), "{o:?}");
    let o = cli_as(s, true, &["ls", &p(&bed, "closed/inner")]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    // Root sees everything.
    let v = json(s, &["ls", "--json", &p(&bed, "")]);
    assert_eq!(v[0]["files"].as_array().unwrap().len(), 3);
    assert_eq!(v[0]["hidden"], 0);

    // A socket this user may not connect to is told apart from a daemon that is down.
    std::fs::set_permissions(s, PermissionsExt::from_mode(0o600)).unwrap();
    let o = cli_as(s, true, &["status"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let e = stderr(&o);
    assert!(
        e.contains("permission denied") && e.contains("keeps this user out"),
        "{e}"
    );
    assert!(!e.contains("is the daemon running"), "{e}");
}

#[test]
fn wait_returns_once_prefetch_is_done_and_times_out_with_exit_code_3() {
    let bed = Bed::new();
    let names: Vec<String> = (0..4).map(|i| format!("f{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        write_file(&bed.path(n), i as u64, 2 * MIB);
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    {
        let _d = bed.start(&["--block-size", "1MiB"]);
        register(&bed, "train", &names);
        let o = cli(&bed.socket, &["wait", "train", "--timeout", "120"]);
        assert_eq!(o.status.code(), Some(0), "{o:?}");
        assert!(stdout(&o).contains("job train: ready"), "{o:?}");
        let v = json(&bed.socket, &["ls", "--json"]);
        assert_eq!(v["datasets"][0]["resident_bytes"], 8 * MIB, "{v}");
        assert_eq!(v["datasets"][0]["resident_files"], 4);
    }

    // Without prefetch nothing becomes ready: the wait runs out.
    let bed = Bed::new();
    for (i, n) in names.iter().enumerate() {
        write_file(&bed.path(n), i as u64, 2 * MIB);
    }
    let _d = start_quiet(&bed);
    register(&bed, "train", &names);
    let o = cli(&bed.socket, &["wait", "train", "--timeout", "1"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    let e = stderr(&o);
    assert!(e.contains("job `train` not ready after 1s"), "{e}");
    assert!(e.contains("0 of 4 files"), "{e}");
    // A fraction nothing can reach is a usage error; a job nobody registered, an error.
    let o = cli(&bed.socket, &["wait", "train", "--fraction", "1.5"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let o = cli(&bed.socket, &["wait", "other", "--timeout", "1"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        stderr(&o).contains("no job `other` is registered on this node (registered: train)"),
        "{o:?}"
    );
    // prefetch --wait runs out the same way.
    let path = bed.tmp.path().join("train.json");
    let o = cli(
        &bed.socket,
        &[
            "prefetch",
            path.to_str().unwrap(),
            "--wait",
            "1",
            "--timeout",
            "1",
        ],
    );
    assert_eq!(o.status.code(), Some(3), "{o:?}");
}

#[test]
fn without_a_daemon_every_command_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("absent.sock");
    for args in [
        vec!["status"],
        vec!["ls"],
        vec!["ls", "train"],
        vec!["evict", "--all"],
        vec!["wait", "train"],
        vec!["verify"],
        vec!["unregister", "train"],
    ] {
        let o = cli(&sock, &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {o:?}");
        let e = stderr(&o);
        assert!(
            e.contains(&format!("cannot reach shardcached at {}", sock.display()))
                && e.contains("is the daemon running? (systemctl status shardcached"),
            "{args:?}: {e}"
        );
    }
}

#[test]
fn only_a_jobs_registrant_or_an_operator_may_change_it_and_verify_is_for_operators() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to run the CLI as another uid");
        return;
    }
    let bed = Bed::new();
    write_file(&bed.path("public"), 1, MIB);
    std::fs::set_permissions(bed.path("public"), PermissionsExt::from_mode(0o644)).unwrap();
    let _d = start_quiet(&bed);
    let s = &bed.socket;
    register(&bed, "roots-job", &["public"]);
    // Another user can neither unregister nor move root's job, nor replace it.
    let o = cli_as(s, true, &["unregister", "roots-job"]);
    assert!(!o.status.success(), "{o:?}");
    assert!(
        stderr(&o).contains("registered by uid 0"),
        "says who may: {}",
        stderr(&o)
    );
    let replace = manifest(&bed, "replace", "roots-job", &["public"]);
    let o = cli_as(s, true, &["prefetch", &replace]);
    assert!(!o.status.success(), "a replacement by another user: {o:?}");
    assert!(ok(s, &["status", "--json"]).contains("roots-job"));
    // Verify reads the whole cache: operators only.
    let o = cli_as(s, true, &["verify"]);
    assert!(!o.status.success(), "{o:?}");
    assert!(stderr(&o).contains("only root"), "{}", stderr(&o));
    ok(s, &["verify"]);
    // A user's own job is theirs to change, and an operator's too.
    let mine = manifest(&bed, "mine", "nobodys-job", &["public"]);
    let o = cli_as(s, true, &["prefetch", &mine]);
    assert!(o.status.success(), "{o:?}");
    let o = cli_as(s, true, &["prefetch", &mine]);
    assert!(o.status.success(), "registering again replaces it: {o:?}");
    ok(s, &["unregister", "nobodys-job"]);
    ok(s, &["unregister", "roots-job"]);
}
