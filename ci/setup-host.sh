#!/usr/bin/env bash
# Host set-up for vhca on Debian 12, as root: QEMU 10 from bookworm-backports and the tools the image build needs.
# Idempotent: every step checks before it acts, so the README's commands can call it on every run.
set -euo pipefail

need_qemu() {
  command -v qemu-system-x86_64 >/dev/null 2>&1 || return 0
  local major
  major=$(qemu-system-x86_64 --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -n1)
  [ "${major:-0}" -lt 10 ]
}

add_backports() {
  # Copy the machine's own Debian entry (URIs, Components, Signed-By) with Suites: bookworm-backports.
  local src=/etc/apt/sources.list.d/vhca-backports.sources
  [ -f "$src" ] && return 0
  local uris="http://deb.debian.org/debian" comps="main" signed="/usr/share/keyrings/debian-archive-keyring.gpg"
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uris=$(awk '/^URIs:/ && /debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    comps=$(awk '/^Components:/ {sub(/^Components: */,""); print; exit}' /etc/apt/sources.list.d/debian.sources)
    signed=$(awk '/^Signed-By:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: %s\nSigned-By: %s\n' \
    "${uris:-http://deb.debian.org/debian}" "${comps:-main}" "${signed:-/usr/share/keyrings/debian-archive-keyring.gpg}" >"$src"
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
command -v cpio >/dev/null 2>&1 || pkgs+=(cpio)
# objcopy: the image takes the guest binary without its debug info.
command -v objcopy >/dev/null 2>&1 || pkgs+=(binutils)
dpkg -s libc6-dev >/dev/null 2>&1 || pkgs+=(libc6-dev)
# Windows guests (never booted here): OVMF for the UEFI machine the tests start paused, xorriso for the answer disc,
# qemu-img for the image's disks and per-run overlays.
[ -f /usr/share/OVMF/OVMF_CODE_4M.fd ] || pkgs+=(ovmf)
command -v xorriso >/dev/null 2>&1 || pkgs+=(xorriso)
command -v qemu-img >/dev/null 2>&1 || pkgs+=(qemu-utils)
# vhca.sys (ci/build-windows.sh): signing and the test certificate.
command -v osslsigncode >/dev/null 2>&1 || pkgs+=(osslsigncode)
command -v openssl >/dev/null 2>&1 || pkgs+=(openssl)
command -v chromium >/dev/null 2>&1 || pkgs+=(chromium)  # the suite's report.html test renders it headless

if [ ${#pkgs[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  add_backports
  apt-get update -qq
  # No pipe into `grep -q` here: under pipefail an early-closing grep can turn a match into a failure.
  rest=()
  for p in "${pkgs[@]}"; do
    if [ "$p" = qemu-system-x86 ] || [ "$p" = qemu-utils ]; then
      apt-get install -y -qq -t bookworm-backports --no-install-recommends "$p" >/dev/null
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

qemu-system-x86_64 --version | head -n1
