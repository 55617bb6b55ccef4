#!/usr/bin/env bash
# Two GPUs in one call (issue: --peer-device on two H200s), plus the whole GPU suite of this tree:
#   1. every @pytest.mark.gpu test (the peer-device test runs only where a second GPU exists)
#   2. the seed scenario with the prefix-cache tier on the second card (--peer-device cuda:1)
#   3. bench reuse: TTFT of a repeated prompt, tier on cuda:0 against tier on cuda:1
#   4. strata-tui screenshots on the GPU (real NVML: both cards in the GPU panel)
#
#   OUT=/path/to/logs bash scripts/gpu_two.sh      (SEED_RUNS, SEED_PROMPT_TOKENS, *_LIMIT_S to trim)
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
START_S=$(date +%s)
log() { echo "[$(($(date +%s) - START_S))s] $*" | tee -a "$OUT/two.log"; }
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv | tee -a "$OUT/two.log"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" \
    | tee -a "$OUT/two.log"

log "GPU tests"
timeout "${TESTS_LIMIT_S:-200}" python3 -m pytest -m gpu -q -rA --durations=15 -p no:cacheprovider tests \
    >"$OUT/gpu_tests.log" 2>&1
log "GPU tests rc=$? ($(tail -1 "$OUT/gpu_tests.log"))"
grep -E "peer_device|PASSED|FAILED|ERROR" "$OUT/gpu_tests.log" | grep -iE "peer|FAILED|ERROR" | head -20 | tee -a "$OUT/two.log"

log "seed scenario, tier on cuda:1: ${SEED_RUNS:-5} runs"
timeout "${SEED_LIMIT_S:-200}" python3 benchmarks/seed_scenario.py --runs "${SEED_RUNS:-5}" --device cuda:0 \
    --prompt-tokens "${SEED_PROMPT_TOKENS:-65536}" --out "$OUT/seed_peer.json" --extra --peer-device cuda:1 \
    >"$OUT/seed_peer.log" 2>&1
log "seed scenario rc=$?"
tail -12 "$OUT/seed_peer.log" | tee -a "$OUT/two.log"

log "bench reuse, tier on cuda:0 and on cuda:1"
timeout "${REUSE_LIMIT_S:-120}" python3 -m engine.bench reuse --model random:0.6b --device cuda:0 --prompt-sizes 32K \
    --peer-device cuda:1 --json "$OUT/reuse.json" >"$OUT/reuse.log" 2>&1
log "bench reuse rc=$?"
tail -8 "$OUT/reuse.log" | tee -a "$OUT/two.log"

if [ "${SCREENSHOTS:-1}" = 1 ]; then
    log "screenshots on the GPU"
    timeout "${SHOTS_LIMIT_S:-120}" python3 scripts/make_screenshots.py --device cuda:0 >"$OUT/shots.log" 2>&1
    log "screenshots rc=$?"
    tail -5 "$OUT/shots.log" | tee -a "$OUT/two.log"
    mkdir -p "$OUT/shots" && cp screenshots/*.svg "$OUT/shots/" 2>/dev/null
    tar czf "$OUT/shots.tgz" -C "$OUT" shots && rm -rf "$OUT/shots"
fi
