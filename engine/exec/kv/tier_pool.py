"""The prefix-cache tier's blocks inside the KV pool, so a reused prefix is shared by reference, not copied.

Used when the tier lives on the compute device, every slot owns its whole context (no `--kv-resident`), and a
tier block is a whole number of pool blocks (256-token tier blocks = 4 pool blocks of 64). The pool tensors of
every layer (engine.exec.kv.cache.SlotKVCache: `[Hkv, num_blocks, 64, D]`, int8 scales alike) then hold both:

    home[s][j]     the physical block slot s writes its logical block j to (at start: `s * blocks_per_slot + j`)
    backing[b]     the `group` physical blocks of tier block id b (its tokens [256 i, 256 i + 256) of a prompt)

Every physical block is exactly one home block or one tier block. A slot's table row points logical block j at
its home block, except where the slot *maps* a tier block: `mapped[s][i]` (the BlockRef of tier block b)
sends logical blocks `i*group .. i*group + group-1` to `backing[b]`. The slot only reads those (a slot writes at positions past its
computed prompt: rejected drafts, padded rows and the margin scratch included, docs/KV.md), so many slots can
map one tier block.

- **Reuse** (`map`): an admitted request's cached prefix blocks are mapped: a table update, no KV copied.
- **Hand-over** (`hand_over`): a prompt block the slot has just computed becomes a tier block by swapping
  physical ids: the tier block takes the slot's home blocks (holding the KV) and the slot's home becomes the
  tier block's old blocks. The slot's row does not change (it maps the block it computed), no KV is copied.
- **Unmap** (`unmap`): the request ended; the row points at the slot's home blocks again.
- **Resize** (`set_backing`): tier ids gain or lose physical blocks. The pool tensors are reallocated to
  `homes + group * backed ids` blocks, one tensor at a time; when shrinking, live blocks above the new end move
  into freed ones below it first, and a tensor goes through host memory when the device has no room for the
  new one next to the old one. The table is rewritten in place; captured graphs, which hold the old tensors' addresses, are
  dropped by `on_resize`.

Pins (the prefix index's) are the tier's business (engine.exec.kv.tier.AdaptiveTier): a mapped tier block is
pinned, so eviction and shrinking never take a block a slot maps.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.exec.kv.block_index import BlockRef

MIB = float(1 << 20)
_MOVE_BLOCKS = 256  # blocks one compaction copy moves (its scratch: that many blocks of one pool tensor)


class SharedTierBlocks:
    """Block bookkeeping and pool resizing for a tier whose blocks live in the KV pool (see the module doc)."""

    # A hand-over swaps the slot's blocks with the tier block's own: the tier block must be backed first.
    backs_before_hand_over = True
    # Dropping a tier block's backing reallocates the pool tensors: never what a short pool asks for first.
    gives_pool_blocks_back = False

    def __init__(self, kv, tier_block_tokens: int, on_resize: Callable[[], None] | None = None) -> None:
        """`on_resize`: what must follow a pool reallocation (captured graphs read the old tensors: dropped)."""
        g = kv.geometry
        if kv.paging is not None or tier_block_tokens % g.block_tokens:
            raise ValueError("tier blocks share the pool only without --kv-resident and in whole pool blocks")
        self.kv = kv
        self.group = tier_block_tokens // g.block_tokens
        bps = g.blocks_per_slot
        self.home = [list(range(s * bps, (s + 1) * bps)) for s in range(g.num_slots)]
        self.backing: dict[int, list[int]] = {}
        self.mapped: list[dict[int, BlockRef]] = [{} for _ in range(g.num_slots)]  # slot -> {prompt block: ref}
        self._retired: set[int] = set()
        self._table = kv.block_table.to("cpu", copy=True)
        self.on_resize = on_resize

    # --- queries -------------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Physical blocks the pool tensors hold: every slot's home blocks and the backed tier blocks."""
        return self.kv.geometry.num_blocks + self.group * len(self.backing)

    def is_backed(self, block_id: int) -> bool:
        return block_id in self.backing

    def physical(self, block_id: int) -> list[int]:
        return list(self.backing[block_id])

    def row(self, slot: int) -> list[int]:
        """The slot's table row: home blocks, with the mapped tier blocks' physical blocks over them."""
        row = list(self.home[slot])
        for i, ref in self.mapped[slot].items():
            row[i * self.group:(i + 1) * self.group] = self.backing[ref.block_id]
        return row

    def transient_mib(self, num_blocks: int) -> float:
        """Device memory a reallocation holds twice at once: the largest pool tensor at `num_blocks` blocks (growing,
        the old tensors are freed one by one as their larger copies are made)."""
        return max(t[:, :1].numel() * t.element_size() for t in self._tensors()) * num_blocks / MIB

    # --- reuse, hand-over, release ---------------------------------------------------------------------------

    def map(self, slot: int, refs: list[BlockRef]) -> None:
        """Point the slot's logical blocks of each ref's prompt block at the tier block (admission reuse)."""
        if self.mapped[slot] or slot in self._retired:
            raise RuntimeError(f"slot {slot} still maps tier blocks of its last request")
        for ref in refs:
            self.mapped[slot][ref.index] = ref
        self._sync({slot})

    def hand_over(self, slot: int, refs: list[BlockRef]) -> None:
        """The slot's computed prompt blocks become the (backed) tier blocks `refs` name: physical ids swap."""
        g = self.group
        for ref in refs:
            if ref.index in self.mapped[slot]:
                raise RuntimeError(f"slot {slot} already maps prompt block {ref.index}")
            homes = self.home[slot][ref.index * g:(ref.index + 1) * g]
            self.home[slot][ref.index * g:(ref.index + 1) * g] = self.backing[ref.block_id]
            self.backing[ref.block_id] = homes
            self.mapped[slot][ref.index] = ref
        # the row is unchanged: the slot maps the very blocks it wrote

    def retire(self, slot: int) -> None:
        """The slot's request finished: its mappings go at the next `reclaim` (a fill after its last chunk may
        still hand its blocks over in the same step)."""
        self._retired.add(slot)

    def reclaim(self) -> list[BlockRef]:
        """Unmap every retired slot; returns the refs they mapped (one per mapping: the tier unpins them)."""
        released: list[BlockRef] = []
        changed = set(self._retired)
        for slot in sorted(changed):
            released += self.unmap(slot, sync=False)
        if released:
            self._sync(changed)
        return released

    def unmap(self, slot: int, sync: bool = True) -> list[BlockRef]:
        released = list(self.mapped[slot].values())
        self.mapped[slot] = {}
        self._retired.discard(slot)
        if released and sync:
            self._sync({slot})
        return released

    # --- resize ----------------------------------------------------------------------------------------------

    def set_backing(self, add: list[int], drop: list[int]) -> None:
        """Back the tier ids `add` with pool blocks and free those of `drop` (none may be mapped); reallocates
        the pool tensors to the new size. On an out-of-memory while growing, no size changes and it raises (the
        tensors that grew were put back at new addresses: `on_resize` runs then too)."""
        add = [b for b in add if b not in self.backing]
        drop = [b for b in drop if b in self.backing]
        if not add and not drop:
            return
        mapped = {ref.block_id for m in self.mapped for ref in m.values()}
        if mapped.intersection(drop):
            raise RuntimeError(f"tier blocks {sorted(mapped.intersection(drop))} are mapped by a slot; they cannot "
                               "lose their pool blocks")
        # The pool tensors stay normal tensors (not inference tensors) whichever mode the caller runs in: the
        # release paths run outside inference mode and update them in place.
        with torch.inference_mode(False):
            reallocated = self._set_backing(add, drop)
        if reallocated and self.on_resize is not None:
            self.on_resize()

    def _set_backing(self, add: list[int], drop: list[int]) -> bool:
        old_n = self.num_blocks
        new_n = old_n + self.group * (len(add) - len(drop))
        if new_n > old_n:
            self._reallocate(new_n, stage=False)  # all or nothing in size: out of memory changed no size
        free = sorted(p for b in drop for p in self.backing.pop(b))
        fresh = iter(range(old_n, max(old_n, new_n)))
        for b in add:
            take, free = free[:self.group], free[self.group:]
            self.backing[b] = take + [next(fresh) for _ in range(self.group - len(take))]
        if new_n < old_n:
            self._compact(new_n, [p for p in free if p < new_n])
            self._reallocate(new_n, stage=True)
        self.kv.tier_blocks = self.group * len(self.backing)
        self._sync(set(range(len(self.home))))
        return new_n != old_n

    def forget(self) -> None:
        """The engine closes: drop the bookkeeping (the KV cache frees the tensors)."""
        self.backing.clear()
        self.mapped = [{} for _ in self.mapped]
        self._retired.clear()
        self.kv.tier_blocks = 0

    # --- internals -------------------------------------------------------------------------------------------

    def _tensors(self) -> list[torch.Tensor]:
        return self.kv.pools()

    def _compact(self, new_n: int, holes: list[int]) -> None:
        """Move every live block at or past `new_n` into a free block below it (`holes`), bit for bit."""
        owners = [(lst, j) for lst in self.home + list(self.backing.values()) for j, p in enumerate(lst) if p >= new_n]
        assert len(owners) == len(holes), "compaction: live blocks past the end must match the holes below it"
        if not owners:
            return
        src = torch.tensor([lst[j] for lst, j in owners], dtype=torch.long, device=self.kv.device)
        dst = torch.tensor(holes, dtype=torch.long, device=self.kv.device)
        for t in self._tensors():
            for i in range(0, len(holes), _MOVE_BLOCKS):  # a bounded copy at a time: a shrink may run short of memory
                t.index_copy_(1, dst[i:i + _MOVE_BLOCKS], t.index_select(1, src[i:i + _MOVE_BLOCKS]))
        for (lst, j), hole in zip(owners, holes):
            lst[j] = hole

    def _reallocate(self, num_blocks: int, stage: bool) -> None:
        self.kv.resize_pool(num_blocks, stage, failed_move=self.on_resize)  # a failure part-way moved tensors too

    def _sync(self, slots: set[int]) -> None:
        for slot in slots:
            self._table[slot] = torch.tensor(self.row(slot), dtype=torch.int32)
        self.kv.block_table.copy_(self._table)  # in place: captured steps read this tensor

