#!/usr/bin/env bash
# What the open issues still need from one H200, in the order to run it. Calls of at most 10 minutes each (a
# step skips itself when the budget is short). The sessions of 2026-12-01 (third to ninth) ran the suite seven
# times, kvspill five times, eight MoE seed runs, the kv seed, the prompt-chunk kernel and TTFT, reuse, the
# compile starts, FUSED_OPS' profiles, the projections (`linear`), the decode kernel at short spans, peers seven
# times, the 176K admission four times and MTP (docs/BENCHMARKS.md, "The GPU session of 2026-12-01 (ninth)");
# The tenth session ran the suite (56 passed in 377 s, cut by its session timeout) and prompt chunks beside the
# decoding slots (the admission: 1.71x its lone prompt at decode ratio 0.537). The eleventh ran the seed scenario with
# them (5/5 once green contexts outlived the process: -6 on SIGTERM before), cuDNN / flash SDPA against the prefill
# kernel (slower), chunk lengths (no gain), and MTP against the code before the chunk stream (one run each moved by
# 30 %: `bench mtp` now takes the median of --repeats). The twelfth filled issue 17's table in one session: the
# prefill kernel through TMA (bf16 1.26x; the 176K first token 8.67 s), peers, the 128K steps, MTP medians, reuse,
# the admission (1.670x at ratio 0.551), the suite (cut at 370 s again). The thirteenth split a short chunk's keys
# (the reused 32K prompt at 0.035), cut a step's host copies, ran MTP in ABBA order (1.470x / 1.794x) and the suite
# whole in two halves (65 passed, 401.9 s). The fourteenth launched greedy decode steps ahead of the host (batch 1
# at 819.1 tok/s, 3.481x the peer) and filled the table again but for MTP (cut by the budget) and the admission's
# ratio (0.453). The fifteenth keyed few-query steps by batch alone (no capture as contexts grow: the admission at
# 0.606, 1.666x), launched MTP's fused steps ahead (depth 1 at 1.350x) and ran the suite (412.1 s). The sixteenth
# filled the table again (every row met but MTP at depth 2: 1.6x against the steady plain rate), ran the seed
# scenario (5/5 passed) and the suite in four processes (265.0 s, three failures of tests that run alone, the
# server's files not collected). The seventeenth cut MTP's depth-2 step to 161 kernels (FUSED_OPS: rotary tables,
# the head's norms, the acceptance) and filled the table in one session, depth 2 at 1.841x, and ran the suite in
# four processes whole (367.0 s, green). Next: the seed scenario on this code; the suite in eight processes (its
# shared phase kept the lone tests waiting); int8's short-chunk split at 264 programs, the decode kernel's 64-key
# block loads at batch 6:
#
#   OUT=$OUT STEPS=seed bash scripts/gpu_pending.sh
#   OUT=$OUT STEPS=gpu_suite_n8 bash scripts/gpu_pending.sh            (a fresh machine)
#
#   profile_ahead_off     #17: the batch-1 step with --decode-ahead off (profile_ops_1 runs the default, on)
#   profile_pinned_off    #17: the same with STRATA_PINNED_STAGING=0 (when a call sets it on)
#   profile_b6(_ahead_off)  #17: the batch-6 step with decode ahead on (the default), then off
#   ahead_tests           #17: engines' greedy tokens with steps launched ahead (graphs, chunks beside the steps)
#
#   attention_split(_512) #17: a 256- / 512-token chunk 8K-128K deep: the default (keys split to 132 programs,
#                         PrefillConfig.split_programs) against one pass and other targets
#   gpu_suite_a/_b        the `-m gpu` suite in two halves (tests/engine/exec + tests/engine/model; the rest)
#   profile_tiny_mtp_N    #17: a strata-tiny step's host functions and kernels, plain and MTP at depth 1 and 2
#   host_cut_tests        #17: every graph kind replayed against eager, engines' greedy tokens (packed inputs, the
#                         decode graph's argmax, the fused MTP step's outputs)
#
#   attention_loads       #17: the prefill kernel's key loads (gather / block / tma) at launch shapes around the
#                         defaults, beside the dense kernel (attention_loads_baseline: BASELINE's tree, same rows)
#   attention_decode_loads  #17: the decode kernel's 64-key tiles through the table, one entry a tile, TMA
#   ttft_176k(_int8)      #17: the 176K first token alone with today's defaults (bf16; int8)
#   profile128k_bf16      #17: a batch-1 decode step at 128K context with bf16 KV (the goal: <= 8 ms)
#   attention_sdpa        #17: a 2048-token chunk over 32K / 128K cached tokens: the Triton prefill kernel against
#                         cuDNN's and flash's SDPA over the gathered prefix (whole, and 32K keys at a time)
#   attention_dense       #17: the paged prefill kernel against a dense Triton flash kernel over contiguous keys (the
#                         paging's cost, and what Triton reaches on the H200: the 176K first token needs ~1.2x)
#   serve_exit            #17: `serve` on CUDA exits 0 on SIGTERM after a long prompt's chunks ran beside a decoding
#                         slot (the eleventh session's seed runs exited -6 and -9)
#   seed                  #17 (must not regress): the seed scenario (strata-tiny, 6 MTP slots, int8 KV, every
#                         switch, a fresh 150K prompt under full VRAM), SEED_RUNS runs (default 5)
#   overlap_tests         #17: prompt chunks beside the decoding slots' steps (side stream): the tokens of chunks
#                         between the steps, every slot's token every step, FUSED_OPS' engine tokens
#   gpu_suite_n4          the whole `-m gpu` suite in four processes (`-n 4`): shared tests side by side, the rest alone
#   gpu_suite_n8          the same in eight processes (`-n 8`): the shared phase on seven
#   gpu_suite             #15 item 7: the whole `-m gpu` suite (soaks out), timed (goal: under 5 minutes); it
#                         holds #17's prompt-chunk kernel tests, #18's spilled-KV tests, #20's MoE tests and
#                         #15's real-pressure graph-cache test (-rA prints every test's output)
#   tier_tests            #15 item 7: the two tier tests the 2026-12-01 suite failed, alone, with their figures
#   moe_seed              #20: the seed scenario on a random Qwen3-MoE with --expert-cache-mib auto (MOE_RUNS, 5;
#                         about 90 s each: a 55-81 s start)
#   kvspill               #18: decode with half of the non-resident KV on the host, against the PCIe floor, and
#                         its tokens against each prompt decoded alone (`same_tokens_as_alone`)
#   kvspill_six           #18: the seed's six long prompts on a pool sized for two: tokens = each prompt decoded
#                         alone with room (`same_tokens_as_alone`: in bf16 the room run's differed on 2026-12-01;
#                         an fp32 run took 29.8 tok/s with room and ran past 150 s)
#   oom_pressure          #15 item 7: the real-pressure graph-cache test alone, its message printed (-s)
#   kv_resident_tests     #18: spilled KV through the paged kernels and graphs = tokens of a run with room
#   prefill_kernel_tests  #17: the prompt-chunk kernel against the reference, captured, in an engine (PAGED_PREFILL)
#   moe_tests             #20: the MoE GPU tests (graph-capture OOM shrinks the expert cache, live grow)
#   attention_prefill     #17: a 2048-token chunk over 8K / 32K / 128K cached tokens, kernel vs gather + SDPA
#   ttft_repeat           #17: two fresh 176K prompts one after the other (int8 KV), each split into its chunks'
#                         time, the tier's fills and the rest of its steps
#   prefill_tune          #17: the prompt-chunk kernel's launch shapes at 128K cached tokens
#   ttft_paged_prefill_0/_1  #17: TTFT of fresh 32K / 128K / 176K prompts with PAGED_PREFILL off, then on
#   reuse                 #17: TTFT of a repeated 32K prompt against the fresh one (the zero-copy goal: <= 5 %)
#   kv_seed               #18: the seed scenario with the seed's `--kv-resident 16384` (131K prompt, 262K context)
#   linear                #17: a decode step's projections, cuBLAS against the skinny-matmul kernel and its launch
#                         shapes, at 1, 6 and 18 rows
#   attention_short       #17: the decode kernel at short spans (256 keys up), its split plan's fewest tiles per split
#   fused_ops_tests       #17: the FUSED_OPS kernels against the bf16 reference ops (the skinny matmul against
#                         cuBLAS), the int8 KV write code for code, engines with FUSED_OPS on and off (greedy
#                         tokens identical)
#   paged_tests           #17: the paged decode kernel against the reference (its last split combines the splits)
#   step_tests            #17: the paged kernels (a split per tile at short spans), the prompt-chunk kernel, the
#                         engine's greedy tokens with graphs (short chunks from captured graphs) and MTP
#   profile_ops_0/_1      #17: a batch-1 decode step (0.6B shape, short context) with FUSED_OPS off, then on
#   profile128k_int8_ops0 #17: the 128K int8 step with FUSED_OPS off (profile128k_int8 below runs it on)
#   peers                 #17: default switches (PAGED_PREFILL, SHARED_PREFIX now on) against HF static cache +
#                         torch.compile in the same run, batch 1 and 6 (the goal: >= 2.0x)
#   peers_fused           #17: the same with FUSED_PROJ on (measured 1.14x / 1.09x at batch 1 / 6 on 2026-11-29,
#                         before PAGED_ATTN was on by default): whether it wins with today's defaults, to turn it on
#   mtp_1/_2              #17: MTP speedup at batch 1 on strata-tiny, depth 1 and 2, with FUSED_OPS and FUSED_PROJ
#   mtp_1/_2_baseline     #17: the same on the code before the chunk stream (BASELINE=baseline_d705, see below)
#   mtp_1_VARIANT         #17: MTP depth 1 with the chunk stream off / a plain side stream (sms0) / default
#   prefill_chunk_N       #17: a prompt chunk of N tokens (2048, 4096, 8192) over 32K / 128K cached tokens
#   ttft_chunk_N          #17: the 176K first token alone (bf16) in chunks of N tokens (2048, 8192)
#   profile128k_int8      #17: a batch-1 decode step at 128K context with int8 KV (the goal: <= 5 ms)
#   admission             #17: six slots decoding while a fresh 176K prompt is admitted (TTFT <= 2x alone, decode
#                         ratio >= 0.5), int8 KV, the prompt-chunk kernel on, chunks beside the steps (the default)
#   admission_sms_N       #17: the admission (no lone runs) with the chunks' stream in a green context of N SMs
#                         (STRATA_CHUNK_SMS; N from CHUNK_SMS_LIST, default 96,112,120)
#   admission_between     #17: the same with the chunks between the steps (--prefill-overlap off), paced
#   compile_cold/_warm    #17: FUSED_PROJ + COMPILE decode with an empty compile cache, then again (its END lines
#                         give each start's wall time; the 128 s start measured on 2026-11-29 was a cold one)
#
# Two GPUs (#19's fifth seed run, #20's peer store): `OUT=$OUT SEED_RUNS=1 bash scripts/gpu_two.sh` on nvidia-h200-x2.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 STRATA_BENCH_CACHE=${STRATA_BENCH_CACHE:-/tmp/strata-bench-checkpoints}
if compgen -G ".whl/*.whl" >/dev/null; then  # the device image lacks the server's and the TUI's packages
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-570}
source scripts/gpu_step.sh  # (the working directory is the repository root)
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
GPU_TEST=("$PY" -m pytest -m gpu -q -rA -p no:cacheprovider)

# MTP on strata-tiny with today's defaults (the issue: kept or better), first in the script: a call that runs them
# runs them on a fresh machine (the fifteenth session's plain runs after other steps were off by half)
step mtp_1 70 "$PY" -m engine.bench mtp --model builtin:strata-tiny --device cuda:0 --batches 1 --mtp-depth 1 \
    --json "$OUT/mtp_1.json"
step mtp_2 70 "$PY" -m engine.bench mtp --model builtin:strata-tiny --device cuda:0 --batches 1 --mtp-depth 2 \
    --json "$OUT/mtp_2.json"

# --session-timeout (pytest-timeout, carried in .whl) ends the suite before the step's limit kills it, so a suite
# that runs long still prints its failures and its slowest tests (2026-12-01, ninth session: killed at 400 s with
# one failure and no report)
step attention_sdpa 120 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 5 \
    --prefill-prefixes 32K,128K --backends torch,triton,cudnn,cudnn32k,flash,flash32k --json "$OUT/attention_sdpa.json"
step attention_dense 120 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 5 \
    --prefill-prefixes 32K,128K --backends triton,dense,gather_dense,dense128x64x8x3,dense128x128x8x2,dense64x64x4x3 \
    --json "$OUT/attention_dense.json"
# the prefill kernel's key loads (PrefillConfig.loads: gather / block / tma) at launch shapes around the defaults,
# beside the dense kernel; then the code before them (BASELINE tree, below) for the same rows
step attention_loads 150 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 5 \
    --prefill-prefixes 32K,128K --backends triton,dense \
    --prefill-tune 128x64x4x3xblock,64x64x4x3xtma,128x64x4x4xtma,128x32x4x3xtma,128x64x4x2xtma,256x64x8x3xtma,128x128x8x2xgather \
    --json "$OUT/attention_loads.json"
# the decode kernel's key loads: 64-key tiles (one pool block) through the table, one entry a tile, TMA
step attention_decode_loads 120 "$PY" -m engine.bench attention --device cuda:0 --rows decode --contexts 32K,128K \
    --batches 1,6 --q-lens 1 --backends triton --iters 10 \
    --tune 64x4x2x1xgather,64x4x2x1xblock,64x4x2x1xtma,64x4x3x1xtma,64x8x2x1xtma,64x4x4x1xtma \
    --json "$OUT/attention_decode_loads.json"
# a short prompt chunk deep into a span (a reused prompt's tail, a new turn of a long conversation): the default
# splits each program's keys when a launch has fewer programs than PrefillConfig.split_programs (132); against one
# pass (a tune without xN) and other targets (xN), 256 and 512 tokens
step attention_split 120 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 10 \
    --prefill-prefixes 8K,32K,128K --prefill-chunk 256 --backends triton \
    --prefill-tune 128x64x4x3xtma,128x64x4x3xtmax264,128x64x4x3xtmax396,64x64x4x3xtmax264,128x128x8x2xgather,128x128x8x2xgatherx264 \
    --json "$OUT/attention_split_256.json"
step attention_split_512 90 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 10 \
    --prefill-prefixes 32K,128K --prefill-chunk 512 --backends triton \
    --prefill-tune 128x64x4x3xtma,128x64x4x3xtmax264,128x128x8x2xgather \
    --json "$OUT/attention_split_512.json"
# the 176K first token alone with today's defaults, bf16 and int8 KV
step ttft_176k 120 "$PY" -m engine.bench ttft --model random:0.6b --device cuda:0 --prompt-sizes 176K \
    --json "$OUT/ttft_176k.json"
step ttft_176k_int8 120 "$PY" -m engine.bench ttft --model random:0.6b --device cuda:0 --kv int8 --prompt-sizes 176K \
    --json "$OUT/ttft_176k_int8.json"
step serve_exit 90 "${GPU_TEST[@]}" -s tests/engine/server/test_serve_process.py -k "exits_0_on_sigterm"
step seed 560 "$PY" benchmarks/seed_scenario.py --runs ${SEED_RUNS:-5} --device cuda:0 --out "$OUT/seed.json"
step overlap_tests 150 "${GPU_TEST[@]}" -s tests/engine/test_engine_interleave.py \
    tests/engine/model/test_triton_ops_gpu.py -k "interleave or beside or engine_greedy"
step gpu_suite 400 "${GPU_TEST[@]}" --durations=60 --session-timeout=370 --junitxml="$OUT/gpu_suite.xml" tests
# the same in four processes (pytest-xdist): the `gpu_shared` tests (kernels, models) side by side, then each other
# test alone, through tests/conftest.py's lock, all of them in one process in their order (xdist group gpu_alone)
step gpu_suite_n4 400 "${GPU_TEST[@]}" -n 4 --dist loadgroup --durations=0 --session-timeout=370 \
    --junitxml="$OUT/gpu_suite_n4.xml" tests
# in eight: the process that runs the lone tests waits out the shared phase (the shared tests spread over the other
# processes), so more processes shorten that phase (docs/BENCHMARKS.md, the seventeenth session)
step gpu_suite_n8 400 "${GPU_TEST[@]}" -n 8 --dist loadgroup --durations=0 --session-timeout=370 \
    --junitxml="$OUT/gpu_suite_n8.xml" tests
# the same suite in two halves (each call of a session short of device time): every test's time in the JUnit files
step gpu_suite_a 400 "${GPU_TEST[@]}" --durations=0 --session-timeout=370 --junitxml="$OUT/gpu_suite_a.xml" \
    tests/engine/exec tests/engine/model
step gpu_suite_b 400 "${GPU_TEST[@]}" --durations=0 --session-timeout=370 --junitxml="$OUT/gpu_suite_b.xml" \
    tests --ignore=tests/engine/exec --ignore=tests/engine/model
step tier_tests 90 "${GPU_TEST[@]}" -s -k "tier_takes_free_vram or small_release_takes_own_blocks" \
    tests/engine/test_engine_gpu.py tests/engine/exec/test_tier_shared_gpu.py
step moe_seed 330 "$PY" benchmarks/seed_scenario.py --runs ${MOE_RUNS:-5} --device cuda:0 --random-model moe-bench \
    --prompt-tokens 32768 --out "$OUT/moe_seed.json" --extra --expert-cache-mib auto
step kvspill 100 "$PY" -m engine.bench kvspill --model random:0.6b --device cuda:0 --kv int8 --prompt-tokens 8K \
    --new-tokens 64 --kv-resident 1024 --json "$OUT/kvspill.json"
step kvspill_six 150 "$PY" -m engine.bench kvspill --model random:0.6b --device cuda:0 --kv int8 --slots 6 \
    --prompt-tokens 8K --new-tokens 32 --kv-resident 1024 --json "$OUT/kvspill_six.json"
step oom_pressure 90 "${GPU_TEST[@]}" -s tests/engine/exec/test_oom_gpu.py -k real_pressure
step kv_resident_tests 120 "${GPU_TEST[@]}" tests/engine/exec/test_kv_resident_gpu.py
step prefill_kernel_tests 150 "${GPU_TEST[@]}" tests/engine/exec/test_kv_paged_prefill_gpu.py
# the step's own inputs and outputs: packed inputs refilled with one copy, the decode graph's argmax, the fused MTP
# step's accepted and tokens side by side: every kind replayed against eager, engines' greedy tokens
step host_cut_tests 150 "${GPU_TEST[@]}" tests/engine/exec/test_graphs_runner.py tests/engine/test_engine_gpu.py \
    tests/engine/exec/test_kv_paged_prefill_gpu.py -k "replay_equals_eager or greedy_with_graphs or engine_greedy"
step moe_tests 120 "${GPU_TEST[@]}" tests/engine/model/test_moe_gpu.py

step attention_prefill 120 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 10 \
    --prefill-tune 128x64x8x2,128x64x4x3,128x128x8x2,64x64x4x2 --json "$OUT/attention_prefill.json"
step prefill_tune 150 "$PY" -m engine.bench attention --device cuda:0 --rows prefill --prefill-prefixes 128K \
    --iters 5 --backends triton \
    --prefill-tune 128x64x4x4,128x128x8x3,128x128x4x2,256x64x8x3,128x32x4x4,64x64x4x3,64x128x4x3 \
    --json "$OUT/prefill_tune.json"
step ttft_repeat 150 "$PY" -m engine.bench ttft --model random:0.6b --device cuda:0 --kv int8 \
    --prompt-sizes 176K,176K --json "$OUT/ttft_repeat.json"
for paged in 0 1; do  # the prompt-chunk kernel end to end: TTFT of fresh prompts with PAGED_PREFILL off, then on
    step ttft_paged_prefill_$paged 120 env STRATA_PAGED_PREFILL=$paged "$PY" -m engine.bench ttft --model random:0.6b \
        --device cuda:0 --prompt-sizes 32K,128K,176K --json "$OUT/ttft_paged_prefill_$paged.json"
done
step reuse 90 "$PY" -m engine.bench reuse --model random:0.6b --device cuda:0 --prompt-sizes 32K \
    --json "$OUT/reuse.json"
# where a step's time goes on strata-tiny, plain and with MTP at depth 1 and 2 (a depth-2 step cost 1.77x a plain one)
PROFILE_TINY=("$PY" -m engine.bench profile --model builtin:strata-tiny --device cuda:0 --batch 1 --steps 64 --top 25
)
step profile_tiny_mtp_0 90 "${PROFILE_TINY[@]}" --json "$OUT/profile_tiny_mtp_0.json"
step profile_tiny_mtp_1 90 "${PROFILE_TINY[@]}" --batch-mtp --mtp-depth 1 --json "$OUT/profile_tiny_mtp_1.json"
step profile_tiny_mtp_2 90 "${PROFILE_TINY[@]}" --batch-mtp --mtp-depth 2 --json "$OUT/profile_tiny_mtp_2.json"
step kv_seed 300 "$PY" benchmarks/seed_scenario.py --runs 1 --device cuda:0 --random-model 0.6b \
    --prompt-tokens 131072 --out "$OUT/kv_seed.json" --extra --kv-resident 16384
step linear 150 "$PY" -m engine.bench linear --device cuda:0 --rows 1,6,18 --iters 50 \
    --tune 16x128x8x4x4,16x512x2x4x4,16x256x2x4x6,32x256x1x4x4,32x512x1x4x3,64x256x1x4x4,64x128x1x8x4,128x128x1x8x3 \
    --json "$OUT/linear.json"
step attention_short 150 "$PY" -m engine.bench attention --device cuda:0 --rows decode --contexts 256,1K,4K,32K,128K \
    --batches 1,8 --q-lens 1,3 --backends triton --iters 20 --tune 128x4x2x1,64x4x2x1,32x4x2x1,64x4x2x4,32x2x2x1 \
    --json "$OUT/attention_short.json"
step fused_ops_tests 150 "${GPU_TEST[@]}" tests/engine/model/test_triton_ops_gpu.py
step paged_tests 120 "${GPU_TEST[@]}" tests/engine/exec/test_kv_paged_gpu.py
step step_tests 200 "${GPU_TEST[@]}" tests/engine/exec/test_kv_paged_gpu.py tests/engine/exec/test_kv_paged_prefill_gpu.py \
    tests/engine/test_engine_gpu.py -k "not seed_scenario and not peer_device and not tier_takes"
# the next greedy step launched before a step's tokens are read (engine.exec.decode_ahead, on by default): off here
step profile_ahead_off 90 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 --batch 1 --steps 64 \
    --top 12 --decode-ahead off --json "$OUT/profile_ahead_off.json"
step profile_pinned_off 90 env STRATA_PINNED_STAGING=0 "$PY" -m engine.bench profile --model random:0.6b \
    --device cuda:0 --batch 1 --steps 64 --top 12 --json "$OUT/profile_pinned_off.json"
step profile_b6 90 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 --batch 6 --steps 64 --top 12 \
    --json "$OUT/profile_b6.json"
step profile_b6_ahead_off 90 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 --batch 6 --steps 64 \
    --top 12 --decode-ahead off --json "$OUT/profile_b6_ahead_off.json"
step ahead_tests 150 "${GPU_TEST[@]}" tests/engine/test_engine_gpu.py tests/engine/test_engine_interleave.py \
    -k "greedy_with_graphs or on_cuda"
for ops in 0 1; do  # FUSED_OPS off, then on (the default): kernels and time of a batch-1 decode step, short context
    step profile_ops_$ops 90 env STRATA_FUSED_OPS=$ops "$PY" -m engine.bench profile --model random:0.6b \
        --device cuda:0 --batch 1 --steps 64 --top 12 --json "$OUT/profile_ops_$ops.json"
done
step profile128k_int8_ops0 90 env STRATA_FUSED_OPS=0 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 \
    --batch 1 --kv int8 --prompt-tokens 131072 --steps 32 --top 12 --json "$OUT/profile128k_int8_ops0.json"
step peers 200 "$PY" -m engine.bench peers --model random:0.6b --device cuda:0 --batches 1,6 --peers static \
    --json "$OUT/peers.json"
step peers_fused 200 env STRATA_FUSED_PROJ=1 "$PY" -m engine.bench peers --model random:0.6b --device cuda:0 \
    --batches 1,6 --peers static --json "$OUT/peers_fused.json"
# the same against the code before the chunk stream (commit d705eb3), in the same call: BASELINE names its tree
# (`git archive d705eb3 engine ':!engine/models' | tar -x -C baseline_d705`; the embedded model is copied in here)
if [ -n "${BASELINE:-}" ] && [ -d "$BASELINE/engine" ]; then
    [ -d "$BASELINE/engine/models" ] || cp -r engine/models "$BASELINE/engine/"
    step reuse_baseline 90 env -C "$BASELINE" PYTHONPATH="/tmp/site:$PWD/$BASELINE" "$PY" -m engine.bench reuse \
        --model random:0.6b --device cuda:0 --prompt-sizes 32K --json "$OUT/reuse_baseline.json"
    step attention_loads_baseline 90 env -C "$BASELINE" PYTHONPATH="/tmp/site:$PWD/$BASELINE" "$PY" -m engine.bench \
        attention --device cuda:0 --rows prefill --iters 5 --prefill-prefixes 32K,128K --backends triton \
        --json "$OUT/attention_loads_baseline.json"
    step profile_ops_1_baseline 90 env -C "$BASELINE" PYTHONPATH="/tmp/site:$PWD/$BASELINE" "$PY" -m engine.bench \
        profile --model random:0.6b --device cuda:0 --batch 1 --steps 64 --top 12 \
        --json "$OUT/profile_ops_1_baseline.json"
    step mtp_2_base 70 env -C "$BASELINE" PYTHONPATH="/tmp/site:$PWD/$BASELINE" "$PY" -m engine.bench mtp \
        --model builtin:strata-tiny --device cuda:0 --batches 1 --mtp-depth 2 --json "$OUT/mtp_2_base.json"
    for depth in 1 2; do  # its bench times one run per mode: three of them, each its own process
        step mtp_${depth}_baseline 150 env -C "$BASELINE" PYTHONPATH="/tmp/site:$PWD/$BASELINE" bash -c \
            "for i in 1 2 3; do $PY -m engine.bench mtp --model builtin:strata-tiny --device cuda:0 --batches 1 \
                --mtp-depth $depth --json $OUT/mtp_${depth}_baseline_\$i.json || exit 1; done"
    done
fi
# MTP depth 1 with the chunk stream off, with a plain side stream (no green context), and as the default (twice):
# which part of the chunk stream costs MTP its speed-up (1.083x against 1.400x before it, eleventh session)
MTP_1=("$PY" -m engine.bench mtp --model builtin:strata-tiny --device cuda:0 --batches 1 --mtp-depth 1
)
step mtp_1_default 60 "${MTP_1[@]}" --json "$OUT/mtp_1_default.json"
step mtp_1_off 60 "${MTP_1[@]}" --prefill-overlap off --json "$OUT/mtp_1_off.json"
step mtp_1_sms0 60 env STRATA_CHUNK_SMS=0 "${MTP_1[@]}" --json "$OUT/mtp_1_sms0.json"
step mtp_1_default_again 60 "${MTP_1[@]}" --json "$OUT/mtp_1_default_again.json"
step profile128k_bf16 90 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 --batch 1 \
    --prompt-tokens 131072 --steps 32 --top 12 --json "$OUT/profile128k_bf16.json"
step profile128k_int8 90 "$PY" -m engine.bench profile --model random:0.6b --device cuda:0 --batch 1 --kv int8 \
    --prompt-tokens 131072 --steps 32 --top 12 --json "$OUT/profile128k_int8.json"
# a prompt chunk's cost by its length (a lone prompt could take longer chunks than the 2,048 the slots' pacing uses)
PREFILL_ROWS=("$PY" -m engine.bench attention --device cuda:0 --rows prefill --iters 5 --prefill-prefixes 32K,128K
              --backends triton
)
step prefill_chunk_2048 60 "${PREFILL_ROWS[@]}" --prefill-chunk 2048 --json "$OUT/prefill_chunk_2048.json"
step prefill_chunk_4096 60 "${PREFILL_ROWS[@]}" --prefill-chunk 4096 --json "$OUT/prefill_chunk_4096.json"
step prefill_chunk_8192 60 "${PREFILL_ROWS[@]}" --prefill-chunk 8192 --json "$OUT/prefill_chunk_8192.json"
# the 176K first token alone (bf16 KV, the default) in chunks of that length
TTFT_176K=("$PY" -m engine.bench ttft --model random:0.6b --device cuda:0 --prompt-sizes 176K
)
step ttft_chunk_2048 100 "${TTFT_176K[@]}" --prefill-chunk-tokens 2048 --step-token-budget 4096 \
    --json "$OUT/ttft_chunk_2048.json"
step ttft_chunk_8192 100 "${TTFT_176K[@]}" --prefill-chunk-tokens 8192 --step-token-budget 8192 \
    --json "$OUT/ttft_chunk_8192.json"
step admission 240 "$PY" -m engine.bench admission --model random:0.6b --device cuda:0 --slots 6 --long-tokens 176K \
    --kv int8 --baseline-steps 64 --json "$OUT/admission.json"
IFS=, read -ra _sms_list <<< "${CHUNK_SMS_LIST:-96,112,120}"
for sms in "${_sms_list[@]}"; do  # the chunks' side stream in a green context of that many SMs, no lone runs
    step admission_sms_$sms 120 env STRATA_CHUNK_SMS=$sms "$PY" -m engine.bench admission --model random:0.6b \
        --device cuda:0 --slots 6 --long-tokens 176K --kv int8 --baseline-steps 64 --no-alone \
        --json "$OUT/admission_sms_$sms.json"
done
# chunks beside the steps (the default on CUDA since the tenth session) against chunks between them, same code
step admission_between 200 "$PY" -m engine.bench admission --model random:0.6b --device cuda:0 --slots 6 \
    --long-tokens 176K --kv int8 --baseline-steps 64 --prefill-overlap off --json "$OUT/admission_between.json"
COMPILED=(env XDG_CACHE_HOME=/tmp/strata-compile-cache STRATA_FUSED_PROJ=1 STRATA_COMPILE=1 "$PY" -m engine.bench decode \
          --model random:0.6b --device cuda:0 --batches 1,6 --prompt-tokens 128 --new-tokens 256 --graph-modes on
)
rm -rf /tmp/strata-compile-cache
step compile_cold 150 "${COMPILED[@]}" --json "$OUT/compile_cold.json"
step compile_warm 90 "${COMPILED[@]}" --json "$OUT/compile_warm.json"

echo "done after $(($(date +%s) - START_S))s"
