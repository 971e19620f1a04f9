#!/bin/bash
# make demo: trains a small GPT on the text of Debian's `fortunes` package with
# a device budget smaller than the model's state, so chunks move all the time;
# shows the loss falling and the offload figures, saves a checkpoint,
# evaluates it on held-out text and prints a sample.
# DEMO_STEPS=N changes the length (default 600: a few minutes on 2 cores).
set -euo pipefail
tidal=${1:-build/tidal}
corpus=${FORTUNES_DIR:-/usr/share/games/fortunes}
steps=${DEMO_STEPS:-600}
mkdir -p data out
if [ ! -f data/fortunes.tok ]; then
    "$tidal" prepare --input "$corpus" --out data/fortunes.tok
fi
model="--layers 4 --width 256 --heads 4 --seq 128 --micro-batch 8"
run="--backend cpu --gpu-budget 48MiB --ckpt on --policy auto"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "tidal demo: a GPU is present, but the CUDA model ops are not in tidal yet: training on the CPU backend."
fi
echo
echo "== the plan: 3.3M params (params, grads and AdamW state: 52 MiB) under a 48 MiB device budget"
"$tidal" plan --data data/fortunes.tok $model $run || true
echo
echo "== training for $steps steps"
"$tidal" train --data data/fortunes.tok $model $run --heldout 10 --steps "$steps" --lr 2e-3 \
    --log out/demo-log.jsonl --save out/demo --log-every 50
echo
echo "== held-out loss"
"$tidal" eval --checkpoint out/demo --data data/fortunes.tok --split heldout --heldout 10 --seq 128 --batches 20
echo
echo "== offload, from out/demo-log.jsonl"
python3 - <<'PY' 2>/dev/null || tail -n 1 out/demo-log.jsonl
import json
rows = [json.loads(l) for l in open("out/demo-log.jsonl")]
last = rows[-1]
print(f"loss {rows[0]['loss']:.3f} at step 1 -> {last['loss']:.3f} at step {last['step']}")
print(f"moved {last['h2d_bytes'] / 2**20:.0f} MiB host->device and {last['d2h_bytes'] / 2**20:.0f} MiB back; "
      f"device peak {last['device_peak_bytes'] / 2**20:.1f} MiB of the 48 MiB budget; "
      f"waited on copies {last['stall_ms']:.0f} ms in all")
PY
echo
echo "== a sample (out/demo holds the checkpoint; transformers.GPT2LMHeadModel.from_pretrained('out/demo') loads it)"
"$tidal" generate --checkpoint out/demo --prompt "Q: " --tokens 300 --temperature 0.8
