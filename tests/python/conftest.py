"""Fixtures: a real shardcached on temporary directories, stopped by its pid."""

import os
import pathlib
import signal
import subprocess
import time

import pytest

import shardcache

REPO = pathlib.Path(__file__).resolve().parents[2]


def daemon_bin() -> str:
    return os.environ.get("SHARDCACHED_BIN", str(REPO / "target" / "debug" / "shardcached"))


def content(seed: int, n: int) -> bytes:
    """Deterministic bytes for a file (differs per seed)."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


class Daemon:
    def __init__(self, tmp: pathlib.Path, extra=()):
        self.tmp = tmp
        self.root = tmp / "backing"
        self.root.mkdir(exist_ok=True)
        self.socket = str(tmp / "shardcached.sock")
        self.extra = list(extra)
        self.proc = None
        self.start()

    def start(self):
        log = open(self.tmp / "daemon.log", "ab")
        self.proc = subprocess.Popen(
            [daemon_bin(), "--backing-root", str(self.root), "--cache-dir", str(self.tmp / "cache"),
             "--socket", self.socket, "--min-free", "0", *self.metrics_args(), *self.extra],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shardcached exited: {(self.tmp / 'daemon.log').read_text()}")
            try:
                shardcache.Client(self.socket, timeout=1).status()
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("shardcached did not become ready in 20 s")

    def metrics_args(self):
        # Never the default port: tests run side by side (the bound one is in status).
        return [] if "--metrics-listen" in self.extra else ["--metrics-listen", "127.0.0.1:0"]

    def metrics_addr(self) -> str:
        """host:port of the metrics endpoint ("" when it is off)."""
        return self.client().status()["metrics_addr"]

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.proc = None

    def client(self) -> shardcache.Client:
        return shardcache.Client(self.socket, timeout=2, wait_timeout=10)

    def counters(self) -> dict:
        return self.client().status()["counters"]

    def write(self, rel: str, seed: int, n: int) -> pathlib.Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content(seed, n))
        return p


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture
def make_daemon(tmp_path):
    made = []

    def make(*extra):
        d = Daemon(tmp_path, extra)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
