#!/usr/bin/env bash
# Runs every test on this host: set-up, the release builds the end-to-end tests boot, then the whole workspace's
# tests in the same release profile (so nothing is built twice).
set -euo pipefail
cd "$(dirname "$0")/.."
ci/setup-host.sh
source ci/build.sh
# vhca.sys: built, packaged and test-signed here; a missing Windows target or osslsigncode is an error, not a skip.
source ci/build-windows.sh
# --all-targets: unit, integration and bench-as-test targets, without the empty doc-test passes. --no-fail-fast: one
# failing harness does not hide the others' results. The output is kept so the last line can total every harness's
# counts: one closing line that says what ran.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --release --all-targets --no-fail-fast 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$rc"
