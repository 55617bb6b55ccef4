#!/usr/bin/env bash
# GPU validation in one call on a CUDA machine: every @pytest.mark.gpu test, then the seed scenario.
#
#   OUT=/path/to/logs SEED_RUNS=10 bash scripts/gpu_validate.sh
#
# On the project's device machines the server's wheels are carried in .whl/ (that image has no PyPI access);
# elsewhere install the project with `pip install -e '.[test]'` and the .whl step is skipped.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
START_S=$(date +%s)
log() { echo "[$(($(date +%s) - START_S))s] $*" | tee -a "$OUT/validate.log"; }
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee -a "$OUT/validate.log"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/validate.log"

log "GPU tests"
GPU_FILES=${GPU_TESTS:-$(grep -rl "mark.gpu" tests | sort | tr '\n' ' ')}
# four processes (pytest-xdist): the gpu_shared tests side by side, each other test alone (tests/conftest.py)
timeout "${TESTS_LIMIT_S:-360}" python3 -m pytest -m gpu -n "${GPU_WORKERS:-4}" --dist loadgroup -v -rA --durations=0 \
    -p no:cacheprovider $GPU_FILES \
    >"$OUT/gpu_tests.log" 2>&1
log "GPU tests rc=$? ($(tail -1 "$OUT/gpu_tests.log"))"

log "seed scenario: ${SEED_RUNS:-10} cold runs, switches ${SEED_SWITCHES:-all}"
SW=()
[ -n "${SEED_SWITCHES:-}" ] && SW=(--switches "$SEED_SWITCHES")
timeout "${SEED_LIMIT_S:-300}" python3 benchmarks/seed_scenario.py --runs "${SEED_RUNS:-10}" --device cuda:0 \
    --prompt-tokens "${SEED_PROMPT_TOKENS:-150000}" "${SW[@]}" --out "$OUT/seed.json" >"$OUT/seed.log" 2>&1
log "seed scenario rc=$?"
tail -25 "$OUT/seed.log" | tee -a "$OUT/validate.log"

# Optional short benchmarks when BENCH=1 (the full set is benchmarks/run_all_gpu.sh).
if [ "${BENCH:-0}" = 1 ]; then
    log "bench mtp (strata-tiny, batch 1 and 6)"
    timeout 60 python3 -m engine.bench mtp --model builtin:strata-tiny --device cuda:0 --batches 1,6 \
        --prompt-tokens 128 --new-tokens 256 --mtp-depth 1 --json "$OUT/mtp.json" >"$OUT/bench.log" 2>&1
    log "bench mtp rc=$?"
    timeout 75 python3 -m engine.bench decode --model random:0.6b --device cuda:0 --batches 1,6 \
        --prompt-tokens 128 --new-tokens 256 --graph-modes on,off --json "$OUT/decode.json" >>"$OUT/bench.log" 2>&1
    log "bench decode rc=$?"
    tail -40 "$OUT/bench.log" | tee -a "$OUT/validate.log"
fi
