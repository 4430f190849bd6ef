#!/usr/bin/env bash
# The README's run command: builds everything (release) and runs the demo on generated
# data. Extra arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --bins --locked
exec target/release/shardcache-demo "$@"
