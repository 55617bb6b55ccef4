#!/usr/bin/env bash
# Every GPU measurement of docs/BENCHMARKS.md, as named steps, in one call of at most BUDGET_S seconds. Each step
# is its own process (a CUDA failure in one cannot poison the next) under `timeout`; its JSON and log land in $OUT.
#
#   OUT=/path/to/results bash benchmarks/run_all_gpu.sh              # the default steps, then summary.json
#   OUT=/path/to/results bash benchmarks/run_all_gpu.sh STEP[,STEP]  # only those (or STEPS=STEP,STEP)
#   bash benchmarks/run_all_gpu.sh --list                            # every step
#
# A benchmark that hits its limit still leaves its rows so far (JSON with "partial": true). Steps that no longer
# fit the budget are skipped and logged. Environment overrides: BUDGET_S (default 540), PYTHON, MODEL (default
# random:0.6b), MTP_MODEL (default builtin:strata-tiny), QUANT_MODEL and QUANT_PEER_MODEL (default random:8b),
# QUANT_SIZE (8b), QUANT_SMALL_SIZE (0.6b), QUANT_TUNE, QUANT_ROWS, QUANT_FORMATS, MOE_TOKENS, MOE_TUNE, DEVICE, the
# sizes PROMPT, NEW, LONG, TTFT_SIZES, SWITCH_LONG, SPLIT_LONG, SWITCH_NEW, GRAPH_NEW, COPY_MIB, SPEED_RESERVE_MIB (or
# SPEED_USABLE_MIB); DECODE_COMPILE=0 skips the compiled decode run; SEED_RUNS, MOE_RUNS, MOE80B_RUNS, GPU_WORKERS for
# the seed and test-suite steps; GPU_TESTS (default tests) the folders, files or test ids (space-separated) the
# gpu_suite steps collect, SESSION_MARGIN_S their session's end before the limit;
# LIMIT_SCALE (default 1) multiplies every step's own limit (a slower or busier machine; the budget still caps each)
# (tests/engine/bench/test_bench_script.py runs the default steps on CPU with tiny sizes).
set -uo pipefail

# name, then what it measures; the first block runs when no step is named (most important first)
STEP_LIST="\
decode            default  decode tok/s per batch, CUDA graphs on and off
peers             default  Strata against HF transformers' eager generate, and the weight-bandwidth floor
mtp               default  MTP off vs on at depth 1, batch 1 and 6 (strata-tiny)
mtp_depth2        default  the same at depth 2
admission         default  six slots decoding while a fresh 176K prompt is admitted (int8 KV, VRAM full)
ttft              default  time to first token of fresh 32K, 128K and 176K prompts
graphs            default  the graph cache after each batch (0.6B)
graphs_mtp        default  the same for strata-tiny with MTP at depth 2
switches          default  each opt-in switch off vs on
switches_long     default  SPLIT_ATTN at batch 1 with a SPLIT_LONG prompt, VRAM full
decode_compile    default  decode with FUSED_PROJ and COMPILE on
peers_compile     default  HF static cache + torch.compile alone
peers_static      named    Strata against HF static cache + torch.compile in the same run, batch 1 and 6
llama_build       named    llama.cpp's llama-server with CUDA, built here from LLAMA_CPP_SRC (scripts/pack_llama_src.sh)
peers_llamacpp    named    Strata against llama.cpp (CUDA) and HF static + compile on the same bf16 weights, batch 1, 6, 16
peers_gguf        named    Strata against llama.cpp on one Q8_0 and one Q4_0 GGUF file, batch 1 and 16
mtp_1             named    MTP off vs on at batch 1, depth 1 (the decode-vs-MTP table)
mtp_2             named    the same at depth 2
profile_b1        named    where a batch-1 decode step's time goes (0.6B)
profile_b6        named    the same at batch 6
profile_ahead_off named    the batch-1 step with --decode-ahead off
profile128k_bf16  named    a batch-1 decode step at 128K of context, bf16 KV
profile128k_int8  named    the same with int8 KV
profile_tiny_mtp_0 named   a strata-tiny step, plain
profile_tiny_mtp_1 named   a strata-tiny MTP step at depth 1
profile_tiny_mtp_2 named   a strata-tiny MTP step at depth 2
ttft_176k         named    the first token of a fresh 176K prompt alone, bf16 KV
ttft_176k_int8    named    the same with int8 KV
admission_between named    the admission with the chunks between the decode steps (--prefill-overlap off)
reuse             named    a reused 32K prompt's first token against the fresh one's, shared and copy paths
attention_decode  named    the paged decode kernel's tile loads at 32K and 128K keys, batch 1 and 6
attention_backends named   one layer's decode attention: gather + SDPA, the Triton paged kernel, FlexAttention
attention_prefill named    the prefill kernel's launch shapes and loads, 2,048-token chunk over 32K and 128K
attention_split   named    a 256-token chunk 8K-128K deep: split keys (the default) against one pass
attention_sdpa    named    the prefill kernel against cuDNN's and flash's SDPA over the gathered prefix
linear            named    a decode step's projections: cuBLAS against the skinny matmul
experts           named    a random Qwen3-MoE per expert-cache budget, and its routing trace
experts_kernels   named    one random:moe-80b layer's routed experts per backend (Triton, torch._grouped_mm, gather) at 1-2,048 tokens, against the floor
experts_resident  named    random:moe-80b-40l with every expert on the card, decode batch 1 and 6, against its bandwidth floor
kvspill           named    decode with half of the non-resident KV on the host, against the PCIe floor
kvspill_six       named    the seed's six long prompts on a pool sized for two
throughput        named    1..256 concurrent 1K-token prompts (KV by use): tok/s, TTFT, inter-token, floor, HF static peer
throughput_mixed  named    the same with the seeded mixed set (128-8K prompts, 64-1K outputs), no peer
throughput_reserved named  the fixed set with reserved KV (--kv-pool reserved), no peer: by use's figures against it
compile_cold      named    FUSED_PROJ + COMPILE decode with an empty compile cache
compile_warm      named    the same again, the compiled kernels from the cache
seed              named    the seed scenario through serve, SEED_RUNS runs (default 5)
moe_seed          named    the seed scenario on a random Qwen3-MoE, MOE_RUNS runs (default 3)
kv_seed           named    the seed scenario with --kv-resident 16384 (131K prompt)
moe80b_seed       named    the seed scenario at seed scale: random:moe-80b, expert cache auto, fresh 176K prompt, MOE80B_RUNS runs (default 1)
experts_cold      named    random:moe-80b at 85 % of experts on the card: cold experts copied / on the CPU / prefetched, batch 1 and 6, against random:moe-80b-40l all resident
experts_prefill_chunked named random:moe-80b at 85 %: the MiB a 16K prompt copies in and its first-token time, chunk by chunk (--prefill-window-tokens 0)
experts_prefill   named    the same in one layer-major window of 16K tokens (the default): each cold expert once per layer
quant_tests       named    the quantized kernels' GPU tests (every path against cuBLAS, capture, FP8 prompt GEMMs, MTP on = off), in GPU_WORKERS processes
quant_linear      named    each path of the quantized kernels (GEMV, tensor cores, prompt chunks) beside tinygemm and cuBLAS bf16 at the QUANT_SIZE (8b) shapes, QUANT_ROWS (1,4,16,128,2048), QUANT_TUNE's launch shapes, the launch table they give
quant_linear_small named   every quantized format (GGUF's groups too) at the 0.6B shape, rows 1, 16, 128
dequant_ncu       named    ncu of the prompt-chunk path's int4 dequantizing kernel at the 8B gate/up shape, beside a copy of its bf16 bytes
quant_decode      named    decode of QUANT_MODEL (random:8b, drawn on the GPU) with bf16, fp8 (also with --quantize-head), fp8-block and int4 weights (int4 also with --int4-decode tinygemm), batch 1, 16 and 64
quant_peers       named    QUANT_PEER_MODEL (random:8b) written as a block-FP8 checkpoint: Strata against transformers on it, batch 1 and 16
prefill_eta       named    strata-tui's prefill ETA at the halfway mark of a fresh 180K prompt, alone and beside 4 decodes
gpu_suite         named    every @pytest.mark.gpu test, in GPU_WORKERS processes (default 4)
gpu_suite_shared  named    the GPU tests marked gpu_shared (kernels and models against references), side by side: gpu_suite's first half
gpu_suite_alone   named    the other GPU tests (engines, servers, NVML), each with the GPU to itself: the second half (GPU_TESTS splits it further)
peer_tests        named    two GPUs: the GPU tests of the tier and the expert store on cuda:1
reuse_peer        named    two GPUs: bench reuse with the tier on cuda:0 and on cuda:1
seed_peer         named    two GPUs: the seed scenario with the tier on cuda:1
experts_peer      named    two GPUs: bench experts with the store on the host and on cuda:1
screenshots       named    strata-tui's GPU screenshots (real NVML), into \$OUT/shots.tgz
"
ALL_STEPS=$(awk '{print $1}' <<<"$STEP_LIST" | xargs)
DEFAULT_STEPS=$(awk '$2 == "default" {print $1}' <<<"$STEP_LIST" | tr '\n' ',')

case "${1:-}" in
    --list) echo "$STEP_LIST"; exit 0 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) STEPS=$1 ;;
esac
_named=${STEPS:-}
for name in ${_named//,/ }; do
    if [[ " $ALL_STEPS " != *" $name "* ]]; then
        echo "run_all_gpu.sh: unknown step '$name'; the steps are: $ALL_STEPS" >&2
        exit 2
    fi
done

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
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! "$PY" -c "import fastapi, uvicorn, textual" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    # a machine without a package index: the server's wheels carried along
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
START_S=$(date +%s)
: > "$LOG"

log() { echo "[$(($(date +%s) - START_S))s] $*" | tee -a "$LOG"; }

# wanted NAME LIMIT_S: whether to run the step now, and its limit in $limit: min(LIMIT_S, what is left of the budget).
wanted() {
    local steps=${STEPS:-$DEFAULT_STEPS} left
    [[ ",$steps," == *",$1,"* ]] || return 1
    left=$((BUDGET_S - ($(date +%s) - START_S)))
    if [ "$left" -lt 15 ]; then
        log "SKIP $1: only ${left}s of the ${BUDGET_S}s budget left"
        return 1
    fi
    limit=$(($2 * ${LIMIT_SCALE:-1}))
    [ "$limit" -gt "$left" ] && limit=$left
    return 0
}

# run NAME LIMIT_S BENCH ARGS...: `python -m engine.bench BENCH ARGS --json $OUT/NAME.json`, its output in the log.
run() {
    local name=$1 limit  # switches for one run come as environment variables: STRATA_X=1 run ...
    wanted "$1" "$2" || return 0
    shift 2
    log "START $name (limit ${limit}s): $*"
    timeout --signal=TERM --kill-after=10 "$limit" "$PY" -m engine.bench "$@" --json "$OUT/$name.json" >>"$LOG" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && log "TIMEOUT $name after ${limit}s (rows so far are in $name.json)" || log "END $name rc=$rc"
}

# step NAME LIMIT_S COMMAND...: any other command, its output in $OUT/NAME.log and its tail in the log.
step() {
    local name=$1 limit
    wanted "$1" "$2" || return 0
    shift 2
    log "START $name (limit ${limit}s): $*"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && log "TIMEOUT $name after ${limit}s" || log "END $name rc=$rc"
    grep -v USDT "$OUT/$name.log" | tail -"${TAIL:-30}" >>"$LOG"
}

# pytest_step NAME LIMIT_S PYTEST_ARGS...: pytest with a line per test as it ends (a step cut off by its limit still
# names every test that ran, and how it ended) and a session that stops starting tests SESSION_MARGIN_S (90, or a
# third of a shorter limit) before the step's limit, so its failures and durations are printed; the counts and the
# failures' names go to the log.
pytest_step() {
    local name=$1 limit
    wanted "$1" "$2" || return 0
    shift 2
    local margin=${SESSION_MARGIN_S:-$((limit / 3 < 90 ? limit / 3 : 90))} session
    session=$((limit - margin > 0 ? limit - margin : 1))
    log "START $name (limit ${limit}s, session ${session}s): pytest $*"
    timeout --signal=TERM --kill-after=10 "$limit" "$PY" -m pytest -v -rfE -p no:cacheprovider \
        --session-timeout="$session" --junitxml="$OUT/$name.xml" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && log "TIMEOUT $name after ${limit}s" || log "END $name rc=$rc"
    log "$name: $(grep -cE ' PASSED' "$OUT/$name.log") passed, $(grep -cE ' FAILED' "$OUT/$name.log") failed," \
        "$(grep -cE ' ERROR' "$OUT/$name.log") errors, $(grep -cE ' SKIPPED' "$OUT/$name.log") skipped"
    grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -"${TAIL:-30}" >>"$LOG"
}

log "strata benchmarks on $(hostname); budget ${BUDGET_S}s; steps ${STEPS:-$DEFAULT_STEPS}"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,driver_version --format=csv >>"$LOG" 2>&1
"$PY" -c "import torch, transformers as t; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', t.__version__)" >>"$LOG" 2>&1

# Steps that never read $MODEL's checkpoint (models of their own, drawn on the GPU, or the test suites): a call of
# only these does not write it, which would spend the call's device time on weights no step reads.
OWN_MODEL_STEPS=" llama_build experts_kernels experts_resident experts_cold experts_prefill_chunked experts_prefill \
moe80b_seed quant_tests quant_linear quant_linear_small dequant_ncu quant_decode quant_peers gpu_suite \
gpu_suite_shared gpu_suite_alone peer_tests "
reads_model() {  # whether a step of this call is not one of OWN_MODEL_STEPS
    local s steps=${STEPS:-$DEFAULT_STEPS}
    for s in ${steps//,/ }; do
        [[ "$OWN_MODEL_STEPS" == *" $s "* ]] || return 0
    done
    return 1
}
if reads_model; then
    log "START checkpoint: $MODEL (random weights written once, shared by every benchmark)"
    timeout 90 "$PY" -c "
import sys, torch
from engine.bench.common import prepare_model
print(prepare_model(sys.argv[1], torch.device(sys.argv[2])))" "$MODEL" "$DEVICE" >>"$LOG" 2>&1
    log "END checkpoint rc=$?"
else
    log "SKIP checkpoint: no step of this call reads $MODEL"
fi

# The default speed benchmarks (decode, peers, MTP, TTFT, graphs, switches) keep SPEED_RESERVE_MIB free: serve's
# default tier takes all VRAM but the reserve (~140 GiB of small blocks on a 141 GiB card), which makes every
# engine start seconds longer without changing a decode step. admission and switches_long keep serve's default:
# they are about long prompts with VRAM full. 0 = serve's default (always on the CPU, where a host reserve that
# large would not fit). By default the reserve leaves SPEED_USABLE_MIB of the card (98,304 MiB reserved on an H200,
# 36,092 on an H100 80GB), so the 8B shape's weights and KV fit on either card.
SPEED_USABLE_MIB=${SPEED_USABLE_MIB:-45467}
card_mib() {  # the card's total MiB, or nothing
    nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${DEVICE#cuda:}" 2>/dev/null | head -1
}
if [ -z "${SPEED_RESERVE_MIB:-}" ]; then
    total_mib=$([[ "$DEVICE" == cuda* ]] && card_mib)
    SPEED_RESERVE_MIB=$(( ${total_mib:-0} > SPEED_USABLE_MIB ? ${total_mib:-0} - SPEED_USABLE_MIB : 0 ))
fi
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
# The compiled decode: FUSED_PROJ and COMPILE on (COMPILE compiles each graph bucket first).
[ "${DECODE_COMPILE:-1}" = 1 ] && STRATA_FUSED_PROJ=1 STRATA_COMPILE=1 run decode_compile 150 decode "${COMMON[@]}" "${SPEED[@]}" --batches 1,6 \
    --prompt-tokens "$PROMPT" --new-tokens "$NEW" --graph-modes on
run peers_compile 120 peers "${COMMON[@]}" "${SPEED[@]}" --batches 1,6 --prompt-tokens "$PROMPT" --new-tokens "$NEW" \
    --skip-strata --peers static --copy-mib "$COPY_MIB"

# The named steps: the tables of docs/BENCHMARKS.md with serve's defaults (VRAM full), as measured there.
run peers_static 200 peers "${COMMON[@]}" --batches 1,6 --peers static
# llama.cpp as the C++ peer: built here (no registry: the trimmed sources travel as LLAMA_CPP_SRC), unless
# STRATA_LLAMA_SERVER names a binary already; the peers steps below use what this step printed last.
step llama_build 480 env CUDA=1 JOBS="${JOBS:-$(nproc)}" LLAMA_CPP_SRC="${LLAMA_CPP_SRC:-.whl/llama.cpp-src.tar.xz}" \
    bash scripts/build_llama_server.sh
if [ -z "${STRATA_LLAMA_SERVER:-}" ] && [ -f "$OUT/llama_build.log" ] && [ -x "$(tail -1 "$OUT/llama_build.log")" ]; then
    export STRATA_LLAMA_SERVER=$(tail -1 "$OUT/llama_build.log")
fi
run peers_llamacpp 300 peers "${COMMON[@]}" "${SPEED[@]}" --batches 1,6,16 --prompt-tokens "$PROMPT" --new-tokens "$NEW" \
    --copy-mib "$COPY_MIB" --peers llamacpp,static
for qtype in q8_0 q4_0; do
    wanted peers_gguf 60 && timeout 120 "$PY" -m engine.bench.gguf_export "$MODEL" "/tmp/strata-peer-$qtype.gguf" \
        --type "$qtype" >>"$LOG" 2>&1
    run peers_gguf 150 peers --model "/tmp/strata-peer-$qtype.gguf" --device "$DEVICE" "${SPEED[@]}" --batches 1,16 \
        --prompt-tokens "$PROMPT" --new-tokens "$NEW" --copy-mib "$COPY_MIB" --peers llamacpp
    [ -f "$OUT/peers_gguf.json" ] && mv "$OUT/peers_gguf.json" "$OUT/peers_gguf_$qtype.json"
done
# MTP's ratio on strata-tiny moves with the host's speed: run these first on a fresh machine.
run mtp_1 70 mtp --model "$MTP_MODEL" --device "$DEVICE" --batches 1 --mtp-depth 1
run mtp_2 70 mtp --model "$MTP_MODEL" --device "$DEVICE" --batches 1 --mtp-depth 2
run profile_b1 90 profile "${COMMON[@]}" --batch 1 --steps 64 --top 12
run profile_b6 90 profile "${COMMON[@]}" --batch 6 --steps 64 --top 12
run profile_ahead_off 90 profile "${COMMON[@]}" --batch 1 --steps 64 --top 12 --decode-ahead off
run profile128k_bf16 90 profile "${COMMON[@]}" --batch 1 --prompt-tokens 131072 --steps 32 --top 12
run profile128k_int8 90 profile "${COMMON[@]}" --batch 1 --kv int8 --prompt-tokens 131072 --steps 32 --top 12
run profile_tiny_mtp_0 90 profile --model "$MTP_MODEL" --device "$DEVICE" --batch 1 --steps 64 --top 25
run profile_tiny_mtp_1 90 profile --model "$MTP_MODEL" --device "$DEVICE" --batch 1 --steps 64 --top 25 --batch-mtp --mtp-depth 1
run profile_tiny_mtp_2 90 profile --model "$MTP_MODEL" --device "$DEVICE" --batch 1 --steps 64 --top 25 --batch-mtp --mtp-depth 2
run ttft_176k 120 ttft "${COMMON[@]}" --prompt-sizes 176K
run ttft_176k_int8 120 ttft "${COMMON[@]}" --kv int8 --prompt-sizes 176K
run admission_between 200 admission "${COMMON[@]}" --slots 6 --long-tokens "$LONG" --kv int8 --baseline-steps 64 \
    --prefill-overlap off
run reuse 90 reuse "${COMMON[@]}" --prompt-sizes 32K
run attention_decode 120 attention --device "$DEVICE" --rows decode --contexts 32K,128K --batches 1,6 --q-lens 1 \
    --backends triton --iters 10 --tune 64x4x2x1xgather,64x4x2x1xblock,64x4x2x1xtma,64x4x3x1xtma
run attention_backends 170 attention --device "$DEVICE" --rows decode --iters 10
run attention_prefill 150 attention --device "$DEVICE" --rows prefill --iters 5 --prefill-prefixes 32K,128K \
    --backends triton,dense \
    --prefill-tune 64x64x4x3xtma,128x64x4x4xtma,128x32x4x3xtma,128x64x4x2xtma,256x64x8x3xtma,128x128x8x2xgather
run attention_split 120 attention --device "$DEVICE" --rows prefill --iters 10 --prefill-prefixes 8K,32K,128K \
    --prefill-chunk 256 --backends triton --prefill-tune 128x64x4x3xtma,128x128x8x2xgather
run attention_sdpa 120 attention --device "$DEVICE" --rows prefill --iters 5 --prefill-prefixes 32K,128K \
    --backends torch,triton,cudnn,cudnn32k,flash,flash32k
run linear 150 linear --device "$DEVICE" --rows 1,6,18 --iters 50 \
    --tune 32x256x1x4x4,64x256x1x4x4,64x128x1x8x4,128x128x1x8x3
run experts 200 experts --device "$DEVICE" --prompt-tokens 32 --new-tokens 64 --copy-mib "$COPY_MIB" \
    --trace-out "$OUT/experts_trace.jsonl"
# One seed-scale layer's expert products per backend (no engine): the kernels' choice, and MOE_TUNE's shapes
run experts_kernels 150 experts --device "$DEVICE" --model random:moe-80b --kernels "${MOE_TOKENS:-1,6,12,64,2048}" \
    --copy-mib "$COPY_MIB" --moe-tune "${MOE_TUNE:-}" --iters 20
# The seed-scale model with every expert on the card (40 of its 48 layers fit): decode against the floor
run experts_resident 240 experts --device "$DEVICE" --model random:moe-80b-40l --budgets 100 --batches 1,6 \
    --prompt-tokens 32 --new-tokens 48 --copy-mib "$COPY_MIB" --no-hf
run kvspill 100 kvspill "${COMMON[@]}" --kv int8 --prompt-tokens 8K --new-tokens 64 --kv-resident 1024
run kvspill_six 150 kvspill "${COMMON[@]}" --kv int8 --slots 6 --prompt-tokens 8K --new-tokens 32 --kv-resident 1024
run throughput 540 throughput "${COMMON[@]}" --kv-pool by-use --sets fixed --concurrency 1,8,32,64,128,256 \
    --prompt-tokens 1K --new-tokens 256 --copy-mib "$COPY_MIB" --peer static --peer-timeout-s 120 --peer-max-concurrency 8
run throughput_mixed 540 throughput "${COMMON[@]}" --kv-pool by-use --sets mixed --concurrency 1,8,32,64,128,256 \
    --copy-mib "$COPY_MIB" --peer none
run throughput_reserved 300 throughput "${COMMON[@]}" --kv-pool reserved --sets fixed --concurrency 1,8,32,64,128,256 \
    --prompt-tokens 1K --new-tokens 256 --copy-mib "$COPY_MIB" --peer none
# COMPILE's start with an empty compile cache, then again with the kernels it kept
[[ ",${STEPS:-}," == *",compile_cold,"* ]] && rm -rf /tmp/strata-compile-cache
XDG_CACHE_HOME=/tmp/strata-compile-cache STRATA_FUSED_PROJ=1 STRATA_COMPILE=1 run compile_cold 150 decode "${COMMON[@]}" \
    --batches 1,6 --prompt-tokens 128 --new-tokens 256 --graph-modes on
XDG_CACHE_HOME=/tmp/strata-compile-cache STRATA_FUSED_PROJ=1 STRATA_COMPILE=1 run compile_warm 90 decode "${COMMON[@]}" \
    --batches 1,6 --prompt-tokens 128 --new-tokens 256 --graph-modes on

# The seed report through `serve` (strata-tiny, 6 MTP slots, int8 KV, every switch, a fresh 150K prompt, VRAM full).
step seed 560 "$PY" benchmarks/seed_scenario.py --runs "${SEED_RUNS:-5}" --device "$DEVICE" --out "$OUT/seed.json"
# The MoE seed runs take every switch but the two cold-expert ones (EXPERT_CPU would win over EXPERT_PREFETCH and
# replace the default copy path): the cold paths are compared by experts_cold, the seed runs measure the default.
MOE_SEED_SWITCHES=$("$PY" -c "from engine.switches import SWITCHES
print(','.join(s.name for s in SWITCHES if s.name not in ('EXPERT_CPU', 'EXPERT_PREFETCH')))")
step moe_seed 330 "$PY" benchmarks/seed_scenario.py --runs "${MOE_RUNS:-3}" --device "$DEVICE" --random-model moe-bench \
    --prompt-tokens 32768 --switches "$MOE_SEED_SWITCHES" --out "$OUT/moe_seed.json" --extra --expert-cache-mib auto
step kv_seed 300 "$PY" benchmarks/seed_scenario.py --runs 1 --device "$DEVICE" --random-model 0.6b \
    --prompt-tokens 131072 --out "$OUT/kv_seed.json" --extra --kv-resident 16384
# The seed's own scale (issue 44): 48 x 512 experts generated at load (no file), the expert cache sized auto fills
# the card (~85 % of the experts), 6 MTP slots, int8 KV, a resident window of 16K tokens a slot, a fresh 176K
# prompt. One run is start-up (the goal: ready within 60 s, `ready_s`) plus the 176K prefill streaming the experts
# that do not fit through the pool: about 4 minutes. Runs: MOE80B_RUNS (default 1) (the goal's five
# runs need a call of their own: STEPS=moe80b_seed MOE80B_RUNS=5 BUDGET_S=1300 (limit 60 + 240 s a run), past one 10-minute device command).
MOE80B_RUNS=${MOE80B_RUNS:-1}
[ "$MOE80B_RUNS" -gt 1 ] && : "${MOE80B_LIMIT_S:=$((60 + 240 * MOE80B_RUNS))}"
step moe80b_seed ${MOE80B_LIMIT_S:-300} "$PY" benchmarks/seed_scenario.py --runs "$MOE80B_RUNS" --device "$DEVICE" \
    --model random:moe-80b --prompt-tokens 176000 --ready-timeout-s 240 --switches "$MOE_SEED_SWITCHES" \
    --out "$OUT/moe80b_seed.json" \
    --extra --expert-cache-mib auto --kv-resident 16384
# The three ways to serve a cold expert side by side (one engine each: 85 % of random:moe-80b's experts on the
# card), decode tok/s at batch 1 and 6 against random:moe-80b-40l with every expert on the card; the copy rows'
# vs_belady is the default policy's hit rate over Belady's on the same skewed trace.
run experts_cold 330 experts --device "$DEVICE" --model random:moe-80b --all-resident-model random:moe-80b-40l \
    --budgets 85 --cold copy,cpu,prefetch --batches 1,6 --prompt-tokens 32 --new-tokens 48 --copy-mib "$COPY_MIB" \
    --trace-out "$OUT/experts_cold_trace.jsonl"
# A 16K prompt (8 chunks) at 85 % of the experts on the card: `prompt_loaded_mib` (MiB its chunks copied in) and
# `ttft_s`, chunk by chunk and then in one layer-major window (engine/exec/prefill_window.py)
run experts_prefill_chunked 330 experts --device "$DEVICE" --model random:moe-80b \
    --all-resident-model random:moe-80b-40l --budgets 85 --prompt-tokens 16384 --new-tokens 8 --copy-mib "$COPY_MIB" \
    --no-hf --prefill-window-tokens 0
run experts_prefill 330 experts --device "$DEVICE" --model random:moe-80b --all-resident-model random:moe-80b-40l \
    --budgets 85 --prompt-tokens 16384 --new-tokens 8 --copy-mib "$COPY_MIB" --no-hf --prefill-window-tokens 16384
# Quantized weights: each format rounded at load from the same checkpoint, one engine each, same run.
# The quantized kernels alone (against cuBLAS bf16, with QUANT_TUNE's launch shapes beside the default), then
# decode on the 8B shape, whose random weights the engine draws on the GPU at each start (no checkpoint).
# The quantized kernels' GPU tests first: a kernel that does not compile or is wrong fails here, named. They compile
# every path's kernels at several shapes: on an H100 four workers had not finished in 240 s (a call of its own).
pytest_step quant_tests 480 -m gpu -n "${GPU_WORKERS:-4}" --dist loadgroup --durations=10 \
    tests/engine/model/test_quant_kernels_gpu.py tests/engine/bench/test_bench_linear_quant.py
# Each launch shape of QUANT_TUNE on the GEMV (1-4 rows) and the tensor-core path (5-256 rows), every path and
# tinygemm side by side; quant_launch_table.json is the launch table they measured (engine/model/quant/).
QUANT_TUNE=${QUANT_TUNE:-256x128x2x8x2,64x128x4x4x3,128x256x2x4x3,32x128x8x2x4,64x128x4x4x3xpairs,128x128x4x4x3xpairs}
run quant_linear 330 linear --device "$DEVICE" --size "${QUANT_SIZE:-8b}" --rows "${QUANT_ROWS:-1,4,16,128,2048}" \
    --iters 40 --quant "${QUANT_FORMATS:-fp8,fp8-block,int4}" --quant-tune "$QUANT_TUNE" \
    --table-out "$OUT/quant_launch_table.json"
# The prompt-chunk path's int4 dequantizing kernel under Nsight Compute at the 8B gate/up shape (24576 x 4096, the
# bench's group), beside a copy of the bytes it writes: where its time goes (bench linear --quant: dense_ms - torch_ms)
step dequant_ncu 150 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section SchedulerStats -k "regex:dequant|copy" -c 4 \
    "$PY" benchmarks/dequant_ncu.py --device "$DEVICE"
run quant_linear_small 150 linear --device "$DEVICE" --size "${QUANT_SMALL_SIZE:-0.6b}" --rows 1,16,128 --iters 40 \
    --quant fp8,fp8-block,int4,int4-g32,int8,int8-g32
run quant_decode 330 decode --model "${QUANT_MODEL:-random:8b}" --device "$DEVICE" "${SPEED[@]}" --batches 1,16,64 \
    --weight-formats off,fp8,fp8+head,fp8-block,int4,int4+tinygemm --graph-modes on --prompt-tokens 128 --new-tokens 128
# transformers on the same FP8 checkpoint, in Qwen's block-FP8 layout (`strata-engine quantize --format fp8-block`,
# which transformers runs through its own FP8 kernels; its error in the row if it cannot), written once into the
# checkpoint cache.
QUANT_DIR="$STRATA_BENCH_CACHE/fp8-block-$(tr -c 'a-z0-9.\n' - <<<"${QUANT_PEER_MODEL:-random:8b}")"
step quant_peers 330 bash -c '[ -f "$2/config.json" ] || "$0" -m engine.cli quantize --model "$1" --format fp8-block \
    --out "$2" --device "$3" && "$0" -m engine.bench peers --model "$2" --device "$3" "${@:5}" --batches 1,16 \
    --prompt-tokens 128 --new-tokens 128 --copy-mib 2048 --peers eager --json "$4"' \
    "$PY" "${QUANT_PEER_MODEL:-random:8b}" "$QUANT_DIR" "$DEVICE" "$OUT/quant_peers.json" "${SPEED[@]}"
# Shorter prompts finish between two refreshes on a GPU: no halfway reading.
step prefill_eta 200 "$PY" benchmarks/bench_prefill_eta.py --device "$DEVICE" --prompt-tokens 180000 --context 184320 \
    --decode-slots 0 4 --refresh-s 0.1
# The GPU tests: those marked gpu_shared (kernels and models against references) side by side, each other test
# alone through tests/conftest.py's lock. On an H100 the whole suite does not fit one 10-minute call.
read -ra GPU_TEST_ARGS <<<"${GPU_TESTS:-tests}"
pytest_step gpu_suite 590 -m gpu -n "${GPU_WORKERS:-4}" --dist loadgroup --durations=0 "${GPU_TEST_ARGS[@]}"
pytest_step gpu_suite_shared 590 -m "gpu and gpu_shared" -n "${GPU_WORKERS:-4}" --dist loadgroup --durations=0 \
    "${GPU_TEST_ARGS[@]}"
pytest_step gpu_suite_alone 590 -m "gpu and not gpu_shared" --durations=0 "${GPU_TEST_ARGS[@]}"

# Two GPUs: the prefix-cache tier and the MoE expert store on cuda:1.
pytest_step peer_tests 150 -m gpu -s tests/engine/test_engine_gpu.py tests/engine/model/test_moe_gpu.py \
    tests/engine/bench/test_bench_gpu.py -k "peer_device or expert_store or peer_store or host_and_peer"
run reuse_peer 90 reuse "${COMMON[@]}" --prompt-sizes 32K --peer-device cuda:1
step seed_peer 300 "$PY" benchmarks/seed_scenario.py --runs "${SEED_RUNS:-5}" --device "$DEVICE" --prompt-tokens 32768 \
    --out "$OUT/seed_peer.json" --extra --peer-device cuda:1
run experts_peer 300 experts --device "$DEVICE" --peer-device cuda:1 --stores host,peer --budgets 5,15,30,50 \
    --prompt-tokens 32 --new-tokens 64 --copy-mib "$COPY_MIB" --no-hf
# One archive, not six files: a device call's results come back as a few files.
step screenshots 120 bash -c '"$0" scripts/make_screenshots.py --device "$1" --context 65536 --chunk-tokens 1024 \
    --fault-inject capture:draft_round:1-2:oom --prefix gpu- --out "$2/shots" && tar czf "$2/shots.tgz" -C "$2" shots \
    && rm -r "$2/shots"' "$PY" "$DEVICE" "$OUT"

"$PY" benchmarks/collect_results.py "$OUT" 2>&1 | tee -a "$LOG"
log "done"
