"""Building an Engine's parts from an EngineConfig: model, KV cache sized against the VRAM budget, tier,
scheduler, runner and drafter. Separate from engine.py so the step loop reads on its own.

Memory is never silently overcommitted: the KV cache is sized from `--batch`, `--context` and `--kv`, and a
config whose KV does not fit next to the weights and the reserve raises ConfigError naming the numbers.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.model.quant.linear import is_quantized, model_bytes
from engine.errors import ConfigError, StrataError
from engine.exec.device_switches import settle_switches
from engine.exec.chunk_stream import CHUNK_OWNER, ChunkStream, chunk_sms_from_env, overlap_wanted
from engine.exec.streams import Streams
from engine.exec.decode_ahead import DecodeAhead, ahead_wanted
from engine.exec.executor import EagerExecutor
from engine.exec.gpu_errors import is_sticky, real_message, vram_free_mib
from engine.exec.kv.cache import KVGeometry, SlotKVCache
from engine.exec.kv.tier_ledger import LedgerTierBlocks
from engine.exec.kv.tier_pool import SharedTierBlocks
from engine.core.prefix_index import PrefixIndex
from engine.exec.runner import MIN_CHUNK_TOKENS, ModelRunner, pow2_bucket, switch_for_key
from engine.core.scheduler import DEFAULT_BLOCK_TOKENS, Scheduler
from engine.switches import SwitchBoard
from engine.telemetry import EngineEvent, EventBus, WarningEvent
from engine.exec.kv.tier import (CPU_TIER_DEFAULT_MIB, MIB, OWN_BLOCKS_RESERVE_FACTOR, AdaptiveTier, VramBudget,
                              check_kv_fits, device_memory_mib)


SHARED_SWITCH = "SHARED_PREFIX"
# KV by use on a CPU: the pool's size at start (when every slot's whole context is more); it grows as slots use it
CPU_START_POOL_MIB = 256.0


class StartupError(StrataError):
    """The engine could not be built: the stage, the real error, where in the engine it was raised, VRAM free."""

    def __init__(self, stage: str, exc: BaseException, vram_free: float | None) -> None:
        self.stage = stage
        self.where = innermost_engine_frame(exc)
        self.vram_free_mib = vram_free
        free = "" if vram_free is None else f"; vram free {vram_free:.0f} MiB"
        where = f" at {self.where}" if self.where else ""
        super().__init__(f"while {stage}: {real_message(exc)}{where}{free}")


def innermost_engine_frame(exc: BaseException) -> str | None:
    """`engine/file.py:line in function` of the deepest traceback frame inside this package, if any."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if _PACKAGE_DIR in path.parents:
            found = f"{path.relative_to(_PACKAGE_DIR.parent)}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return found


_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # engine/


@dataclass
class EngineParts:
    lm: Any
    kv: SlotKVCache
    tier: AdaptiveTier
    budgets: list[VramBudget]  # the compute device first; the --peer-device holding the tier second
    sched: Scheduler
    runner: ModelRunner
    drafter: Any
    board: SwitchBoard
    executor: Any
    device: torch.device
    streams: Streams  # every CUDA stream of the engine, and the lane of each launch (engine.exec.streams)
    chunks: ChunkStream | None  # prompt chunks beside the steps (--prefill-overlap)
    ahead: DecodeAhead  # the next greedy decode step launched early (--decode-ahead)


def build_parts(config: EngineConfig, bus: EventBus, executor: Any, tier_budget_mib: float | None,
                block_tokens: int | None) -> EngineParts:
    """Load the model and build everything around it (see the module docstring).

    A failure that is not already a StrataError (those name the option or file) is raised as StartupError
    naming the stage, the innermost engine frame and the VRAM free: a bare "CUDA error: out of memory" at
    start-up says none of that.
    """
    builder = _PartsBuilder(config, bus)
    try:
        return builder.build(executor, tier_budget_mib, block_tokens)
    except StrataError:
        raise
    except Exception as exc:
        if is_sticky(exc):
            raise
        raise StartupError(builder.stage, exc, vram_free_mib(config.device if config.device != "auto" else None)) \
            from exc


class _PartsBuilder:
    """Builds the parts in order, remembering the stage it is in (for StartupError) and the books once they
    exist (a graph capture's out-of-memory path asks them for room, but only after the tier is made)."""

    def __init__(self, config: EngineConfig, bus: EventBus) -> None:
        self.config = config
        self.bus = bus
        self.stage = "starting"
        self.budgets: list[VramBudget] | None = None
        self.experts: Any = None  # an MoE model's expert cache (engine.exec.experts.cache), built after the load
        self.device: torch.device | None = None
        self.tier_device: torch.device | None = None

    def make_room(self, mib: float, reason: str) -> float:
        """Room on the compute device from the tier, through the books, so what was freed stays free as
        headroom: a tier that regrew into it would make the next capture run out of memory again. Only a tier
        on the compute device can, and only once it exists (CAPTURE_ALL captures before it); the expert cache
        (MoE) is on the compute device from the start, so it can answer before the tier exists."""
        if self.budgets is None or self.tier_device != self.device:
            return self.experts.release(mib, reason) if self.experts is not None else 0.0
        return self.budgets[0].make_room(mib, reason)

    def build(self, executor: Any, tier_budget_mib: float | None, block_tokens: int | None) -> EngineParts:
        from engine.model import load_checkpoint, resolve_device

        config, bus = self.config, self.bus
        board = SwitchBoard.from_values(config.switches)
        # a bad --peer-device fails before the load
        self.tier_device = _tier_device(config, resolve_device(config.device))
        self.stage = f"loading the model {config.model}"
        # MoE: routed experts load to host memory; the expert cache gives them their device slots
        from engine.model.random_source import RANDOM_PREFIX, load_random

        load = load_random if config.model.startswith(RANDOM_PREFIX) else load_checkpoint  # random: drawn at load
        lm = load(config.model, dtype=config.dtype, device=config.device, expert_device="cpu",
                  quantize=None if config.quantize == "off" else config.quantize)
        device = self.device = lm.device
        model = lm.model
        if config.quantize_head:
            from engine.model.quant.rtn import quantize_head

            lm.weight_format = f"{lm.weight_format}, {quantize_head(model)}"
        # The one owner of the engine's streams: every component below that queues work off the current stream
        # takes its stream from here.
        overlap = overlap_wanted(config.prefill_overlap, device, moe=lm.config.moe is not None)
        streams = Streams(device, overlap, chunk_sms_from_env(os.environ) if overlap else None)
        if streams.note is not None:
            bus.publish(WarningEvent(where="engine.chunks", message=streams.note))
        if device.type == "cuda" and any(is_quantized(m) for m in model.modules()):
            from engine.model.quant.kernels import prepare  # Triton: CUDA only

            prepare(device)  # the quantized kernels' split counters exist before any graph capture
        if board.enabled("FUSED_PROJ"):
            model.fuse_projections()
        self.stage = "building the expert cache"
        experts = self.experts = _expert_cache(config, lm, bus, self.tier_device, streams)
        depth = 0
        if config.batch_mtp:
            if model.mtp is None:
                raise ConfigError("batch_mtp", True, f"the checkpoint {config.model} has no MTP head to draft with")
            depth = config.mtp_depth
        self.stage = "allocating the KV cache"
        kv, weights_mib = _sized_kv_cache(config, lm, depth, streams)
        settle_switches(board, bus, config, model, kv, has_experts=experts is not None)
        index = PrefixIndex(block_tokens or DEFAULT_BLOCK_TOKENS, 0)
        # The runner's and drafter's own buffers first: the tier then takes what is left after them, so the
        # reserve it leaves is really free (nothing allocated at start-up after it can find VRAM full).
        self.stage = "building the scheduler, runner and drafter"
        sched = Scheduler.from_config(config, index, draft_tokens=depth, eos_token_ids=tuple(lm.eos_token_ids))
        if executor is None:
            executor = _default_executor(config, bus, board, self.make_room, streams)
        if experts is not None:
            from engine.exec.experts.steps import ExpertStepExecutor, follow_policy_switch

            inner = executor
            experts.on_resize = lambda: inner.invalidate(lambda kind, key: True)  # graphs read the old pools
            executor = ExpertStepExecutor(inner, experts, kv.geometry.context_tokens)
        runner = ModelRunner(model, kv, executor, board, bus, device, config.batch, depth)
        if experts is not None:
            # prompt chunks with the fused chunk attention run on the runner's own eager executor: wrap it too, so
            # their padding rows load no expert and their accesses are counted as prefill steps
            runner._eager = ExpertStepExecutor(runner._eager, experts, kv.geometry.context_tokens)
            follow_policy_switch(experts, board)  # EXPERT_LFU set at start
            from engine.exec.experts.cold import cold_mode

            experts.set_cold(cold_mode(board))  # EXPERT_CPU / EXPERT_PREFETCH: how a miss is served
        runner.release_memory = self.make_room
        if kv.paging is not None and config.kv_resident is None:  # --kv-resident: spills make room, as documented
            paging, lookahead = kv.paging, runner.lookahead_tokens
            sched.admission_gate = lambda chunks, ends: paging.admission_wait(chunks, ends, lookahead)
        chunks = None
        if overlap:
            chunks = ChunkStream(streams)
            chunks.paging = kv.paging
            if kv.paging is not None:
                kv.paging.settle_held = chunks.settle
            runner.prefill_owner = CHUNK_OWNER
            sched.overlap_chunks = True
        runner.oom_release_mib = float(max(256, config.vram_reserve_mib))
        drafter = None
        if depth:
            from engine.exec.drafter import MtpDrafter

            drafter = MtpDrafter(runner, depth)
        if experts is not None:
            from engine.exec.experts.setup import grow_auto

            grow_auto(experts, config.expert_cache_mib, device_memory_mib(device)[1], config.vram_reserve_mib)
        if board.enabled("CAPTURE_ALL"):
            # Before the tier: the graphs take their pools from free memory, and the tier then takes the rest,
            # instead of every capture running out of memory against a full tier and evicting its siblings.
            self.stage = "capturing every graph bucket (CAPTURE_ALL)"
            precapture_all(config, bus, board, executor, runner, drafter)
        self.stage = "allocating the adaptive tier"
        shared = _shared_tier_blocks(board, bus, kv, index, device, self.tier_device, executor, runner,
                                     asked=bool(config.switches.get(SHARED_SWITCH)))
        # A preallocated tier in the KV pool reallocates the pool tensors the graphs captured above read: drop
        # them first, keep their measured size free for the tier's budget, and capture them again after it.
        recapture = shared is not None and self.tier_device.type == "cuda" and board.enabled("CAPTURE_ALL")
        graphs_mib = executor.snapshot().total_mib if recapture else 0.0
        if recapture:
            executor.release()
        tier, self.budgets = _tier_and_budgets(config, bus, kv, index, weights_mib, device, self.tier_device,
                                               tier_budget_mib, experts.peer_mib if experts is not None else 0.0,
                                               shared, keep_free_mib=graphs_mib)
        self.budgets[0].experts = experts
        if experts is not None:
            from engine.exec.experts.setup import AUTO

            self.budgets[0].experts_first = config.expert_cache_mib == AUTO  # the claimant that fills the card
        self.budgets[0].weight_format = lm.weight_format
        if recapture:
            self.stage = "capturing every graph bucket again (CAPTURE_ALL, after the tier joined the KV pool)"
            precapture_all(config, bus, board, executor, runner, drafter)
        if kv.paging is not None:
            _wire_paging(kv, bus, tier if self.tier_device == device else None, self.budgets[0], executor, runner)
        graphs = config.graphs and not isinstance(executor, EagerExecutor)
        may_miss = experts is not None and not experts.every_expert_resident
        ahead = DecodeAhead(runner, ahead_wanted(config.decode_ahead, device, graphs, moe=may_miss), drafter)
        return EngineParts(lm, kv, tier, self.budgets, sched, runner, drafter, board, executor, device, streams,
                           chunks, ahead)


def release_device_memory(executor: Any, tier: AdaptiveTier, kv: SlotKVCache, model: torch.nn.Module,
                          device: torch.device) -> None:
    """Free an engine's graphs, tier blocks, KV buffers and weights explicitly rather than by dropping the engine:
    a dropped engine's tier (it fills the GPU) is still held when the next engine of the same process checks its
    KV fit, which then sees about the reserve free."""
    executor.release()
    tier.close("engine closed")
    kv.free()
    experts = model.expert_provider  # an MoE model's expert cache: pools and host store
    if experts is not None:
        experts.close()
    model.to("meta")  # in place: the parameters' storage goes even where something still holds the module
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def precapture_all(config: EngineConfig, bus: EventBus, board: SwitchBoard, executor: Any, runner: ModelRunner,
                   drafter: Any) -> None:
    """CAPTURE_ALL: capture every decode/verify/drafter bucket before the first request.

    The buckets are the runner's and the drafter's `graph_specs()` (see there). A bucket that cannot be
    captured degrades CAPTURE_ALL (the rest are then captured lazily, as without the switch), never the
    engine; only a sticky CUDA error, which leaves the device unusable, propagates.
    """
    try:
        with torch.inference_mode():
            specs = runner.graph_specs(verify=drafter is None or not drafter.fused)
            if drafter is not None:
                specs += drafter.graph_specs(config.prefill_chunk_tokens)
            summary = executor.precapture(specs)
    except Exception as exc:  # noqa: BLE001 - a failed warm-up costs the switch, not the engine
        if is_sticky(exc):
            raise
        board.degrade("CAPTURE_ALL", f"precapture: {real_message(exc)}", bus, where="engine.exec.graphs.cache")
        return
    if summary is None:
        bus.publish(WarningEvent(where="engine.exec.graphs.cache", message=(
            f"CAPTURE_ALL is on but {type(executor).__name__} captures no graphs (CPU or --no-graphs): "
            "every step runs eagerly")))
        return
    # An executor handed in from outside may keep its own switch board: the engine's must show the degrade.
    theirs = getattr(executor, "board", board)
    if theirs is not board and theirs.states["CAPTURE_ALL"].degraded and board.enabled("CAPTURE_ALL"):
        board.degrade("CAPTURE_ALL", theirs.states["CAPTURE_ALL"].reason)
    bus.publish(EngineEvent(state="loading", detail=(
        f"CAPTURE_ALL: {summary['captured']} of {len(specs)} graphs captured, {summary['total_mib']:.0f} MiB, "
        f"{summary['ms']:.0f} ms")))


def _expert_cache(config: EngineConfig, lm: Any, bus: EventBus, peer: torch.device, streams: Streams) -> Any:
    """An MoE model's expert cache at its start-up size (engine.exec.experts.setup), its store on the
    --peer-device card when one is given (`peer` is the compute device otherwise); None for a dense model."""
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
                              store, peer_free_mib, streams=streams)


def _sized_kv_cache(config: EngineConfig, lm: Any, depth: int, streams: Streams) -> tuple[SlotKVCache, float]:
    """The slot KV cache for every slot's whole context (+ MTP layers), after the fit check; and weights MiB."""
    mcfg, model = lm.config, lm.model
    num_layers = mcfg.num_hidden_layers + (model.mtp_depth_layers if depth else 0)
    margin = max(pow2_bucket(config.prefill_chunk_tokens, MIN_CHUNK_TOKENS), 2 * depth + 2)
    geometry = KVGeometry(num_layers, config.batch, mcfg.num_key_value_heads, mcfg.head_dim, config.context, margin)
    weights_mib = model_bytes(model) / MIB
    _, free_mib = device_memory_mib(lm.device)
    if not config.kv_by_use(lm.device.type):
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
    kv = SlotKVCache(geometry, config.kv, lm.dtype, lm.device, resident, pool_blocks, streams=streams)
    if cpu_grows:
        kv.paging.grow_limit_blocks = config.batch * layout.window_blocks
    return kv, weights_mib


def _wire_paging(kv: SlotKVCache, bus: EventBus, tier: AdaptiveTier | None, budget: VramBudget, executor: Any,
                 runner: ModelRunner) -> None:
    """--kv-resident: the pool asks the tier (on this device) for memory first, and a pool that grew drops the
    captured graphs (they read the old pool tensors) and updates the books' KV figure."""
    paging = kv.paging
    paging.bus = bus
    budget.kv_paging = paging
    if tier is not None:
        paging.take_memory = tier.release

    def resized() -> None:
        for ex in (executor, runner._eager):
            ex.invalidate(lambda kind, key: True)
        budget.kv_mib = kv.mib

    paging.on_resize = resized


def _shared_tier_blocks(board: SwitchBoard, bus: EventBus, kv: SlotKVCache, index: PrefixIndex, device: torch.device,
                        tier_device: torch.device, executor: Any, runner: ModelRunner,
                        asked: bool = False) -> SharedTierBlocks | None:
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
    if kv.paging is not None:  # KV by use: the tier's blocks come from the slots' own pool
        return LedgerTierBlocks(kv, index.block_tokens)
    shared = SharedTierBlocks(kv, index.block_tokens)

    def resized() -> None:  # the pool tensors were reallocated: graphs read the old ones' addresses
        for ex in (executor, runner._eager):
            ex.invalidate(lambda kind, key: True)

    shared.on_resize = resized
    return shared


def _tier_and_budgets(config: EngineConfig, bus: EventBus, kv: SlotKVCache, index: PrefixIndex, weights_mib: float,
                      device: torch.device, tier_device: torch.device, tier_budget_mib: float | None,
                      peer_weights_mib: float = 0.0, shared: SharedTierBlocks | None = None,
                      keep_free_mib: float = 0.0) -> tuple[AdaptiveTier, list[VramBudget]]:
    """The adaptive tier (on the compute device or --peer-device) and the per-device books (an MoE model's
    expert store on the peer counts as its weights: `peer_weights_mib`). `keep_free_mib`: memory the tier's
    default budget leaves free beyond the reserve (graphs to be captured again right after it)."""
    budgets = [VramBudget(device, float(config.vram_reserve_mib), weights_mib, kv.mib)]
    if tier_device != device:  # --peer-device: the prefix-cache tier (and an MoE expert store) on the second GPU
        budgets.append(VramBudget(tier_device, float(config.vram_reserve_mib), peer_weights_mib, 0.0))
    if tier_budget_mib is None:
        _, free_mib = device_memory_mib(tier_device)
        if tier_device.type == "cuda":
            tier_budget_mib = max(0.0, free_mib - config.vram_reserve_mib - keep_free_mib)  # all of it, up front
        else:
            tier_budget_mib = min(CPU_TIER_DEFAULT_MIB, free_mib / 8)
    on_gpu = tier_device.type == "cuda"
    own_mib = OWN_BLOCKS_RESERVE_FACTOR * max(float(config.vram_reserve_mib), 1024.0)
    tier = AdaptiveTier(index, kv, bus, tier_device, tier_budget_mib, preallocate=on_gpu,
                        room_mib=budgets[-1].driver_room_mib if on_gpu else None, shared=shared,
                        pooled_mib=max(0.0, tier_budget_mib - own_mib) if on_gpu else None)
    budgets[-1].tier = tier
    return tier, budgets


def _tier_device(config: EngineConfig, device: torch.device) -> torch.device:
    """The compute device, or --peer-device (validated against the CUDA devices torch sees)."""
    if config.peer_device is None:
        return device
    peer = torch.device(config.peer_device)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type != "cuda" or peer.index is None or peer.index >= count or peer == device:
        raise ConfigError("peer_device", config.peer_device,
                          f"needs a second CUDA device besides the compute device {device}; torch sees {count}")
    return peer


def _default_executor(config: EngineConfig, bus: EventBus, board: SwitchBoard, release: Any,
                      streams: Streams) -> Any:
    """The graph cache on CUDA with --graphs (its OOM path shrinks the tier through `release`, i.e.
    VramBudget.make_room: what it frees stays free as headroom); else eager."""
    if not streams.cuda or not config.graphs:
        return EagerExecutor()
    from engine.exec.graphs.cache import GraphCache

    return GraphCache(streams.device, bus, board, release_tier=release, wait_polls=config.tier_wait_polls,
                      wait_interval_s=config.tier_wait_interval_s, switch_for_key=switch_for_key, streams=streams)
