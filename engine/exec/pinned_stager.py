"""Pinned host buffers for non-blocking host-to-device copies of a step's inputs (PINNED_STAGING, and a step launched
ahead: engine.exec.runner.ModelRunner.stage)."""

from __future__ import annotations

import torch


class PinnedStager:
    """Reusable pinned host buffers per (shape, dtype) for non-blocking host-to-device input copies.

    A buffer is reused only after the copy that last read it has completed (a CUDA event per buffer), so a
    host write can never race an in-flight copy.
    """

    RING = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rings: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._turn: dict[tuple, int] = {}

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        key = (tuple(host.shape), host.dtype)
        ring = self._rings.setdefault(key, [])
        turn = self._turn.get(key, 0)
        self._turn[key] = turn + 1
        if len(ring) < self.RING:
            ring.append((torch.empty(host.shape, dtype=host.dtype).pin_memory(), torch.cuda.Event()))
            buf, done = ring[-1]
        else:
            buf, done = ring[turn % self.RING]
            done.synchronize()
        buf.copy_(host)
        out = buf.to(self.device, non_blocking=True)
        done.record()
        return out
