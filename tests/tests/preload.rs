//! End-to-end tests of `libshardcache_preload.so`: unmodified programs (`cat`, `dd`,
//! `sh`, `python3`) run with the shim preloaded against the real daemon. What proves that
//! a file was served from the cache: the daemon counted a complete open and read nothing
//! from the backing store, or the program's descriptor names a file in the cache
//! directory (`/proc/self/fd`).
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use shardcache_tests::{Bed, content, read_all, write_file};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Runs `c` to its end; panics unless it succeeded. Its stdout.
fn ok(c: &mut Command) -> Vec<u8> {
    let out = c.output().unwrap();
    assert!(out.status.success(), "{c:?} failed: {}", show(&out));
    out.stdout
}

fn show(out: &Output) -> String {
    format!(
        "{}; stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    )
}

/// True when `python3` runs here; the tests that need it say so and skip otherwise.
fn have_python() -> bool {
    let found = Command::new("python3")
        .args(["-c", ""])
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("SKIPPED: python3 not found");
    }
    found
}

/// Runs a Python script with the shim; its stdout.
fn python(bed: &Bed, script: &str, args: &[&Path]) -> Vec<u8> {
    ok(bed.shimmed("python3").arg("-c").arg(script).args(args))
}

/// How the daemon's counters moved.
fn delta(
    before: &shardcache_client::Counters,
    after: &shardcache_client::Counters,
) -> (u64, u64, u64) {
    (
        after.opens - before.opens,
        after.opens_full - before.opens_full,
        after.backing_reads - before.backing_reads,
    )
}

/// `(opens, complete opens, backing reads)` of one local-copy open per file.
fn from_cache(files: u64) -> (u64, u64, u64) {
    (files, files, 0)
}

#[test]
fn cat_reads_a_cached_file_from_the_local_copy() {
    let bed = Bed::new();
    let p = bed.path("ds/train-0001.tar");
    let len = 3 * MIB + MIB / 2 + 17;
    write_file(&p, 1, len);
    let d = bed.start(&["--block-size", "1MiB"]);
    assert_eq!(read_all(&bed.client(), &p).unwrap().0, content(1, len));

    let before = d.counters();
    let out = ok(bed.shimmed("cat").arg(&p));
    assert!(out == content(1, len), "cat gave the file's bytes");
    assert_eq!(delta(&before, &d.counters()), from_cache(1));

    // A relative path with `.` and doubled slashes, against the working directory.
    let before = d.counters();
    let out = ok(bed
        .shimmed("cat")
        .current_dir(&bed.backing)
        .arg("./ds//./train-0001.tar"));
    assert!(out == content(1, len));
    assert_eq!(delta(&before, &d.counters()), from_cache(1));
}

#[test]
fn python_and_dd_read_cached_files_from_the_local_copy() {
    let bed = Bed::new();
    let p = bed.path("ds/shard.bin");
    let len = 2 * MIB + 5;
    write_file(&p, 2, len);
    let d = bed.start(&["--block-size", "1MiB"]);
    read_all(&bed.client(), &p).unwrap();

    if have_python() {
        let before = d.counters();
        let script = "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())";
        let out = python(&bed, script, &[&p]);
        assert!(out == content(2, len), "python read the file's bytes");
        assert_eq!(delta(&before, &d.counters()), from_cache(1));
    }

    let before = d.counters();
    let out = ok(bed
        .shimmed("dd")
        .arg(format!("if={}", p.display()))
        .args(["bs=64k", "status=none"]));
    assert!(out == content(2, len), "dd copied the file's bytes");
    assert_eq!(delta(&before, &d.counters()), from_cache(1));
}

#[test]
fn a_cold_file_is_fetched_by_the_daemon_then_read_locally() {
    let bed = Bed::new();
    let p = bed.path("cold/f.bin");
    let len = 5 * 64 * KIB + 3;
    write_file(&p, 3, len);
    let d = bed.start(&["--block-size", "64KiB"]);

    let before = d.counters();
    let out = ok(bed.shimmed("cat").arg(&p));
    assert!(out == content(3, len), "right bytes from a cold file");
    let after = d.counters();
    assert_eq!(after.opens - before.opens, 1);
    assert_eq!(after.opens_empty - before.opens_empty, 1, "it was cold");
    assert!(
        after.backing_reads > before.backing_reads,
        "the daemon filled it"
    );

    let before = d.counters();
    assert!(ok(bed.shimmed("cat").arg(&p)) == content(3, len));
    assert_eq!(
        delta(&before, &d.counters()),
        from_cache(1),
        "cached whole by the first open"
    );
}

#[test]
fn without_a_daemon_programs_read_the_backing_files() {
    let bed = Bed::new();
    let p = bed.path("f.bin");
    let len = MIB + 1;
    write_file(&p, 4, len);

    // Never started: nothing listens on the socket.
    assert!(ok(bed.shimmed("cat").arg(&p)) == content(4, len));
    let missing = bed
        .shimmed("cat")
        .arg(bed.path("missing"))
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("No such file or directory"),
        "the real call's errno: {}",
        show(&missing)
    );

    // Hung (SIGSTOP): asking it times out, and the program reads the backing file.
    let mut d = bed.start(&["--block-size", "1MiB"]);
    read_all(&bed.client(), &p).unwrap();
    d.signal(libc::SIGSTOP);
    let out = bed
        .shimmed("cat")
        .env("SHARDCACHE_TIMEOUT_MS", "200")
        .arg(&p)
        .output();
    d.signal(libc::SIGCONT);
    let out = out.unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(out.stdout == content(4, len));

    // Stopped.
    assert!(d.stop(), "clean shutdown");
    assert!(ok(bed.shimmed("cat").arg(&p)) == content(4, len));
}

#[test]
fn a_daemon_stopping_while_a_program_runs_does_not_fail_it() {
    if !have_python() {
        return;
    }
    let bed = Bed::new();
    let (a, b) = (bed.path("a.bin"), bed.path("b.bin"));
    write_file(&a, 5, MIB + 7);
    write_file(&b, 6, MIB + 9);
    let mut d = bed.start(&["--block-size", "1MiB"]);
    read_all(&bed.client(), &a).unwrap();
    read_all(&bed.client(), &b).unwrap();

    // Reads `a`, waits for a line on stdin, reads `b`.
    let script = "import sys
out = sys.stdout.buffer
out.write(open(sys.argv[1], 'rb').read()); out.flush()
sys.stdin.readline()
out.write(open(sys.argv[2], 'rb').read())";
    let before = d.counters();
    let mut child = bed
        .shimmed("python3")
        .arg("-c")
        .arg(script)
        .arg(&a)
        .arg(&b)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = vec![0u8; (MIB + 7) as usize];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    assert!(first == content(5, MIB + 7));
    assert_eq!(delta(&before, &d.counters()), from_cache(1));
    assert!(d.stop(), "clean shutdown");
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(
        out.stdout == content(6, MIB + 9),
        "read from the backing store"
    );
}

#[test]
fn paths_outside_the_roots_writes_and_a_disabled_shim_pass_through() {
    let bed = Bed::new();
    let outside = bed.tmp.path().join("outside/f.bin");
    write_file(&outside, 7, 300 * KIB);
    let inside = bed.path("f.bin");
    write_file(&inside, 8, 300 * KIB);
    let d = bed.start(&["--block-size", "64KiB"]);
    read_all(&bed.client(), &inside).unwrap();

    let before = d.counters();
    assert!(ok(bed.shimmed("cat").arg(&outside)) == content(7, 300 * KIB));

    // Create, truncate and append under the root.
    let written = bed.path("new/out.txt");
    std::fs::create_dir_all(written.parent().unwrap()).unwrap();
    ok(bed
        .shimmed("sh")
        .arg("-c")
        .arg("echo x > \"$1\"; echo y >> \"$1\"")
        .arg("sh")
        .arg(&written));
    assert_eq!(std::fs::read(&written).unwrap(), b"x\ny\n");
    assert_eq!(d.counters().opens, before.opens, "the daemon was not asked");

    if have_python() {
        // Read-write and switched off: the backing file itself.
        let script = "import os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
print(os.readlink(f'/proc/self/fd/{fd}'))";
        let out = python(&bed, script, &[&inside]);
        assert_eq!(
            String::from_utf8_lossy(&out).trim(),
            inside.to_str().unwrap()
        );
        let script = "import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print(os.readlink(f'/proc/self/fd/{fd}'))";
        let out = ok(bed
            .shimmed("python3")
            .env("SHARDCACHE_PRELOAD", "0")
            .args(["-c", script])
            .arg(&inside));
        assert_eq!(
            String::from_utf8_lossy(&out).trim(),
            inside.to_str().unwrap()
        );
        assert_eq!(d.counters().opens, before.opens, "the daemon was not asked");
    }
}

#[test]
fn descriptors_are_the_local_copy_with_the_flags_asked_for() {
    if !have_python() {
        return;
    }
    let bed = Bed::new();
    let p = bed.path("d/f.bin");
    write_file(&p, 9, 200 * KIB);
    let d = bed.start(&["--block-size", "64KiB"]);
    read_all(&bed.client(), &p).unwrap();

    // Each line: how the file was opened, where its descriptor points, whether it is
    // inherited by exec'd programs, and whether its bytes are right.
    let script = "import ctypes, os, sys
path, want = sys.argv[1], open(sys.argv[2], 'rb').read()
libc = ctypes.CDLL(None, use_errno=True)
libc.fopen.restype = ctypes.c_void_p
libc.fileno.argtypes = [ctypes.c_void_p]
def report(how, fd):
    got = os.pread(fd, len(want) + 1, 0)
    print(how, os.readlink(f'/proc/self/fd/{fd}'), os.get_inheritable(fd), got == want)
report('open', libc.open(path.encode(), os.O_RDONLY))
report('open-cloexec', libc.open(path.encode(), os.O_RDONLY | os.O_CLOEXEC))
report('open64-nonblock', libc.open64(path.encode(), os.O_RDONLY | os.O_NONBLOCK))
report('fopen-rb', libc.fileno(libc.fopen(path.encode(), b'rb')))
report('fopen-re', libc.fileno(libc.fopen(path.encode(), b're')))
report('fopen-r+', libc.fileno(libc.fopen(path.encode(), b'r+')))
report('open-nofollow', libc.open(path.encode(), os.O_RDONLY | os.O_NOFOLLOW))
dirfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
report('openat', os.open(os.path.basename(path), os.O_RDONLY, dir_fd=dirfd))
os.chdir(os.path.dirname(path))
report('relative-dotdot', os.open('../d/./' + os.path.basename(path), os.O_RDONLY))
ctypes.set_errno(0)
fd = libc.open(path.encode() + b'/', os.O_RDONLY)
print('trailing-slash', fd, os.strerror(ctypes.get_errno()))";
    // The expected bytes come from a file outside the roots (read through the shim too).
    let want = bed.tmp.path().join("want.bin");
    std::fs::write(&want, content(9, 200 * KIB)).unwrap();
    let before = d.counters();
    let out = String::from_utf8(python(&bed, script, &[&p, &want])).unwrap();
    let cache = bed.cache.to_str().unwrap();
    let backing = p.to_str().unwrap();
    let expect = [
        ("open", cache, "True"),
        ("open-cloexec", cache, "False"),
        ("open64-nonblock", cache, "True"),
        ("fopen-rb", cache, "True"),
        ("fopen-re", cache, "False"),
        ("fopen-r+", backing, "True"),
        ("open-nofollow", backing, "True"),
        ("openat", cache, "False"),
        ("relative-dotdot", cache, "False"),
    ];
    let lines: Vec<Vec<&str>> = out.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(lines.len(), expect.len() + 1, "{out}");
    for (line, (how, dir, inherited)) in lines.iter().zip(expect) {
        assert_eq!(line[0], how, "{out}");
        assert!(line[1].starts_with(dir), "{how}: {}, not in {dir}", line[1]);
        assert_eq!(line[2], inherited, "{how}: inheritable");
        assert_eq!(line[3], "True", "{how}: right bytes");
    }
    assert_eq!(
        lines[expect.len()],
        ["trailing-slash", "-1", "Not", "a", "directory"],
        "the real call ran, errno included"
    );
    let served = expect.iter().filter(|e| e.1 == cache).count() as u64;
    assert_eq!(delta(&before, &d.counters()), from_cache(served));
}

#[test]
fn many_threads_read_through_the_shim() {
    if !have_python() {
        return;
    }
    let bed = Bed::new();
    let n = 16;
    let len = |i: u64| 256 * KIB + i * 1000;
    for i in 0..n {
        write_file(&bed.path(&format!("t/{i}.bin")), 100 + i, len(i));
    }
    let d = bed.start(&["--block-size", "64KiB"]);
    for i in 0..n {
        read_all(&bed.client(), &bed.path(&format!("t/{i}.bin"))).unwrap();
    }
    // The main thread reads one file first (the shim then knows the roots), then 8
    // threads read all 16; the files' bytes, concatenated in order, go to stdout.
    let script = "import sys
from concurrent.futures import ThreadPoolExecutor
def read(p):
    with open(p, 'rb') as f:
        return f.read()
read(sys.argv[1])
with ThreadPoolExecutor(max_workers=8) as pool:
    for data in pool.map(read, sys.argv[1:]):
        sys.stdout.buffer.write(data)";
    let paths: Vec<_> = (0..n).map(|i| bed.path(&format!("t/{i}.bin"))).collect();
    let args: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
    let before = d.counters();
    let out = python(&bed, script, &args);
    let want: Vec<u8> = (0..n).flat_map(|i| content(100 + i, len(i))).collect();
    assert!(out == want, "every byte of every file, right");
    assert_eq!(delta(&before, &d.counters()), from_cache(n + 1));
}

#[test]
fn forked_children_read_through_their_own_client() {
    if !have_python() {
        return;
    }
    let bed = Bed::new();
    for i in 0..4 {
        write_file(&bed.path(&format!("w/{i}.bin")), 200 + i, 100 * KIB + i);
    }
    let d = bed.start(&["--block-size", "64KiB"]);
    for i in 0..4 {
        read_all(&bed.client(), &bed.path(&format!("w/{i}.bin"))).unwrap();
    }
    // The parent reads through the shim (making its client), then forks one child per
    // file, as a data loader's workers; each child copies its file out of the roots.
    let script = "import os, sys
out, files = sys.argv[1], sys.argv[2:]
open(files[0], 'rb').read()
pids = []
for i, f in enumerate(files):
    pid = os.fork()
    if pid == 0:
        data = open(f, 'rb').read()
        with open(os.path.join(out, str(i)), 'wb') as o:
            o.write(data)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0";
    let out = bed.tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let paths: Vec<_> = (0..4).map(|i| bed.path(&format!("w/{i}.bin"))).collect();
    let mut args: Vec<&Path> = vec![&out];
    args.extend(paths.iter().map(|p| p.as_path()));
    let before = d.counters();
    python(&bed, script, &args);
    for i in 0..4u64 {
        let got = std::fs::read(out.join(i.to_string())).unwrap();
        assert!(got == content(200 + i, 100 * KIB + i), "child {i}'s bytes");
    }
    assert_eq!(delta(&before, &d.counters()), from_cache(5));
}

#[test]
fn a_second_uid_reads_through_the_shim_only_what_it_may() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to run programs as another uid");
        return;
    }
    let bed = Bed::new();
    let (private, public) = (bed.path("private.bin"), bed.path("public.bin"));
    write_file(&private, 10, 100 * KIB);
    std::fs::set_permissions(&private, PermissionsExt::from_mode(0o600)).unwrap();
    write_file(&public, 11, 100 * KIB);
    std::fs::set_permissions(&public, PermissionsExt::from_mode(0o644)).unwrap();
    let d = bed.start(&["--block-size", "64KiB"]);
    read_all(&bed.client(), &private).unwrap();
    read_all(&bed.client(), &public).unwrap();

    let cat_as_nobody = |f: &Path| {
        bed.shimmed("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
            .arg(f)
            .output()
            .unwrap()
    };
    let before = d.counters();
    let out = cat_as_nobody(&private);
    assert!(!out.status.success(), "uid 65534 must not read it");
    assert!(out.stdout.is_empty(), "no byte leaked");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"));
    let after = d.counters();
    assert_eq!(after.refused_denied - before.refused_denied, 1);
    let out = cat_as_nobody(&public);
    assert!(out.status.success(), "{}", show(&out));
    assert!(out.stdout == content(11, 100 * KIB));
    assert_eq!(
        d.counters().opens_full - after.opens_full,
        1,
        "from the cache"
    );

    // A process that drops its privileges after reading through the shim: what it
    // opens afterwards is judged with its new credentials, not its pooled root
    // connections'.
    if !have_python() {
        return;
    }
    let script = "import os, sys
private, public = sys.argv[1:3]
open(private, 'rb').read()
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
try:
    open(private, 'rb')
    sys.exit('LEAK: the private file opened after dropping privileges')
except PermissionError:
    pass
sys.stdout.buffer.write(open(public, 'rb').read())";
    let before = d.counters();
    let out = python(&bed, script, &[&private, &public]);
    assert!(out == content(11, 100 * KIB));
    let after = d.counters();
    assert_eq!(after.refused_denied - before.refused_denied, 1);
    assert_eq!(
        after.opens_full - before.opens_full,
        2,
        "as root, then as 65534"
    );
}
