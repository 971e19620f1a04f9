#!/bin/bash
# tools/ptx-same.sh [REV] : whether the CUDA sources of the work tree compile to
# the same PTX as those of REV (default HEAD), for sm_90a and compute_80 (the
# default build's targets).  Internal name hashes, which follow a file's
# contents, are removed first.  The same PTX is the same device code, so a
# change that passes this (comments, a refactor of the source) keeps what the
# last `make gpu-test` on REV measured.  Exit 0: the same; 1: a file differs
# (named); 2: a compile failed.
set -u
rev=${1:-HEAD}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
[ -x "$nvcc" ] || { echo "ptx-same: no nvcc" >&2; exit 2; }
top=$(git rev-parse --show-toplevel) || exit 2
cd "$top" || exit 2
tmp=$(mktemp -d) || exit 2
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/old" "$tmp/new"
git archive "$rev" include model optim | tar -x -C "$tmp/old" || exit 2
cp -r include model optim "$tmp/new/"
status=0
for f in $(cd "$tmp/new" && ls model/cuda/*.cu optim/*.cu 2>/dev/null); do
    [ -f "$tmp/old/$f" ] || { echo "ptx-same: $f is new"; status=1; continue; }
    for arch in sm_90a compute_80; do
        for side in old new; do
            (cd "$tmp/$side" && "$nvcc" -std=c++17 -O3 -arch=$arch -Iinclude -DTD_HAVE_CUDA -ptx "$f" -o "$tmp/$side.ptx") ||
                { echo "ptx-same: $f ($side, $arch) did not compile" >&2; exit 2; }
            sed -E 's/_GLOBAL__N__[0-9a-f_]+//g; s/_INTERNAL_[0-9a-f]+_/_INTERNAL_/g' "$tmp/$side.ptx" > "$tmp/$side.norm"
        done
        if cmp -s "$tmp/old.norm" "$tmp/new.norm"; then echo "same  $f ($arch)"; else echo "DIFF  $f ($arch)"; status=1; fi
    done
done
exit $status
