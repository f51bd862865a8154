#!/usr/bin/env bash
# Every GPU measurement of one device run, one after another, each bounded in time: checks (tests/gpu),
# the model's view while KV moves (gpu_overlap.py), tiercache beside LMCache's kernel (vs_lmcache.py gpu),
# the whole calls against their floors (gpu_bench.py --only per_size), and several server-mode processes at
# once (server_gpu_two.py). JSON to $OUT/<name>.json, everything printed to $OUT/gpu_all.log.
# Usage: OUT=dir LMCACHE_SRC=<unpacked LMCache 0.5.6 source> [OVERLAP_ARGS=...] benchmarks/gpu_all.sh [part ...]
#   parts: tests overlap vs_lmcache per_size server_two (default: all, in that order, meant to fit one 600 s
#   command). The overlap part measures, over 5 rounds, the paths dispatch picks for pinned L1 and those the
#   docs read the goals from; OVERLAP_ARGS replaces its arguments (every path: "--every-path --rounds 5
#   --size-budget 250 --ce-streams 4", about 470 s on its own).
set -u
OUT=${OUT:-benchmarks/results}
LMCACHE_SRC=${LMCACHE_SRC:?the unpacked LMCache 0.5.6 source (it has csrc/cuda)}
HERE=$(cd "$(dirname "$0")" && pwd)
LOG="$OUT/gpu_all.log"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} LMCACHE_BUILD_DIR=${LMCACHE_BUILD_DIR:-/tmp/lmc_build}
OVERLAP_ARGS=${OVERLAP_ARGS---rounds 5 --size-budget 150}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests overlap vs_lmcache per_size server_two)
step() {  # name seconds command...: run it bounded, its stdout JSON to $OUT/name.json
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.json" 2>> "$LOG"
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    [ -s "$OUT/$name.json" ] || rm -f "$OUT/$name.json"
}
nvidia-smi -L | tee -a "$LOG"
for p in "${parts[@]}"; do
    case $p in
        tests) echo "=== tests ($(date -u +%T))" | tee -a "$LOG"
               timeout 150 python3 -m pytest -q -x -p no:cacheprovider "$HERE/../tests/gpu" 2>&1 | tail -5 | tee -a "$LOG" ;;
        overlap) echo "=== gpu_overlap ($(date -u +%T)): every size bounded by --size-budget" | tee -a "$LOG"
                 timeout 600 python3 "$HERE/gpu_overlap.py" --lmcache-src "$LMCACHE_SRC" \
                     --out "$OUT/gpu_overlap.json" $OVERLAP_ARGS 2>> "$LOG"
                 echo "=== gpu_overlap rc=$? ($(date -u +%T))" | tee -a "$LOG" ;;
        vs_lmcache) step vs_lmcache_gpu 240 python3 "$HERE/vs_lmcache.py" gpu --lmcache-src "$LMCACHE_SRC" ;;
        per_size) step gpu_bench_per_size 200 python3 "$HERE/gpu_bench.py" --only per_size ;;
        server_two) step server_gpu_two 200 python3 "$HERE/server_gpu_two.py" ;;
        *) echo "unknown part $p" | tee -a "$LOG" ;;
    esac
done
