#!/usr/bin/env bash
# The end-to-end PyTorch benchmark (issue 14; README.md, "Benchmark"): a real DataLoader
# over slow shared storage (../shared/testbed/slow-storage.sh), plain mount vs shardcache
# (Python package and LD_PRELOAD shim) vs fsspec simplecache. Root; not part of CI.
# Builds what it needs and installs torch (CPU is enough; ~3 GB from PyPI) into
# target/torch-venv. Extra arguments go to tests/python/bench_torch.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p shardcache-daemon -p shardcache-preload -p shardcache-client
. scripts/torch-venv.sh
exec "$VENV/bin/python" tests/python/bench_torch.py "$@"
