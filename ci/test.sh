#!/usr/bin/env bash
# Runs every test on this host: set-up, the release builds the end-to-end tests boot, then the whole workspace's
# tests in the same release profile (so nothing is built twice).
set -euo pipefail
cd "$(dirname "$0")/.."
ci/setup-host.sh
source ci/build.sh
cargo test --workspace --release
