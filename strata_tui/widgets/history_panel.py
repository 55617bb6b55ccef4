"""History: what the engine did over the last 1, 5 or 15 minutes (`z` steps through them), one chart a metric:
tok/s, queue, KV use, TTFT, the expert cache's hit rate, VRAM, and this host's CPU and RAM when the engine runs on
the CPU; the same for every engine kind (strata_tui/state/history.py samples them once a second).

Each chart is block characters drawn here as Rich Text, one style a row, scaled from 0 (a fraction from 0 to
100 %): benchmarks/bench_history_widgets.py measured the candidates on six 900-sample series at 1 Hz.
textual-plotext and textual-plot spend their rows on axes (at 3 rows no data is left to see; at 8 rows they cost
7 % of a core), and Textual's own Sparkline scales each line from its minimum to its maximum (KV at 41-42 %
fills the box as 0-100 % would) and costs twice as much as this (a style per bar). A chart is drawn again only
when what it shows changes: a window of one unchanged value does not repaint every second."""

from __future__ import annotations

import time

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from strata_tui.state.history import WINDOWS_S, History, Metric
from strata_tui.widgets.view_bound import ViewBound

_BARS = " ▁▂▃▄▅▆▇█"
BEFORE = float("-inf")  # a cell from before the first sample: blank (a None is a sample the engine could not give)
TWO_ROWS_FROM = 48  # terminal rows from which each chart is two rows high
COLUMNS_FROM = (0, 70, 150)  # the panel's width from which it has 1, 2, 3 charts a line


def buckets(values: list[float | None], cells: int) -> list[float | None]:
    """`values` (oldest first) into `cells` cells, the newest at the right; each cell the largest of its samples
    (a peak is never averaged away), None where a cell's samples are all None, BEFORE left of the first sample."""
    if len(values) <= cells:
        return [BEFORE] * (cells - len(values)) + list(values)
    out: list[float | None] = []
    step = len(values) / cells
    for i in range(cells):
        part = [v for v in values[int(i * step):max(int(i * step) + 1, int((i + 1) * step))] if v is not None]
        out.append(max(part) if part else None)
    return out


def chart(cells: list[float | None], rows: int, upper: float, style: str) -> list[Text]:
    """Bars from 0 to `upper` over `rows` rows (the top row first); a cell without a sample is a dim dot."""
    levels = len(_BARS) - 1
    heights = [None if v is None else -1 if v == BEFORE else
               max(0, min(rows * levels, round(v / upper * rows * levels))) if upper > 0 else 0 for v in cells]
    lines = []
    for row in reversed(range(rows)):
        chars = []
        for h in heights:
            if h == -1:
                chars.append(" ")
            elif h is None:
                chars.append("·" if row == 0 else " ")
            else:
                chars.append(_BARS[max(0, min(levels, h - row * levels))])
        line = Text("".join(chars), style=style)
        if row == 0 and None in heights:
            for i, h in enumerate(heights):
                if h is None:
                    line.stylize("dim", i, i + 1)
        lines.append(line)
    return lines


BUSY_REDRAW_S = 1.9  # the panel is drawn this often while requests run (every other one-second sample)
IDLE_REDRAW_S = 5.0  # and this often while none does


def _busy(view) -> bool:
    """A request runs on the engine (or on any endpoint of another kind)."""
    if view.foreign is not None:
        return any((e.running or 0) > 0 for e in view.foreign.endpoints if e.reachable)
    return view.monitor.any_running()


LABEL_CELLS = 18  # one-row charts: "tok/s 1,234" beside its line


def metric_block(metric: Metric, values: list[float | None], width: int, rows: int, label: str) -> list[Text]:
    """One metric: its label, latest value and the window's peak, then its chart `width` cells wide (one row:
    label and value, then the chart on the same line)."""
    seen = [v for v in values if v is not None]
    latest = next((v for v in reversed(values) if v is not None), None)
    head = Text.assemble((f"{label} ", "bold"), (metric.show(latest) if latest is not None else "—", metric.style))
    upper = metric.upper or (max(seen) if seen else 1.0) or 1.0
    if rows == 1:
        head.truncate(LABEL_CELLS, overflow="ellipsis", pad=True)
        line = head + Text(" ") + chart(buckets(values, max(4, width - LABEL_CELLS - 1)), 1, upper, metric.style)[0]
        return [line]
    if seen:
        head.append(f"  peak {metric.show(max(seen))}", style="dim")
    head.truncate(width, overflow="ellipsis")
    return [head, *chart(buckets(values, width), rows, upper, metric.style)]


class HistoryPanel(ViewBound, Static):
    """Draws the view's history on its tick when a new sample changed what it shows (or the zoom, or its size)."""

    DEFAULT_CSS = """
    HistoryPanel { height: auto; padding: 0 1; }
    HistoryPanel.-stale { text-opacity: 45%; }
    """

    dims_when_stale = True

    def __init__(self, view=None, **kwargs) -> None:
        super().__init__(view, **kwargs)
        self.window_s = WINDOWS_S[0]
        self._shown_history = -1
        self._lines = -1  # lines drawn last (a change of height lays the screen out again)
        self._drawn_s = float("-inf")

    def zoom(self) -> None:
        """The next window: 1 → 5 → 15 minutes → 1."""
        self.window_s = WINDOWS_S[(WINDOWS_S.index(self.window_s) + 1) % len(WINDOWS_S)]
        self.redraw(force=True)

    def redraw(self, force: bool = False) -> None:
        view = self.view
        if view is None:
            return
        if view.history.version == self._shown_history and not force:
            return
        now = time.monotonic()
        # Each draw repaints the panel (~4 ms on a loaded 2-core machine): every other sample while requests run
        # (the slots table has the live rates; a chart cell spans 1.5 s at the 1-minute zoom), every few seconds
        # while nothing does (the lines only drift with the host's CPU noise).
        if not force and now - self._drawn_s < (BUSY_REDRAW_S if _busy(view) else IDLE_REDRAW_S):
            return
        self._drawn_s = now
        self._shown_history = view.history.version
        self.changed_view(force=True)  # the stale class follows the view
        self.show(view.history)

    def show(self, history: History) -> None:
        width = self.content_size.width or self.app.size.width - 4
        metrics = history.shown()
        columns = max(1, sum(1 for start in COLUMNS_FROM if width >= start))
        rows = 2 if self.app.size.height >= TWO_ROWS_FROM else 1
        cell = max(10, (width - 2 * (columns - 1)) // columns)
        blocks = [metric_block(m, history.window(m.key, self.window_s), cell, rows, history.labels.get(m.key, m.label))
                  for m in metrics]
        minutes = self.window_s // 60
        title = f"History · last {minutes} min · z zoom"
        key = (tuple(tuple(t.plain for t in b) for b in blocks), columns, cell, title)
        if not self.slice_changed(key):
            return
        if self.border_title != title:
            self.border_title = title
        if not blocks:
            self.update(Text("no samples yet: one a second once the engine serves", style="dim"))
            self._lines = 1
            return
        # Each line one Text of padded cells (a Rich Table measures its columns again at every render: twice the
        # cost, once a second).
        rows: list[Text] = []
        for start in range(0, len(blocks), columns):
            group = blocks[start:start + columns]
            for line in range(len(group[0])):
                row = Text(no_wrap=True, overflow="crop")
                for i, block in enumerate(group):
                    part = block[line].copy()
                    part.truncate(cell, pad=True)
                    row.append_text(part)
                    if i < len(group) - 1:
                        row.append("  ")
                rows.append(row)
        # The screen is laid out again only when the panel's height changes (a layout pass costs more than
        # painting the panel, and the numbers change every second while the engine works).
        self.update(Group(*rows), layout=len(rows) != self._lines)
        self._lines = len(rows)

