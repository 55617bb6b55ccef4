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


def _fail_allocation(monkeypatch, number: int, held: list | None = None) -> list[int]:
    """Fault injection: the `number`-th pool-tensor allocation from now (1-based) raises out of memory, once.
    `held` (the pool tensors' storages now): no allocation from now reuses the address of a pool tensor freed since,
    as on a device whose allocator gave its cached memory back to the driver when an allocation failed (the CPU's
    would hand the same address out again)."""
    real, seen = pool_resize.empty, [0]

    def empty(shape, dtype, device):
        seen[0] += 1
        if seen[0] == number:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        tensor = real(shape, dtype, device)
        if held is not None:
            held.append(tensor.untyped_storage())
        return tensor

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


class _AddressCheckingBackend:
    """A device's graph, modelled on the CPU: a replay reads the pool tensors at the addresses they had at capture
    (as a CUDA graph's kernels do). A replay after the pools moved is the device's illegal memory access."""

    def __init__(self, pools) -> None:
        from engine.exec.graphs.backends import CpuGraphBackend

        self.inner, self.pools, self.stale_replays = CpuGraphBackend(), pools, 0
        self.device = "cpu"

    def addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.pools())

    def capture(self, fn, static_inputs, owner, stage, on_failure):
        graph = self.inner.capture(fn, static_inputs, owner, stage, on_failure)
        graph.addresses = self.addresses()
        return graph

    def replay(self, graph) -> None:
        if graph.addresses != self.addresses():
            self.stale_replays += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.inner.replay(graph)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_growth_out_of_memory_part_way_drops_the_graphs_that_read_the_tensors_it_moved(ckpt, monkeypatch):
    """Putting the grown tensors back allocates them anew: a graph captured before the growth would replay on
    freed memory. Found on an H100 as an illegal memory access in a prompt chunk's graph at 256 mixed requests."""
    from engine.exec.graphs.cache import GraphCache
    from engine.exec.runner import switch_for_key
    from engine.switches import SwitchBoard

    def run(fail: bool) -> tuple[dict[str, list[int]], _AddressCheckingBackend, Engine]:
        bus = EventBus(history=100000)
        holder: list[Engine] = []
        backend = _AddressCheckingBackend(lambda: holder[0].kv.pools())
        cache = GraphCache("cpu", bus, SwitchBoard.from_values({}), lambda mib, reason: 0.0, wait_polls=1,
                           wait_interval_s=0.0, switch_for_key=switch_for_key, backend=backend,
                           sleep=lambda s: None)
        config = EngineConfig(model=str(ckpt), device="cpu", dtype="float32", batch=16, context=576, queue_max=16,
                              kv_resident=64, step_token_budget=1024, prefill_chunk_tokens=512)
        engine = Engine(config, bus, graphs=cache)
        holder.append(engine)
        engine.kv.paging.take_memory = lambda mib, reason: mib
        # one request at a time: the graphs the burst replays once it spills (a lone chunk's, a lone row's decode)
        for i, prompt in enumerate(random_prompts(2, seed=5, lengths=(500, 510), vocab=200)):
            engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            while engine.has_work:
                engine.step()
        assert cache.snapshot().graphs
        if fail:
            layers = len(engine.kv.k)
            held = [t.untyped_storage() for t in engine.kv.pools()]
            seen = _fail_allocation(monkeypatch, layers + 1, held)  # the next growth's first value tensor
            # past the failure the device has no memory left: the steps after it spill and replay their graphs
            engine.kv.paging.take_memory = lambda mib, reason: mib if seen[0] <= layers else 0.0
        return _run(engine), backend, engine  # every output error-free (asserted there)

    expected, _, clean = run(fail=False)
    clean.close()
    tokens, backend, engine = run(fail=True)
    assert engine.kv.paging.stats.preemptions > 0  # the growth failed and the pool spilled instead
    assert backend.stale_replays == 0
    assert any(g.replays for g in engine.graphs.snapshot().graphs)  # the steps did replay graphs
    assert tokens == expected
    engine.close()
