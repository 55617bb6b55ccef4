"""`--kv-resident`: a guaranteed device window per slot, the rest from a shared pool, host memory as a last resort.

The cache (engine.exec.kv_cache.SlotKVCache) keeps its pools and its device block table; this class decides what
the table says. Before every forward the runner calls `prepare({slot: end_tokens})`:

1. the ledger (engine.exec.kv_blocks) counts the pool blocks the forward's slots lack;
2. if the free pool is short, the prefix-cache tier gives memory back first (`take_memory`, its release path)
   and the pool tensors grow into it (captured graphs read the old tensors' addresses: `on_resize` drops them);
3. what is still short is taken from other slots: their blocks are copied to host memory (a spill), and the
   forward's own host-held blocks are copied back (a fetch) into the pool blocks the table then points at;
4. the changed table rows are copied into the device table in place, so a captured step replays unchanged.

Copies are whole blocks of every layer, bit for bit: attention reads exactly the KV it would have read with
everything on the device. They run on the compute stream before the forward (no overlap yet: streaming a
layer's blocks while the previous layer computes is a follow-up, docs/KV.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.exec.kv_blocks import BlockLayout, BlockLedger, Plan
from engine.exec.kv_host import MIB, HostKVStore
from engine.telemetry import EventBus, KvEvent


@dataclass
class PagingStats:
    """Totals since start (the snapshot's `kv` section and the Prometheus counters)."""

    spilled_blocks: int = 0
    fetched_blocks: int = 0
    spilled_mib: float = 0.0
    fetched_mib: float = 0.0
    spill_ms: float = 0.0
    fetch_ms: float = 0.0
    grown_blocks: int = 0


class KVPaging:
    """The block table's owner under `--kv-resident` (see the module docstring)."""

    def __init__(self, kv, layout: BlockLayout, pool_blocks: int, resident_tokens: int) -> None:
        self.kv = kv
        self.layout = layout
        self.resident_tokens = resident_tokens
        self.ledger = BlockLedger(layout, pool_blocks)
        self.host = HostKVStore(kv.pools(), pinned=kv.device.type == "cuda")
        self.stats = PagingStats()
        self.bus: EventBus | None = None
        # Set by the engine builder once the tier exists: memory the tier gives back (MiB asked, reason) -> freed,
        # and what must follow a pool reallocation (graphs dropped, the books' KV figure updated).
        self.take_memory: Callable[[float, str], float] | None = None
        self.on_resize: Callable[[], None] | None = None
        self._table = torch.tensor([self.ledger.table_row(s) for s in range(layout.num_slots)], dtype=torch.int32)

    # --- queries -------------------------------------------------------------------------------------------

    @property
    def block_mib(self) -> float:
        """One block of every layer (keys, values, int8 scales)."""
        return sum(p[:, :1].numel() * p.element_size() for p in self.kv.pools()) / MIB

    @property
    def host_mib(self) -> float:
        """KV held in host memory now."""
        return self.ledger.host_held_blocks * self.block_mib

    def split_groups(self, groups: list[list[int]], end_tokens: list[int]) -> list[list[int]]:
        """Forwards' rows (indices into end_tokens) split so that each forward's slots fit the pool together,
        after asking the tier for room to keep them whole. One slot always fits: the pool is never smaller
        than one slot's window."""
        short = sum(self.layout.pool_need(e) for e in end_tokens) - self.ledger.pool_blocks
        if short > 0:
            self._grow_from_tier(short, "slots addressing more KV than the pool holds")
        out: list[list[int]] = []
        for group in groups:
            used = self.ledger.pool_blocks + 1  # forces a new forward for the first row
            for i in group:
                need = self.layout.pool_need(end_tokens[i])
                if used + need > self.ledger.pool_blocks:
                    out.append([])
                    used = 0
                out[-1].append(i)
                used += need
        return out

    def placement_tokens(self, slot: int, length_tokens: int) -> tuple[int, int, int]:
        return self.ledger.placement_tokens(slot, length_tokens)

    def snapshot(self) -> dict:
        s = self.stats
        return {"resident_tokens": self.resident_tokens, "pool_blocks": self.ledger.pool_blocks,
                "free_pool_blocks": self.ledger.free_pool_blocks, "block_tokens": self.layout.block_tokens,
                "host_mib": round(self.host_mib, 3), "host_blocks": self.ledger.host_held_blocks,
                "spilled_mib": round(s.spilled_mib, 3), "fetched_mib": round(s.fetched_mib, 3),
                "spill_ms": round(s.spill_ms, 3), "fetch_ms": round(s.fetch_ms, 3),
                "spilled_blocks": s.spilled_blocks, "fetched_blocks": s.fetched_blocks}

    # --- commands ------------------------------------------------------------------------------------------

    def prepare(self, wants: dict[int, int]) -> None:
        """Make every block slot s addresses below wants[s] (tokens) live on the device; see the module doc."""
        short = self.ledger.shortfall(wants)
        if short > 0:
            self._grow_from_tier(short, "the KV pool is short")
        plan = self.ledger.plan(wants)
        if plan.spills or plan.fetches:
            self._copy(plan)
        if plan.changed_slots:
            self._sync_rows(plan.changed_slots)

    def retire(self, slot: int) -> None:
        self.ledger.retire(slot)

    def reclaim(self) -> None:
        changed = self.ledger.reclaim()
        if changed:
            self._sync_rows(changed)

    # --- internals -----------------------------------------------------------------------------------------

    def _sync_rows(self, slots: set[int]) -> None:
        for slot in slots:
            self._table[slot] = torch.tensor(self.ledger.table_row(slot), dtype=torch.int32)
        self.kv.block_table.copy_(self._table)  # in place: captured steps read this tensor

    def _copy(self, plan: Plan) -> None:
        pools, bt = self.kv.pools(), self.layout.block_tokens
        for action, moves in (("spill", plan.spills), ("fetch", plan.fetches)):
            if not moves:
                continue
            t0 = time.perf_counter()
            if action == "spill":
                self.host.ensure(self.ledger.host_blocks)
                self.host.spill(pools, [m.src for m in moves], [m.dst for m in moves])
            else:
                self.host.fetch(pools, [m.src for m in moves], [m.dst for m in moves])
            self._sync_device()
            ms = (time.perf_counter() - t0) * 1e3
            mib = len(moves) * self.block_mib
            if action == "spill":
                self.stats.spilled_blocks += len(moves)
                self.stats.spilled_mib += mib
                self.stats.spill_ms += ms
            else:
                self.stats.fetched_blocks += len(moves)
                self.stats.fetched_mib += mib
                self.stats.fetch_ms += ms
            self._publish(action, len(moves), mib, ms, sorted({m.slot for m in moves}),
                          "room for a forward's slots" if action == "spill" else "a forward reads them")

    def _grow_from_tier(self, short_blocks: int, reason: str) -> None:
        """Ask the tier for `short_blocks` (at least one slot's window) of pool memory and grow into what it
        gave; nothing when it has none (the caller then spills)."""
        if self.take_memory is None:
            return
        want = max(short_blocks, self.layout.window_blocks)
        block_mib = self.block_mib
        # Growing reallocates one pool tensor at a time: on the device the largest one is briefly held twice.
        transient = 0.0
        if self.kv.device.type == "cuda":
            transient = max(p.numel() * p.element_size() for p in self.kv.pools()) / MIB
        freed = self.take_memory(want * block_mib + transient, f"kv pool: {reason}")
        blocks = min(want, int(max(0.0, freed - transient) // block_mib)) if block_mib > 0 else 0
        if blocks <= 0:
            return
        t0 = time.perf_counter()
        try:
            self.kv.grow_pool(self.layout.pool_base + self.ledger.pool_blocks + blocks)
        except torch.OutOfMemoryError:
            return  # the tensors that did grow keep their (unused) rows; the forward spills instead
        self.ledger.add_pool(blocks)
        self.stats.grown_blocks += blocks
        if self.on_resize is not None:
            self.on_resize()
        self._sync_device()
        self._publish("grow", blocks, blocks * block_mib, (time.perf_counter() - t0) * 1e3, [], reason)

    def _sync_device(self) -> None:
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)

    def _publish(self, action: str, blocks: int, mib: float, ms: float, slots: list[int], reason: str) -> None:
        if self.bus is not None:
            self.bus.publish(KvEvent(action=action, blocks=blocks, tokens=blocks * self.layout.block_tokens,
                                     mib=round(mib, 4), ms=round(ms, 3), host_mib=round(self.host_mib, 4),
                                     slots=slots, reason=reason, device=str(self.kv.device)))
