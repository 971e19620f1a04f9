#!/bin/bash
# ZeRO-3's benchmarks on a machine of 2 GPUs (or more), each figure beside
# its peer in the same run, JSON into bench/results/:
#   W7.json         W7: 1.5B on 2 GPUs at 24 GiB each, 64k tokens a step, beside
#                   tidal on 1 GPU of the same host (the same global batch) and
#                   FSDP2 CPU offload on 2 GPUs (torchrun)
#   W10.json        W10: the largest model on 2 GPUs vs on 1 GPU of this host, fp32
#                   AdamW state, and tidal vs FSDP2 CPU offload at FSDP2's largest
#   host-peak-fp32.json  the host's measured peak a parameter for 1 and 2 ranks
# (each through bench/results.py: `python3 bench/report.py` tabulates them)
# Usage: bench/zero3.sh [path/to/tidal] [parts...]   (parts: w7 w10 host; default all)
# Environment: TD_BENCH_ARGS, extra flags for bench/workloads.py's W7 (e.g. --steps 7).
set -euo pipefail
tidal=${1:-build/tidal}
shift || true
parts=${*:-w7 w10 host}
for part in $parts; do
    case $part in
    w7)
        echo "== W7: tidal on 2 GPUs (ZeRO-3) beside tidal on 1 and FSDP2 CPU offload on 2"
        # shellcheck disable=SC2086 # TD_BENCH_ARGS is a list of flags
        python3 bench/workloads.py --tidal "$tidal" --workloads W7 --quick --steps 7 --warmup 2 --run-timeout 300 \
            ${TD_BENCH_ARGS:-}
        ;;
    w10)
        echo "== W10: the largest model on 2 GPUs, on 1, and beside FSDP2 at its largest"
        python3 bench/w10.py --tidal "$tidal" --steps 5 --warmup 2
        ;;
    host)
        echo "== the host's peak a parameter, 1 and 2 ranks"
        python3 bench/host_peak.py --tidal "$tidal" --ranks 1,2
        ;;
    *)
        echo "zero3.sh: unknown part '$part' (use w7, w10, host)" >&2
        exit 2
        ;;
    esac
done
