#!/bin/bash
# tests/run.sh BIN... — runs cmocka test binaries and sums their results.
# A binary that crashes or exits non-zero without a cmocka summary counts as
# one failed test.  The last line is always "N passed, M failed".
# TD_TEST_WRAP: a command each binary runs under (e.g. compute-sanitizer);
# its non-zero exit fails the binary.
passed=0; failed=0; failures=()
for bin in "$@"; do
    name=${bin##*/}
    out=$(${TD_TEST_WRAP:-} "$bin" 2>&1); rc=$?
    p=$(printf '%s\n' "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | tail -1)
    f=$(printf '%s\n' "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | tail -1)
    p=${p:-0}; f=${f:-0}
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p)); failed=$((failed + f))
    if [ "$f" -ne 0 ]; then
        failures+=("$name")
        printf '%s\n' "$out" | tail -40
        printf 'FAIL %-28s %3d passed, %d failed (exit %d)\n' "$name" "$p" "$f" "$rc"
    else
        printf 'ok   %-28s %3d passed\n' "$name" "$p"
    fi
done
[ ${#failures[@]} -eq 0 ] || echo "failed: ${failures[*]}"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
