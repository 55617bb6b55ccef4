#!/usr/bin/env bash
# Every Strata benchmark on one GPU, in one call of at most ~8 minutes. Writes <bench>.json files, a log and
# summary.json (targets checked) into $OUT.
#
#   OUT=/path/to/results bash benchmarks/run_all_gpu.sh
#
# Needs only torch (CUDA), transformers, tokenizers, safetensors, numpy: no server, no httpx. Each benchmark
# is its own process (a CUDA failure in one cannot poison the next) under `timeout`; the most important run
# first. A benchmark that hits its limit still leaves its rows so far (JSON with "partial": true). Steps that
# no longer fit the whole budget are skipped and logged. Environment overrides: BUDGET_S (total seconds,
# default 540), PYTHON, MODEL (default random:0.6b), MTP_MODEL (default builtin:strata-tiny), DEVICE, and the
# sizes PROMPT, NEW, LONG, TTFT_SIZES, SWITCH_LONG, SPLIT_LONG, SWITCH_NEW, GRAPH_NEW, COPY_MIB, SPEED_RESERVE_MIB;
# DECODE_COMPILE=0 skips the compiled decode run; STEPS=name,name runs only those benchmarks
# (e.g. STEPS=admission,switches)
# (tests/engine/bench/test_bench_script.py runs the whole script on CPU with tiny ones).
set -uo pipefail

OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
MODEL=${MODEL:-random:0.6b}
MTP_MODEL=${MTP_MODEL:-builtin:strata-tiny}
DEVICE=${DEVICE:-cuda:0}
BUDGET_S=${BUDGET_S:-540}
PROMPT=${PROMPT:-128}
NEW=${NEW:-256}
LONG=${LONG:-176K}
TTFT_SIZES=${TTFT_SIZES:-32K,128K,176K}
SWITCH_LONG=${SWITCH_LONG:-16K}
SPLIT_LONG=${SPLIT_LONG:-128K}
COPY_MIB=${COPY_MIB:-2048}
GRAPH_NEW=${GRAPH_NEW:-64}
SWITCH_NEW=${SWITCH_NEW:-128}
LOG="$OUT/run_all_gpu.log"
export STRATA_BENCH_CACHE=${STRATA_BENCH_CACHE:-/tmp/strata-bench-checkpoints}
export PYTHONUNBUFFERED=1
START_S=$(date +%s)
: > "$LOG"

log() { echo "[$(($(date +%s) - START_S))s] $*" | tee -a "$LOG"; }

# run NAME LIMIT_S ARGS...: one benchmark under min(LIMIT_S, what is left of the budget).
run() {
    local name=$1 limit=$2  # switches for one run come as environment variables: STRATA_X=1 run ...
    shift 2
    if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then
        return  # not asked for in STEPS
    fi
    local left=$((BUDGET_S - ($(date +%s) - START_S)))
    if [ "$left" -lt 15 ]; then
        log "SKIP $name: only ${left}s of the ${BUDGET_S}s budget left"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "START $name (limit ${limit}s): $*"
    timeout --signal=TERM --kill-after=10 "$limit" "$PY" -m engine.bench "$@" --json "$OUT/$name.json" >>"$LOG" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && log "TIMEOUT $name after ${limit}s (rows so far are in $name.json)" || log "END $name rc=$rc"
}

log "strata benchmarks on $(hostname); budget ${BUDGET_S}s"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,driver_version --format=csv >>"$LOG" 2>&1
"$PY" -c "import torch, transformers as t; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', t.__version__)" >>"$LOG" 2>&1

log "START checkpoint: $MODEL (random weights written once, shared by every benchmark)"
timeout 90 "$PY" -c "
import sys, torch
from engine.bench.common import prepare_model
print(prepare_model(sys.argv[1], torch.device(sys.argv[2])))" "$MODEL" "$DEVICE" >>"$LOG" 2>&1
log "END checkpoint rc=$?"

# The speed benchmarks (decode, peers, MTP, TTFT, graphs, switches) keep SPEED_RESERVE_MIB free. serve's default
# tier takes all VRAM but the reserve: ~140 GiB of ~0.6 MiB blocks on an H200, seconds more at every engine start
# (decode and mtp ran past their limits on 2026-12-01 once it did), the same decode step. admission and
# switches_long keep serve's default: they are about long prompts with VRAM full. 0 = serve's default (always
# on the CPU, where a host reserve that large would not fit).
SPEED_RESERVE_MIB=${SPEED_RESERVE_MIB:-$([[ "$DEVICE" == cuda* ]] && echo 98304 || echo 0)}
SPEED=()
[ "$SPEED_RESERVE_MIB" -gt 0 ] && SPEED=(--vram-reserve-mib "$SPEED_RESERVE_MIB")
COMMON=(--model "$MODEL" --device "$DEVICE")
# The headline figures first: decode, then the peers (eager + floor) on the same weights.
run decode 50 decode "${COMMON[@]}" "${SPEED[@]}" --batches 1,6 --prompt-tokens "$PROMPT" --new-tokens "$NEW" --graph-modes on,off
run peers 110 peers "${COMMON[@]}" "${SPEED[@]}" --batches 1,6 --prompt-tokens "$PROMPT" --new-tokens "$NEW" \
    --copy-mib "$COPY_MIB" --peers eager
run mtp 35 mtp "${SPEED[@]}" --model "$MTP_MODEL" --device "$DEVICE" --batches 1,6 --prompt-tokens "$PROMPT" \
    --new-tokens "$NEW" --mtp-depth 1
run mtp_depth2 35 mtp "${SPEED[@]}" --model "$MTP_MODEL" --device "$DEVICE" --batches 1,6 --prompt-tokens "$PROMPT" \
    --new-tokens "$NEW" --mtp-depth 2
# The seed report's moment: 6 slots decoding while a fresh 176K prompt is admitted (int8 KV, as in the report:
# 7 slots x 176K of bf16 KV would not fit next to anything else).
run admission 200 admission "${COMMON[@]}" --slots 6 --long-tokens "$LONG" --kv int8 --baseline-steps 64
run ttft 115 ttft "${COMMON[@]}" "${SPEED[@]}" --prompt-sizes "$TTFT_SIZES"
run graphs 25 graphs "${COMMON[@]}" "${SPEED[@]}" --batches 1,6 --prompt-tokens "$PROMPT" --new-tokens "$GRAPH_NEW"
run graphs_mtp 20 graphs "${SPEED[@]}" --model "$MTP_MODEL" --device "$DEVICE" --batch-mtp --mtp-depth 2 --batches 1,6 \
    --prompt-tokens "$PROMPT" --new-tokens "$GRAPH_NEW"
# Least important last: each switch on/off (COMPILE, the slowest to start, at the end), then the
# static-cache + torch.compile peer, which may spend minutes compiling.
run switches 60 switches "${COMMON[@]}" "${SPEED[@]}" --only SPLIT_ATTN,FUSED_PROJ,PINNED_STAGING,CAPTURE_ALL \
    --batches 1,6 --prompt-tokens "$PROMPT" --long-prompt-tokens "$SWITCH_LONG" --new-tokens "$SWITCH_NEW"
# SPLIT_ATTN where it claims to help: decode deep into a long context (batch 1, so the long prefill is one prompt).
run switches_long 90 switches "${COMMON[@]}" --only SPLIT_ATTN --batches 1 --prompt-tokens "$PROMPT" \
    --long-prompt-tokens "$SPLIT_LONG" --new-tokens "$GRAPH_NEW"
# The fastest decode this engine has: FUSED_PROJ and COMPILE on (COMPILE compiles each graph bucket first).
[ "${DECODE_COMPILE:-1}" = 1 ] && STRATA_FUSED_PROJ=1 STRATA_COMPILE=1 run decode_compile 150 decode "${COMMON[@]}" "${SPEED[@]}" --batches 1,6 \
    --prompt-tokens "$PROMPT" --new-tokens "$NEW" --graph-modes on
run peers_compile 120 peers "${COMMON[@]}" "${SPEED[@]}" --batches 1,6 --prompt-tokens "$PROMPT" --new-tokens "$NEW" \
    --skip-strata --peers static --copy-mib "$COPY_MIB"

"$PY" benchmarks/collect_results.py "$OUT" 2>&1 | tee -a "$LOG"
log "done"
