"""Who holds which KV block when slots take blocks by use (`--kv-pool by-use`, the default on CPU, and
`--kv-resident`): the ledger behind the block table. Pure Python (no torch), so it is unit-tested in
milliseconds; engine.exec.kv.paging does the copies it plans.

Physical blocks of the device pool (`BlockLayout`):

    [0, slots * resident_blocks)   each slot's resident window: its logical blocks 0..resident_blocks-1, fixed
    scratch_block                  one block every unmapped or host-held logical block of the context points at:
                                   nothing writes it, so it stays finite (a query at position p sees keys <= p, and
                                   p is always mapped, but attention reads masked keys too, and 0 * NaN is NaN)
    sink_block                     every slot's margin past the context points at it: padded batch rows write
                                   there (whatever they compute, NaN included) and no real row reads it
    [pool_base, ...)               the shared pool: handed to slots on demand, grown from the tier, spilled

A logical block past the resident window is unmapped, on the device (a pool block), or on the host (a host
block). `plan(wants)` makes every block a forward's slots address up to their end live on the device: free
pool blocks first, then blocks of *other* slots spilled to the host (least recently used slot first, its lowest
blocks first). A forward never spills its own slots' blocks, so it needs `sum(pool_need)` pool blocks at most:
the runner splits forwards so that this fits (`engine.exec.runner.ModelRunner.span_groups`).

With no resident window the prefix-cache tier's blocks live in the same pool (engine.exec.kv.tier_ledger): the
ledger hands the tier pool blocks (`take_blocks` / `give_blocks`), a slot *borrows* the tier's blocks of a reused
prefix (`borrow`: mapped in its row, never spilled nor freed by it) and *lends* the blocks it computed to the tier
(`lend`: they stop being the slot's own). A slot whose chunk runs beside the steps is `hold`-ed: its blocks are
never spilled while the chunk may write them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class BlockLayout:
    """The static shape of a paged cache: slots, logical blocks per slot, the resident window, block size."""

    num_slots: int
    blocks_per_slot: int  # logical blocks a slot addresses (context + scratch margin)
    context_blocks: int  # logical blocks holding positions < context (past them: scratch only)
    resident_blocks: int  # per slot: logical blocks [0, resident_blocks) own fixed device blocks
    block_tokens: int

    @property
    def scratch_block(self) -> int:
        return self.num_slots * self.resident_blocks

    @property
    def sink_block(self) -> int:
        return self.scratch_block + 1

    @property
    def pool_base(self) -> int:
        return self.scratch_block + 2

    @property
    def window_blocks(self) -> int:
        """Pool blocks one slot can need: its context past the resident window (the pool's minimum size)."""
        return max(0, self.context_blocks - self.resident_blocks)

    def device_blocks(self, pool_blocks: int) -> int:
        return self.pool_base + pool_blocks

    def blocks_for(self, end_tokens: int) -> int:
        """Logical blocks covering positions [0, end_tokens) that can hold a real token (< context)."""
        return min(self.context_blocks, -(-max(0, end_tokens) // self.block_tokens))

    def pool_need(self, end_tokens: int) -> int:
        """Pool blocks a slot addressing positions [0, end_tokens) holds on the device during its forward."""
        return max(0, self.blocks_for(end_tokens) - self.resident_blocks)


class Where(Enum):
    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class Move:
    """One block copy: a spill (device pool block -> host block) or a fetch (host block -> device pool block)."""

    slot: int
    logical: int
    src: int
    dst: int


@dataclass
class Plan:
    """What `BlockLedger.plan` decided: copies to make (spills before fetches) and the table rows that changed."""

    spills: list[Move] = field(default_factory=list)
    fetches: list[Move] = field(default_factory=list)
    changed_slots: set[int] = field(default_factory=set)


class PoolTooSmall(RuntimeError):
    """A forward's slots need more pool blocks than the pool has (the runner splits forwards so this cannot)."""


class BlockLedger:
    """Owner of every pool and host block id; the block table's rows are derived from it (`table_row`)."""

    def __init__(self, layout: BlockLayout, pool_blocks: int) -> None:
        self.layout = layout
        self.pool_blocks = 0
        self.host_blocks = 0  # host block ids handed out so far (the host store's size)
        self._free_pool: list[int] = []
        self._free_host: list[int] = []
        self._owned: list[dict[int, tuple[Where, int]]] = [{} for _ in range(layout.num_slots)]
        # A slot's mapped blocks are always [resident_blocks, top): plan maps a window whole, and only release
        # unmaps. With its host-held ones, that makes "nothing to do" (every decode step) O(1) per slot.
        self._top = [layout.resident_blocks] * layout.num_slots
        self._on_host: list[set[int]] = [set() for _ in range(layout.num_slots)]
        self._last_use = [0] * layout.num_slots
        self._clock = 0
        self._retired: set[int] = set()
        self._borrowed: list[dict[int, int]] = [{} for _ in range(layout.num_slots)]  # logical -> tier's pool block
        self._borrowers: dict[int, int] = {}  # a tier's pool block some slot maps -> how many slots map it
        self._held: set[int] = set()  # slots whose blocks a chunk beside the steps may be writing: never spilled
        self.add_pool(pool_blocks)

    # --- queries -------------------------------------------------------------------------------------------

    @property
    def free_pool_blocks(self) -> int:
        return len(self._free_pool)

    @property
    def host_held_blocks(self) -> int:
        return self.host_blocks - len(self._free_host)

    def used_blocks(self, slot: int) -> int:
        """Pool blocks the slot holds on the device (borrowed tier blocks not counted: the tier holds them)."""
        return len(self._owned[slot]) - len(self._on_host[slot])

    @property
    def borrowed_blocks(self) -> int:
        """Table entries that point at a tier block (one tier block shared by n slots counts n times)."""
        return sum(len(b) for b in self._borrowed)

    @property
    def mapped_tier_blocks(self) -> int:
        """Distinct tier pool blocks some slot maps: the tier cannot give them to the pool while they are mapped."""
        return len(self._borrowers)

    def own_need(self, slot: int, end_tokens: int) -> int:
        """Pool blocks of its own the slot holds on the device during a forward addressing [0, end_tokens) (at least
        its tokens so far): its pool need less the tier's blocks it borrows, all of them prompt blocks below its
        end (they stay in the pool, counted once, whoever runs). Constant time: asked for every row every step."""
        return max(0, self.layout.pool_need(end_tokens) - len(self._borrowed[slot]))

    def sole_borrower(self, block: int) -> bool:
        """Exactly one slot maps the tier's pool block `block`."""
        return self._borrowers.get(block) == 1

    def spillable(self, wants: dict[int, int]) -> int:
        """Device pool blocks `plan(wants)` may spill to the host (`_victims`)."""
        return len(self._victims(wants))

    def others_by_use(self, wants: dict[int, int]) -> list[int]:
        """The slots a forward of `wants` may take blocks from (not in it, not held), least recently used first."""
        return sorted((s for s in range(self.layout.num_slots) if s not in wants and s not in self._held),
                      key=lambda s: self._last_use[s])

    def missing_blocks(self, wants: dict[int, int]) -> int:
        """Pool blocks `plan(wants)` would map (logical blocks below each slot's end that are not on the device)."""
        return sum(len(self._missing(slot, end)) for slot, end in wants.items())

    def shortfall(self, wants: dict[int, int]) -> int:
        """Pool blocks `plan(wants)` would have to take from other slots (0: the free pool covers it)."""
        return max(0, sum(len(self._missing(slot, end)) for slot, end in wants.items()) - len(self._free_pool))

    def needs_held(self, wants: dict[int, int]) -> bool:
        """`plan(wants)` cannot find its blocks without spilling a held slot's (a chunk beside the steps holds it)."""
        if not self._held:
            return False
        needed = sum(len(self._missing(slot, end)) for slot, end in wants.items())
        return needed - len(self._free_pool) > len(self._victims(wants))

    def maps_only(self, wants: dict[int, int]) -> bool:
        """`plan(wants)` would copy nothing (no spill, no fetch) and need no pool growth: at most free blocks
        mapped into the table (what a step launched ahead of the one in flight may do)."""
        missing = 0
        for slot, end in wants.items():
            top = self.layout.blocks_for(end)
            if any(j < top for j in self._on_host[slot]):
                return False
            missing += max(0, top - self._top[slot])
        return missing <= len(self._free_pool)

    def table_row(self, slot: int) -> list[int]:
        """Physical block of each of the slot's logical blocks (scratch where unmapped or on the host, the sink past
        the context)."""
        lay = self.layout
        row = [lay.scratch_block] * lay.context_blocks + [lay.sink_block] * (lay.blocks_per_slot - lay.context_blocks)
        for j in range(min(lay.resident_blocks, lay.blocks_per_slot)):
            row[j] = slot * lay.resident_blocks + j
        for j, (where, idx) in self._owned[slot].items():
            if where is Where.DEVICE:
                row[j] = idx
        for j, idx in self._borrowed[slot].items():
            row[j] = idx
        return row

    def placement_tokens(self, slot: int, length_tokens: int) -> tuple[int, int, int]:
        """(resident, pooled, host) tokens of the slot's first `length_tokens` positions."""
        # Every slot's telemetry (each snapshot, each progress event) asks: the resident window in closed form,
        # and only the blocks the slot maps are visited.
        bt = self.layout.block_tokens
        length = max(0, length_tokens)
        resident = min(length, self.layout.resident_blocks * bt)
        pooled = host = 0
        for j, (where, _) in self._owned[slot].items():
            held = min(bt, length - j * bt)
            if held > 0:
                if where is Where.DEVICE:
                    pooled += held
                else:
                    host += held
        for j in self._borrowed[slot]:
            held = min(bt, length - j * bt)
            if held > 0:
                pooled += held
        return resident, pooled, host

    # --- commands ------------------------------------------------------------------------------------------

    def add_pool(self, count: int) -> list[int]:
        """`count` more pool blocks (the pool tensors grew): their physical ids."""
        base = self.layout.pool_base + self.pool_blocks
        ids = list(range(base, base + count))
        self.pool_blocks += count
        self._free_pool.extend(reversed(ids))  # pop() hands out the lowest first
        return ids

    def plan(self, wants: dict[int, int]) -> Plan:
        """Make every block slot s addresses below wants[s] (tokens) live on the device; returns the copies."""
        self._clock += 1
        for slot in wants:
            self._last_use[slot] = self._clock
        plan = Plan()
        needed = [(slot, j) for slot, end in wants.items() for j in self._missing(slot, end)]
        short = len(needed) - len(self._free_pool)
        if short > 0:
            victims = self._victims(wants)
            if len(victims) < short:
                raise PoolTooSmall(f"the forward needs {len(needed)} more pool blocks; {len(self._free_pool)} are "
                                   f"free and {len(victims)} can be spilled (pool {self.pool_blocks} blocks)")
            for slot, j in victims[:short]:
                _, pid = self._owned[slot][j]
                hid = self._take_host()
                self._owned[slot][j] = (Where.HOST, hid)
                self._on_host[slot].add(j)
                self._free_pool.append(pid)
                plan.spills.append(Move(slot, j, pid, hid))
                plan.changed_slots.add(slot)
        for slot, j in needed:
            pid = self._free_pool.pop()
            held = self._owned[slot].get(j)
            if held is not None:  # on the host: bring it back
                plan.fetches.append(Move(slot, j, held[1], pid))
                self._free_host.append(held[1])
                self._on_host[slot].discard(j)
            self._owned[slot][j] = (Where.DEVICE, pid)
            self._top[slot] = max(self._top[slot], j + 1)
            plan.changed_slots.add(slot)
        return plan

    def release(self, slot: int) -> bool:
        """Give back every pool and host block of the slot (its request ended) and forget what it borrowed; True
        when its row changes."""
        owned = self._owned[slot]
        for where, idx in owned.values():
            (self._free_pool if where is Where.DEVICE else self._free_host).append(idx)
        borrowed = self._borrowed[slot]
        self._count_borrowers(borrowed.values(), -1)
        self._owned[slot] = {}
        self._borrowed[slot] = {}
        self._top[slot] = self.layout.resident_blocks
        self._on_host[slot] = set()
        self._retired.discard(slot)
        self._held.discard(slot)
        return bool(owned) or bool(borrowed)

    # --- the tier's blocks in the pool (engine.exec.kv.tier_ledger) and chunks beside the steps ---------------

    def take_blocks(self, count: int) -> list[int]:
        """`count` free pool blocks for the tier (fewer when the free pool is shorter)."""
        count = min(count, len(self._free_pool))
        return [self._free_pool.pop() for _ in range(count)]

    def give_blocks(self, block_ids: list[int]) -> None:
        """Pool blocks the tier no longer backs a block with: free again."""
        self._free_pool.extend(sorted(block_ids, reverse=True))

    def borrow(self, slot: int, blocks: dict[int, int]) -> None:
        """Map the slot's logical blocks (a reused prefix from 0 on, past its resident window) at the tier's pool
        blocks: read, never written, spilled or freed by the slot."""
        if self._owned[slot] or self._borrowed[slot]:
            raise RuntimeError(f"slot {slot} still holds blocks of its last request")
        if any(j < self.layout.resident_blocks for j in blocks):
            raise RuntimeError("a borrowed block inside the resident window")
        self._borrowed[slot] = dict(blocks)
        self._count_borrowers(blocks.values(), 1)
        self._top[slot] = max([self._top[slot], *(j + 1 for j in blocks)])

    def lend(self, slot: int, logical: list[int]) -> dict[int, int]:
        """The slot's computed blocks become the tier's (it keeps mapping them, borrowed): returns {logical:
        pool block} of those on the device; blocks spilled to the host since are not lent."""
        lent: dict[int, int] = {}
        for j in logical:
            held = self._owned[slot].get(j)
            if held is None or held[0] is not Where.DEVICE:
                continue
            del self._owned[slot][j]
            self._borrowed[slot][j] = held[1]
            lent[j] = held[1]
        self._count_borrowers(lent.values(), 1)
        return lent

    def unlend(self, slot: int, logical: list[int]) -> None:
        """The tier gives the slot's borrowed blocks `logical` up (it drops the tier block they back): they are the
        slot's own again, on the device, so a plan may spill them like any other."""
        for j in logical:
            block = self._borrowed[slot].pop(j)
            self._owned[slot][j] = (Where.DEVICE, block)
            self._count_borrowers([block], -1)

    def hold(self, slot: int) -> None:
        self._held.add(slot)

    def unhold(self, slot: int) -> None:
        self._held.discard(slot)

    def retire(self, slot: int) -> None:
        """The slot's request finished: its blocks are given back at the next `reclaim` (the engine calls it when
        a step starts), so what the step still copies from the slot (the tier's fill after its last chunk) stays
        valid until then."""
        self._retired.add(slot)

    def retired_room(self) -> tuple[int, int]:
        """What the next `reclaim` gives back: the pool blocks retired slots hold on the device, and the tier's pool
        blocks that only retired slots map (the tier may then give them to the pool)."""
        pool = sum(self.used_blocks(slot) for slot in self._retired)
        mapping = Counter(block for slot in self._retired for block in self._borrowed[slot].values())
        return pool, sum(1 for block, n in mapping.items() if self._borrowers.get(block) == n)

    def reclaim(self) -> set[int]:
        """Release every retired slot now; returns the slots whose table rows changed."""
        changed = {slot for slot in list(self._retired) if self.release(slot)}
        self._retired.clear()
        return changed

    # --- internals -----------------------------------------------------------------------------------------

    def _missing(self, slot: int, end: int) -> list[int]:
        """Logical blocks below `end` tokens that are not on the device: host-held ones, then unmapped ones."""
        top = self.layout.blocks_for(end)
        first = self._top[slot]
        # a decoding slot maps a new block every 64 tokens at most: most steps skip the comprehension
        unmapped = [j for j in range(first, top) if j not in self._borrowed[slot]] if top > first else []
        if not self._on_host[slot]:  # nothing spilled (every decoding slot, most steps): no sort, no concatenation
            return unmapped
        return sorted(j for j in self._on_host[slot] if j < top) + unmapped

    def _count_borrowers(self, blocks, delta: int) -> None:
        for block in blocks:
            count = self._borrowers.get(block, 0) + delta
            if count > 0:
                self._borrowers[block] = count
            else:
                self._borrowers.pop(block, None)

    def _victims(self, wants: dict[int, int]) -> list[tuple[int, int]]:
        """Device pool blocks a plan may spill: other slots' (least recently used slot first, lowest block
        first), then this forward's slots' blocks past what it addresses."""
        out: list[tuple[int, int]] = []
        for slot in self.others_by_use(wants):
            out += [(slot, j) for j in sorted(self._owned[slot]) if self._owned[slot][j][0] is Where.DEVICE]
        for slot, end in wants.items():
            top = self.layout.blocks_for(end)
            out += [(slot, j) for j in sorted(self._owned[slot])
                    if j >= top and self._owned[slot][j][0] is Where.DEVICE]
        return out

    def _take_host(self) -> int:
        if self._free_host:
            return self._free_host.pop()
        self.host_blocks += 1
        return self.host_blocks - 1
