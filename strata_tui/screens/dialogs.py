"""Small modal dialogs: ask for a profile name (and do what it is for), a log filter, confirm a deletion."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from engine.errors import ConfigError, StrataError
from strata_tui.profiles.profile import check_name


class NameDialog(ModalScreen[str | None]):
    """Ask for a profile name. With `submit` (create, duplicate, rename), the dialog runs it (in a thread: it
    writes files) and closes only when it succeeded; a refusal (a bad name, a name that exists) is shown in
    full under the field, and the dialog stays open and keeps the keys."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    NameDialog { align: center middle; }
    NameDialog > Vertical { width: 90%; max-width: 76; height: auto; border: thick $accent; background: $surface;
                            padding: 1; }
    NameDialog Label { width: 100%; }
    NameDialog #error { color: $error; }
    """

    def __init__(self, prompt: str, value: str = "", submit: Callable[[str], Any] | None = None) -> None:
        super().__init__()
        self.prompt = prompt
        self.value = value
        self.submit = submit
        self._busy = False

    def compose(self) -> ComposeResult:
        with Vertical(id="box"):
            yield Label(self.prompt, markup=False)
            yield Input(value=self.value, id="name")
            yield Label("", id="error", markup=False)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self._busy:
            return
        try:
            name = check_name(event.value.strip())
        except ConfigError as exc:
            self._refused(f"{exc.param}={exc.value!r}: {exc.reason}")
            return
        if self.submit is None:
            self.dismiss(name)
        else:
            self._busy = True
            self._run_submit(name)

    @work(exclusive=True, group="name-dialog")
    async def _run_submit(self, name: str) -> None:
        try:
            await asyncio.to_thread(self.submit, name)
        except ConfigError as exc:
            self._refused(f"{exc.param}={exc.value!r}: {exc.reason}")
        except StrataError as exc:
            self._refused(str(exc))
        else:
            self.dismiss(name)
        finally:
            self._busy = False

    def _refused(self, reason: str) -> None:
        self.query_one("#error", Label).update(reason)

    def action_cancel(self) -> None:
        self.dismiss(None)


class FilterDialog(ModalScreen[str | None]):
    """The engine log's `/`: a pattern (a regular expression, case-insensitive), enter applies it, an empty one
    shows every line again, escape leaves the filter as it was."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    FilterDialog { align: center bottom; }
    FilterDialog > Vertical { width: 90%; max-width: 90; height: auto; border: thick $accent; background: $surface;
                              padding: 0 1; margin-bottom: 2; }
    """

    def __init__(self, pattern: str = "") -> None:
        super().__init__()
        self.pattern = pattern

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("filter the engine log (a regular expression; empty: every line) · enter · escape",
                        markup=False)
            yield Input(value=self.pattern, id="pattern")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip())

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
