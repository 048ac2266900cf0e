#!/usr/bin/env bash
# The release builds every CI entry point needs: vhca-device and vhca-run for the host, vhca-guest static for the
# guest image. Sourced by suite.sh and test.sh; exports VHCA_DEVICE_BIN and VHCA_GUEST_BIN for what runs next.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

target=${CARGO_TARGET_DIR:-$PWD/target}
case "$target" in /*) ;; *) target=$PWD/$target ;; esac

cargo build --release -p vhca-device -p vhca-run
# Static, so the initramfs needs no libc; --target keeps these flags off the host builds' artifacts.
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release -p vhca-guest --target x86_64-unknown-linux-gnu

export VHCA_DEVICE_BIN="$target/release/vhca-device"
export VHCA_GUEST_BIN="$target/x86_64-unknown-linux-gnu/release/vhca-guest"
export VHCA_RUN_BIN="$target/release/vhca-run"
