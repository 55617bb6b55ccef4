"""What the app does while the engine has nothing to say: no panel is drawn again for books it already shows, one
timer wakes the monitor's panels, and /health is asked no more often than a stop needs (the CPU itself is measured
by benchmarks/bench_tui.py --real-engine --idle)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from engine.telemetry import SlotEvent, VramEvent
from strata_tui.engine_io.messages import TelemetryBatch
from strata_tui.widgets.gpu_panel import GpuPanel
from strata_tui.widgets.slots_table import SlotsTable
from strata_tui.widgets.view_bound import ViewBound
from strata_tui.engine_io.workers import LIVENESS_SILENCE_S, watch_liveness
from tests.tui.conftest import offline_app, screen_text, wait_for


class _Health:
    """What watch_liveness reads of a TelemetryClient: no stream bytes (an idle engine), and /health taking
    `answer_s` to answer, or never answering once `stopped`."""

    def __init__(self, answer_s: float = 0.0) -> None:
        self.last_data_s: float | None = None
        self.answer_s = answer_s
        self.stopped = False
        self.probes = 0

    async def health(self, timeout_s: float | None = None) -> tuple[bool, str]:
        self.probes += 1
        if self.stopped:
            await asyncio.sleep(timeout_s or 0)
            raise OSError("no answer")
        await asyncio.sleep(self.answer_s)
        return True, "ready"


async def test_an_idle_engine_that_answers_at_once_is_asked_half_as_often_and_a_stop_is_still_seen_in_time() -> None:
    client, news = _Health(), []
    worker = asyncio.create_task(watch_liveness(news.append, client))
    await asyncio.sleep(3.0)
    # one probe every 0.5 s at most (a probe every 0.25 s asked 12-13 times in 3 s)
    assert 2 <= client.probes <= 7, client.probes
    client.stopped = True
    stopped_s = time.monotonic()
    while len(news) < 2 and time.monotonic() - stopped_s < 10:
        await asyncio.sleep(0.01)
    seen_after_s = time.monotonic() - stopped_s
    worker.cancel()
    assert [n.answering for n in news] == [True, False]
    # the last answer came at most one gap before the stop: the stop shows LIVENESS_SILENCE_S after it at the latest
    # (a generous margin for a loaded machine's scheduling)
    assert seen_after_s < LIVENESS_SILENCE_S + 1.0, seen_after_s


async def test_an_engine_whose_answers_are_slow_is_asked_often_enough_to_never_read_as_stopped() -> None:
    client, news = _Health(answer_s=0.3), []
    worker = asyncio.create_task(watch_liveness(news.append, client))
    await asyncio.sleep(4.0)
    worker.cancel()
    # 0.3 s answers leave a probe sent 0.5 s after the last answer 0.05 s of the 0.85 s allowed: the gap shrinks
    assert [n.answering for n in news] == [True], news
    assert client.probes >= 6, client.probes


class _CountingGpuPanel(GpuPanel):
    shows = 0

    def show(self, *args, **kwargs) -> None:
        type(self).shows += 1
        super().show(*args, **kwargs)


def _books(seq: int, free_mib: float) -> VramEvent:
    return VramEvent(device="cpu", total_mib=24105.0, weights_mib=70.2, kv_mib=96.0, free_mib=free_mib, seq=seq,
                     ts=1000.0 + seq)


async def test_the_gpu_panel_is_not_drawn_again_for_books_that_read_the_same(config_dir: Path) -> None:
    """An engine on the CPU sends its books every second, the host's free memory moved by a fraction of a MiB: the
    panel was drawn again each time (a third of an idle app's CPU); it is drawn when what it shows changes."""
    app = offline_app(config_dir)
    async with app.run_test(size=(160, 48)) as pilot:
        screen_panel = app.screen.query_one(GpuPanel)
        panel = _CountingGpuPanel(app.view, id="counted")
        await screen_panel.parent.mount(panel, after=screen_panel)
        app.post_message(TelemetryBatch([_books(1, 21000.0)]))
        await wait_for(pilot, lambda: _CountingGpuPanel.shows and "20.5 GiB" in screen_text(app), what="the books")
        # Mounted mid-screen, the panel may have drawn before its layout settled, and its width is part of what it
        # draws: the first view change after would draw it again, rightly. Drawn once at its laid-out width (what a
        # resize does), it is drawn again only when what it shows changes.
        await wait_for(pilot, lambda: panel.content_size.width > 0, what="the panel laid out")
        panel.redraw(force=True)
        await pilot.pause()
        drawn = _CountingGpuPanel.shows
        for seq in range(2, 6):  # four more seconds of books that read the same
            app.post_message(TelemetryBatch([_books(seq, 21000.0 + seq / 100)]))
            await pilot.pause(0.3)
        assert _CountingGpuPanel.shows == drawn
        app.post_message(TelemetryBatch([_books(9, 18000.0)]))  # what it shows changed: drawn at the next tick
        await wait_for(pilot, lambda: "17.6 GiB" in screen_text(app), what="the new free memory")
        assert _CountingGpuPanel.shows == drawn + 1


async def test_one_timer_wakes_the_monitors_panels_and_each_still_follows_the_view(config_dir: Path) -> None:
    """A dozen panels each with its own 4 Hz timer woke the loop 48 times a second with nothing to draw."""
    app = offline_app(config_dir)
    async with app.run_test(size=(160, 48)) as pilot:
        bound = [w for w in app.screen.walk_children() if isinstance(w, ViewBound)]
        assert len(bound) >= 8
        assert sum(len(w._timers) for w in bound) == 0, [type(w).__name__ for w in bound if w._timers]
        app.post_message(TelemetryBatch([SlotEvent(slot=3, state="decode", request_id="r", prompt_tokens=64,
                                                   prefilled_tokens=64, generated_tokens=5, max_tokens=99,
                                                   decode_tok_s=41.0, seq=1, ts=1.0)]))
        table = app.screen.query_one(SlotsTable)
        await wait_for(pilot, lambda: "3" in table.rows, what="the slot drawn on the screen's tick")
