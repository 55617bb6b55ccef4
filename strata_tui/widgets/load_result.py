"""The last load scenario's result, one metric per line, until the next scenario (or escape) replaces it. Handed
the app's view state, the panel reads the result on its own tick (widgets/view_bound.py)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from strata_tui.widgets.view_bound import ViewBound


class LoadResultPanel(ViewBound, Static):
    """Hidden while there is no result; `show(None)` hides it."""

    DEFAULT_CSS = """
    LoadResultPanel { height: auto; max-height: 14; border: round $success; padding: 0 1; display: none; }
    LoadResultPanel.-visible { display: block; }
    """

    def redraw(self, force: bool = False) -> None:
        view = self.changed_view(force)
        if view is not None and self.slice_changed(view.load_result, force):
            self.show(view.load_result)

    def show(self, report: str | None) -> None:
        if report is None:
            self.remove_class("-visible")
            return
        self.border_title = "Load result · escape: close"
        first, _, rest = report.partition("\n")
        self.update(Text.assemble((first, "bold"), "\n" if rest else "", rest))
        self.add_class("-visible")
