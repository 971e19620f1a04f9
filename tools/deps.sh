#!/bin/sh
# tools/deps.sh check|install [libs] — the system packages tidal needs.
#   check    exits non-zero when a library or the fortunes corpus is
#            missing; libraries are looked up with pkg-config, so
#            packages unpacked elsewhere (PKG_CONFIG_PATH) count.
#   install  installs what is missing with apt-get (sudo when not root).
# Called by `make deps`, and by `make test` / `make demo` when something is missing.
set -e
LIBS="hwloc libcjson cmocka jemalloc"
need_pkgs() {
    pkgs=""
    command -v pkg-config >/dev/null 2>&1 || pkgs="pkg-config"
    pkg-config --exists hwloc 2>/dev/null || pkgs="$pkgs libhwloc-dev"
    pkg-config --exists libcjson 2>/dev/null || pkgs="$pkgs libcjson-dev"
    pkg-config --exists cmocka 2>/dev/null || pkgs="$pkgs libcmocka-dev"
    # The process's allocator, whose statistics measure the host footprint.
    pkg-config --exists jemalloc 2>/dev/null || [ -f /usr/include/jemalloc/jemalloc.h ] || pkgs="$pkgs libjemalloc-dev"
    # The demo's corpus, also used by the trainer's tests (not by `libs`).
    [ "$1" = libs ] || ls "${FORTUNES_DIR:-/usr/share/games/fortunes}"/fortunes >/dev/null 2>&1 || pkgs="$pkgs fortunes"
    echo $pkgs
}
missing=$(need_pkgs "$2")
case "$1" in
check) [ -z "$missing" ] ;;
install)
    if [ -z "$missing" ]; then echo "deps: all present"; exit 0; fi
    echo "deps: installing $missing"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q $missing || { $SUDO apt-get update -q && $SUDO apt-get install -y -q $missing; }
    ;;
*) echo "usage: $0 check|install [libs]" >&2; exit 2 ;;
esac
