#!/bin/sh
# tools/deps.sh check|install [libs|fuzz] — the system packages tidal needs.
#   check    exits non-zero when a library or the fortunes corpus is
#            missing; libraries are looked up with pkg-config, so
#            packages unpacked elsewhere (PKG_CONFIG_PATH) count.
#   install  installs what is missing with apt-get (sudo when not root).
#   libs     only the libraries (no fortunes corpus).
#   fuzz     the libraries plus what `make fuzz` needs: clang, its libFuzzer
#            and sanitizer runtimes (compiler-rt) and its OpenMP runtime.
# Called by `make deps`, and by `make test` / `make demo` / `make fuzz` when something is missing.
set -e
LIBS="hwloc libcjson zlib cmocka jemalloc liburing"
need_pkgs() {
    pkgs=""
    command -v pkg-config >/dev/null 2>&1 || pkgs="pkg-config"
    pkg-config --exists hwloc 2>/dev/null || pkgs="$pkgs libhwloc-dev"
    pkg-config --exists libcjson 2>/dev/null || pkgs="$pkgs libcjson-dev"
    pkg-config --exists zlib 2>/dev/null || pkgs="$pkgs zlib1g-dev"
    pkg-config --exists cmocka 2>/dev/null || pkgs="$pkgs libcmocka-dev"
    # The process's allocator, whose statistics measure the host footprint.
    pkg-config --exists jemalloc 2>/dev/null || [ -f /usr/include/jemalloc/jemalloc.h ] || pkgs="$pkgs libjemalloc-dev"
    # io_uring for the disk tier (--offload-dir); without it the build runs
    # pread/pwrite threads (URING=0), so `libs` (the GPU machine, which may
    # have no registry) does without it.
    [ "$1" = libs ] || pkg-config --exists liburing 2>/dev/null || [ -f /usr/include/liburing.h ] || pkgs="$pkgs liburing-dev"
    if [ "$1" = fuzz ]; then
        # Probe a link rather than trust package names: the runtimes ship in
        # versioned packages (libclang-rt-14-dev, libomp-14-dev, ...).
        if ! command -v "${FUZZ_CC:-clang}" >/dev/null 2>&1; then
            pkgs="$pkgs clang libclang-rt-dev libomp-dev"
        else
            probe=$(mktemp -d)
            printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }\n' >"$probe/f.c"
            "${FUZZ_CC:-clang}" -fsanitize=fuzzer,address,undefined -o "$probe/f" "$probe/f.c" >/dev/null 2>&1 ||
                pkgs="$pkgs libclang-rt-dev"
            printf 'int main(void) { return 0; }\n' >"$probe/o.c"
            "${FUZZ_CC:-clang}" -fopenmp -o "$probe/o" "$probe/o.c" >/dev/null 2>&1 || pkgs="$pkgs libomp-dev"
            rm -rf "$probe"
        fi
        echo $pkgs
        return
    fi
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
*) echo "usage: $0 check|install [libs|fuzz]" >&2; exit 2 ;;
esac
