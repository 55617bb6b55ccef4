"""`--kv-resident` on the GPU (skipped without CUDA): the Triton paged kernels read spilled-and-fetched blocks
through the block table, and captured CUDA graphs replay unchanged while the table moves under them. Fetches run
on a copy stream, layer by layer, overlapped with the forward: each layer's attention waits for its blocks (in
captured graphs too), and `prepare` returns before the copy is done."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(4, seed=71, lengths=(400, 800))


def _engine(ckpt, bus=None, tier_budget_mib=0.0, **kw) -> Engine:
    base = dict(model=str(ckpt), device="cuda:0", dtype="float32", batch=4, context=1024,
                prefill_chunk_tokens=64, step_token_budget=128)
    base.update(kw)
    return Engine(EngineConfig(**base), bus or EventBus(history=100000), tier_budget_mib=tier_budget_mib,
                  block_tokens=16)


def _tier_with_nothing_to_give(engine: Engine) -> Engine:
    """On CUDA the tier takes the free VRAM at start and gives it to the pool when asked (so an engine with
    free VRAM grows its pool instead of spilling). The seed's card is full by design and its tier has nothing left to
    give: the pool must spill. That state is made here by the pool's source answering 0 MiB."""
    engine.kv.paging.take_memory = lambda mib, reason: 0.0
    return engine


def _replays(engine: Engine) -> int:
    return sum(g.replays for g in engine.graphs.snapshot().graphs)


# KV by use with a resident window (its forwards wait for each layer's fetch) and without one (a fetch is waited
# for whole before the forward: no wait in its graphs)
WINDOWED, BY_USE = dict(kv_resident=128), dict(kv_pool="by-use")


@pytest.mark.parametrize("kv,mtp,pool", [("bf16", False, WINDOWED), ("int8", True, WINDOWED), ("bf16", False, BY_USE),
                                         ("int8", True, BY_USE)])
def test_gpu_spilled_kv_through_the_paged_kernels_and_graphs_gives_the_tokens_of_a_run_with_room(ckpt, kv, mtp, pool):
    roomy = tokens_of(run_all(_engine(ckpt, kv=kv, batch_mtp=mtp, mtp_depth=2), PROMPTS, GREEDY))
    bus = EventBus(history=100000)
    engine = _tier_with_nothing_to_give(_engine(ckpt, bus=bus, kv=kv, batch_mtp=mtp, mtp_depth=2, **pool))
    assert engine.kv.paging.layer_waits == ("kv_resident" in pool)
    assert engine.runner.paged_enabled(), "the Triton paged kernels should read the pool here"
    assert type(engine.graphs).__name__ == "GraphCache"
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == roomy
    kinds = [e.action for e in bus.history() if e.type == "kv"]
    assert "spill" in kinds and "fetch" in kinds
    assert _replays(engine) > 0  # captured steps replayed with the table pointing at fetched blocks
    # Fetches went through the copy stream; once it is idle every one of them is counted and published.
    torch.cuda.synchronize()
    state = engine.kv.paging.snapshot()
    fetches = [e for e in bus.history() if e.type == "kv" and e.action == "fetch"]
    assert state.fetched_blocks == sum(e.blocks for e in fetches) and all(e.ms > 0 for e in fetches)


def test_gpu_a_captured_decode_replays_correctly_after_its_slots_blocks_moved(ckpt):
    """Slot 0's decode graph is captured and replayed; slot 1's prefill then spills slot 0's blocks to the
    host; the next replay (after the fetch rewrote the table in place) gives the same logits."""
    from engine.exec.runner import Row

    engine = _tier_with_nothing_to_give(_engine(ckpt, batch=2, kv_resident=64))
    runner, kv = engine.runner, engine.kv
    prompt = random_prompts(2, seed=5, lengths=(700, 701))
    with torch.inference_mode():
        for start in range(0, 640, 64):
            runner.prefill(0, prompt[0][start:start + 64], start)
        first = runner.decode([Row(0, 11, 640)]).logits.clone()  # eager warm-up and capture of its b1 graph
        second = runner.decode([Row(0, 11, 640)]).logits.clone()  # a replay
        replays = _replays(engine)
        for start in range(0, 700, 64):  # slot 1 takes the pool: slot 0's blocks spill
            runner.prefill(1, prompt[1][start:start + 64], start)
        assert kv.paging.placement_tokens(0, 640)[2] > 0, "slot 0 has nothing on the host"
        fetched = kv.paging.stats.fetched_blocks
        again = runner.decode([Row(0, 11, 640)]).logits.clone()  # fetch back, replay the same graph
        # A CUDA fetch is counted once its copy has completed (the copy is asynchronous: read right after the
        # decode, the count can still be 0), at the next prepare or snapshot.
        torch.cuda.synchronize()
        assert kv.paging.snapshot().fetched_blocks > fetched
    assert _replays(engine) > replays
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


# A quarter to half a second at a 1-2 GHz GPU clock: long enough that the host is far ahead when it looks.
_SLOW_COPY_CYCLES = 500_000_000


@pytest.mark.parametrize("pool", [dict(kv_resident=64), BY_USE], ids=["windowed", "by-use"])
def test_gpu_a_replayed_decode_waits_for_a_slow_fetch_that_prepare_did_not_wait_for(ckpt, pool):
    """The decode graph is captured while nothing is fetched; slot 0's blocks then spill, and the fetch that
    brings them back is made slow (a sleep queued on the copy stream before its copies). `prepare` returns with
    the copy still running (no layer's event complete), and the replayed graph still reads exactly the fetched
    KV: its captured waits on the external layer events held each layer back until its blocks had landed (with a
    resident window), or the compute stream waited for the whole fetch before the replay (without one)."""
    from engine.exec.runner import Row

    engine = _tier_with_nothing_to_give(_engine(ckpt, batch=2, **pool))
    runner, kv, paging = engine.runner, engine.kv, engine.kv.paging
    prompt = random_prompts(2, seed=5, lengths=(700, 701))
    with torch.inference_mode():
        for start in range(0, 640, 64):
            runner.prefill(0, prompt[0][start:start + 64], start)
        first = runner.decode([Row(0, 11, 640)]).logits.clone()  # eager warm-up and capture: no fetch yet
        runner.decode([Row(0, 11, 640)])
        replays = _replays(engine)
        for start in range(0, 700, 64):  # slot 1 takes the pool: slot 0's blocks spill
            runner.prefill(1, prompt[1][start:start + 64], start)
        assert paging.placement_tokens(0, 640)[2] > 0, "slot 0 has nothing on the host"
        torch.cuda.synchronize()

        real_fetch, real_prepare = paging.host.fetch, paging.prepare
        streams, after_prepare = [], []

        def slow_fetch(*args, **kwargs):
            streams.append(torch.cuda.current_stream().cuda_stream)
            torch.cuda._sleep(_SLOW_COPY_CYCLES)  # queued ahead of the copies on the stream they run on
            real_fetch(*args, **kwargs)

        def watched_prepare(wants):
            real_prepare(wants)
            layers_done = [e.query() for e in paging._layer_fetched]
            after_prepare.append((layers_done, [f.end.query() for f in paging._pending]))

        paging.host.fetch, paging.prepare = slow_fetch, watched_prepare
        fetched = paging.stats.fetched_blocks
        again = runner.decode([Row(0, 11, 640)]).logits.clone()  # fetch back, replay the same graph
        torch.cuda.synchronize()

    assert streams == [engine.streams.kv_copy.cuda_stream], "the fetch ran on the engine's KV copy stream, once"
    [(layers_done, pending_done)] = after_prepare
    assert not any(layers_done), "prepare waited for the copy"
    assert pending_done == [False]  # left pending: its telemetry comes once the copy is done
    assert _replays(engine) > replays, "the decode ran eagerly: the captured waits were not exercised"
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    state = paging.snapshot()  # the copy is done now: its time (the sleep included) is published
    assert state.fetched_blocks > fetched and paging._pending == []
    assert state.fetch_ms >= 100.0
