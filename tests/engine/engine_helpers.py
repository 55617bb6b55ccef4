"""Test models and drivers for the engine tests (Engine, AsyncEngine, MTP, tier).

A random checkpoint with the default init (std 0.02) greedily repeats its last token forever, which would make
generation tests pass trivially. `lively_checkpoint` scales the projection weights so greedy output varies,
and sets the MTP head's projection to pass the next token's embedding through: the head then drafts "the
next token repeats", which the main model sometimes does, so MTP verification sees both accepted and
rejected drafts.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from pathlib import Path

import torch

from engine.api import RequestOutput, SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus

WEIGHT_SCALE = 4.0


def lively_checkpoint(directory: Path, seed: int = 0, size: str = "tiny", **overrides) -> Path:
    """A random tiny Qwen3 + DeepSeek-MTP checkpoint whose greedy output is varied (see module docstring)."""
    from engine.model import load_checkpoint, save_checkpoint
    from engine.model.random_checkpoint import write_random_checkpoint

    if (directory / "config.json").exists():
        return directory
    write_random_checkpoint(directory, mtp_layout="deepseek", size=size, seed=seed, **overrides)
    lm = load_checkpoint(directory, dtype="float32", device="cpu")
    model = lm.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and not name.startswith("mtp."):
                p.mul_(WEIGHT_SCALE)
        for layer in model.mtp.layers:
            h = layer.eh_proj.weight.shape[0]
            layer.eh_proj.weight.zero_()
            layer.eh_proj.weight[:, :h] = torch.eye(h)  # [embedding | hidden]: keep the embedding
    save_checkpoint(model, directory, lm.eos_token_ids)
    return directory


_CACHE: dict[tuple, Path] = {}


def shared_lively_checkpoint(tmp_path_factory, seed: int = 0, **overrides) -> Path:
    """lively_checkpoint written once per test session (and per seed/overrides)."""
    key = (seed, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        _CACHE[key] = lively_checkpoint(tmp_path_factory.mktemp("lively"), seed=seed, **overrides)
    return _CACHE[key]


@contextlib.contextmanager
def one_thread():
    """Run torch on one intra-op thread: on a shared 2-core CI box, two spinning threads per test process
    make tiny ops hundreds of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def small_config(model: Path, **kw) -> EngineConfig:
    """A CPU config with small chunks so tests exercise chunked prefill."""
    base = dict(model=str(model), device="cpu", dtype="float32", batch=4, context=1024,
                prefill_chunk_tokens=64, step_token_budget=128)
    base.update(kw)
    return EngineConfig(**base)


def random_prompts(n: int, seed: int, lengths: tuple[int, int] = (20, 200), vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (size,), generator=gen).tolist() for size in sizes]


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams, prefix: str = "r",
            max_steps: int = 100000) -> dict[str, list[RequestOutput]]:
    """Add every prompt, step until idle, and collect each request's outputs."""
    outs: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work, "engine did not finish its requests"
    return outs


def tokens_of(outs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in seq for t in o.token_ids] for rid, seq in outs.items()}


def make_engine(model: Path, bus: EventBus | None = None, **kw) -> Engine:
    executor = kw.pop("executor", None)
    tier_mib = kw.pop("tier_budget_mib", 64.0)
    block_tokens = kw.pop("block_tokens", 16)
    return Engine(small_config(model, **kw), bus or EventBus(), graphs=executor, tier_budget_mib=tier_mib,
                  block_tokens=block_tokens)


def beside_others_reserve_mib(engine_mib: float = 4096.0, device: str = "cuda:0") -> int:
    """A --vram-reserve-mib for an engine in a `gpu_shared` test (tests/conftest.py): the engine takes at most
    `engine_mib` of what is free now, its tier included (which otherwise takes every free MiB past the reserve and
    regrows into it), and leaves the rest to the tests running beside it. When they take more, its tier shrinks;
    its weights, KV and graphs stay."""
    free_b, _ = torch.cuda.mem_get_info(torch.device(device))
    return max(0, int(free_b / 2**20 - engine_mib))


def tier_starving_reserve_mib(build: Callable[[], Engine], slack_mib: float = 64.0) -> int:
    """A --vram-reserve-mib that leaves the adaptive tier at most `slack_mib` on CUDA, where it otherwise takes
    every free MiB past the reserve at start and regrows into it at each rebalance (so `tier_budget_mib=0` does
    not keep it empty there): for GPU tests whose other claimant must be the one that answers. `build` makes the
    engine once, to read its books (weights + KV); it is closed and collected before free VRAM is measured."""
    from engine.exec.kv.vram_budget import device_memory_mib

    engine = build()
    weights_mib, kv_mib, device = engine.budget.weights_mib, engine.budget.kv_mib, engine.budget.device
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return int(device_memory_mib(device)[1] - weights_mib - kv_mib - slack_mib)


def fill_the_pool_beside_a_chunk(engine: Engine, bus: EventBus, short: list[list[int]], long: list[int],
                                 params: SamplingParams) -> tuple[dict[str, list[RequestOutput]], list, list[set[int]]]:
    """KV by use with a pool that cannot grow (the tier gives nothing): the short prompts are prefilled and decode,
    then the long one's chunks run beside their steps. Returns each request's outputs, the spill events, and the
    slots held (a chunk in flight) at each ledger plan."""
    engine.kv.paging.take_memory = lambda mib, reason: 0.0  # the tier has nothing to give: the pool must spill
    assert engine.chunks is not None
    ledger = engine.kv.paging.ledger
    held: list[set[int]] = []
    plan = ledger.plan

    def watch(wants):
        held.append(set(ledger._held))
        return plan(wants)

    ledger.plan = watch
    for i, prompt in enumerate(short):
        engine.add_request(f"r{i}", prompt, params)
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(4):  # the short prompts are prefilled and decode
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    engine.add_request(f"r{len(short)}", long, params)
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    spills = [e for e in bus.history() if e.type == "kv" and e.action == "spill"]
    return outs, spills, held


def slot_keys(kv, layer: int, values: bool = False) -> torch.Tensor:
    """Every slot's raw stored keys (or values) of a SlotKVCache in logical order, [slots, Hkv, columns, D]: a copy
    through the block table (the serving paths never build one)."""
    g = kv.geometry
    kv.join_fetches()
    pool = kv.v[layer] if values else kv.k[layer]
    picked = pool.index_select(1, kv.block_table.reshape(-1).long())
    return picked.view(g.num_kv_heads, g.num_slots, g.columns, g.head_dim).transpose(0, 1)
