"""The last load scenario's result, one metric per line, until the next scenario (or escape) replaces it."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class LoadResultPanel(Static):
    """Hidden while there is no result; `show(None)` hides it."""

    DEFAULT_CSS = """
    LoadResultPanel { height: auto; max-height: 14; border: round $success; padding: 0 1; display: none; }
    LoadResultPanel.-visible { display: block; }
    """

    def show(self, report: str | None) -> None:
        if report is None:
            self.remove_class("-visible")
            return
        self.border_title = "Load result · escape: close"
        first, _, rest = report.partition("\n")
        self.update(Text.assemble((first, "bold"), "\n" if rest else "", rest))
        self.add_class("-visible")
