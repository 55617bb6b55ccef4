"""Help: every key of the monitor and profiles screens, and what each switch does."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from strata_tui.monitor_state import KEYED_SWITCHES



def help_markdown() -> str:
    switches = "\n".join(
        f"| `{i + 1}` | `{sw.env_var}` | {'live' if sw.live else 'restart'} | {sw.description} |"
        for i, sw in enumerate(KEYED_SWITCHES)
    )
    return f"""\
# Strata TUI

## Monitor
| key | action |
|---|---|
| `1`-`9` | toggle an opt-in switch (live where the engine allows it, else saved for the next start) |
| `+` / `-` | VRAM reserve up / down by the small step (live, saved to the profile) |
| `]` / `[` | VRAM reserve up / down by the large step |
| `>` / `<` | MoE engines: expert-cache budget up / down by one slot per layer (live, saved to the profile as `expert_cache_mib`) |
| `l` | run the load scenario (the seed report: six short generations, then one fresh long prompt) |
| `r` | restart the engine (applies start-only switches and edited options) |
| `s` | stop the engine |
| `f` | filter graph-cache events: all, warnings and errors, errors only |
| `p` | profiles |
| `ctrl+p` | command palette |
| `?` | this help |
| `q` | quit (stops the engine it launched) |

## Profiles
| key | action |
|---|---|
| `enter` | use the selected profile (relaunch with it) |
| `e` | edit every engine option |
| `n` / `d` / `r` / `x` | new, duplicate, rename, delete |
| `escape` | back to the monitor |

## Switches
| key | variable | applies | what it does |
|---|---|---|---|
{switches}
"""


class HelpScreen(ModalScreen[None]):
    """A modal page of keys and switches; any of escape, q or ? closes it."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 110; height: 85%; border: thick $accent;
                                   background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(help_markdown())
