"""Small modal dialogs: ask for a profile name, confirm a deletion."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from engine.errors import ConfigError
from strata_tui.profiles import check_name


class NameDialog(ModalScreen[str | None]):
    """Ask for a profile name; refuses names that cannot be file names, saying why."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    NameDialog { align: center middle; }
    NameDialog > Vertical { width: 60; height: auto; border: thick $accent; background: $surface; padding: 1; }
    NameDialog #error { color: $error; }
    """

    def __init__(self, prompt: str, value: str = "") -> None:
        super().__init__()
        self.prompt = prompt
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.prompt)
            yield Input(value=self.value, id="name")
            yield Label("", id="error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        try:
            name = check_name(event.value.strip())
        except ConfigError as exc:
            self.query_one("#error", Label).update(f"{exc.param}={exc.value!r}: {exc.reason}")
            return
        self.dismiss(name)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmDialog(ModalScreen[bool]):
    """Yes (y) or no (n, escape)."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]
    DEFAULT_CSS = """
    ConfirmDialog { align: center middle; }
    ConfirmDialog > Vertical { width: 60; height: auto; border: thick $error; background: $surface; padding: 1; }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            yield Label("y: yes    n: no")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
