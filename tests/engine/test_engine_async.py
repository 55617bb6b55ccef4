"""AsyncEngine: the EngineClient the server uses, driven on CPU through exactly that surface."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.api import EngineClient, GenerationRequest, SamplingParams
from engine.orchestration.async_engine import AsyncEngine
from engine.orchestration.engine import Engine
from engine.errors import EngineDead, PromptTooLong, QueueFull
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, small_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _factory(cfg, bus):
    return Engine(cfg, bus, tier_budget_mib=32.0, block_tokens=16)


@contextlib.asynccontextmanager
async def running(ckpt, **kw):
    engine = AsyncEngine(small_config(ckpt, **kw), EventBus(), engine_factory=_factory)
    health = await engine.ready(timeout_s=60)
    assert health.ready, health.reason
    try:
        yield engine
    finally:
        await engine.shutdown()


async def _collect(engine, rid, prompt, params):
    outs = []
    async with contextlib.aclosing(engine.generate(GenerationRequest(rid, prompt, params))) as gen:
        async for out in gen:
            outs.append(out)
    return outs


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_generate_streams_increments_for_concurrent_requests(ckpt):
    async with running(ckpt, batch=2) as engine:
        assert isinstance(engine, EngineClient)
        assert engine.vocab_size == 512 and engine.context_tokens == 1024
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(3, seed=20)
        results = await asyncio.gather(*[_collect(engine, f"q{i}", p, params) for i, p in enumerate(prompts)])
        for outs in results:
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            ids = [t for o in outs for t in o.token_ids]
            assert len(ids) == 10
            assert "".join(o.text for o in outs) == engine.decode(ids)
        assert engine.health().ready
        assert engine.state().slots[0].state == "idle"  # AsyncEngine.state() is the typed EngineSnapshot


async def test_rejections_are_raised_before_the_first_yield(ckpt):
    async with running(ckpt, batch=1, context=128, prefill_chunk_tokens=64, queue_max=1) as engine:
        with pytest.raises(PromptTooLong):
            await _collect(engine, "long", [7] * 200, SamplingParams(max_tokens=4))
        slow = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        first = asyncio.create_task(_collect(engine, "a", [7] * 10, slow))
        await _until(lambda: engine.state().to_json()["slots"][0]["state"] != "idle")
        second = asyncio.create_task(_collect(engine, "b", [7] * 10, slow))
        await _until(lambda: engine.state().to_json()["queue"]["waiting"] == 1)  # "a" holds the slot, "b" the queue place
        with pytest.raises(QueueFull):
            await _collect(engine, "c", [7] * 10, slow)
        first.cancel()
        second.cancel()


async def test_cancelling_the_iterator_aborts_the_request_within_a_step(ckpt):
    async with running(ckpt, batch=1) as engine:
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        seen = asyncio.Event()

        async def consume():
            async for out in engine.generate(GenerationRequest("c", random_prompts(1, seed=21)[0], params)):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: engine.state().to_json()["slots"][0]["state"] == "idle")
        # The slot serves the next request at once.
        outs = await _collect(engine, "next", [9] * 12, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert outs[-1].completion_tokens == 3


async def test_live_controls_reserve_and_switch(ckpt):
    async with running(ckpt, batch=1) as engine:
        assert await engine.set_vram_reserve(2048) == 2048
        assert engine.state().to_json()["vram"][0]["reserve_mib"] == 2048
        state = await engine.set_switch("SPLIT_ATTN", True)
        assert state.enabled
        assert any(s["name"] == "SPLIT_ATTN" and s["enabled"] for s in engine.state().to_json()["switches"])
        outs = await _collect(engine, "s", [11] * 30, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert outs[-1].completion_tokens == 4


async def test_text_past_the_context_is_refused_by_its_count_as_text_and_as_chat(tiny_checkpoint):
    async with running(tiny_checkpoint, context=64) as engine:
        fits = engine.encode("hello world " * 4)
        assert 0 < len(fits) <= 64
        with pytest.raises(PromptTooLong) as info:
            engine.encode("hello world " * 200)
        assert info.value.context_tokens == 64 and info.value.prompt_tokens > 64
        with pytest.raises(PromptTooLong) as info:
            engine.apply_chat_template([{"role": "user", "content": "hello world " * 200}])
        assert info.value.context_tokens == 64 and info.value.prompt_tokens > 64


async def test_a_failed_load_reports_dead_with_the_reason(tmp_path):
    engine = AsyncEngine(small_config(tmp_path), EventBus())
    health = await engine.ready(timeout_s=30)
    assert not health.ready and health.reason.startswith("dead:") and "config.json" in health.reason
    with pytest.raises(EngineDead):
        await _collect(engine, "x", [1, 2], SamplingParams())
    await engine.shutdown()


async def test_a_step_failure_ends_the_stream_with_the_error_and_health_goes_dead(ckpt):
    from engine.exec.step_fns import EagerExecutor

    class Broken(EagerExecutor):
        def run(self, kind, key, fn, inputs, owner=None):
            if kind == "decode":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return fn(inputs)

    def factory(cfg, bus):
        return Engine(cfg, bus, graphs=Broken(), tier_budget_mib=8.0, block_tokens=16)

    engine = AsyncEngine(small_config(ckpt, batch=1), EventBus(), engine_factory=factory)
    assert (await engine.ready(timeout_s=60)).ready
    outs = await _collect(engine, "x", [5] * 20, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert outs[-1].finished and outs[-1].finish_reason == "error" and "illegal memory access" in outs[-1].error
    health = engine.health()
    assert not health.ready and "illegal memory access" in health.reason
    with pytest.raises(EngineDead):
        await _collect(engine, "y", [5] * 20, SamplingParams(max_tokens=2))
    await engine.shutdown()
    assert engine.health().reason.startswith("dead:")  # a dead engine stays dead after shutdown


async def test_an_idle_engine_keeps_publishing_vram_about_once_a_second(ckpt):
    async with running(ckpt, batch=1) as engine:
        before = len([e for e in engine.bus.history() if e.type == "vram"])
        await asyncio.sleep(2.3)
        after = len([e for e in engine.bus.history() if e.type == "vram"])
        assert 1 <= after - before <= 4
