#!/usr/bin/env bash
# Runs the seed suite on this host: set-up, release builds (vhca.sys included), then `vhca-run suite`, each run restored from the saved
# guest. Arguments are passed on (e.g. --cold to boot every run, --json report.json, --artifacts out/).
# Exit status 0 only if every run passed.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/setup-host.sh
source ci/build.sh
# The seed suite runs every scenario as native and as vhca.sys: the signed driver goes into the guest image.
source ci/build-windows.sh
exec "$VHCA_RUN_BIN" suite "$@"
