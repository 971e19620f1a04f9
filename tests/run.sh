#!/bin/bash
# tests/run.sh BIN... — runs cmocka test binaries and sums their results.
#
# The last line is always "N passed, M failed, K skipped", counted in test
# cases.  A case that skipped is never counted as passed, and a binary whose
# cases all skipped shows as "skip".  A binary that crashes or exits non-zero
# without a cmocka failure counts one failed case; one that exits 0 without a
# cmocka summary also fails (it ran nothing that was counted).
#
# Skips are listed with their reason: the line "skipped: REASON" that the
# test prints before skip() (tests/support/td_test.h's td_test_skip).  A skip
# without a reason fails.  A reason that names hardware this machine has
# fails too, so nothing skips on the machine that should run it:
#   "needs N GPUs" / "needs a GPU"  fails when the machine has that many GPUs
#   "needs NCCL"                     fails when the machine has 2 GPUs or more
#   "needs CPU flag F"               fails when /proc/cpuinfo lists flag F
# GPUs are counted with `nvidia-smi -L` (within CUDA_VISIBLE_DEVICES when it
# is set); TD_TEST_GPUS=N overrides the count.
#
# TD_TEST_WRAP: a command each binary runs under (e.g. compute-sanitizer);
# its non-zero exit fails the binary.
# TD_TEST_JOBS=N: up to N binaries at once (default 1); the report keeps the
# order given.  Each binary's seconds then include its share of the cores.
# With several at once the binaries that tests/slow-first.txt names start
# first, in its order (the longest first: no long one is left to run alone
# at the end); the others follow in the order given.
passed=0; failed=0; skipped=0
run_t0=$(date +%s.%N)
failures=(); skip_lines=(); hw_lines=()

gpu_count() {
    if [ -n "${TD_TEST_GPUS:-}" ]; then echo "$TD_TEST_GPUS"; return; fi
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || n=0
    if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
        local v
        v=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .) || v=0
        [ "$v" -lt "$n" ] && n=$v
    fi
    echo "$n"
}
gpus=$(gpu_count)

# CPU seconds (user + system) of this script's finished children so far:
# beside each binary's wall-clock seconds, what it costs on a machine whose
# cores other work shares (the wall clock then grows, this does not).
# (/proc/PID/stat's cutime and cstime, fields 16 and 17 after the name.)
clk_tck=$(getconf CLK_TCK 2>/dev/null || echo 100)
children_cpu() {
    sed 's/^.*) //' "/proc/$$/stat" 2>/dev/null | awk -v hz="$clk_tck" '{ printf "%.2f", ($14 + $15) / hz }'
}

# Why a skip should not have happened here, or nothing.
hardware_present() {
    local why=$1 n flag
    if [[ $why =~ needs\ ([0-9]+)\ GPUs? ]]; then
        n=${BASH_REMATCH[1]}
        [ "$gpus" -ge "$n" ] && echo "this machine has $gpus GPU(s)"
    elif [[ $why =~ needs\ a\ GPU ]]; then
        [ "$gpus" -ge 1 ] && echo "this machine has $gpus GPU(s)"
    elif [[ $why =~ needs\ NCCL ]]; then
        [ "$gpus" -ge 2 ] && echo "this machine has $gpus GPUs: build with NCCL so its multi-rank cases run"
    elif [[ $why =~ needs\ CPU\ flag\ ([a-z0-9_]+) ]]; then
        flag=${BASH_REMATCH[1]}
        grep -qw "$flag" /proc/cpuinfo 2>/dev/null && echo "this CPU has $flag"
    fi
}

# Each binary runs in a subshell of its own, which leaves in $work/N.* its
# output, exit status, wall-clock and CPU seconds; up to $jobs at once
# (TD_TEST_JOBS; default 1).  Results are reported in the order given.
njobs=${TD_TEST_JOBS:-1}
[[ $njobs =~ ^[1-9][0-9]*$ ]] || { echo "tests/run.sh: TD_TEST_JOBS=$njobs: give a count of 1 or more" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/td-run.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; wait; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
start_one() {
    local i=$1 bin=$2
    (
        t0=$(date +%s.%N); me=$BASHPID
        ${TD_TEST_WRAP:-} "$bin" > "$work/$i.out" 2>&1; echo $? > "$work/$i.rc"
        # this subshell's finished children: the binary and all it ran
        sed 's/^.*) //' "/proc/$me/stat" | awk -v hz="$clk_tck" '{ printf "%.1f\n", ($14 + $15) / hz }' \
            > "$work/$i.cpu"
        awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f\n", b - a }' > "$work/$i.secs"
        mv "$work/$i.rc" "$work/$i.done"
    ) &
}

report() {
    local i=$1 bin=$2
    local name=${bin##*/}
    local out rc secs cpu
    out=$(cat "$work/$i.out"); rc=$(cat "$work/$i.done"); secs=$(cat "$work/$i.secs"); cpu=$(cat "$work/$i.cpu")
    sum() { printf '%s\n' "$out" | sed -n "s/^\[$1\] \([0-9]*\) test.*/\1/p" | awk '{ s += $1 } END { print s + 0 }'; }
    p=$(sum '  PASSED  '); f=$(sum '  FAILED  '); s=$(sum '  SKIPPED ')
    has_summary=$(printf '%s\n' "$out" | grep -c '^\[==========\] [0-9]* test(s) run\.')
    note=""
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; note="exit $rc without a cmocka failure"; fi
    if [ "$rc" -eq 0 ] && [ "$has_summary" -eq 0 ]; then f=1; note="no cmocka summary: nothing was counted"; fi

    # Each skipped case with the reason it printed between its RUN and SKIPPED lines.
    mapfile -t reasons < <(printf '%s\n' "$out" | awk '
        /^\[ RUN      \] / { cur = substr($0, 14); why = ""; next }
        /^skipped: /       { why = substr($0, 10); next }
        /^\[  SKIPPED \] / { t = substr($0, 14)
                             if (t == cur && !(t in seen)) { seen[t] = 1; print t "\t" why } }')
    for r in "${reasons[@]}"; do
        case_name=${r%%$'\t'*}; why=${r#*$'\t'}
        if [ -z "$why" ]; then
            hw_lines+=("$name: $case_name skipped without a reason (skip with td_test_skip(\"needs ...\"))")
            s=$((s - 1)); f=$((f + 1))
            continue
        fi
        present=$(hardware_present "$why")
        if [ -n "$present" ]; then
            hw_lines+=("$name: $case_name skipped ($why) but $present")
            s=$((s - 1)); f=$((f + 1))
        else
            skip_lines+=("$name: $case_name: $why")
        fi
    done
    [ "$s" -lt 0 ] && s=0

    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    counts="$(printf '%3d passed' "$p")"
    [ "$s" -ne 0 ] && counts="$counts, $s skipped"
    if [ "$f" -ne 0 ]; then
        failures+=("$name")
        # each failed assertion with what the test printed before it, then the end
        printf '%s\n' "$out" | grep -B8 -A1 -e '^\[  ERROR   \]' -e '^\[   LINE   \]' | head -80
        echo "..."
        printf '%s\n' "$out" | tail -40
        printf 'FAIL %-28s %s, %d failed%s %6s s (CPU %s s)\n' "$name" "$counts" "$f" "${note:+ ($note)}" "$secs" "$cpu"
    elif [ "$p" -eq 0 ] && [ "$s" -ne 0 ]; then
        printf 'skip %-28s %s %6s s (CPU %s s)\n' "$name" "$counts" "$secs" "$cpu"
    else
        printf 'ok   %-28s %s %6s s (CPU %s s)\n' "$name" "$counts" "$secs" "$cpu"
    fi
}

bins=("$@")
reported=0
flush() { # reports every finished binary whose predecessors are reported
    while [ "$reported" -lt ${#bins[@]} ] && [ -e "$work/$reported.done" ]; do
        report "$reported" "${bins[$reported]}"
        reported=$((reported + 1))
    done
}
# The start order: indices into bins, tests/slow-first.txt's names first.
order=()
if [ "$njobs" -gt 1 ] && [ -f "$(dirname "$0")/slow-first.txt" ]; then
    while read -r slow _; do
        [[ -z $slow || $slow == \#* ]] && continue
        for i in "${!bins[@]}"; do [ "${bins[$i]##*/}" = "$slow" ] && order+=("$i"); done
    done < "$(dirname "$0")/slow-first.txt"
fi
for i in "${!bins[@]}"; do [[ " ${order[*]} " == *" $i "* ]] || order+=("$i"); done
running=0
for i in "${order[@]}"; do
    while [ "$running" -ge "$njobs" ]; do
        wait -n || true
        running=$((running - 1))
        flush
    done
    start_one "$i" "${bins[$i]}"
    running=$((running + 1))
done
wait
flush

if [ ${#skip_lines[@]} -ne 0 ]; then
    echo "skipped:"
    printf '  %s\n' "${skip_lines[@]}"
fi
if [ ${#hw_lines[@]} -ne 0 ]; then
    echo "skips that count as failures:"
    printf '  %s\n' "${hw_lines[@]}"
fi
[ ${#failures[@]} -eq 0 ] || echo "failed: ${failures[*]}"
awk -v a="$run_t0" -v b="$(date +%s.%N)" -v c="$(children_cpu)" -v l="$(cut -d' ' -f1-3 /proc/loadavg)" -v n=$# \
    'BEGIN { printf "%d binaries in %.0f s, %.0f CPU-s (load average %s)\n", n, b - a, c, l }'
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
