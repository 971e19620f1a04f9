#!/bin/bash
# tools/offline-deps.sh [DIR] — the route to a machine without a package
# registry (such as the GPU machine): run it where Debian's registry is
# reachable; it downloads the packages tidal builds against (hwloc, cJSON,
# cmocka, liburing, and fortunes for the demo) as .deb files into DIR (default
# .devdeps, which git ignores) and writes DIR/env.sh.  Copy DIR along with the
# checkout; on the other machine
#
#     source DIR/env.sh && make gpu-test
#
# unpacks the .debs into /opt/devdeps (no dpkg database, no root needed
# beyond writing there; TD_DEVDEPS_ROOT changes the place) and points the
# compiler, linker and pkg-config at them.  EXTRA_DEBS adds packages.
set -euo pipefail
dir=${1:-.devdeps}
pkgs="libhwloc15 libhwloc-dev libcjson1 libcjson-dev libcmocka0 libcmocka-dev liburing2 liburing-dev fortunes ${EXTRA_DEBS:-}"
mkdir -p "$dir"
cd "$dir"
rm -f ./*.deb
if ! apt-get download $pkgs >/dev/null 2>&1; then
    echo "offline-deps: refreshing the package lists"
    apt-get update -qq
    apt-get download $pkgs
fi
cat > env.sh <<'ENV'
# Sourced on the machine without a registry: unpack the carried .debs and use them.
_dd=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_root=${TD_DEVDEPS_ROOT:-/opt/devdeps}
mkdir -p "$_root"
for f in "$_dd"/*.deb; do dpkg -x "$f" "$_root"; done
_p=$_root/usr
export CPATH="$_p/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$_p/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$_p/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_PATH="$_p/lib/x86_64-linux-gnu/pkgconfig:$_p/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
# The .pc files name /usr as their prefix: point them at the unpacked tree.
export PKG_CONFIG_SYSROOT_DIR=$_root
# The demo's corpus, unpacked with the rest.
[ -d "$_p/share/games/fortunes" ] && export FORTUNES_DIR="$_p/share/games/fortunes"
# NVLink multicast stays off on the shared GPU machines.
export NCCL_NVLS_ENABLE=0
ENV
echo "offline-deps: $(ls ./*.deb | wc -l) packages and env.sh in $(pwd)"
