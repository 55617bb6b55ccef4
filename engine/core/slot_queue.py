"""A bounded FIFO queue in front of a fixed number of slots: who waits, who holds which slot, and how soon a queue
place is likely to free (the Retry-After of a full queue). The Scheduler (engine.core.scheduler) is one; what runs in
each step is its own."""

from __future__ import annotations

import heapq
from collections import deque

from engine.core.request import Request, RequestState
from engine.errors import QueueFull

_RETRY_AFTER_MIN_S = 0.1
_RETRY_AFTER_MAX_S = 60.0
_RETRY_AFTER_UNKNOWN_S = 1.0


class SlotQueue:
    """Requests queued (oldest first) and the slots they are admitted to (the lowest free slot first)."""

    def __init__(self, num_slots: int, queue_max: int) -> None:
        self.num_slots = num_slots
        self.queue_max = queue_max
        self._waiting: deque[Request] = deque()
        self._slots: list[Request | None] = [None] * num_slots
        self._free_slots: list[int] = list(range(num_slots))
        self._requests: dict[str, Request] = {}
        self._finish_times_s: deque[float] = deque(maxlen=32)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return self.num_slots - len(self._free_slots)

    def prefill_tokens_waiting(self) -> int:
        """Prompt tokens still to prefill: whole prompts in the queue and what is left of those in a slot."""
        queued = sum(req.num_prompt_tokens for req in self._waiting)
        running = (self.slot_request(slot) for slot in range(self.num_slots))
        return queued + sum(req.remaining_prompt_tokens for req in running if req is not None)

    @property
    def has_work(self) -> bool:
        """True while anything is queued or holds a slot: the engine keeps stepping."""
        return bool(self._waiting) or self.num_running > 0

    def waiting(self) -> list[Request]:
        """Queued requests, oldest first."""
        return list(self._waiting)

    def running(self) -> list[Request]:
        """Requests holding slots, by slot."""
        return [req for req in self._slots if req is not None]

    def slot_request(self, slot: int) -> Request | None:
        return self._slots[slot]

    def get(self, request_id: str) -> Request | None:
        """A queued or running request by id (finished ones are forgotten)."""
        return self._requests.get(request_id)

    def retry_after_s(self) -> float:
        """How long until a queue place is likely to free: one finish's time at the recent finish rate."""
        times = self._finish_times_s
        if len(times) < 2 or times[-1] <= times[0]:
            return _RETRY_AFTER_UNKNOWN_S
        per_finish_s = (times[-1] - times[0]) / (len(times) - 1)
        return min(max(per_finish_s, _RETRY_AFTER_MIN_S), _RETRY_AFTER_MAX_S)

    def _enqueue(self, req: Request) -> None:
        """At the back of the queue; QueueFull when the queue is full."""
        if len(self._waiting) >= self.queue_max:
            raise QueueFull(len(self._waiting), self.queue_max, self.retry_after_s())
        self._waiting.append(req)
        self._requests[req.request_id] = req

    def _take_slot(self, req: Request) -> int:
        """The lowest free slot, now `req`'s (the caller has taken `req` off the queue)."""
        slot = heapq.heappop(self._free_slots)
        req.slot = slot
        self._slots[slot] = req
        return slot

    def _leave(self, req: Request, now_s: float) -> None:
        """`req` finished at `now_s`: its queue place or slot is free, its id forgotten."""
        if req.state is RequestState.WAITING:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass  # never added: finishing it is still well-defined
        if req.slot is not None:
            self._slots[req.slot] = None
            heapq.heappush(self._free_slots, req.slot)
            req.slot = None
        self._requests.pop(req.request_id, None)
        self._finish_times_s.append(now_s)
