"""Helpers of the metrics tests: a real shardcached and a real Prometheus, each on
temporary directories and loopback ports, each stopped by its pid; the exposition parser;
and the metric names a PromQL expression uses.

Everything waits on a condition with a deadline (never a bare sleep as synchronisation),
and every loop is bounded in time and count.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def debug_bin(name: str) -> pathlib.Path:
    """A binary of the debug build that scripts/test.sh makes before the tests."""
    env = {"shardcached": "SHARDCACHED_BIN", "shardcache": "SHARDCACHE_BIN"}[name]
    p = pathlib.Path(os.environ.get(env, REPO / "target" / "debug" / name))
    if not p.is_file():
        pytest.fail(f"{p} is missing: build it first (cargo build --workspace --bins)")
    return p


def content(seed: int, n: int) -> bytes:
    """Deterministic bytes for a file (differs per seed)."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


def free_port() -> int:
    """A loopback port free right now (the caller binds it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float = 30.0, every: float = 0.05):
    """Calls ``check`` until it returns something truthy (returned), at most ``timeout``
    seconds and ``timeout / every`` times; raises with ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last = None
    for _ in range(int(timeout / every) + 1):
        try:
            got = check()
            if got:
                return got
            last = got
        except Exception as e:  # noqa: BLE001 - reported below if it never succeeds
            last = e
        if time.monotonic() > deadline:
            break
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def stop_pid(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process we started, wait (bounded), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def http_get(url: str, timeout: float = 5.0):
    """(status, body text) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Node:
    """A real shardcached on temporary directories, its metrics on an ephemeral port."""

    def __init__(self, tmp: pathlib.Path, root: pathlib.Path, name: str = "node", extra=()):
        import shardcache

        self.tmp = tmp
        self.root = root
        self.socket = str(tmp / f"{name}.sock")
        self.log = tmp / f"{name}.log"
        (tmp / f"{name}-cache").mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(debug_bin("shardcached")), "--backing-root", str(root), "--cache-dir", str(tmp / f"{name}-cache"),
                 "--socket", self.socket, "--min-free", "0", "--block-size", "64KiB",
                 "--metrics-listen", "127.0.0.1:0", "--log", "info", *extra],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            )
        try:
            def up():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"shardcached exited: {self.log.read_text()}")
                return shardcache.Client(self.socket, timeout=1).status()

            status = wait_for("shardcached to answer", up, timeout=20)
            self.metrics_addr = status["metrics_addr"]
            assert re.fullmatch(r"127\.0\.0\.1:\d+", self.metrics_addr), status["metrics_addr"]
        except BaseException:
            self.stop()
            raise

    def client(self):
        import shardcache

        return shardcache.Client(self.socket, timeout=5, wait_timeout=30)

    def url(self, path: str) -> str:
        return f"http://{self.metrics_addr}{path}"

    def scrape(self) -> str:
        status, body = http_get(self.url("/metrics"))
        assert status == 200, (status, body)
        return body

    def stop(self) -> None:
        stop_pid(self.proc)


def parse_exposition(text: str) -> dict:
    """{(name, frozenset of (label, value))): value} of a Prometheus text exposition."""
    out = {}
    line_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        assert m, f"unparsable exposition line: {line!r}"
        labels = frozenset(label_re.findall(m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def value(samples: dict, name: str, **labels) -> float:
    """The one sample of ``name`` with exactly ``labels``."""
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} not exported; have {sorted(n for n, _ in samples if n == name)}"
    return samples[key]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_NAME = re.compile(r"(?<![A-Za-z0-9_:])shardcache_[A-Za-z0-9_]+")


def metric_names(expr: str) -> set:
    """Metric names (``shardcache_…``) a PromQL expression reads: strings, label
    matchers and range/subquery brackets are removed first, so that names are only taken
    where a metric may stand (functions and ``by (...)`` lists never start with the
    prefix)."""
    e = _STRING.sub('""', expr)
    e = _BRACES.sub("", e)
    e = _BRACKETS.sub("", e)
    return set(_NAME.findall(e))


class Prometheus:
    """A real Prometheus on a free loopback port scraping ``targets`` every second, with
    a temporary storage directory; stopped by its pid."""

    def __init__(self, tmp: pathlib.Path, targets, rule_files=()):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: run scripts/ops-deps.sh (Debian package prometheus)"
        self.dir = tmp / "prometheus"
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "shardcache", "static_configs": [{"targets": list(targets)}]}],
        }
        # JSON is YAML.
        (self.dir / "prometheus.yml").write_text(json.dumps(cfg))
        self.log = self.dir / "prometheus.log"
        self.proc = None
        last = ""
        for _ in range(3):  # the free port may be taken in between: try another
            self.port = free_port()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [binary, f"--config.file={self.dir / 'prometheus.yml'}",
                     f"--storage.tsdb.path={self.dir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                    stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=self.dir,
                )
            try:
                wait_for("prometheus to be ready", self._ready, timeout=30, every=0.1)
                return
            except AssertionError as e:
                last = f"{e}\n{self.log.read_text()}"
                stop_pid(self.proc)
        raise AssertionError(f"prometheus did not start: {last}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {self.log.read_text()}")
        status, _ = http_get(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
        return status == 200

    def query(self, expr: str) -> list:
        """The result vector of an instant query (raises on a query error)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        status, body = http_get(url)
        reply = json.loads(body)
        assert status == 200 and reply["status"] == "success", (expr, status, body)
        return reply["data"]["result"]

    def scalar(self, expr: str):
        """The single value of an instant query, or None when it has no result."""
        r = self.query(expr)
        assert len(r) <= 1, (expr, r)
        return float(r[0]["value"][1]) if r else None

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)
