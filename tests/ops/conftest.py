"""Shared helpers of the packaging tests: paths, the built binaries, a real daemon.

The tools these tests use (Helm's Go SDK as a Python package, the Kubernetes schemas,
rpmbuild, rpm2cpio, systemd-analyze) are installed by scripts/ops-deps.sh; a missing
one is a failure that names that script, never a skip.
"""

import functools
import os
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "packaging" / "helm" / "shardcache"


def debug_bin(name: str) -> pathlib.Path:
    """A binary of the debug build that scripts/test.sh makes before the tests."""
    env = {"shardcached": "SHARDCACHED_BIN", "shardcache": "SHARDCACHE_BIN"}[name]
    p = pathlib.Path(os.environ.get(env, REPO / "target" / "debug" / name))
    if not p.is_file():
        pytest.fail(f"{p} is missing: build it first (cargo build --workspace --bins)")
    return p


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: run scripts/ops-deps.sh")
    return path


@functools.lru_cache(maxsize=None)
def daemon_flags() -> str:
    """`shardcached --help`: which flags this build knows."""
    return subprocess.run(
        [str(debug_bin("shardcached")), "--help"], capture_output=True, text=True, check=True
    ).stdout


class Daemon:
    """A real shardcached on temporary directories, stopped by its pid."""

    def __init__(self, tmp: pathlib.Path, root: pathlib.Path, extra=(), wrap=()):
        """`wrap`: a command that runs the daemon (e.g. setpriv with a capability set)."""
        self.tmp = tmp
        self.root = root
        self.socket = tmp / "run" / "shardcached.sock"
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.log = tmp / "daemon.log"
        args = [
            *wrap,
            str(debug_bin("shardcached")),
            "--backing-root", str(root),
            "--cache-dir", str(tmp / "cache"),
            "--socket", str(self.socket),
            "--min-free", "0",
            *extra,
        ]
        # Once the daemon serves metrics, keep the test off any fixed port.
        if "--metrics-listen" in daemon_flags():
            args += ["--metrics-listen", "off"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shardcached exited: {self.log.read_text()}")
            r = self.cli("status", "--json")
            if r.returncode == 0:
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"shardcached did not answer within 20 s: {self.log.read_text()}")

    def cli(self, *args, env=None, timeout=30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(debug_bin("shardcache")), "--socket", str(self.socket), *args],
            capture_output=True, text=True, env=env, timeout=timeout,
        )

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
