#!/usr/bin/env bash
# Installs what the operations tests (tests/ops) need, and only what is missing, so a
# second run costs a few seconds:
#   - Debian: prometheus (the server and promtool) for the metrics tests; rpm (rpmbuild, rpm -qip/-qlp) with rpm2cpio, and cpio, to build and open
#     the RPM; dpkg-deb, systemd-analyze, readelf (binutils) and setpriv (util-linux)
#     come with the base system and are installed only if absent.
#   - PyPI, into the test virtual environment (target/pyenv, which scripts/test.sh also
#     uses): pytest; helm-python-sdk (Helm v4's Go SDK as a shared library: `helm
#     template` and `helm lint` without a helm binary); kubernetes-validate (the
#     Kubernetes OpenAPI schemas, offline); cloudcoil-models-prometheus-operator
#     (models generated from the Prometheus Operator's CRDs, for the ServiceMonitor) and
#     filelock (which cloudcoil's pytest plugin imports).
# Run as root (apt-get). Versions are pinned so a run is reproducible.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v rpmbuild >/dev/null 2>&1 || missing+=(rpm)
command -v rpm2cpio >/dev/null 2>&1 || missing+=(rpm2cpio)
command -v cpio >/dev/null 2>&1 || missing+=(cpio)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v dpkg-deb >/dev/null 2>&1 || missing+=(dpkg)
command -v readelf >/dev/null 2>&1 || missing+=(binutils)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    if [ "$(id -u)" -ne 0 ]; then
        echo "ops-deps: missing ${missing[*]}; run as root (apt-get install -y ${missing[*]})" >&2
        exit 1
    fi
    echo "ops-deps: apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYENV=target/pyenv
[ -x "$PYENV/bin/python" ] || python3 -m venv "$PYENV"
pins=(
    pytest
    helm-python-sdk==0.2.2
    kubernetes-validate==1.37.0
    cloudcoil-models-prometheus-operator==0.80.1.0
    filelock
    PyYAML
)
if ! "$PYENV/bin/python" - "${pins[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for pin in sys.argv[1:]:
    name, _, want = pin.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if want and have != want:
        sys.exit(1)
EOF
then
    echo "ops-deps: pip install ${pins[*]}"
    "$PYENV/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}"
fi
