"""Slots table: one row per engine slot, diffed by row key so a refresh touches only changed cells.

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

from engine.snapshot import KvPagingSnapshot
from engine.telemetry import AdmissionEvent, SlotEvent
from strata_tui.prefill_eta import PrefillTrack
from strata_tui.widgets.format import bar
from strata_tui.widgets.view_bound import ViewBound

if TYPE_CHECKING:
    from strata_tui.view_state import ViewState

WIDE_AT = 140  # table width from which every column fits
MAX_SLOT_ROWS = 24  # rows of slots at most; past it the busiest, and a row counting the rest
REST_KEY = "rest"  # the row key of that count
_STATE_STYLE = {"prefill": "yellow", "decode": "green", "idle": "dim", "finished": "blue",
                "aborted": "magenta", "error": "bold red"}


NARROW_BELOW = 94  # table width under which the request, prompt and cached columns go (80x24)


def columns_for(width: int) -> tuple[tuple[str, str, int], ...]:
    """(label, key, width) for a table `width` cells wide (each column adds 2 cells of padding). Narrow (80
    columns): slot, state, progress, tok/s and MTP only; the title says where the rest went (the admission line
    under the table names the last request, its prompt and what was cached)."""
    if width < NARROW_BELOW:
        fixed = (("slot", "slot", 4), ("state", "state", 7), ("tok/s", "tok_s", 7), ("MTP", "acceptance", 4))
        progress = max(16, width - 4 - sum(w + 2 for _, _, w in fixed) - 2)
        return fixed[:2] + (("progress", "progress", progress),) + fixed[2:]
    if width < WIDE_AT:
        fixed = (("slot", "slot", 4), ("state", "state", 7), ("request", "request", 10), ("prompt", "prompt", 9),
                 ("cached", "cached", 8), ("tok/s", "tok_s", 7), ("MTP", "acceptance", 4))
        progress = max(22, width - 4 - sum(w + 2 for _, _, w in fixed) - 2)
        return fixed[:5] + (("progress", "progress", progress),) + fixed[5:]
    fixed = (("slot", "slot", 4), ("state", "state", 8), ("prompt", "prompt", 9), ("cached", "cached", 9),
             ("gen", "generated", 8), ("tok/s", "tok_s", 8), ("MTP acc", "acceptance", 7),
             ("first token", "first_token", 26))
    room = width - 4 - sum(w + 2 for _, _, w in fixed) - 4
    request = min(36, max(20, room // 3))
    progress = min(60, max(30, room - request))
    return (fixed[:2] + (("request", "request", request),) + fixed[2:4] + (("progress", "progress", progress),)
            + fixed[4:])


def format_eta(eta_s: float | None) -> str:
    if eta_s is None:
        return ""
    if eta_s >= 60:
        return f"{int(eta_s // 60)}m{int(eta_s % 60):02d}s"
    if eta_s < 0.95:  # under a second in milliseconds: a one-chunk prompt's 46 ms is not "0.0s"
        return f"{eta_s * 1000:.0f}ms"
    return f"{eta_s:.0f}s" if eta_s >= 10 else f"{eta_s:.1f}s"


def format_rate(tok_s: float | None) -> str:
    if not tok_s:
        return ""
    return f"{tok_s / 1000:.1f}k tok/s" if tok_s >= 10000 else f"{tok_s:,.0f} tok/s"


def first_token_text(track: PrefillTrack | None) -> str:
    """"TTFT 41.2s @ 3,640 tok/s" once the first token came, else ""."""
    if track is None or track.ttft_s is None:
        return ""
    rate = format_rate(track.prompt_tok_s)
    return f"TTFT {format_eta(track.ttft_s)}" + (f" @ {rate}" if rate else "")


def admission_line(event: AdmissionEvent | None, track: PrefillTrack | None = None) -> str:
    """The latest admission, the moment the seed report is about: fresh or reused, and, once its first
    token came, how long that took and at what prompt rate."""
    if event is None:
        return ""
    cached = f", {event.cached_tokens:,} cached" if event.cached_tokens else ""
    first = first_token_text(track)
    return (f"last admission: {event.request_id[:20]} → slot {event.slot}, {event.reuse}, "
            f"{event.prompt_tokens:,} prompt tokens{cached}" + (f" · {first}" if first else ""))


def _tokens_short(n: int) -> str:
    return f"{n / 1000:.1f}K" if n >= 1000 else str(n)


def kv_place_text(slot: SlotEvent, wide: bool) -> str:
    """--kv-resident: where the slot's KV lies, once some of it is on the host ("" while all is in VRAM)."""
    if not slot.kv_host_tokens:
        return ""
    host = f"{_tokens_short(slot.kv_host_tokens)} host"
    if not wide:
        return f" {host}"
    return f" · {_tokens_short(slot.kv_resident_tokens + slot.kv_pooled_tokens)} VRAM {host}"


def progress_cell(slot: SlotEvent, track: PrefillTrack | None, now_s: float, width: int, wide: bool) -> Text:
    if slot.state == "prefill" and slot.prompt_tokens:
        to_do = max(0, slot.prompt_tokens - slot.cached_tokens)
        fraction = (min(1.0, max(0.0, (slot.prefilled_tokens - slot.cached_tokens) / to_do)) if to_do else 1.0)
        eta = track.eta_s(now_s) if track is not None else slot.eta_s
        tail = f" {fraction * 100:3.0f}%" + (f" ETA {format_eta(eta)}" if eta is not None else "")
        place = kv_place_text(slot, wide)
        text = bar(fraction, max(4, min(20, width - len(tail) - len(place))), "yellow")
        text.append(tail[:4], style="")
        text.append(tail[4:], style="yellow")
        text.append(place, style="magenta")
        return text
    if slot.state == "decode" and slot.max_tokens:
        counts = f" {slot.generated_tokens:,}/{slot.max_tokens:,}"
        ttft = "" if wide else first_token_text(track).split(" @ ")[0]
        place = kv_place_text(slot, wide)
        tail = counts + (f" {ttft}" if ttft and not place else "")  # where the KV lies says more than TTFT
        width_left = width - len(tail) - len(place)
        text = bar(slot.generated_tokens / slot.max_tokens, min(20, width_left), "green") if width_left >= 4 else Text()
        text.append(tail)
        text.append(place, style="magenta")
        return text
    return Text("")


def slot_cells(slot: SlotEvent, track: PrefillTrack | None = None, now_s: float = 0.0,
               columns: tuple[tuple[str, str, int], ...] | None = None) -> dict[str, Text | str]:
    """The cells of one slot's row, keyed by column key. Equal inputs give equal cells (for diffing)."""
    columns = columns or columns_for(200)
    widths = {key: width for _, key, width in columns}
    prefilling = slot.state == "prefill"
    rate = slot.prefill_tok_s if prefilling else slot.decode_tok_s
    wide = "first_token" in widths
    cells: dict[str, Text | str] = {
        "slot": str(slot.slot),
        "state": Text(slot.state, style=_STATE_STYLE.get(slot.state, "")),
        "request": (slot.request_id or "")[:widths.get("request", 20)],
        "prompt": f"{slot.prompt_tokens:,}" if slot.request_id else "",
        "cached": f"{slot.cached_tokens:,}" if slot.request_id else "",
        "progress": progress_cell(slot, track, now_s, widths.get("progress", 30), wide),
        "generated": f"{slot.generated_tokens:,}" if slot.request_id else "",
        "tok_s": (f"{rate:,.0f}" if rate >= 1000 else f"{rate:.1f}") if rate else "",
        "acceptance": f"{slot.acceptance * 100:.0f}%" if slot.acceptance is not None else "",
        "first_token": first_token_text(track) if slot.request_id else "",
    }
    return {key: cells[key] for key in widths}


def busiest(slots: dict[int, SlotEvent], limit: int = MAX_SLOT_ROWS) -> tuple[list[int], Counter[str]]:
    """The slot numbers to show (all of them when they fit `limit` rows, else the busiest `limit - 1`, by slot
    number) and, by state, the count of those left out."""
    if len(slots) <= limit:
        return sorted(slots), Counter()

    def rank(n: int) -> tuple:
        slot = slots[n]
        order = {"prefill": 0, "decode": 1}.get(slot.state, 2 if slot.request_id else 3)
        rate = slot.prefill_tok_s if slot.state == "prefill" else slot.decode_tok_s
        return order, -(rate or 0.0), n

    shown = sorted(sorted(slots, key=rank)[:limit - 1])
    left = Counter(slots[n].state for n in slots if n not in set(shown))
    return shown, left


def rest_cells(left: Counter[str], columns: tuple[tuple[str, str, int], ...]) -> dict[str, Text | str]:
    """The row counting the slots the table leaves out ("+232 more: 200 decode, 32 idle")."""
    total = sum(left.values())
    parts = ", ".join(f"{n} {state}" for state, n in sorted(left.items(), key=lambda kv: (-kv[1], kv[0])))
    cells: dict[str, Text | str] = {key: "" for _, key, _ in columns}
    cells["state"] = Text(f"+{total}", style="dim")
    width = dict((k, w) for _, k, w in columns)["progress"]  # the widest column in either layout
    cells["progress"] = Text(f"more: {parts}"[:width], style="dim")
    return cells


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
        if self.columns_spec and len(self.columns_spec) < 7:
            title += " · request, prompt, cached: from 100 columns (last admission below)"
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
        for key in [k for k in self._cells if k not in wanted]:
            self.remove_row(key)
            del self._cells[key]
            self._row_version.pop(key, None)
            self._drawn.pop(key, None)
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


def slots_title(pool: KvPagingSnapshot | None, admission_wait: str = "", idle: bool = False) -> str:
    """The slots panel's title: with KV by use, what the block pool holds (blocks slots use as their own, free,
    backing the prefix tier and mapped into slots from it, on the host), how many times a slot was preempted, and
    that the queue waits for blocks while a slot is free.

    `idle`: every slot is idle. A finished request's blocks go back to the pool when the engine's next step starts
    (what that step may still copy from them stays valid until then), so an engine with nothing to do still
    counts its last requests' blocks as held: they are shown as such, not as in use."""
    if pool is None or not pool.pool_blocks:
        return "Slots"
    used = pool.pool_blocks - pool.free_pool_blocks
    held = f"{pool.used_blocks:,} used"
    if idle and pool.used_blocks:
        used -= pool.used_blocks
        held = f"0 used ({pool.used_blocks:,} of finished requests, free at the next step)"
    parts = [f"KV pool {used * 100 // pool.pool_blocks} % of {pool.pool_blocks:,} blocks: {held}, "
             f"{pool.free_pool_blocks:,} free"]
    if pool.tier_blocks or pool.borrowed_blocks:
        parts.append(f"tier {pool.tier_blocks:,} ({pool.borrowed_blocks:,} shared)")
    if pool.host_blocks:
        parts.append(f"{pool.host_blocks:,} on host")
    text = "Slots · " + ", ".join(parts)
    text += f" · {pool.preemptions:,} preempted" if pool.preemptions else ""
    return text + (" · queue waits for blocks" if admission_wait else "")


def _row_order(key: str) -> int:
    return 1 << 30 if key == REST_KEY else int(key)
