"""The captured path of the expert cache (engine.exec.experts.cache.ExpertCache, whose base this is): a decode or
verify step under a CUDA graph, and what is done with its counts between steps.

Captured, a forward has no host sync: `slots = table[ids]`, the experts' weights are gathered from the pool, and a
miss (a real row routed to the miss slot) is counted on the device. Between steps, ExpertStepExecutor
(engine.exec.experts.steps) reads the counts: no miss, the replay stands and the routed experts are touched; a
miss, the first missed layer's experts are loaded (`serve_captured_layer`) and the graph replayed again (a few
times at most), or the step is run again eagerly, which loads what it needs. With every expert resident no route
can miss, so the counts are read a step late (`count_late`), behind the next step's compute.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from engine.exec.experts.cold import predicted_ids
from engine.exec.experts.pool import ExpertPool
from engine.exec.experts.stats import ExpertStats
from engine.exec.experts.trace import groups_of
from engine.model.moe_kernels import routed_experts
from engine.model.moe_route import slots_and_counts


def stream_capturing(x: torch.Tensor) -> bool:
    """Whether `x`'s stream is being captured into a CUDA graph: the forward must then take the captured path."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class CapturedExperts:
    """The captured path's methods; what they read is the cache's own (ExpertCache.__init__ makes it)."""

    pools: list[ExpertPool]
    blocks: list
    stats: ExpertStats
    device: torch.device
    top_k: int
    main_layers: int
    cold: str
    force_eager: bool
    served_this_step: set[int]
    dev_counts: torch.Tensor  # [L, E] routes per expert, counted by captured steps
    dev_misses: torch.Tensor  # [L] routes to the miss slot
    dev_predicted: torch.Tensor  # [L, E] prefetch predictions
    _predicted_misses: torch.Tensor
    _late_buffers: list[torch.Tensor]
    _late: tuple[torch.Tensor, torch.cuda.Event | None, int, str] | None
    _rows: Callable[[int], torch.Tensor | None]
    _load: Callable[..., None]

    def _captured_forward(self, i: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
        """Graph-safe: no host sync, static shapes. Misses read the zero slot and are counted for a re-run."""
        pool = self.pools[i]
        rows = self._rows(ids.shape[0])
        # slots [N, k] (padding rows -1: no expert's weights read for them); misses and route counts on the device
        slots = slots_and_counts(ids, pool.table, pool.slots, rows, self.dev_counts[i], self.dev_misses[i:i + 1])
        j = i + 1
        if self.cold == "prefetch" and j < self.main_layers and (
                self.blocks[j].router_prior is None or positions is not None):
            predicted = predicted_ids(self.blocks[j], x, positions)  # [N, k] layer j's likely experts
            nxt = self.pools[j]  # its predicted experts counted as the layer's own routes are (misses unread)
            slots_and_counts(predicted, nxt.table, nxt.slots, rows, self.dev_predicted[j], self._predicted_misses)
        return routed_experts(x, pool.gate_up, pool.down, slots, weights, quant=pool.quant).sum(dim=1)

    def serve_captured_layer(self, i: int, experts: list[int], tokens: int) -> None:
        """Load what a captured step's *first* missed layer routed to (its routing is right: every layer before
        it hit), so the step can be replayed again; len(experts) <= slots. Recorded as that layer's access."""
        pool = self.pools[i]
        self.stats.record_access(i, experts, tokens)
        result = pool.policy.serve(experts)
        self.stats.record_group(i, result.hits, len(result.loads), len(result.evicted))
        if result.loads:
            self._load(pool, result.loads, result.evicted, layer=i)
        self.served_this_step.add(i)

    def touch_captured(self, counts: np.ndarray, step: int | None = None, kind: str | None = None) -> None:
        """A captured step that hit everywhere: record its accesses and refresh the policy's recency and counts
        (layers served between its replays are recorded already). counts [L, E]: its routes per expert; `step`
        and `kind`: the step's, when its counters are read a step late (ExpertStepExecutor)."""
        for i in np.flatnonzero(counts.any(axis=1)).tolist():
            if i in self.served_this_step:
                continue
            row = counts[i]
            experts = np.flatnonzero(row).tolist()
            pool = self.pools[i]
            self.stats.record_access(i, experts, int(row.sum()) // self.top_k, step, kind)
            for group in groups_of(experts, pool.slots):
                result = pool.policy.serve(group)  # all resident: hits only, nothing moves
                self.stats.record_group(i, result.hits, len(result.loads), len(result.evicted))

    # --- a captured step's counters read a step late ------------------------------------------------------

    @property
    def every_expert_resident(self) -> bool:
        """Every pool holds every expert: no route can miss."""
        return all(pool.slots >= pool.num_experts for pool in self.pools)

    def counts_late_ok(self) -> bool:
        """Whether a step stands unchecked: every expert resident (no route can miss) and no prefetch
        predictions to read."""
        return self.cold != "prefetch" and not self.force_eager and self.every_expert_resident

    def count_late(self) -> None:
        """Copy this step's route counts to host memory behind it (pinned, on CUDA) and clear them; record the
        step before's, whose copy is long done (the host read that step's tokens since), while this one
        computes."""
        on_cuda = self.device.type == "cuda"
        if not self._late_buffers:
            self._late_buffers = [torch.empty(self.dev_counts.shape, pin_memory=on_cuda) for _ in range(2)]
        buffer = self._late_buffers[self.stats.steps % 2]
        buffer.copy_(self.dev_counts, non_blocking=on_cuda)
        done = None
        if on_cuda:
            done = torch.cuda.Event()
            done.record()
        self.dev_counts.zero_()
        self.dev_misses.zero_()  # nothing can miss; cleared all the same, for the next checked step
        before, self._late = self._late, (buffer, done, self.stats.steps, self.stats.step_kind)
        if before is not None:
            self._record_late(before)

    def flush_late_counts(self, wait: bool = True) -> None:
        """Record the counts still in flight (before a checked step or a close; a snapshot passes wait=False and
        takes them only when their copy is done, so it never waits for a step in flight)."""
        if self._late is not None and (wait or self._late[1] is None or self._late[1].query()):
            before, self._late = self._late, None
            self._record_late(before)

    def _record_late(self, late: tuple[torch.Tensor, torch.cuda.Event | None, int, str]) -> None:
        buffer, done, step, kind = late
        if done is not None:
            done.synchronize()
        counts = buffer.numpy()
        if counts.any():  # an eager step records its own accesses
            self.touch_captured(counts, step, kind)
