#!/usr/bin/env bash
# Times the seed suite from the snapshot and cold in one session (`vhca-run bench`, default -j 1,2) and prints a
# Markdown table: wall time, per-run median, speed-up. Arguments are passed on (e.g. -j 2, a suite file).
# Not a test: the numbers depend on the machine; docs/bench.md records what this machine gave.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/setup-host.sh
source ci/build.sh
exec "$VHCA_RUN_BIN" bench "$@"
