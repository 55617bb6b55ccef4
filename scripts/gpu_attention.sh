#!/usr/bin/env bash
# The paged-attention session on one GPU, in one call (issue 17): the kernel tests, one layer's attention per
# backend (`strata-engine bench attention`), the 128K decode profile, the HF static+compile peer end to end,
# and the engine's GPU parity tests. Each step under `timeout`, skipped when the budget is short; logs and JSON
# land in $OUT (8 files at most).
#
#   OUT=/path/to/logs BUDGET_S=560 [STEPS=kernel_tests,attention,...] bash scripts/gpu_attention.sh
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 STRATA_BENCH_CACHE=${STRATA_BENCH_CACHE:-/tmp/strata-bench-checkpoints}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-560}
source scripts/gpu_step.sh  # (the working directory is the repository root)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
step kernel_tests 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/engine/exec/test_kv_paged_gpu.py
step attention 170 "$PY" -m engine.bench attention --device cuda:0 --rows decode --iters 10 --json "$OUT/attention.json"
step profile128k 110 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 --batch 1 \
    --prompt-tokens 131072 --steps 32 --top 12 --json "$OUT/profile128k.json"
step engine_gpu 90 "$PY" -m pytest -q -p no:cacheprovider tests/engine/exec/test_graphs_runner.py \
    tests/engine/test_engine_gpu.py -k "not seed_scenario and not peer_device"
step peers 160 "$PY" -m engine.bench peers --model random:0.6b --device cuda:0 --batches 1,6 --peers static \
    --json "$OUT/peers.json"
# The kernel's launch shapes side by side at 128K (KernelConfig), the int8 128K profile, MTP on strata-tiny.
step attention_tune 80 "$PY" -m engine.bench attention --device cuda:0 --contexts 128K --batches 1,8 --q-lens 1 \
    --rows decode --backends triton --iters 10 --tune 64x4x3,128x4x2,128x8x2,128x8x3,256x8x2 --json "$OUT/attention_tune.json"
step profile128k_int8 90 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 --batch 1 --kv int8 \
    --prompt-tokens 131072 --steps 32 --top 12 --json "$OUT/profile128k_int8.json"
step mtp 70 "$PY" -m engine.bench mtp --model builtin:strata-tiny --device cuda:0 --batches 1 --mtp-depth 2 \
    --json "$OUT/mtp.json"
# The prompt-chunk kernel (triton_prefill): its GPU tests, then a 2048-token chunk over 8K / 32K / 128K cached
# tokens against gather + fused SDPA, with its launch shapes side by side.
step prefill_kernel_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/engine/exec/test_kv_paged_prefill_gpu.py
step attention_prefill 150 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 10 \
    --prefill-tune 128x64x8x2,128x64x4x3,128x128x8x2,64x64x4x2 --json "$OUT/attention_prefill.json"
echo "done after $(($(date +%s) - START_S))s"
