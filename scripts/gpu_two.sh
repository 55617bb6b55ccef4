#!/usr/bin/env bash
# Two GPUs in one call (the --peer-device issue), plus the GPU suite of this tree, in priority order, each step
# under its own time limit so the call ends inside the device budget:
#   1. the peer-device GPU test (the tier on cuda:1)
#   1b. the MoE expert store on cuda:1: its GPU tests, then bench experts with the store on the host vs cuda:1
#   2. the seed scenario with the prefix-cache tier on the second card (--peer-device cuda:1)
#   3. bench reuse: TTFT of a repeated 32K prompt, tier on cuda:0 against tier on cuda:1
#   4. strata-tui screenshots on the GPU (real NVML: both cards in the GPU panel), tarred
#   5. the rest of the @pytest.mark.gpu suite
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

log "peer-device GPU test"
timeout "${PEER_TEST_LIMIT_S:-60}" python3 -m pytest -m gpu -q -s -rA -p no:cacheprovider \
    tests/engine/test_engine_gpu.py -k peer_device >"$OUT/peer_test.log" 2>&1
log "peer-device GPU test rc=$? ($(tail -1 "$OUT/peer_test.log"))"

log "MoE expert store on cuda:1: GPU tests"
timeout "${EXPERTS_PEER_TEST_LIMIT_S:-90}" python3 -m pytest -m gpu -q -s -rA -p no:cacheprovider \
    tests/engine/model/test_moe_gpu.py tests/engine/bench/test_bench_gpu.py -k "expert_store or peer_store or host_and_peer" \
    >"$OUT/experts_peer_test.log" 2>&1
log "expert store GPU tests rc=$? ($(tail -1 "$OUT/experts_peer_test.log"))"
log "bench experts, store on the host vs on cuda:1"
timeout "${EXPERTS_PEER_LIMIT_S:-300}" python3 -m engine.bench experts --device cuda:0 --peer-device cuda:1 \
    --stores host,peer --budgets 5,15,30,50 --prompt-tokens 32 --new-tokens 64 --no-hf \
    --json "$OUT/experts_peer.json" >"$OUT/experts_peer.log" 2>&1
log "bench experts host vs peer rc=$?"
tail -12 "$OUT/experts_peer.log" | tee -a "$OUT/two.log"

log "seed scenario, tier on cuda:1: ${SEED_RUNS:-5} runs"
timeout "${SEED_LIMIT_S:-170}" python3 benchmarks/seed_scenario.py --runs "${SEED_RUNS:-5}" --device cuda:0 \
    --prompt-tokens "${SEED_PROMPT_TOKENS:-32768}" --out "$OUT/seed_peer.json" --extra --peer-device cuda:1 \
    >"$OUT/seed_peer.log" 2>&1
log "seed scenario rc=$?"
grep -E "^run [0-9]+: (PASS|FAIL)|runs passed|tier|NVML" "$OUT/seed_peer.log" | tail -14 | tee -a "$OUT/two.log"

log "bench reuse, tier on cuda:0 and on cuda:1"
timeout "${REUSE_LIMIT_S:-60}" python3 -m engine.bench reuse --model random:0.6b --device cuda:0 --prompt-sizes 32K \
    --peer-device cuda:1 --json "$OUT/reuse.json" >"$OUT/reuse.log" 2>&1
log "bench reuse rc=$?"
tail -7 "$OUT/reuse.log" | tee -a "$OUT/two.log"

log "screenshots on the GPU"
mkdir -p /tmp/shots
timeout "${SHOTS_LIMIT_S:-75}" python3 scripts/make_screenshots.py --device cuda:0 --context 65536 --chunk-tokens 1024 \
    --fault-inject capture:draft_round:1-2:oom --prefix gpu- --out /tmp/shots >"$OUT/shots.log" 2>&1
log "screenshots rc=$? ($(ls /tmp/shots | tr '\n' ' '))"
tar czf "$OUT/shots.tgz" -C /tmp shots

log "the rest of the GPU suite"
timeout "${TESTS_LIMIT_S:-100}" python3 -m pytest -m gpu -q -rA --durations=12 -p no:cacheprovider tests \
    -k "not peer_device and not seed_scenario and not peers and not peer_store and not host_and_peer" >"$OUT/gpu_tests.log" 2>&1
log "GPU tests rc=$? ($(tail -1 "$OUT/gpu_tests.log"))"
