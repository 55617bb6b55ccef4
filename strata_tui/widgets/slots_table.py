"""Slots table: one row per engine slot, diffed by row key so a refresh touches only changed cells. What each cell
says is strata_tui/widgets/slot_cells.py's; this file draws it.

Columns are fitted to the table's width: at 100 columns the low-value ones go first (generated count,
which the progress cell already shows, and the first-token column, which moves into the progress cell),
and at 200 columns the request and progress columns take the room instead of leaving it empty.

Progress while prefilling counts only the tokens that need prefilling: (computed - cached) / (prompt -
cached), never above 100 %; its ETA comes from `PrefillTrack` (growing chunk cost, counted down every
refresh). While decoding it is generated / max_tokens, and after the first token the row says how long
that took (TTFT) and at what prompt rate. With `--kv-resident`, once some of a slot's KV lies on the host
the cell says how much (and, when wide, how much is in VRAM).

The table draws its own lines. DataTable renders each cell through Rich again after any change anywhere
in the table (its render caches are keyed by the table's update count), several milliseconds a refresh
for a few changed numbers; while slots decode every row changes every refresh, and that was most of the
app's CPU. Here a row is one Text (its cells cut or padded to their column widths, as DataTable lays them
out) rendered once per change of that row and kept as a Strip; the header and zebra stripes take the
DataTable's own component styles. The DataTable still holds the cells (get_cell, rows, scrolling, focus).

With more slots than `MAX_SLOT_ROWS` (`--batch` up to 256) the table shows the busiest: prefilling slots first
(they have an ETA to watch), then decoding ones by rate, then the rest; one last row counts the slots left out by
state, so a 256-slot engine is still one screen and one refresh touches a few dozen rows.

Given the app's view state, the table reads its own slice of it (the slots, the pool in its title, the last
admission under it) on its own refresh tick, the profile's `[tui] refresh_s` (widgets/view_bound.py): the high-rate
slot events reach their cells without the screen passing them down, and a prefilling slot's ETA counts down every
tick here.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Callable

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widgets import DataTable

from engine.telemetry import SlotEvent
from strata_tui.state.prefill_eta import PrefillTrack
from strata_tui.widgets.slot_cells import (MAX_SLOT_ROWS, REST_KEY, admission_line, busiest, columns_for, rest_cells,
                                           slot_cells, slots_title)  # what each cell says
from strata_tui.widgets.view_bound import ViewBound

if TYPE_CHECKING:
    from strata_tui.state.view_state import ViewState

class SlotsTable(ViewBound, DataTable):
    """Slot rows keyed by slot number. `show()` adds, removes and updates only what changed; with a `view`,
    `redraw()` shows the view's slots on every refresh tick that has something new."""

    DEFAULT_CSS = """
    SlotsTable { height: auto; max-height: 16; }
    SlotsTable.-stale { text-opacity: 45%; }
    """

    def __init__(self, view: ViewState | None = None, clock: Callable[[], float] = time.monotonic,
                 **kwargs) -> None:
        super().__init__(view, cursor_type="row", zebra_stripes=True, **kwargs)
        self._clock = clock  # the local monotonic clock the ETAs count down on
        self._cells: dict[str, dict[str, Text | str]] = {}
        self.columns_spec: tuple[tuple[str, str, int], ...] = ()
        self.cell_updates = 0  # counted for tests and the benchmark: diffing keeps this small
        self.updated: Counter[tuple[str, str]] = Counter()  # (row, column) -> updates, for the same reason
        self._row_version: dict[str, int] = {}  # row key -> changes so far (a drawn row is kept until it changes)
        self._drawn: dict[str | None, tuple[tuple, Strip]] = {}  # row key (None: the header) -> (look, strip)
        self._frame_styles: dict[str, Style] | None = None
        self.row_limit = MAX_SLOT_ROWS  # slot rows at most (the monitor lowers it on a short terminal)

    dims_when_stale = True

    def on_mount(self) -> None:
        self.border_title = slots_title(None)

    def keeps_moving(self, view: ViewState) -> bool:
        return view.monitor.any_prefilling  # its ETA counts down

    def redraw(self, force: bool = False) -> None:
        """Draw the view's slots, the pool in the title and the last admission under the table, when any of it
        changed since the last tick (always while a slot prefills: its ETA counts down)."""
        view = self.changed_view(force)
        if view is None:
            return
        state = view.monitor
        if self.slice_changed(tuple(state.slots.items()), force or state.any_prefilling):
            self.show(state.slots, {n: state.track_of(s) for n, s in state.slots.items()}, self._clock())
        title = slots_title(state.kv_pool, state.admission_wait, idle=bool(state.slots) and not state.any_running())
        if self.columns_spec and len(self.columns_spec) < 7:  # first, so a long pool line cannot cut it off
            title = "Slots (request, prompt, cached: 100+ columns)" + title.removeprefix("Slots")
        if self.border_title != title:  # setting it repaints the border even when it is the same
            self.border_title = title
        admission = state.last_admission
        subtitle = admission_line(admission, state.prefills.get(admission.request_id) if admission else None)
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle

    def _fit_columns(self) -> bool:
        """Rebuild the columns when the width calls for another set; True when rebuilt."""
        spec = columns_for(self.size.width or self.app.size.width)
        if spec == self.columns_spec:
            return False
        self.columns_spec = spec
        self.clear(columns=True)
        self._cells = {}
        self._row_version.clear()
        self._drawn.clear()
        for label, key, width in spec:
            self.add_column(label, key=key, width=width)
        return True

    def show(self, slots: dict[int, SlotEvent], tracks: dict[int, PrefillTrack | None] | None = None,
             now_s: float = 0.0) -> None:
        """Make the table match `slots` (slot number -> latest SlotEvent); `tracks` by slot for ETAs."""
        self._fit_columns()
        tracks = tracks or {}
        shown, left = busiest(slots, self.row_limit)
        wanted = {str(n): slot_cells(slots[n], tracks.get(n), now_s, self.columns_spec) for n in shown}
        if left:
            wanted[REST_KEY] = rest_cells(left, self.columns_spec)
        with self.app.batch_update():  # one repaint for all the cell changes
            self._apply(wanted)

    def _apply(self, wanted: dict[str, dict[str, Text | str]]) -> None:
        gone = [k for k in self._cells if k not in wanted]
        for key in gone:
            self.remove_row(key)
            del self._cells[key]
            self._row_version.pop(key, None)
            self._drawn.pop(key, None)
        if gone:
            # The table's height follows its rows (height: auto), but DataTable measures them again only when
            # idle, after the layout remove_row asked for: lay out once more after that, or the rows that went
            # stay as blank lines (an exited engine's table kept the switches below it off a 30-line screen).
            self.call_after_refresh(self.refresh, layout=True)
        for key, cells in wanted.items():
            old = self._cells.get(key)
            if old is None:
                self.add_row(*(cells[c] for _, c, _ in self.columns_spec), key=key)
                self.cell_updates += len(cells)
                self._row_version[key] = self._row_version.get(key, 0) + 1
            else:
                changed = False
                for column, value in cells.items():
                    if old[column] != value:
                        self.update_cell(key, column, value)
                        self.cell_updates += 1
                        self.updated[(key, column)] += 1
                        changed = True
                if changed:
                    self._row_version[key] += 1
            self._cells[key] = cells
        order = sorted(self._cells, key=_row_order)
        if list(self._cells) != order:
            self.sort("slot", key=lambda value: int(value) if value else 1 << 30)  # the count of the rest last
            self._cells = {k: self._cells[k] for k in order}

    # --- drawing: one Strip per row, rendered again only when the row changed ---------------------------

    def notify_style_update(self) -> None:  # a CSS change (a class such as -stale) changes every row's look
        self._drawn.clear()
        self._frame_styles = None
        super().notify_style_update()

    def render_lines(self, crop):
        self._frame_styles = None  # the widget's styles are read once a paint, not once a line
        return super().render_lines(crop)

    def _styles(self) -> dict[str, Style]:
        if self._frame_styles is None:
            self._frame_styles = {"base": self.rich_style, **{name: self.get_component_rich_style(name) for name in (
                "datatable--header", "datatable--odd-row", "datatable--even-row", "datatable--cursor")}}
        return self._frame_styles

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        scroll_x, scroll_y = self.scroll_offset
        styles = self._styles()
        base = styles["base"]
        if self.show_header and y < self.header_height:
            key, index = None, -1
        else:
            index = y - (self.header_height if self.show_header else 0) + scroll_y
            if not 0 <= index < len(self._cells):
                return Strip.blank(width, base)
            key = list(self._cells)[index]
        component = "datatable--header" if key is None else (
            "datatable--odd-row" if index % 2 else "datatable--even-row")
        row_style = base + styles[component]
        # The row cursor looks as DataTable draws it: its colours over the cells' own (foreground), under them
        # (background), per the table's cursor priorities.
        cursor = (key is not None and self.show_cursor and self.cursor_type == "row" and index == self.cursor_row)
        cursor_style = styles["datatable--cursor"] if cursor else None
        look = (self._row_version.get(key, 0) if key is not None else self.columns_spec, index, width, scroll_x,
                row_style, cursor_style)
        drawn = self._drawn.get(key)
        if drawn is not None and drawn[0] == look:
            return drawn[1]
        cells = ({c: Text(label) for label, c, _ in self.columns_spec} if key is None else self._cells[key])
        under, over = row_style, None
        if cursor_style is not None:
            under = row_style + cursor_style
            over = Style.from_color(
                color=cursor_style.color if self.cursor_foreground_priority == "css" else None,
                bgcolor=cursor_style.bgcolor if self.cursor_background_priority == "css" else None)
        # A click reads the row from the style's meta, as on DataTable's own lines (it moves the row cursor).
        under += Style.from_meta({"row": index, "column": 0})
        strip = self._row_strip(cells, under, over).crop_extend(scroll_x, scroll_x + width, under)
        self._drawn[key] = (look, strip)
        return strip

    def _row_strip(self, cells: dict[str, Text | str], under: Style, over: Style | None) -> Strip:
        """One row as DataTable lays it out: each cell cut to its column's width, padded, one cell of padding
        on either side; `under` beneath the cells' own styles, `over` (the cursor's colours) above them."""
        line = Text(no_wrap=True, overflow="crop", end="")
        pad = " " * self.cell_padding
        for _, column, width in self.columns_spec:
            value = cells.get(column, "")
            cell = value.copy() if isinstance(value, Text) else Text(str(value))
            cell.truncate(width, overflow="ellipsis")
            line.append(pad)
            line.append_text(cell)
            line.append(" " * (width - cell.cell_len) + pad)
        segments = []
        for text, style, control in line.render(self.app.console):
            style = under + style if style else under
            segments.append(Segment(text, style + over if over else style, control))
        return Strip(segments)


def _row_order(key: str) -> int:
    return 1 << 30 if key == REST_KEY else int(key)
