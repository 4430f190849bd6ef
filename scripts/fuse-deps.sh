#!/usr/bin/env bash
# Installs what the hung-backing-store tests need (tests/fuse/hangfs.py, a FUSE
# passthrough whose server a test can SIGSTOP), and only what is missing:
#   - fuse3 (fusermount3, to unmount), python3-fusepy (for /usr/bin/python3; it brings
#     libfuse2).
# Run as root (apt-get); the tests call it themselves. Exits 0 when everything is there.
set -euo pipefail

missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
/usr/bin/python3 -c 'import fusepy' >/dev/null 2>&1 || missing+=(python3-fusepy)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "fuse-deps: missing ${missing[*]}; run as root (apt-get install -y ${missing[*]})" >&2
    exit 1
fi
echo "fuse-deps: apt-get install ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# Other tests may be installing at the same time: wait for the dpkg lock.
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
