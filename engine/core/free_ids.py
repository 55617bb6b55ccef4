"""The prefix index's free tier block ids: handed out lowest first, given back highest first.

A tier on a large card owns up to `MAX_TIER_BLOCKS` ids, and a KV pool short of blocks asks it for some back at
nearly every step while prompts arrive (KV by use): so each operation costs about what it moves (a bisection and
a move of the ids after it), never a pass over every free id.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterable


class FreeIds:
    """A set of ids kept sorted (as negated ids, ascending: the lowest id last, where `pop` takes it)."""

    def __init__(self, count: int = 0) -> None:
        self._neg: list[int] = list(range(-(count - 1), 1)) if count > 0 else []

    def __len__(self) -> int:
        return len(self._neg)

    def __contains__(self, block_id: int) -> bool:
        i = bisect.bisect_left(self._neg, -block_id)
        return i < len(self._neg) and self._neg[i] == -block_id

    def ascending(self) -> list[int]:
        return [-v for v in reversed(self._neg)]

    def add(self, block_id: int) -> None:
        if block_id not in self:
            bisect.insort(self._neg, -block_id)

    def pop_lowest(self) -> int:
        """The lowest free id, taken (so the ids in use stay packed at the front of a contiguous tier)."""
        return -self._neg.pop()

    def highest(self, count: int, accept: Callable[[int], bool] | None = None) -> list[int]:
        """Up to `count` free ids (those `accept` takes, when given), highest first; they stay free."""
        found: list[int] = []
        if count <= 0:
            return found
        for v in self._neg:
            if accept is None or accept(-v):
                found.append(-v)
                if len(found) == count:
                    break
        return found

    def remove(self, block_ids: Iterable[int]) -> list[int]:
        """Take these ids out where they are free; returns those that were."""
        removed: list[int] = []
        for block_id in block_ids:
            i = bisect.bisect_left(self._neg, -block_id)
            if i < len(self._neg) and self._neg[i] == -block_id:
                del self._neg[i]
                removed.append(block_id)
        return removed
