"""Sizing the expert cache at start from `--expert-cache-mib` (EngineConfig.expert_cache_mib).

- not given: every routed expert resident (the pools hold all of them; shrinking on request still works);
- N: N MiB of pools (whole slots per layer, at least one slot per layer, at most every expert);
- auto: one slot per layer at start, then, once the KV cache and the runner's buffers are allocated,
  AUTO_SHARE of what the books leave (free memory, measured with the weights, KV and any graphs captured so far
  taken, minus the reserve), up to every expert. The prefix tier comes after it and takes only the rest, so with
  auto the experts fill the card by design; and being the claimant that fills it, the cache is the first asked
  for room when a graph capture or a step runs out of memory (VramBudget.experts_first), before the tier.
A budget that cannot fit is a ConfigError naming the numbers, before anything is allocated.

The experts that do not fit the slots stay in pinned host memory, or with `--peer-device` on that card (the
store: every routed expert once), which must have room for all of them (a ConfigError on peer_device if not).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engine.errors import ConfigError
from engine.exec.experts.cache import ExpertCache
from engine.exec.experts.pool import expert_bytes
from engine.exec.cuda_streams import Streams
from engine.model.moe import sparse_blocks
from engine.model.moe_quant import quant_tensors
from engine.telemetry import EventBus

AUTO = "auto"
# auto's share of what is left after the weights that must stay, KV, graphs and the reserve: the rest is room for
# the graph pools captured later (decode buckets, MTP rounds) and the prefix tier's first blocks.
AUTO_SHARE = 0.95


def start_expert_cache(budget: int | str | None, model: torch.nn.Module, device: torch.device, bus: EventBus,
                       free_mib: float, reserve_mib: float, peer: torch.device | None = None,
                       peer_free_mib: float = 0.0, streams: Streams | None = None,
                       on_resize: Callable[[], None] | None = None) -> ExpertCache:
    """The cache with its start-up size (see the module docstring); `free_mib` is the device's free memory,
    `peer_free_mib` the --peer-device's (where the store goes when `peer` is given); `on_resize`: ExpertCache's."""
    if peer is not None and peer.type == "cuda":
        need = store_mib(model)
        if need > peer_free_mib - reserve_mib:
            raise ConfigError("peer_device", str(peer),
                              f"the routed experts need {need:.0f} MiB there but only {peer_free_mib - reserve_mib:.0f} "
                              f"MiB are available ({peer_free_mib:.0f} MiB free, minus the {reserve_mib:.0f} MiB "
                              "reserve); without --peer-device they stay in host memory")
    cache = ExpertCache(model, device, bus, slots=1, store_device=peer, streams=streams, on_resize=on_resize)
    if budget == AUTO:
        return cache
    want_mib = cache.all_experts_mib + cache.mib_for(0) if budget is None else float(budget)
    slots = cache.clamp_slots(cache.slots_for(want_mib))
    if budget is not None:
        check_min_budget(cache, budget, "expert_cache_mib")
    available = free_mib + cache.mib - reserve_mib
    if device.type == "cuda" and cache.mib_for(slots) > available:
        what = "every expert needs" if budget is None else "the expert cache needs"
        raise ConfigError("expert_cache_mib", budget if budget is not None else "all experts",
                          f"{what} {cache.mib_for(slots):.0f} MiB but only {available:.0f} MiB are available "
                          f"(free after the other weights, minus the {reserve_mib:.0f} MiB reserve); "
                          "use --expert-cache-mib auto or a smaller --expert-cache-mib")
    cache.set_budget(cache.mib_for(slots), "start")
    return cache


def store_mib(model: torch.nn.Module) -> float:
    """MiB of every routed expert once (the store), from the model's sparse layers before the cache takes them."""
    # the store holds each expert as the cache will (engine.exec.experts.pool.expert_bytes); a synthetic source's
    # shared store (engine.model.synthetic) holds its distinct rows once
    shared = {t.data_ptr(): t.numel() * t.element_size() for b in sparse_blocks(model) if b.expert_store is not None
              for t in (*b.expert_store, *quant_tensors(b.expert_quant))}
    own = sum(b.num_experts * expert_bytes(b) for b in sparse_blocks(model) if b.expert_store is None)
    return (own + sum(shared.values())) / 2**20


def check_min_budget(cache: ExpertCache, mib: Any, param: str) -> None:
    """ConfigError naming `param` when `mib` cannot hold one slot per sparse layer (start-up and live route)."""
    if float(mib) < cache.min_mib:
        raise ConfigError(param, mib,
                          f"below the minimum of {cache.min_mib:.1f} MiB (one slot of {cache.expert_mib:.3f} MiB per "
                          f"sparse layer x {cache.num_layers} layers, plus each layer's miss slot)")


def auto_budget_mib(free_mib: float, reserve_mib: float, cache_mib: float) -> float:
    """auto's budget: AUTO_SHARE of what is left (`free_mib`, measured with the weights, KV, runner buffers and
    any graphs captured so far already taken, plus what the cache holds now, minus the reserve); the cache rounds
    it down to whole slots and caps it at every expert."""
    return AUTO_SHARE * max(0.0, free_mib + cache_mib - reserve_mib)


def grow_auto(cache: ExpertCache, budget: Any, free_mib: float, reserve_mib: float) -> None:
    """auto: take auto_budget_mib of what the books leave now, up to every expert (at least one slot a layer)."""
    if budget != AUTO:
        return
    want = auto_budget_mib(free_mib, reserve_mib, cache.mib)
    cache.set_budget(max(want, cache.mib_for(cache.min_slots)), "auto: what the VRAM books leave")
