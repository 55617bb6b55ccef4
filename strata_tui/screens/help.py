"""Help: every key of the monitor, profiles and editor screens, and every switch with what it does.

The page is plain text built once per process (`help_text`, cached) and drawn by one Static: a Markdown widget
parsed and laid out its tables at every open (368 ms p50 on a 2-core machine)."""

from __future__ import annotations

from functools import cache

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from engine.switches import SWITCHES
from strata_tui.state.monitor_state import KEYED_SWITCHES

CLOSE_HINT = "escape · q · ? close"

MONITOR_KEYS = (
    ("1-9", "toggle switch N below (live where the engine allows it, else saved for the next start; a switch that "
            "does not apply to this engine's model says so and is not changed)"),
    ("ctrl+p", "command palette: every action, every switch (those past the ninth too), every scenario"),
    ("+ / -", "VRAM reserve up / down by the small step (live, saved to the profile)"),
    ("] / [", "VRAM reserve up / down by the large step"),
    ("> / <", "MoE engines: expert-cache budget up / down by one slot per layer (saved as expert_cache_mib)"),
    ("l", "run the load scenario (six short generations, then one fresh long prompt)"),
    ("c", "cancel the running load scenario (its requests are closed)"),
    ("escape", "close the load result"),
    ("f", "filter graph-cache events: all, warnings and errors, errors only"),
    ("z", "history: zoom out to the last 1, 5 or 15 minutes"),
    ("v", "on a short terminal: show the next of the panels left out (history, graph cache, engine log)"),
    ("/", "filter the engine log (a regular expression; empty shows every line)"),
    ("space", "pause the engine log (new lines wait); up / down then move a cursor over its lines"),
    ("y", "copy the log's cursor line (the last line while it follows) to the clipboard (OSC 52)"),
    ("e", "copy the engine's last error to the clipboard (OSC 52)"),
    ("w", "save the engine log's lines shown to a file (its path is shown)"),
    ("r", "restart the engine (applies start-only switches and edited options)"),
    ("s", "stop the engine"),
    ("p", "profiles"),
    ("? / f1", "this help"),
    ("q / ctrl+q", "quit (stops the engine it launched)"),
    ("ctrl+c", "does not quit (it copies in a text field): says which key does"),
)
PROFILE_KEYS = (
    ("enter", "use the selected profile (relaunch with it)"),
    ("e", "edit every engine option"),
    ("n / d / r / x", "new, duplicate, rename, delete"),
    ("escape", "back to the monitor"),
)
EDITOR_KEYS = (("ctrl+s", "save"), ("escape", "cancel (asks first when something was changed)"))


def switch_key(index: int) -> str:
    """The key of switch `index` (registry order): 1-9, or the palette for those past the ninth."""
    return str(index + 1) if SWITCHES[index] in KEYED_SWITCHES else "ctrl+p"


@cache
def help_text() -> Text:
    """The whole page, built once."""
    text = Text()

    def section(title: str, rows: tuple[tuple[str, str], ...]) -> None:
        text.append(f"{title}\n", style="bold")
        width = max(len(key) for key, _ in rows)
        for key, what in rows:
            text.append(f"  {key:<{width}}  ", style="bold cyan")
            text.append(f"{what}\n")
        text.append("\n")

    section("Monitor", MONITOR_KEYS)
    section("Profiles", PROFILE_KEYS)
    section("Profile editor", EDITOR_KEYS)
    text.append("Switches\n", style="bold")
    name_width = max(len(sw.env_var) for sw in SWITCHES)
    for index, sw in enumerate(SWITCHES):
        applies = "live" if sw.live else "start only"
        moe = ", MoE only" if sw.moe_only else ""
        text.append(f"  {switch_key(index):<6} ", style="bold cyan")
        text.append(f"{sw.env_var:<{name_width}}  ")
        text.append(f"{applies}{moe}", style="dim")
        text.append(f"  {sw.description}\n")
    text.append(f"\n{CLOSE_HINT}", style="dim")
    return text


class HelpScreen(ModalScreen[None]):
    """A modal page of keys and switches; any of escape, q or ? closes it (said on its border)."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 94%; max-width: 130; height: 90%; border: thick $accent;
                                   background: $surface; padding: 0 1; border-subtitle-color: $text; }
    """

    def compose(self) -> ComposeResult:
        scroll = VerticalScroll()
        scroll.border_title = "Help"
        scroll.border_subtitle = CLOSE_HINT
        with scroll:
            yield Static(help_text())
