"""The prefix-cache tier's blocks in a KV pool whose slots take blocks by use (engine.exec.kv.blocks.BlockLedger),
so a reused prefix is still shared by reference, not copied.

The same interface as engine.exec.kv.tier_pool.SharedTierBlocks (what engine.exec.kv.tier.AdaptiveTier calls),
over one allocator instead of two: a tier block id is backed by `group` pool blocks taken from the ledger's free
pool, and a dropped one gives them back to it. Nothing is reallocated to drop a tier block, nor to back one while
the pool has free blocks (past them it grows: a CPU's headroom, `KVPaging.grow`, else by the memory the tier
checked is free, `KVPaging.extend`, as the reserved pool does), and the slots' KV and the tier share one pool:
whatever the slots do not use, the tier may back blocks with, and a tier block it drops is a block a slot can
take.

- **Reuse** (`map`): the slot borrows the tier block's pool blocks for its prompt blocks (its row points at them).
- **Hand-over** (`hand_over`): a prompt block the slot has just computed is lent to the tier: the tier block is
  backed by the slot's pool blocks (the slot keeps reading them, borrowed), and the pool blocks that backed it
  before go back to the free pool. A block spilled to the host since it was computed is not handed over (the
  tier's fill reports it failed).
- **Take back** (`take_back`): a forward short of pool blocks, with nothing left free or spillable, has the tier
  drop blocks that only one running slot maps (the prompt it lent, or a prefix it reused): the slot owns them
  again, so they can go to the host like its other blocks. The cached prefix is lost; no request is.
- **Retire / reclaim**: the slot's row is released by the ledger (`KVPaging.reclaim`); here only the refs it
  mapped are returned, for the tier to unpin.

Used where the tier lives on the compute device, there is no resident window (`--kv-resident` unset: the window
blocks are fixed per slot and a prefix cannot be borrowed into them) and a tier block is whole pool blocks.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.exec.kv.block_index import BlockRef

MIB = float(1 << 20)


class LedgerTierBlocks:
    """Tier block ids backed by pool blocks of the slots' ledger (see the module doc)."""

    # A hand-over backs the tier block with the slot's own blocks: backing it first would take free pool blocks
    # only to give them back, and past the free ones grow the pool (a copy of all of it) for nothing.
    backs_before_hand_over = False
    # A tier block dropped gives its pool blocks to the free list, nothing reallocated: what a pool short of
    # blocks takes first (AdaptiveTier.release's pool_first).
    gives_pool_blocks_back = True

    def __init__(self, kv, tier_block_tokens: int) -> None:
        paging = kv.paging
        if paging is None or paging.layout.resident_blocks or tier_block_tokens % kv.geometry.block_tokens:
            raise ValueError("tier blocks share a by-use pool only without a resident window, in whole pool blocks")
        self.kv = kv
        self.paging = paging
        self.ledger = paging.ledger
        self.group = tier_block_tokens // kv.geometry.block_tokens
        self.backing: dict[int, list[int]] = {}
        self.mapped: list[dict[int, BlockRef]] = [{} for _ in range(kv.geometry.num_slots)]
        self._retired: set[int] = set()
        self.on_resize: Callable[[], None] | None = None  # the pool's own (KVPaging.on_resize) drops the graphs

    # --- queries -------------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.kv.k[0].shape[1] if self.kv.k else 0

    def is_backed(self, block_id: int) -> bool:
        return block_id in self.backing

    def physical(self, block_id: int) -> list[int]:
        return list(self.backing[block_id])

    def transient_mib(self, num_blocks: int) -> float:
        """What a pool growth holds twice: the largest pool tensor at `num_blocks` blocks (0 off CUDA)."""
        if self.kv.device.type != "cuda":
            return 0.0
        return max(t[:, :1].numel() * t.element_size() for t in self.kv.pools()) * num_blocks / MIB

    # --- reuse, hand-over, release ---------------------------------------------------------------------------

    def map(self, slot: int, refs: list[BlockRef]) -> None:
        if self.mapped[slot] or slot in self._retired:
            raise RuntimeError(f"slot {slot} still maps tier blocks of its last request")
        g = self.group
        blocks = {ref.index * g + i: p for ref in refs for i, p in enumerate(self.backing[ref.block_id])}
        self.ledger.borrow(slot, blocks)
        for ref in refs:
            self.mapped[slot][ref.index] = ref
        self.paging.sync_rows({slot})

    def hand_over(self, slot: int, refs: list[BlockRef]) -> list[BlockRef]:
        """Lend the slot's computed blocks of each ref to the tier; returns the refs that could not be (a block
        of theirs is on the host now)."""
        g = self.group
        refused: list[BlockRef] = []
        for ref in refs:
            if ref.index in self.mapped[slot]:
                raise RuntimeError(f"slot {slot} already maps prompt block {ref.index}")
            logical = list(range(ref.index * g, (ref.index + 1) * g))
            if not self.paging.on_device(slot, logical):
                refused.append(ref)
                continue
            lent = self.ledger.lend(slot, logical)
            old = self.backing.get(ref.block_id, [])
            self.backing[ref.block_id] = [lent[j] for j in logical]
            self.ledger.give_blocks(old)
            self.mapped[slot][ref.index] = ref
        self.kv.tier_blocks = g * len(self.backing)
        return refused  # the rows are unchanged: the slot maps the very blocks it wrote

    def take_back(self, blocks: int, slots: list[int], only: Callable[[int], bool]) -> list[int]:
        """Drop tier blocks that only one of `slots` maps (in that order; a slot's last prompt blocks first) and
        `only(tier id)` allows, until `blocks` pool blocks are the slots' own again; returns the dropped tier ids
        (the tier forgets them)."""
        g, ledger = self.group, self.ledger
        dropped: list[int] = []
        for slot in slots:
            if len(dropped) * g >= blocks:
                break
            for index, ref in sorted(self.mapped[slot].items(), reverse=True):
                if len(dropped) * g >= blocks:
                    break
                physical = self.backing.get(ref.block_id, [])
                if not physical or not only(ref.block_id) or not all(ledger.sole_borrower(p) for p in physical):
                    continue
                ledger.unlend(slot, list(range(index * g, (index + 1) * g)))
                del self.backing[ref.block_id], self.mapped[slot][index]
                dropped.append(ref.block_id)
        self.kv.tier_blocks = g * len(self.backing)
        return dropped

    def retire(self, slot: int) -> None:
        self._retired.add(slot)

    def reclaim(self) -> list[BlockRef]:
        """The retired slots' mapped refs (their rows are released by the ledger's own reclaim)."""
        released: list[BlockRef] = []
        for slot in sorted(self._retired):
            released += self.unmap(slot)
        return released

    def unmap(self, slot: int, sync: bool = True) -> list[BlockRef]:
        released = list(self.mapped[slot].values())
        self.mapped[slot] = {}
        self._retired.discard(slot)
        return released

    # --- backing ---------------------------------------------------------------------------------------------

    def set_backing(self, add: list[int], drop: list[int]) -> None:
        """Back the tier ids `add` with free pool blocks (growing the pool when they are short: OutOfMemoryError
        when it cannot, nothing changed) and give the pool blocks of `drop` (none may be mapped) back."""
        add = [b for b in add if b not in self.backing]
        drop = [b for b in drop if b in self.backing]
        mapped = {ref.block_id for m in self.mapped for ref in m.values()}
        if mapped.intersection(drop):
            raise RuntimeError(f"tier blocks {sorted(mapped.intersection(drop))} are mapped by a slot; they cannot "
                               "lose their pool blocks")
        for b in drop:
            self.ledger.give_blocks(self.backing.pop(b))
        need = self.group * len(add)
        if need > self.ledger.free_pool_blocks:
            reason = "the prefix-cache tier backs its blocks"
            with torch.inference_mode(False):
                self.paging.grow(need - self.ledger.free_pool_blocks, reason, ask_tier=False)  # a CPU's headroom
                # past it (CUDA): memory the tier has checked is free, as the reserved pool's tier blocks take it
                self.paging.extend(need - self.ledger.free_pool_blocks, reason)
            if need > self.ledger.free_pool_blocks:
                self.kv.tier_blocks = self.group * len(self.backing)
                raise torch.OutOfMemoryError(f"the KV pool has {self.ledger.free_pool_blocks} free blocks; the tier "
                                             f"asked for {need}")
        for b in add:
            self.backing[b] = self.ledger.take_blocks(self.group)
        self.kv.tier_blocks = self.group * len(self.backing)

    def forget(self) -> None:
        for blocks in self.backing.values():
            self.ledger.give_blocks(blocks)
        self.backing.clear()
        self.mapped = [{} for _ in self.mapped]
        self._retired.clear()
        self.kv.tier_blocks = 0
