"""The Slurm prolog and epilog (packaging/slurm/) against a real shardcached, with the
environment slurmd gives them faked: the prolog registers the job's manifest and waits
for readiness; the epilog unregisters it; neither ever fails a job."""

import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import pytest

from conftest import REPO, Daemon, debug_bin

SLURM = REPO / "packaging" / "slurm"
FILES = 6
SIZE = 300 * 1024


def make_backing(root: pathlib.Path):
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(FILES):
        p = root / "train" / f"shard-{i:04}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes([(i * 37 + j) % 251 for j in range(251)]) * (SIZE // 251))
        names.append(str(p.relative_to(root)))
    return names


def write_manifest(path: pathlib.Path, root: pathlib.Path, names, job="from-the-manifest"):
    path.write_text(json.dumps({
        "version": 1,
        "job": job,
        "root": str(root),
        "files": names,
        "immutable": True,
        "plan": {"kind": "sequence", "epochs": [list(range(len(names)))]},
    }))


def slurm_env(daemon_socket, job_id="4242", **extra):
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_GID": "0",
        "SLURM_JOB_USER": "root",
        "SLURMD_NODENAME": "gpu-node-17",
        "SHARDCACHE_CLI": str(debug_bin("shardcache")),
        "SHARDCACHE_SOCKET": str(daemon_socket),
        "SHARDCACHE_SLURM_ENV": "/nonexistent/slurm.env",
        "SHARDCACHE_SYSLOG": "0",
        "SHARDCACHE_WAIT": "1",
        "SHARDCACHE_TIMEOUT": "30",
    }
    env.update(extra)
    return env


def run_script(name, env, timeout=90):
    started = time.monotonic()
    r = subprocess.run([str(SLURM / name)], env=env, capture_output=True, text=True, timeout=timeout)
    r.seconds = time.monotonic() - started
    return r


def jobs(d: Daemon):
    r = d.cli("status", "--json")
    assert r.returncode == 0, r.stderr
    return {j["job"]: j for j in json.loads(r.stdout).get("jobs", [])}


@pytest.fixture
def bed(tmp_path):
    root = tmp_path / "backing"
    names = make_backing(root)
    d = Daemon(tmp_path, root)
    yield d, root, names
    d.stop()


def test_prolog_registers_and_waits_then_epilog_unregisters(bed, tmp_path):
    d, root, names = bed
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, root, names)
    env = slurm_env(d.socket, SLURM_JOB_COMMENT=f"run 7 shardcache={manifest}")

    r = run_script("prolog.sh", env)
    assert r.returncode == 0, r.stderr
    assert f"registered {manifest} as slurm-4242" in r.stderr
    registered = jobs(d)
    # Registered under the Slurm job id, not the manifest's, and ready: --wait 1 returned.
    assert set(registered) == {"slurm-4242"}
    j = registered["slurm-4242"]
    assert j["files"] == FILES
    assert j["window_bytes"] == FILES * (SIZE // 251 * 251)
    assert j["window_resident_bytes"] == j["window_bytes"]

    r = run_script("epilog.sh", env)
    assert r.returncode == 0, r.stderr
    assert "unregistered slurm-4242" in r.stderr
    assert jobs(d) == {}


def test_per_node_manifests_through_the_extra_field(bed, tmp_path):
    d, root, names = bed
    (tmp_path / "manifests").mkdir()
    write_manifest(tmp_path / "manifests" / "gpu-node-17.json", root, names[:2])
    write_manifest(tmp_path / "manifests" / "gpu-node-18.json", root, names)
    env = slurm_env(
        d.socket, job_id="77",
        SLURM_JOB_EXTRA=f"team=vision shardcache={tmp_path}/manifests/%N.json",
    )
    r = run_script("prolog.sh", env)
    assert r.returncode == 0, r.stderr
    assert jobs(d)["slurm-77"]["files"] == 2  # this node's manifest
    assert run_script("epilog.sh", env).returncode == 0
    assert jobs(d) == {}


def test_a_job_without_a_manifest_is_left_alone(bed):
    d, _, _ = bed
    env = slurm_env(d.socket, SLURM_JOB_COMMENT="just a comment")
    r = run_script("prolog.sh", env)
    assert (r.returncode, r.stderr) == (0, "")
    assert jobs(d) == {}
    r = run_script("epilog.sh", env)
    assert (r.returncode, r.stderr) == (0, "")


def test_bad_manifests_are_logged_and_the_job_starts(bed, tmp_path):
    d, root, names = bed
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "job": "x", "root": "relative", "files": []}')
    for comment in (f"shardcache={bad}", f"shardcache={tmp_path}/missing.json", "shardcache=relative.json"):
        r = run_script("prolog.sh", slurm_env(d.socket, SLURM_JOB_COMMENT=comment))
        assert r.returncode == 0, r.stderr
        assert "starting without the cache" in r.stderr or "not an absolute path" in r.stderr, r.stderr
    assert jobs(d) == {}


def test_a_daemon_that_is_down_never_fails_the_job(tmp_path):
    root = tmp_path / "backing"
    names = make_backing(root)
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, root, names)
    env = slurm_env(tmp_path / "no-daemon.sock", SLURM_JOB_COMMENT=f"shardcache={manifest}")
    r = run_script("prolog.sh", env)
    assert r.returncode == 0 and "starting without the cache being ready" in r.stderr, r.stderr
    assert r.seconds < 15
    r = run_script("epilog.sh", env)
    assert r.returncode == 0 and "could not unregister slurm-4242" in r.stderr, r.stderr


def test_a_wait_that_runs_out_lets_the_job_start(tmp_path):
    root = tmp_path / "backing"
    names = make_backing(root)
    # Planned prefetch off: the readiness window never fills.
    d = Daemon(tmp_path, root, ["--prefetch-ahead", "0"])
    try:
        manifest = tmp_path / "manifest.json"
        write_manifest(manifest, root, names)
        env = slurm_env(d.socket, SLURM_JOB_COMMENT=f"shardcache={manifest}", SHARDCACHE_TIMEOUT="1")
        r = run_script("prolog.sh", env)
        assert r.returncode == 0, r.stderr
        assert "starting without the cache being ready" in r.stderr and "after 1s" in r.stderr, r.stderr
        assert r.seconds < 10
        assert "slurm-4242" in jobs(d)  # registered all the same: the plan still steers the cache
        assert run_script("epilog.sh", env).returncode == 0
        assert jobs(d) == {}
    finally:
        d.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the job's uid needs root (scripts/test.sh runs as root)")
def test_the_manifest_is_read_as_the_jobs_user():
    """The prolog runs as root but reads the manifest as the job's user: a file that user
    cannot read is not registered."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="shardcache-slurm-"))
    try:
        top.chmod(0o755)  # nobody must reach the socket and the manifests
        root = top / "backing"
        names = make_backing(root)
        d = Daemon(top, root)
        try:
            (top / "run").chmod(0o755)
            nobody = {"SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534", "SLURM_JOB_USER": "nobody"}
            private = top / "private.json"
            write_manifest(private, root, names)
            private.chmod(0o600)
            r = run_script("prolog.sh", slurm_env(d.socket, SLURM_JOB_COMMENT=f"shardcache={private}", **nobody))
            assert r.returncode == 0 and "Permission denied" in r.stderr, r.stderr
            assert jobs(d) == {}

            public = top / "public.json"
            write_manifest(public, root, names)
            public.chmod(0o644)
            env = slurm_env(d.socket, job_id="99", SLURM_JOB_COMMENT=f"shardcache={public}", **nobody)
            r = run_script("prolog.sh", env)
            assert r.returncode == 0 and "registered" in r.stderr, r.stderr
            assert "slurm-99" in jobs(d)
            assert run_script("epilog.sh", env).returncode == 0
            assert jobs(d) == {}
        finally:
            d.stop()
    finally:
        shutil.rmtree(top)
