#!/usr/bin/env bash
# docs/PYTHON.md's complete example, as written, on 4 nodes of the testbed
# (../shared/testbed/cluster-net.sh; issue 15; README.md, "Benchmark"): torchrun
# --nproc-per-node 2 on each node, each node with its own shardcached and peers on; per
# epoch backing bytes against the floor, local reads, peer blocks, cache use. Root; not
# part of CI. Builds what it needs and installs torch (CPU is enough; ~3 GB from PyPI)
# into target/torch-venv. Extra arguments go to tests/python/cluster_example.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p shardcache-daemon -p shardcache-client
. scripts/torch-venv.sh
exec "$VENV/bin/python" tests/python/cluster_example.py "$@"
