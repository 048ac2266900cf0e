#!/usr/bin/env bash
# Runs one of this repository's commands inside a Debian 13 container, for hosts whose own release cannot serve
# vhca: Ubuntu (GitHub's hosted runners) ships QEMU 8.2 (24.04) or 6.2 (22.04), without the mapped-ram migration the
# saved guest needs or the HCA's carrier as QEMU 10 has it, and its kernel packages are laid out unlike Debian's.
#
#   ci/in-debian-container.sh COMMAND [ARGS...]      e.g. ci/in-debian-container.sh ci/test.sh
#
# Needs docker and a Rust toolchain installed with rustup on the host (with the x86_64-pc-windows-msvc target:
# `rustup target add x86_64-pc-windows-msvc`): the container takes the host's RUSTUP_HOME and CARGO_HOME instead of
# downloading its own. The repository is mounted at /vhca read-write (target/ and artifact roots land in the host's
# tree), /dev/kvm is passed through when the host has one (else vhca-run uses TCG and says so), CI is passed on, and
# ci/setup-host.sh runs inside as on any Debian 13 host. Files the container's root wrote are handed back to the
# caller's user at the end. VHCA_DEBIAN_IMAGE overrides the image (debian:bookworm takes QEMU from backports).
set -euo pipefail

[ $# -gt 0 ] || { echo "usage: ci/in-debian-container.sh COMMAND [ARGS...]" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
image=${VHCA_DEBIAN_IMAGE:-debian:trixie}
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
for d in "$rustup_home" "$cargo_home/bin"; do
  [ -d "$d" ] || { echo "ci/in-debian-container.sh: no $d: install Rust with rustup first" >&2; exit 1; }
done

args=(--rm --init -w /vhca
  -v "$repo:/vhca" -v "$rustup_home:/opt/rustup" -v "$cargo_home:/opt/cargo"
  -e RUSTUP_HOME=/opt/rustup -e CARGO_HOME=/opt/cargo -e CI -e TERM=dumb
  -e PATH=/opt/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  -e VHCA_OWNER="$(id -u):$(id -g)"
  # The device installs its own seccomp filter and the tests check what it traps; the container's default profile
  # on top would refuse calls the rig makes on a plain host.
  --security-opt seccomp=unconfined)
[ -e /dev/kvm ] && args+=(--device /dev/kvm)

# Inside: the command, then the ownership of what it wrote given back (the mounts are the host's directories). The
# command's exit status is the container's.
# shellcheck disable=SC2016 # expanded by the container's shell
inner='give_back() { [ "$VHCA_OWNER" = 0:0 ] || chown -R "$VHCA_OWNER" /vhca /opt/cargo /opt/rustup; }
trap give_back EXIT
"$@"'
exec docker run "${args[@]}" "$image" bash -c "$inner" vhca "$@"
