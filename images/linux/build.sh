#!/usr/bin/env bash
# Builds the vhca Linux guest image from Debian packages: kernel (vmlinux extracted for a PVH boot, bzImage kept as the
# fallback) and an uncompressed newc initramfs with static busybox, the VFIO modules, /init and the static vhca-guest.
#
#   build.sh resolve                      print "<kernel package> <version>": the host release's linux-image-amd64 target
#   build.sh build --out DIR --guest BIN [--driver SYS] [--kernel-pkg PKG --kernel-ver VER] [--cache DIR]
#
# The caller (vhca-run's image cache) decides when to build; this script only builds. --cache holds the downloaded
# .debs and the per-kernel extraction, which do not depend on the guest binary and so are reused across guest builds.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The modules the guest needs: VFIO, and pvpanic-mmio so a kernel panic reaches QEMU's QMP as GUEST_PANICKED.
# Their dependency closure is resolved from modules.dep. A trailing '?' marks a module a kernel may not have as a module
# of its own: vfio_virqfd is one up to Linux 6.1 (Debian 12) and part of vfio.ko from 6.2 (Debian 13's 6.12).
vfio_modules=(irqbypass vfio 'vfio_virqfd?' vfio_iommu_type1 vfio-pci-core vfio-pci pvpanic-mmio)
# The busybox applets /init uses, as symlinks, so the image does not pay for `busybox --install` at every boot.
applets=(sh mount insmod poweroff sleep cat echo ls mkdir)

cleanup=()
trap 'for d in "${cleanup[@]}"; do rm -rf "$d"; done' EXIT

die() { echo "images/linux/build.sh: $*" >&2; exit 1; }
log() { echo "images/linux/build.sh: $*" >&2; }

apt_lists_ready() { local p; p=$(apt-cache policy linux-image-amd64 2>/dev/null) && grep -q "Candidate: [0-9]" <<<"$p"; }

resolve() {
  apt_lists_ready || { log "apt lists missing: apt-get update"; apt-get update -qq >&2 || die "apt-get update failed"; }
  local pkg ver
  pkg=$(apt-cache depends linux-image-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -n1)
  [ -n "$pkg" ] || die "cannot resolve the kernel package linux-image-amd64 depends on"
  ver=$(apt-cache policy "$pkg" | sed -n 's/^ *Candidate: //p')
  [ -n "$ver" ] && [ "$ver" != "(none)" ] || die "no candidate version for $pkg"
  echo "$pkg $ver"
}

# fetch_deb PKG VER DIR: prints the path of PKG_VER's .deb in DIR, downloading it once.
fetch_deb() {
  local pkg=$1 ver=$2 dir=$3 file
  mkdir -p "$dir"
  file=$(ls "$dir/${pkg}_${ver//:/%3a}_"*.deb 2>/dev/null | head -n1 || true)
  if [ -z "$file" ]; then
    log "downloading $pkg=$ver"
    (cd "$dir" && apt-get download -qq "$pkg=$ver" >&2 2>/dev/null) || die "apt-get download $pkg=$ver failed"
    file=$(ls "$dir/${pkg}_${ver//:/%3a}_"*.deb | head -n1)
  fi
  echo "$file"
}

# extract_vmlinux BZIMAGE OUT: the bzImage carries the kernel as one compressed stream; find its magic and inflate it.
extract_vmlinux() {
  local bz=$1 out=$2 magic tool off
  for pair in 'fd377a585a00:xz -dc --single-stream' '28b52ffd:zstd -dcq' '1f8b0800:gzip -dc' '02214c18:lz4 -dc'; do
    magic=${pair%%:*}; tool=${pair#*:}
    command -v "${tool%% *}" >/dev/null 2>&1 || continue
    off=$(LC_ALL=C grep -obUaP "$(sed 's/../\\x&/g' <<<"$magic")" "$bz" | head -n1 | cut -d: -f1 || true)
    [ -n "$off" ] || continue
    # Trailing bytes after the stream are expected (the bzImage goes on); the tools' complaint about them is noise.
    tail -c +$((off + 1)) "$bz" | $tool >"$out" 2>/dev/null || true
    if [ "$(head -c 4 "$out" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then return 0; fi
  done
  rm -f "$out"
  return 1
}

# The kernel tree's cache name carries the module list, so adding a module re-extracts instead of reusing a tree
# that lacks it.
modules_tag() { printf '%s\n' "${vfio_modules[@]}" | cksum | cut -d' ' -f1; }

# kernel_tree PKG VER CACHE: extracts once per kernel: boot/vmlinuz, vmlinux, and the VFIO modules in load order.
kernel_tree() {
  local pkg=$1 ver=$2 cache=$3 dir="$3/kernel/${2//:/_}-$1-m$(modules_tag)"
  if [ -f "$dir/.done" ]; then echo "$dir"; return 0; fi
  local deb tmp kver root listing usr=""
  deb=$(fetch_deb "$pkg" "$ver" "$cache/debs")
  tmp=$(mktemp -d "$cache/kernel/.extract.XXXXXX")
  cleanup+=("$tmp")
  # Debian 12 ships the modules in lib/modules, Debian 13 (merged /usr) in usr/lib/modules; tar fails on a pattern
  # that matches nothing, so ask the archive which one it has. (Listing kept whole: under pipefail a `grep -q` that
  # stops reading early would fail the pipe.)
  listing=$(dpkg-deb --fsys-tarfile "$deb" | tar -t) || die "cannot list $deb"
  grep -q '^\./usr/lib/modules/' <<<"$listing" && usr=usr/
  log "extracting $deb (modules in ${usr}lib/modules)"
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" --wildcards './boot/vmlinuz-*' "./${usr}lib/modules/*" \
    || die "cannot unpack $deb"
  # root: the directory whose lib/modules holds the modules, as busybox depmod -b and modules.dep's paths want it.
  root=$tmp
  [ -z "$usr" ] || root=$tmp/usr
  kver=$(ls "$root/lib/modules" | head -n1)
  [ -n "$kver" ] || die "$deb has no /${usr}lib/modules"
  # The .deb ships no modules.dep; busybox depmod writes one (host kmod's depmod may be absent).
  busybox depmod -b "$root" "$kver" || die "busybox depmod failed"
  mkdir -p "$tmp/out/modules"
  cp "$tmp/boot/vmlinuz-$kver" "$tmp/out/bzImage"
  if extract_vmlinux "$tmp/out/bzImage" "$tmp/out/vmlinux"; then log "vmlinux extracted"; else log "vmlinux extraction failed: bzImage only"; fi
  # Load order: each module after everything it depends on (depth-first over modules.dep).
  local order=() seen=" "
  visit() {
    local rel=$1 dep
    case "$seen" in *" $rel "*) return 0;; esac
    seen="$seen$rel "
    for dep in $(sed -n "s|^${rel}: *||p" "$root/lib/modules/$kver/modules.dep"); do visit "$dep"; done
    order+=("$rel")
  }
  for m in "${vfio_modules[@]}"; do
    local optional=""
    case "$m" in *\?) optional=1; m=${m%\?} ;; esac
    rel=$(cut -d: -f1 "$root/lib/modules/$kver/modules.dep" | grep -E "/${m}\.ko(\.xz|\.zst|\.gz)?$" | head -n1 || true)
    if [ -z "$rel" ] && [ -n "$optional" ]; then log "module $m: not a module of its own in $pkg"; continue; fi
    [ -n "$rel" ] || die "module $m not in $pkg"
    visit "$rel"
  done
  : >"$tmp/out/modules.order"
  for rel in "${order[@]}"; do
    local base src=$root/lib/modules/$kver/$rel
    base=$(basename "$rel")
    # busybox insmod cannot inflate compressed modules: store them plain.
    case "$rel" in
      *.ko.xz) xz -dc "$src" >"$tmp/out/modules/${base%.xz}"; base=${base%.xz} ;;
      *.ko.zst) zstd -dcq "$src" >"$tmp/out/modules/${base%.zst}"; base=${base%.zst} ;;
      *.ko.gz) gzip -dc "$src" >"$tmp/out/modules/${base%.gz}"; base=${base%.gz} ;;
      *) cp "$src" "$tmp/out/modules/$base" ;;
    esac
    echo "$base" >>"$tmp/out/modules.order"
  done
  echo "$kver" >"$tmp/out/kver"
  touch "$tmp/out/.done"
  # Atomic: a concurrent build that got there first wins and ours is dropped.
  mv -T "$tmp/out" "$dir" 2>/dev/null || [ -f "$dir/.done" ] || die "cannot move the kernel tree into $dir"
  rm -rf "$tmp"
  echo "$dir"
}

build() {
  local out="" guest="" driver="" pkg="" ver="" cache="${VHCA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vhca}"
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out=$2; shift 2 ;;
      --guest) guest=$2; shift 2 ;;
      --driver) driver=$2; shift 2 ;;
      --kernel-pkg) pkg=$2; shift 2 ;;
      --kernel-ver) ver=$2; shift 2 ;;
      --cache) cache=$2; shift 2 ;;
      *) die "unknown argument $1" ;;
    esac
  done
  [ -n "$out" ] && [ -n "$guest" ] || die "usage: build.sh build --out DIR --guest BIN [--driver SYS] [--kernel-pkg P --kernel-ver V] [--cache DIR]"
  [ -x "$guest" ] || die "guest binary $guest is missing or not executable"
  if [ -z "$pkg" ] || [ -z "$ver" ]; then read -r pkg ver < <(resolve); fi
  mkdir -p "$out" "$cache/kernel"
  local ktree bbdeb stage
  ktree=$(kernel_tree "$pkg" "$ver" "$cache")
  # busybox-static from Debian, not the host's busybox, so the image is the same on every host.
  bbver=$(apt-cache policy busybox-static | sed -n 's/^ *Candidate: //p')
  bbdeb=$(fetch_deb busybox-static "$bbver" "$cache/debs")
  stage=$(mktemp -d "$out/.stage.XXXXXX")
  cleanup+=("$stage")
  mkdir -p "$stage"/{bin,dev,proc,sys,tmp,etc/vhca,lib/modules} "$stage/.bb"
  dpkg-deb -x "$bbdeb" "$stage/.bb"
  # bin/busybox in Debian 12's package, usr/bin/busybox in 13's (merged /usr).
  if [ -f "$stage/.bb/usr/bin/busybox" ]; then mv "$stage/.bb/usr/bin/busybox" "$stage/bin/busybox"
  else mv "$stage/.bb/bin/busybox" "$stage/bin/busybox"; fi
  rm -rf "$stage/.bb"
  for a in "${applets[@]}"; do ln -s busybox "$stage/bin/$a"; done
  cp "$ktree"/modules/*.ko "$stage/lib/modules/"
  cp "$ktree/modules.order" "$stage/etc/vhca/modules"
  install -m 0755 "$here/init" "$stage/init"
  # Without its debug info (10 of its 14 MB; the unwind tables the NT model's call sites walk stay): every byte of
  # the initramfs is in guest RAM twice (the archive, freed but not zeroed, and the unpacked file), so in every
  # snapshot each run loads and each run's exit frees. Debuggers take the unstripped binary from target/: the code
  # and its addresses are the same.
  objcopy --strip-debug "$guest" "$stage/bin/vhca-guest"
  chmod 0755 "$stage/bin/vhca-guest"
  # The signed vhca.sys, for runs with vhca.driver=sys (the guest's PE loader maps it from here).
  if [ -n "$driver" ]; then install -D -m 0644 "$driver" "$stage/vhca/vhca.sys"; fi
  # Uncompressed: under TCG the kernel inflating an initramfs costs more than QEMU loading a few more megabytes.
  (cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$out/initramfs.cpio"
  # Hard links: every cached image shares the kernel files of its kernel tree instead of a 66 MB copy each.
  ln -f "$ktree/bzImage" "$out/bzImage" 2>/dev/null || cp "$ktree/bzImage" "$out/bzImage"
  if [ -f "$ktree/vmlinux" ]; then ln -f "$ktree/vmlinux" "$out/vmlinux" 2>/dev/null || cp "$ktree/vmlinux" "$out/vmlinux"; fi
  printf 'kernel_pkg=%s\nkernel_ver=%s\nkver=%s\nbusybox_ver=%s\n' "$pkg" "$ver" "$(cat "$ktree/kver")" "$bbver" >"$out/image.info"
}

case "${1:-}" in
  resolve) resolve ;;
  build) shift; build "$@" ;;
  *) die "usage: build.sh resolve | build --out DIR --guest BIN [...]" ;;
esac
