"""Samplers: the daemon's plan, PyTorch's DistributedSampler protocol, a multi-process
loader reading a whole epoch."""

import multiprocessing
import os
import warnings

import pytest

import shardcache
from conftest import content


@pytest.mark.parametrize("n,world,drop_last", [(10, 1, False), (10, 3, False), (10, 3, True), (7, 4, False), (2, 4, False)])
def test_orders_are_distributed_sampler_slices_of_one_permutation(n, world, drop_last):
    for seed in (0, 1, 2**63 + 5):
        for epoch in (0, 1, 7):
            per = shardcache.samples_per_rank(n, world, drop_last)
            orders = [shardcache.DistributedShuffleSampler(n=n, num_replicas=world, rank=r, seed=seed, drop_last=drop_last) for r in range(world)]
            for s in orders:
                s.set_epoch(epoch)
                assert len(s) == per
            got = [list(s) for s in orders]
            # Rank r takes positions r, r + world, ... of one padded permutation.
            merged = [got[i % world][i // world] for i in range(per * world)]
            if drop_last:
                assert len(set(merged)) == len(merged)
            else:
                assert set(merged) == set(range(n))
                assert merged[n:] == merged[: per * world - n]  # padding repeats the start
            assert shardcache.node_order(n, seed, epoch, world, list(range(world)), drop_last) == merged


def test_a_sampler_and_the_daemon_agree_on_the_order(daemon):
    """The sampler registers its plan; reading in the sampler's order moves the daemon's
    position exactly one step per file (a read the plan did not expect next would
    jump or stay)."""
    n = 40
    files = [str(daemon.write(f"ds/s{i:03}", i, 2000 + i)) for i in range(n)]
    c = daemon.client()
    for seed, world, rank in [(1, 1, 0), (5, 2, 1), (9, 3, 2)]:
        s = shardcache.DistributedShuffleSampler(n=n, num_replicas=world, rank=rank, seed=seed, files=files, client=c, epochs=3)
        for epoch in range(3):
            s.set_epoch(epoch)
            job = next(j for j in c.status()["jobs"] if j["job"] == s.job)
            assert (job["epoch"], job["step"]) == (epoch, 0)
            for k, i in enumerate(s):
                with c.open(files[i]) as f:
                    assert f.read() == content(i, 2000 + i)
                job = next(j for j in c.status()["jobs"] if j["job"] == s.job)
                if k + 1 < len(s):
                    assert (job["epoch"], job["step"]) == (epoch, k + 1), (seed, world, rank, epoch, k)
        assert c.unregister(s.job)


def test_no_daemon_no_problem(tmp_path):
    files = []
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(content(i, 100))
        files.append(str(p))
    c = shardcache.Client(str(tmp_path / "nobody.sock"))
    s = shardcache.ShuffleSampler(n=5, seed=3, files=files, client=c)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s.set_epoch(1)
        order = list(s)
    assert sorted(order) == list(range(5))
    assert any("could not tell the daemon" in str(x.message) for x in w)
    for i in order:
        with c.open(files[i]) as f:
            assert f.read() == content(i, 100)


def _read_one(args):
    socket, path = args
    c = shardcache.Client(socket)
    with c.open(path) as f:
        data = f.read()
    return path, len(data), hash(data)


def test_a_multi_process_loader_reads_a_whole_epoch(daemon):
    n = 48
    files = [str(daemon.write(f"mp/s{i:03}", i, 30_000 + 977 * i)) for i in range(n)]
    s = shardcache.ShuffleSampler(n=n, seed=4, files=files, client=daemon.client(), epochs=2)
    for epoch in range(2):
        s.set_epoch(epoch)
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(4) as pool:
            got = pool.map(_read_one, [(daemon.socket, files[i]) for i in s], chunksize=2)
        assert [p for p, _, _ in got] == [files[i] for i in s]
        for p, size, h in got:
            i = files.index(p)
            assert size == 30_000 + 977 * i and h == hash(content(i, size))
    assert daemon.counters()["opens"] >= 2 * n


def test_a_torch_data_loader_if_torch_is_installed(daemon):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    n = 32
    files = [str(daemon.write(f"t/s{i:03}", i, 5000)) for i in range(n)]

    class Files(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            with shardcache.open(files[i]) as f:
                return torch.tensor(list(f.read()[:4]))

    s = shardcache.DistributedShuffleSampler(Files(), num_replicas=2, rank=0, seed=1, files=files)
    s.set_epoch(0)
    loader = DataLoader(Files(), batch_size=4, sampler=s, num_workers=2)
    rows = [b for batch in loader for b in batch]
    assert len(rows) == len(s)
    assert [r.tolist() for r in rows] == [list(content(i, 5000)[:4]) for i in s]


def test_make_manifest_from_a_directory_a_glob_and_a_list(tmp_path):
    for rel in ["a/1.tar", "a/2.tar", "a/x.idx", "b/3.tar"]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    m = shardcache.make_manifest("j", tmp_path)
    assert m["files"] == ["a/1.tar", "a/2.tar", "a/x.idx", "b/3.tar"]
    m = shardcache.make_manifest("j", tmp_path, glob="**/*.tar", seed=3, epochs=2, sizes=True)
    assert [f["path"] for f in m["files"]] == ["a/1.tar", "a/2.tar", "b/3.tar"]
    assert m["plan"]["seed"] == 3 and m["plan"]["algorithm"] == shardcache.SHUFFLE_ALGORITHM
    m = shardcache.make_manifest("j", tmp_path, [tmp_path / "b/3.tar", "a/1.tar"], order=[[1, 0]])
    assert m["files"] == ["b/3.tar", "a/1.tar"] and m["plan"]["kind"] == "sequence"
    with pytest.raises(shardcache.ManifestError, match="ranks"):
        shardcache.make_manifest("j", tmp_path, world_size=2, ranks=[5])
    with pytest.raises(shardcache.ManifestError, match="not under root"):
        shardcache.make_manifest("j", tmp_path / "a", [str(tmp_path / "b/3.tar")])
    with pytest.raises(shardcache.ManifestError, match="matches no"):
        shardcache.make_manifest("j", tmp_path, glob="*.none")
    assert os.path.isabs(m["root"])


class _Recorder:
    """A client that records the manifests it is asked to register."""

    def __init__(self):
        self.manifests = []

    def progress(self, job, epoch, step):
        return False

    def register_leased(self, manifest, lease):
        self.manifests.append(manifest)

    def register(self, manifest):
        self.manifests.append(manifest)


def test_a_sampler_puts_the_files_sizes_in_its_plan(tmp_path):
    """Issue 15: with ``sizes`` (given, or ``True``: stat once) every file of the plan
    has its size, which makes the nodes' cluster placement count bytes."""
    files = []
    for i in range(4):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * (100 * (i + 1)))
        files.append(str(p))
    for sizes in ([100, 200, 300, 400], True):
        rec = _Recorder()
        s = shardcache.DistributedShuffleSampler(n=4, num_replicas=1, rank=0, files=files, client=rec, sizes=sizes, lease=0)
        s.set_epoch(0)
        s.set_epoch(1)  # registered again: the recorder knows no job
        assert len(rec.manifests) == 2
        for m in rec.manifests:
            assert [(f["path"], f["size"]) for f in m["files"]] == [(f"f{i}", 100 * (i + 1)) for i in range(4)]
    rec = _Recorder()
    shardcache.DistributedShuffleSampler(n=4, num_replicas=1, rank=0, files=files, client=rec, lease=0).set_epoch(0)
    assert rec.manifests[0]["files"] == ["f0", "f1", "f2", "f3"], "no sizes unless asked"
    with pytest.raises(ValueError, match="3 sizes for 4 files"):
        shardcache.DistributedShuffleSampler(n=4, files=files, sizes=[1, 2, 3])
    with pytest.raises(shardcache.ManifestError, match="2 sizes for 4 files"):
        shardcache.make_manifest("j", tmp_path, files, sizes=[1, 2])
    m = shardcache.make_manifest("j", tmp_path, files, sizes=[5, 6, 7, 8])
    assert [f["size"] for f in m["files"]] == [5, 6, 7, 8]
