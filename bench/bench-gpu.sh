#!/bin/bash
# make bench-gpu: the benchmarks of the GPU machine, each beside its peer in
# the same run.  Usage: bench/bench-gpu.sh path/to/tidal
set -euo pipefail
tidal=${1:-build/tidal}
threads=$(nproc)
echo "== tidal bench copy (copy engine vs raw cudaMemcpyAsync on pinned memory)"
"$tidal" bench copy --backend cuda
echo
echo "== tidal bench adam vs torch.optim.AdamW(fused=True) on CPU, $threads threads"
"$tidal" bench adam --threads "$threads" --max-params 256M
if python3 -c "import torch" 2>/dev/null; then
    python3 bench/peers/adam_torch.py --threads "$threads" --max-params 256M >/dev/null
else
    echo "(PyTorch not found: no peer figures)"
fi
