"""The Grafana dashboard, checked without a screenshot: every metric its queries name is
one the daemon really exports (taken from a real scrape of two peered daemons with a
registered job that read data), every query evaluates in a real Prometheus and shows
data, and the alert rules name only exported metrics too."""

import json

import pytest

import shardcache
from metrics_helpers import REPO, Node, Prometheus, content, metric_names, parse_exposition, wait_for

DASHBOARD = REPO / "packaging" / "grafana" / "shardcache-dashboard.json"
RULES = REPO / "packaging" / "prometheus" / "shardcache-alerts.yml"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict):
    """Every panel, those inside rows included."""
    for p in d.get("panels", []):
        yield p
        yield from panels(p)


def queries(d: dict) -> list:
    """(where, expr) of every panel target and every query variable."""
    out = []
    for p in panels(d):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t.get('refId')}", t["expr"]))
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    return out


def rule_exprs() -> list:
    import re

    # The rules file is YAML; its expressions are the `expr:` values (plain or block).
    text = RULES.read_text()
    exprs = re.findall(r"expr: \|\n((?:\s{10}.*\n)+)", text)
    exprs += [e for e in re.findall(r"expr: (.+)\n", text) if e.strip() != "|"]
    return exprs


def test_the_name_extraction_strips_matchers_strings_and_ranges():
    e = ('histogram_quantile(0.9, sum by (le) (rate(shardcache_a_bucket{x="shardcache_not_me",'
         'y=~"$v"}[5m]))) / on (instance) group_left shardcache_b offset 1h '
         '+ max_over_time(shardcache_c[10m:1m]) + label_values(shardcache_d{i="1"}, job_id)')
    assert metric_names(e) == {"shardcache_a_bucket", "shardcache_b", "shardcache_c", "shardcache_d"}
    assert metric_names('sum(rate(shardcache:job_hit_ratio:rate5m[5m]))') == set()


def test_the_dashboard_is_a_usable_grafana_dashboard():
    d = dashboard()
    ds = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert len(ds) == 1 and ds[0]["query"] == "prometheus" and ds[0]["name"] == "datasource"
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = {p["title"] for p in panels(d)}
    for wanted in ["Hit ratio by job", "Bytes by source", "Data stall by job", "Prefetch lead time",
                   "Readiness window resident fraction", "NVMe used and free", "Evictions",
                   "Backing store bytes", "Backing store operations", "Peer health", "Fallbacks by reason"]:
        assert wanted in titles
    for p in panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    for where, expr in queries(d):
        assert metric_names(expr), f"{where} names no shardcache metric: {expr}"


@pytest.fixture
def cluster(tmp_path):
    """Two peered daemons on one backing root, a job registered on the first, data read
    through it (some blocks from the peer)."""
    from metrics_helpers import free_port

    root = tmp_path / "backing"
    root.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("a-test-secret-of-enough-length\n")
    ports = [free_port(), free_port()]
    nodes = []
    try:
        for i, name in enumerate(["a", "b"]):
            extra = ["--peer-listen", f"127.0.0.1:{ports[i]}", "--peer", f"127.0.0.1:{ports[1 - i]}",
                     "--peer-secret-file", str(secret)]
            nodes.append(Node(tmp_path, root, name=name, extra=extra))
        paths = []
        for i in range(6):
            p = root / "ds" / f"s{i}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content(i, 200_000 + i))
            paths.append(str(p))
        c = nodes[0].client()
        c.register(shardcache.make_manifest("dash", root, paths, order=[list(range(6))] * 2))
        for i, p in enumerate(paths):
            with c.open(p) as f:
                assert f.read() == content(i, 200_000 + i)
        c.status()
        yield nodes
    finally:
        for n in nodes:
            n.stop()


def test_every_dashboard_metric_is_exported_and_every_query_shows_data(tmp_path, cluster):
    a = cluster[0]
    exported = {name for name, _ in parse_exposition(a.scrape())}
    named = {}
    for where, expr in queries(dashboard()):
        for n in metric_names(expr):
            named.setdefault(n, where)
    missing = {n: w for n, w in named.items() if n not in exported}
    assert not missing, f"the dashboard names metrics the daemon does not export: {missing}"
    for expr in rule_exprs():
        assert metric_names(expr) <= exported, expr
    # Peer series are there because sharing is on, the job's because one is registered.
    assert "shardcache_peer_up" in exported and "shardcache_job_read_bytes_total" in exported

    # Every panel query, with the dashboard's variables filled in, evaluates in a real
    # Prometheus scraping both daemons, and returns series.
    prom = Prometheus(tmp_path, [n.metrics_addr for n in cluster])
    try:
        subst = {"$__rate_interval": "1m", "$instance": ".*", "$job_id": ".*"}

        def fill(e: str) -> str:
            for k, v in subst.items():
                e = e.replace(k, v)
            return e

        panel_queries = [(w, fill(e)) for w, e in queries(dashboard()) if w.startswith("panel")]
        wait_for("three scrapes", lambda: (prom.scalar("min(count_over_time(up[1m]))") or 0) >= 3, timeout=30)

        def empty():
            return [w for w, e in panel_queries if not prom.query(e)]

        wait_for("every panel to have data", lambda: not empty(), timeout=30, every=0.5)
        # The job variable's values (label_values over shardcache_job_files).
        jobs = prom.query('group by (job_id) (shardcache_job_files)')
        assert [r["metric"]["job_id"] for r in jobs] == ["dash"]
    finally:
        prom.stop()
