#!/bin/bash
# make bench-gpu: the benchmarks of the GPU machine, each beside its peer in
# the same run.  Usage: bench/bench-gpu.sh path/to/tidal
# Each part records its figures in bench/results/ (bench/results.py):
# copy.json, adam.json and adam-torch.json, and one file per workload.
#
# Environment:
#   TD_BENCH_PARTS  which parts, in order (default "copy adam workloads", and
#                   "comm" before workloads on a machine of several GPUs)
#   TD_WORKLOADS    workloads for bench/workloads.py (default W1,W2,W3,W4,W6,
#                   and W7 on a machine of several GPUs)
#   TD_BENCH_ARGS   extra flags for bench/workloads.py, e.g. "--quick" or
#                   "--json out/bench-gpu/workloads.json" (see bench/README.md)
set -euo pipefail
tidal=${1:-build/tidal}
threads=$(nproc)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${gpus:-0}" -ge 2 ]; then
    parts=${TD_BENCH_PARTS:-copy adam comm workloads}
    workloads=${TD_WORKLOADS:-W1,W2,W3,W4,W6,W7}
else
    parts=${TD_BENCH_PARTS:-copy adam workloads}
    workloads=${TD_WORKLOADS:-W1,W2,W3,W4,W6}
fi
have_torch=0
python3 -c "import torch" 2>/dev/null && have_torch=1

for part in $parts; do
    case $part in
    copy)
        echo "== tidal bench copy (copy engine vs raw cudaMemcpyAsync on pinned memory)"
        python3 bench/results.py wrap copy "the copy engine against raw cudaMemcpyAsync on pinned memory" -- \
            "$tidal" bench copy --backend cuda --json
        echo
        ;;
    adam)
        echo "== tidal bench adam vs torch.optim.AdamW(fused=True) on CPU, $threads threads"
        python3 bench/results.py wrap adam "tidal's CPU AdamW, $threads threads, against the DRAM bound" -- \
            "$tidal" bench adam --threads "$threads" --max-params 256M --json
        if [ "$have_torch" = 1 ]; then
            python3 bench/results.py wrap adam-torch "torch.optim.AdamW(fused=True) on the CPU, $threads threads" -- \
                python3 bench/peers/adam_torch.py --threads "$threads" --max-params 256M
        else
            echo "(PyTorch not found: no peer figures)"
        fi
        echo
        ;;
    comm)
        echo "== tidal bench comm: NCCL's collectives on the ${gpus} GPUs, checked, then timed"
        "$tidal" bench comm --nproc "$gpus" --backend cuda
        echo
        ;;
    workloads)
        echo "== the training workloads of docs/benchmarks.md: tidal vs PyTorch eager / FSDP2 CPU offload"
        [ "$have_torch" = 1 ] || echo "(PyTorch not found: the peers will report themselves not available)"
        # shellcheck disable=SC2086 # TD_BENCH_ARGS is a list of flags
        python3 bench/workloads.py --tidal "$tidal" --workloads "$workloads" ${TD_BENCH_ARGS:-}
        echo
        ;;
    *)
        echo "bench-gpu.sh: unknown part '$part' in TD_BENCH_PARTS (use copy, adam, comm, workloads)" >&2
        exit 2
        ;;
    esac
done
