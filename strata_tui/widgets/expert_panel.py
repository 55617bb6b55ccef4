"""Expert-cache panel (MoE engines only): the budget (slots per layer now and its target, device MiB, host
MiB), the hit rate against the oracle's (Belady on the same trace: how much a better policy could gain),
per-layer hit rates (a sparkline and the worst layers), misses per step, reruns and replays, and the budget
keys. Every line is one terminal line, cut with an ellipsis, so the panel keeps its height at 100x30."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from strata_tui.expert_view import ExpertView
from strata_tui.widgets.format import NA, sparkline

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


def expert_lines(view: ExpertView, note: str = "") -> list[Text]:
    slots, target, experts = view.slots, view.target_slots, view.num_experts
    budget = Text.assemble(("slots ", "dim"), (f"{slots}/{experts}", "bold"), (" a layer", "dim"))
    if target is not None and target != slots:
        budget.append(f" → {target}", style="yellow")
    store = view.snapshot.get("store_device") or "host"
    where = ("  host ", "dim"), _mib(view.host_mib)
    if store != "host":  # --peer-device: the experts that do not fit are on the second card
        where = (f"  peer {store} ", "dim"), _mib(view.snapshot.get("peer_mib"))
    budget.append_text(Text.assemble(("  device ", "dim"), (_mib(view.mib), "bright_magenta"), *where))
    hit = view.hit_rate
    style = "green" if hit is not None and hit >= 0.9 else "yellow" if hit is not None and hit >= 0.6 else "red"
    snap = view.snapshot
    per_step = NA if view.misses_per_step is None else f"{view.misses_per_step:.2f}"
    rates = Text.assemble(("hits ", "dim"), (_pct(hit), style), ("  oracle ", "dim"), _pct(view.oracle_hit_rate),
                          ("  misses/step ", "dim"), per_step)
    policy = snap.get("policy")
    if policy and policy != "lru":  # EXPERT_LFU on: say which policy the hit rate is of
        rates.append_text(Text.assemble(("  policy ", "dim"), (policy, "cyan")))
    runs = Text.assemble(("reruns ", "dim"), str(snap.get("reruns", NA)), ("  replays ", "dim"),
                         str(snap.get("replays", NA)))
    resize = view.last_resize
    if resize is not None:
        runs.append(f"  {resize.action} → {resize.slots}: {resize.reason}", style="dim")
    layers = view.layer_hit_rates()
    per_layer = Text("layers ", style="dim")
    if layers:
        per_layer.append_text(sparkline([r or 0.0 for r in layers], min(len(layers), 24), upper=1.0))
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


class ExpertPanel(Static):
    """Draws the expert cache; hidden for a dense model. The monitor binds the budget keys (< and >)."""

    DEFAULT_CSS = """
    ExpertPanel { height: auto; padding: 0 1; display: none; }
    ExpertPanel.-shown { display: block; }
    ExpertPanel.-stale { text-opacity: 45%; }
    """

    def show(self, view: ExpertView | None, note: str = "") -> None:
        self.set_class(view is not None, "-shown")
        if view is None:
            return
        self.border_subtitle = KEYS_HINT
        self.update(Group(*expert_lines(view, note)))
