"""The Helm chart: rendered and linted by Helm itself, validated against the Kubernetes
schemas, and checked for the properties the cache depends on.

Renderer: the `helm-python-sdk` package, which binds Helm v4's Go SDK (a shared library
built from helm.sh/helm/v4) through ctypes: `Chart.render` is `helm template`,
`helm_python.lint` is `helm lint`. Schemas: `kubernetes-validate` ships the Kubernetes
OpenAPI schemas (strict variants reject unknown fields); the ServiceMonitor, a
Prometheus Operator CRD, is checked with the models generated from that CRD
(`cloudcoil-models-prometheus-operator`). Everything works offline.
"""

import base64
import copy
import os
import subprocess
import tomllib

import pytest

from conftest import CHART, debug_bin

try:
    import helm_python as helm
    import kubernetes_validate
    import pydantic
    import yaml
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
except ImportError as e:  # pragma: no cover - a setup error, reported as a failure
    raise ImportError(f"{e}: run scripts/ops-deps.sh") from e

# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest
# schema shipped: the objects must be valid for both.
KUBE_VERSIONS = ["1.25.0", "1.37.0"]
NAMESPACE = "ml-infra"
RELEASE = "sc"
FULL_VALUES = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())


def render(values=None):
    """`helm template` with these values: every rendered object, by kind and name."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objs = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in objs, f"{key} rendered twice"
                objs[key] = doc
    return objs


def one(objs, kind):
    found = [o for (k, _), o in objs.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def strict_servicemonitor(obj):
    """Validates against the ServiceMonitor CRD's schema; unknown fields are errors
    (the API server would silently prune them)."""
    model = ServiceMonitor.model_validate(obj)
    kept = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert kept == obj, f"fields the CRD does not know were dropped:\n{kept}\n!=\n{obj}"


def validate_all(objs):
    kinds = set()
    for (kind, name), obj in objs.items():
        kinds.add(kind)
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            strict_servicemonitor(obj)
            continue
        for v in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{kind}/{name} is invalid for Kubernetes {v}: {e.message} at {list(e.path)}")
    return kinds


@pytest.fixture(scope="module")
def defaults():
    return render()


@pytest.fixture(scope="module")
def full():
    return render(FULL_VALUES)


def test_lint_is_clean_with_defaults_and_with_every_option():
    for values in ({}, FULL_VALUES):
        for kube in ("v1.25.0", "v1.37.0"):
            report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=kube)
            serious = [m for m in report["messages"] if m["severity"] >= 2]
            assert not report["errors"] and not serious, report
            # What remains is informational: Helm recommends an icon, which we do not have.
            assert all(m["error"] == "icon is recommended" for m in report["messages"]), report


def test_the_values_schema_rejects_mistakes():
    for bad in (
        {"backingRoots": ["relative/path"]},
        {"backingRoots": []},
        {"config": {"capacity": 1.5}},
        {"config": {"socket": "/elsewhere.sock"}},  # the chart owns it
        {"peers": {"secret": {"value": "too-short"}}},
        {"metrics": {"port": 70000}},
        {"cacheDir": {"hostPath": "/nvme", "type": "File"}},
        {"unknownTopLevel": True},
    ):
        report = helm.lint(str(CHART), bad, strict=True, namespace=NAMESPACE)
        assert report["errors"], f"lint accepted {bad}"


def test_default_render_is_valid_kubernetes(defaults):
    kinds = validate_all(defaults)
    assert kinds == {"DaemonSet", "ConfigMap", "Service", "Secret", "ServiceAccount"}


def test_render_with_every_option_is_valid_kubernetes_and_prometheus_operator(full):
    kinds = validate_all(full)
    assert kinds == {"DaemonSet", "ConfigMap", "Service", "Secret", "ServiceAccount", "ServiceMonitor"}


def test_the_validators_are_not_lenient(defaults):
    """A misspelt field and a wrong type are caught: the checks above can fail."""
    ds = copy.deepcopy(one(defaults, "DaemonSet"))
    ds["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE_VERSIONS[-1], strict=True)
    ds = copy.deepcopy(one(defaults, "DaemonSet"))
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9477"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE_VERSIONS[-1], strict=True)
    sm = one(render({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    strict_servicemonitor(sm)
    typo = copy.deepcopy(sm)
    typo["spec"]["endpoints"][0]["prot"] = "metrics"
    with pytest.raises(AssertionError):
        strict_servicemonitor(typo)
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(pydantic.ValidationError):
        strict_servicemonitor(bad)


def pod(objs):
    return one(objs, "DaemonSet")["spec"]["template"]["spec"]


def container(objs):
    (c,) = pod(objs)["containers"]
    return c


def mounts(objs):
    """mountPath -> (volume, mount)."""
    vols = {v["name"]: v for v in pod(objs)["volumes"]}
    return {m["mountPath"]: (vols[m["name"]], m) for m in container(objs)["volumeMounts"]}


def toml_of(objs):
    cm = one(objs, "ConfigMap")
    return tomllib.loads(cm["data"]["shardcached.toml"])


@pytest.mark.parametrize("which", ["defaults", "full"])
def test_daemonset_semantics(which, request):
    objs = request.getfixturevalue(which)
    values = FULL_VALUES if which == "full" else yaml.safe_load((CHART / "values.yaml").read_text())
    cfg = toml_of(objs)
    spec = pod(objs)
    c = container(objs)
    m = mounts(objs)

    # The cache directory and the socket directory are hostPaths on the node, mounted
    # where the configuration says.
    cache_vol, cache_mount = m[cfg["cache_dir"]]
    assert cache_vol["hostPath"]["path"] == values["cacheDir"]["hostPath"]
    assert not cache_mount.get("readOnly", False)
    sock_vol, _ = m[os.path.dirname(cfg["socket"])]
    assert sock_vol["hostPath"]["path"] == values["socketDir"]["hostPath"]
    assert cfg["socket_mode"] == 0o666

    # Every backing root: read-only hostPath at the same path as on the node.
    assert cfg["backing_roots"] == values["backingRoots"]
    for root in values["backingRoots"]:
        vol, mount = m[root]
        assert vol["hostPath"] == {"path": root, "type": "Directory"}
        assert mount["readOnly"] is True
        assert mount["mountPropagation"] == "HostToContainer"
    assert m["/etc/shardcache"][1]["readOnly"] is True

    # Probes on the metrics port, which is where metrics_listen listens.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg["metrics_listen"] == f"0.0.0.0:{ports['metrics']}"
    assert ports["metrics"] == values["metrics"]["port"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}

    # Least privilege.
    sc = c["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["capabilities"]["add"] == ["DAC_READ_SEARCH"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    for host_ns in ("hostNetwork", "hostPID", "hostIPC"):
        assert spec.get(host_ns, False) is False
    assert spec["automountServiceAccountToken"] is False
    assert one(objs, "ServiceAccount")["automountServiceAccountToken"] is False

    # GPU nodes are tolerated; resources are set.
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]

    # The config checksum rolls pods when the TOML changes.
    assert len(one(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]) == 64


@pytest.mark.parametrize("which", ["defaults", "full"])
def test_peers_find_each_other_through_the_headless_service(which, request):
    objs = request.getfixturevalue(which)
    cfg = toml_of(objs)
    svc = one(objs, "Service")
    ds = one(objs, "DaemonSet")
    c = container(objs)
    domain = FULL_VALUES["peers"]["clusterDomain"] if which == "full" else "cluster.local"

    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    # The Service selects exactly the daemon's pods.
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert ds["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    peer_port = ports["peer"]
    assert cfg["peer_listen"] == f"0.0.0.0:{peer_port}"
    assert cfg["peer_dns"] == f"{svc['metadata']['name']}.{NAMESPACE}.svc.{domain}:{peer_port}"
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc_ports["peer"]["port"] == peer_port and svc_ports["peer"]["targetPort"] == "peer"
    assert svc_ports["metrics"]["targetPort"] == "metrics"

    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["SHARDCACHED_PEER_ADVERTISE"]["value"] == f"$(POD_IP):{peer_port}"

    # The secret file is the rendered Secret's key, mounted read-only.
    secret = one(objs, "Secret")
    vol, mount = mounts(objs)[os.path.dirname(cfg["peer_secret_file"])]
    assert mount["readOnly"] is True
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    key = os.path.basename(cfg["peer_secret_file"])
    assert key in secret["data"]
    assert [i["key"] for i in vol["secret"]["items"]] == [key]
    if which == "full":
        assert base64.b64decode(secret["data"][key]).decode() == FULL_VALUES["peers"]["secret"]["value"]


def test_service_monitor_scrapes_the_metrics_port(full):
    sm = one(full, "ServiceMonitor")
    svc = one(full, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    assert ep["interval"] == "15s"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_existing_secret_and_peers_off():
    objs = render({"peers": {"secret": {"existingSecret": "cluster-peer-secret", "key": "token"}}})
    assert "Secret" not in {k for k, _ in objs}
    vol, _ = mounts(objs)[os.path.dirname(toml_of(objs)["peer_secret_file"])]
    assert vol["secret"]["secretName"] == "cluster-peer-secret"
    assert toml_of(objs)["peer_secret_file"].endswith("/token")

    objs = render({"peers": {"enabled": False}})
    validate_all(objs)
    cfg = toml_of(objs)
    assert not {k for k in cfg if k.startswith("peer_") and k not in ("peer_timeout", "peer_refresh")}
    assert "Secret" not in {k for k, _ in objs}
    assert "SHARDCACHED_PEER_ADVERTISE" not in {e["name"] for e in container(objs)["env"]}
    assert [p["name"] for p in one(objs, "Service")["spec"]["ports"]] == ["metrics"]


def test_peer_tls_mounts_the_named_secret_and_points_the_daemon_at_it():
    objs = render({"peers": {"tls": {"existingSecret": "peer-tls", "name": "peers.ml.example"}}})
    validate_all(objs)
    cfg = toml_of(objs)
    files = {k: cfg[k] for k in ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")}
    assert {os.path.basename(f) for f in files.values()} == {"tls.crt", "tls.key", "ca.crt"}
    assert cfg["peer_tls_name"] == "peers.ml.example"
    (d,) = {os.path.dirname(f) for f in files.values()}
    vol, mount = mounts(objs)[d]
    assert mount["readOnly"] is True
    assert vol["secret"]["secretName"] == "peer-tls"
    assert vol["secret"]["defaultMode"] == 0o400
    assert sorted(i["key"] for i in vol["secret"]["items"]) == ["ca.crt", "tls.crt", "tls.key"]
    # Off by default, and the chart owns the keys.
    assert not {k for k in toml_of(render()) if k.startswith("peer_tls")}
    with pytest.raises(helm.HelmError, match="peer_tls_cert"):
        render({"config": {"peer_tls_cert": "/x.crt"}})


def test_config_values_become_typed_toml_and_chart_owned_keys_are_refused():
    cfg = toml_of(render({"config": {"fill_workers": 12, "block_size": "1MiB", "max_wait": "5s"}}))
    assert cfg["fill_workers"] == 12 and isinstance(cfg["fill_workers"], int)
    assert cfg["block_size"] == "1MiB"
    # Refused by the values schema (and, behind it, by the template itself).
    with pytest.raises(helm.HelmError, match="invalid propertyName 'socket'"):
        render({"config": {"socket": "/x.sock"}})


def check_config(objs, tmp_path):
    """Runs the daemon's own validation on the rendered TOML, with the environment the
    DaemonSet gives it (POD_IP resolved as the kubelet would)."""
    toml_text = one(objs, "ConfigMap")["data"]["shardcached.toml"]
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("SHARDCACHED_") or k == "SHARDCACHE_SOCKET":
            del env[k]
    for e in container(objs)["env"]:
        if "value" in e:
            env[e["name"]] = e["value"].replace("$(POD_IP)", "10.42.0.17")
    env["RUST_BACKTRACE"] = "0"
    path = tmp_path / "shardcached.toml"
    path.write_text(toml_text)
    # `=file`: the paths the file names are the nodes', not this machine's (a plain
    # --check-config also checks that they exist, as a start on a node does).
    cmd = [str(debug_bin("shardcached")), "--check-config=file", "--config", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"shardcached refused the rendered configuration:\n{r.stderr}\n{toml_text}"
    assert "configuration ok" in r.stdout


@pytest.mark.parametrize("values", [{}, FULL_VALUES, {"peers": {"enabled": False}}], ids=["defaults", "full", "no-peers"])
def test_the_daemon_accepts_the_rendered_configuration(values, tmp_path):
    check_config(render(values), tmp_path)


def test_the_daemon_check_catches_a_bad_rendered_key(tmp_path):
    """--check-config is a real check: a key the daemon does not know fails it."""
    objs = render({"config": {"fill_wrokers": 4}})
    with pytest.raises(AssertionError, match="fill_wrokers"):
        check_config(objs, tmp_path)
