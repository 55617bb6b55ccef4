"""What the app renders and asks while the engine is busy: work per refresh follows what changed, not how
many events came, and the events' values arrive exact (CPU itself is measured by benchmarks/bench_tui.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from rich.text import Text
from textual.app import App
from textual.widgets import DataTable

from engine.telemetry import AdmissionEvent, SlotEvent
from strata_tui.engine_io.messages import EngineLiveness, TelemetryBatch
from strata_tui.engine_io.workers import watch_liveness
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from strata_tui.state.reducer import reduce
from strata_tui.state.view_state import ViewState
from strata_tui.widgets.slots_table import SlotsTable
from tests.tui.conftest import offline_app, recorded, wait_for


@pytest.fixture
def seeded_dir(tmp_path: Path) -> Path:
    ProfileStore(tmp_path).save(Profile("seed"))
    return tmp_path


def _decoding(generated: dict[int, int]) -> dict[int, SlotEvent]:
    return {n: SlotEvent(slot=n, state="decode", request_id=f"busy-{n}", prompt_tokens=512, prefilled_tokens=512,
                         generated_tokens=g, max_tokens=4096, decode_tok_s=30.0 + n, acceptance=0.7)
            for n, g in generated.items()}


def _progress(table: SlotsTable, row: str) -> str:
    """The row's progress cell as text, "" while the row is not drawn yet."""
    return table.get_cell(row, "progress").plain if row in table.rows else ""


class _TableApp(App):
    def compose(self):
        yield SlotsTable()


class _ViewApp(App):
    """A slots table handed the view state, with no screen to pass anything down to it."""

    def __init__(self) -> None:
        super().__init__()
        self.view = ViewState(mode="attached")

    def compose(self):
        yield SlotsTable(self.view, lambda: 0.0)


async def test_the_slots_table_reads_its_slice_of_the_view_state_on_its_own_tick() -> None:
    """An event folded into the view state by the reducer reaches its cells with no screen relaying it; a tick
    with nothing new touches no cell."""
    app = _ViewApp()
    async with app.run_test(size=(160, 20)) as pilot:
        table = app.query_one(SlotsTable)
        events = [AdmissionEvent(request_id="busy-2", slot=2, prompt_tokens=512, seq=1),
                  *_decoding({2: 40}).values()]
        reduce(app.view, TelemetryBatch(events), 0.0, 0.0)
        await wait_for(pilot, lambda: "40/4,096" in _progress(table, "2"), what="the first tick")
        assert "last admission: busy-2 → slot 2" in str(table.border_subtitle)
        drawn = table.cell_updates
        await pilot.pause(app.view.settings.refresh_s * 3)
        assert table.cell_updates == drawn, "a quiet tick touched cells"
        reduce(app.view, TelemetryBatch(list(_decoding({2: 41}).values())), 0.0, 0.0)
        await wait_for(pilot, lambda: "41/4,096" in _progress(table, "2"), what="the next tick")


async def test_a_refresh_renders_only_the_rows_that_changed(monkeypatch) -> None:
    """DataTable rendered every cell of the table through Rich again after any one cell changed: six decoding
    slots cost some seventy cell renders a refresh. A row is now rendered once when it changes."""
    renders = []
    text_render = Text.render

    def counted_render(self, *args, **kwargs):
        renders.append(self.plain)
        return text_render(self, *args, **kwargs)

    monkeypatch.setattr(Text, "render", counted_render)
    app = _TableApp()
    async with app.run_test(size=(160, 20)) as pilot:
        table = app.query_one(SlotsTable)
        generated = {n: 10 for n in range(6)}
        table.show(_decoding(generated))
        await wait_for(pilot, lambda: sum("10/4,096" in r for r in renders) >= 6, what="the six rows rendered")
        await pilot.pause(0.1)
        renders.clear()
        for _ in range(50):  # a burst of events for slot 3, folded into one refresh
            generated[3] += 1
        table.show(_decoding(generated))
        await wait_for(pilot, lambda: renders, what="the changed row rendered")
        await pilot.pause(0.1)
        assert len(renders) == 1, renders
        assert "60/4,096" in renders[0] and renders[0].lstrip().startswith("3 ")
        assert "60/4,096" in table.get_cell("3", "progress").plain
        renders.clear()
        await pilot.pause(0.1)
        table.refresh()  # a repaint with nothing new renders nothing again
        await pilot.pause(0.1)
        assert renders == []


async def test_the_slots_table_looks_as_datatable_draws_it(seeded_dir) -> None:
    """The table draws its own lines; character for character, colour and weight, they are DataTable's
    (header, zebra stripes, the row cursor), focused or not, at each width's set of columns."""
    for size in ((160, 48), (100, 30), (200, 55)):
        app = offline_app(seeded_dir, profile="seed")
        async with app.run_test(size=size) as pilot:
            app.clock = lambda: 1000.0
            app.post_message(TelemetryBatch(recorded("seed_run.jsonl")))
            table = app.screen.query_one(SlotsTable)
            await wait_for(pilot, lambda: table.row_count == 8, what="the slots drawn")
            app.screen.redraw(force=True)
            await pilot.pause(0.2)
            for focused in (False, True):
                if focused:
                    table.focus()
                    await pilot.pause(0.1)
                table._pseudo_class_state = table.get_pseudo_class_state()  # as DataTable.render_lines sets it
                for y in range(table.size.height):
                    ours, theirs = _cells(table.render_line(y)), _cells(DataTable.render_line(table, y))
                    assert ours == theirs, (size, focused, y)


def _cells(strip) -> list[tuple]:
    return [(ch, seg.style.color, seg.style.bgcolor, bool(seg.style.bold), bool(seg.style.italic),
             bool(seg.style.dim)) for seg in strip for ch in seg.text]


class _Client:
    """What watch_liveness reads of a TelemetryClient: the stream's last bytes, and /health."""

    def __init__(self) -> None:
        self.last_data_s: float | None = None
        self.probes = 0
        self.answer = True

    async def health(self, timeout_s: float | None = None) -> tuple[bool, str]:
        self.probes += 1
        if not self.answer:
            await asyncio.sleep(timeout_s or 0)
            raise OSError("no answer")
        return True, "ready"


async def test_no_health_probe_while_the_event_stream_flows_and_a_silent_engine_is_still_seen() -> None:
    client, news = _Client(), []
    # silence_s well above any stall a loaded machine puts on this loop: the stream must keep the probe away
    worker = asyncio.create_task(watch_liveness(news.append, client, interval_s=0.05, silence_s=1.5))

    async def stream() -> None:  # a busy engine: bytes on the stream every 10 ms
        while True:
            client.last_data_s = time.monotonic()
            await asyncio.sleep(0.01)

    feeding = asyncio.create_task(stream())
    await asyncio.sleep(2.0)
    assert client.probes == 1, "only the first probe (whether it answers at all); the stream says the rest"
    assert [n.answering for n in news] == [True]
    feeding.cancel()
    client.answer = False  # the engine stops: no more bytes, and /health does not answer
    stopped_s = time.monotonic()
    while len(news) < 2 and time.monotonic() - stopped_s < 10:
        await asyncio.sleep(0.01)
    worker.cancel()
    assert [n.answering for n in news] == [True, False] and isinstance(news[1], EngineLiveness)
    assert client.probes >= 2, "once the stream went quiet, /health was asked again"


async def test_a_click_on_a_row_still_moves_the_row_cursor() -> None:
    app = _TableApp()
    async with app.run_test(size=(160, 20)) as pilot:
        table = app.query_one(SlotsTable)
        table.show(_decoding({n: 10 for n in range(6)}))
        await pilot.pause(0.1)
        assert table.cursor_row == 0
        await pilot.click(SlotsTable, offset=(3, 4))  # the header is line 0: line 4 is slot 3's row
        await wait_for(pilot, lambda: table.cursor_row == 3, what="the clicked row")


class _Stream:
    """What stream_telemetry reads of a TelemetryClient: a connection's state, then batches of events."""

    engine_restarts = 0

    def __init__(self, batches: int) -> None:
        self.batches = batches

    async def state(self) -> dict:
        return {"instance_id": "x"}

    async def events(self, on_status, on_connect):
        await on_connect()
        on_status(True, "connected")
        seq = 0
        for _ in range(self.batches):  # a busy engine: a read every 5 ms
            await asyncio.sleep(0.005)
            batch = []
            for slot in range(6):
                seq += 1
                batch.append(SlotEvent(slot=slot, state="decode", generated_tokens=seq, seq=seq))
            yield batch
        on_status(False, "event stream ended")
        await asyncio.sleep(3600)


async def test_a_burst_of_reads_is_posted_in_few_batches_with_every_event_in_order() -> None:
    from strata_tui.engine_io.messages import StateSnapshot, TelemetryStatus
    from strata_tui.engine_io.telemetry_client import stream_telemetry

    posted: list = []
    worker = asyncio.create_task(stream_telemetry(posted.append, _Stream(100), batch_s=0.1))
    while not any(isinstance(m, TelemetryStatus) and not m.connected for m in posted):
        await asyncio.sleep(0.01)
    worker.cancel()
    batches = [m for m in posted if isinstance(m, TelemetryBatch)]
    assert [e.seq for m in batches for e in m.events] == list(range(1, 601)), "every event, in order"
    assert len(batches) < 100 / 2, f"{len(batches)} messages for 100 reads"
    kinds = [type(m) for m in posted]
    assert kinds[0] is StateSnapshot and kinds[1] is TelemetryStatus and kinds[-1] is TelemetryStatus
    assert kinds.index(TelemetryStatus, 2) == len(kinds) - 1, "the events before the drop are posted before it"
