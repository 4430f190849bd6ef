"""shardcache.open: the backing bytes, cold, warm and with the daemon stopped."""

import io
import os

import pytest

import shardcache
from conftest import content


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 65536 + 17])
def test_cold_and_warm_reads_equal_the_backing_bytes(daemon, size):
    p = daemon.write(f"ds/f{size}", 3, size)
    c = daemon.client()
    for round in ("cold", "warm"):
        with c.open(p) as f:
            assert f.read() == content(3, size), round
            assert f.raw.source == "cache"
    st = c.status()["counters"]
    assert st["opens"] >= 2


def test_partial_reads_seek_tell_readinto_and_text(daemon):
    data = content(5, 200_000)
    p = daemon.write("ds/big", 5, len(data))
    c = daemon.client()
    with c.open(p) as f:
        assert f.read(10) == data[:10]
        assert f.tell() == 10
        f.seek(100_000)
        buf = bytearray(5000)
        assert f.readinto(buf) == 5000 and bytes(buf) == data[100_000:105_000]
        f.seek(-7, io.SEEK_END)
        assert f.read() == data[-7:]
        assert f.read() == b""
        with pytest.raises(io.UnsupportedOperation):
            f.fileno()
    raw = c.open(p, buffering=0)
    assert isinstance(raw, shardcache.CacheFile)
    assert raw.readall() == data
    raw.close()
    with pytest.raises(ValueError):
        raw.read()
    t = daemon.write("ds/text", 0, 0)
    t.write_text("one\ntwo\n")
    with c.open(t, "r", encoding="utf-8") as f:
        assert f.readlines() == ["one\n", "two\n"]


def test_the_daemon_stopped_or_absent_reads_the_backing_store(daemon, tmp_path):
    p = daemon.write("ds/f", 9, 150_000)
    c = daemon.client()
    with c.open(p) as f:
        assert f.read() == content(9, 150_000)
    daemon.stop()
    with c.open(p) as f:
        assert f.read() == content(9, 150_000)
        assert f.raw.source == "backing"
        assert "daemon" in (f.raw.fallback_reason() or "")
    absent = shardcache.Client(str(tmp_path / "nobody.sock"))
    with absent.open(p) as f:
        assert f.read() == content(9, 150_000)
    with pytest.raises(OSError):
        absent.status()


def test_errors_are_python_exceptions(daemon):
    c = daemon.client()
    with pytest.raises(FileNotFoundError):
        c.open(daemon.root / "missing")
    with pytest.raises(ValueError, match="reads only"):
        shardcache.open(daemon.root / "x", "wb")
    with pytest.raises(shardcache.ManifestError, match="plan"):
        c.register({"version": 1, "job": "j", "root": str(daemon.root), "files": ["a"],
                    "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 1,
                             "epochs": 1, "world_size": 2, "ranks": [2]}})


def test_the_default_client_follows_the_environment(daemon, monkeypatch):
    p = daemon.write("ds/env", 2, 1000)
    monkeypatch.setenv("SHARDCACHE_SOCKET", daemon.socket)
    shardcache._default = None  # as in a fresh process
    before = daemon.counters()["opens"]
    with shardcache.open(p) as f:
        assert f.read() == content(2, 1000)
    assert daemon.counters()["opens"] == before + 1
    assert os.path.exists(daemon.socket)


def test_open_many_and_open_ahead_give_the_same_bytes(daemon):
    paths = [daemon.write(f"many/{i:03}", i, 1000 + 37 * i) for i in range(150)]
    c = daemon.client()
    before = daemon.counters()["opens"]
    files = c.open_many(paths)
    assert [f.read() for f in files] == [content(i, 1000 + 37 * i) for i in range(150)]
    got = [f.read() for f in c.open_ahead(paths, batch=16)]
    assert got == [content(i, 1000 + 37 * i) for i in range(150)]
    assert daemon.counters()["opens"] == before + 300
    with pytest.raises(FileNotFoundError):
        c.open_many([paths[0], daemon.root / "missing"])
    it = c.open_ahead([paths[0], daemon.root / "missing"])
    assert next(it).read() == content(0, 1000)
    with pytest.raises(FileNotFoundError):
        next(it)
