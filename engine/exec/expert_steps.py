"""ExpertStepExecutor: the step-executor seam with the expert cache's between-steps work around it.

It wraps the engine's executor (GraphCache on CUDA, EagerExecutor otherwise) and, for every step:
1. marks the step's real rows (positions inside the context; padded batch rows sit past it), so neither path
   loads an expert only a padding row wants;
2. runs the step through the inner executor (a graph replay, a capture, or eagerly);
3. after a replay, reads the device's per-layer route counts and miss counts (one small copy, after the step's
   own sync point): no miss, the replay stands and the routed experts count as hits (LRU order refreshed); a
   miss, the replay's output is discarded and the step runs again eagerly, which loads the missing experts
   between the two runs. A step only writes KV at its own positions, so running it twice is safe;
4. publishes the summed load / evict events about once a second.
Everything else (release, invalidate, snapshot, precapture, ...) is the inner executor's.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch

from engine.exec.executor import StepFn
from engine.exec.expert_cache import MAX_STEP_ROWS, ExpertCache


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
        before = len(cache.stats.trace)
        self._mark_rows(inputs)
        try:
            out = self.inner.run(kind, key, fn, inputs, owner)
            if self._replayed_with_misses():
                cache.stats.forget_step(len(cache.stats.trace) - before)
                cache.stats.reruns += 1
                cache.force_eager = True
                out = fn(inputs)  # eager: serves every layer's access, loading what was missing
        finally:
            cache.valid_rows = None
            cache.force_eager = False
        cache.stats.publish_due(cache.mib, cache.slots)
        return out

    def _mark_rows(self, inputs: Mapping[str, Any]) -> None:
        positions = inputs.get("positions")
        if not isinstance(positions, torch.Tensor) or positions.numel() > MAX_STEP_ROWS:
            return
        n = positions.numel()
        self.cache.row_valid[:n].copy_((positions < self.context_tokens).flatten())
        self.cache.valid_rows = n

    def _replayed_with_misses(self) -> bool:
        """Read and clear the captured steps' counters; True when a real row missed an expert."""
        cache = self.cache
        packed = torch.cat([cache.dev_misses[:, None], cache.dev_counts], dim=1).cpu()  # [L, 1 + E]
        if not bool(packed.any()):
            return False
        cache.dev_misses.zero_()
        cache.dev_counts.zero_()
        if bool(packed[:, 0].any()):
            return True
        cache.touch_captured(packed[:, 1:].tolist())
        return False
