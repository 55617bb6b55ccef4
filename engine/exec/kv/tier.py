"""The adaptive tier (the prefix cache's memory) and, re-exported from engine.exec.kv.vram_budget, the VRAM books.

The adaptive tier is the prefix cache's memory: KV blocks (all layers of `block_tokens` tokens) keyed by the
PrefixIndex's block ids. On a GPU it takes what is left after weights, KV, graphs and the reserve, up front
(so the engine runs with VRAM near-full by design, as the seed report's expert cache did), and gives memory
back through ONE call, `release(mib, reason)`, used by admission and by the graph cache's out-of-memory path.
On CPU it holds host memory within a fixed budget, allocated as blocks are filled.

Where the tier lives on the compute device and no slot has a resident window (`--kv-resident`), its blocks are
blocks of the KV pool itself (`shared`: engine.exec.kv.tier_pool.SharedTierBlocks where every slot reserves its
whole context, engine.exec.kv.tier_ledger.LedgerTierBlocks where slots take blocks by use): a reused prefix is
mapped into the admitted slot's block table instead of copied, and a computed prompt block becomes a tier block
by handing its pool blocks over. Otherwise (a `--peer-device` tier, `--kv-resident`) the tier keeps its own
tensors and copies blocks in and out of slots.

Both directions publish a TierEvent. The index stays the single owner of block ids: the tier only resizes
the index's pool and frees the tensors of the ids the index released.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.tier_ledger import LedgerTierBlocks
from engine.exec.kv.tier_pool import SharedTierBlocks
from engine.exec.kv.block_index import BlockIndex, BlockRef
from engine.exec.kv.vram_budget import MIB, VramBudget, check_kv_fits, device_memory_mib
from engine.telemetry import EventBus, TierEvent

__all__ = ["AdaptiveTier", "MIB", "VramBudget", "check_kv_fits", "device_memory_mib", "CPU_TIER_DEFAULT_MIB"]

# Upper bound on tier blocks: a tiny model on a large GPU would otherwise mean millions of block tensors. High
# enough that the tier still fills a 141 GiB card with the embedded tiny model's small blocks, so VRAM is
# near-full by design there too (docs/VRAM.md).
MAX_TIER_BLOCKS = 1 << 18
# A growing preallocated tier measures the room left after every this many MiB of blocks.
_ROOM_CHECK_MIB = 64.0
# A preallocated tier in the KV pool keeps this many times the reserve (at least 1 GiB) of its start budget in
# own blocks: what out-of-memory recovery and the reserve ask back is freed without reallocating the pool.
OWN_BLOCKS_RESERVE_FACTOR = 4
# CPU runs: the tier's budget when none is configured (capped by a fraction of available RAM).
CPU_TIER_DEFAULT_MIB = 512.0
_CPU_TIER_RAM_FRACTION = 0.125


class AdaptiveTier:
    """Prefix-cache KV blocks in device (or host) memory, sized by a budget that can move both ways.

    With `shared` (engine.exec.kv.tier_pool.SharedTierBlocks) the tier's blocks live in the KV pool: filled by
    handing a slot's pool blocks over, reused by mapping them into a slot's block table. A preallocated tier
    puts `pooled_mib` of its start budget there and the rest, and whatever it regrows later, in blocks of its
    own (copied in and out): resizing the pool reallocates every pool tensor and drops the captured graphs,
    while an own block is freed alone, so releases (out-of-memory recovery, the reserve) take own blocks first
    and touch the pool only when those are gone. A tier that does not preallocate (host) backs every block in
    the pool as it is filled.
    """

    def __init__(self, index: BlockIndex, kv: SlotKVCache, bus: EventBus, device: torch.device,
                 budget_mib: float, preallocate: bool, room_mib: Callable[[], float] | None = None,
                 room_check_mib: float = _ROOM_CHECK_MIB, shared: SharedTierBlocks | LedgerTierBlocks | None = None,
                 pooled_mib: float | None = None) -> None:
        self.index = index
        # How much more memory the tier may take right now, measured (on CUDA: the driver's free memory minus
        # what must stay free). A preallocating tier checks it while it grows: a block's bytes understate what
        # the allocator really takes for it (small blocks share 2 MiB segments with slack: +11 % for the
        # embedded tiny model), and a budget computed from block bytes alone once left the reserve at 0 MiB.
        self.room_mib = room_mib
        self.room_check_mib = room_check_mib
        self.kv = kv
        self.bus = bus
        self.device = device
        self.preallocate = preallocate
        self.block_tokens = index.block_tokens
        g = kv.geometry
        self._data_shape = (g.num_layers, 2, g.num_kv_heads, self.block_tokens, g.head_dim)
        self._data_dtype = kv.k[0].dtype
        self.block_mib = g.bytes_per_token(kv.storage, kv.compute_dtype) * self.block_tokens / MIB
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # own blocks
        self.shared = shared
        self.filled_blocks = 0
        self.copied_in_blocks = 0  # tier blocks copied into a slot (own blocks)
        self.shared_blocks = 0  # tier blocks mapped into a slot by reference (pool blocks)
        start = self.blocks_for(budget_mib)
        # The own blocks' share first: where MAX_TIER_BLOCKS caps the start, the cap comes out of the pool's share
        # (a tiny model's blocks on a large card otherwise all go to the pool, and every release reallocates it).
        pooled = start if pooled_mib is None else max(0, start - self.blocks_for(max(0.0, budget_mib - pooled_mib)))
        self._resize_to(start, "start", pooled=pooled if shared is not None else 0)

    # --- queries -------------------------------------------------------------------------------------------

    def blocks_for(self, mib: float) -> int:
        return min(MAX_TIER_BLOCKS, max(0, int(mib // self.block_mib))) if self.block_mib > 0 else 0

    @property
    def capacity_blocks(self) -> int:
        return self.index.capacity_blocks

    @property
    def mib(self) -> float:
        """Memory the tier holds now (own blocks and pool blocks)."""
        pooled = len(self.shared.backing) if self.shared is not None else 0
        return (len(self._blocks) + pooled) * self.block_mib

    @property
    def capacity_mib(self) -> float:
        return self.capacity_blocks * self.block_mib

    def snapshot(self) -> dict:
        stats = self.index.stats()
        return {
            "device": str(self.device), "mib": round(self.mib, 2), "capacity_mib": round(self.capacity_mib, 2),
            "block_tokens": self.block_tokens, "block_mib": round(self.block_mib, 4),
            "capacity_blocks": stats.capacity_blocks, "used_blocks": stats.used_blocks,
            "pinned_blocks": stats.pinned_blocks, "hit_blocks": stats.hit_blocks, "miss_blocks": stats.miss_blocks,
            "evicted_blocks": stats.evicted_blocks, "preallocated": self.preallocate,
            "pool_blocks": len(self.shared.backing) if self.shared is not None else 0,
            "shared_blocks": self.shared_blocks, "copied_in_blocks": self.copied_in_blocks,
        }

    def _pooled(self, block_id: int) -> bool:
        """Whether the block lives in the KV pool (or, for a host tier, will once it is filled)."""
        shared = self.shared
        return shared is not None and (shared.is_backed(block_id)
                                       or (not self.preallocate and block_id not in self._blocks))

    # --- filling and reuse (the engine calls these) ----------------------------------------------------------

    def fill(self, refs: list[BlockRef], slot: int, coming_blocks: int = 0) -> list[int]:
        """Put slot KV into the tier blocks `refs` name: pool blocks are handed over by the slot, own blocks
        are copied. `coming_blocks`: how many more blocks of the same prompt later steps will fill (what a pool
        growth makes room for at once). Returns the ids that could not be filled."""
        pooled = [ref for ref in refs if self._pooled(ref.block_id)]
        failed = self._hand_over(pooled, slot, coming_blocks) if pooled else []
        for ref in refs:
            if pooled and ref in pooled:
                continue
            start = ref.index * self.block_tokens
            try:
                data, scales = self.kv.read_span(slot, start, start + self.block_tokens)
                dst = self._block(ref.block_id)
                dst[0].copy_(data, non_blocking=True)
                if scales is not None and dst[1] is not None:
                    dst[1].copy_(scales, non_blocking=True)
                self.filled_blocks += 1
            except torch.OutOfMemoryError:
                failed.append(ref.block_id)
        return failed

    def load(self, refs: list[BlockRef], slot: int) -> None:
        """Give a newly admitted slot its cached prefix: pool blocks are mapped into its block table (pinned
        until its request ends), own blocks are copied to their prompt positions."""
        pooled = [ref for ref in refs if self._pooled(ref.block_id)]
        if pooled:
            self.shared.map(slot, pooled)
            self.index.pin(ref.block_id for ref in pooled)
            self.shared_blocks += len(pooled)
        for ref in refs:
            if pooled and ref in pooled:
                continue
            data, scales = self._blocks[ref.block_id]
            self.kv.write_span(slot, ref.index * self.block_tokens, data, scales)
            self.copied_in_blocks += 1

    def _hand_over(self, refs: list[BlockRef], slot: int, coming_blocks: int = 0) -> list[int]:
        # A ref whose block was discarded since (its request failed in this step) holds nothing to hand over.
        live = [ref for ref in refs if self.index.digest_of(ref.block_id) == ref.digest]
        unbacked = [ref.block_id for ref in live if not self.shared.is_backed(ref.block_id)] \
            if self.shared.backs_before_hand_over else []
        failed: list[int] = []
        if unbacked:  # a host tier backs its blocks as they are filled
            try:
                self.shared.set_backing(self._growth(unbacked, coming_blocks), [])
            except torch.OutOfMemoryError:
                failed = unbacked
                live = [ref for ref in live if self.shared.is_backed(ref.block_id)]
        refused = self.shared.hand_over(slot, live) or []  # KV by use: a block spilled to the host since
        if refused:
            failed += [ref.block_id for ref in refused]
            live = [ref for ref in live if ref not in refused]
        self.index.pin(ref.block_id for ref in live)  # the slot maps them until its request ends
        self.filled_blocks += len(live)
        return failed

    def _growth(self, unbacked: list[int], coming_blocks: int) -> list[int]:
        """The ids one pool growth backs: `unbacked`, and free ids (the index hands out its lowest free ids
        first, so these are the ids the prompt's next blocks take) enough for the rest of the prompt, or half as
        many again as the pool backs: each growth reallocates, and copies, the whole pool, so a long prompt grows
        it once, not once per chunk."""
        want = max(len(self.shared.backing) // 2 - len(unbacked), coming_blocks)
        return unbacked + [b for b in self.index.free_block_ids() if not self.shared.is_backed(b)][:max(0, want)]

    # --- slots (pool blocks a slot maps are pinned until its request ends) ----------------------------------

    def retire_slot(self, slot: int) -> None:
        """The slot's request finished: its mapped blocks are unpinned at the next `reclaim_retired`, which the
        engine calls between steps only (a fill after the request's last chunk still hands its blocks over, in
        the same step, into the slot's mappings)."""
        if self.shared is not None:
            self.shared.retire(slot)

    def reclaim_retired(self) -> None:
        if self.shared is not None:
            # A block discarded (and maybe reused) since it was mapped lost its pins with it: only a block that
            # still holds the digest it was mapped with carries this mapping's pin.
            self.index.unpin(ref.block_id for ref in self.shared.reclaim()
                             if self.index.digest_of(ref.block_id) == ref.digest)

    def scrub_non_finite(self, live_slots: Iterable[int]) -> int:
        """After a request ended on logits that were not finite (and its slot was reclaimed): zero every pool block
        holding a NaN or inf that no live slot reads, so no later request meets it through a masked position
        (engine.exec.kv.cache.SlotKVCache.zero_blocks); cached prefix blocks among them are evicted first, as
        they no longer hold their prompt's KV. Blocks a live slot reads keep what they hold: that request meets
        its NaN itself and gets the error. Returns the blocks zeroed."""
        bad = self.kv.non_finite_blocks() - self.kv.blocks_of(live_slots)
        if self.shared is not None and bad:
            held = {b for b, physical in self.shared.backing.items() if bad.intersection(physical)}
            kept = held - set(self.index.evict(len(held), only=held.__contains__))  # pinned: a live slot maps it
            bad -= {p for b in kept for p in self.shared.backing[b]}
        self.kv.zero_blocks(bad)
        return len(bad)

    def close(self, reason: str) -> None:
        """The engine closes: give every block back (pool blocks go with the KV cache's tensors)."""
        if self.shared is None:
            self.set_budget(0.0, reason)
            return
        before = self.mib
        self.shared.forget()  # no pool reallocation: the cache frees its tensors next
        self.index.resize(0)
        self._blocks.clear()
        if before > 0:
            self._publish("shrink", before, reason)

    # --- size changes ----------------------------------------------------------------------------------------

    def release(self, mib: float, reason: str, pool_first: bool = False) -> float:
        """Give back at least `mib` MiB of held memory if the tier has it; returns the MiB actually freed.

        A preallocated (GPU) tier lowers its capacity: free blocks go first, then least recently used unpinned
        ones (own blocks before pool blocks), and the memory returns to the device (empty_cache); it regrows
        when `VramBudget.rebalance` finds room again. A host tier evicts least recently used unpinned blocks
        and keeps its budget. Pinned blocks (being copied into a slot this step, or mapped by one) always stay.

        `pool_first`: a KV pool short of blocks asks (KV by use). Where a dropped tier block gives its pool
        blocks back as they are (`gives_pool_blocks_back`), the blocks in the pool go first: the slots take them
        at once, where memory freed makes the pool grow, a copy of every pool tensor that drops every captured
        graph. The pool blocks stay the pool's, so only own blocks' memory goes back to the device.
        """
        if mib <= 0 or self.block_mib <= 0:
            return 0.0
        before = self.mib
        own_before = len(self._blocks)
        want_blocks = math.ceil(mib / self.block_mib)
        if self.preallocate:
            pool_first = pool_first and self.shared is not None and self.shared.gives_pool_blocks_back
            self._resize_to(max(0, self.capacity_blocks - want_blocks), reason, pool_first=pool_first)
        else:
            shared = self.shared
            idle = [b for b in self.index.free_block_ids() if shared.is_backed(b)][:want_blocks] if shared else []
            evicted = self.index.evict(want_blocks - len(idle))
            for block_id in evicted:
                self._blocks.pop(block_id, None)
            if shared is not None:
                shared.set_backing([], idle + evicted)
            if self.mib < before:
                self._publish("shrink", before - self.mib, reason)
        freed = before - self.mib
        if len(self._blocks) < own_before and self.device.type == "cuda":
            torch.cuda.empty_cache()  # own blocks' memory back to the driver (pool blocks: _resize_pool's)
        return freed

    def take_lent(self, blocks: int, slots: list[int], reason: str) -> int:
        """A KV pool short of blocks with none free or spillable (KV by use): drop cached blocks that only one of
        `slots` maps, in that order, until `blocks` pool blocks are those slots' own again (to be spilled to the
        host); returns how many are. Only a tier whose blocks are lent by the slots can (`take_back`)."""
        take_back = getattr(self.shared, "take_back", None)
        if blocks <= 0 or take_back is None:
            return 0
        before = self.mib
        # a block pinned past its one mapping is in use this step (an admission copying it, a fill writing it)
        dropped = take_back(blocks, slots, lambda block_id: self.index.pins(block_id) <= 1)
        self.index.discard(dropped)  # their pins go with them: the slots own the blocks now
        if dropped:
            self._publish("shrink", before - self.mib, reason)
        return len(dropped) * self.shared.group

    def set_budget(self, mib: float, reason: str) -> None:
        """Grow or shrink the tier's capacity to `mib` (whole blocks); growth takes own blocks."""
        self._resize_to(self.blocks_for(mib), reason)

    def _resize_to(self, blocks: int, reason: str, pooled: int = 0, pool_first: bool = False) -> None:
        """Resize the index to `blocks` ids; of the ids it adds (preallocated), the first `pooled` go to the
        KV pool, the rest to own blocks. Shrinking keeps the pool's ids last (dropping one may reallocate the
        pool), or, `pool_first`, own ids last."""
        before_cap = self.capacity_blocks
        before_mib = self.mib
        shared = self.shared
        if shared is None:
            result = self.index.resize(blocks)
        else:
            result = self.index.resize(blocks, (lambda b: not shared.is_backed(b)) if pool_first else shared.is_backed)
        for block_id in result.released_block_ids:
            self._blocks.pop(block_id, None)
        added = result.added_block_ids if self.preallocate else []
        drop = [b for b in result.released_block_ids if shared is not None and shared.is_backed(b)]
        if drop or (pooled and added):
            self._resize_pool(added[:pooled], drop)
        own = added[pooled:]
        if own:
            done = self._allocate(own)
            if done < len(own):  # the room ran out while growing: keep what was allocated, hand the rest back
                self.index.drop_free(own[done:])
        after_cap = self.capacity_blocks
        if after_cap == before_cap and self.mib == before_mib:
            return
        if self.preallocate:
            delta = self.mib - before_mib
        else:
            delta = (after_cap - before_cap) * self.block_mib
        self._publish("grow" if delta > 0 else "shrink", abs(delta), reason)

    def _resize_pool(self, added: list[int], drop: list[int]) -> None:
        """Back `added` with pool blocks (as many as the measured room allows next to the one pool tensor a
        reallocation holds twice) and free the pool blocks of `drop`; ids left unbacked go back to the index."""
        if added and self.room_mib is not None and self.block_mib > 0:
            room = self.room_mib() - self.shared.transient_mib(self.shared.num_blocks)
            fits = max(0, int(room // self.block_mib))
            if fits < len(added):
                self.index.drop_free(added[fits:])
                added = added[:fits]
        pool_blocks = self.shared.num_blocks
        try:
            self.shared.set_backing(added, drop)
        except torch.OutOfMemoryError:
            self.index.drop_free(added)
            self.shared.set_backing([], drop)
        if self.device.type == "cuda" and self.shared.num_blocks != pool_blocks:
            torch.cuda.empty_cache()  # the old pool tensors go back to the driver, where the room is measured

    def _allocate(self, block_ids: list[int]) -> int:
        """Back `block_ids` with memory in order, checking the measured room every `room_check_mib`; returns how
        many were allocated (fewer when the room or the device ran out)."""
        group = max(1, int(self.room_check_mib // self.block_mib)) if self.block_mib > 0 else len(block_ids)
        for done, block_id in enumerate(block_ids):
            if self.room_mib is not None and done % group == 0:
                if self.room_mib() < min(group, len(block_ids) - done) * self.block_mib:
                    return done
            try:
                self._block(block_id)
            except torch.OutOfMemoryError:
                return done
        return len(block_ids)

    def _publish(self, action: str, mib: float, reason: str) -> None:
        """TierEvent: `mib` changed by, `total_mib` the budget afterwards (preallocated: the memory held)."""
        self.bus.publish(TierEvent(action=action, mib=round(mib, 4), total_mib=round(self.capacity_mib, 4),
                                   reason=reason, device=str(self.device)))

    def _block(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        block = self._blocks.get(block_id)
        if block is None:
            data = torch.empty(self._data_shape, dtype=self._data_dtype, device=self.device)
            scales = (torch.empty(self._data_shape[:-1], dtype=torch.float32, device=self.device)
                      if self.kv.storage == "int8" else None)
            block = self._blocks[block_id] = (data, scales)
        return block
