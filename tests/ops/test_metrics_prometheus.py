"""A real Prometheus scrapes a real shardcached while a registered job reads through the
cache: the hit and byte counters move in Prometheus exactly as the reads happened, the
probes answer, the exposition passes `promtool check metrics` and the packaged alert
rules `promtool check rules` (and their unit tests, `promtool test rules`)."""

import shutil
import subprocess

import pytest

import shardcache
from metrics_helpers import (REPO, Node, Prometheus, content, http_get, parse_exposition, value,
                             wait_for)

RULES = REPO / "packaging" / "prometheus" / "shardcache-alerts.yml"
RULES_TEST = REPO / "tests" / "ops" / "shardcache-alerts.test.yml"
JOB = "metrics-e2e"
SIZES = [300_000 + 4099 * i for i in range(8)]


def promtool() -> str:
    p = shutil.which("promtool")
    assert p, "promtool is not installed: run scripts/ops-deps.sh (Debian package prometheus)"
    return p


@pytest.fixture
def node(tmp_path):
    root = tmp_path / "backing"
    root.mkdir()
    n = Node(tmp_path, root)
    yield n
    n.stop()


@pytest.fixture
def prometheus(tmp_path, node):
    p = Prometheus(tmp_path, [node.metrics_addr], rule_files=[RULES])
    yield p
    p.stop()


def read_all(client, paths) -> int:
    n = 0
    for i, p in enumerate(paths):
        with client.open(p) as f:
            data = f.read()
        assert data == content(i, SIZES[i])
        n += len(data)
    return n


def test_probes(node):
    assert http_get(node.url("/healthz")) == (200, "ok\n")
    assert http_get(node.url("/readyz")) == (200, "ok\n")
    status, _ = http_get(node.url("/nothing-here"))
    assert status == 404


def test_prometheus_sees_hits_and_bytes_move_with_the_reads(tmp_path, node, prometheus):
    paths = []
    for i, size in enumerate(SIZES):
        p = node.root / "ds" / f"part-{i:03}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content(i, size))
        paths.append(str(p))
    total = sum(SIZES)
    hit = 'shardcache_read_bytes_total{result="hit"}'
    all_bytes = "sum(shardcache_read_bytes_total)"
    job_bytes = f'sum(shardcache_job_read_bytes_total{{job_id="{JOB}"}})'

    # Prometheus has scraped the daemon before any read: the counters exist, at 0.
    wait_for("a first scrape", lambda: prometheus.scalar('up{job="shardcache"}') == 1.0)
    wait_for("the read counters", lambda: prometheus.scalar(all_bytes) is not None)
    assert prometheus.scalar(all_bytes) == 0.0
    assert prometheus.scalar(hit) == 0.0

    # A job registers two epochs over the files, in order; prefetch makes them resident
    # before the first read, so every open of the first epoch has a prefetch lead time.
    c = node.client()
    order = [list(range(len(paths)))] * 2
    job, nfiles = c.register(shardcache.make_manifest(JOB, node.root, paths, order=order, sizes=True))
    assert (job, nfiles) == (JOB, len(paths))

    def window_resident():
        j = next(j for j in c.status()["jobs"] if j["job"] == JOB)
        return j["window"] == len(paths) and j["window_resident"] == len(paths)

    wait_for("the prefetcher to fetch the job's files", window_resident, timeout=60)

    # Epoch 0, then epoch 1: all from the cache.
    assert read_all(c, paths) == total
    assert read_all(c, paths) == total
    status = c.status()  # delivers the client's read report
    counters = status["counters"]
    assert counters["hit_bytes"] + counters["filled_bytes"] + counters["fallback_bytes"] == 2 * total
    assert counters["hit_bytes"] >= total  # the second pass at least
    assert counters["fallback_bytes"] == 0

    # Prometheus, through its query API, sees what the daemon counted and the client read.
    wait_for("Prometheus to see every byte read", lambda: prometheus.scalar(all_bytes) == 2 * total, timeout=30)
    assert prometheus.scalar(hit) == counters["hit_bytes"]
    assert prometheus.scalar('shardcache_read_bytes_total{result="fallback"}') == 0.0
    assert prometheus.scalar("sum(shardcache_reads_total)") == (
        counters["hit_reads"] + counters["filled_reads"] + counters["fallback_reads"])
    assert prometheus.scalar("sum(shardcache_reads_total)") >= 2 * len(paths)
    wait_for("the job's bytes", lambda: prometheus.scalar(job_bytes) == 2 * total, timeout=30)
    assert prometheus.scalar(f'shardcache_job_opens_total{{job_id="{JOB}"}}') == 2 * len(paths)
    assert prometheus.scalar(f'shardcache_job_window_resident_ratio{{job_id="{JOB}"}}') is not None
    # The job's hit ratio, as the dashboard and the alert compute it, over the whole run.
    ratio = prometheus.scalar(
        f'sum(shardcache_job_read_bytes_total{{job_id="{JOB}",result="hit"}}) / {job_bytes}')
    assert ratio == pytest.approx(status["jobs"][0]["hit_bytes"] / (2 * total))
    # Every file of epoch 0 was opened after the prefetcher had made it resident.
    assert prometheus.scalar("shardcache_prefetch_lead_seconds_count") == len(paths)
    assert prometheus.scalar("shardcache_prefetch_late_total") == 0.0
    # The backing store was read by the daemon, once per file's bytes (64 KiB blocks).
    assert prometheus.scalar("shardcache_backing_read_bytes_total") == total
    assert prometheus.scalar("shardcache_cache_used_bytes") == total
    # The recording rule of the packaged rules file evaluates too.
    wait_for("the hit-ratio recording rule", lambda: prometheus.query(
        f'shardcache:job_hit_ratio:rate5m{{job_id="{JOB}"}}'), timeout=30)
    print(f"\nPrometheus saw: read bytes {prometheus.scalar(all_bytes):.0f} "
          f"(hit {prometheus.scalar(hit):.0f}), job bytes {prometheus.scalar(job_bytes):.0f}, "
          f"reads {prometheus.scalar('sum(shardcache_reads_total)'):.0f}, "
          f"lead-time observations {prometheus.scalar('shardcache_prefetch_lead_seconds_count'):.0f}, "
          f"job hit ratio {ratio:.3f}")

    # Unregistering the job removes its series from the next scrape.
    assert c.unregister(JOB)
    samples = parse_exposition(node.scrape())
    assert not [k for k in samples if ("job_id", JOB) in k[1]]


def test_promtool_accepts_the_exposition(tmp_path, node):
    # A registered job and a read, so that per-job series and a histogram with
    # observations are part of what is checked.
    p = node.root / "f.bin"
    p.write_bytes(content(1, 200_000))
    c = node.client()
    c.register(shardcache.make_manifest("lint", node.root, [str(p)]))
    with c.open(p) as f:
        assert f.read() == content(1, 200_000)
    c.status()
    text = node.scrape()
    samples = parse_exposition(text)
    assert value(samples, "shardcache_job_files", job_id="lint") == 1.0
    r = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_accepts_the_alert_rules():
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    r = subprocess.run([promtool(), "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                       timeout=120, cwd=RULES_TEST.parent)
    assert r.returncode == 0, r.stdout + r.stderr
