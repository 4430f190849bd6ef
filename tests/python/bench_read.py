"""Python read throughput through the cache ÷ plain reads of the same local cache files.

Usage: bench_read.py SHARDCACHED PRELOAD_SO [--dir DIR] [--rounds N]

Starts a real shardcached on generated data, warms the cache, then, for large files and
for small files, in alternating rounds:
- baseline: ``builtins.open(local_copy).read()`` of the daemon's own cache files;
- ``shardcache.open(backing_path).read()``, and the same files through
  ``Client.open_ahead`` (the daemon opens the next batch while this one is read);
- in child processes (so both sides pay the same start-up): plain ``open`` of the local
  cache files, and plain ``open`` of the backing paths with the LD_PRELOAD shim.
Both sides read from the page cache (the files were just read), so the ratio measures
what the cache's path costs on top of a local read. Prints medians of per-round ratios.
"""

import argparse
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import shardcache

CHILD = r"""
import sys, time
paths = sys.argv[1:]
t = time.perf_counter()
n = 0
for p in paths:
    with open(p, "rb") as f:
        n += len(f.read())
print(n, time.perf_counter() - t)
"""


def write(p: pathlib.Path, n: int, seed: int) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    block = bytes((seed * 131 + i * 7) % 251 for i in range(65536))
    with open(p, "wb") as f:
        left = n
        while left:
            k = min(left, len(block))
            f.write(block[:k])
            left -= k


def timed(read, paths):
    t = time.perf_counter()
    n = 0
    for p in paths:
        n += read(p)
    return n, time.perf_counter() - t


def child(paths, env):
    out = subprocess.run([sys.executable, "-c", CHILD, *paths], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout.split()
    return int(out[0]), float(out[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shardcached")
    ap.add_argument("preload")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--large", type=int, default=16, help="files of 16 MiB")
    ap.add_argument("--small", type=int, default=2000, help="files of 100 KiB")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=a.dir, prefix="sc-pybench-") as tmp:
        tmp = pathlib.Path(tmp)
        root = tmp / "backing"
        sets = {
            "large (16 MiB)": [root / f"large/{i:03}" for i in range(a.large)],
            "small (100 KiB)": [root / f"small/{i:05}" for i in range(a.small)],
        }
        for i, p in enumerate(sets["large (16 MiB)"]):
            write(p, 16 << 20, i)
        for i, p in enumerate(sets["small (100 KiB)"]):
            write(p, 100 << 10, i)
        sock = str(tmp / "sc.sock")
        log = open(tmp / "daemon.log", "wb")
        d = subprocess.Popen([a.shardcached, "--backing-root", str(root), "--cache-dir", str(tmp / "cache"),
                              "--socket", sock, "--min-free", "0", "--metrics-listen", "off"], stdout=log, stderr=log)
        try:
            c = shardcache.Client(sock, timeout=5, wait_timeout=60)
            for _ in range(500):
                try:
                    c.status()
                    break
                except OSError:
                    time.sleep(0.02)
            print(f"python read throughput, {a.rounds} alternating rounds, page-cached; medians of per-round ratios")
            print(f"{'files':<16} {'plain open (MiB/s)':>19} {'shardcache.open':>16} {'ratio':>6} | "
                  f"{'open_ahead':>11} {'ratio':>6} | {'plain, child':>13} {'LD_PRELOAD':>11} {'ratio':>6}")
            env_plain = dict(os.environ)
            env_plain.pop("LD_PRELOAD", None)
            env_pre = dict(env_plain, LD_PRELOAD=os.path.abspath(a.preload), SHARDCACHE_SOCKET=sock)
            for name, paths in sets.items():
                # Enough bytes per measurement (≥ 600 MiB) that one hiccup does not decide it.
                reps = max(1, (600 << 20) // sum(os.path.getsize(p) for p in paths))
                local = []
                for p in paths:
                    with c.open(p, buffering=0) as f:
                        lp = f.local_path()
                    if lp is None:
                        raise SystemExit(f"{p} is not cached whole: see {tmp / 'daemon.log'}")
                    local.append(lp)
                local = local * reps
                spaths = [str(p) for p in paths] * reps

                def plain(p):
                    with open(p, "rb") as f:
                        return len(f.read())

                def cached(p):
                    with c.open(p) as f:
                        return len(f.read())

                def ahead(ps):
                    t = time.perf_counter()
                    n = 0
                    for f in c.open_ahead(ps):
                        with f:
                            n += len(f.read())
                    return n, time.perf_counter() - t

                r_sc, r_pre, r_ah, mb = [], [], [], []
                for r in range(a.rounds):
                    first, second = (plain, cached) if r % 2 == 0 else (cached, plain)
                    t1 = timed(first, local if first is plain else spaths)
                    t2 = timed(second, local if second is plain else spaths)
                    (nb, tb), (ns, ts) = (t1, t2) if first is plain else (t2, t1)
                    assert nb == ns
                    if r % 2 == 0:
                        cb, cp = child(local, env_plain), child(spaths, env_pre)
                    else:
                        cp, cb = child(spaths, env_pre), child(local, env_plain)
                    assert cb[0] == cp[0] == nb
                    na, ta = ahead(spaths)
                    assert na == nb
                    r_sc.append(tb / ts)
                    r_pre.append(cb[1] / cp[1])
                    r_ah.append(tb / ta)
                    mb.append((nb / 2**20 / tb, nb / 2**20 / ts, nb / 2**20 / cb[1], nb / 2**20 / cp[1],
                               nb / 2**20 / ta))
                m = [statistics.median(x[i] for x in mb) for i in range(5)]
                print(f"{name:<16} {m[0]:>19.0f} {m[1]:>16.0f} {statistics.median(r_sc):>6.2f} | "
                      f"{m[4]:>11.0f} {statistics.median(r_ah):>6.2f} | "
                      f"{m[2]:>13.0f} {m[3]:>11.0f} {statistics.median(r_pre):>6.2f}")
            st = c.status()["counters"]
            print(f"daemon: {st.get('opens', 0)} opens, {st.get('opens_full', 0)} found the file cached whole; "
                  f"backing reads {st.get('backing_reads', 0)} (all during warm-up)")
            print("goal: ratio ≥ 0.9 for shardcache.open and for the shim")
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(timeout=30)


if __name__ == "__main__":
    main()
