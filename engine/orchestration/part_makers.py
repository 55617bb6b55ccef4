"""The engine's parts made one at a time from the config and the device, each on its own: the KV cache sized
against the free memory, an MoE model's expert cache at its start-up size, the device the tier lives on, the step
executor (the graph cache on CUDA, else eager), the tier's blocks in the KV pool, the step token budget.
engine.orchestration.engine_setup calls them in its stages and hands each what it needs.
"""

from __future__ import annotations

import functools
from typing import Any, Hashable

import torch

from engine.config import EngineConfig
from engine.core.prefix_index import PrefixIndex
from engine.core.step_budget import default_step_token_budget, estimated_prefill_tok_s, prefill_flops_per_token
from engine.errors import ConfigError
from engine.exec.cuda_streams import Streams
from engine.exec.device_rate import matmul_flop_s
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.exec.kv.tier import MIB, check_kv_fits
from engine.exec.kv.tier_ledger import LedgerTierBlocks
from engine.exec.kv.tier_pool import SharedTierBlocks
from engine.exec.kv.vram_budget import device_memory_mib
from engine.exec.runner import switch_for_key
from engine.exec.step_buckets import MIN_CHUNK_TOKENS, pow2_bucket
from engine.exec.step_fns import EagerExecutor, StepExecutor
from engine.model.quant.linear import model_bytes
from engine.switches import SwitchBoard
from engine.telemetry import EventBus, WarningEvent

SHARED_SWITCH = "SHARED_PREFIX"
# KV by use on a CPU: the pool's size at start (when every slot's whole context is more); it grows as slots use it
CPU_START_POOL_MIB = 256.0


def every_graph(kind: str, key: Hashable) -> bool:
    """What a reallocated pool makes stale: every captured graph (a StepExecutor.invalidate predicate)."""
    return True


def step_token_budget(config: EngineConfig, model_config: Any, device: torch.device, dtype: torch.dtype) -> int:
    """`config.step_token_budget` where set, else the rule's (engine.core.step_budget) for this device and model."""
    if config.step_token_budget is not None:
        return config.step_token_budget
    rate = estimated_prefill_tok_s(matmul_flop_s(device, dtype), prefill_flops_per_token(model_config))
    return default_step_token_budget(rate, config.prefill_chunk_tokens)


def expert_cache_at_start(config: EngineConfig, lm: Any, bus: EventBus, peer: torch.device, streams: Streams,
                          on_resize: Any) -> Any:
    """An MoE model's expert cache at its start-up size (engine.exec.experts.setup), its store on the
    --peer-device card when one is given (`peer` is the compute device otherwise); None for a dense model.
    `on_resize`: drops the captured graphs (they read the old pools)."""
    if lm.config.moe is None:
        if config.expert_cache_mib is not None:
            raise ConfigError("expert_cache_mib", config.expert_cache_mib,
                              f"the checkpoint {config.model} has no MoE layers: there are no experts to cache")
        return None
    from engine.exec.experts.setup import start_expert_cache

    _, free_mib = device_memory_mib(lm.device)
    store = peer if peer != lm.device else None
    peer_free_mib = device_memory_mib(store)[1] if store is not None else 0.0
    return start_expert_cache(config.expert_cache_mib, lm.model, lm.device, bus, free_mib, config.vram_reserve_mib,
                              store, peer_free_mib, streams=streams, on_resize=on_resize)


def sized_kv_cache(config: EngineConfig, lm: Any, depth: int, streams: Streams,
                   **paging: Any) -> tuple[SlotKVCache, float]:
    """The slot KV cache for every slot's whole context (+ MTP layers), after the fit check; and weights MiB.
    `paging`: KV by use's needs (engine.exec.kv.paging.KVPaging: the bus, `take_memory`, `on_resize`)."""
    mcfg, model = lm.config, lm.model
    num_layers = mcfg.num_hidden_layers + (model.mtp_depth_layers if depth else 0)
    margin = max(pow2_bucket(config.prefill_chunk_tokens, MIN_CHUNK_TOKENS), 2 * depth + 2)
    geometry = KVGeometry(num_layers, config.batch, mcfg.num_key_value_heads, mcfg.head_dim, config.context, margin)
    weights_mib = model_bytes(model) / MIB
    _, free_mib = device_memory_mib(lm.device)
    if not config.kv_by_use():
        kv_mib = geometry.total_bytes(config.kv, lm.dtype) / MIB
        check_kv_fits(kv_mib, weights_mib, config.vram_reserve_mib, free_mib, "context", config.context)
        return SlotKVCache(geometry, config.kv, lm.dtype, lm.device), weights_mib
    # By use: every slot's resident window (--kv-resident; none by default), one scratch block, and a shared pool.
    # The pool starts at one slot's window (a forward of one slot always fits) and grows from the tier, then spills
    # to host memory. Without --kv-resident on a CPU it starts at one prompt chunk per slot instead and grows as
    # slots use it, up to what every slot's whole context would take: host memory is the tier's and the pool's
    # alike, so there is nothing to take from the tier first.
    resident = config.kv_resident or 0
    layout = geometry.layout(resident)
    pool_blocks = layout.window_blocks
    cpu_grows = lm.device.type == "cpu" and config.kv_resident is None
    block_mib = geometry.bytes_per_token(config.kv, lm.dtype) * geometry.block_tokens / MIB
    if cpu_grows:
        # every slot's whole context when that is small (a pool that never grows drops no graph), else
        # CPU_START_POOL_MIB or one prompt chunk per slot, whichever is more
        chunk_blocks = config.batch * -(-margin // layout.block_tokens)
        pool_blocks = min(config.batch * layout.window_blocks, max(chunk_blocks, int(CPU_START_POOL_MIB // block_mib)))
    kv_mib = layout.device_blocks(pool_blocks) * block_mib
    resident_tokens = layout.resident_blocks * layout.block_tokens
    name, value = ("kv_resident", config.kv_resident) if config.kv_resident is not None else ("context", config.context)
    check_kv_fits(kv_mib, weights_mib, config.vram_reserve_mib, free_mib, name, value,
                  needs=(f"{config.batch} slot{'s' if config.batch != 1 else ''} x {resident_tokens} resident "
                         f"tokens plus a shared pool of "
                         f"{pool_blocks * layout.block_tokens} tokens need"),
                  hint="lower --kv-resident, --context or --batch, use --kv int8, or lower --vram-reserve-mib")
    grow_limit_blocks = config.batch * layout.window_blocks if cpu_grows else 0
    # Layer-by-layer fetch waits where fetches are routine (a resident window per slot, the rest from the pool or
    # the host); without one a fetch only follows a spill, and a wait node in every step's graph costs more
    kv = SlotKVCache(geometry, config.kv, lm.dtype, lm.device, resident, pool_blocks, streams=streams,
                     grow_limit_blocks=grow_limit_blocks, layer_waits=config.kv_resident is not None, **paging)
    return kv, weights_mib


def tier_device_for(config: EngineConfig, device: torch.device) -> torch.device:
    """The compute device, or --peer-device (validated against the CUDA devices torch sees)."""
    if config.peer_device is None:
        return device
    peer = torch.device(config.peer_device)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type != "cuda" or peer.index is None or peer.index >= count or peer == device:
        raise ConfigError("peer_device", config.peer_device,
                          f"needs a second CUDA device besides the compute device {device}; torch sees {count}")
    return peer


def default_graphs(config: EngineConfig, bus: EventBus, board: SwitchBoard, make_room: Any,
                   streams: Streams) -> StepExecutor:
    """The graph cache on CUDA with --graphs (its OOM path gets room through `make_room`, i.e.
    VramBudget.make_room: what it frees stays free as headroom); else eager."""
    if not streams.cuda or not config.graphs:
        return EagerExecutor()
    from engine.exec.graphs.cache import GraphCache

    return GraphCache(streams.device, bus, board, release_tier=make_room, wait_polls=config.tier_wait_polls,
                      wait_interval_s=config.tier_wait_interval_s, switch_for_key=switch_for_key, streams=streams)


def shared_tier_blocks(board: SwitchBoard, bus: EventBus, kv: SlotKVCache, index: PrefixIndex, device: torch.device,
                       tier_device: torch.device, graphs: StepExecutor,
                       asked: bool = False) -> SharedTierBlocks | LedgerTierBlocks | None:
    """With SHARED_PREFIX on, the tier's blocks in the KV pool (a reused prefix shared by reference), where the
    compute device's kernels can read them: the tier on the compute device, every slot owning its context (no
    --kv-resident: its ledger owns the table), and tier blocks of whole pool blocks. Otherwise None: the tier
    copies (SHARED_PREFIX is then marked unavailable with the reason; a WARNING says so when it was asked for,
    not merely on by default)."""
    if not board.enabled(SHARED_SWITCH):
        return None
    why = ("the tier is on another device (--peer-device)" if tier_device != device
           else "--kv-resident's window blocks are fixed per slot"
           if kv.paging is not None and kv.paging.layout.resident_blocks
           else "tier blocks are not whole pool blocks" if index.block_tokens % kv.geometry.block_tokens else None)
    if why is not None:
        reason = f"{why}: reused prefixes are copied"
        board.mark_unavailable(SHARED_SWITCH, reason)
        if asked:
            bus.publish(WarningEvent(where="engine.exec.kv.tier_pool", message=f"SHARED_PREFIX is off: {reason}"))
        return None
    if kv.paging is not None:  # KV by use: the tier's blocks come from the slots' own pool (its growth drops graphs)
        return LedgerTierBlocks(kv, index.block_tokens)
    # the pool tensors reallocated: the graphs read the old ones' addresses
    return SharedTierBlocks(kv, index.block_tokens, on_resize=functools.partial(graphs.invalidate, every_graph))
