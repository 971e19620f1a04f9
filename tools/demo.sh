#!/bin/bash
# make demo: the main job.  Until the trainer lands it runs the copy benchmark
# (on the GPU if there is one, else on the CPU backend) and says so.
set -euo pipefail
tidal=${1:-build/tidal}
echo "tidal demo: the trainer is not built yet; running the copy benchmark instead."
echo "It measures host<->device bandwidth through tidal's copy engine beside raw pinned copies."
"$tidal" bench copy --iters 5
