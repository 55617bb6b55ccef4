"""The panel for a vLLM, SGLang or llama.cpp server: one row per endpoint (requests, KV use, prefix-cache hits,
TTFT and inter-token latency quantiles, preemptions), an aggregate line over the endpoints that answer, then
the first answering endpoint's speculative acceptance per position and its slots (llama.cpp) with prefill
progress. Whatever an engine cannot feed is one dim line saying so, never a zero. Handed the app's view state,
the panel reads the endpoints' readings on its own tick (widgets/view_bound.py)."""

from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from strata_tui.adapters.view import EndpointView, ForeignView, SlotRow
from strata_tui.profiles.kinds import KIND_NAMES
from strata_tui.widgets.format import bar
from strata_tui.widgets.view_bound import ViewBound

NARROW_BELOW = 130
_PANEL_ORDER = ("requests", "kv", "prefix", "spec", "latency", "preemptions", "slots", "prefill")


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def count(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def secs(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _cell(text: str, style: str = "") -> Text:
    cell = Text(text, style=style)
    cell.no_wrap, cell.overflow = True, "ellipsis"
    return cell


def endpoint_table(view: ForeignView, narrow: bool) -> Table:
    table = Table(box=None, padding=(0, 1), show_edge=False, expand=False, header_style="dim")
    columns = ["endpoint", "state", "run", "wait", "KV", "prefix", "TTFT p50/p95", "ITL p50/p95", "preempt"]
    if narrow:
        columns = ["endpoint", "state", "run", "wait", "KV", "prefix", "TTFT p50", "ITL p50", "pre"]
    for name in columns:
        table.add_column(name, no_wrap=True, overflow="ellipsis",
                         max_width=26 if name == "endpoint" else (18 if narrow and name == "state" else None))
    mixed = len({e.kind for e in view.endpoints}) > 1
    for endpoint in view.endpoints:
        if endpoint.reachable:
            kind = f"{KIND_NAMES.get(endpoint.kind, endpoint.kind)} " if mixed else ""
            state = _cell(f"up {kind}" + (endpoint.version or "")[:14], "green")

            def shown(name: str, fmt) -> str:
                return "invalid" if name in endpoint.invalid else fmt(getattr(endpoint, name))

            kv = shown("kv_usage", pct) + ("" if endpoint.kv_label == "KV" else f" {endpoint.kv_label}")
            ttft = shown("ttft_p50_s", secs) + ("" if narrow else "/" + shown("ttft_p95_s", secs))
            itl = shown("itl_p50_s", secs) + ("" if narrow else "/" + shown("itl_p95_s", secs))
            row = [shown("running", count), shown("waiting", count), kv, shown("prefix_hit", pct), ttft, itl,
                   shown("preemptions", count)]
            table.add_row(_cell(endpoint.host), state,
                          *[_cell(c, "yellow" if c.startswith("invalid") else "") for c in row])
        else:
            if endpoint.unreachable_since is not None:
                clock = time.strftime("%H:%M:%S", time.localtime(endpoint.unreachable_since))
                state = _cell(f"unreachable since {clock}", "bold red")
            else:
                state = _cell(endpoint.error or "not read yet", "dim")
            table.add_row(_cell(endpoint.host, "dim"), state, *[_cell("", "dim")] * 7)
    return table


def problem_lines(view: ForeignView) -> list[Text]:
    """What went wrong with each endpoint, in words: why it could not be read, which values were invalid."""
    lines = []
    for endpoint in view.endpoints:
        if not endpoint.reachable and endpoint.unreachable_since is not None and endpoint.error:
            lines.append(_cell(f"{endpoint.host}: {endpoint.error}", "red"))
        if endpoint.reachable and endpoint.invalid:
            reasons = "; ".join(r for r in endpoint.invalid.values() if r) or "values out of range"
            lines.append(_cell(f"{endpoint.host}: invalid: {reasons}", "yellow"))
    return lines


def aggregate_line(view: ForeignView) -> Text:
    total = view.aggregate()
    up, n = int(total["up"] or 0), len(view.endpoints)
    text = Text.assemble((f"all {n}: ", "bold"), (f"{up} up", "green" if up == n else "bold red"))
    for label, key, fmt in (("running", "running", count), ("waiting", "waiting", count),
                            ("KV", "kv_usage", pct), ("preemptions", "preemptions", count)):
        text.append(f" · {label} ", style="dim")
        text.append(fmt(total[key]))
    return text


def spec_line(endpoint: EndpointView) -> Text | None:
    if endpoint.spec_per_position:
        positions = "  ".join(f"{i + 1}:{rate * 100:.0f}%" for i, rate in enumerate(endpoint.spec_per_position))
        mean = f"  mean length {endpoint.spec_mean_length:.2f}" if endpoint.spec_mean_length else ""
        return Text.assemble(("spec accepted per position ", "dim"), positions, (mean, "dim"))
    if endpoint.spec_mean_length:
        rate = f", rate {pct(endpoint.spec_rate)}" if endpoint.spec_rate is not None else ""
        return Text.assemble(("spec ", "dim"), f"mean length {endpoint.spec_mean_length:.2f}{rate}")
    return None


def slot_table(slots: list[SlotRow], narrow: bool) -> Table:
    table = Table(box=None, padding=(0, 1), show_edge=False, header_style="dim")
    for name in ("slot", "state", "prefill", "prompt done", "decoded", "held", "context"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    width = 10 if narrow else 20
    for slot in slots:
        fraction = slot.prefill_fraction
        if slot.state != "prefill":
            progress = Text("")
        elif fraction is None:
            progress = Text("processing", style="yellow")
        else:
            progress = bar(fraction, width, "yellow")
            progress.append(f" {fraction * 100:3.0f}%")
        style = {"prefill": "yellow", "decode": "green"}.get(slot.state, "dim")
        table.add_row(str(slot.id), Text(slot.state, style=style), progress, count(slot.prompt_done_tokens),
                      count(slot.decoded_tokens), count(slot.held_tokens), count(slot.context_tokens))
    return table


class EnginePanel(ViewBound, Static):
    """Draws the view's ForeignView on its tick, or what `show()` is given; owns no I/O. Hidden for a Strata
    engine."""

    DEFAULT_CSS = """
    EnginePanel { height: auto; max-height: 24; padding: 0 1; display: none; }
    EnginePanel.-visible { display: block; }
    EnginePanel.-stale { text-opacity: 45%; }
    """

    dims_when_stale = True
    TAKEN_ROWS = 26  # the terminal's rows the monitor's other panels keep: the slot rows get the rest

    def redraw(self, force: bool = False) -> None:
        """The readings change in place (the foreign reader updates them): every tick that has news draws."""
        view = self.changed_view(force)
        if view is None:
            return
        if view.foreign is None:
            self.hide()
        else:
            self.show(view.foreign, max(1, self.app.size.height - self.TAKEN_ROWS))

    def show(self, view: ForeignView, height_rows: int) -> None:
        width = self.content_size.width or self.app.size.width - 4
        narrow = width < NARROW_BELOW
        self.add_class("-visible")
        names = " + ".join(dict.fromkeys(KIND_NAMES.get(e.kind, e.kind) for e in view.endpoints if e.kind != "?"))
        self.border_title = f"{names or KIND_NAMES.get(view.kind, view.kind)} · {len(view.endpoints)} endpoint" + \
            ("s" if len(view.endpoints) != 1 else "")
        parts: list = [endpoint_table(view, narrow), *problem_lines(view)]
        if len(view.endpoints) > 1:
            parts.append(aggregate_line(view))
        first = next((e for e in view.endpoints if e.reachable), None)
        if first is not None:
            extra = []
            if first.prompt_tokens_s is not None or first.decode_tokens_s is not None:
                extra.append(Text.assemble(("rates ", "dim"), f"prompt {count(first.prompt_tokens_s)} tok/s · "
                                           f"decode {count(first.decode_tokens_s)} tok/s"))
            spec = spec_line(first)
            if spec is not None:
                extra.append(spec)
            parts.extend(extra)
            if first.slots:
                shown = first.slots[:max(1, height_rows)]
                parts.append(slot_table(shown, narrow))
                if len(first.slots) > len(shown):
                    parts.append(Text(f"… {len(first.slots) - len(shown)} more slots", style="dim"))
            for panel in _PANEL_ORDER:
                why = first.cannot.get(panel)
                if why:
                    line = Text(f"{panel}: {why}", style="dim")
                    line.no_wrap, line.overflow = True, "ellipsis"
                    parts.append(line)
        self.update(Group(*parts))

    def hide(self) -> None:
        self.remove_class("-visible")
