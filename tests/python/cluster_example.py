#!/usr/bin/env python3
"""docs/PYTHON.md's complete example, as written, on a cluster of network namespaces.

Issue 15's check that the documented usage engages the cluster placement: the
example's code block is taken from docs/PYTHON.md verbatim (only ``DATASET`` and
``EPOCHS`` are set, through the environment it reads) and started with ``torchrun
--nnodes N --nproc-per-node R`` on every node of ``../shared/testbed/cluster-net.sh``
(each node a network namespace behind a bridge, links shaped with tbf), each node with
its own ``shardcached`` (its own cache directory and socket, peers on, a cache of
``a`` x the dataset / N). The dataset is ImageNet-like: class directories of ``.JPEG``
files, log-normal sizes around ``--kib``.

It prints, over the run (the example trains nothing, so an epoch takes seconds: too
short to tell epochs apart, or for the placement to move copies in time; the placement
per epoch is ``shardcache-bench placement --testbed``): backing bytes (the daemons' and
the clients' fallbacks) / the dataset next to the floor, opens that found their file
whole on the reader's node, blocks from peers, fills refused for room, and cache use /
capacity; then whether every rank of the run registered one job (one id on every node,
R lease holders on each, a layout of N nodes), its exit status saying so (1 if not).
Root only; not part of CI (it needs torch: run it through
``scripts/bench-cluster.sh``, which installs torch into ``target/torch-venv``).
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def example_code() -> str:
    """The Python block of docs/PYTHON.md's "A complete PyTorch example", verbatim."""
    text = (REPO / "docs" / "PYTHON.md").read_text()
    section = text.split("## A complete PyTorch example", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def make_dataset(root: Path, files: int, kib: int, classes: int) -> int:
    """ImageNet-like files under ``root/cNNN/``: log-normal sizes (sigma 0.5 of the log)
    with mean ``kib`` KiB. Returns the total bytes."""
    rng = random.Random(7)
    sigma = 0.5
    median = kib * 1024 / math.exp(sigma * sigma / 2)
    total = 0
    for i in range(files):
        size = int(min(max(median * math.exp(rng.gauss(0, sigma)), 4096), 16 * kib * 1024))
        d = root / f"c{i % classes:03}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"x{i:06}.JPEG").write_bytes(rng.randbytes(size))
        total += size
    return total


def status(cli: Path, sock: Path) -> dict | None:
    """The daemon's status (``shardcache status --json``), or None while it does not answer."""
    r = subprocess.run(
        [str(cli), "--socket", str(sock), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return json.loads(r.stdout) if r.returncode == 0 else None


def poller(sock: Path, failures: list):
    """A quicker [`status`] for polling: the Python client in this process. A poll that
    fails appends (when, seconds it took, the error) to ``failures``."""
    import shardcache

    c = shardcache.Client(socket=str(sock), timeout=5)

    def poll() -> dict | None:
        t0 = time.monotonic()
        try:
            return c.status()
        except OSError as e:
            failures.append((t0, time.monotonic() - t0, f"{type(e).__name__}: {e}"))
            return None

    return poll


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", default=str(REPO.parent / "shared" / "testbed" / "cluster-net.sh"))
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--files", type=int, default=8000)
    ap.add_argument("--kib", type=int, default=110)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--a", type=float, default=1.0, help="aggregate cache / dataset")
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--release", default=str(REPO / "target" / "release"))
    ap.add_argument("--timeline", help="write every poll's per-node counters here (JSON)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("root only (network namespaces)", file=sys.stderr)
        return 2
    rel = Path(a.release)
    daemon_bin, cli = rel / "shardcached", rel / "shardcache"
    torchrun = Path(sys.executable).parent / "torchrun"
    for p in (daemon_bin, cli, torchrun):
        if not p.exists():
            print(f"missing {p}", file=sys.stderr)
            return 2
    n, r = a.nodes, a.nproc_per_node
    tmp = Path(tempfile.mkdtemp(prefix="sc-cluster-example-", dir=a.dir))
    procs: list[subprocess.Popen] = []
    bed_up = False
    try:
        data = tmp / "train"
        total = make_dataset(data, a.files, a.kib, a.classes)
        (tmp / "train.py").write_text(example_code())
        (tmp / "secret").write_text("cluster example shared secret")
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if any(line.startswith(("sc-n", "sc-br")) for line in listed.splitlines()):
            print("a testbed is already up (ip netns list shows sc-*): take it down first", file=sys.stderr)
            return 2
        subprocess.run([a.testbed, "up", str(n), a.link], check=True)
        bed_up = True
        addr = [
            subprocess.run([a.testbed, "addr", str(k)], capture_output=True, text=True, check=True).stdout.strip()
            for k in range(1, n + 1)
        ]
        capacity = int(a.a * total / n)
        socks = [tmp / f"node-{k}.sock" for k in range(1, n + 1)]
        daemons = []
        for k in range(1, n + 1):
            peers = [x for j in range(1, n + 1) if j != k for x in ("--peer", f"{addr[j - 1]}:7411")]
            cmd = [
                "ip", "netns", "exec", f"sc-n{k}", str(daemon_bin),
                "--backing-root", str(data),
                "--cache-dir", str(tmp / f"cache-{k}"),
                "--socket", str(socks[k - 1]),
                "--capacity", str(capacity),
                "--min-free", "0",
                "--peer-listen", f"{addr[k - 1]}:7411",
                "--peer-secret-file", str(tmp / "secret"),
                "--metrics-listen", "off",
                *peers,
            ]
            log = open(tmp / f"daemon-{k}.log", "w")
            d = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            procs.append(d)
            daemons.append(d)
        deadline = time.monotonic() + 30
        for s in socks:
            while status(cli, s) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon at {s} did not answer within 30 s")
                time.sleep(0.1)
        runs = []
        for k in range(1, n + 1):
            env = dict(
                os.environ,
                SHARDCACHE_SOCKET=str(socks[k - 1]),
                DATASET=str(data),
                EPOCHS=str(a.epochs),
                GLOO_SOCKET_IFNAME=f"scv{k}",
                OMP_NUM_THREADS="1",
            )
            cmd = [
                "ip", "netns", "exec", f"sc-n{k}", str(torchrun),
                "--nnodes", str(n), "--nproc-per-node", str(r), "--node-rank", str(k - 1),
                "--master-addr", addr[0], "--master-port", "29500",
                str(tmp / "train.py"),
            ]
            log = open(tmp / f"torchrun-{k}.log", "w")
            p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
            procs.append(p)
            runs.append(p)
        started = time.monotonic()
        # Each node polled by a thread of its own every 0.1 s (a slow answer from one
        # node delays no other node's polls): (t, status or None) per node.
        samples: list[list] = [[] for _ in range(n)]
        failures: list[list] = [[] for _ in range(n)]
        done = threading.Event()

        def poll_node(k: int) -> None:
            poll = poller(socks[k], failures[k])
            while not done.is_set():
                st = poll()
                samples[k].append((time.monotonic() - started, st))
                done.wait(0.1)

        pollers = [threading.Thread(target=poll_node, args=(k,), daemon=True) for k in range(n)]
        for t in pollers:
            t.start()
        limit = 600 + 120 * a.epochs
        try:
            while any(p.poll() is None for p in runs):
                if time.monotonic() - started > limit:
                    raise RuntimeError(f"the run took over {limit} s")
                time.sleep(0.2)
        finally:
            done.set()
            for t in pollers:
                t.join(timeout=15)
        jobs_seen: list[set] = [set() for _ in range(n)]
        holders = [0] * n
        layout_nodes = [0] * n
        for k in range(n):
            for _, st in samples[k]:
                for j in (st or {}).get("jobs", []):
                    jobs_seen[k].add(j["job"])
                    holders[k] = max(holders[k], j.get("lease_holders", 0))
                    layout_nodes[k] = max(layout_nodes[k], j.get("placement_nodes", 0))
        final = [status(cli, s) for s in socks]
        if any(st is None for st in final):
            raise RuntimeError("a daemon did not answer its final status")
        rcs = [p.returncode for p in runs]
        wall = time.monotonic() - started
        print(
            f"docs/PYTHON.md's example, as written: {n} nodes of the testbed (tbf {a.link}), "
            f"torchrun --nproc-per-node {r} on each ({n * r} ranks), {a.files} files in {a.classes} class "
            f"directories, log-normal around {a.kib} KiB ({total / 2**30:.2f} GiB), a = {a.a} "
            f"(each cache {capacity / 2**20:.0f} MiB), {a.epochs} epochs; wall {wall:.0f} s; torchrun exit codes {rcs}"
        )

        def summed(sts, key):
            return sum(st["counters"][key] for st in sts)

        # Over the whole run (fresh daemons: their counters start at 0). The example's
        # loop trains nothing, so an epoch takes a few seconds here: too short to tell
        # epochs apart by polling, and shorter than the placement needs to move copies
        # (`shardcache-bench placement --testbed` measures the placement per epoch).
        daemon_back = summed(final, "backing_bytes")
        fallback = summed(final, "fallback_bytes")
        opens, full = summed(final, "opens"), summed(final, "opens_full")
        floor = 1 + (a.epochs - 1) * max(0.0, 1.0 - a.a)
        uses = [st["used_bytes"] / max(st["capacity_bytes"], 1) for node in samples for _, st in node if st]
        print(
            f"over the run: backing {(daemon_back + fallback) / total:.3f} of the dataset (floor {floor:.3f}: "
            f"the cold epoch, then max(0, 1 - a) per epoch; the daemons {daemon_back / total:.3f}, the clients' "
            f"fallbacks {fallback / total:.3f}); opens that found the file on the node {full / max(opens, 1):.3f} "
            f"of {opens}; blocks from peers {summed(final, 'peer_blocks_in')}; fills refused for room "
            f"{summed(final, 'fills_no_space')}; cache use mean {(sum(uses) / len(uses)) if uses else 0:.2f}, "
            f"peak {max(uses, default=0):.2f}"
        )
        # Per epoch, each node by its own opens: its ranks open the same number of files
        # every epoch (its final opens / the epochs), so a poll's count of a node's opens
        # says which epoch its loaders are reading (to the gap between its polls: 0.1 s
        # and the time the daemon takes to answer), whatever the
        # daemon's view of the job. Every poll's growth of a node's counters goes to that
        # epoch, so the rows add up to the run's totals. A node's backing reads include
        # the files it reads for its peers (a file's owner reads the backing store) and
        # its prefetch of the next epoch's files.
        per_epoch: dict = {}  # epoch -> summed growth of ROW_KEYS
        row_keys = ["backing_bytes", "fallback_bytes", "opens", "opens_full", "backlog_full",
                    "evicted_files", "peer_blocks_in"]
        for k in range(n):
            last = {key: 0 for key in row_keys}
            per_node = max(final[k]["counters"]["opens"] // a.epochs, 1)
            polls_k = [st for _, st in samples[k]] + [final[k]]
            for st in polls_k:
                if st is None:
                    continue
                c = st["counters"]
                epoch = min(max(c["opens"] - 1, 0) // per_node, a.epochs - 1)
                row = per_epoch.setdefault(epoch, {key: 0 for key in row_keys})
                for key in row_keys:
                    row[key] += c[key] - last[key]
                    last[key] = c[key]
        rows = []
        for e in sorted(per_epoch):
            x = per_epoch[e]
            rows.append(
                f"{e}: backing {(x['backing_bytes'] + x['fallback_bytes']) / total:.3f}, local "
                f"{x['opens_full'] / max(x['opens'], 1):.3f} of {x['opens']}, backlog full {x['backlog_full']}, "
                f"evicted {x['evicted_files']}, peer blocks {x['peer_blocks_in']}"
            )
        print("per epoch (each node by its own opens): " + "; ".join(rows))
        # Polls a daemon did not answer (its status call timed out at 5 s, or the
        # client's breaker sent it nowhere for 2 s after one): when, and why.
        for k in range(n):
            if not failures[k]:
                continue
            kinds: dict = {}
            for t0, dt, err in failures[k]:
                kind = err.split(":", 1)[0] + (" (timed out)" if dt >= 4.5 else "")
                kinds[kind] = kinds.get(kind, 0) + 1
            first, last = failures[k][0][0] - started, failures[k][-1][0] - started
            print(
                f"node {k}: {len(failures[k])} polls unanswered between {first:.0f} s and {last:.0f} s, "
                f"longest {max(f[1] for f in failures[k]):.1f} s; {kinds}; first error: {failures[k][0][2]}"
            )
        if a.timeline:
            with open(a.timeline, "w") as f:
                json.dump(
                    [
                        [
                            {
                                "t": round(t, 2),
                                **(
                                    {}
                                    if st is None
                                    else {
                                        "epoch": [j["epoch"] for j in st.get("jobs", [])],
                                        **{key: st["counters"][key] for key in row_keys + ["blocks_filled", "backing_reads", "waits"]},
                                        "used_bytes": st["used_bytes"],
                                    }
                                ),
                            }
                            for t, st in node
                        ]
                        for node in samples
                    ],
                    f,
                )
        keys = ["backing_reads", "peer_blocks_in", "peer_blocks_out", "peer_errors", "peer_refused",
                "queue_shed", "backlog_full", "fills_no_space", "evicted_files", "handoffs", "waits",
                "wait_timeouts"]
        print("daemons' counters (per node): " + ", ".join(
            f"{k} {[st['counters'][k] for st in final]}" for k in keys))
        reasons: dict = {}
        for st in final:
            for f in st.get("fallbacks", []):
                reasons[f["reason"]] = reasons.get(f["reason"], 0) + f["opens"]
        print(f"clients' fallbacks by reason (opens): {dict(sorted(reasons.items()))}")
        ids = set().union(*jobs_seen)
        one = len(ids) == 1 and all(len(s) == 1 for s in jobs_seen)
        print(
            f"jobs: {sorted(ids)} ({'one id on every node' if one else 'NOT one id'}); lease holders per node "
            f"{holders} (ranks per node {r}); layout nodes per node {layout_nodes} (of {n})"
        )
        ok = one and all(h == r for h in holders) and all(m == n for m in layout_nodes) and all(c == 0 for c in rcs)
        print("placement engaged by the documented usage: " + ("yes" if ok else "NO"))
        if not ok:
            for k in range(1, n + 1):
                print(f"--- torchrun-{k}.log (tail)")
                print("".join((tmp / f"torchrun-{k}.log").read_text().splitlines(True)[-15:]))
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if bed_up:
            subprocess.run([a.testbed, "down"], check=False)
        if os.environ.get("KEEP") is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


if __name__ == "__main__":
    sys.exit(main())
