"""Whether KV by use admits the next queued request (engine.core.scheduler's admission gate), or why it waits.

Two checks, the second only when the first admits:
1. **Room now**: the request's first chunk and the decoding slots' next step fit in free pool blocks, the pool's own
   headroom or the prefix tier's blocks in the pool, never in running requests' blocks (a spill to the host would
   preempt them for a request that could as well wait in the queue).
2. **Room at their ends**: the requests running, those admitted this step and this one, each at its end (prompt +
   max_tokens), fit in what the pool can reach (its blocks, its headroom, the tier's blocks no slot maps) and the
   host memory spilled KV may take (engine.exec.kv.host.HostKVStore.reachable_blocks). Past it, a later step
   would find the host full (`HostKVFull`) and end every request in it; waiting in the queue loses nothing.
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
