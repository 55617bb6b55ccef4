"""uvicorn's Server with Strata's stop semantics.

On SIGTERM/SIGINT uvicorn stops accepting and waits for open connections, but our streams (a long
generation, /strata/events) would keep theirs open until the graceful timeout. So the first signal also
starts the drain (`on_signal`: abort requests, stop the engine, end the event streams). And uvicorn
re-raises a captured signal after its shutdown, which would end the process with -15 instead of 0: a
graceful stop is a success here, so it does not.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Callable

import uvicorn

log = logging.getLogger("strata.serve")


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server whose first stop signal also calls `on_signal` on the loop."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if first:
            log.info("received %s: stopping", signal.Signals(sig).name)
            asyncio.get_event_loop().call_soon_threadsafe(self._on_signal)
