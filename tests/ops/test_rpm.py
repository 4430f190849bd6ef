"""The RPM and the .deb, built for real (release binaries, rpmbuild, dpkg-deb) by
scripts/package.sh, then opened and checked: header, file list, modes and owners,
scriptlets, and the systemd unit as installed (`systemd-analyze verify` against the
extracted tree; `systemd-analyze security` for its exposure score).
"""

import os
import pathlib
import re
import shutil
import subprocess
import time

import pytest

from conftest import REPO, need_tool

VERSION = re.search(
    r'\[workspace\.package\][^\[]*?version\s*=\s*"([^"]+)"', (REPO / "Cargo.toml").read_text(), re.S
).group(1)
UNIT = "/usr/lib/systemd/system/shardcached.service"


def run(*cmd, cwd=None, input=None, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, cwd=cwd, input=input)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stderr.decode(errors='replace')}")
    return r


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Builds both packages once (the release build is the slow part)."""
    for tool in ("rpmbuild", "rpm", "rpm2cpio", "cpio", "dpkg-deb", "systemd-analyze"):
        need_tool(tool)
    out = tmp_path_factory.mktemp("packages")
    started = time.monotonic()
    run(str(REPO / "scripts" / "package.sh"), "all", str(out), cwd=REPO)
    print(f"scripts/package.sh all: {time.monotonic() - started:.0f} s")
    rpms = list(out.glob("*.rpm"))
    debs = list(out.glob("*.deb"))
    assert len(rpms) == 1 and len(debs) == 1, os.listdir(out)
    return rpms[0], debs[0]


@pytest.fixture(scope="module")
def rpm(packages):
    return packages[0]


def q(rpm_path, *args) -> str:
    return run("rpm", "-qp", *args, str(rpm_path)).stdout.decode()


@pytest.fixture(scope="module")
def extracted(rpm, tmp_path_factory):
    """The RPM's payload unpacked into an empty root (what an install lays down)."""
    root = tmp_path_factory.mktemp("rpmroot")
    payload = run("rpm2cpio", str(rpm)).stdout
    run("cpio", "-idm", "--quiet", "--no-absolute-filenames", cwd=root, input=payload)
    return root


def test_rpm_header(rpm):
    info = run("rpm", "-qip", str(rpm)).stdout.decode()
    fields = dict(re.findall(r"^(\w[\w ]*?)\s*: (.*)$", info, re.M))
    assert fields["Name"] == "shardcache"
    assert fields["Version"] == VERSION
    assert fields["Release"] == "1"
    assert fields["Architecture"] == os.uname().machine
    assert fields["License"] == "Apache-2.0"
    assert "NVMe read cache" in fields["Summary"]
    assert "shardcached runs on every GPU node" in info
    assert rpm.name == f"shardcache-{VERSION}-1.{os.uname().machine}.rpm"


def test_rpm_files_modes_and_owners(rpm):
    libdir = "/usr/lib64"  # %{_libdir} of x86_64 and aarch64 RPM systems
    listed = set(run("rpm", "-qlp", str(rpm)).stdout.decode().split())
    expected = {
        "/usr/bin/shardcached": ("-rwxr-xr-x", "root", "root"),
        "/usr/bin/shardcache": ("-rwxr-xr-x", "root", "root"),
        f"{libdir}/libshardcache_preload.so": ("-rwxr-xr-x", "root", "root"),
        UNIT: ("-rw-r--r--", "root", "root"),
        "/usr/lib/sysusers.d/shardcache.conf": ("-rw-r--r--", "root", "root"),
        "/usr/lib/tmpfiles.d/shardcache.conf": ("-rw-r--r--", "root", "root"),
        "/etc/shardcache": ("drwxr-xr-x", "root", "root"),
        "/etc/shardcache/shardcached.toml": ("-rw-r--r--", "root", "root"),
        "/var/cache/shardcache": ("drwx------", "shardcache", "shardcache"),
        "/run/shardcache": ("drwxr-xr-x", "shardcache", "shardcache"),
    }
    docs = {p for p in listed if p.startswith("/usr/share/doc/shardcache")}
    assert "/usr/share/doc/shardcache/OPERATIONS.md" in docs
    assert listed - docs == set(expected), listed
    rows = q(rpm, "--qf", r"[%{FILEMODES:perms} %{FILEUSERNAME} %{FILEGROUPNAME} %{FILEFLAGS:fflags} %{FILENAMES}\n]")
    seen = {}
    for line in rows.splitlines():
        perms, user, group, flags, path = line.split(" ", 4)
        seen[path] = (perms, user, group, flags)
    for path, want in expected.items():
        assert seen[path][:3] == want, (path, seen[path])
    assert "c" in seen["/etc/shardcache/shardcached.toml"][3] and "n" in seen["/etc/shardcache/shardcached.toml"][3]
    assert "g" in seen["/run/shardcache"][3]  # %ghost: created at run time, owned by the package
    assert q(rpm, "-c").split() == ["/etc/shardcache/shardcached.toml"]


def test_rpm_scriptlets_create_the_user_and_handle_the_service(rpm):
    scripts = q(rpm, "--scripts")
    parts = dict(re.findall(r"^(\w+) scriptlet \(using /bin/sh\):\n(.*?)(?=^\w+ scriptlet|\Z)", scripts, re.M | re.S))
    assert set(parts) == {"preinstall", "postinstall", "preuninstall", "postuninstall"}, scripts
    assert "useradd -r -g shardcache" in parts["preinstall"] and "groupadd -r shardcache" in parts["preinstall"]
    assert "systemd-tmpfiles --create /usr/lib/tmpfiles.d/shardcache.conf" in parts["postinstall"]
    assert "preset shardcached.service" in parts["postinstall"]
    assert "disable --now shardcached.service" in parts["preuninstall"]
    assert "try-restart shardcached.service" in parts["postuninstall"]
    for name, body in parts.items():
        r = subprocess.run(["sh", "-n"], input=body.encode(), capture_output=True)
        assert r.returncode == 0, f"{name}: {r.stderr.decode()}"
    requires = q(rpm, "--requires")
    assert "shadow-utils" in requires and "systemd" in requires
    assert re.search(r"libc\.so\.6\(GLIBC_[\d.]+\)\(64bit\)", requires), requires


def test_installed_tree_runs(extracted):
    daemon = extracted / "usr/bin/shardcached"
    cli = extracted / "usr/bin/shardcache"
    assert run(str(daemon), "--version").stdout.decode().split() == ["shardcached", VERSION]
    assert run(str(cli), "--version").stdout.decode().split() == ["shardcache", VERSION]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHED_")}
    r = subprocess.run(
        # `=file`: /lustre/datasets is the example's root, not this machine's.
        [str(daemon), "--check-config=file", "--config", str(extracted / "etc/shardcache/shardcached.toml")],
        capture_output=True, text=True, env=env,
    )
    assert r.returncode == 0 and "configuration ok" in r.stdout, r.stderr
    # The shim is a shared object that interposes the open calls.
    shim = extracted / "usr/lib64/libshardcache_preload.so"
    dyn = run("readelf", "-W", "--dyn-syms", "--file-header", str(shim)).stdout.decode()
    assert "DYN (Shared object file)" in dyn
    exported = {l.split()[-1].split("@")[0] for l in dyn.splitlines() if " FUNC " in l and " GLOBAL " in l and " UND " not in l}
    assert {"open", "openat", "fopen"} <= exported, sorted(exported)


def test_tmpfiles_and_sysusers_agree_with_the_unit(extracted):
    sysusers = (extracted / "usr/lib/sysusers.d/shardcache.conf").read_text()
    assert re.search(r"^u shardcache - ", sysusers, re.M)
    tmpfiles = (extracted / "usr/lib/tmpfiles.d/shardcache.conf").read_text()
    assert re.search(r"^d /run/shardcache 0755 shardcache shardcache -$", tmpfiles, re.M)
    assert re.search(r"^d /var/cache/shardcache 0700 shardcache shardcache -$", tmpfiles, re.M)
    unit = (extracted / UNIT.lstrip("/")).read_text()
    settings = re.findall(r"^(\w+)=(.*)$", unit, re.M)
    s = dict(settings)
    assert s["User"] == "shardcache" and s["Group"] == "shardcache"
    assert s["ExecStart"] == "/usr/bin/shardcached --config /etc/shardcache/shardcached.toml"
    assert s["CapabilityBoundingSet"] == "CAP_DAC_READ_SEARCH" == s["AmbientCapabilities"]
    assert s["RuntimeDirectory"] == "shardcache" and s["RuntimeDirectoryMode"] == "0755"
    assert s["CacheDirectory"] == "shardcache" and s["CacheDirectoryMode"] == "0700"
    for key in ("NoNewPrivileges", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables", "ProtectControlGroups"):
        assert s[key] == "yes", key
    assert s["ProtectSystem"] == "strict"


@pytest.fixture(scope="module")
def unit_root(extracted, tmp_path_factory):
    """The extracted package plus the host's own systemd units (the targets the unit
    orders itself after), so `systemd-analyze --root` sees a complete system whose only
    shardcache files are the package's."""
    root = tmp_path_factory.mktemp("unitroot")
    shutil.copytree(extracted, root, dirs_exist_ok=True, symlinks=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", dirs_exist_ok=True, symlinks=True)
    assert (root / UNIT.lstrip("/")).read_bytes() == (extracted / UNIT.lstrip("/")).read_bytes()
    return root


def test_systemd_analyze_verify_is_clean(unit_root):
    r = run("systemd-analyze", "verify", f"--root={unit_root}", "shardcached.service", check=False)
    out = (r.stdout + r.stderr).decode()
    print(f"systemd-analyze verify: exit {r.returncode}, output {out!r}")
    # verify exits 0 on unknown keys and bad values (it only warns): any output fails.
    assert r.returncode == 0 and out.strip() == "", out


def test_systemd_analyze_verify_catches_mistakes(unit_root, tmp_path):
    """The check above can fail: a misspelt key and a missing binary are reported."""
    broken = tmp_path / "broken"
    shutil.copytree(unit_root, broken, symlinks=True)
    unit = broken / UNIT.lstrip("/")
    unit.write_text(unit.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    r = run("systemd-analyze", "verify", f"--root={broken}", "shardcached.service", check=False)
    assert b"Unknown key" in r.stderr
    (broken / "usr/bin/shardcached").unlink()
    r = run("systemd-analyze", "verify", f"--root={broken}", "shardcached.service", check=False)
    assert r.returncode != 0 and b"/usr/bin/shardcached" in r.stderr


def test_systemd_analyze_security_exposure(unit_root):
    r = run("systemd-analyze", "security", "--offline=yes", f"--root={unit_root}", "--no-pager", "shardcached.service")
    out = r.stdout.decode()
    m = re.search(r"Overall exposure level for shardcached\.service: ([\d.]+) (\w+)", out)
    assert m, out
    score = float(m.group(1))
    print(f"systemd-analyze security: exposure {score} {m.group(2)}")
    # 0 is a fully sandboxed service, 10 an unprotected one; "OK" is below 2. What is left
    # is inherent: the network (peers), CAP_DAC_READ_SEARCH, read-only /home.
    assert score <= 2.0, out


def test_deb(packages, tmp_path):
    deb = packages[1]
    info = run("dpkg-deb", "--info", str(deb)).stdout.decode()
    assert re.search(r"^ Package: shardcache$", info, re.M)
    assert re.search(rf"^ Version: {re.escape(VERSION)}$", info, re.M)
    # Depends on at least the glibc the binaries were linked against.
    m = re.search(r"^ Depends: libc6 \(>= (2\.\d+)\), libgcc-s1, ", info, re.M)
    assert m, info
    needed = run("readelf", "-W", "--version-info", str(REPO / "target/release/shardcached")).stdout.decode()
    newest = max(tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+)\b", needed))
    assert tuple(map(int, m.group(1).split("."))) >= newest
    for script in ("postinst", "prerm", "postrm", "conffiles"):
        assert re.search(rf"^\s+\d+ bytes,\s+\d+ lines\s+\*?\s*{script}\b", info, re.M), (script, info)
    contents = run("dpkg-deb", "--contents", str(deb)).stdout.decode()
    files = {}
    for line in contents.splitlines():
        perms, owner, *_rest, path = line.split()
        files[path.removeprefix(".")] = (perms, owner)
    multiarch = run("dpkg-architecture", "-qDEB_HOST_MULTIARCH", check=False).stdout.decode().strip() or (
        os.uname().machine + "-linux-gnu"
    )
    for path, perms in {
        "/usr/bin/shardcached": "-rwxr-xr-x",
        "/usr/bin/shardcache": "-rwxr-xr-x",
        f"/usr/lib/{multiarch}/libshardcache_preload.so": "-rwxr-xr-x",
        UNIT: "-rw-r--r--",
        "/usr/lib/sysusers.d/shardcache.conf": "-rw-r--r--",
        "/usr/lib/tmpfiles.d/shardcache.conf": "-rw-r--r--",
        "/etc/shardcache/shardcached.toml": "-rw-r--r--",
    }.items():
        assert files[path] == (perms, "root/root"), (path, files.get(path))
    control = tmp_path / "control"
    run("dpkg-deb", "--control", str(deb), str(control))
    assert (control / "conffiles").read_text().split() == ["/etc/shardcache/shardcached.toml"]
    for script in ("postinst", "prerm", "postrm"):
        assert os.access(control / script, os.X_OK)
        run("sh", "-n", str(control / script))
    assert "systemd-sysusers /usr/lib/sysusers.d/shardcache.conf" in (control / "postinst").read_text()
