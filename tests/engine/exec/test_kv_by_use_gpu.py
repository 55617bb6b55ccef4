"""KV by use on the GPU (skipped without CUDA): the same greedy tokens as every slot's context reserved, with CUDA
graphs, chunks beside the steps and steps launched ahead all on; block tables that change under replayed graphs
(slots taking blocks as they grow, a finished request's blocks going to the next one); a pool that fills while a
chunk runs beside the steps (the chunk's slot is held, the decoding slots spill each other instead); and, as a
server runs it (the prefix tier taking what VRAM is left, default switches), N requests at once on N slots."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import fill_the_pool_beside_a_chunk, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(4, seed=171, lengths=(300, 900))


def _engine(ckpt, bus=None, **kw) -> Engine:
    base = dict(model=str(ckpt), device="cuda:0", dtype="float32", batch=4, context=2048,
                prefill_chunk_tokens=256, step_token_budget=512)
    base.update(kw)
    return Engine(EngineConfig(**base), bus or EventBus(history=100000), tier_budget_mib=0.0, block_tokens=64)


def _served(ckpt, n: int, kv_pool: str) -> Engine:
    """As `strata-engine serve` builds it: the tier takes what VRAM is left (no tier budget given). fp32 weights: the
    two runs batch their steps differently, and bf16 matmuls round differently at different batch sizes."""
    config = EngineConfig(model=str(ckpt), device="cuda:0", dtype="float32", batch=n, queue_max=n, context=1536,
                          kv_pool=kv_pool)
    return Engine(config, EventBus(history=100000))


def _replays(engine: Engine) -> int:
    return sum(g.replays for g in engine.graphs.snapshot().graphs)


@pytest.mark.parametrize("kv,mtp", [("bf16", False), ("int8", False), ("bf16", True), ("int8", True)])
def test_gpu_by_use_gives_the_tokens_of_reserved_with_graphs_chunks_beside_and_steps_ahead(ckpt, kv, mtp):
    reserved = tokens_of(run_all(_engine(ckpt, kv=kv, batch_mtp=mtp, mtp_depth=2, kv_pool="reserved"), PROMPTS,
                                 GREEDY))
    engine = _engine(ckpt, kv=kv, batch_mtp=mtp, mtp_depth=2, kv_pool="by-use")
    assert engine.kv.paging is not None and engine.chunks is not None
    assert engine.ahead.enabled and type(engine.graphs).__name__ == "GraphCache"
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == reserved
    assert _replays(engine) > 0
    engine.step()
    ledger = engine.kv.paging.ledger
    assert all(ledger.used_blocks(s) == 0 for s in range(4))  # every block back


def test_gpu_block_tables_change_under_replayed_graphs_as_requests_come_and_go(ckpt):
    """Waves of requests on two slots: each wave's slots take the blocks the last one gave back, in another order,
    and the decode graphs captured in the first wave replay over the rewritten table."""
    engine = _engine(ckpt, batch=2, kv_pool="by-use", prefill_overlap="off", decode_ahead="off")
    reference = _engine(ckpt, batch=2, kv_pool="reserved", prefill_overlap="off", decode_ahead="off")
    for wave in range(3):
        prompts = random_prompts(2, seed=180 + wave, lengths=(100, 700))
        got = tokens_of(run_all(engine, prompts, GREEDY, prefix=f"w{wave}_"))
        assert got == tokens_of(run_all(reference, prompts, GREEDY, prefix=f"w{wave}_"))
        if wave == 0:
            replays = _replays(engine)
            captures = len(engine.graphs.snapshot().graphs)
    assert _replays(engine) > replays
    assert engine.kv.paging.stats.grown_blocks == 0  # no growth: the graphs were never dropped
    assert len(engine.graphs.snapshot().graphs) >= captures


def test_gpu_a_pool_that_fills_while_a_chunk_runs_beside_the_steps(ckpt):
    """Two slots decode while a long prompt's chunks run beside them on a pool too small for all three (a
    resident window of 64, no tier to grow from): the steps spill the decoding slots' blocks, never the chunk's
    slot's, and every request gets the tokens of a run with room."""
    short = random_prompts(2, seed=190, lengths=(500, 600))
    long = random_prompts(1, seed=191, lengths=(1800, 1801))
    reference = _engine(ckpt, batch=3, kv_pool="reserved")
    want = tokens_of(run_all(reference, short + long, GREEDY))
    bus = EventBus(history=100000)
    engine = _engine(ckpt, bus=bus, batch=3, kv_resident=64)
    outs, spills, held = fill_the_pool_beside_a_chunk(engine, bus, short, long[0], GREEDY)
    assert tokens_of(outs) == want
    assert spills, "the pool never filled"
    assert any(held_slots for held_slots in held), "no chunk ran beside the steps"
    torch.cuda.synchronize()


@pytest.mark.parametrize("n", [1, 8, 128])
def test_gpu_n_requests_at_once_by_use_give_the_tokens_of_reserved_as_served(ckpt, n):
    """N prompts arrive at once on N slots of an engine built as `serve` builds it (the tier fills the card):
    by use admits them as its pool allows and gives every request the greedy tokens of reserved KV."""
    prompts = random_prompts(n, seed=400 + n, lengths=(64, 1000))
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    reserved = _served(ckpt, n, "reserved")
    want = tokens_of(run_all(reserved, prompts, params))
    reserved.close()
    engine = _served(ckpt, n, "by-use")
    assert engine.kv.paging is not None
    assert tokens_of(run_all(engine, prompts, params)) == want
    assert engine.kv.paging.stats.preemptions == 0
    engine.close()
