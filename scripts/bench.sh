#!/usr/bin/env bash
# The foundation benchmark (README): ratios against baselines measured in the same run.
# Extra arguments go to `shardcache-bench foundation` (see --help); defaults use ~3.4 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --bins --locked
exec target/release/shardcache-bench foundation "$@"
