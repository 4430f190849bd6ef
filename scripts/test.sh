#!/usr/bin/env bash
# Runs every check and test of the workspace: the README's test command, and what CI runs.
# Needs only a Rust toolchain (no system protoc); run as root for the second-uid tests.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== format and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== build (the end-to-end tests start these binaries and load the preload shim)"
cargo build --workspace --bins --locked
cargo build -p shardcache-preload --locked   # the LD_PRELOAD shim (a cdylib) the preload tests load

echo "== docs"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --locked --no-tests=pass
    cargo test --workspace --doc --locked
else
    cargo test --workspace --locked
fi

echo "== Python package (pip install of client-lib/python, built by maturin) and its tests"
PYENV=target/pyenv
[ -x "$PYENV/bin/python" ] || python3 -m venv "$PYENV"
"$PYENV/bin/pip" install --quiet --disable-pip-version-check pytest ./client-lib/python
SHARDCACHED_BIN="$PWD/target/debug/shardcached" PYTHONPATH=tests/python \
    "$PYENV/bin/python" -m pytest -q -p no:cacheprovider tests/python

echo "== operations: metrics with a real Prometheus, the dashboard, Helm chart, RPM and .deb (release build), Slurm scripts (tests/ops)"
scripts/ops-deps.sh
SHARDCACHED_BIN="$PWD/target/debug/shardcached" SHARDCACHE_BIN="$PWD/target/debug/shardcache" \
    PYTHONPATH=tests/ops \
    "$PYENV/bin/python" -m pytest -q -p no:cacheprovider -p no:cloudcoil tests/ops
