"""How the app ends: `q`, SIGTERM, SIGINT, SIGHUP or the terminal going away. One quit at a time; each
says "stopping engine…" at once, stops the engine it launched (SIGTERM to its group, SIGKILL after a
budget) and exits. `q` does not wait for the engine: the screen returns at once (as htop's does) and a
reaper process (`strata_tui/engine_io/reaper.py`) sees the engine's stop through. With `watchdog` on (the CLI), a
thread makes sure the process is gone by a deadline even if the event loop is stuck, and a second
SIGTERM/SIGINT ends it at once.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import TYPE_CHECKING

from strata_tui.terminal import hard_exit

if TYPE_CHECKING:
    from strata_tui.actions.host import StrataHost

# The engine's graceful stop (SIGTERM, then SIGKILL) and the hard deadline for the whole quit, per cause.
QUIT_STOP_S, QUIT_DEADLINE_S = 2.0, 2.8        # `q`: returns within 3 s even when the engine ignores SIGTERM
SIGNAL_STOP_S, SIGNAL_DEADLINE_S = 2.0, 2.8
HANGUP_STOP_S, HANGUP_DEADLINE_S = 0.8, 1.5    # the terminal closed: gone within 2 s


class Shutdown:
    """Ends `app`. `watchdog` arms the deadline thread and lets signals force an exit."""

    def __init__(self, app: "StrataHost", watchdog: bool) -> None:
        self.app = app
        self.watchdog = watchdog
        self.why: str | None = None  # why the app is ending, once it is

    def install_signal_handlers(self) -> None:
        """The engine runs in its own session, so a signal to us does not reach it: end as `q` does."""
        if not self.watchdog:
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: self.request(
                s.name, SIGNAL_STOP_S, 128 + s, SIGNAL_DEADLINE_S, force_if_repeated=True))
        loop.add_signal_handler(signal.SIGHUP, self.hang_up)

    def quit(self) -> None:
        self.request("quit", QUIT_STOP_S, 0, QUIT_DEADLINE_S, hand_off=True)

    def hang_up(self) -> None:
        self.request("SIGHUP", HANGUP_STOP_S, 128 + signal.SIGHUP, HANGUP_DEADLINE_S)

    def request(self, why: str, stop_s: float, return_code: int, deadline_s: float,
                force_if_repeated: bool = False, hand_off: bool = False) -> None:
        if self.why is not None:
            if force_if_repeated and self.watchdog:
                self.force(return_code)
            return
        self.why = why
        if self.watchdog:
            timer = threading.Timer(deadline_s, self.force, args=(return_code,))
            timer.daemon = True
            timer.start()
        app = self.app
        if app.engine_running:
            app.view.monitor.engine_state = "stopping"
            app.view.status_note = "stopping engine…"
            app.view.changed()
            redraw = getattr(app.screen, "redraw", None)
            if redraw is not None:
                redraw()
        app.workers.cancel_group(app, "load")  # its open streams would hold up the engine's shutdown
        if hand_off and app.process is not None and app.engine_running:
            app.view.stopping_why = why
            # Nobody waits for it now, so it gets the whole budget a stop (`s`) gets.
            app.process.hand_off(max(stop_s, app.stop_timeout_s))
            if app.process.handed_off:
                app.exit(return_code=return_code)
                return
        app.run_worker(self._quit(stop_s, return_code), group="quit", exit_on_error=False)

    async def _quit(self, stop_s: float, return_code: int) -> None:
        try:
            await self.app.stop_process(stop_s, why=self.why or "quit")
        finally:
            self.app.exit(return_code=return_code)

    def force(self, return_code: int) -> None:
        """From any thread: SIGKILL the engine's group, restore the terminal as far as possible, leave."""
        process = self.app.process
        if process is not None:
            process.kill_now()
        hard_exit(return_code, getattr(self.app._driver, "attrs_before", None))
