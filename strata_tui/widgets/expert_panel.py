"""Expert-cache panel (MoE engines only): the budget (slots per layer now and its target, device MiB, host
MiB), the hit rate against the oracle's (Belady on the same trace: how much a better policy could gain),
per-layer hit rates (a heat row: one cell a layer, or a cell for several showing their worst, bar height and
colour the rate, and the worst layers), misses per step, reruns and replays, and the budget keys. Every line is
one terminal line, cut with an ellipsis, so the panel keeps its height at 100x30 with 48 layers of 512 experts.
Handed the app's view state, the panel reads the cache and the budget keys' last answer on its own tick
(widgets/view_bound.py)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from engine.snapshot import ExpertCacheSnapshot
from strata_tui.state.expert_view import ExpertView
from strata_tui.state.view_state import ViewState
from strata_tui.widgets.format import NA
from strata_tui.widgets.view_bound import ViewBound

KEYS_HINT = "</> budget"


def _mib(value: float | None) -> str:
    if value is None:
        return NA
    if value >= 10 * 1024:
        return f"{value / 1024:.1f} GiB"
    return f"{value:.0f} MiB" if value >= 10 else f"{value:.2f} MiB"


def _pct(value: float | None) -> str:
    return NA if value is None else f"{value * 100:.1f}%"


def _one_line(text: Text) -> Text:
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


_BARS = "▁▂▃▄▅▆▇█"
HEAT_CELLS = 48  # the heat row's cells at most (the panel narrows it to fit its width)
_WORST_CHARS = 34  # "  worst L12 41% L7 52% L40 60%": what the heat row leaves room for on its line


def _rate_style(rate: float) -> str:
    return "green" if rate >= 0.9 else "yellow" if rate >= 0.6 else "red"


def heat_row(view: ExpertView, cells: int) -> Text:
    """The per-layer hit rates as one row of at most `cells` cells (ExpertView.layer_heat): bar height and colour
    the rate, `·` a cell whose layers were not accessed yet."""
    row = Text()
    for rate in view.layer_heat(cells):
        if rate is None:
            row.append("·", style="dim")
        else:
            row.append(_BARS[min(len(_BARS) - 1, int(rate * (len(_BARS) - 1) + 0.5))], style=_rate_style(rate))
    return row


def expert_lines(view: ExpertView, note: str = "", width: int = 0) -> list[Text]:
    """The panel's lines; `width` (the panel's content width, 0: unknown) narrows the heat row to fit."""
    slots, target, experts = view.slots, view.target_slots, view.num_experts
    budget = Text.assemble(("slots ", "dim"), (f"{slots}/{experts}", "bold"), (" a layer", "dim"))
    if target is not None and target != slots:
        budget.append(f" → {target}", style="yellow")
    snap = view.snapshot or ExpertCacheSnapshot()
    store = snap.store_device or "host"
    where = ("  host ", "dim"), _mib(view.host_mib)
    if store != "host":  # --peer-device: the experts that do not fit are on the second card
        where = (f"  peer {store} ", "dim"), _mib(snap.peer_mib)
    budget.append_text(Text.assemble(("  device ", "dim"), (_mib(view.mib), "bright_magenta"), *where))
    hit = view.hit_rate
    style = "green" if hit is not None and hit >= 0.9 else "yellow" if hit is not None and hit >= 0.6 else "red"
    per_step = NA if view.misses_per_step is None else f"{view.misses_per_step:.2f}"
    rates = Text.assemble(("hits ", "dim"), (_pct(hit), style), ("  oracle ", "dim"), _pct(view.oracle_hit_rate),
                          ("  misses/step ", "dim"), per_step)
    policy = snap.policy
    if policy and policy != "lru":  # EXPERT_LFU on: say which policy the hit rate is of
        rates.append_text(Text.assemble(("  policy ", "dim"), (policy, "cyan")))
    runs = Text.assemble(("reruns ", "dim"), str(snap.reruns), ("  replays ", "dim"), str(snap.replays))
    cold = snap.cold
    if cold == "cpu":  # EXPERT_CPU: misses run on the host
        runs.append_text(Text.assemble(("  cold ", "dim"), ("cpu", "cyan"), ("  on host ", "dim"),
                                       str(snap.host_runs)))
    elif cold == "prefetch":  # EXPERT_PREFETCH: experts copied in ahead of their layer
        runs.append_text(Text.assemble(("  cold ", "dim"), ("prefetch", "cyan"), ("  prefetched ", "dim"),
                                       str(snap.prefetched)))
    resize = view.last_resize
    if resize is not None:
        runs.append(f"  {resize.action} → {resize.slots}: {resize.reason}", style="dim")
    layers = view.layer_hit_rates()
    per_layer = Text(f"L0-{len(layers) - 1} " if len(layers) > 1 else "layers ", style="dim")
    if layers:
        cells = HEAT_CELLS if width <= 0 else max(8, min(HEAT_CELLS, width - len(per_layer) - _WORST_CHARS))
        per_layer.append_text(heat_row(view, cells))
        worst = view.worst_layers(3)
        if worst:
            per_layer.append("  worst ", style="dim")
            per_layer.append(" ".join(f"L{i} {r * 100:.0f}%" for i, r in worst))
    else:
        per_layer.append(NA)
    lines = [_one_line(budget), _one_line(rates), _one_line(per_layer), _one_line(runs)]
    if note:
        lines.append(_one_line(Text(f"  {note}", style="dim italic")))
    return lines


class ExpertPanel(ViewBound, Static):
    """Draws the expert cache; hidden for a dense model. The monitor binds the budget keys (< and >)."""

    DEFAULT_CSS = """
    ExpertPanel { height: auto; padding: 0 1; display: none; }
    ExpertPanel.-shown { display: block; }
    ExpertPanel.-stale { text-opacity: 45%; }
    """

    dims_when_stale = True

    def __init__(self, view: ViewState | None = None, **kwargs) -> None:
        super().__init__(view, **kwargs)
        self._cache: ExpertView | None = None  # what is drawn
        self._note = ""

    def redraw(self, force: bool = False) -> None:
        """Draw the cache and the last answer about its budget, when either changed."""
        view = self.changed_view(force)
        if view is None:
            return
        experts = view.monitor.experts
        if self.slice_changed((dict(vars(experts)) if experts is not None else None, view.expert_note), force):
            self.show(experts, view.expert_note)

    def show(self, cache: ExpertView | None, note: str = "") -> None:
        self.set_class(cache is not None, "-shown")
        self._cache, self._note = cache, note
        if cache is None:
            return
        self.border_subtitle = KEYS_HINT
        self.refresh()

    def render(self) -> Group:
        """Drawn at the panel's width now, so the heat row follows a resize."""
        if self._cache is None:
            return Group()
        return Group(*expert_lines(self._cache, self._note, self.content_size.width))
