"""The slot table at --batch 256: the busiest slots (prefilling first, then decoding by rate) and one row counting
the rest by state, in a real Textual app; a refresh of the same slots touches no cell."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult

from engine.telemetry import SlotEvent
from strata_tui.widgets.slot_cells import MAX_SLOT_ROWS, REST_KEY, busiest
from strata_tui.widgets.slots_table import SlotsTable


def _slots(n: int) -> dict[int, SlotEvent]:
    slots = {}
    for i in range(n):
        if i % 64 == 5:
            slots[i] = SlotEvent(slot=i, state="prefill", request_id=f"p{i}", prompt_tokens=4000, prefilled_tokens=100,
                                 prefill_tok_s=5000.0)
        elif i < 200:
            slots[i] = SlotEvent(slot=i, state="decode", request_id=f"d{i}", prompt_tokens=100, max_tokens=256,
                                 generated_tokens=10, decode_tok_s=float(i))
        else:
            slots[i] = SlotEvent(slot=i)
    return slots


def test_the_busiest_are_prefilling_then_the_fastest_decoding_and_the_rest_are_counted() -> None:
    slots = _slots(256)
    shown, left = busiest(slots)
    assert len(shown) == MAX_SLOT_ROWS - 1 and shown == sorted(shown)
    prefilling = [n for n in slots if slots[n].state == "prefill"]
    assert set(prefilling) <= set(shown)
    decoding_shown = [n for n in shown if slots[n].state == "decode"]
    assert min(decoding_shown) > max(n for n in slots if slots[n].state == "decode" and n not in shown)
    assert left["idle"] == 56 and sum(left.values()) == 256 - len(shown)
    assert busiest(_slots(6)) == (list(range(6)), {})


class _One(App):
    def compose(self) -> ComposeResult:
        yield SlotsTable()


async def test_a_256_slot_table_is_one_screen_with_a_row_counting_the_rest() -> None:
    app = _One()
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(SlotsTable)
        slots = _slots(256)
        table.show(slots)
        await pilot.pause()
        assert table.row_count == MAX_SLOT_ROWS
        keys = [row.key.value for row in table.ordered_rows]
        assert keys[-1] == REST_KEY and keys[:-1] == sorted(keys[:-1], key=int)
        rest = table.get_row(REST_KEY)
        assert str(rest[1]) == f"+{256 - MAX_SLOT_ROWS + 1}" and "56 idle" in "".join(str(c) for c in rest)
        before = table.cell_updates
        table.show(slots)
        assert table.cell_updates == before  # nothing changed, nothing touched


def test_the_slots_title_says_what_the_kv_pool_holds() -> None:
    from engine.snapshot import KvPagingSnapshot
    from strata_tui.widgets.slot_cells import slots_title

    assert slots_title(None) == "Slots"  # every slot holds its whole context: no pool to show
    pool = KvPagingSnapshot(pool_blocks=1024, free_pool_blocks=600, used_blocks=400, tier_blocks=24,
                            borrowed_blocks=9, host_blocks=0)
    assert slots_title(pool) == "Slots · KV pool 41 % of 1,024 blocks: 400 used, 600 free, tier 24 (9 shared)"
    spilled = KvPagingSnapshot(pool_blocks=64, free_pool_blocks=0, used_blocks=64, host_blocks=12, preemptions=3)
    assert slots_title(spilled) == "Slots · KV pool 100 % of 64 blocks: 64 used, 0 free, 12 on host · 3 preempted"
    assert slots_title(spilled, "KV pool full: 0 blocks free or reclaimable, 2 needed") == (
        "Slots · KV pool 100 % of 64 blocks: 64 used, 0 free, 12 on host · 3 preempted · queue waits for blocks")
    paused = KvPagingSnapshot(pool_blocks=64, free_pool_blocks=0, used_blocks=64, host_blocks=12, preemptions=3,
                              paused_requests=2)
    assert slots_title(paused) == (
        "Slots · KV pool 100 % of 64 blocks: 64 used, 0 free, 12 on host · 3 preempted · 2 paused for blocks")


async def test_the_pool_read_by_the_state_poll_reaches_the_slots_title(config_dir) -> None:
    """What `workers.poll_state` posts, through the reducer, is drawn in the slots panel's title at 100x30; an
    engine that answers no pool (every slot holds its context) shows `Slots` again."""
    from engine.snapshot import EngineSnapshot
    from strata_tui.engine_io.messages import KvPoolSnapshot
    from tests.tui.conftest import offline_app, screen_text, wait_for

    app = offline_app(config_dir)
    async with app.run_test(size=(100, 30)) as pilot:
        # as `poll_state` reads it from /strata/state: the typed snapshot's `kv.paging` and `queue.admission_wait`
        state = {"kv": {"paging": {"pool_blocks": 256, "free_pool_blocks": 0, "used_blocks": 250, "tier_blocks": 6,
                                   "borrowed_blocks": 2, "paused_requests": 3}},
                 "queue": {"admission_wait": "KV pool full: 0 blocks free or reclaimable, 2 needed"}}
        snapshot = EngineSnapshot.from_json(state)
        app.post_message(KvPoolSnapshot(snapshot.kv.paging, snapshot.queue.admission_wait))
        await wait_for(pilot, lambda: "KV pool 100 % of 256 blocks" in screen_text(app), what="the pool drawn")
        assert app.screen.query_one(SlotsTable).border_title.endswith("3 paused for blocks · queue waits for blocks")
        app.post_message(KvPoolSnapshot(None))
        await wait_for(pilot, lambda: app.screen.query_one(SlotsTable).border_title == "Slots", what="no pool")


async def test_the_pool_is_read_while_requests_run_and_once_after_not_while_idle() -> None:
    """`workers.poll_state` asks the engine once a second only while a slot holds a request, and once more after
    the last one ends (the blocks it gave back); an idle engine's pool does not change, so it is not asked."""
    import pytest

    from strata_tui.engine_io.messages import KvPoolSnapshot
    from strata_tui.engine_io.workers import poll_state

    states = iter([False, True, True, False] + [False] * 8)  # busy() at each turn of the poll's loop

    def busy() -> bool:
        try:
            return next(states)
        except StopIteration:
            raise asyncio.CancelledError from None

    class Engine:
        reads = 0

        async def state(self) -> dict:
            self.reads += 1
            return {"kv": {"paging": {"pool_blocks": 8, "free_pool_blocks": 8 - self.reads}}, "queue": {}}

    engine, posted = Engine(), []
    with pytest.raises(asyncio.CancelledError):
        await poll_state(posted.append, engine, interval_s=0.0, dense_interval_s=1e9, busy=busy)
    # the first turn (what the engine has), two while busy, one after the last request: then 8 idle turns, no read
    assert engine.reads == 4
    assert [m.paging.free_pool_blocks for m in posted if isinstance(m, KvPoolSnapshot)] == [7, 6, 5, 4]
