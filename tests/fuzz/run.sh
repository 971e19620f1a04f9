#!/bin/bash
# tests/fuzz/run.sh SECONDS BIN... — runs each libFuzzer target for SECONDS.
#
# A target's seed corpus is tests/fuzz/corpus/<target>/ and its dictionary,
# when there is one, tests/fuzz/<target>.dict.  New inputs the fuzzer finds
# go to a scratch folder (the committed corpus stays small and reviewed);
# a crash, leak, timeout or out-of-memory is written to
# build-fuzz/crashes/<target>/ and fails the run.  Every target runs even
# after one fails; the last line is "N targets, M failed".
#
# SECONDS 0: no time limit (give FUZZ_FLAGS=-runs=N instead).
# FUZZ_JOBS: how many targets run at once (default: the cores).
# FUZZ_FLAGS: extra libFuzzer flags (e.g. -runs=1000000).
set -u
seconds=${1:?usage: tests/fuzz/run.sh SECONDS BIN...}
shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# FUZZ_JOBS: targets run at once (default: the cores); each is one process.
jobs=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}
[ "$jobs" -ge 1 ] 2>/dev/null || jobs=1

# One target: its result line into build-fuzz/crashes/<target>/result, and
# its log's tail there too when it failed.
run_one() {
    local bin=$1 name=${1##*/}
    local corpus=$here/corpus/$name crashes=$root/build-fuzz/crashes/$name
    mkdir -p "$crashes"
    local result=$crashes/result log=$crashes/last.log
    if [ ! -d "$corpus" ]; then
        echo "FAIL $name has no seed corpus $corpus" >"$result"
        return
    fi
    local scratch dict=() t0 rc took runs
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/$name.XXXXXX")
    [ -f "$here/$name.dict" ] && dict=(-dict="$here/$name.dict")
    t0=$(date +%s)
    # -timeout: a single input taking 10 s is a hang; -rss_limit_mb: the
    # parsers' own limits must keep memory small; UBSan findings abort.
    ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
        "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$crashes/" "${dict[@]}" ${FUZZ_FLAGS:-} "$scratch" "$corpus" >"$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - t0 ))
    rm -rf "$scratch"
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [ "$rc" -ne 0 ]; then
        { tail -60 "$log"
          printf 'FAIL %-28s exit %d after %s runs (log %s, inputs in %s)\n' "$name" "$rc" "${runs:-?}" "$log" "$crashes"
        } >"$result"
    else
        printf 'ok   %-28s %s runs in %s s\n' "$name" "${runs:-?}" "$took" >"$result"
    fi
}

running=0
for bin in "$@"; do
    rm -f "$root/build-fuzz/crashes/${bin##*/}/result"
    run_one "$bin" &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
        wait -n
        running=$((running - 1))
    fi
done
wait
failed=(); n=0
for bin in "$@"; do # the results in the order given
    name=${bin##*/}
    n=$((n + 1))
    result=$root/build-fuzz/crashes/$name/result
    if [ -f "$result" ]; then cat "$result"; else echo "FAIL $name left no result"; fi
    [ -f "$result" ] && tail -1 "$result" | grep -q '^ok ' || failed+=("$name")
done
[ ${#failed[@]} -eq 0 ] || echo "failed: ${failed[*]}"
echo "$n targets, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
