"""One line under the header: profile, engine state, URL, telemetry connection, load scenario status."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

_STATE_STYLE = {"ready": "bold green", "starting": "yellow", "loading": "yellow", "exited": "bold red",
                "stopping": "yellow", "not started": "dim", "attaching": "yellow"}


class StatusBar(Static):
    """Where the app stands, drawn from plain values handed down by the screen."""

    DEFAULT_CSS = """
    StatusBar { height: 1; padding: 0 1; background: $boost; }
    """

    def show(self, profile: str, mode: str, engine_state: str, url: str | None, connected: bool | None,
             note: str = "") -> None:
        text = Text.assemble(("profile ", "dim"), (profile, "bold"), ("  ", ""), (mode, "dim"), ("  engine ", "dim"),
                             (engine_state, _STATE_STYLE.get(engine_state, "")))
        if url:
            text.append(f"  {url}", style="underline")
        if connected is not None:
            text.append("  telemetry ", style="dim")
            text.append("live" if connected else "reconnecting", style="green" if connected else "yellow")
        if note:
            text.append(f"  {note}", style="italic")
        self.update(text)
