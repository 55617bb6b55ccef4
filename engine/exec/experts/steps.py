"""ExpertStepExecutor: the step-executor seam with the expert cache's between-steps work around it.

It wraps the engine's executor (GraphCache on CUDA, EagerExecutor otherwise) and, for every step:
1. marks the step's real rows (positions inside the context; padded batch rows sit past it), so neither path
   loads an expert only a padding row wants;
2. runs the step through the inner executor (a graph replay, a capture, or eagerly);
3. after a replay, reads the device's per-layer route counts and miss counts (one small copy, after the step's
   own sync point):
   - no miss: the replay stands and the routed experts count as hits (the policy refreshed);
   - a miss: every layer before the first missed one hit, so that layer's routing is right. Its experts are
     loaded (when they fit its pool) and the graph is replayed again, up to MAX_EXTRA_REPLAYS times; after
     that, or when the layer's access is larger than its pool, the step runs again eagerly, which serves every
     layer itself. A step only writes KV at its own positions, so running it again is safe, as long as its
     inputs are its own: never an output of the graph it replays, which the first replay overwrites (MTP's
     fused step launched ahead copies them: engine.exec.drafter.verify_and_draft_ahead);
   With the cold mode `cpu` a miss always runs the step again eagerly (its misses computed on the host); with
   `prefetch` the layers past the first missed one are also loaded from the graph's predictions before the
   replay (engine.exec.experts.cold);
4. publishes the summed load / evict events about once a second.
When every pool holds every expert (not under prefetch) no route can miss, so a replay stands without a check:
its counters go to (pinned) host memory behind it and are recorded while the next step computes, instead of the
host waiting for the step to read them and the device waiting for the host to record them.
Everything else (release, invalidate, snapshot, precapture, ...) is the inner executor's.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import numpy as np
import torch

from engine.exec.step_fns import StepFn
from engine.exec.experts.cache import MAX_STEP_ROWS, ExpertCache
from engine.switches import SwitchBoard

POLICY_SWITCH = "EXPERT_LFU"

# A replay costs about one decode step; an eager re-run of a 24-layer step costs 15-20 of them on a GPU
# (docs/BENCHMARKS.md), so a few replays that each fix one layer are worth trying first.
MAX_EXTRA_REPLAYS = 3


class ExpertStepExecutor:
    """Runs steps through `inner`, resolving expert-cache misses between steps (see the module docstring)."""

    def __init__(self, inner: Any, cache: ExpertCache, context_tokens: int) -> None:
        self.inner = inner
        self.cache = cache
        self.context_tokens = context_tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run(self, kind: str, key: Hashable, fn: StepFn, inputs: Mapping[str, Any],
            owner: str | None = None) -> dict[str, Any]:
        cache = self.cache
        cache.stats.begin_step(kind)
        cache.served_this_step = set()
        self._mark_rows(inputs)
        try:
            cache.wait_all_pending()  # copies that went behind an earlier step (cold cpu / prefetch)
            out = self.inner.run(kind, key, fn, inputs, owner)
            late = cache.counts_late_ok()
            if late:
                cache.count_late()
            else:
                cache.flush_late_counts()
            for extra in range(0 if late else MAX_EXTRA_REPLAYS + 1):
                counters = self._take_counters()
                if counters is None:  # nothing captured ran (eager, or this call captured the graph)
                    break
                misses, counts, predicted = counters
                missed = np.flatnonzero(misses)
                if not missed.size:
                    cache.touch_captured(counts)
                    break
                first = int(missed[0])
                experts = np.flatnonzero(counts[first]).tolist()
                if extra == MAX_EXTRA_REPLAYS or len(experts) > cache.pools[first].slots or cache.cold == "cpu":
                    # cpu: the eager run computes the misses on the host instead of waiting for their copies
                    cache.stats.reruns += 1
                    cache.force_eager = True
                    out = fn(inputs)  # eager: serves every layer not served yet, loading what is missing
                    break
                cache.serve_captured_layer(first, experts, int(sum(counts[first])) // cache.top_k)
                if predicted is not None:  # prefetch: the layers past the first missed one, from the predictions
                    for j in range(first + 1, len(predicted)):
                        cache.prefetch(j, np.flatnonzero(predicted[j]).tolist())
                    cache.wait_all_pending()
                cache.stats.replays += 1
                out = self.inner.run(kind, key, fn, inputs, owner)
        finally:
            cache.valid_rows = None
            cache.force_eager = False
            cache.served_this_step = set()
        cache.stats.publish_due(cache.mib, cache.slots, policy=cache.policy)
        return out

    def _mark_rows(self, inputs: Mapping[str, Any]) -> None:
        positions = inputs.get("positions")
        if not isinstance(positions, torch.Tensor) or positions.numel() > MAX_STEP_ROWS:
            return
        n = positions.numel()
        self.cache.row_valid[:n].copy_((positions < self.context_tokens).flatten())
        self.cache.valid_rows = n

    def _take_counters(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """Read and clear what captured layers counted: (misses per layer [L], route counts [L, E], and under
        prefetch the predicted route counts [L, E]), or None when no captured layer ran since the last read."""
        cache = self.cache
        parts = [cache.dev_misses[:, None], cache.dev_counts]
        if cache.cold == "prefetch":
            parts.append(cache.dev_predicted)
        packed = torch.cat(parts, dim=1).cpu().numpy()  # [L, 1 + E (+ E)]
        if not packed.any():
            return None
        cache.dev_misses.zero_()
        cache.dev_counts.zero_()
        E = cache.num_experts
        predicted = None
        if cache.cold == "prefetch":
            cache.dev_predicted.zero_()
            predicted = packed[:, 1 + E:]
        return packed[:, 0], packed[:, 1:1 + E], predicted

def follow_policy_switch(cache: ExpertCache, board: SwitchBoard | None) -> None:
    """Give the cache the slot policy the EXPERT_LFU switch asks for (no change: nothing happens). Called at
    start and by Engine.set_switch, the one place the switch changes while the engine runs."""
    if board is None or POLICY_SWITCH not in board.states:
        return
    want = "lfu" if board.enabled(POLICY_SWITCH) else "lru"
    if cache.policy != want:
        cache.set_policy(want)
