"""GPU panel: every GPU NVML sees (name, memory bar, util, temperature, power, a minute of history) and,
beside it, the engine's own VRAM breakdown for that device (weights, KV, graphs, tier, the MoE expert cache
when there is one, reserve, free). Handed the app's view state, it reads them on its own tick
(widgets/view_bound.py)."""

from __future__ import annotations

import re

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from engine.telemetry import TierEvent, VramEvent
from strata_tui.engine_io.gpu import GpuHistory, GpuSample
from strata_tui.widgets.format import NA, bar, mib, num, sparkline
from strata_tui.widgets.view_bound import ViewBound

BREAKDOWN = (("weights", "weights_mib", "blue"), ("KV", "kv_mib", "green"), ("graphs", "graphs_mib", "magenta"),
             ("tier", "tier_mib", "cyan"), ("experts", "experts_mib", "bright_magenta"),
             ("reserve", "reserve_mib", "yellow"))
_CUDA_INDEX = re.compile(r"^cuda:(\d+)$")
COMPACT_BELOW = 130  # content width under which the panel draws its compact form (100x30 terminals)


def breakdown_bar(vram: VramEvent, width: int) -> Text:
    """One bar split into the engine's categories, in proportion to the device's total."""
    total = vram.total_mib or sum(getattr(vram, f) for _, f, _ in BREAKDOWN) + vram.free_mib
    text = Text()
    used_cells = 0
    for _, attr, style in BREAKDOWN:
        cells = int(round(getattr(vram, attr) / total * width)) if total else 0
        cells = min(cells, width - used_cells)
        text.append("█" * cells, style=style)
        used_cells += cells
    text.append("░" * (width - used_cells), style="dim")
    return text


def breakdown_text(vram: VramEvent, compact: bool = False) -> Text:
    """weights, KV, graphs, tier, reserve and free; `compact` (narrow terminals) with G/M units."""
    size = _short_mib if compact else mib
    gap = " " if compact else "  "
    text = Text()
    for label, attr, style in BREAKDOWN:
        if attr == "experts_mib" and not vram.experts_mib:
            continue  # a dense model: no expert cache in its books
        text.append(f"{label} ", style="dim")
        text.append(size(getattr(vram, attr)) + gap, style=style)
        if attr == "weights_mib" and _quantized(vram.weight_format):
            text.append(f"({vram.weight_format.split()[0]}){gap}", style="dim")
    text.append("free ", style="dim")
    text.append(size(vram.free_mib), style="bold" if vram.free_mib < 256 else "")
    if vram.host_kv_mib:  # --kv-resident spilled KV to host memory: not VRAM, so beside the books, not in the bar
        text.append(gap + "host KV ", style="dim")
        text.append(size(vram.host_kv_mib), style="magenta")
    return text


def drawn_books(vram: VramEvent) -> tuple[str, str, str]:
    """What the panel draws of one device's books (both forms and the bar's cells): equal tuples draw alike."""
    return breakdown_text(vram).plain, breakdown_text(vram, compact=True).plain, breakdown_bar(vram, 20).plain


def _quantized(weight_format: str) -> bool:
    """Whether the books should name the weight format: only when it is not a plain float dtype."""
    return bool(weight_format) and weight_format.split()[0] not in ("bf16", "fp16", "fp32")


def _short_mib(value: float | None) -> str:
    if value is None:
        return NA
    return f"{value / 1024:.1f}G" if value >= 10 * 1024 else f"{value:.0f}M"


def tier_line(tier: TierEvent) -> Text:
    """The tier's last change: by how much (signed, so "grow 512 MiB → 512 MiB" cannot read as no change) and
    its budget afterwards, then why. A budget, not the memory held: a tier that does not preallocate (CPU, host)
    holds only what it has filled, which the books beside it show as `tier`."""
    sign = "-" if tier.action == "shrink" else "+"
    change = f"{tier.action} {sign}{mib(abs(tier.mib))} → budget {mib(tier.total_mib)}"  # the engine sends abs
    return Text.assemble(("tier ", "dim"), (change, "cyan"), (f"  {tier.reason}", "dim"))


def process_line(gpu: GpuSample, compact: bool) -> Text:
    """Which processes hold this card and how much each (NVML per process): the ranks of one server."""
    line = Text("  held by ", style="dim")
    for i, proc in enumerate(sorted(gpu.processes, key=lambda p: -(p.used_mib or 0))):
        if i:
            line.append(" · ", style="dim")
        line.append(f"{proc.pid} ", style="dim")
        line.append(proc.name[:18] if compact else proc.name)
        line.append(f" {_short_mib(proc.used_mib)}" if compact else f" {mib(proc.used_mib)}", style="cyan")
    line.no_wrap, line.overflow = True, "ellipsis"
    return line


class GpuPanel(ViewBound, Static):
    """Draws GPU readings and the engine's VRAM breakdown: the view's, on its tick, or what `show()` is given; owns
    no I/O."""

    DEFAULT_CSS = """
    GpuPanel { height: auto; padding: 0 1; }
    GpuPanel.-stale { text-opacity: 45%; }
    """

    dims_when_stale = True
    _lines = 0

    def redraw(self, force: bool = False) -> None:
        """Draw the latest readings and the engine's books, when they (or the panel's width) changed."""
        view = self.changed_view(force)
        if view is None:
            return
        state = view.monitor
        # The books as drawn, not the events: an engine on the CPU sends its books every second with the host's
        # free memory moved by a fraction of a MiB, and a redraw a second was a third of an idle app's CPU.
        books = tuple((device, drawn_books(event)) for device, event in state.vram.items())
        if self.slice_changed((id(view.gpu_history.latest), view.gpu_unavailable, books, state.tier,
                               self.content_size.width), force):
            self.show(view.gpu_history, view.gpu_unavailable, state.vram, state.tier)

    def show(
        self,
        history: GpuHistory,
        unavailable: str | None,
        vram: dict[str, VramEvent],
        tier: TierEvent | None = None,
    ) -> None:
        """Redraw from the latest readings (`history.latest`) and the engine's VramEvents by device."""
        width = self.content_size.width or self.app.size.width - 4
        compact = width < COMPACT_BELOW
        parts: list = []
        shown_devices: set[str] = set()
        if unavailable:
            parts.append(Text(unavailable, style="yellow"))
        for gpu in history.latest:
            device = f"cuda:{gpu.index}"
            shown_devices.add(device)
            parts.append(self._gpu_table(gpu, history, width))
            if gpu.processes:
                parts.append(process_line(gpu, compact))
            if device in vram:
                parts.append(self._engine_row(vram[device], "engine", compact))
        for device, event in sorted(vram.items()):
            if device not in shown_devices:  # CPU runs, or NVML unavailable: the engine's view alone
                parts.append(self._engine_row(event, device or "?", compact))
        # on the bottom border, like the switches panel's reserve: a row of its own would cost the switch list
        # its last line at 100x30
        subtitle = tier_line(tier) if tier is not None else Text("")
        if self.border_subtitle != subtitle.markup:
            self.border_subtitle = subtitle
        if not parts:
            parts.append(Text("no GPU readings yet", style="dim"))
        # One line per part: the screen is laid out again only when that count changes (a layout pass
        # costs more than painting the panel).
        self.update(Group(*parts), layout=len(parts) != self._lines)
        self._lines = len(parts)

    @staticmethod
    def _gpu_table(gpu: GpuSample, history: GpuHistory, width: int) -> Table:
        """One line per GPU; on a narrow terminal the name, bar and history get shorter, not wrapped."""
        compact = width < COMPACT_BELOW
        name_w, bar_w = (12, 10) if compact else (24, 20)
        table = Table.grid(padding=(0, 1))
        fraction = gpu.used_mib / gpu.total_mib if gpu.used_mib is not None and gpu.total_mib else None
        style = "red" if fraction is not None and fraction > 0.95 else "green"
        memory = f"{num(gpu.used_mib)}/{num(gpu.total_mib)} MiB"
        fixed = 4 + name_w + bar_w + 17 + 9 + 5 + 6 + 8
        spark_w = max(0, min(30, width - fixed))
        cells = [
            Text(f"GPU{gpu.index}", style="bold"),
            Text((gpu.name or NA)[:name_w].ljust(name_w)),
            bar(fraction, bar_w, style),
            Text(memory.rjust(17)),
            Text(f"util {num(gpu.util_pct, unit='%')}".ljust(9)),
            Text(num(gpu.temp_c, unit="°C").rjust(5)),
            Text(num(gpu.power_w, unit=" W").rjust(6)),
        ]
        if spark_w:
            cells.append(sparkline(history.used_mib.get(gpu.index, ()), spark_w, upper=gpu.total_mib))
        table.add_row(*cells)
        return table

    @staticmethod
    def _engine_row(vram: VramEvent, label: str, compact: bool) -> Table:
        table = Table.grid(padding=(0, 1))
        if compact:  # the GPU line above already has a bar: the books alone, one line (cut, never wrapped)
            books = breakdown_text(vram, compact=True)
            books.no_wrap, books.overflow = True, "ellipsis"
            table.add_row(Text(f"  {label}", style="dim"), books)
        else:
            table.add_row(Text(f"  {label}", style="dim"), breakdown_bar(vram, 20), breakdown_text(vram))
        return table
