#!/bin/bash
# make bench-gpu: the GPU benchmarks, each beside its peer, in one run.
# Usage: bench/bench-gpu.sh path/to/tidal
set -euo pipefail
tidal=${1:-build/tidal}
echo "== tidal bench copy (copy engine vs raw cudaMemcpyAsync, pinned)"
"$tidal" bench copy --backend cuda
