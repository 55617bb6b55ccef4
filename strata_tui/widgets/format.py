"""Small text helpers shared by the widgets: N/A for missing readings, bars, sparklines."""

from __future__ import annotations

from typing import Iterable

from rich.text import Text

NA = "N/A"
_SPARK = "▁▂▃▄▅▆▇█"


def num(value: float | None, fmt: str = "{:.0f}", unit: str = "") -> str:
    """Format a reading, or N/A when it could not be read."""
    return NA if value is None else fmt.format(value) + unit


def bar(fraction: float | None, width: int, style: str = "green") -> Text:
    """A horizontal bar `width` cells wide; dim dots when the fraction is unknown."""
    if fraction is None:
        return Text("·" * width, style="dim")
    fraction = min(max(fraction, 0.0), 1.0)
    filled = int(round(fraction * width))
    text = Text("█" * filled, style=style)
    text.append("░" * (width - filled), style="dim")
    return text


def sparkline(values: Iterable[float], width: int, upper: float | None = None) -> Text:
    """The last `width` values as block characters, scaled to `upper` (or their own max)."""
    data = list(values)[-width:]
    if not data:
        return Text(" " * width)
    top = upper if upper else max(data) or 1.0
    chars = "".join(_SPARK[min(len(_SPARK) - 1, int(v / top * (len(_SPARK) - 1) + 0.5))] for v in data)
    return Text(chars.rjust(width), style="cyan")


def mib(value: float | None) -> str:
    if value is None:
        return NA
    return f"{value / 1024:.1f} GiB" if value >= 10 * 1024 else f"{value:.0f} MiB"
