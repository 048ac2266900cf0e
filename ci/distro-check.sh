#!/usr/bin/env bash
# Checks that the README's commands work on a fresh Debian release: debootstraps one (trixie by default) into a
# temporary root, clones this repository's HEAD into it and runs them there as a new user's machine would.
#
#   ci/distro-check.sh [--suite trixie|bookworm] [--stage setup|full] [--mirror URL] [--repo DIR]
#
#   --stage setup   ci/setup-host.sh, then the guest image build against the release's kernel package (busybox
#                   stands in for the guest binary: this checks the host and the kernel layout, not the guest)
#   --stage full    (default) ci/suite.sh, then ci/test.sh, with CI=true, each timed
#
# Slow (a fresh cargo build of everything) and so not part of the test command. Needs root. Only crates.io, PyPI
# and Debian are reachable from the machines here, so no toolchain can be downloaded: the host's rustup and cargo
# homes are bind-mounted into the root (cargo's registry cache is shared with the host; nothing else is written
# there unless a Rust target is missing, which ci/setup-host.sh would add). Every mount and the root itself are
# removed on every exit path; a mount that cannot be removed keeps the root on disk, never deleted through.
set -euo pipefail

suite=trixie stage=full mirror=http://deb.debian.org/debian
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) suite=$2; shift 2 ;;
    --stage) stage=$2; shift 2 ;;
    --mirror) mirror=$2; shift 2 ;;
    --repo) repo=$2; shift 2 ;;
    *) echo "usage: ci/distro-check.sh [--suite trixie|bookworm] [--stage setup|full] [--mirror URL] [--repo DIR]" >&2
       exit 2 ;;
  esac
done
case "$stage" in setup | full) ;; *) echo "ci/distro-check.sh: --stage setup or full" >&2; exit 2 ;; esac

log() { echo "distro-check: $*" >&2; }
die() { log "$*"; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot, mounts)"

rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
[ -x "$cargo_home/bin/cargo" ] || die "no cargo in $cargo_home/bin: the host's rustup toolchain is what the root uses"
# ci/setup-host.sh would `rustup target add` it inside, which needs a server these machines cannot reach.
installed=$(rustup target list --installed 2>/dev/null || true)
grep -qx x86_64-pc-windows-msvc <<<"$installed" \
  || log "the host's toolchain lacks x86_64-pc-windows-msvc: setup-host.sh inside will try to add it"

command -v debootstrap >/dev/null 2>&1 || {
  log "installing debootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}

work=$(mktemp -d "${TMPDIR:-/var/tmp}/vhca-distro-check.XXXXXX")
root=$work/root
mounted=()

# Processes still inside the root (an interrupted run's QEMU or cargo) would keep its mounts busy: they are ours.
kill_inside() {
  local p target
  for p in /proc/[0-9]*; do
    target=$(readlink "$p/root" 2>/dev/null) || continue
    case "$target" in "$root" | "$root"/*) kill -KILL "${p#/proc/}" 2>/dev/null || true ;; esac
  done
}

still_mounted() { awk -v r="$root" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo; }

cleanup() {
  local rc=$? i left
  trap - EXIT INT TERM
  kill_inside
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -R "${mounted[$i]}" 2>/dev/null || umount -R -l "${mounted[$i]}" 2>/dev/null || true
  done
  left=$(still_mounted)
  if [ -n "$left" ]; then
    log "still mounted, so $work is kept (not deleted through a mount): $left"
  else
    rm -rf --one-file-system "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# mount_at TARGET ARGS...: mounts and records TARGET for cleanup. Recursive binds are made slaves first thing, so
# unmounting them here cannot propagate back to the host's own /dev or /sys.
mount_at() {
  local target=$1; shift
  mkdir -p "$target"
  mount "$@" "$target"
  mounted+=("$target")
  case " $* " in *" --rbind "*) mount --make-rslave "$target" ;; esac
}

t0=$(date +%s)
log "debootstrap $suite into $root"
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap $suite failed"; }
log "debootstrap: $(($(date +%s) - t0)) s"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# The host's local CAs: on a network that inspects TLS the registries are reached only with them. The root's
# ca-certificates (installed by setup-host.sh) adds them to its bundle, and pip, which would use its own, is pointed
# at that bundle.
pip_cert=""
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  pip_cert=/etc/ssl/certs/ca-certificates.crt
fi
# No service starts inside the root when a package is installed.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 0755 "$root/usr/sbin/policy-rc.d"

mount_at "$root/proc" -t proc proc
mount_at "$root/sys" --rbind /sys
# /dev whole: /dev/kvm, /dev/pts and /dev/shm with it.
mount_at "$root/dev" --rbind /dev
mount_at "$root/opt/rustup" --bind "$rustup_home"
mount_at "$root/opt/cargo" --bind "$cargo_home"

git clone -q --no-hardlinks "$repo" "$root/vhca"
log "cloned $(git -C "$root/vhca" log -1 --format='%h %s')"

inside() {
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb CI=true ${pip_cert:+PIP_CERT=$pip_cert} \
    PATH=/opt/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RUSTUP_HOME=/opt/rustup CARGO_HOME=/opt/cargo bash -c "cd /vhca && $1"
}

# timed NAME COMMAND: runs COMMAND inside, prints its time and exit status; the status is the function's.
timed() {
  local name=$1 cmd=$2 start rc
  start=$(date +%s)
  log "$name: start"
  # In the background, waited for: bash runs a trap only once the foreground command ends, and an interrupted or
  # timed-out check must clean up now, not after the command inside has finished.
  set +e
  inside "$cmd" &
  wait $!
  rc=$?
  set -e
  log "$name: exit $rc in $(($(date +%s) - start)) s"
  return "$rc"
}

rc=0
case "$stage" in
  setup)
    timed ci/setup-host.sh 'ci/setup-host.sh && . /etc/os-release && echo "host: $PRETTY_NAME"' || rc=$?
    [ "$rc" -ne 0 ] || timed "guest image build" 'images/linux/build.sh resolve &&
      images/linux/build.sh build --out /tmp/image --guest "$(command -v busybox)" --cache /tmp/image-cache &&
      cat /tmp/image/image.info && ls -l /tmp/image' || rc=$?
    ;;
  full)
    timed ci/suite.sh ci/suite.sh || rc=$?
    timed ci/test.sh ci/test.sh || rc=$?
    ;;
esac
log "$suite, stage $stage: exit $rc, $(($(date +%s) - t0)) s in all"
exit "$rc"
