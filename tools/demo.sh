#!/bin/bash
# make demo: trains a small GPT on the text of Debian's `fortunes` package
# with a device budget smaller than the model's state, so chunks move all
# the time; shows the loss falling and the offload figures, saves a
# checkpoint, evaluates it on held-out text and prints a sample.
#
#   on a GPU:  25M params (8 layers, 512 wide), 1800 steps of 32 x 256
#              bytes (15M tokens, about six passes over the corpus) under a
#              384 MiB budget, and a sample of English words
#   on a CPU:  3.3M params (4 layers, 256 wide), 300 steps of 8 x 64
#              bytes under a 32 MiB budget on the cpu backend; the sample
#              is made of word-like pieces
#
# DEMO_STEPS=N changes the length; FORTUNES_DIR the corpus.
set -euo pipefail
tidal=${1:-build/tidal}
corpus=${FORTUNES_DIR:-/usr/share/games/fortunes}
start=$SECONDS
mkdir -p data out
if [ ! -f data/fortunes.tok ]; then
    "$tidal" prepare --input "$corpus" --out data/fortunes.tok
fi
if "$tidal" version | grep -q cuda && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    model="--layers 8 --width 512 --heads 8 --seq 256 --micro-batch 32"
    steps=${DEMO_STEPS:-1800}
    run="--backend cuda --precision bf16 --gpu-budget 384MiB --ckpt on --policy auto"
    what="25M params (params, grads, fp32 master and AdamW state: 402 MiB) under a 384 MiB device budget, on the GPU"
    lr=1e-3 warmup=100 seq=256 budget=384 backend=cuda
else
    model="--layers 4 --width 256 --heads 4 --seq 64 --micro-batch 8"
    steps=${DEMO_STEPS:-300}
    run="--backend cpu --gpu-budget 32MiB --ckpt on --policy auto"
    what="3.3M params (params, grads and AdamW state: 50 MiB) under a 32 MiB device budget, on the CPU backend"
    lr=1e-3 warmup=20 seq=64 budget=32 backend=cpu
fi
echo
echo "== the plan: $what"
"$tidal" plan --data data/fortunes.tok $model $run || true
echo
echo "== training for $steps steps"
"$tidal" train --data data/fortunes.tok $model $run --heldout 10 --steps "$steps" --lr "$lr" --warmup "$warmup" \
    --log out/demo-log.jsonl --save out/demo --overwrite --log-every 50
echo
echo "== held-out loss"
"$tidal" eval --checkpoint out/demo --data data/fortunes.tok --split heldout --heldout 10 --seq "$seq" --batches 20 \
    --backend "$backend"
echo
echo "== offload, from out/demo-log.jsonl"
BUDGET_MIB=$budget python3 - <<'PY' 2>/dev/null || tail -n 1 out/demo-log.jsonl
import json, os
rows = [json.loads(l) for l in open("out/demo-log.jsonl")]
last = rows[-1]
print(f"loss {rows[0]['loss']:.3f} at step 1 -> {last['loss']:.3f} at step {last['step']}")
# The loss curve as a sparkline: 60 columns, each the mean of its steps.
cols = min(60, len(rows))
means = [sum(r["loss"] for r in rows[i * len(rows) // cols:(i + 1) * len(rows) // cols]) /
         max(1, (i + 1) * len(rows) // cols - i * len(rows) // cols) for i in range(cols)]
lo, hi = min(means), max(means)
bars = "\u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588"
print(f"loss curve {hi:.2f} " + "".join(bars[min(7, int((m - lo) / (hi - lo + 1e-12) * 8))] for m in means) + f" {lo:.2f}")
print(f"moved {last['h2d_bytes'] / 2**20:.0f} MiB host->device and {last['d2h_bytes'] / 2**20:.0f} MiB back; "
      f"device peak {last['device_peak_bytes'] / 2**20:.1f} MiB of the {os.environ['BUDGET_MIB']} MiB budget; "
      f"waited on copies {last['stall_ms']:.0f} ms in all")
PY
echo
echo "== a sample (out/demo holds the checkpoint; transformers.GPT2LMHeadModel.from_pretrained('out/demo') loads it)"
"$tidal" generate --checkpoint out/demo --prompt "Q: " --tokens 300 --temperature 0.8
echo
echo "== the demo took $((SECONDS - start)) s"
