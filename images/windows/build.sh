#!/usr/bin/env bash
# One command from your own Windows ISO to an image directory vhca-run boots (docs/windows.md):
#   images/windows/build.sh --iso Win11.iso --out ~/vhca-images/win11 [--driver-package DIR] [more options]
# The work is vhca-run's `windows-image build` (answer disc, unattended install, verifier boot states); this script
# only builds vhca-run and the driver package first when they are missing. NEVER RUN here: no Windows ISO on the
# machines this project is developed on.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
run_bin=${VHCA_RUN_BIN:-$root/target/release/vhca-run}
if [ ! -x "$run_bin" ]; then
  cargo build --release -p vhca-run --manifest-path "$root/Cargo.toml"
fi
# The driver package comes from the Windows driver's build (ci/build-windows.sh) unless --driver-package names one.
if [[ " $* " != *" --driver-package "* ]] && [ ! -f "$root/target/vhca-sys/vhca.sys" ]; then
  if [ -x "$root/ci/build-windows.sh" ]; then
    "$root/ci/build-windows.sh"
  else
    echo "images/windows/build.sh: no driver package at target/vhca-sys and no ci/build-windows.sh; pass --driver-package DIR" >&2
    exit 2
  fi
fi
cd "$root"
exec "$run_bin" windows-image build "$@"
