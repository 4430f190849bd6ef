#!/usr/bin/env bash
# Python read throughput through shardcache.open and through the LD_PRELOAD shim, each
# ÷ plain reads of the same local cache files (docs/PYTHON.md). Builds what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p shardcache-daemon -p shardcache-preload
PYENV=target/pyenv
[ -x "$PYENV/bin/python" ] || python3 -m venv "$PYENV"
"$PYENV/bin/pip" install --quiet --disable-pip-version-check ./client-lib/python
exec "$PYENV/bin/python" tests/python/bench_read.py target/release/shardcached \
    target/release/libshardcache_preload.so "$@"
