"""The privileges the packaging grants are enough, and needed: a real shardcached, run
with exactly the capability set of the systemd unit (an unprivileged uid with ambient
CAP_DAC_READ_SEARCH) or of the Helm chart's container (uid 0, every capability but
CAP_DAC_READ_SEARCH dropped, no_new_privs), serves a private file to its owner from the
cache and refuses it to another uid; without the capability the owner still reads it,
but from the backing store. The sets are read from the unit and the chart's values, so
a change there is tested here."""

import os
import pathlib
import re
import shutil
import subprocess
import tempfile

import pytest
import yaml

from conftest import CHART, REPO, Daemon, debug_bin, need_tool

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="running as other uids with chosen capabilities needs root (scripts/test.sh runs as root)"
)

OWNER, OTHER, DAEMON_UID = 1234, 1235, 65534
SIZE = 1_000_000


def unit_caps():
    unit = (REPO / "packaging" / "systemd" / "shardcached.service").read_text()
    s = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    assert s["AmbientCapabilities"] == s["CapabilityBoundingSet"]
    assert s["NoNewPrivileges"] == "yes"
    return [c.removeprefix("CAP_").lower() for c in s["AmbientCapabilities"].split()]


def chart_caps():
    sc = yaml.safe_load((CHART / "values.yaml").read_text())["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False
    return sc["runAsUser"], [c.lower() for c in sc["capabilities"]["add"]]


def setpriv_systemd(caps):
    """What systemd does for User= + AmbientCapabilities= + CapabilityBoundingSet=."""
    c = ",".join(f"+{x}" for x in caps)
    return [
        need_tool("setpriv"), f"--reuid={DAEMON_UID}", f"--regid={DAEMON_UID}", "--clear-groups",
        f"--inh-caps=-all,{c}", f"--ambient-caps=-all,{c}", f"--bounding-set=-all,{c}", "--no-new-privs", "--",
    ]


def setpriv_container(uid, caps):
    """What the container runtime does for the chart's securityContext: uid 0 keeps only
    the capabilities left in its bounding set."""
    c = ",".join(f"+{x}" for x in caps)
    return [
        need_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        "--inh-caps=-all", f"--bounding-set=-all{',' + c if c else ''}", "--no-new-privs", "--",
    ]


@pytest.fixture
def bed():
    top = pathlib.Path(tempfile.mkdtemp(prefix="shardcache-privs-"))
    try:
        top.chmod(0o755)
        root = top / "backing"
        private = root / "home" / "alice"
        private.mkdir(parents=True)
        secret = private / "shard.bin"
        secret.write_bytes(os.urandom(SIZE))
        for p in (private, secret):
            os.chown(p, OWNER, OWNER)
        private.chmod(0o700)
        secret.chmod(0o600)
        yield top, root, secret
    finally:
        shutil.rmtree(top)


def start(top: pathlib.Path, root, wrap, daemon_uid):
    """The daemon on directories it owns, as the packages create them."""
    for d in ("cache", "run"):
        (top / d).mkdir(exist_ok=True)
        os.chown(top / d, daemon_uid, daemon_uid)
    (top / "cache").chmod(0o700)
    (top / "run").chmod(0o755)
    return Daemon(top, root, wrap=wrap)


def cat_as(d: Daemon, uid: int, path):
    r = subprocess.run(
        [need_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
         str(debug_bin("shardcache")), "--socket", str(d.socket), "cat", "--stats", str(path)],
        capture_output=True, timeout=60,
    )
    return r.returncode, r.stdout, r.stderr.decode()


def sources(stderr):
    m = re.search(r"hit (\d+) B, filled (\d+) B, backing (\d+) B", stderr)
    assert m, stderr
    return tuple(map(int, m.groups()))


def check_served_from_cache(d, secret):
    data = secret.read_bytes()
    rc, out, err = cat_as(d, OWNER, secret)
    assert rc == 0 and out == data, err
    hit, filled, backing = sources(err)
    assert (hit + filled, backing) == (SIZE, 0), f"the daemon did not serve it: {err}"
    rc, out, err = cat_as(d, OTHER, secret)
    assert rc != 0 and out == b"" and "Permission denied" in err, err


def test_the_systemd_units_capabilities_suffice(bed):
    top, root, secret = bed
    d = start(top, root, setpriv_systemd(unit_caps()), DAEMON_UID)
    try:
        status = pathlib.Path(f"/proc/{d.proc.pid}/status").read_text()
        assert re.search(r"^CapEff:\s+0000000000000004$", status, re.M), status  # CAP_DAC_READ_SEARCH alone
        assert re.search(rf"^Uid:\s+{DAEMON_UID}\b", status, re.M)
        check_served_from_cache(d, secret)
    finally:
        d.stop()


def test_the_charts_security_context_suffices(bed):
    top, root, secret = bed
    uid, caps = chart_caps()
    d = start(top, root, setpriv_container(uid, caps), uid)
    try:
        status = pathlib.Path(f"/proc/{d.proc.pid}/status").read_text()
        assert re.search(r"^CapEff:\s+0000000000000004$", status, re.M), status
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M)
        check_served_from_cache(d, secret)
    finally:
        d.stop()


def test_without_the_capability_the_owner_reads_the_backing_store(bed):
    top, root, secret = bed
    d = start(top, root, setpriv_container(0, []), 0)
    try:
        rc, out, err = cat_as(d, OWNER, secret)
        assert rc == 0 and out == secret.read_bytes(), err
        assert sources(err) == (0, 0, SIZE), err
    finally:
        d.stop()
