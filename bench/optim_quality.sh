#!/bin/bash
# The quality cost of compact AdamW state (issue 10): the same run, 2000
# steps on a token file, once per --optim-state, then each checkpoint's
# held-out loss.  Prints the mean training loss of the last 100 steps and
# the held-out loss of each, and each against fp32.
#   bench/optim_quality.sh TOKFILE [OUTDIR] [extra tidal train flags...]
# Default shape: the README demo's (4 layers, 256 wide, 4 heads, T128, B8)
# on the cpu backend, one thread a run, the three runs side by side.  Flags
# given after OUTDIR win over these (the last of a flag counts); issue 10's
# GPU check at W1's shape (124M, vocabulary 50304, B16 x T1024, bf16; the
# three runs share the GPU), on at least 33M tokens of distinct text so that
# the 2000 steps make one pass (a smaller text is gone over several times,
# and memorising it separates the state types by several percent), in a
# real vocabulary (with byte tokens the loss drops steeply around step 600
# at a moment that moves with any perturbation, and the end loss mostly
# times that drop: fp32 runs of three seeds ended 7% apart).  From what the
# GPU machine has (150 MB of text, a BPE of 50257 tokens trained on it):
#   TOKENIZER=bpe bench/text_corpus.sh out/q 150000000
#   bench/optim_quality.sh out/q/corpus.tok out/q/r1337 --backend cuda --precision bf16 \
#       --layers 12 --width 768 --heads 12 --seq 1024 --micro-batch 16 --threads 5 --vocab 50304 --seed 1337
set -euo pipefail
tok=${1:?usage: bench/optim_quality.sh TOKFILE [OUTDIR] [train flags...]}
out=${2:-out/optim-quality}
shift $(( $# >= 2 ? 2 : 1 ))
tidal=${TIDAL:-build/tidal}
mkdir -p "$out"
for s in fp32 bf16 int8; do
  "$tidal" train --data "$tok" --backend cpu --layers 4 --width 256 --heads 4 --seq 128 --micro-batch 8 \
     --steps 2000 --seed 1337 --heldout 5 --threads 1 "$@" --optim-state $s \
     --log "$out/$s.jsonl" --save "$out/ck_$s" > "$out/$s.out" 2>&1 &
done
wait
for s in fp32 bf16 int8; do
  "$tidal" eval --checkpoint "$out/ck_$s" --data "$tok" --split heldout --batches 50 --json > "$out/eval_$s.json"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
res = {}
for s in ("fp32", "bf16", "int8"):
    rows = [json.loads(l) for l in open(f"{out}/{s}.jsonl")]
    last = [r["loss"] for r in rows[-100:]]
    res[s] = (sum(last) / len(last), json.loads(open(f"{out}/eval_{s}.json").read().strip().splitlines()[-1])["loss"])
f_train, f_held = res["fp32"]
for s, (tr, he) in res.items():
    print(f"{s:5s} train (last 100 steps) {tr:.5f} ({(tr / f_train - 1) * 100:+.2f}%)  "
          f"held-out {he:.4f} ({(he / f_held - 1) * 100:+.2f}%)")
PY
