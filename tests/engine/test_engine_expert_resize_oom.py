"""The real Engine on a Qwen3-MoE checkpoint (CPU) whose expert cache is resized while memory runs out: the seed's
card, full of an 80B MoE's experts by design. A shrink that the out-of-memory path asks for has no room for a
layer's new pool beside its old one; a growth into room the books measured finds it taken part-way. Either way every
layer keeps one size, no captured graph reads a pool that moved, and the greedy tokens do not change."""

from __future__ import annotations

import math
import weakref

import torch

from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, one_thread, run_all, tokens_of
from tests.engine.exec.test_kv_pool_growth_oom import _AddressCheckingBackend
from tests.engine.test_engine_moe import GREEDY, engine_whose_captures_run_out_of_memory
from tests.engine.test_engine_moe import moe_ckpt, plain_tokens, prompts  # noqa: F401 (fixtures)

_OOM = "CUDA out of memory. Tried to allocate {mib:.2f} MiB. [injected: the card holds its expert pools and no more]"


def _pool_tensors(cache) -> list[torch.Tensor]:
    return [t for pool in cache.pools for t in (pool.gate_up, pool.down)]


def _card_full_of_experts(monkeypatch, cache) -> list[int]:
    """Fault injection: the device holds the expert pools it has now and nothing more. A pool allocation past
    that runs out of memory; a pool freed gives its memory back. Returns [allocations refused]."""
    from engine.exec.experts import pool as expert_pool

    live: dict[int, int] = {}
    refused = [0]

    def track(tensor: torch.Tensor) -> torch.Tensor:
        live[id(tensor)] = tensor.untyped_storage().nbytes()
        weakref.finalize(tensor, live.pop, id(tensor), None)
        return tensor

    for tensor in _pool_tensors(cache):
        track(tensor)
    capacity, real = sum(live.values()), expert_pool.empty

    def empty(shape, dtype, device):
        need = math.prod(shape) * dtype.itemsize
        if sum(live.values()) + need > capacity:
            refused[0] += 1
            raise torch.OutOfMemoryError(_OOM.format(mib=need / 2**20))
        return track(real(shape, dtype, device))

    monkeypatch.setattr(expert_pool, "empty", empty)
    return refused


def test_a_capture_out_of_memory_on_a_card_full_of_experts_shrinks_the_cache_through_its_store(
        moe_ckpt, prompts, plain_tokens, monkeypatch):
    """A graph capture runs out of memory and the books ask the expert cache for room (the tier is empty), on a
    card with no room for a layer's smaller pool beside its old one."""
    bus = EventBus()
    with one_thread():
        engine = engine_whose_captures_run_out_of_memory(moe_ckpt, bus)
        cache = engine.lm.model.expert_provider
        try:
            refused = _card_full_of_experts(monkeypatch, cache)
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
        finally:
            engine.close()
    shrink = next(e for e in bus.history() if e.type == "expert" and e.action == "shrink")
    assert "out of memory" in shrink.reason and shrink.slots < 16 and shrink.mib > 0
    assert refused[0] >= 1  # the smaller pool did not fit beside the old one
    assert {p.slots for p in cache.pools} == {shrink.slots}
    assert not [e for e in bus.history() if e.type == "graph" and e.action == "degrade"]
    assert tokens == plain_tokens


def test_a_budget_raised_into_memory_taken_part_way_keeps_every_layer_one_size_and_the_graphs_valid(
        moe_ckpt, prompts, plain_tokens, monkeypatch):
    """strata-tui raises the expert budget; the growth runs out of memory at the second layer. The first layer's
    pool is put back at the others' size by a new allocation (a new address): the graphs captured on the old pools
    are dropped, the engine says why the cache did not grow, and serving goes on with the same tokens."""
    from engine.exec.experts import pool as expert_pool
    from engine.exec.graphs.cache import GraphCache
    from engine.exec.runner import switch_for_key
    from engine.switches import SwitchBoard

    bus, holder = EventBus(history=100000), []
    backend = _AddressCheckingBackend(lambda: _pool_tensors(holder[0].lm.model.expert_provider))
    graphs = GraphCache("cpu", bus, SwitchBoard.from_values({}), lambda mib, reason: 0.0, wait_polls=1,
                        wait_interval_s=0.0, switch_for_key=switch_for_key, backend=backend, sleep=lambda s: None)
    with one_thread():
        engine = make_engine(moe_ckpt, bus=bus, batch=3, executor=graphs, expert_cache_mib=1)
        holder.append(engine)
        cache = engine.lm.model.expert_provider
        try:
            run_all(engine, prompts, GREEDY)  # graphs captured on the pools as they are
            assert engine.graphs.snapshot().graphs
            slots = cache.slots
            # a freed pool's address stays taken, as on a device whose allocator gave its cache back on the failure
            held, real, seen = [t.untyped_storage() for t in _pool_tensors(cache)], expert_pool.empty, [0]

            def empty(shape, dtype, device):
                seen[0] += 1
                if seen[0] == 3:  # the second layer's gate_up, after the first layer's gate_up and down
                    raise torch.OutOfMemoryError(_OOM.format(mib=math.prod(shape) * dtype.itemsize / 2**20))
                tensor = real(shape, dtype, device)
                held.append(tensor.untyped_storage())
                return tensor

            monkeypatch.setattr(expert_pool, "empty", empty)
            engine.budget.set_expert_budget(cache.all_experts_mib, "expert budget set in strata-tui")
            assert seen[0] > 3 and cache.slots == slots  # it tried, and stayed
            assert {p.slots for p in cache.pools} == {slots}
            assert {p.gate_up.shape[0] for p in cache.pools} == {slots + 1}
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            replays = sum(g.replays for g in engine.graphs.snapshot().graphs)  # captured after the growth failed
        finally:
            engine.close()
    warning = next(e for e in bus.history() if e.type == "warning" and e.where == "experts.grow")
    assert "ran out of memory" in warning.message and "CUDA out of memory" in warning.message
    assert f"stays at {slots} slots" in warning.message
    assert backend.stale_replays == 0
    assert replays > 0  # the steps after it did replay graphs
    assert tokens == plain_tokens
