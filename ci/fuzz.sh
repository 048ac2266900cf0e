#!/usr/bin/env bash
# Coverage-guided fuzzing of every target in fuzz/ for SECONDS each, one after the other on one core. Without
# SECONDS (or with 0) each target runs until libFuzzer has made 10 million executions (-runs=10000000).
# Usage: [FUZZ_SANITIZER=address|none] ci/fuzz.sh [SECONDS] [TARGET...]. The default sanitizer is AddressSanitizer;
# `none` keeps debug assertions and overflow checks but runs 2-7x faster (docs/fuzz.md gives both campaigns).
# Needs nightly and cargo-fuzz (installed here if missing). Starts from the
# committed seeds plus whatever corpus earlier runs left in fuzz/corpus/TARGET (not committed), stops a target at
# its first crash or timeout (input saved in fuzz/artifacts/TARGET/), and prints one line per target: executions,
# seconds, executions per second, coverage (libFuzzer's edge `cov` and feature `ft` counts) and the outcome.
# A crash, once fixed, is copied to fuzz/regressions/TARGET/ so the stable test command replays it.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-0}
shift || true
sanitizer=${FUZZ_SANITIZER:-address}
if [ "$seconds" -gt 0 ]; then
    budget=(-max_total_time="$seconds")
else
    budget=(-runs=10000000)
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(vhost_user_connection hca_commands serial_console qmp_events event_log suite_file ioctl_dispatch)
fi
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
cargo +nightly fuzz build -O --debug-assertions -s "$sanitizer"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=0
echo "sanitizer: $sanitizer"
printf '%-24s %12s %8s %10s %8s %8s  %s\n' target executions seconds execs/s cov ft outcome
for target in "${targets[@]}"; do
    mkdir -p "corpus/$target" "artifacts/$target"
    log="$logs/$target.log"
    started=$SECONDS
    set +e
    # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a leak fails the run, not the machine.
    cargo +nightly fuzz run -O --debug-assertions -s "$sanitizer" "$target" "corpus/$target" -- \
        "${budget[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1
    rc=$?
    set -e
    # `|| true`: a log without the line (a crash before the first stats) must not end the script under pipefail.
    execs=$(awk '/stat::number_of_executed_units/ { print $NF }' "$log" | tail -1 || true)
    took=$(sed -nE 's/^Done [0-9]+ runs in ([0-9]+) second.*/\1/p' "$log" | tail -1 || true)
    cov=$( (grep -Eo 'cov: [0-9]+' "$log" || true) | tail -1 | awk '{ print $2 }')
    ft=$( (grep -Eo 'ft: [0-9]+' "$log" || true) | tail -1 | awk '{ print $2 }')
    # libFuzzer prints no "Done" line when interrupted or crashed: the wall time of the run stands in.
    took=${took:-$((SECONDS - started))}
    rate=$(( ${execs:-0} / (took > 0 ? took : 1) ))
    if [ "$rc" -eq 0 ]; then
        outcome="0 crashes, 0 timeouts"
    else
        # The log goes with the temp dir at exit: keep it first. An interrupt (Ctrl-C) is named as such.
        cp "$log" "artifacts/$target/last-run.log"
        cause=$(grep -m1 -Eo 'ERROR: libFuzzer: [a-z-]+|deadly signal|panicked at [^ ]+|run interrupted' "$log" || true)
        outcome="FAILED (exit $rc): ${cause:-no cause in the log}; log and input in fuzz/artifacts/$target/"
        failed=1
    fi
    printf '%-24s %12s %8s %10s %8s %8s  %s\n' "$target" "${execs:-?}" "$took" "$rate" "${cov:-?}" "${ft:-?}" "$outcome"
done
exit "$failed"
