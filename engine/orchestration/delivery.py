"""Outputs from the engine thread to the asyncio queues of the clients waiting for them.

Each `generate` call registers its request's queue with the event loop it awaits on. After a step, the engine
thread hands the step's RequestOutputs over in one go: one `call_soon_threadsafe` per event loop per step (not
one per token), so the engine thread's cost of a step's delivery is one wake-up of each loop whatever the
batch; the loop then puts each output in its queue, in the step's order.
"""

from __future__ import annotations

import asyncio
import threading

from engine.api import RequestOutput


class OutputRouter:
    """request id -> (event loop, asyncio queue). `deliver` runs on the engine thread; `register` on any."""

    def __init__(self) -> None:
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()

    def register(self, request_id: str, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        with self._lock:
            self._queues[request_id] = (loop, queue)

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._queues)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its request's queue; a finished output forgets its request. Outputs of a request
        nobody waits for (never registered, or its loop closed) are dropped."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                target = self._queues.get(out.request_id)
                if target is None:
                    continue
                if out.finished:
                    del self._queues[out.request_id]
                loop, queue = target
                by_loop.setdefault(loop, []).append((queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: its consumers are gone
                self._forget_loop(loop)

    def _forget_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            for rid in [rid for rid, (each, _) in self._queues.items() if each is loop]:
                del self._queues[rid]


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
