"""Building an Engine's parts from an EngineConfig, in stages, each part handed what it needs when it is made (a
part made on its own from the config and the device comes from engine.orchestration.part_makers):

1. load: the model on its device, the CUDA streams (engine.exec.cuda_streams), the step executor (the graph
   cache on CUDA, else eager) and, for an MoE model, the expert cache;
2. KV: the cache sized from `--batch`, `--context` and `--kv` against the free memory (a config whose KV does not
   fit next to the weights and the reserve raises ConfigError naming the numbers: memory is never silently
   overcommitted);
3. executors: scheduler, runner, MTP drafter, prompt chunks beside the steps, the step launched ahead;
4. graphs: CAPTURE_ALL captures every bucket now, before the tier, so the graph pools take free memory first;
5. tier: the prefix cache, the per-device books, and the PlanExecutor that joins them all (graphs captured again
   when the tier's blocks reallocated the KV pool).

Two needs point forward, to parts made later: a KV pool growth takes memory from the tier, and a step or capture
that ran out of memory asks the books for room. Those get a method of the builder (`_tier_release`,
`make_room`), which answers once the part exists.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.prefix_index import PrefixIndex
from engine.core.scheduler import DEFAULT_BLOCK_TOKENS, Scheduler
from engine.errors import ConfigError, StrataError
from engine.exec.chunk_stream import ChunkStream, chunk_sms_from_env, overlap_wanted
from engine.exec.cuda_streams import Streams
from engine.exec.decode_ahead import DecodeAhead, ahead_wanted
from engine.exec.device_switches import settle_switches
from engine.exec.gpu_errors import is_sticky, real_message, vram_free_mib
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.tier import CPU_TIER_DEFAULT_MIB, OWN_BLOCKS_RESERVE_FACTOR, AdaptiveTier
from engine.exec.kv.vram_budget import DeviceRoom, VramBudget, device_memory_mib
from engine.exec.plan_executor import PlanExecutor
from engine.exec.runner import ModelRunner
from engine.exec.step_fns import EagerExecutor, StepExecutor
from engine.model.quant.linear import is_quantized
from engine.orchestration.part_makers import (SHARED_SWITCH, default_graphs, every_graph, expert_cache_at_start,
                                              shared_tier_blocks, sized_kv_cache, step_token_budget,
                                              tier_device_for)
from engine.switches import SwitchBoard
from engine.telemetry import EngineEvent, EventBus, WarningEvent


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
    graphs: StepExecutor  # the graph cache (eager where there are no graphs), as the runner runs its steps
    executor: PlanExecutor  # runs each step's plan
    device: torch.device
    streams: Streams  # every CUDA stream of the engine, and the lane of each launch (engine.exec.cuda_streams)
    chunks: ChunkStream | None  # prompt chunks beside the steps (--prefill-overlap)
    ahead: DecodeAhead  # the next greedy decode step launched early (--decode-ahead)


def build_parts(config: EngineConfig, bus: EventBus, graphs: StepExecutor | None, tier_budget_mib: float | None,
                block_tokens: int | None) -> EngineParts:
    """Load the model and build everything around it (see the module docstring); `graphs`: a step executor of
    the caller's instead of the default one.

    A failure that is not already a StrataError (those name the option or file) is raised as StartupError
    naming the stage, the innermost engine frame and the VRAM free: a bare "CUDA error: out of memory" at
    start-up says none of that.
    """
    builder = _PartsBuilder(config, bus)
    try:
        return builder.build(graphs, tier_budget_mib, block_tokens)
    except StrataError:
        raise
    except Exception as exc:
        if is_sticky(exc):
            raise
        raise StartupError(builder.stage, exc, vram_free_mib(config.device if config.device != "auto" else None)) \
            from exc


@dataclass
class _Executors:
    """What the executors stage makes."""

    sched: Scheduler
    runner: ModelRunner
    drafter: Any
    chunks: ChunkStream | None
    ahead: DecodeAhead


class _PartsBuilder:
    """Builds the parts stage by stage, remembering the stage it is in (for StartupError) and the parts that a
    forward need reaches (the tier, the books, the expert cache) once they exist."""

    def __init__(self, config: EngineConfig, bus: EventBus) -> None:
        self.config = config
        self.bus = bus
        self.stage = "starting"
        self.board = SwitchBoard.from_values(config.switches)
        self.device: torch.device | None = None
        self.tier_device: torch.device | None = None
        self.experts: Any = None  # an MoE model's expert cache (engine.exec.experts.cache), made at the load
        self.tier: AdaptiveTier | None = None
        self.budgets: list[VramBudget] | None = None

    # --- the forward needs ---------------------------------------------------------------------------------

    def make_room(self, mib: float, reason: str) -> float:
        """Room on the compute device from the tier, through the books, so what was freed stays free as
        headroom: a tier that regrew into it would make the next capture run out of memory again. Only a tier
        on the compute device can, and only once it exists (CAPTURE_ALL captures before it); the expert cache
        (MoE) is on the compute device from the start, so it can answer before the tier exists."""
        if self.budgets is None or self.tier_device != self.device:
            return self.experts.release(mib, reason) if self.experts is not None else 0.0
        return self.budgets[0].make_room(mib, reason)

    def _tier_release(self, mib: float, reason: str) -> float:
        """A KV pool short of blocks asks the tier on the compute device first (none before the tier exists):
        its blocks in the pool, then memory the pool grows into."""
        if self.tier is None or self.tier_device != self.device:
            return 0.0
        return self.tier.release(mib, reason, pool_first=True)

    def _tier_take_lent(self, blocks: int, slots: list[int], reason: str) -> int:
        """A KV pool with no block free or spillable takes back the tier's blocks those slots alone map."""
        if self.tier is None or self.tier_device != self.device:
            return 0
        return self.tier.take_lent(blocks, slots, reason)

    # --- the stages ----------------------------------------------------------------------------------------

    def build(self, graphs: StepExecutor | None, tier_budget_mib: float | None,
              block_tokens: int | None) -> EngineParts:
        config, bus, board = self.config, self.bus, self.board
        lm, streams, graphs = self._load(graphs)
        self.stage = "allocating the KV cache"
        depth = config.mtp_depth if config.batch_mtp else 0
        kv, weights_mib = sized_kv_cache(config, lm, depth, streams, bus=bus, take_memory=self._tier_release,
                                         take_lent=self._tier_take_lent,
                                         on_resize=functools.partial(self._kv_pool_resized, graphs))
        settle_switches(board, bus, config, lm.model, kv, has_experts=self.experts is not None)
        index = PrefixIndex(block_tokens or DEFAULT_BLOCK_TOKENS, 0)
        # The runner's and drafter's own buffers first: the tier then takes what is left after them, so the
        # reserve it leaves is really free (nothing allocated at start-up after it can find VRAM full).
        self.stage = "building the scheduler, runner and drafter"
        graphs, eager = self._expert_steps(graphs, kv)
        ex = self._executors(lm, kv, index, streams, graphs, eager, depth)
        if board.enabled("CAPTURE_ALL"):
            # Before the tier: the graphs take their pools from free memory, and the tier then takes the rest,
            # instead of every capture running out of memory against a full tier and evicting its siblings.
            self.stage = "capturing every graph bucket (CAPTURE_ALL)"
            precapture_all(config, bus, board, graphs, ex.runner, ex.drafter)
        self.stage = "allocating the adaptive tier"
        tier, budgets, recapture = self._tier(lm, kv, index, graphs, weights_mib, tier_budget_mib)
        if recapture:
            self.stage = "capturing every graph bucket again (CAPTURE_ALL, after the tier joined the KV pool)"
            precapture_all(config, bus, board, graphs, ex.runner, ex.drafter)
        window = None
        if self.experts is not None and config.prefill_window_tokens:
            from engine.exec.prefill_window import PrefillWindow

            window = PrefillWindow(ex.runner, eager, self.experts, config.prefill_window_tokens,
                                   config.prefill_chunk_tokens)
        executor = PlanExecutor(runner=ex.runner, drafter=ex.drafter, kv=kv, tier=tier, streams=streams,
                                chunks=ex.chunks, ahead=ex.ahead, graphs=graphs, device=lm.device, bus=bus,
                                window=window, rows_max_tokens=ex.sched.step_token_budget)
        return EngineParts(lm, kv, tier, budgets, ex.sched, ex.runner, ex.drafter, board, graphs, executor,
                           lm.device, streams, ex.chunks, ex.ahead)

    def _load(self, graphs: StepExecutor | None) -> tuple[Any, Streams, StepExecutor]:
        """The model on its device, the engine's streams, the step executor, the expert cache (MoE)."""
        from engine.model import load_checkpoint, resolve_device
        from engine.model.random_source import RANDOM_PREFIX, load_random

        config, bus, board = self.config, self.bus, self.board
        self.tier_device = tier_device_for(config, resolve_device(config.device))  # a bad --peer-device fails first
        self.stage = f"loading the model {config.model}"
        load = load_random if config.model.startswith(RANDOM_PREFIX) else load_checkpoint  # random: drawn at load
        # MoE: routed experts load to host memory; the expert cache gives them their device slots
        lm = load(config.model, dtype=config.dtype, device=config.device, expert_device="cpu",
                  quantize=None if config.quantize == "off" else config.quantize)
        self.device = lm.device
        model = lm.model
        if config.quantize_head:  # the head in FP8 too: a model the loader made, its format text a new record
            from engine.model.quant.rtn import quantize_head

            lm = dataclasses.replace(lm, weight_format=f"{lm.weight_format}, {quantize_head(model)}")
        if config.batch_mtp and model.mtp is None:
            raise ConfigError("batch_mtp", True, f"the checkpoint {config.model} has no MTP head to draft with")
        # The one owner of the engine's streams: every component below that queues work off the current stream
        # takes its stream from here.
        overlap = overlap_wanted(config.prefill_overlap, lm.device, moe=lm.config.moe is not None)
        streams = Streams(lm.device, overlap, chunk_sms_from_env(os.environ) if overlap else None)
        if streams.note is not None:
            bus.publish(WarningEvent(where="engine.chunks", message=streams.note))
        if board.enabled("FUSED_PROJ"):
            model.fuse_projections()
        quantized_on_gpu = lm.device.type == "cuda" and any(is_quantized(m) for m in model.modules())
        if config.int4_decode != "strata" and not quantized_on_gpu:  # the CPU's products are dequantize + matmul
            raise ConfigError("int4_decode", config.int4_decode, "picks the kernel of quantized weights on CUDA")
        if quantized_on_gpu:
            from engine.model.quant.kernels import prepare  # Triton: CUDA only

            # the split counters and tinygemm's packs exist before any graph capture and before the KV is sized
            prepare(lm.device, model, lm.dtype, config.int4_decode)
            if config.int4_decode == "tinygemm":  # the books say which kernel decodes (strata-tui shows them)
                lm = dataclasses.replace(lm, weight_format=f"{lm.weight_format}, int4 decode on tinygemm")
        if graphs is None:
            graphs = default_graphs(config, bus, board, self.make_room, streams)
        self.stage = "building the expert cache"
        self.experts = expert_cache_at_start(config, lm, bus, self.tier_device, streams,
                                             on_resize=functools.partial(graphs.invalidate, every_graph))
        return lm, streams, graphs

    def _expert_steps(self, graphs: StepExecutor, kv: SlotKVCache) -> tuple[StepExecutor, StepExecutor]:
        """The step executors the runner takes: the graphs, and the eager one of prompt chunks with the fused chunk
        attention; for an MoE model both wrapped in the expert cache's steps (their padding rows load no expert,
        and their accesses are counted: engine.exec.experts.steps)."""
        eager: StepExecutor = EagerExecutor()
        experts = self.experts
        if experts is None:
            return graphs, eager
        from engine.exec.experts.cold import cold_mode
        from engine.exec.experts.steps import ExpertStepExecutor, follow_policy_switch

        follow_policy_switch(experts, self.board)  # EXPERT_LFU set at start
        experts.set_cold(cold_mode(self.board))  # EXPERT_CPU / EXPERT_PREFETCH: how a miss is served
        context_tokens = kv.geometry.context_tokens
        return ExpertStepExecutor(graphs, experts, context_tokens), ExpertStepExecutor(eager, experts, context_tokens)

    def _executors(self, lm: Any, kv: SlotKVCache, index: PrefixIndex, streams: Streams, graphs: StepExecutor,
                   eager: StepExecutor, depth: int) -> _Executors:
        """Scheduler, runner, drafter, the chunks beside the steps and the step launched ahead."""
        config, experts = self.config, self.experts
        overlap = streams.overlap
        runner = ModelRunner(lm.model, kv, graphs, self.board, self.bus, lm.device, config.batch, depth, eager=eager,
                             release_memory=self.make_room,
                             oom_release_mib=float(max(256, config.vram_reserve_mib)))
        gate = None
        if kv.paging is not None and config.kv_resident is None:  # --kv-resident: spills make room, as documented
            gate = functools.partial(kv.paging.admission_wait, lookahead_tokens=runner.lookahead_tokens)
        budget = step_token_budget(config, lm.config, lm.device, lm.dtype)
        sched = Scheduler.from_config(config, index, budget, draft_tokens=depth, eos_token_ids=tuple(lm.eos_token_ids),
                                      overlap_chunks=overlap, admission_gate=gate)
        chunks = ChunkStream(streams, paging=kv.paging) if overlap else None
        drafter = None
        if depth:
            from engine.exec.drafter import MtpDrafter

            drafter = MtpDrafter(runner, depth)
        if experts is not None:
            from engine.exec.experts.setup import grow_auto

            grow_auto(experts, config.expert_cache_mib, device_memory_mib(lm.device)[1], config.vram_reserve_mib)
        uses_graphs = config.graphs and not isinstance(graphs, EagerExecutor)
        may_miss = experts is not None and not experts.every_expert_resident  # a replay must then be checked
        ahead = DecodeAhead(runner, ahead_wanted(config.decode_ahead, lm.device, uses_graphs, moe=may_miss), drafter)
        return _Executors(sched, runner, drafter, chunks, ahead)

    def _tier(self, lm: Any, kv: SlotKVCache, index: PrefixIndex, graphs: StepExecutor, weights_mib: float,
              tier_budget_mib: float | None) -> tuple[AdaptiveTier, list[VramBudget], bool]:
        """The adaptive tier (on the compute device or --peer-device), the per-device books (an MoE model's
        expert store on the peer counts as its weights), and whether the graphs must be captured again."""
        config, bus, device, tier_device = self.config, self.bus, lm.device, self.tier_device
        shared = shared_tier_blocks(self.board, bus, kv, index, device, tier_device, graphs,
                                    asked=bool(config.switches.get(SHARED_SWITCH)))
        # A preallocated tier in the KV pool reallocates the pool tensors the graphs captured above read: drop
        # them first, keep their measured size free for the tier's budget, and capture them again after it.
        recapture = shared is not None and tier_device.type == "cuda" and self.board.enabled("CAPTURE_ALL")
        keep_free_mib = graphs.snapshot().total_mib if recapture else 0.0
        if recapture:
            graphs.release()
        reserve_mib = float(config.vram_reserve_mib)
        rooms = [DeviceRoom(device, reserve_mib)]
        if tier_device != device:  # --peer-device: the prefix-cache tier (and an MoE expert store) on the second GPU
            rooms.append(DeviceRoom(tier_device, reserve_mib))
        if tier_budget_mib is None:
            _, free_mib = device_memory_mib(tier_device)
            if tier_device.type == "cuda":
                tier_budget_mib = max(0.0, free_mib - reserve_mib - keep_free_mib)  # all of it, up front
            else:
                tier_budget_mib = min(CPU_TIER_DEFAULT_MIB, free_mib / 8)
        on_gpu = tier_device.type == "cuda"
        own_mib = OWN_BLOCKS_RESERVE_FACTOR * max(reserve_mib, 1024.0)
        kv_mib = kv.mib  # the books count the slots' KV; a tier's blocks in the pool are the tier's
        tier = self.tier = AdaptiveTier(
            index, kv, bus, tier_device, tier_budget_mib, preallocate=on_gpu,
            room_mib=rooms[-1].driver_room_mib if on_gpu else None, shared=shared,
            pooled_mib=max(0.0, tier_budget_mib - own_mib) if on_gpu else None)
        experts = self.experts
        experts_first = False  # --expert-cache-mib auto: the claimant that fills the card gives first
        if experts is not None:
            from engine.exec.experts.setup import AUTO

            experts_first = config.expert_cache_mib == AUTO
        budgets = [VramBudget(device, weights_mib=weights_mib, kv_mib=kv_mib, room=rooms[0],
                              tier=tier if tier_device == device else None, experts=experts,
                              experts_first=experts_first, kv_paging=kv.paging, weight_format=lm.weight_format)]
        if tier_device != device:
            budgets.append(VramBudget(tier_device, weights_mib=experts.peer_mib if experts is not None else 0.0,
                                      room=rooms[1], tier=tier))
        self.budgets = budgets
        return tier, budgets, recapture

    def _kv_pool_resized(self, graphs: StepExecutor) -> None:
        """A KV pool growth (KV by use) reallocated the pool tensors: the captured graphs read the old ones, and the
        books' KV figure follows the pool (once the books exist)."""
        graphs.invalidate(every_graph)
        if self.budgets is not None:
            self.budgets[0].kv_pool_resized()


def release_device_memory(graphs: StepExecutor, tier: AdaptiveTier, kv: SlotKVCache, model: torch.nn.Module,
                          device: torch.device) -> None:
    """Free an engine's graphs, tier blocks, KV buffers and weights explicitly rather than by dropping the engine:
    a dropped engine's tier (it fills the GPU) is still held when the next engine of the same process checks its
    KV fit, which then sees about the reserve free."""
    graphs.release()
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
