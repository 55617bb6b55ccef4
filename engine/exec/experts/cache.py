"""ExpertCache: routed experts in a per-layer pool of device slots, every expert once in a store: pinned host
memory, or the --peer-device card (`store_device`: the experts that do not fit the compute card live there and
a miss copies peer -> compute on the same side stream; tests on CPU pass the CPU as the "peer": the same path).

Each sparse layer (engine.model.moe.SparseMoE, `moe_index` i) owns a pool (engine.exec.experts.pool) of `slots`
experts on the device, `gate_up [slots + 1, 2I, H]` and `down [slots + 1, H, I]`, whose last row is a zero
*miss slot*, and a device table `table[i] [E]` (expert -> its slot, or the miss slot). The store holds every expert once
(`[E, 2I, H]`, `[E, H, I]`; pinned when it is host memory for a CUDA device), so a miss is one slice copy each
way, on a side stream.

Two forward paths, chosen by whether the stream is being captured into a CUDA graph:
- eager (CPU, prefill, graphs off, graph warm-ups): the routed ids come to the host, the layer's access is
  served group by group through the slot policy (LRU, or LRFU with the EXPERT_LFU switch; engine.exec.experts.trace),
  misses are copied in, and
  the experts run one by one in ascending order (so any budget gives the same sums as the all-resident run);
- captured (decode / verify under CUDA graphs): no host sync, misses counted on the device and served between
  steps (engine.exec.experts.captured, the cache's base).

The cache is a claimant in the VRAM books (engine.exec.kv.tier.VramBudget): `release(mib, reason)` shrinks every
pool (graph-capture out-of-memory recovery asks it after the tier), `set_budget` / `grow` regrow it, and each
change publishes an ExpertEvent; a resize reallocates the pools, so `on_resize` drops the captured graphs that read
the old ones (engine.exec.experts.sizing, the cache's other base). Telemetry bookkeeping (stats, events, oracle)
lives in engine.exec.experts.stats.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from engine.exec.experts.captured import CapturedExperts, stream_capturing
from engine.exec.experts.cold import COLD_MODES, CPU_MAX_TOKENS, predicted_ids, routed_on_host
from engine.exec.experts.pool import ExpertPool, expert_bytes
from engine.exec.experts.sizing import SizedExperts
from engine.exec.experts.stats import ExpertStats
from engine.exec.experts.trace import adopt, groups_of
from engine.exec.cuda_streams import Streams, required
from engine.snapshot import ExpertCacheSnapshot
from engine.model.moe import moe_index_of, routes_by_expert, sparse_blocks
from engine.model.moe_quant import quant_tensors
from engine.telemetry import EventBus

MIB = float(1 << 20)
MAX_STEP_ROWS = 1 << 16  # tokens one step may route (chunk buckets, verify rows): the valid-row mask's size
# experts copied in per event when a group misses (ExpertCache._stream_group): small enough that the first batch's
# compute starts early, large enough that a copy is not a handful of KiB (a seed-scale expert is 6 MiB)
COPY_BATCH_EXPERTS = 8


class ExpertCache(CapturedExperts, SizedExperts):
    """Per-layer expert pools behind the ExpertProvider seam of engine.model.moe (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, bus: EventBus, slots: int,
                 min_slots: int = 1, policy: str = "lru", store_device: torch.device | None = None,
                 streams: Streams | None = None, on_resize: Callable[[], None] | None = None) -> None:
        """`streams`: the engine's (engine.exec.cuda_streams), whose `expert_copy` stream the loads run on; needed on
        CUDA (None on a CPU, where a load copies in order). `on_resize`: drops the captured graphs (they read the
        old pools)."""
        self.blocks = sparse_blocks(model)
        if not self.blocks:
            raise ValueError("the model has no sparse MoE layers")
        self.device = device
        self.bus = bus
        on_cuda = device.type == "cuda"
        self.copy_stream = required(streams, device, "an expert cache").expert_copy if on_cuda else None
        self.peer = store_device  # None: the store is pinned host memory
        store = torch.device("cpu") if store_device is None else store_device
        moved: dict[int, torch.Tensor] = {}  # a shared store (synthetic sources) moves once for every layer
        self.pools = [ExpertPool(b, device, store, on_cuda and store.type == "cpu", moved) for b in self.blocks]
        # the store's own bytes: every expert once, or a shared store's distinct rows once
        distinct = {t.data_ptr(): t.numel() * t.element_size() for p in self.pools
                    for t in (p.store_gate_up, p.store_down, *quant_tensors(p.store_quant))}
        self.store_mib = sum(distinct.values()) / MIB
        first = self.pools[0]
        self.num_experts = first.num_experts
        self.top_k = self.blocks[0].top_k
        # each layer's expert as its pool holds it: layers may hold theirs in other forms (a GGUF file's down
        # projections in another type on some layers keep those layers' experts dequantized), so the books count
        # the layers' mean (mib_for is then exact) and a load its own layer's bytes
        self.layer_expert_mib = [expert_bytes(b) / MIB for b in self.blocks]
        self.expert_mib = sum(self.layer_expert_mib) / len(self.blocks)
        self.dtype = self.blocks[0].gate.weight.dtype  # the activations': what a dequantized expert computes in
        self.min_slots = max(1, min_slots)
        self.target_slots = self.num_experts  # what regrowth aims for (the configured budget)
        self.on_resize: Callable[[], None] = on_resize or (lambda: None)
        self.stats = ExpertStats(len(self.pools), self.num_experts, bus, str(device))
        n = len(self.pools)
        # Written by captured steps (engine.exec.experts.steps reads them between steps).
        self.dev_counts = torch.zeros(n, self.num_experts, dtype=torch.float32, device=device)
        self.dev_misses = torch.zeros(n, dtype=torch.float32, device=device)
        self.row_valid = torch.ones(MAX_STEP_ROWS, dtype=torch.bool, device=device)
        self.valid_rows: int | None = None  # rows covered by row_valid this step (None: all rows are real)
        # Which path a forward takes: the graph-safe one while a CUDA graph is being captured. Tests on CPU
        # point this at `lambda x: True` to run the captured path's logic eagerly; `force_eager` is the re-run.
        self.capturing: Callable[[torch.Tensor], bool] = stream_capturing
        self.force_eager = False
        self.served_this_step: set[int] = set()  # layers loaded between this step's replays (expert_steps)
        self.cold = "copy"  # how a miss is served: copy | cpu | prefetch (engine.exec.experts.cold; set_cold)
        config = getattr(model, "config", None)
        # the sparse blocks of the main stack (an MTP block follows the last one in another forward: not predicted)
        self.main_layers = n if config is None else sum(
            moe_index_of(config, layer) is not None for layer in range(config.num_hidden_layers))
        # prefetch under a CUDA graph: the experts each layer's next one would route to, counted on the device
        self.dev_predicted = torch.zeros(n, self.num_experts, dtype=torch.float32, device=device)
        self._predicted_misses = torch.zeros(1, dtype=torch.float32, device=device)
        # route counts read a step late (count_late): two pinned buffers in turn, and the one in flight
        self._late_buffers: list[torch.Tensor] = []
        self._late: tuple[torch.Tensor, torch.cuda.Event | None, int, str] | None = None
        for block in self.blocks:
            block.experts = torch.nn.ModuleList()  # the host store has them now: no second copy
            block.attach_provider(self)
        model.expert_provider = self  # engine_setup.release_device_memory closes it
        self.set_policy(policy)
        self._resize(self.clamp_slots(slots), "start")

    @property
    def policy(self) -> str:
        return self.pools[0].policy.name

    def set_policy(self, name: str) -> None:
        """Evict by `name` (`lru`, `lfu`) from now on; the residents stay where they are, so the device tables and
        the captured graphs reading them stay valid."""
        for pool in self.pools:
            pool.policy = adopt(pool.policy, name)

    def set_cold(self, mode: str) -> None:
        """Serve misses by `mode` (engine.exec.experts.cold.COLD_MODES); the captured graphs compute predictions
        only under prefetch, so they are dropped when the mode changes."""
        if mode not in COLD_MODES:
            raise ValueError(f"mode={mode!r}: expected one of {', '.join(COLD_MODES)}")
        if mode != self.cold:
            self.cold = mode
            self.on_resize()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copy_stream is None:
            dst.copy_(src)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # dst's memory may be in use
        with torch.cuda.stream(self.copy_stream):
            # peer -> compute: torch runs a cross-device copy on the peer's stream, fenced both ways with this one
            dst.copy_(src, non_blocking=True)
            if src.device == dst.device:  # an old pool about to be freed (the store lives as long as the cache)
                src.record_stream(self.copy_stream)

    def close(self) -> None:
        """Free the pools and the store (Engine.close), after publishing the last load / evict sums."""
        self.flush_late_counts()
        self.stats.publish_due(self.mib, self.slots, force=True, policy=self.policy)
        for pool in self.pools:
            pool.gate_up = pool.down = pool.table = torch.empty(0)
            pool.store_gate_up = pool.store_down = torch.empty(0)
            pool.quant = pool.store_quant = None
        for block in self.blocks:
            block.expert_store = block.expert_quant = None  # a shared store is freed with the pools

    # --- the provider seam ---------------------------------------------------------------------------------

    @torch.compiler.disable
    def moe_forward(self, moe_index: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H], ids / weights [N, k] (positions [N]: the next layer's router prior, for prefetch) -> [N, H]
        (see the module docstring for the two paths).

        Never traced by torch.compile (COMPILE): Dynamo would specialize on `capturing()`, False at the warm-up,
        and compile the captured path during the capture itself, which CUDA refuses ("operation not permitted
        when stream is capturing"), and an MoE engine under COMPILE would lose the switch or die."""
        if not self.force_eager and self.capturing(x):
            return self._captured_forward(moe_index, x, ids, weights, positions)
        return self._eager_forward(moe_index, x, ids, weights, positions)

    def _rows(self, n: int) -> torch.Tensor | None:
        """The real-row mask of a step's N tokens (padding rows route too, but need no expert), or None."""
        return self.row_valid[:n] if self.valid_rows == n else None

    def _eager_forward(self, i: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
        pool = self.pools[i]
        self.wait_pending(pool)
        N, k = ids.shape
        rows = self._rows(N)
        routes = routes_by_expert(ids, rows)  # the layer's host syncs, a few for all its experts
        experts = list(routes)  # ascending
        y = torch.zeros(N, k, x.shape[1], dtype=x.dtype, device=x.device)  # [N, k, H]: each route's product
        if i in self.served_this_step and all(pool.policy.resident(e) for e in experts):
            # loaded between this step's replays and recorded then: compute only (a second serve would
            # reorder the policy and count the access twice)
            pool.run_resident(y, x, ids, weights, rows, None)
            return y.sum(dim=1)
        tokens = N if rows is None else int(rows.sum())
        self.stats.record_access(i, experts, tokens)
        predict = self.cold == "prefetch"
        for group in groups_of(experts, pool.slots):
            result = pool.policy.serve(group)
            self.stats.record_group(i, result.hits, len(result.loads), len(result.evicted))
            if result.loads and self.cold != "cpu":
                self._stream_group(y, pool, i, x, ids, weights, rows, group, result,
                                   lambda: self._prefetch_next(i, x, positions, rows) if predict else None)
                predict = False
                continue
            # cpu: a miss with few tokens runs on the host while its copy goes behind the step (the layer's next
            # access waits for it); a miss with many (a prompt chunk's) is copied and waited for, as in copy mode
            cold = {e for e, _ in result.loads if routes[e][0].numel() <= CPU_MAX_TOKENS} \
                if self.cold == "cpu" else set()
            if result.loads:
                self._load(pool, result.loads, result.evicted, wait=len(cold) < len(result.loads), layer=i)
            if predict:  # once, after this layer's own loads: the layer does not wait for the next one's copies
                predict = False
                self._prefetch_next(i, x, positions, rows)
            on_device = [e for e in group if e not in cold]
            pool.run_resident(y, x, ids, weights, rows, None if len(on_device) == len(experts) else on_device)
            for e in sorted(cold):
                self.stats.host_runs += 1
                routed_on_host(y, x, weights, routes[e], *pool.host_weights(e, self.dtype))
        return y.sum(dim=1)

    def _stream_group(self, y: torch.Tensor, pool: ExpertPool, i: int, x: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, rows: torch.Tensor | None, group: list[int], result: Any,
                      then_prefetch: Callable[[], None]) -> None:
        """A group with misses: every copy queued on the side stream at once, in batches of COPY_BATCH_EXPERTS
        with an event each (then the next layer's prefetch behind them), while the compute stream runs the
        group's resident experts, then each batch once its copy is done: a batch's copy overlaps the compute of
        the residents and of the batches before it (a prompt window's layer, whose group copies dozens). Each
        route's product has its own row of `y`, so computing the group in parts gives the same sums."""
        batches = []
        for b in range(0, len(result.loads), COPY_BATCH_EXPERTS):
            part = result.loads[b:b + COPY_BATCH_EXPERTS]
            self._load(pool, part, result.evicted if b == 0 else [], wait=False, layer=i)
            batches.append((pool.pending, [e for e, _ in part]))
            pool.pending = None
        then_prefetch()
        copied = {e for e, _ in result.loads}
        pool.run_resident(y, x, ids, weights, rows, [e for e in group if e not in copied])
        for done, part in batches:
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
            pool.run_resident(y, x, ids, weights, rows, part)

    def _prefetch_next(self, i: int, x: torch.Tensor, positions: torch.Tensor | None,
                       rows: torch.Tensor | None) -> None:
        """Copy in, on the side stream, the experts layer i+1's gate picks for layer i's input (see cold.py)."""
        j = i + 1
        if j >= self.main_layers or (self.blocks[j].router_prior is not None and positions is None):
            return
        predicted = predicted_ids(self.blocks[j], x, positions)
        wanted = sorted(set((predicted if rows is None else predicted[rows]).flatten().tolist()))
        self.prefetch(j, wanted)

    def prefetch(self, j: int, experts: list[int]) -> None:
        """Bring layer j's `experts` (predicted, not yet asked for) into its pool behind the step: no access is
        recorded (the layer records its own when it runs), and at most the pool's slots are taken."""
        pool = self.pools[j]
        missing = [e for e in experts if not pool.policy.resident(e)][:pool.slots]
        if not missing:
            return
        result = pool.policy.serve(missing)
        self.stats.prefetched += len(result.loads)
        self._load(pool, result.loads, result.evicted, wait=False, layer=j)

    def wait_pending(self, pool: ExpertPool) -> None:
        """Make the compute stream wait for a copy into `pool` that went behind an earlier step."""
        if pool.pending is not None:
            torch.cuda.current_stream(self.device).wait_event(pool.pending)
            pool.pending = None

    def wait_all_pending(self) -> None:
        for pool in self.pools:
            self.wait_pending(pool)

    def _load(self, pool: ExpertPool, loads: list[tuple[int, int]], evicted: list[int], wait: bool = True, *,
              layer: int) -> None:
        """Copy `loads` (expert, slot) in from the store into `pool` (layer `layer`'s) on the side stream; `wait`:
        the compute stream waits for them now, else the pool's next reader does (ExpertPool.pending)."""
        start = end = None
        if self.copy_stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the evicted slots' last readers
            start.record(self.copy_stream)
        t0 = time.perf_counter()
        for e, slot in loads:
            pool.load(slot, e, self._copy)
        pool.set_table([(e, pool.slots) for e in evicted] + list(loads))
        if self.copy_stream is not None:
            end.record(self.copy_stream)
            if wait:
                torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            else:
                pool.pending = end
        self.stats.record_loads(layer, len(loads), len(loads) * self.layer_expert_mib[layer], (start, end),
                                time.perf_counter() - t0)

    def snapshot(self, oracle_max_age_s: float = 0.0) -> ExpertCacheSnapshot:
        """For /strata/state, the `expert` Prometheus series and the TUI panel (the oracle's rates may be up to
        `oracle_max_age_s` old: see ExpertStats.oracle)."""
        self.flush_late_counts(wait=False)
        return self.stats.snapshot(oracle_max_age_s, policy=self.policy, slots=self.slots,
                                   target_slots=self.target_slots, mib=self.mib, host_mib=self.host_mib,
                                   peer_mib=self.peer_mib, store_device=str(self.peer or "host"),
                                   expert_mib=self.expert_mib, all_experts_mib=self.all_experts_mib, top_k=self.top_k,
                                   cold=self.cold)
