"""The prefix tier's blocks the scheduler holds for its requests (engine.core.scheduler.Scheduler owns one when it has
a prefix index).

A prompt is hashed once, at admission, into its chain of block digests: its chunks extend the cached prefix block
by block, and rehashing a 176K-token prompt for every chunk would be quadratic. Two kinds of pins keep tier blocks
from being handed back (a tier shrink) while the runner still uses them:

- the cached prefix an admission copies into its slot: pinned from the admission until the runner has copied it
  (`release`) or the step ends (`end_step`);
- the blocks a chunk's cache fill writes: pinned from the plan until the step ends. A request aborted or failed
  inside the step has them discarded instead (`forget`): the chunk behind the fill may never have run.
"""

from __future__ import annotations

from engine.core.prefix_index import PrefixIndex, block_digests
from engine.core.request import Request
from engine.step import BlockRef, CacheFill, PrefillChunk


class PrefixPins:
    """Each running request's digest chain, its copy pins and its fill pins, over one PrefixIndex."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.block_tokens = index.block_tokens
        self._awaiting_copy: list[Request] = []  # admitted last step: their prefix pins drop next step
        # Tier blocks handed out for filling last step, by request: unpinned next step or when it finishes.
        self._fill_pins: dict[str, list[int]] = {}
        self._next_fill_block: dict[str, int] = {}
        self._digests: dict[str, list[bytes]] = {}

    def admit(self, req: Request) -> list[BlockRef]:
        """The longest cached prefix of `req`'s prompt, pinned until it is copied into the slot."""
        digests = block_digests(req.prompt_token_ids, self.block_tokens)
        self._digests[req.request_id] = digests
        # All but the last prompt token: its logits are needed, so its KV is always computed.
        blocks = self.index.match_digests(digests[:(req.num_prompt_tokens - 1) // self.block_tokens])
        self.index.pin(ref.block_id for ref in blocks)
        self._awaiting_copy.append(req)
        self._next_fill_block[req.request_id] = len(blocks)
        return blocks

    def plan_fill(self, req: Request, chunk: PrefillChunk) -> CacheFill | None:
        """The tier blocks `chunk` completes, inserted and pinned until the runner has filled them."""
        first_new_block = self._next_fill_block.get(req.request_id, 0)
        full_blocks = chunk.end // self.block_tokens
        if full_blocks <= first_new_block:
            return None
        digests = self._digests[req.request_id]
        refs = self.index.insert_digests(digests[:full_blocks], first_new_block)
        self._next_fill_block[req.request_id] = full_blocks
        if chunk.is_last:
            del self._digests[req.request_id]  # no block of this prompt is left to insert
        if not refs:
            return None
        # Until the runner has filled them: a tier shrink during the step must not hand these ids back.
        fill_ids = [ref.block_id for ref in refs]
        self.index.pin(fill_ids)
        self._fill_pins[req.request_id] = fill_ids
        return CacheFill(req, chunk.slot, refs)

    def release(self, req: Request) -> None:
        """`req`'s cached prefix has been copied into its slot (or it finished): unpin it."""
        if req.blocks_pinned:
            self.index.unpin(ref.block_id for ref in req.cached_blocks)
        req.blocks_pinned = False

    def forget(self, req: Request, work_lost: bool) -> None:
        """`req` finished: its chain goes; with `work_lost` (aborted or failed inside the step) so do the blocks of
        this step's fill. A fill the runner still makes lands in a free id, which is written again before any
        later match can return it."""
        if work_lost:
            self.index.discard(self._fill_pins.pop(req.request_id, []))
        self._next_fill_block.pop(req.request_id, None)
        self._digests.pop(req.request_id, None)

    def end_step(self) -> None:
        """The runner has run the last plan, its copies and its cache fills: drop the pins that protected them."""
        for req in self._awaiting_copy:
            self.release(req)
        self._awaiting_copy.clear()
        for block_ids in self._fill_pins.values():
            self.index.unpin(block_ids)
        self._fill_pins.clear()
