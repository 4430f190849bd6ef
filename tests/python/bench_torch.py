"""End-to-end PyTorch benchmark (issue 14): a real DataLoader reading slow shared storage.

Not part of CI (needs torch and root). ``./scripts/bench-torch.sh`` builds the release
daemon, shim and CLI, makes ``target/torch-venv`` (torch, fsspec, the local ``shardcache``
package) and runs this script; extra arguments come here (``--help``).

What it does
------------
1. Generates, under ``target/bench-torch/export-<parameters>/`` (kept between runs): ``small/``: ``--small-files`` files of ``--file-kib`` KiB
   of random bytes in subdirectories of 1 000; ``shards/``: ``--shards`` real tar files of
   about ``--shard-mib`` MiB each (samples of ``--file-kib`` KiB); ``calib/``: 4 × 32 MiB.
2. Mounts the export with ``slow-storage.sh up EXPORT MNT RATE`` (sshfs over a veth pair
   shaped with tc tbf; ``--slow-storage`` / ``$SLOW_STORAGE``, default
   ``../shared/testbed/slow-storage.sh`` from the repository root) and measures the link
   rate B by reading ``calib/`` over the mount with 4 threads, page cache dropped.
3. For each dataset (small files, tar shards) runs these rows, ``--epochs`` epochs each,
   every row in a fresh child process (so the shim is loaded at its start):

   - ``plain``: builtin ``open`` on the mount, no daemon;
   - ``sc-full``: ``shardcache.open`` / ``open_many`` + ``DistributedShuffleSampler(files=…)``,
     cache capacity 1.1 × dataset;
   - ``sc-half``: the same with capacity = dataset / 2;
   - ``shim``: builtin ``open`` with ``LD_PRELOAD=libshardcache_preload.so``, capacity
     1.1 × dataset. The shim registers nothing: the sampler is shardcache's
     ``DistributedShuffleSampler`` *without* ``files=`` (the same order, no plan);
   - ``fsspec``: ``simplecache::file://`` over the mount (unbounded, cache on local disk).

   The daemon (release ``shardcached``, backing root = the mount, cache dir on local disk)
   is started afresh with an empty cache for every row that uses it, inside a cgroup-v1
   memory cgroup ``/sys/fs/cgroup/memory/shardcache-bench-<pid>`` limited to
   ``--cgroup-mib`` (the page cache its fills write is charged there), and
   ``sync; echo 3 > /proc/sys/vm/drop_caches`` runs before *every* epoch of every row:
   no epoch is served from page cache warmed by an earlier one (plain rows included).

   sshfs (mounted without ``-o use_ino``) numbers inodes afresh when the kernel forgets
   them, which ``drop_caches`` makes it do; the daemon's version of a backing file
   includes its inode, so after each drop every file would look changed to a daemon that
   has no immutable manifest for it (the shim rows). The parent therefore holds an
   ``O_PATH`` descriptor of every file of the dataset while its rows run (inode numbers
   stay put, as on a shared file system with stable inodes; page cache is still dropped);
   ``--no-pin-inodes`` turns that off.

The loader: ``DataLoader(num_workers=4, persistent_workers=True, prefetch_factor=2)``;
small files in batches of 64 through ``Dataset.__getitems__`` (``open_many`` as in
docs/PYTHON.md); shards with ``batch_size=None``, each item a shard read as a stream
(``tarfile.open(fileobj=f, mode="r|")``). Items return byte counts and a checksum byte,
not the bytes, so inter-process copies do not weigh on a small machine.

Simulated compute: the loop sleeps ``compute = F × bytes / B`` per batch (F =
``--compute-frac``, 0.35 by default as in issue 14's table: local reads keep the loop
compute-bound, the link does not).

Per epoch (printed, and saved to ``target/bench-torch/results.json`` and ``results.md``):

- wall: seconds from ``sampler.set_epoch`` (which registers the plan in epoch 0) to the
  end of the last batch's compute;
- stall = (time blocked in ``next(loader)``) / wall; AU = compute / wall;
- stall floor: M = bytes that must cross the link this epoch (the dataset N for ``plain``
  and for every row's epoch 0; 0 later for caches ≥ N; (1 − C/N)·N later for the half
  cache), T_need = M / B, compute T_c: floor = max(0, T_need − T_c) / max(T_need, T_c)
  (the stall of a loop whose reads overlap compute perfectly at link rate B);
- link bytes: the host veth's ``rx_bytes`` delta (scveth0; includes ssh/TCP overhead, a few
  %), next to its floor M;
- the daemon's bytes read from the backing store (per job from ``status``, else daemon
  wide), opens that found their file cached whole (job and daemon-wide) and the job's
  position after the epoch, from ``shardcache.Client.status()``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
OUT = REPO / "target" / "bench-torch"
IFACE = "scveth0"
ROWS = ("plain", "sc-full", "sc-half", "shim", "fsspec")
DATASETS = ("small", "shards")
SEED = 42


def log(*a) -> None:
    print(*a, flush=True)


def rx_bytes() -> int:
    return int(pathlib.Path(f"/sys/class/net/{IFACE}/statistics/rx_bytes").read_text())


def drop_caches() -> None:
    os.sync()
    pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")


# ---------------------------------------------------------------------------------------
# Datasets


def gen_params(a) -> dict:
    return {"small_files": a.small_files, "file_kib": a.file_kib, "shards": a.shards,
            "shard_mib": a.shard_mib, "version": 1}


def generate(export: pathlib.Path, a) -> None:
    params = gen_params(a)
    marker = export / "params.json"
    if marker.exists() and json.loads(marker.read_text()) == params:
        log(f"datasets: {export} already generated with {params}")
        return
    log(f"datasets: generating {params} in {export}")
    if export.exists():
        shutil.rmtree(export)
    size = a.file_kib * 1024
    small = export / "small"
    for i in range(a.small_files):
        d = small / f"d{i // 1000:03d}"
        if i % 1000 == 0:
            d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:06d}.bin").write_bytes(os.urandom(size))
    shards = export / "shards"
    shards.mkdir(parents=True)
    per_shard = max(1, a.shard_mib * 1024 * 1024 // (size + 512))
    for s in range(a.shards):
        with tarfile.open(shards / f"shard-{s:04d}.tar", "w") as tar:
            for k in range(per_shard):
                info = tarfile.TarInfo(f"s{s:04d}/{k:06d}.bin")
                info.size = size
                info.mtime = 0
                tar.addfile(info, io.BytesIO(os.urandom(size)))
    calib = export / "calib"
    calib.mkdir()
    for c in range(4):
        (calib / f"c{c}.bin").write_bytes(os.urandom(32 << 20))
    marker.write_text(json.dumps(params))


def dataset_files(mnt: pathlib.Path, kind: str) -> list:
    if kind == "small":
        return sorted(str(p) for p in (mnt / "small").glob("d*/f*.bin"))
    return sorted(str(p) for p in (mnt / "shards").glob("shard-*.tar"))


def calibrate(mnt: pathlib.Path) -> float:
    """Bytes/s over the mount: 4 threads each read a 32 MiB file, page cache dropped."""
    files = sorted((mnt / "calib").glob("c*.bin"))
    drop_caches()

    def read(p):
        n = 0
        with open(p, "rb", buffering=0) as f:
            while True:
                b = f.read(1 << 20)
                if not b:
                    return n
                n += len(b)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        total = sum(ex.map(read, files))
    return total / (time.monotonic() - t0)


# ---------------------------------------------------------------------------------------
# The child: one row, all its epochs, in a fresh process


def child(spec: dict) -> None:
    import warnings

    # 4 workers on a small machine, and torch without numpy: expected here, not news.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    import torch  # noqa: F401  (imported before the loader for its workers)
    from torch.utils.data import DataLoader, Dataset

    import shardcache

    row, kind, files = spec["row"], spec["kind"], spec["files"]
    cache_dir = spec.get("fsspec_dir")

    def opener():
        if row in ("sc-full", "sc-half"):
            return shardcache.open
        if row == "fsspec":
            import fsspec

            fs = fsspec.filesystem("simplecache", target_protocol="file",
                                   cache_storage=cache_dir)
            return lambda p, mode="rb": fs.open(p, mode)
        return open  # plain, and shim (the preload shim redirects it)

    class Small(Dataset):
        def __init__(self, files):
            self.files = files
            self._open = None

        def __len__(self):
            return len(self.files)

        def _read(self, f):
            with f:
                data = f.read()
            return len(data), data[-1] if data else 0

        def __getitem__(self, i):
            if self._open is None:
                self._open = opener()
            return self._read(self._open(self.files[i], "rb"))

        def __getitems__(self, indices):
            if row in ("sc-full", "sc-half"):
                client = shardcache.default_client()  # this worker's own connection
                return [self._read(f) for f in client.open_many([self.files[i] for i in indices])]
            return [self[i] for i in indices]

    class Shards(Dataset):
        def __init__(self, files):
            self.files = files
            self._open = None

        def __len__(self):
            return len(self.files)

        def __getitem__(self, i):
            if self._open is None:
                self._open = opener()
            n = nbytes = check = 0
            with self._open(self.files[i], "rb") as f:
                with tarfile.open(fileobj=f, mode="r|") as tar:
                    for m in tar:
                        data = tar.extractfile(m).read()
                        n += 1
                        nbytes += len(data)
                        check ^= data[-1] if data else 0
            return n, nbytes, check

    data = Small(files) if kind == "small" else Shards(files)
    epochs = spec["epochs"]
    if row in ("sc-full", "sc-half"):
        sampler = shardcache.DistributedShuffleSampler(
            data, num_replicas=1, rank=0, seed=SEED, files=files, epochs=epochs)
    else:  # same order, nothing registered
        sampler = shardcache.DistributedShuffleSampler(data, num_replicas=1, rank=0, seed=SEED)
    loader = DataLoader(data, batch_size=64 if kind == "small" else None, sampler=sampler,
                        num_workers=4, persistent_workers=True, prefetch_factor=2,
                        collate_fn=(lambda b: b) if kind == "small" else None)
    client = shardcache.Client(spec["socket"], timeout=5) if spec.get("socket") else None
    per_byte = spec["compute_per_byte"]

    def status():
        if client is None:
            return None
        try:
            return client.status()
        except OSError:
            return None

    results = []
    for epoch in range(epochs):
        drop_caches()
        st0 = status()
        rx0 = rx_bytes()
        wait = compute = 0.0
        nbytes = nsamples = 0
        long_waits = []
        t0 = time.monotonic()
        started = time.time()  # wall clock, to line the epoch up with outside traces
        sampler.set_epoch(epoch)  # registers the plan (epoch 0): prefetch may start here
        it = iter(loader)
        while True:
            a = time.monotonic()
            try:
                batch = next(it)
            except StopIteration:
                wait += time.monotonic() - a
                break
            w = time.monotonic() - a
            wait += w
            if w > 0.02:  # where in the epoch the loop waited (results.json)
                long_waits.append((round(a - t0, 3), round(w, 3)))
            if kind == "small":
                b = sum(x[0] for x in batch)
                nsamples += len(batch)
            else:
                b = batch[1]
                nsamples += batch[0]
            nbytes += b
            c = b * per_byte
            time.sleep(c)
            compute += c
        wall = time.monotonic() - t0
        rx1 = rx_bytes()
        st1 = status()
        r = {"epoch": epoch, "started": started, "wall": wall, "wait": wait, "compute": compute,
             "bytes_read": nbytes, "samples": nsamples, "link_bytes": rx1 - rx0,
             "long_waits": long_waits}
        if st0 and st1:
            c0, c1 = st0["counters"], st1["counters"]
            for k in ("opens", "opens_full", "backing_bytes", "fallback_bytes", "fallback_opens",
                      "waits", "evicted_files", "fills_no_space", "hit_bytes", "filled_bytes",
                      "wait_timeouts", "handoffs", "backlog_full"):
                r["d_" + k] = c1.get(k, 0) - c0.get(k, 0)
            # Clients' fallbacks by reason (opens and reads reported in this epoch).
            f0 = {f["reason"]: f for f in st0.get("fallbacks", [])}
            r["d_fallbacks"] = {
                f["reason"]: [f["opens"] - f0.get(f["reason"], {}).get("opens", 0),
                              f["reads"] - f0.get(f["reason"], {}).get("reads", 0)]
                for f in st1.get("fallbacks", [])}
            r["d_fallbacks"] = {k: v for k, v in r["d_fallbacks"].items() if v != [0, 0]}
            r["space"] = {k: st1.get(k)
                          for k in ("capacity_bytes", "used_bytes", "files", "blocks")}
            job = getattr(sampler, "job", None)
            j0 = next((j for j in st0.get("jobs", []) if j["job"] == job), None)
            j1 = next((j for j in st1.get("jobs", []) if j["job"] == job), None)
            if j1:
                r["job"] = {k: v for k, v in j1.items() if not isinstance(v, (list, dict))}
                for k in ("opens", "opens_hit", "backing_bytes", "fallback_bytes", "hit_bytes",
                          "filled_bytes"):
                    r["job_d_" + k] = j1.get(k, 0) - (j0.get(k, 0) if j0 else 0)
        log(f"  epoch {epoch}: wall {wall:6.1f} s  stall {wait / wall:.2f}  AU {compute / wall:.2f}"
            f"  link {(rx1 - rx0) / 1e9:.3f} GB  read {nbytes / 1e9:.3f} GB"
            + (f"  daemon backing {r['d_backing_bytes'] / 1e9:.3f} GB"
               f"  full-hit opens {r['d_opens_full']}/{r['d_opens']}"
               f"  fallbacks (opens, reads) {r['d_fallbacks'] or 'none'}" if "d_opens" in r else "")
            + (f"  job hits {r['job_d_opens_hit']}/{r['job_d_opens']} step {r['job'].get('step')}"
               f"/{r['job'].get('epoch_len')} (epoch {r['job'].get('epoch')})"
               if "job" in r else ""))
        results.append(r)
    pathlib.Path(spec["out"]).write_text(json.dumps(results))
    del it, loader
    if hasattr(sampler, "close"):
        sampler.close()


# ---------------------------------------------------------------------------------------
# The parent: storage, daemon, rows, table


class Bench:
    def __init__(self, a):
        self.a = a
        self.export = OUT / (f"export-{a.small_files}x{a.file_kib}k-{a.shards}x{a.shard_mib}m")
        self.mnt = OUT / "mnt"
        self.slow = pathlib.Path(a.slow_storage)
        self.cgroup = pathlib.Path(f"/sys/fs/cgroup/memory/shardcache-bench-{os.getpid()}")
        self.daemon = None
        self.child = None
        self.mounted = False
        self.pinners = []

    # -- lifecycle
    def storage_up(self):
        subprocess.run([str(self.slow), "down", str(self.mnt)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.mounted = True
        subprocess.run([str(self.slow), "up", str(self.export), str(self.mnt), self.a.rate],
                       check=True)

    def storage_down(self):
        if self.mounted:
            subprocess.run([str(self.slow), "down", str(self.mnt)], check=False)
            self.mounted = False

    def start_daemon(self, capacity: int, cache: pathlib.Path, socket: str):
        import shardcache

        if cache.exists():
            shutil.rmtree(cache)
        cache.mkdir(parents=True)
        if not self.cgroup.exists():
            self.cgroup.mkdir()
        (self.cgroup / "memory.limit_in_bytes").write_text(str(self.a.cgroup_mib << 20))
        logf = open(OUT / "daemon.log", "ab")
        cmd = [str(REPO / "target/release/shardcached"), "--backing-root", str(self.mnt.resolve()),
               "--cache-dir", str(cache), "--socket", socket, "--capacity", str(capacity),
               "--min-free", "0", "--metrics-listen", "127.0.0.1:0", *self.a.daemon_arg]
        self.daemon = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"', "sh", *cmd],
            stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise RuntimeError(f"shardcached exited; see {OUT / 'daemon.log'}")
            try:
                shardcache.Client(socket, timeout=1).status()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("shardcached did not become ready in 30 s")

    def stop_daemon(self):
        if self.daemon is not None:
            if self.daemon.poll() is None:
                self.daemon.send_signal(signal.SIGTERM)
                try:
                    self.daemon.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.daemon.kill()
                    self.daemon.wait(timeout=30)
            self.daemon = None

    def cgroup_remove(self):
        if self.cgroup.exists():
            for _ in range(50):
                try:
                    self.cgroup.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)
            log(f"warning: could not remove {self.cgroup}")

    def stop_child(self):
        if self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.child.wait()
        self.child = None

    def cleanup(self):
        self.stop_child()
        self.unpin()
        self.stop_daemon()
        self.cgroup_remove()
        self.storage_down()

    # -- rows
    def run_row(self, row: str, kind: str, files: list, total: int, B: float) -> list:
        a = self.a
        spec = {"row": row, "kind": kind, "files": files, "epochs": a.epochs,
                "compute_per_byte": a.compute_frac / B, "out": str(OUT / "row.json")}
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        socket = str(OUT / "shardcached.sock")
        cache = OUT / "cache"
        fs_dir = OUT / "fsspec-cache"
        capacity = None
        if row in ("sc-full", "sc-half", "shim"):
            capacity = int(1.1 * total) if row != "sc-half" else total // 2
            self.start_daemon(capacity, cache, socket)
            spec["socket"] = socket
            env["SHARDCACHE_SOCKET"] = socket
            if row == "shim":
                env["LD_PRELOAD"] = str(REPO / "target/release/libshardcache_preload.so")
        if row == "fsspec":
            if fs_dir.exists():
                shutil.rmtree(fs_dir)
            fs_dir.mkdir(parents=True)
            spec["fsspec_dir"] = str(fs_dir)
        spec_path = OUT / "row-spec.json"
        spec_path.write_text(json.dumps(spec))
        log(f"{kind} / {row}" + (f" (cache capacity {capacity / 1e9:.3f} GB = "
                                  f"{capacity / total:.2f} × dataset)" if capacity else ""))
        try:
            self.child = subprocess.Popen([sys.executable, __file__, "--child", str(spec_path)],
                                          env=env, start_new_session=True)
            rc = self.child.wait()
            self.child = None
            if rc != 0:
                raise RuntimeError(f"row {kind}/{row} failed (exit {rc})")
            res = json.loads((OUT / "row.json").read_text())
        finally:
            self.stop_child()
            self.stop_daemon()
            for d in (cache, fs_dir):
                if d.exists():
                    shutil.rmtree(d)
        cn = (capacity / total) if row == "sc-half" else 1.0
        t_link = total / B
        for r in res:
            must = total if (row == "plain" or r["epoch"] == 0) else max(0.0, 1 - cn) * total
            t_need = must / B
            r["link_floor"] = must
            r["stall_floor"] = max(0.0, t_need - r["compute"]) / max(t_need, r["compute"], 1e-9)
            r["t_link"] = t_link
        return res

    def pin(self, files: list) -> None:
        """O_PATH descriptors of ``files`` (see the module's doc: stable sshfs inodes), held
        by helper processes (each within the descriptor limit) until :meth:`unpin`."""
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        per = max(1000, hard - 1024)
        for i in range(0, len(files), per):
            lst = OUT / f"pin-{i // per}.json"
            lst.write_text(json.dumps(files[i:i + per]))
            h = subprocess.Popen([sys.executable, __file__, "--pin", str(lst)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.pinners.append(h)
            if h.stdout.readline().strip() != b"pinned":
                raise RuntimeError("pinning the dataset's inodes failed")

    def unpin(self) -> None:
        for h in self.pinners:
            if h.poll() is None:
                h.kill()
            h.wait()
        self.pinners = []

    def run(self):
        a = self.a
        OUT.mkdir(parents=True, exist_ok=True)
        generate(self.export, a)
        self.storage_up()
        B = a.link_rate or calibrate(self.mnt)
        log(f"link: {B / 1e6:.1f} MB/s over the mount ({'given' if a.link_rate else 'measured'})")
        log("page cache: dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every epoch of "
            f"every row; the daemon runs in {self.cgroup} (memory.limit_in_bytes "
            f"{a.cgroup_mib} MiB)")
        out = {"args": vars(a), "link_bytes_per_s": B, "datasets": {}}
        for kind in a.dataset:
            files = dataset_files(self.mnt, kind)
            total = sum(os.path.getsize(p) for p in
                        (str(self.export / pathlib.Path(f).relative_to(self.mnt)) for f in files))
            comp = a.compute_frac * total / B
            log(f"\n== {kind}: {len(files)} files, {total / 1e9:.3f} GB; link-bound epoch "
                f"{total / B:.1f} s; compute {comp:.1f} s per epoch "
                f"({a.compute_frac} × link-bound; {a.compute_frac / B * 1e9:.3f} s per GB"
                + (f", {a.compute_frac / B * a.file_kib * 1024 * 1e3:.2f} ms per sample"
                   if kind == "small" else "") + ")")
            if a.pin_inodes:
                self.pin(files)
            try:
                rows = {}
                for row in a.row:
                    rows[row] = self.run_row(row, kind, files, total, B)
                    out["datasets"][kind] = {"files": len(files), "bytes": total, "rows": rows}
                    self.save(out)
            finally:
                self.unpin()
        return out

    def save(self, out):
        (OUT / "results.json").write_text(json.dumps(out, indent=1))
        (OUT / "results.md").write_text(table(out))


def table(out) -> str:
    a = out["args"]
    lines = [f"link B = {out['link_bytes_per_s'] / 1e6:.1f} MB/s ({a['rate']}); compute = "
             f"{a['compute_frac']} × bytes / B; page cache dropped before every epoch; daemon in "
             f"a {a['cgroup_mib']} MiB memory cgroup; inodes pinned: {a.get('pin_inodes')}; "
             "stall floor = max(0, M/B − compute) / max(M/B, compute), M = bytes that must "
             "cross the link (the link floor); clients' fallback = bytes the Python clients read "
             "from the mount themselves (reported to the daemon; the shim reports none)", ""]
    for kind, d in out["datasets"].items():
        lines += [f"### {kind}: {d['files']} files, {d['bytes'] / 1e9:.2f} GB", "",
                  "| row | epoch | wall s | stall (floor) | AU | link GB (floor) | "
                  "daemon backing GB | clients' fallback GB | opens cached whole (daemon) | "
                  "job hits | job step |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row, res in d["rows"].items():
            for r in res:
                w = r["wall"]
                dae = (f"{r['d_backing_bytes'] / 1e9:.3f}" if "d_backing_bytes" in r else "–")
                if "job_d_backing_bytes" in r:
                    dae += f" (job {r['job_d_backing_bytes'] / 1e9:.3f})"
                fb = f"{r['d_fallback_bytes'] / 1e9:.3f}" if "d_fallback_bytes" in r else "–"
                hits = (f"{r['d_opens_full']}/{r['d_opens']}" if "d_opens" in r else "–")
                jh = (f"{r['job_d_opens_hit']}/{r['job_d_opens']}"
                      f" ({r['job_d_opens_hit'] / max(1, r['job_d_opens']):.2f})"
                      if "job_d_opens" in r else "–")
                js = (f"{r['job']['step']}/{r['job']['epoch_len']} e{r['job']['epoch']}"
                      if "job" in r else "–")
                lines.append(
                    f"| {row} | {r['epoch']} | {w:.1f} | "
                    f"{r['wait'] / w:.2f} ({r['stall_floor']:.2f}) | {r['compute'] / w:.2f} | "
                    f"{r['link_bytes'] / 1e9:.3f} ({r['link_floor'] / 1e9:.3f}) | "
                    f"{dae} | {fb} | {hits} | {jh} | {js} |")
        lines.append("")
    return "\n".join(lines)


def default_slow_storage() -> str:
    """../shared/testbed/slow-storage.sh beside the repository (a git worktree: beside the
    main checkout)."""
    tail = pathlib.Path("shared/testbed/slow-storage.sh")
    roots = [REPO.parent]
    try:
        common = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-common-dir"],
                                capture_output=True, text=True, check=True).stdout.strip()
        roots.append((REPO / common).resolve().parent.parent)
    except (OSError, subprocess.CalledProcessError):
        pass
    for r in roots:
        if (r / tail).exists():
            return str(r / tail)
    return str(REPO.parent / tail)


def pin_helper(files: list) -> None:
    """Holds an O_PATH descriptor of each file until stdin closes (or it is killed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        fds = list(ex.map(lambda f: os.open(f, os.O_PATH), files))
    print("pinned", flush=True)
    sys.stdin.read()
    for fd in fds:
        os.close(fd)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(pathlib.Path(sys.argv[2]).read_text()))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--pin":
        pin_helper(json.loads(pathlib.Path(sys.argv[2]).read_text()))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small-files", type=int, default=20000)
    p.add_argument("--file-kib", type=int, default=100, help="size of a small file / tar sample")
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--shard-mib", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rate", default="400mbit", help="tc tbf rate of the link")
    p.add_argument("--link-rate", type=float, default=0,
                   help="link bytes/s for compute and floors (default: measured)")
    p.add_argument("--compute-frac", type=float, default=0.35,
                   help="compute per epoch ÷ the epoch's time at link rate")
    p.add_argument("--cgroup-mib", type=int, default=1024)
    p.add_argument("--dataset", action="append", choices=DATASETS,
                   help="repeat; default both")
    p.add_argument("--row", action="append", choices=ROWS, help="repeat; default all")
    p.add_argument("--no-pin-inodes", dest="pin_inodes", action="store_false",
                   help="do not hold O_PATH descriptors of the dataset's files")
    p.add_argument("--daemon-arg", action="append", default=[],
                   help="extra shardcached argument (repeat)")
    p.add_argument("--slow-storage",
                   default=os.environ.get("SLOW_STORAGE") or default_slow_storage())
    a = p.parse_args()
    a.dataset = a.dataset or list(DATASETS)
    a.row = a.row or list(ROWS)
    if os.geteuid() != 0:
        sys.exit("bench_torch.py needs root (slow-storage.sh, cgroups, drop_caches)")
    b = Bench(a)

    def stop(sig, _frame):
        raise SystemExit(128 + sig)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        out = b.run()
    finally:
        b.cleanup()
    log("\n" + table(out))
    log(f"saved {OUT / 'results.json'} and {OUT / 'results.md'}")


if __name__ == "__main__":
    main()
