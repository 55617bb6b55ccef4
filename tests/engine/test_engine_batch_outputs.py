"""What a client receives does not depend on how many requests decode beside it: the same token ids, the same
streamed text chunks (stop strings split across tokens cut the same way), the same finish reasons and usage at
batch 64 with requests with and without stop strings mixed as at batch 1, and the engine thread hands a step's
outputs to a waiting event loop once a step, not once a token."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.api import GenerationRequest, RequestOutput, SamplingParams
from engine.orchestration.async_engine import AsyncEngine
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, small_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH = 64
MAX_TOKENS = 12
ABSENT = "\u2603 not generated \u2603"


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    for _ in range(100000):
        if not engine.has_work:
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work
    return outs


def _seen(seq: list[RequestOutput]) -> tuple:
    """Everything a client sees of one request's stream."""
    return ([o.token_ids for o in seq], [o.text for o in seq], [o.finished for o in seq], seq[-1].finish_reason,
            [(o.prompt_tokens, o.cached_tokens, o.completion_tokens) for o in seq])


def _split_stop(seq: list[RequestOutput]) -> str | None:
    """A stop string made of the last character of one streamed chunk and the first of the next: text that two
    different tokens produced (before the final output, whose text the decoder's flush may complete)."""
    texts = [o.text for o in seq]
    for k in range(1, len(texts) - 2):
        if texts[k] and texts[k + 1]:
            return texts[k][-1] + texts[k + 1][0]
    return None


def test_stop_strings_split_across_tokens_give_the_same_stream_at_batch_64_as_at_batch_1(ckpt):
    prompts = random_prompts(BATCH, seed=52, lengths=(5, 40))
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    free = _run(make_engine(ckpt, batch=BATCH), prompts, [plain] * BATCH)
    params, expected_text = [], {}
    for i in range(BATCH):
        rid = f"r{i}"
        stop = _split_stop(free[rid]) if i % 2 == 0 else None
        if stop is None:
            params.append(plain)
            continue
        text = "".join(o.text for o in free[rid])
        assert ABSENT not in text
        # with a longer stop string beside it that never comes: text is held back for it while it may be forming
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=(stop, ABSENT)))
        expected_text[rid] = text[:text.index(stop)]
    assert len(expected_text) >= BATCH // 4  # enough requests really carry a stop string split across tokens

    batched = _run(make_engine(ckpt, batch=BATCH), prompts, params)
    alone = _run(make_engine(ckpt, batch=1), prompts, params)
    assert {rid: _seen(seq) for rid, seq in batched.items()} == {rid: _seen(seq) for rid, seq in alone.items()}
    for rid, seq in batched.items():
        text = "".join(o.text for o in seq)
        if rid in expected_text:
            assert seq[-1].finish_reason == "stop" and text == expected_text[rid], rid
        else:
            assert seq[-1].finish_reason == "length" and seq[-1].completion_tokens == MAX_TOKENS
            assert [o.text for o in seq] == [o.text for o in free[rid]]


async def test_a_step_reaches_a_waiting_event_loop_in_one_hand_over_not_one_per_token(ckpt):
    requests, tokens = 16, MAX_TOKENS
    engine = AsyncEngine(small_config(ckpt, batch=requests), EventBus(),
                         engine_factory=lambda cfg, bus: Engine(cfg, bus, tier_budget_mib=32.0, block_tokens=16))
    assert (await engine.ready(timeout_s=60)).ready
    loop = asyncio.get_running_loop()
    wakes = 0
    real = loop.call_soon_threadsafe

    def counting(*args, **kwargs):  # every hand-over from another thread to this loop
        nonlocal wakes
        wakes += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def collect(i: int, prompt: list[int]) -> list[RequestOutput]:
        async with contextlib.aclosing(engine.generate(GenerationRequest(f"q{i}", prompt, params))) as gen:
            return [out async for out in gen]

    try:
        results = await asyncio.gather(*[collect(i, p) for i, p in enumerate(random_prompts(requests, seed=9))])
    finally:
        del loop.call_soon_threadsafe
        await engine.shutdown()
    for outs in results:
        assert outs[-1].finished and outs[-1].completion_tokens == tokens
        assert sum(len(o.token_ids) for o in outs) == tokens
    # one wake per request's add, plus one per step: far fewer than one per token (requests x tokens)
    assert wakes < requests * tokens // 2, wakes
