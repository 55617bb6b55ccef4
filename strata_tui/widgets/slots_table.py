"""Slots table: one row per engine slot, diffed by row key so a refresh touches only changed cells."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from engine.telemetry import SlotEvent
from strata_tui.widgets.format import bar

# (label, key, width): fixed widths, because rows change in place and DataTable sizes auto-width columns
# only from the rows present when they are added (an idle first row would squeeze every later value).
COLUMNS = (("slot", "slot", 4), ("state", "state", 8), ("request", "request", 20), ("prompt", "prompt", 9),
           ("cached", "cached", 9), ("progress", "progress", 32), ("gen", "generated", 7), ("tok/s", "tok_s", 9),
           ("MTP acc", "acceptance", 7))
_STATE_STYLE = {"prefill": "yellow", "decode": "green", "idle": "dim", "finished": "blue",
                "aborted": "magenta", "error": "bold red"}


def format_eta(eta_s: float | None) -> str:
    if eta_s is None:
        return ""
    if eta_s >= 60:
        return f"{int(eta_s // 60)}m{int(eta_s % 60):02d}s"
    return f"{eta_s:.0f}s" if eta_s >= 10 else f"{eta_s:.1f}s"


def slot_cells(slot: SlotEvent) -> dict[str, Text | str]:
    """The cells of one slot's row, keyed by column key. Equal inputs give equal cells (for diffing)."""
    prefilling = slot.state == "prefill"
    if prefilling and slot.prompt_tokens:
        done = (slot.prefilled_tokens + slot.cached_tokens) / slot.prompt_tokens
        progress = bar(done, 12, "yellow")
        progress.append(f" {done * 100:3.0f}%")
        if slot.eta_s is not None:
            progress.append(f" ETA {format_eta(slot.eta_s)}", style="yellow")
    elif slot.state == "decode" and slot.max_tokens:
        progress = bar(slot.generated_tokens / slot.max_tokens, 12, "green")
        progress.append(f" {slot.generated_tokens / slot.max_tokens * 100:3.0f}%")
    else:
        progress = Text("")
    rate = slot.prefill_tok_s if prefilling else slot.decode_tok_s
    return {
        "slot": str(slot.slot),
        "state": Text(slot.state, style=_STATE_STYLE.get(slot.state, "")),
        "request": (slot.request_id or "")[:20],
        "prompt": f"{slot.prompt_tokens:,}" if slot.request_id else "",
        "cached": f"{slot.cached_tokens:,}" if slot.request_id else "",
        "progress": progress,
        "generated": f"{slot.generated_tokens:,}" if slot.request_id else "",
        "tok_s": f"{rate:.1f}" if rate else "",
        "acceptance": f"{slot.acceptance * 100:.0f}%" if slot.acceptance is not None else "",
    }


class SlotsTable(DataTable):
    """Slot rows keyed by slot number. `show()` adds, removes and updates only what changed."""

    DEFAULT_CSS = """
    SlotsTable { height: auto; max-height: 16; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._cells: dict[str, dict[str, Text | str]] = {}
        self.cell_updates = 0  # counted for tests and the benchmark: diffing keeps this small

    def on_mount(self) -> None:
        for label, key, width in COLUMNS:
            self.add_column(label, key=key, width=width)

    def show(self, slots: dict[int, SlotEvent]) -> None:
        """Make the table match `slots` (slot number -> latest SlotEvent)."""
        with self.app.batch_update():  # one repaint for all the cell changes
            self._apply({str(n): slot_cells(slots[n]) for n in sorted(slots)})

    def _apply(self, wanted: dict[str, dict[str, Text | str]]) -> None:
        for key in [k for k in self._cells if k not in wanted]:
            self.remove_row(key)
            del self._cells[key]
        for key, cells in wanted.items():
            old = self._cells.get(key)
            if old is None:
                self.add_row(*(cells[c] for _, c, _ in COLUMNS), key=key)
                self.cell_updates += len(cells)
            else:
                for column, value in cells.items():
                    if old[column] != value:
                        self.update_cell(key, column, value)
                        self.cell_updates += 1
            self._cells[key] = cells
        order = sorted(self._cells, key=int)
        if list(self._cells) != order:
            self.sort("slot", key=int)
            self._cells = {k: self._cells[k] for k in order}
