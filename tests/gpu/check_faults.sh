#!/bin/bash
# The GPU path under faults, run on the GPU machine after `make`:
#   tests/gpu/check_faults.sh [build/tidal]
#  1. kill -9 at random moments of --save-every saves on CUDA: the directory
#     always loads (the old or the new checkpoint); each kill comes after the
#     run's first save, and a run that saved nothing fails the check;
#  2. SIGINT and SIGTERM stop at a step boundary, save, exit 130 / 143, and
#     the run resumes;
#  3. non-finite grads (injected) are skipped; --max-bad-steps in a row stop
#     the run with exit 1; a learning rate that blows up the weights does the
#     same for real.
# Prints PASS/FAIL per check and exits non-zero on any failure.
set -u
tidal=${1:-build/tidal}
work=$(mktemp -d /tmp/tidal-faults-XXXXXX)
trap 'rm -rf "$work"' EXIT
fail=0
pass() { echo "PASS $*"; }
bad() { echo "FAIL $*"; fail=1; }
corpus=${FORTUNES_DIR:-/usr/share/games/fortunes}
"$tidal" prepare --quiet --input "$corpus" --out "$work/f.tok" || { echo "FAIL prepare"; exit 1; }
# FAULTS_BACKEND=cpu runs the same checks on the CPU backend (fp32, a tiny model): a smoke test of this script.
backend=${FAULTS_BACKEND:-cuda}
if [ "$backend" = cuda ]; then
    model="--layers 12 --width 768 --heads 12 --seq 256 --micro-batch 8 --backend cuda --precision bf16"
    small="--layers 4 --width 256 --heads 4 --seq 128 --micro-batch 8 --backend cuda"; precs="bf16 fp32"; kill_s="0 3"
else
    model="--layers 2 --width 64 --heads 2 --seq 64 --micro-batch 2 --backend cpu"
    small="$model"; precs="fp32"; kill_s="0 1"
fi

# 1. kill -9 during saves.
ck="$work/ck"
"$tidal" train --data "$work/f.tok" $model --steps 2 --save "$ck" >/dev/null 2>&1 || bad "first save"
for i in 1 2 3 4 5 6; do
    "$tidal" train --data "$work/f.tok" $model --steps 1000 --save-every 1 --save "$ck" --resume "$ck" \
        >"$work/k$i.log" 2>&1 &
    p=$!
    # Kill only once this run has saved (a kill before its first save would
    # test nothing), at a random moment of the saves that follow.
    for _ in $(seq 1200); do grep -q '^saved\|saved ' "$work/k$i.log" && break; kill -0 $p 2>/dev/null || break; sleep 0.1; done
    sleep "$(python3 -c "import random; print(round(random.uniform(*map(float, '$kill_s'.split())), 2))")"
    kill -9 $p 2>/dev/null; wait $p 2>/dev/null
    saved=$(grep -c '^saved\|saved ' "$work/k$i.log")
    if [ "$saved" -eq 0 ]; then
        bad "kill -9 #$i: the run saved nothing before it was killed, so nothing was tested: $(tail -2 "$work/k$i.log")"
    elif "$tidal" eval --checkpoint "$ck" --data "$work/f.tok" --batches 1 --backend "$backend" $(echo "$model" | grep -o -- "--seq [0-9]*") >"$work/e$i.log" 2>&1 &&
       "$tidal" train --data "$work/f.tok" $model --steps 1000 --stop-after 1 --resume "$ck" >"$work/r$i.log" 2>&1; then
        pass "kill -9 #$i after $saved saves: the checkpoint loads and resumes ($(grep -o 'resumed.*' "$work/r$i.log"))"
    else
        bad "kill -9 #$i: $(tail -2 "$work/e$i.log" "$work/r$i.log")"
    fi
done

# 2. SIGINT and SIGTERM.
for sig in INT TERM; do
    want=$([ $sig = INT ] && echo 130 || echo 143)
    "$tidal" train --data "$work/f.tok" $model --steps 100000 --log-every 1 --save "$work/s$sig" >"$work/s$sig.log" 2>&1 &
    p=$!
    for _ in $(seq 600); do grep -q 'step 5/' "$work/s$sig.log" && break; sleep 0.1; done
    kill -$sig $p; wait $p; rc=$?
    if [ $rc -eq $want ] && grep -q "SIG$sig: stopped after step" "$work/s$sig.log" && grep -q '^saved\|saved ' "$work/s$sig.log" &&
       "$tidal" train --data "$work/f.tok" $model --steps 100000 --stop-after 1 --resume "$work/s$sig" >/dev/null 2>&1; then
        pass "SIG$sig: exit $rc, $(grep -o "stopped after step [0-9]*" "$work/s$sig.log"), saved, resumes"
    else
        bad "SIG$sig: exit $rc (want $want): $(tail -3 "$work/s$sig.log")"
    fi
done

# 3. Non-finite steps.
for prec in $precs; do
    m="$small --precision $prec"
    TD_FAULT_NONFINITE_STEP=3,2 "$tidal" train --data "$work/f.tok" $m --steps 8 --log-every 1 >"$work/n1.log" 2>&1; rc=$?
    if [ $rc -eq 0 ] && [ "$(grep -c 'not finite; skipped' "$work/n1.log")" -eq 2 ]; then
        pass "$prec: two injected non-finite steps skipped, the run went on"
    else bad "$prec: skipped steps: exit $rc, $(grep -c 'not finite' "$work/n1.log") reported"; fi
    TD_FAULT_NONFINITE_STEP=3,100 "$tidal" train --data "$work/f.tok" $m --steps 50 --save-every 1 --save "$work/n$prec" \
        --max-bad-steps 4 >"$work/n2.log" 2>&1; rc=$?
    if [ $rc -eq 1 ] && grep -q '4 steps in a row' "$work/n2.log" &&
       "$tidal" train --data "$work/f.tok" $m --steps 50 --stop-after 1 --resume "$work/n$prec" 2>&1 | grep -q 'at step 2'; then
        pass "$prec: --max-bad-steps 4 stopped the run (exit 1); the checkpoint is step 2, the last good one"
    else bad "$prec: max-bad-steps: exit $rc: $(tail -2 "$work/n2.log")"; fi
done
"$tidal" train --data "$work/f.tok" $small --precision ${precs%% *} --lr 1e4 --clip-grad-norm 1e30 --steps 60 --log-every 1 >"$work/n3.log" 2>&1; rc=$?
if [ $rc -eq 1 ] && grep -q 'steps in a row with a non-finite' "$work/n3.log"; then
    pass "${precs%% *} --lr 1e4: the weights blew up, $(grep -c 'not finite' "$work/n3.log") bad steps reported, stopped with exit 1"
else bad "${precs%% *} --lr 1e4: exit $rc: $(tail -2 "$work/n3.log")"; fi
[ $fail -eq 0 ] && echo "faults: all passed" || echo "faults: FAILED"
exit $fail
