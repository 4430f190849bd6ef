#!/usr/bin/env bash
# Installs the Debian packages the operations tests (tests/ops) need, when missing:
# prometheus (the server and promtool). Idempotent: nothing is downloaded when every
# command is already there; `apt-get update` runs at most once, quietly.
set -euo pipefail

need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
# Unique package names.
mapfile -t pkgs < <(printf '%s\n' "${need[@]}" | sort -u)
if [ "$(id -u)" -ne 0 ]; then
    echo "ops-deps: missing ${pkgs[*]}; run as root (apt-get install -y ${pkgs[*]})" >&2
    exit 1
fi
echo "ops-deps: installing ${pkgs[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
