# Sourced by the benchmarks that need PyTorch (bench-torch.sh, bench-cluster.sh): makes
# target/torch-venv with torch (CPU is enough; ~3 GB from PyPI) and fsspec, once, and
# installs this repository's Python package into it. Sets VENV.
VENV=target/torch-venv
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -c 'import torch, fsspec' 2>/dev/null ||
    "$VENV/bin/pip" install --quiet --disable-pip-version-check torch fsspec
"$VENV/bin/pip" install --quiet --disable-pip-version-check ./client-lib/python
