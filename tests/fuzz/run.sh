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
# FUZZ_FLAGS: extra libFuzzer flags (e.g. -runs=1000000).
set -u
seconds=${1:?usage: tests/fuzz/run.sh SECONDS BIN...}
shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
failed=(); n=0
for bin in "$@"; do
    name=${bin##*/}
    n=$((n + 1))
    corpus=$here/corpus/$name
    crashes=$root/build-fuzz/crashes/$name
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/$name.XXXXXX")
    mkdir -p "$crashes"
    dict=(); [ -f "$here/$name.dict" ] && dict=(-dict="$here/$name.dict")
    [ -d "$corpus" ] || { echo "fuzz: $name has no seed corpus $corpus" >&2; failed+=("$name"); continue; }
    log=$crashes/last.log
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
        failed+=("$name")
        tail -60 "$log"
        printf 'FAIL %-28s exit %d after %s runs (log %s, inputs in %s)\n' "$name" "$rc" "${runs:-?}" "$log" "$crashes"
    else
        printf 'ok   %-28s %s runs in %s s\n' "$name" "${runs:-?}" "$took"
    fi
done
[ ${#failed[@]} -eq 0 ] || echo "failed: ${failed[*]}"
echo "$n targets, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
