"""Shared helpers of the packaging tests: paths, the built binaries, a real daemon.

The tools these tests use (Helm's Go SDK as a Python package, the Kubernetes schemas,
rpmbuild, rpm2cpio, systemd-analyze) are installed by scripts/ops-deps.sh; a missing
one is a failure that names that script, never a skip.
"""

import pathlib
import shutil
import subprocess
import time

import pytest

from metrics_helpers import REPO, debug_bin, stop_pid  # noqa: F401 - used by the tests

CHART = REPO / "packaging" / "helm" / "shardcache"


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: run scripts/ops-deps.sh")
    return path


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
            "--metrics-listen", "off",  # never a fixed port: tests run side by side
            *extra,
        ]
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
        stop_pid(self.proc)
