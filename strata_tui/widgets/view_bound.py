"""A widget handed the app's ViewState reads its own slice of it on its own refresh tick.

The reducer folds every worker message into the one ViewState; nothing pushes the state down. Each live widget
of the monitor is handed the view at construction and, every `[tui] refresh_s` (one tick of its screen for all of
them where the screen says `ticks_view_bound`, else a timer of its own), looks: a tick where the view's
version did not move does nothing, and a widget whose slice did not change is not drawn again (an update lays
out and paints the widget, and a tick that repainted every panel for one changed number was most of the app's
CPU). A forced redraw (a resize, a test) draws it now whatever the keys say.

The widget keeps its own `redraw(force=False)`, which asks `changed_view` (did the view move?) and
`slice_changed` (did my part of it?) and then draws: the path from a tick to the cells stays in the widget's own
file (docs/ARCHITECTURE.md counts the files an event walks through to the screen). Without a view, a widget draws
only what its `show` is given (tests, and panels drawn outside the monitor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata_tui.state.view_state import ViewState

_NOTHING = object()  # no slice drawn yet: differs from every key, None included


class ViewBound:
    """Mixin for a Textual widget that defines `redraw(force=False)` (listed before the widget class). Its
    `on_mount` runs after the widget's own (Textual calls each class's handler along the MRO), so the first draw
    finds the widget set up."""

    dims_when_stale = False  # True: the `-stale` class follows `view.stale` (what telemetry said may be old)

    def __init__(self, view: ViewState | None = None, **kwargs) -> None:
        """`view`: the app's view state, read on each tick; None: drawn only by `show()`. The rest goes on to the
        widget class."""
        super().__init__(**kwargs)
        self.view = view
        self._seen_version: tuple[int, int] | None = None  # (monitor state, view version) last looked at
        self._drawn_key: object = _NOTHING

    def on_mount(self) -> None:
        if self.view is not None:
            # A screen that ticks its view-bound widgets itself (the monitor) saves each its own timer: a dozen
            # timers at 4 Hz woke the loop 48 times a second on an idle engine, most of the app's idle CPU.
            if not getattr(self.screen, "ticks_view_bound", False):  # type: ignore[attr-defined]
                self.set_interval(self.view.settings.refresh_s, self.redraw)  # type: ignore[attr-defined]
            self.redraw()  # type: ignore[attr-defined]

    def keeps_moving(self, view: ViewState) -> bool:
        """True while the widget's drawing moves with the clock (a prefill ETA counting down): every tick draws."""
        return False

    def changed_view(self, force: bool = False) -> ViewState | None:
        """The view, when it moved on since this widget last looked (or `force`, or it keeps moving); else None."""
        view = self.view
        if view is None:
            return None
        version = (id(view.monitor), view.version)
        if version == self._seen_version and not force and not self.keeps_moving(view):
            return None
        self._seen_version = version
        if self.dims_when_stale:
            self.set_class(view.stale, "-stale")  # type: ignore[attr-defined]
        return view

    def slice_changed(self, key: object, force: bool = False) -> bool:
        """True (and remembered) when the widget's slice, summed up by `key`, differs from what it last drew."""
        if key == self._drawn_key and not force:
            return False
        self._drawn_key = key
        return True

    def forget_slice(self) -> None:
        """The next `slice_changed` is True whatever its key (the widget was hidden: what it drew is gone)."""
        self._drawn_key = _NOTHING
