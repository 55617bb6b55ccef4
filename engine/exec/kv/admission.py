"""Whether KV by use admits the next queued request (engine.core.scheduler's admission gate), or why it waits.

Two checks, the second only when the first admits:
1. **Room now**: the request's first chunk and the decoding slots' next step fit in free pool blocks, the pool's own
   headroom or the prefix tier's blocks in the pool, never in running requests' blocks (a spill to the host would
   preempt them for a request that could as well wait in the queue).
2. **Room at their ends**: the requests running, those admitted this step and this one, each at its end (prompt +
   max_tokens), fit in what the pool can reach (its blocks, its headroom, the tier's blocks no slot maps) and the
   host memory spilled KV may take (engine.exec.kv.host.HostKVStore.reachable_blocks). Past it, a later step
   would find the host full (`HostKVFull`) and end every request in it; waiting in the queue loses nothing.

Once admitted, requests decode every step while their blocks fit the pool together; past it, `rows_that_fit`
picks the rows a step decodes, oldest request first, and the others pause with their KV where it is.
"""

from __future__ import annotations

from typing import Any


def admission_wait(paging: Any, first_chunks_tokens: list[int], decoding_ends: dict[int, int],
                   lookahead_tokens: int, reach_tokens: list[int]) -> str | None:
    """Why the last of `first_chunks_tokens` (the first chunks of the requests a step admits) should wait (None:
    admit it). `decoding_ends`: slot -> tokens it will hold after the decoding slots' next step; `reach_tokens`:
    the final length of every request running or admitted, this one last (empty: the first check only). The
    requests that ended since the last step count as gone: the step gives their blocks back (`reclaim`) before it
    maps any block of the ones it admits."""
    ledger, layout = paging.ledger, paging.layout
    bt = layout.block_tokens
    need = ledger.missing_blocks({slot: end + lookahead_tokens for slot, end in decoding_ends.items()})
    need += sum(max(0, -(-(tokens + lookahead_tokens) // bt) - layout.resident_blocks)
                for tokens in first_chunks_tokens)
    freed_pool, freed_tier = ledger.retired_room()
    unmapped_tier = int(paging.kv.tier_blocks) - ledger.mapped_tier_blocks  # a running slot's are not the tier's
    headroom = max(0, paging.grow_limit_blocks - ledger.pool_blocks)
    room = ledger.free_pool_blocks + freed_pool + headroom + max(0, unmapped_tier + freed_tier)
    if need > room:
        return (f"KV pool full: {room} blocks free or reclaimable, {need} needed for the next prompt's first chunk "
                f"and the decoding slots' next step")
    if not reach_tokens:
        return None
    device = ledger.pool_blocks + headroom + max(0, unmapped_tier)
    # at least what the exact count below gives, in one sum: a burst asks once per request it admits
    if (sum(reach_tokens) + len(reach_tokens) * (lookahead_tokens + bt)) // bt <= device:
        return None  # every request fits the pool at its end: no need to ask the host (most steps, every CPU)
    reach = sum(layout.pool_need(tokens + lookahead_tokens) for tokens in reach_tokens)
    if reach <= device:
        return None
    host = paging.host.reachable_blocks()
    if reach <= device + host:
        return None
    return (f"KV full at the requests' ends: the running requests and the next reach {reach} blocks, the pool "
            f"holds {device} and host memory {host} more")


def rows_that_fit(paging: Any, rows: list[tuple[int, int, float]], chunks: list[tuple[int, int]]) -> list[int]:
    """The decoding rows one step runs (indices into `rows`: each row's slot, tokens after the step (lookahead
    included) and arrival time): every row where their blocks fit the pool together (the pool asked to grow
    first); otherwise the oldest requests that fit beside the prompt `chunks` ((slot, end) each: this step's, and
    one in flight beside the steps), at least the oldest. A prefix the tier lends several slots counts once. The
    others pause a step with their KV where it is, and the forwards that need room spill theirs first (the least
    recently used). Forwards that each spilled the other rows' blocks and fetched their own moved a burst's whole
    KV across PCIe every step."""
    ledger, layout = paging.ledger, paging.layout
    # at least what the exact count below gives, in one sum: every step asks (its own blocks <= its pool need)
    bound = sum(layout.pool_need(row[1]) for row in rows + chunks) + ledger.mapped_tier_blocks
    if bound <= paging.usable_blocks():
        return list(range(len(rows)))
    needs = [ledger.own_need(slot, tokens) for slot, tokens, _ in rows]
    held = ledger.mapped_tier_blocks + sum(ledger.own_need(slot, end) for slot, end in chunks)
    short = sum(needs) + held - paging.usable_blocks()
    if short > 0:
        paging.grow(short, "slots addressing more KV than the pool holds")
    room = paging.usable_blocks() - held
    if sum(needs) <= room:
        return list(range(len(rows)))
    kept, used = [], 0
    order = sorted(range(len(rows)), key=lambda i: (rows[i][2], rows[i][0]))
    for i in order:
        if used + needs[i] <= room:
            kept.append(i)
            used += needs[i]
    return sorted(kept) if kept else [order[0]]
