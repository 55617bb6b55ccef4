"""The real engine on CPU interleaving a long admission with running decodes (issue 8, issue 4): four slots
decode, a long fresh prompt arrives, and every decoding slot still gets its token every step while the prompt is
prefilled under measured-cost pacing; the admission completes. Counts, not timings: the CPU's step times only
decide how the prompt is cut, which these tests do not pin."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.core.prefill_pacer import PrefillPacer
from engine.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, small_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHORT = random_prompts(4, seed=80, lengths=(20, 40))
LONG = random_prompts(1, seed=81, lengths=(2500, 2501))[0]
BLOCK_TOKENS = 16


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _admit_next_to_decoders(engine, context: int = 4096) -> int:
    """Four shorts decode; the long prompt arrives; every step must give each short a token until the long
    prompt's first token, and the engine must have fed its timings to the scheduler. Returns the steps the
    admission took."""
    shorts = [engine.add_request(f"s{i}", p, _greedy(context - len(p))) for i, p in enumerate(SHORT)]
    for _ in range(4):  # the shorts prefill, then decode: the engine has measured decode steps
        engine.step()
    assert all(r.num_output_tokens >= 1 for r in shorts)
    long = engine.add_request("long", LONG, _greedy(2))
    steps = 0
    chunks_seen = 0
    while long.num_output_tokens == 0:
        before = [r.num_output_tokens for r in shorts]
        computed_before = long.num_computed_tokens
        engine.step()
        steps += 1
        assert steps <= 40 * len(LONG) // BLOCK_TOKENS, "the long admission stopped making progress"
        gained = [r.num_output_tokens - b for r, b in zip(shorts, before)]
        assert not any(r.is_finished for r in shorts), f"step {steps}: a short ran out of context; give it more"
        assert all(g >= 1 for g in gained), f"step {steps}: a decoding slot got no token ({gained})"
        chunks_seen += long.num_computed_tokens > computed_before
        assert engine.health().ready, engine.health().reason
    assert long.num_computed_tokens == len(LONG)
    assert chunks_seen >= len(LONG) // 512  # chunked: never more than prefill_chunk_tokens a step
    pacer = engine.sched.pacer
    assert pacer.decode_s is not None and pacer.decode_s > 0
    assert pacer.cost.num_samples > 0 and pacer.cost.predict_s(256, 2000) > 0
    for r in shorts:
        engine.abort(r.request_id)
    while engine.has_work:
        engine.step()
    return steps


@pytest.mark.parametrize("mtp", [False, True])
def test_decoding_slots_get_a_token_every_step_while_a_long_prompt_is_admitted(ckpt, mtp: bool) -> None:
    _admit_next_to_decoders(make_engine(ckpt, batch=5, context=4096, prefill_chunk_tokens=512,
                                        step_token_budget=1024, block_tokens=BLOCK_TOKENS, batch_mtp=mtp,
                                        mtp_depth=2))


@pytest.mark.gpu
def test_on_cuda_with_graphs_decoding_slots_keep_their_token_every_step(ckpt) -> None:
    """The same on the GPU path: captured decode graphs, eager fused chunks, device syncs around the timings. The
    shorts get a 32K context: on the H200, once FUSED_OPS and FUSED_PROJ were on by default, the admission outlasted
    the room a 4,096-token context leaves a short decoding 3 tokens a step (docs/BENCHMARKS.md, seventh session)."""
    context = 32768
    config = small_config(ckpt, device="cuda:0", dtype="bfloat16", batch=5, context=context, prefill_chunk_tokens=512,
                          step_token_budget=1024, batch_mtp=True, mtp_depth=2)
    steps = _admit_next_to_decoders(Engine(config, EventBus(), block_tokens=BLOCK_TOKENS), context)
    print(f"the 2,500-token admission took {steps} steps")


def test_a_paced_admission_gives_the_tokens_an_unpaced_one_gives(ckpt) -> None:
    """Where the chunks fall must not change what is generated (greedy, fp32)."""
    outputs = []
    for share in (1.0, 0.2):
        engine = make_engine(ckpt, batch=3, context=2048, prefill_chunk_tokens=256, step_token_budget=512,
                             block_tokens=BLOCK_TOKENS)
        engine.sched.pacer = PrefillPacer(share, granule_tokens=BLOCK_TOKENS)  # the engine's, with this share
        shorts = [engine.add_request(f"s{i}", p, _greedy(40)) for i, p in enumerate(SHORT[:2])]
        for _ in range(3):
            engine.step()
        long = engine.add_request("long", LONG[:1200], _greedy(8))
        while engine.has_work:
            engine.step()
        outputs.append([list(r.output_token_ids) for r in shorts + [long]])
    assert outputs[0] == outputs[1]
