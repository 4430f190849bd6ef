#!/usr/bin/env bash
# Builds the release binaries the packages ship and packs them (docs/OPERATIONS.md):
#
#   scripts/package.sh [rpm|deb|all] [OUTDIR]      default: all, into target/packages
#
# The RPM is built by rpmbuild from packaging/rpm/shardcache.spec, the .deb by dpkg-deb
# from packaging/deb/ (Debian's `rpm` package provides rpmbuild; scripts/ops-deps.sh
# installs it). Only the shipped crates are built: shardcached, the shardcache CLI and
# the LD_PRELOAD shim.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
what=${1:-all}
out=${2:-target/packages}
case "$what" in rpm | deb | all) ;; *)
    echo "usage: $0 [rpm|deb|all] [OUTDIR]" >&2
    exit 2
    ;;
esac
mkdir -p "$out"
out=$(cd "$out" && pwd)

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[ -n "$version" ] || { echo "no [workspace.package] version in Cargo.toml" >&2; exit 1; }

cargo build --release --locked -p shardcache-daemon -p shardcache-client -p shardcache-preload
bins=(target/release/shardcached target/release/shardcache target/release/libshardcache_preload.so)
for f in "${bins[@]}"; do
    [ -f "$f" ] || { echo "missing $f after the build" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "$what" = rpm ] || [ "$what" = all ]; then
    rpmbuild -bb --quiet \
        --define "_topdir $work/rpmbuild" \
        --define "_rpmdir $out" \
        --define "_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm" \
        --define "sc_root $repo" \
        --define "sc_version $version" \
        packaging/rpm/shardcache.spec
    echo "built $out/shardcache-$version-1.$(uname -m).rpm"
fi

if [ "$what" = deb ] || [ "$what" = all ]; then
    arch=$(dpkg --print-architecture)
    multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo "$(uname -m)-linux-gnu")
    root=$work/deb
    install -Dm0755 target/release/shardcached "$root/usr/bin/shardcached"
    install -Dm0755 target/release/shardcache "$root/usr/bin/shardcache"
    install -Dm0755 target/release/libshardcache_preload.so "$root/usr/lib/$multiarch/libshardcache_preload.so"
    install -Dm0644 packaging/systemd/shardcached.service "$root/usr/lib/systemd/system/shardcached.service"
    install -Dm0644 packaging/systemd/shardcache.sysusers "$root/usr/lib/sysusers.d/shardcache.conf"
    install -Dm0644 packaging/systemd/shardcache.tmpfiles "$root/usr/lib/tmpfiles.d/shardcache.conf"
    install -Dm0644 packaging/shardcached.toml "$root/etc/shardcache/shardcached.toml"
    install -d -m0755 "$root/usr/share/doc/shardcache"
    for f in README.md docs/OPERATIONS.md docs/CONFIGURATION.md docs/SEMANTICS.md docs/MANIFEST.md docs/METRICS.md; do
        install -m0644 "$f" "$root/usr/share/doc/shardcache/"
    done
    install -d -m0755 "$root/DEBIAN"
    # The newest glibc symbol version the binaries use (what dpkg-shlibdeps would find).
    glibc=$(readelf -W --version-info "${bins[@]}" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n1)
    sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@GLIBC@/$glibc/" \
        packaging/deb/control >"$root/DEBIAN/control"
    echo "Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)" >>"$root/DEBIAN/control"
    install -m0644 packaging/deb/conffiles "$root/DEBIAN/conffiles"
    install -m0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$root/DEBIAN/"
    dpkg-deb --root-owner-group -Zgzip --build "$root" "$out/shardcache_${version}_${arch}.deb" >/dev/null
    echo "built $out/shardcache_${version}_${arch}.deb"
fi
