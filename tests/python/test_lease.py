"""Jobs bound to their readers (issue 14): the sampler's registration is leased and held
by its process; one job id on every rank of a run; ranks on one node in one plan."""

import json
import os
import signal
import subprocess
import sys
import time

import shardcache

# A reader process: a sampler over the files listed in argv[2] (JSON), registered on
# set_epoch(0); prints its job id, then waits for a line (or EOF) and exits cleanly.
READER = r"""
import json, sys
import shardcache
socket, files, rank, world, lease = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
s = shardcache.DistributedShuffleSampler(
    n=len(files), num_replicas=world, rank=rank, seed=7, files=files,
    client=shardcache.Client(socket, timeout=2), lease=lease, epochs=2)
s.set_epoch(0)
print(s.job, flush=True)
sys.stdin.readline()
"""

# The variables a launcher gives every rank; cleared so that the test's own don't count.
LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID",
                 "RANK", "WORLD_SIZE", "LOCAL_RANK")


def env_with(**kw):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(kw)
    return env


def dataset(daemon, n=16, name="train"):
    files = [str(daemon.write(f"{name}/f{i:02}", i, 1000 + i)) for i in range(n)]
    listing = daemon.tmp / f"{name.replace('/', '_')}-files.json"
    listing.write_text(json.dumps(files))
    return files, listing


def start_reader(daemon, listing, rank=0, world=1, lease=60.0, env=None):
    p = subprocess.Popen(
        [sys.executable, "-c", READER, daemon.socket, str(listing), str(rank), str(world), str(lease)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env or env_with(),
    )
    job = p.stdout.readline().strip()
    assert job, "the reader registered and printed its job"
    return p, job


def jobs(daemon):
    return {j["job"]: j for j in daemon.client().status()["jobs"]}


def wait_for(cond, what, timeout=20.0):
    """Polls `cond` (a status look-up) until it holds, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_killed_readers_job_is_dropped_after_its_lease(daemon):
    _, listing = dataset(daemon)
    p, job = start_reader(daemon, listing, lease=1)
    try:
        j = jobs(daemon)[job]
        assert (j["lease_seconds"], j["lease_holders"], j["lease_holders_alive"]) == (1, 1, 1)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)  # reaped: not even a zombie holds it
        t0 = time.monotonic()
        wait_for(lambda: job not in jobs(daemon), "the killed reader's job dropped")
        assert time.monotonic() - t0 < 10
        log = (daemon.tmp / "daemon.log").read_text()
        assert "lease ran out" in log and job in log
    finally:
        p.kill()
        p.wait()


def test_a_live_reader_holds_its_job_past_the_lease(daemon):
    _, listing = dataset(daemon)
    p, job = start_reader(daemon, listing, lease=1)
    try:
        # The lease (1 s) runs out unrenewed; the holder is alive, so the job stays.
        wait_for(lambda: jobs(daemon)[job]["lease_remaining_seconds"] < 0.5, "the lease nearly out")
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert job in jobs(daemon)
            time.sleep(0.1)
        # A clean exit lets go of it at once.
        p.stdin.close()
        assert p.wait(timeout=10) == 0
        assert job not in jobs(daemon)
    finally:
        p.kill()
        p.wait()


def test_one_job_id_on_every_rank_of_a_run(daemon, tmp_path):
    """Ranks with one launcher environment get one id; other runs, seeds and datasets
    (even with the same directory name) other ids; a process launched by nobody gets one
    of its own. The id is readable: the dataset's name and a hash."""
    files, _ = dataset(daemon)
    other = [str(daemon.write(f"elsewhere/train/f{i:02}", i, 10)) for i in range(16)]
    code = ("import json, sys, shardcache; f = json.loads(sys.argv[1]); "
            "print(shardcache.DistributedShuffleSampler(n=len(f), seed=int(sys.argv[2]), files=f).job)")

    def job_id(env, f=files, seed=7):
        out = subprocess.run([sys.executable, "-c", code, json.dumps(f), str(seed)],
                             env=env, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    torchrun = lambda rank, run="r1": env_with(TORCHELASTIC_RUN_ID=run, RANK=str(rank), WORLD_SIZE="4",  # noqa: E731
                                              LOCAL_RANK=str(rank % 2), MASTER_ADDR="n0", MASTER_PORT="29500")
    ids = {job_id(torchrun(r)) for r in range(4)}
    assert len(ids) == 1, ids
    one = ids.pop()
    assert one.startswith("train.") and len(one) == len("train.") + 12
    assert job_id(torchrun(0, run="r2")) != one, "another run"
    assert job_id(torchrun(0), seed=8) != one, "another seed"
    assert job_id(torchrun(0), f=other) != one, "another dataset of the same name"
    # torchrun without a rendezvous id: the master address and port; Slurm's ids.
    plain = lambda rank, port: env_with(MASTER_ADDR="n0", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")  # noqa: E731
    assert job_id(plain(0, "1")) == job_id(plain(1, "1")) != job_id(plain(0, "2"))
    assert job_id(torchrun(0, run="none")) == job_id(torchrun(1, run="none"))
    slurm = lambda step: env_with(SLURM_JOB_ID="42", SLURM_STEP_ID=step)  # noqa: E731
    assert job_id(slurm("0")) == job_id(slurm("0")) != job_id(slurm("1"))
    # No launcher: each process its own.
    assert job_id(env_with()) != job_id(env_with())


def test_two_ranks_on_one_node_hold_one_plan(daemon):
    """Two ranks (one torchrun environment) register one job: one node plan with both
    ranks' reads, two holders. One rank's clean exit leaves the job to the other; the
    last one's removes it."""
    files, listing = dataset(daemon, n=16)
    env = env_with(TORCHELASTIC_RUN_ID="run-a", MASTER_ADDR="n0", MASTER_PORT="1", WORLD_SIZE="2")
    readers = []
    try:
        for rank in (0, 1):
            readers.append(start_reader(daemon, listing, rank=rank, world=2, env=env))
        (_, a), (_, b) = readers
        assert a == b, "one id"
        assert list(jobs(daemon)) == [a], "one job"
        j = jobs(daemon)[a]
        assert j["epoch_len"] == 16, "the node plan reads both ranks' 8 files"
        assert (j["lease_holders"], j["lease_holders_alive"]) == (2, 2)
        p0, _ = readers[0]
        p0.stdin.close()
        assert p0.wait(timeout=10) == 0
        j = jobs(daemon)[a]
        assert (j["lease_holders"], j["lease_holders_alive"], j["epoch_len"]) == (1, 1, 16)
        p1, _ = readers[1]
        p1.stdin.close()
        assert p1.wait(timeout=10) == 0
        assert jobs(daemon) == {}
    finally:
        for p, _ in readers:
            p.kill()
            p.wait()


def test_a_job_the_daemon_lost_is_registered_again_at_the_next_epoch(daemon):
    """The sampler's report at set_epoch finds the job gone (unregistered by hand here;
    a daemon restart or a lease run out alike): it registers the plan again, leased."""
    files, _ = dataset(daemon)
    c = daemon.client()
    s = shardcache.DistributedShuffleSampler(n=len(files), seed=3, files=files, client=c, epochs=4)
    s.set_epoch(0)
    assert jobs(daemon)[s.job]["lease_seconds"] == 60
    assert c.unregister(s.job)
    s.set_epoch(1)
    j = jobs(daemon)[s.job]
    assert (j["epoch"], j["step"], j["lease_holders"]) == (1, 0, 1)
    s.close()
    assert jobs(daemon) == {}


class Images:
    """docs/PYTHON.md's Dataset, as written there (decode: the bytes' length)."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with shardcache.open(self.files[i]) as f:
            return len(f.read())

    def __getitems__(self, indices):
        client = shardcache.default_client()
        out = []
        for f in client.open_many([self.files[i] for i in indices]):
            with f:
                out.append(len(f.read()))
        return out


def _worker(data, batches, q):
    for k, batch in batches:
        q.put((k, data.__getitems__(batch)))


def test_the_documented_loader_pattern_without_torch(daemon, monkeypatch):
    """PYTHON.md's example, its DataLoader played by forked workers (batch k to worker
    k mod W, each reading its batches in order through __getitems__): one leased job,
    held by the loop's process, every open attributed to it."""
    import multiprocessing

    monkeypatch.setenv("SHARDCACHE_SOCKET", daemon.socket)
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "doc-run")
    n, w, b = 64, 4, 8
    files = [str(daemon.write(f"img/c{i % 4}/x{i:03}.jpg", i, 500 + i)) for i in range(n)]
    data = Images(files)
    sampler = shardcache.DistributedShuffleSampler(data, seed=42, files=files, epochs=2, num_replicas=1, rank=0)
    sampler.set_epoch(0)
    order = list(sampler)
    batches = [(k, order[k * b:(k + 1) * b]) for k in range(n // b)]
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(data, batches[i::w], q)) for i in range(w)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=30) for _ in batches)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [s for k in sorted(got) for s in got[k]] == [500 + i for i in order]
    j = jobs(daemon)[sampler.job]
    assert sampler.job.startswith("img.")
    assert (j["lease_seconds"], j["lease_holders"], j["lease_holders_alive"]) == (60, 1, 1)
    assert j["opens"] == n, "every open attributed to the job"
    sampler.close()
    assert jobs(daemon) == {}
