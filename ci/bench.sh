#!/usr/bin/env bash
# Times the seed suite from the snapshot and cold in one session (`vhca-run bench`, default -j 1,2) and prints a
# Markdown table: wall time, per-run median, speed-up. Arguments are passed on (e.g. -j 2, a suite file), so
# `ci/bench.sh --alternate-completion --rounds 3 --filter RE` times vhca.completion=poll against =interrupt, and
# `ci/bench.sh --roundtrip` the guest round trip in both modes (docs/bench.md sections 5 and 6).
#
#   ci/bench.sh --compare OLD_BIN_DIR [ROUNDS]
# instead times the suite from the snapshot with an older build (OLD_BIN_DIR holding its vhca-run, vhca-device and
# static vhca-guest) and with this tree's, alternately, at -j 1 and -j 2, ROUNDS times (default 2), each build with
# its own image and snapshot in a private cache, so old and new see the same machine in the same session. Prints
# one Markdown row per suite run: build, -j, wall, per-run median, min-max, passed. Both builds run the same runs:
# the 22 native runs the seed suite had when issue 15 was filed (the suite has since gained vhca.sys and
# low-resources runs the old build lacks), or BENCH_FILTER (a --filter regex) if set.
# Not a test: the numbers depend on the machine; docs/bench.md records what this machine gave.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/setup-host.sh
source ci/build.sh
if [ "${1:-}" != "--compare" ]; then
  exec "$VHCA_RUN_BIN" bench "$@"
fi
old=$(cd "${2:?--compare needs the directory of the old build}" && pwd)
rounds=${3:-2}
filter=${BENCH_FILTER:-'^(smoke|fast-mutex-create-cq|fixed-lock-create-cq|contiguous-cq-fallback|map-register-exhaustion|shared-buffer-sg|shared-buffer-common|use-after-unmap|user-buffer-probe-lock|user-buffer-no-lock|io-map-common-buffer)/verifier-(on|off)$'}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A private cache per build: the shared cache keeps 3 snapshots, and other sessions' builds would evict these.
for build in old new; do
  mkdir -p "$work/$build/cache"
  for f in debs kernel kernel-resolve.txt accel-probe.json; do
    if [ -e "${VHCA_CACHE_DIR:-$HOME/.cache/vhca}/$f" ]; then
      cp -r "${VHCA_CACHE_DIR:-$HOME/.cache/vhca}/$f" "$work/$build/cache/"
    fi
  done
done
run() { # build jobs out
  local dir=$1 jobs=$2 out=$3 bin_dir
  if [ "$dir" = old ]; then bin_dir=$old; else bin_dir=$(dirname "$VHCA_RUN_BIN"); fi
  local guest=$VHCA_GUEST_BIN device=$VHCA_DEVICE_BIN runner=$VHCA_RUN_BIN
  if [ "$dir" = old ]; then guest=$old/vhca-guest device=$old/vhca-device runner=$old/vhca-run; fi
  VHCA_CACHE_DIR="$work/$dir/cache" "$runner" --device-bin "$device" --guest-bin "$guest" \
    suite -j "$jobs" --filter "$filter" --artifacts "$out" >/dev/null 2>"$out.log" || true
}
cat >"$work/stats.py" <<'PY'
import json, os, shutil, statistics, sys
label, jobs, path = sys.argv[1:]
r = json.load(open(path))
s = sorted(x["seconds"] for x in r["runs"])
t = r["totals"]
for x in r["runs"]:
    if x.get("outcome", {}).get("result") != "pass":
        # The work dir goes at exit: a failed run's artifacts are copied out first.
        keep = os.path.join(os.environ.get("TMPDIR", "/tmp"), "vhca-bench-failures", "%s-j%s" % (label, jobs), x["name"])
        shutil.copytree(x["artifact_dir"], keep, dirs_exist_ok=True)
        print("%s -j %s: %s failed: %s (artifacts in %s)" % (label, jobs, x["name"], x.get("actual_text"), keep), file=sys.stderr)
print("| %s | %s | %.2f | %.3f | %.2f-%.2f | %d/%d |" % (label, jobs, t["wall_seconds"], statistics.median(s), s[0], s[-1], t["passed"], t["runs"]))
PY
stats() { python3 "$work/stats.py" "$@"; }
# One untimed suite run per build first: it builds that build's image and snapshot.
for build in old new; do run "$build" 2 "$work/warmup-$build"; done
echo "| build | -j | wall (s) | per-run median (s) | per-run min–max (s) | passed |"
echo "|---|---|---|---|---|---|"
for round in $(seq 1 "$rounds"); do
  for jobs in 1 2; do
    for build in old new; do
      out="$work/$build-$jobs-$round"
      run "$build" "$jobs" "$out"
      echo "load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
      stats "$build" "$jobs" "$out/report.json"
    done
  done
done
