#!/usr/bin/env bash
# Where decode time goes on the GPU, in one call: `strata-engine bench profile` for the 0.6B shape (batch 1 and
# 6) and strata-tiny with MTP, then a short decode run with COMPILE on. Logs and JSON land in $OUT.
#
#   OUT=/path/to/logs bash scripts/gpu_profile.sh
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 STRATA_BENCH_CACHE=${STRATA_BENCH_CACHE:-/tmp/strata-bench-checkpoints}
PY=${PYTHON:-python3}
START_S=$(date +%s)
log() { echo "[$(($(date +%s) - START_S))s] $*" | tee -a "$OUT/profile.log"; }
prof() {  # prof NAME LIMIT_S ARGS...
    local name=$1 limit=$2
    shift 2
    log "START $name: $*"
    timeout "$limit" "$PY" -m engine.bench profile "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
    log "END $name rc=$?"
    grep -v USDT "$OUT/$name.log" | tail -"${TAIL:-45}" | tee -a "$OUT/profile.log"
}
prof profile_06b_b1 ${LIMIT_S:-120} --model random:0.6b --device cuda:0 --batch 1 --steps 64 ${EXTRA:-}
prof profile_06b_b6 ${LIMIT_S:-120} --model random:0.6b --device cuda:0 --batch 6 --steps 64 ${EXTRA:-}
prof profile_tiny_mtp ${LIMIT_S:-120} --model builtin:strata-tiny --device cuda:0 --batch 1 --batch-mtp --mtp-depth 1 --steps 64 ${EXTRA:-}
prof profile_tiny ${LIMIT_S:-120} --model builtin:strata-tiny --device cuda:0 --batch 1 --steps 64 ${EXTRA:-}
log done
