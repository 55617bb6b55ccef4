"""The prompt-cache index: which full blocks of token ids have KV in the adaptive tier. Pure Python.

A block is `block_tokens` consecutive prompt tokens starting at a multiple of `block_tokens`. Its key is a
hash chain: the digest of block i covers block i's token ids and block i-1's digest, so equal keys mean equal
prefixes, not just equal blocks. blake2b, because Python's `hash()` is salted per process and a 64-bit hash
would make a collision (silently wrong KV) a matter of time.

The index owns a pool of tier block ids (`capacity_blocks` of them). The tensors behind an id live in the
adaptive tier (`engine/exec/kv/tier.py`): the runner fills the ids that `insert` hands out and reads the ids that
`match` returns. Eviction is LRU over unpinned blocks; a request pins the blocks it copies from.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from engine.core.free_ids import FreeIds
from engine.errors import ConfigError
from engine.step import BlockRef

_DIGEST_BYTES = 16
_ROOT = b"strata-prefix-v1"
assert array("I").itemsize == 4, "token ids are hashed as 32-bit unsigned ints"


@dataclass(frozen=True)
class PrefixStats:
    """Counters since start. Hits and misses count blocks looked up by `match`."""

    lookups: int
    hit_blocks: int
    miss_blocks: int
    inserted_blocks: int
    evicted_blocks: int
    used_blocks: int
    pinned_blocks: int
    capacity_blocks: int

    @property
    def hit_rate(self) -> float | None:
        total = self.hit_blocks + self.miss_blocks
        return self.hit_blocks / total if total else None


@dataclass(frozen=True)
class ResizeResult:
    """What `resize` did. `released_block_ids` are ids the index no longer owns (the tier may free their
    memory); `evicted_block_ids` is the subset of them that held cached KV; `added_block_ids` are new ids the
    tier must back with memory. `capacity_blocks` is the capacity reached, which stays above the target when
    pinned blocks could not be released."""

    capacity_blocks: int
    released_block_ids: list[int] = field(default_factory=list)
    evicted_block_ids: list[int] = field(default_factory=list)
    added_block_ids: list[int] = field(default_factory=list)


def block_digests(token_ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """The hash chain over the full blocks of `token_ids` (a trailing partial block has no key)."""
    num_blocks = len(token_ids) // block_tokens
    try:
        # Fixed-width ids: distinct token sequences can never serialize to the same bytes.
        data = array("I", token_ids[:num_blocks * block_tokens]).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be whole numbers in 0..2**32-1 to be hashed ({exc})") from None
    block_bytes = block_tokens * 4
    digests: list[bytes] = []
    prev = _ROOT
    for start in range(0, num_blocks * block_bytes, block_bytes):
        prev = hashlib.blake2b(prev + data[start:start + block_bytes], digest_size=_DIGEST_BYTES).digest()
        digests.append(prev)
    return digests


class PrefixIndex:
    """Maps hash-chain digests of full token blocks to tier block ids, with LRU eviction and pinning."""

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError("block_tokens", block_tokens, "expected a whole number >= 1")
        _check_capacity(capacity_blocks)
        self.block_tokens = block_tokens
        # digest -> block id, oldest use first: the LRU order.
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._digest_of: dict[int, bytes] = {}
        self._pins: dict[int, int] = {}
        self._free = FreeIds(capacity_blocks)
        # ids below `_next_id` the index gave back (a shrink, `drop_free`): a growth takes them again, lowest first
        self._released: list[int] = []
        self._next_id = capacity_blocks
        self._owned = capacity_blocks
        self._lookups = self._hits = self._misses = self._inserted = self._evicted = 0

    # --- queries -----------------------------------------------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        return self._owned

    @property
    def used_blocks(self) -> int:
        return len(self._lru)

    def stats(self) -> PrefixStats:
        return PrefixStats(
            lookups=self._lookups,
            hit_blocks=self._hits,
            miss_blocks=self._misses,
            inserted_blocks=self._inserted,
            evicted_blocks=self._evicted,
            used_blocks=len(self._lru),
            pinned_blocks=len(self._pins),
            capacity_blocks=self._owned,
        )

    def is_pinned(self, block_id: int) -> bool:
        return block_id in self._pins

    def pins(self, block_id: int) -> int:
        """How many holders pin the block (pins nest)."""
        return self._pins.get(block_id, 0)

    def digest_of(self, block_id: int) -> bytes | None:
        """The digest `block_id` holds now; None when it is free or released."""
        return self._digest_of.get(block_id)

    def free_block_ids(self) -> list[int]:
        """Ids the index owns that hold nothing now."""
        return self._free.ascending()

    def match(self, token_ids: Sequence[int]) -> list[BlockRef]:
        """The longest cached prefix of `token_ids`, as refs for blocks 0..k-1; marks them recently used.

        The caller decides how much of a prompt may be reused (the scheduler passes all but the last token,
        whose logits must be computed).
        """
        return self.match_digests(block_digests(token_ids, self.block_tokens))

    def match_digests(self, digests: Sequence[bytes]) -> list[BlockRef]:
        """`match` for a chain already hashed with `block_digests` (a caller that keeps a prompt's chain)."""
        refs: list[BlockRef] = []
        for index, digest in enumerate(digests):
            block_id = self._lru.get(digest)
            if block_id is None:
                break
            refs.append(BlockRef(index, block_id, digest))
        self._lookups += 1
        self._hits += len(refs)
        self._misses += len(digests) - len(refs)
        self._touch(ref.digest for ref in refs)
        return refs

    # --- commands ----------------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], first_new_block: int = 0) -> list[BlockRef]:
        """Give tier block ids to the full blocks of `token_ids` from `first_new_block` on that are not cached.

        Returns the refs the runner must fill (slot KV -> tier) before the next `match`; blocks already cached
        are only marked used. Returns nothing when a block before `first_new_block` is no longer cached, and
        stops at the first block that finds no room, since a block is reachable only through all blocks
        before it. Room is made by evicting other chains' blocks, never this one's.
        """
        return self.insert_digests(block_digests(token_ids, self.block_tokens), first_new_block)

    def insert_digests(self, digests: Sequence[bytes], first_new_block: int = 0) -> list[BlockRef]:
        """`insert` for a chain already hashed with `block_digests`."""
        if first_new_block < 0:
            raise ValueError(f"first_new_block={first_new_block}: expected >= 0")
        # Blocks before `first_new_block` are this chain's head: a new block is reachable only through them,
        # so they are held (never evicted to make room for their successors) and must all be present.
        head = [self._lru.get(d) for d in digests[:first_new_block]]
        if any(block_id is None for block_id in head):
            return []
        held: list[int] = [block_id for block_id in head if block_id is not None]
        self.pin(held)
        new: list[BlockRef] = []
        try:
            for index in range(first_new_block, len(digests)):
                digest = digests[index]
                block_id = self._lru.get(digest)
                if block_id is None:
                    block_id = self._allocate()
                    if block_id is None:
                        break
                    self._lru[digest] = block_id
                    self._digest_of[block_id] = digest
                    self._inserted += 1
                    new.append(BlockRef(index, block_id, digest))
                self.pin([block_id])
                held.append(block_id)
        finally:
            self.unpin(held)
        self._touch(digests[:len(held)])
        return new

    def pin(self, block_ids: Iterable[int]) -> None:
        """Protect blocks from eviction (a request is copying them); pins nest."""
        for block_id in block_ids:
            if block_id not in self._digest_of:
                raise KeyError(f"block_id={block_id} is not a cached block")
            self._pins[block_id] = self._pins.get(block_id, 0) + 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Undo one `pin` of each block; unpinning an evicted or unknown block is a no-op."""
        for block_id in block_ids:
            count = self._pins.get(block_id, 0)
            if count <= 1:
                self._pins.pop(block_id, None)
            else:
                self._pins[block_id] = count - 1

    def discard(self, block_ids: Iterable[int]) -> None:
        """Forget blocks whose fill failed; their ids go back to the free pool."""
        for block_id in block_ids:
            digest = self._digest_of.pop(block_id, None)
            if digest is not None:
                del self._lru[digest]
                self._pins.pop(block_id, None)
                self._free.add(block_id)

    def evict(self, n_blocks: int, only: Callable[[int], bool] | None = None) -> list[int]:
        """Evict up to `n_blocks` unpinned blocks (those `only` accepts, when given), least recently used first;
        returns their (now free) ids."""
        freed = self._take_lru(n_blocks, only)
        for block_id in freed:
            self._free.add(block_id)
        return freed

    def resize(self, capacity_blocks: int, keep_last: Callable[[int], bool] | None = None) -> ResizeResult:
        """Grow or shrink the pool of tier block ids at run time (the adaptive tier gives memory back).

        Shrinking releases free ids first (highest first, so a contiguous tier can trim its end), then evicts
        LRU unpinned blocks; pinned blocks are never released. With `keep_last`, the ids it accepts (those
        costlier to give back) go only once the others are gone: free others, evicted others, free ones, evicted.
        """
        _check_capacity(capacity_blocks)
        if capacity_blocks >= self._owned:
            added: list[int] = []
            while self._owned + len(added) < capacity_blocks:
                if self._released:
                    added.append(heapq.heappop(self._released))
                else:
                    added.append(self._next_id)
                    self._next_id += 1
            for block_id in added:
                self._free.add(block_id)
            self._owned = capacity_blocks
            return ResizeResult(capacity_blocks, added_block_ids=added)
        excess = self._owned - capacity_blocks
        released: list[int] = []
        evicted: list[int] = []
        for last in ((False, True) if keep_last is not None else (None,)):
            def among(b: int, last: bool | None = last) -> bool:
                return last is None or bool(keep_last(b)) == last

            released += self._free.remove(self._free.highest(excess - len(released), among))
            out = self._take_lru(excess - len(released), among)  # evicted and released at once: never free
            released += out
            evicted += out
        self._give_back(released)
        return ResizeResult(self._owned, sorted(released), evicted)

    def drop_free(self, block_ids: Iterable[int]) -> list[int]:
        """Give back exactly these ids if they are free (a tier that could back only some of the ids a `resize`
        added); returns the ids dropped. The capacity falls by as many."""
        dropped = self._free.remove(set(block_ids))
        self._give_back(dropped)
        return sorted(dropped)

    # --- internals ---------------------------------------------------------------------------------------

    def _touch(self, digests: Iterable[bytes]) -> None:
        # Mark a prefix used so that its first block ends most recent: eviction then takes the tail blocks of
        # a chain before its head, and never strands tails that can no longer be reached.
        for digest in reversed(list(digests)):
            if digest in self._lru:
                self._lru.move_to_end(digest)

    def _allocate(self) -> int | None:
        # Lowest id first, so the ids in use stay packed at the front of a contiguous tier.
        if not self._free and not self.evict(1):
            return None
        return self._free.pop_lowest()

    def _take_lru(self, n_blocks: int, only: Callable[[int], bool] | None) -> list[int]:
        """Forget up to `n_blocks` unpinned blocks (`only`'s), least recently used first; their ids, in no list."""
        if n_blocks <= 0:
            return []
        chosen: list[tuple[bytes, int]] = []
        for digest, block_id in self._lru.items():  # oldest first, up to the n-th: not a pass over every block
            if block_id in self._pins or (only is not None and not only(block_id)):
                continue
            chosen.append((digest, block_id))
            if len(chosen) == n_blocks:
                break
        for digest, block_id in chosen:
            del self._lru[digest]
            del self._digest_of[block_id]
        self._evicted += len(chosen)
        return [block_id for _, block_id in chosen]

    def _give_back(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            heapq.heappush(self._released, block_id)
        self._owned -= len(block_ids)


def _check_capacity(capacity_blocks: object) -> None:
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
        raise ConfigError("capacity_blocks", capacity_blocks, "expected a whole number >= 0")
