"""What the prefix-cache tier needs from the block index, as protocols: the index itself lives in the
torch-free core (engine.core.prefix_index.PrefixIndex), which the executor never imports; the orchestration
builds the index and hands it to the tier, and these say what the tier may call on it."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from engine.step import BlockRef

__all__ = ["BlockIndex", "BlockRef", "IndexStats", "ResizeOutcome"]


class IndexStats(Protocol):
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    hit_blocks: int
    miss_blocks: int
    evicted_blocks: int


class ResizeOutcome(Protocol):
    added_block_ids: list[int]
    released_block_ids: list[int]


class BlockIndex(Protocol):
    """The tier block ids' one owner: which ids exist, which are free, pinned or holding which digest."""

    block_tokens: int

    @property
    def capacity_blocks(self) -> int: ...
    def stats(self) -> IndexStats: ...
    def digest_of(self, block_id: int) -> bytes | None: ...
    def free_block_ids(self) -> list[int]: ...
    def pin(self, block_ids: Iterable[int]) -> None: ...
    def unpin(self, block_ids: Iterable[int]) -> None: ...
    def evict(self, n_blocks: int, only: Callable[[int], bool] | None = None) -> list[int]: ...
    def resize(self, capacity_blocks: int, keep_last: Callable[[int], bool] | None = None) -> ResizeOutcome: ...
    def drop_free(self, block_ids: Iterable[int]) -> list[int]: ...
