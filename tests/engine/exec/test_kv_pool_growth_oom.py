"""KV by use's pool growth when the device runs out of memory part-way through it.

A growth reallocates the pool tensors one at a time, every layer's keys first, then the values and the scales. On
a card full by design (a burst of 256 mixed prompts on an H100) a value tensor's allocation could fail after the
key tensors had grown: the keys then had more blocks than the values, and the kernels, which address a layer's
values with its keys' strides, read and wrote past the value tensors' end (`CUDA error: an illegal memory
access`). On a CPU the same state is harmless (torch indexes each tensor by its own shape), so these tests check
the state itself after every step, with the out-of-memory error injected where the device raised it.
"""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.exec.kv import pool_resize
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts


def _engine(ckpt) -> tuple[Engine, EventBus]:
    """16 slots of KV by use whose pool has no headroom of its own (a GPU's shape: it grows from what the tier
    gives back, which here always has the memory to give)."""
    bus = EventBus(history=100000)
    config = EngineConfig(model=str(ckpt), device="cpu", dtype="float32", batch=16, context=576, queue_max=16,
                          kv_resident=64, step_token_budget=1024, prefill_chunk_tokens=512)
    engine = Engine(config, bus)
    engine.kv.paging.take_memory = lambda mib, reason: mib
    return engine, bus


def _pool_block_counts(engine: Engine) -> set[int]:
    return {t.shape[1] for t in engine.kv.pools()}


def _run(engine: Engine) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(16, seed=97, lengths=(300, 500), vocab=200)):
        engine.add_request(f"g{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not engine.has_work:
            break
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert not engine.has_work
    return tokens


def _fail_allocation(monkeypatch, number: int) -> list[int]:
    """Fault injection: the `number`-th pool-tensor allocation from now (1-based) raises out of memory, once."""
    real, seen = pool_resize.empty, [0]

    def empty(shape, dtype, device):
        seen[0] += 1
        if seen[0] == number:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real(shape, dtype, device)

    monkeypatch.setattr(pool_resize, "empty", empty)
    return seen


@pytest.mark.parametrize("at", ["first value tensor", "last value tensor"])
def test_a_growth_out_of_memory_part_way_leaves_every_pool_tensor_its_old_size_and_the_tokens_unchanged(
        ckpt, monkeypatch, at):
    clean, _ = _engine(ckpt)
    expected = _run(clean)
    grown = clean.kv.paging.stats.grown_blocks
    clean.close()
    assert grown > 0  # the burst needs the pool to grow

    engine, bus = _engine(ckpt)
    layers = len(engine.kv.k)
    before = _pool_block_counts(engine)
    assert len(before) == 1
    # the first growth allocates every key tensor, then every value tensor (float pools: no scales)
    seen = _fail_allocation(monkeypatch, layers + 1 if at == "first value tensor" else 2 * layers)
    # what every layer's forward finds: the pools its attention addresses, as a kernel launched then would
    counts_at_each_layer: list[set[int]] = []
    hooks = [module.register_forward_pre_hook(lambda *_: counts_at_each_layer.append(_pool_block_counts(engine)))
             for module in engine.lm.model.modules() if type(module).__name__.endswith("DecoderLayer")]
    assert len(hooks) >= layers
    tokens = _run(engine)
    assert seen[0] > 2 * layers  # the failed growth, and at least one that succeeded after it
    assert counts_at_each_layer and all(len(counts) == 1 for counts in counts_at_each_layer), [
        sorted(c) for c in counts_at_each_layer if len(c) > 1][:3]
    assert tokens == expected
    grows = [e for e in bus.latest(["kv"]) if e.action == "grow"]
    assert grows and engine.kv.paging.stats.grown_blocks == sum(e.blocks for e in grows)
    engine.close()


def test_a_failed_growth_puts_back_the_tensors_that_grew_and_raises(monkeypatch):
    keys = [torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4) for _ in range(3)]
    values = [k + 100 for k in keys]
    original = [t.clone() for t in keys + values]
    _fail_allocation(monkeypatch, 4)  # the first value tensor's
    with pytest.raises(torch.OutOfMemoryError):
        pool_resize.resize_all(((keys, 0.0), (values, 0.0)), 5, stage=False)
    assert [t.shape for t in keys + values] == [(2, 3, 4)] * 6
    assert all(torch.equal(a, b) for a, b in zip(keys + values, original))


def test_a_kernel_launch_on_key_and_value_pools_of_different_sizes_is_an_error_naming_both():
    from engine.model.attention.triton_paged import scale_pools

    keys, values = torch.zeros(2, 34, 64, 16), torch.zeros(2, 26, 64, 16)
    with pytest.raises(ValueError, match=r"keys \(2, 34, 64, 16\), values \(2, 26, 64, 16\)"):
        scale_pools(keys, values, None, None)
    k8, v8 = keys.to(torch.int8), keys.to(torch.int8)
    with pytest.raises(ValueError, match=r"scales \(2, 34, 64\) / \(2, 26, 64\)"):
        scale_pools(k8, v8, torch.ones(2, 34, 64), torch.ones(2, 26, 64))
    assert scale_pools(k8, v8, torch.ones(2, 34, 64), torch.ones(2, 34, 64))[0] is True
