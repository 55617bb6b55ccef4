"""The panel shown when the engine exits: exit code, the last real error, the last events, restart key."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from engine.telemetry import Event


def event_line(event: Event) -> str:
    data = event.to_json()
    for noise in ("v", "ts", "seq", "type"):
        data.pop(noise, None)
    body = ", ".join(f"{k}={v}" for k, v in data.items() if v not in (None, "", 0, 0.0))
    return f"#{event.seq} {event.type}: {body}"[:200]


class CrashPanel(Static):
    """Why the engine stopped. Hidden until `show()` is called; `hide()` after a restart."""

    DEFAULT_CSS = """
    CrashPanel { height: auto; max-height: 20; border: heavy $error; padding: 0 1; display: none; }
    CrashPanel.-visible { display: block; }
    """

    def show(self, returncode: int | None, error: str | None, recent: list[Event], requested: bool) -> None:
        title = "engine stopped" if requested else "engine exited"
        code = "unknown" if returncode is None else str(returncode)
        lines: list = [Text.assemble((f"{title}: exit code {code}", "bold red"),
                                     ("    press r to restart", "bold"))]
        lines.append(Text.assemble(("last error: ", "bold"), (error or "none reported", "red" if error else "dim")))
        if recent:
            lines.append(Text("last events:", style="bold"))
            lines.extend(Text("  " + event_line(e), style="dim") for e in recent[-8:])
        self.update(Group(*lines))
        self.add_class("-visible")

    def hide(self) -> None:
        self.remove_class("-visible")

    @property
    def visible_now(self) -> bool:
        return self.has_class("-visible")


