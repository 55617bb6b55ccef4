"""Which widget should draw strata-tui's history panels: Textual's own `Sparkline`, `textual-plotext` (plotext in
a widget) or `textual-plot` (a native plotting widget with braille lines and axes)?

Each candidate draws six series of 900 one-second samples (15 minutes), each in a box of ROWS rows beside the
others, the way the history panel lays them out, in a headless 160x48 app; then the series take a new sample
every update, as the panel's one-second tick does, and the app repaints. The figure is the app's CPU time per
update (time.process_time over UPDATES updates, each awaited until the screen is painted), and what a person
sees is printed (the screen as text) so the pictures can be compared too.

    .venv/bin/pip install textual-plotext textual-plot   # the two candidates that are not part of Textual
    .venv/bin/python benchmarks/bench_history_widgets.py
    .venv/bin/python benchmarks/bench_history_widgets.py --rows 3 --updates 60 --show
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textual.app import App, ComposeResult  # noqa: E402
from textual.containers import Grid  # noqa: E402
from textual.widgets import Static  # noqa: E402

SERIES = 6
SAMPLES = 900


def series(seed: int) -> list[float]:
    rng = random.Random(seed)
    return [max(0.0, 50 + 30 * math.sin(i / 40 + seed) + rng.uniform(-8, 8)) for i in range(SAMPLES)]


class Candidate:
    name = ""

    def widget(self, rows: int):
        raise NotImplementedError

    def draw(self, widget, data: list[float], width: int) -> None:
        raise NotImplementedError


class TextualSparkline(Candidate):
    name = "textual Sparkline"

    def widget(self, rows: int):
        from textual.widgets import Sparkline

        spark = Sparkline([], summary_function=max)
        spark.styles.height = rows
        return spark

    def draw(self, widget, data, width) -> None:
        widget.data = list(data)


class TextualSparklineBucketed(TextualSparkline):
    """The same widget handed one value per cell (the max of each cell's samples), not 900 samples to bucket."""

    name = "textual Sparkline, bucketed first"

    def draw(self, widget, data, width) -> None:
        step = len(data) / max(1, width)
        widget.data = [max(data[int(i * step):max(int(i * step) + 1, int((i + 1) * step))]) for i in range(width)]


class OwnText(Candidate):
    """Rich Text of block characters in a Static, as strata_tui/widgets/format.py's sparkline (one row)."""

    name = "Static + Text sparkline (1 row)"

    def widget(self, rows: int):
        return Static("")

    def draw(self, widget, data, width) -> None:
        from strata_tui.widgets.format import sparkline

        step = max(1, len(data) // max(1, width))
        widget.update(sparkline([max(data[i:i + step]) for i in range(0, len(data), step)], width))


class Plotext(Candidate):
    name = "textual-plotext"

    def widget(self, rows: int):
        from textual_plotext import PlotextPlot

        plot = PlotextPlot()
        plot.styles.height = rows
        return plot

    def draw(self, widget, data, width) -> None:
        plt = widget.plt
        plt.clear_data()
        plt.plot(list(range(len(data))), list(data), marker="braille")
        widget.refresh()


class TextualPlot(Candidate):
    name = "textual-plot"

    def widget(self, rows: int):
        from textual_plot import PlotWidget

        plot = PlotWidget()
        plot.styles.height = rows
        return plot

    def draw(self, widget, data, width) -> None:
        widget.clear()
        widget.plot(list(range(len(data))), list(data))


CANDIDATES = {c.name: c for c in (TextualSparkline(), TextualSparklineBucketed(), OwnText(), Plotext(), TextualPlot())}


class Bench(App):
    CSS = "Grid { grid-size: 2; grid-gutter: 0 1; } Grid > * { border: round $primary; }"

    def __init__(self, candidate: Candidate, rows: int) -> None:
        super().__init__()
        self.candidate, self.rows = candidate, rows
        self.charts = []

    def compose(self) -> ComposeResult:
        with Grid():
            for _ in range(SERIES):
                widget = self.candidate.widget(self.rows)
                widget.styles.height = self.rows + 2
                self.charts.append(widget)
                yield widget


def screen_text(app: App) -> str:
    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def measure(candidate: Candidate, rows: int, updates: int, show: bool) -> dict:
    data = [series(i) for i in range(SERIES)]
    app = Bench(candidate, rows)
    async with app.run_test(size=(160, 48)) as pilot:
        for chart, values in zip(app.charts, data):
            candidate.draw(chart, values, chart.content_size.width or 70)
        await pilot.pause()
        cpu0, wall0 = time.process_time(), time.monotonic()
        for step in range(updates):
            for chart, values in zip(app.charts, data):
                values.append(values[-SAMPLES] * 0.98 + 1)
                del values[0]
                candidate.draw(chart, values, chart.content_size.width or 70)
            await pilot.pause()
        cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
        picture = screen_text(app) if show else ""
    return {"widget": candidate.name, "rows": rows, "updates": updates,
            "cpu_ms_per_update_of_6": round(1000 * cpu_s / updates, 2),
            "cpu_pct_of_a_core_at_1_hz": round(100 * cpu_s / updates, 2), "picture": picture}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3, help="rows of each chart")
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--show", action="store_true", help="print each candidate's screen")
    parser.add_argument("--only", choices=sorted(CANDIDATES), action="append")
    args = parser.parse_args()
    for name in args.only or CANDIDATES:
        try:
            result = asyncio.run(measure(CANDIDATES[name], args.rows, args.updates, args.show))
        except ImportError as exc:
            print(json.dumps({"widget": name, "skipped": f"not installed: {exc}"}))
            continue
        picture = result.pop("picture")
        print(json.dumps(result))
        if picture:
            print(picture)


if __name__ == "__main__":
    main()
