"""KV by use (`--kv-pool by-use`, and `--kv-resident`: a guaranteed device window per slot): blocks from a shared pool
as a slot's tokens need them, the pool growing into what the prefix-cache tier gives back (or, on a CPU, into
host memory up to every slot's whole context), host memory as a last resort.

The cache (engine.exec.kv.cache.SlotKVCache) keeps its pools and its device block table; this class decides what
the table says. Before every forward the runner calls `prepare({slot: end_tokens})`:

1. the ledger (engine.exec.kv.blocks) counts the pool blocks the forward's slots lack;
2. if the free pool is short, the prefix-cache tier gives memory back first (`take_memory`, its release path:
   a tier whose blocks are in this pool frees pool blocks, any other frees device memory the pool tensors grow
   into; captured graphs read the old tensors' addresses: `on_resize` drops them), then the pool grows into its
   own headroom (`grow_limit_blocks`: on a CPU, up to every slot's whole context; on CUDA none, the books gave
   the rest to the tier);
3. what is still short is taken from other slots: their blocks are copied to host memory (a spill), and the
   forward's own host-held blocks are copied back (a fetch) into the pool blocks the table then points at; where
   the tier's blocks that running slots map (a prompt they lent it) leave too little, the tier gives those up to
   their slots first (`take_lent`), to be spilled like the rest;
4. the changed table rows are copied into the device table in place, so a captured step replays unchanged.

Copies are whole blocks of every layer, bit for bit: attention reads exactly the KV it would have read with
everything on the device. A spill runs on the compute stream and is waited for (the blocks it frees are reused at
once). A fetch on CUDA is overlapped with the forward, layer by layer: it runs on a copy stream of its own (which
first waits for the compute stream: the destination blocks may still be read by the forward before), one layer's
blocks after another in forward order (main layers, then MTP), with an event recorded after each layer.
`SlotKVCache.attend(layer)` makes the compute stream wait for that layer's event before it writes or reads the
layer's pool, so layer 0 computes while layer 1's blocks are still crossing the bus, and `prepare` returns before
the copies are done. On the CPU a fetch is a plain synchronous copy.

The waits are inside captured CUDA graphs too: the events are external (`torch.cuda.Event(external=True)`), so a
wait captured in a graph becomes an event-wait node on that event, and a replay waits for its latest record, made
by `prepare` outside the graph before the replay. With `--kv-resident` every graph has them, fetch or not (a
replayed wait node costs device time each step: docs/KV.md); without it a fetch follows only a spill, so the
forwards hold no waits (`layer_waits` False) and the compute stream waits for such a fetch whole.

A fetch's time is measured on the copy stream with timing events and published (its `kv` event, PagingStats)
once the copy has completed, at a later `prepare` or `snapshot` (never waited for, except at `free`).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.exec.kv.admission import admission_wait
from engine.exec.kv.blocks import BlockLayout, BlockLedger, Plan
from engine.exec.kv.host import MIB, HostKVStore
from engine.exec.kv.paging_stats import PagingStats, PendingFetch
from engine.exec.cuda_streams import Streams, required
from engine.snapshot import KvPagingSnapshot
from engine.telemetry import EventBus, KvEvent


class KVPaging:
    """The block table's owner under `--kv-resident` (see the module docstring)."""

    def __init__(self, kv, layout: BlockLayout, pool_blocks: int, resident_tokens: int,
                 streams: Streams | None = None, *, bus: EventBus | None = None,
                 take_memory: Callable[[float, str], float] | None = None,
                 take_lent: Callable[[int, list[int], str], int] | None = None,
                 on_resize: Callable[[], None] | None = None, grow_limit_blocks: int = 0,
                 layer_waits: bool = True) -> None:
        """`streams`: the engine's (engine.exec.cuda_streams), whose `kv_copy` stream the fetches run on; needed on
        CUDA (None on a CPU, where a fetch copies in order). `take_memory(mib, reason) -> freed`: memory the
        prefix-cache tier gives back; `take_lent(blocks, slots, reason) -> blocks`: the tier's blocks that only one
        of `slots` maps given back to it (AdaptiveTier.take_lent), for a forward that cannot fit otherwise;
        `on_resize`: what must follow a pool reallocation (graphs dropped, the books' KV figure updated);
        `grow_limit_blocks`: the most pool blocks it may grow to without the tier (KV by use on
        a CPU: every slot's whole context, what the reservation it replaces held; 0: only what the tier gives);
        `layer_waits`: attention waits for its layer's fetch (below); False: a fetch is waited for whole."""
        self.kv = kv
        self.layout = layout
        self.resident_tokens = resident_tokens
        self.ledger = BlockLedger(layout, pool_blocks)
        self.host = HostKVStore(kv.pools(), pinned=kv.device.type == "cuda")
        # one block of every layer (keys, values, int8 scales): a growth adds blocks, never changes a block's size
        self.block_mib = sum(p[:, :1].numel() * p.element_size() for p in kv.pools()) / MIB
        self.stats = PagingStats()
        self.bus = bus
        self.take_memory = take_memory
        self.take_lent = take_lent
        self.on_resize = on_resize
        self.grow_limit_blocks = grow_limit_blocks
        # The held slot's settle (engine.exec.chunk_stream.ChunkStream.settle, handed over with `hold`): waits for
        # the chunk in flight and lifts its hold, for a forward that cannot fit without its blocks.
        self._settle_held: Callable[[], None] | None = None
        self._table = torch.tensor([self.ledger.table_row(s) for s in range(layout.num_slots)], dtype=torch.int32)
        # CUDA only: the fetches' stream, an external event per KV layer (attend's index), the fetches not yet read
        self._copy_stream: torch.cuda.Stream | None = None
        self._layer_fetched: list[torch.cuda.Event] = []
        self._pending: list[PendingFetch] = []
        self.layer_waits = layer_waits
        if kv.device.type == "cuda":
            self._copy_stream = required(streams, kv.device, "KV by use").kv_copy
            # An external event captures as an event-wait node (torch.cuda.Event's `external`, pytorch#155372) on
            # its latest record. Recorded once here: torch creates a CUDA event at its first record and c10's
            # CUDAEvent::block ignores one not yet created (a graph captured before any fetch would get no wait).
            self._layer_fetched = [torch.cuda.Event(external=True) for _ in range(kv.geometry.num_layers)]
            for event in self._layer_fetched:
                event.record(self._copy_stream)

    # --- queries -------------------------------------------------------------------------------------------

    @property
    def host_mib(self) -> float:
        """KV held in host memory now."""
        return self.ledger.host_held_blocks * self.block_mib

    def split_groups(self, groups: list[list[int]], end_tokens: list[int]) -> list[list[int]]:
        """Forwards' rows (indices into end_tokens) split so that each forward's slots fit the pool together,
        after asking the tier for room to keep them whole. The tier's pool blocks that no slot maps are not the
        forward's to count on: those still there after the tier was asked are pinned (a fill this step is
        writing them)."""
        need = sum(self.layout.pool_need(e) for e in end_tokens)
        if need > self.usable_blocks():
            self.grow(need - self.usable_blocks(), "slots addressing more KV than the pool holds")
        usable = self.usable_blocks()
        if need <= usable:
            return groups  # every row of every group fits the pool at once: nothing to split
        out: list[list[int]] = []
        for group in groups:
            used = usable + 1  # forces a new forward for the first row
            for i in group:
                need = self.layout.pool_need(end_tokens[i])
                if used + need > usable:
                    out.append([])
                    used = 0
                out[-1].append(i)
                used += need
        return out

    def usable_blocks(self) -> int:
        """Pool blocks slots can hold: all but the tier's blocks that no slot maps."""
        ledger = self.ledger
        return ledger.pool_blocks - max(0, int(self.kv.tier_blocks) - ledger.mapped_tier_blocks)

    def placement_tokens(self, slot: int, length_tokens: int) -> tuple[int, int, int]:
        return self.ledger.placement_tokens(slot, length_tokens)

    def admission_wait(self, first_chunks_tokens: list[int], decoding_ends: dict[int, int], lookahead_tokens: int,
                       reach_tokens: list[int] | None = None) -> str | None:
        """Why the last of `first_chunks_tokens` should wait (None: admit it): engine.exec.kv.admission."""
        return admission_wait(self, first_chunks_tokens, decoding_ends, lookahead_tokens, reach_tokens or [])

    def snapshot(self) -> KvPagingSnapshot:
        self._finish_fetches(wait=False)
        s = self.stats
        ledger = self.ledger
        used = sum(ledger.used_blocks(slot) for slot in range(self.layout.num_slots))
        return KvPagingSnapshot(
            resident_tokens=self.resident_tokens, pool_blocks=ledger.pool_blocks,
            free_pool_blocks=ledger.free_pool_blocks, used_blocks=used, tier_blocks=int(self.kv.tier_blocks),
            borrowed_blocks=ledger.borrowed_blocks, preemptions=s.preemptions, preemption_cause=s.preemption_cause,
            paused_requests=s.paused_requests,
            block_tokens=self.layout.block_tokens, host_mib=round(self.host_mib, 3),
            host_blocks=self.ledger.host_held_blocks, spilled_mib=round(s.spilled_mib, 3),
            fetched_mib=round(s.fetched_mib, 3), spill_ms=round(s.spill_ms, 3), fetch_ms=round(s.fetch_ms, 3),
            spilled_blocks=s.spilled_blocks, fetched_blocks=s.fetched_blocks)

    # --- commands ------------------------------------------------------------------------------------------

    def prepare(self, wants: dict[int, int]) -> None:
        """Make every block slot s addresses below wants[s] (tokens) live on the device, or on its way there on
        the copy stream (attend waits for each layer: `wait_fetched`); see the module doc."""
        self._finish_fetches(wait=False)
        short = self.ledger.shortfall(wants)
        if short > 0:
            # a spare block a slot: a step that needs the tier is never launched ahead (decode_ahead, maps_only)
            self.grow(short, "the KV pool is short", spare_blocks=len(wants))
            if self._settle_held is not None and self.ledger.needs_held(wants):
                self._settle_held()  # the chunk's kernels are done: its blocks may go to the host like any other
            self._take_lent(wants)
        plan = self.ledger.plan(wants)
        if plan.spills or plan.fetches:
            self._copy(plan)
        if plan.changed_slots:
            self.sync_rows(plan.changed_slots)
        if plan.fetches and not self.layer_waits:  # after the table's pageable copy, which would wait for it
            self.join_fetches()  # no waits in the forward: it starts once the whole fetch has landed

    def _take_lent(self, wants: dict[int, int]) -> None:
        """Where the free and spillable blocks fall short, the tier's blocks other slots map (a prompt they lent it,
        a prefix they reused) become those slots' own, to be spilled: with most of the pool lent to the tier by
        running requests, a forward would otherwise find no block to take."""
        if self.take_lent is None:
            return
        short = self.ledger.shortfall(wants) - self.ledger.spillable(wants)
        if short > 0:
            self.take_lent(short, self.ledger.others_by_use(wants), "the KV pool is short: slots' lent blocks")

    def wait_fetched(self, layer: int) -> None:
        """The current stream waits for `layer`'s blocks of the last fetch (attend, before it writes the layer's
        pool: maybe a partly filled block being fetched); in a capture, the replays' event-wait node."""
        if self._layer_fetched and self.layer_waits:
            torch.cuda.current_stream(self.kv.device).wait_event(self._layer_fetched[layer])

    def join_fetches(self) -> None:
        """The current stream waits for every fetch enqueued so far (pool readers and writers other than attend's
        forwards: the tier's read_span / write_span, a spill, a growth, a forward without layer waits)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.kv.device).wait_stream(self._copy_stream)

    def free(self) -> None:
        """Publish what is pending (waited for: nothing may copy into pools about to go) and drop host memory."""
        try:
            self._finish_fetches(wait=True)
        except RuntimeError:  # the device already failed (Engine.close after a fault): there is nothing to publish
            self._pending.clear()
        self.host.free()

    def retire(self, slot: int) -> None:
        self.ledger.retire(slot)

    def hold(self, slot: int, settle: Callable[[], None] | None = None) -> None:
        """A chunk beside the steps writes the slot's blocks until `unhold`: none of them is spilled meanwhile,
        unless a forward cannot fit without them: then `settle` (it waits for the chunk, then unholds) runs first."""
        self.ledger.hold(slot)
        self._settle_held = settle

    def unhold(self, slot: int) -> None:
        self.ledger.unhold(slot)
        self._settle_held = None

    def on_device(self, slot: int, logical: list[int]) -> bool:
        """Every one of the slot's logical blocks `logical` is in a device pool block it owns (not on the host)."""
        row = self.ledger.table_row(slot)
        return all(row[j] != self.layout.scratch_block for j in logical)

    def maps_only(self, wants: dict[int, int]) -> bool:
        """`prepare(wants)` would copy no block and grow nothing (a step launched ahead may map free blocks, but
        not move blocks or reallocate the pool, which drops the graph it would replay: engine.exec.decode_ahead)."""
        return self.ledger.maps_only(wants)

    def reclaim(self) -> None:
        changed = self.ledger.reclaim()
        if changed:
            self.sync_rows(changed)

    def sync_rows(self, slots: set[int]) -> None:
        """Copy the ledger's rows of `slots` into the device table, in place."""
        for slot in slots:
            self._table[slot] = torch.tensor(self.ledger.table_row(slot), dtype=torch.int32)
        self.kv.block_table.copy_(self._table)  # in place: captured steps read this tensor

    # --- internals -----------------------------------------------------------------------------------------

    def _copy(self, plan: Plan) -> None:
        pools = self.kv.pools()
        if plan.spills:
            moves = plan.spills
            # A spill reads pool blocks a fetch the last forward did not wait for whole may still be writing (an
            # MTP layer's, after a forward of the main layers only).
            self.join_fetches()
            t0 = time.perf_counter()
            self.host.ensure(self.ledger.host_blocks)
            self.host.spill(pools, [m.src for m in moves], [m.dst for m in moves])
            self._sync_device()
            victims = sorted({m.slot for m in moves})
            self.stats.preemptions += len(victims)
            self.stats.preemption_cause = "the pool was short of blocks for a forward's slots"
            self._done("spill", len(moves), len(moves) * self.block_mib, (time.perf_counter() - t0) * 1e3, victims)
        if plan.fetches:
            if self._copy_stream is None:
                self._fetch_now(plan.fetches)
            else:
                self._fetch_overlapped(plan.fetches)

    def _fetch_now(self, moves: list) -> None:
        """The CPU fetch: a plain copy, done when it returns."""
        t0 = time.perf_counter()
        self.host.fetch(self.kv.pools(), [m.src for m in moves], [m.dst for m in moves])
        self._done("fetch", len(moves), len(moves) * self.block_mib, (time.perf_counter() - t0) * 1e3,
                   sorted({m.slot for m in moves}))

    def _fetch_overlapped(self, moves: list) -> None:
        """Enqueue the fetch on the copy stream layer by layer, recording each layer's event; return at once."""
        stream = self._copy_stream
        # The destination blocks may still be read by the forward before this one (and a spill just read them).
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            self.host.fetch(self.kv.pools(), [m.src for m in moves], [m.dst for m in moves],
                            groups=self.kv.pool_groups(),
                            after_group=lambda layer: self._layer_fetched[layer].record(stream))
            end.record(stream)
        self._pending.append(PendingFetch(start, end, len(moves), len(moves) * self.block_mib, self.host_mib,
                                           sorted({m.slot for m in moves})))

    def _finish_fetches(self, wait: bool) -> None:
        """Count and publish the fetches whose copies have completed, in order (one stream runs them); with
        `wait`, all of them."""
        while self._pending and (wait or self._pending[0].end.query()):
            fetch = self._pending.pop(0)
            fetch.end.synchronize()  # at once unless `wait`: query() said it completed
            self._done("fetch", fetch.blocks, fetch.mib, fetch.start.elapsed_time(fetch.end), fetch.slots,
                       fetch.host_mib)

    def _done(self, action: str, blocks: int, mib: float, ms: float, slots: list[int],
              host_mib: float | None = None) -> None:
        """Count a finished spill or fetch in the stats and publish its `kv` event."""
        if action == "spill":
            self.stats.spilled_blocks += blocks
            self.stats.spilled_mib += mib
            self.stats.spill_ms += ms
        else:
            self.stats.fetched_blocks += blocks
            self.stats.fetched_mib += mib
            self.stats.fetch_ms += ms
        reason = "room for a forward's slots" if action == "spill" else "a forward reads them"
        self._publish(action, blocks, mib, ms, slots, reason, host_mib)

    def grow(self, short_blocks: int, reason: str, ask_tier: bool = True, spare_blocks: int = 0) -> None:
        """Make `short_blocks` more pool blocks free: the pool grows into its own headroom first
        (`grow_limit_blocks`: a CPU's, where evicting cached prefixes would buy nothing), then the tier gives back
        (pool blocks, when its blocks are in this pool, or device memory the pool tensors grow into). Nothing
        when neither has any (the caller then spills). `ask_tier` False: the tier itself asks (for its blocks).
        `spare_blocks`: more of the tier's pool blocks, so the next block crossings only map (`maps_only`)."""
        headroom = self.grow_limit_blocks - self.ledger.pool_blocks
        if headroom > 0:
            # geometric: each growth copies the whole pool, so a pool filling up grows a few times, not per block
            blocks = min(headroom, max(short_blocks, self.ledger.pool_blocks // 2))
            if self._resize(blocks, reason):
                short_blocks -= blocks
        block_mib = self.block_mib
        if short_blocks <= 0 or not ask_tier or self.take_memory is None or block_mib <= 0:
            return
        if self.kv.tier_blocks:
            # The tier's blocks in this pool first, and only what is short: one it drops is free pool blocks at
            # once (engine.exec.kv.tier_ledger, AdaptiveTier.release's pool_first), where memory it frees makes
            # the pool grow: every pool tensor copied and every captured graph dropped.
            free_before = self.ledger.free_pool_blocks
            spare_blocks = min(spare_blocks, max(0, int(self.kv.tier_blocks) - short_blocks))  # never own blocks
            self.take_memory((short_blocks + spare_blocks) * block_mib, f"kv pool: {reason}")
            short_blocks -= self.ledger.free_pool_blocks - free_before
            if short_blocks <= 0:
                return
        # Geometric here too: each growth copies the whole pool, drops the captured graphs and waits for the
        # device, and a burst of prompts admitted together is short a few blocks at nearly every step.
        want = max(short_blocks, self.layout.window_blocks, self.ledger.pool_blocks // 2)
        # Growing reallocates one pool tensor at a time: on the device the largest one is briefly held twice.
        transient = 0.0
        if self.kv.device.type == "cuda":
            transient = max(p.numel() * p.element_size() for p in self.kv.pools()) / MIB
        free_before = self.ledger.free_pool_blocks
        freed = self.take_memory(want * block_mib + transient, f"kv pool: {reason}")
        gained = self.ledger.free_pool_blocks - free_before  # tier blocks that were in this pool: free now
        freed -= gained * block_mib
        blocks = min(want - gained, int(max(0.0, freed - transient) // block_mib))
        if blocks > 0:
            self._resize(blocks, reason)

    def extend(self, blocks: int, reason: str) -> bool:
        """Grow the pool tensors by `blocks` free blocks, past the headroom (the tier backing its blocks with memory
        it has checked is free); False when the device ran out."""
        return blocks <= 0 or self._resize(blocks, reason)

    def _resize(self, blocks: int, reason: str) -> bool:
        """Grow the pool tensors by `blocks` blocks; False when the device ran out (no size changed then)."""
        self.join_fetches()  # the old tensors are copied, then freed: no fetch may still be writing them
        t0 = time.perf_counter()
        try:  # a growth put back part-way moved tensors too: `on_resize` drops the graphs that read them
            self.kv.resize_pool(self.layout.pool_base + self.ledger.pool_blocks + blocks, failed_move=self.on_resize)
        except torch.OutOfMemoryError:
            return False  # no size changed; the forward spills instead
        self.ledger.add_pool(blocks)
        self.stats.grown_blocks += blocks
        if self.on_resize is not None:
            self.on_resize()
        self._sync_device()
        self._publish("grow", blocks, blocks * self.block_mib, (time.perf_counter() - t0) * 1e3, [], reason)
        return True

    def _sync_device(self) -> None:
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)

    def _publish(self, action: str, blocks: int, mib: float, ms: float, slots: list[int], reason: str,
                 host_mib: float | None = None) -> None:
        if self.bus is not None:
            host_mib = self.host_mib if host_mib is None else host_mib
            self.bus.publish(KvEvent(action=action, blocks=blocks, tokens=blocks * self.layout.block_tokens,
                                     mib=round(mib, 4), ms=round(ms, 3), host_mib=round(host_mib, 4),
                                     slots=slots, reason=reason, device=str(self.kv.device)))
