"""The terminal going away (SIGHUP, a closed window, `tmux kill-session`): notice it, never wedge on it.

Textual 8's LinuxDriver has two failure modes when its terminal closes. Its input thread treats
`read(0) == 0` (end of file: the terminal hung up) as "nothing this time" and loops on it at a full core.
Its output thread dies on the first write that fails with EIO; after that, writes pile into its 30-slot
queue and the next one blocks the event loop forever, so even the signal handlers (which run on the loop)
never run again and only SIGKILL ends the process. `HangupAwareDriver` ends input at end of file and tells
the app, and gives the output thread a file that drops writes once the terminal is gone.

`hard_exit` is the last resort the app's watchdog thread uses when a graceful quit overruns its deadline.

Textual has no public hook into its input loop, so `run_input_thread` is Textual's own loop with the end-of-file
case changed, and it uses what that loop uses: Textual's private `_xterm_parser.XTermParser` and
`_parser.ParseError`. tests/tui/test_terminal_textual.py fails when Textual changes either or its loop.
"""

from __future__ import annotations

import os
import selectors
import sys
import termios
import threading
from codecs import getincrementaldecoder
from typing import IO, Callable

from textual._parser import ParseError
from textual._xterm_parser import XTermParser
from textual.drivers.linux_driver import LinuxDriver
from textual.message import Message

# What a terminal needs to be usable again after a hard exit: main screen, cursor, mouse reporting off,
# bracketed paste off. Written straight to the fd, bypassing Textual's (possibly wedged) output thread.
_RESET_SEQUENCES = b"\x1b[?1049l\x1b[?25h\x1b[?1000l\x1b[?1003l\x1b[?1006l\x1b[?1015l\x1b[?2004l\x1b[<u"


class TerminalLost(Message):
    """The terminal hung up (end of file on input, or EIO on output)."""


class _DroppingFile:
    """A file proxy for Textual's output thread: once a write fails (EIO: the terminal is gone), report it
    once and drop every later write, so the thread keeps draining its queue and nobody blocks on it."""

    def __init__(self, file: IO[str], on_lost: Callable[[], None]) -> None:
        self._file = file
        self._on_lost = on_lost
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._file.write(text)
            except (OSError, ValueError):  # EIO / EPIPE, or the file was closed under us
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._file.flush()
            except (OSError, ValueError):
                self._lose()

    def fileno(self) -> int:
        return self._file.fileno()

    def isatty(self) -> bool:
        return True

    def _lose(self) -> None:
        self.lost = True
        self._on_lost()


class HangupAwareDriver(LinuxDriver):
    """LinuxDriver that posts `TerminalLost` to the app when its terminal goes away, and never spins or
    blocks on a dead terminal."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lost_reported = threading.Event()

    def start_application_mode(self) -> None:
        self._file = _DroppingFile(self._file, self._terminal_lost)
        super().start_application_mode()

    def _terminal_lost(self) -> None:
        if not self._lost_reported.is_set():
            self._lost_reported.set()
            self.send_message(TerminalLost())

    def run_input_thread(self) -> None:
        """Textual's input loop, except that end of file stops reading and reports the hangup."""
        selector = selectors.SelectSelector()
        selector.register(self.fileno, selectors.EVENT_READ)
        parser = XTermParser(self._debug)
        decode = getincrementaldecoder("utf-8")().decode
        at_eof = False

        def process(selector_events: list[tuple[selectors.SelectorKey, int]], final: bool = False) -> None:
            nonlocal at_eof
            for index, (_key, mask) in enumerate(selector_events):
                last = index == len(selector_events) - 1
                if mask & selectors.EVENT_READ:
                    try:
                        data = os.read(self.fileno, 4096)
                    except OSError:  # EIO from a hung-up tty
                        data = b""
                    if not data:
                        at_eof = True
                        break
                    for event in parser.feed(decode(data, final=final and last)):
                        self.process_message(event)
            for event in parser.tick():
                self.process_message(event)

        try:
            while not self.exit_event.is_set() and not at_eof:
                process(selector.select(0.1))
            if at_eof:
                self._terminal_lost()
            else:
                selector.unregister(self.fileno)
                process(selector.select(0.1), final=True)
        finally:
            selector.close()
            try:
                for _event in parser.feed(""):
                    pass
            except (EOFError, ParseError):
                pass


def hard_exit(code: int, restore_attrs: list | None = None) -> None:
    """Leave now, from any thread: put the terminal back as well as can be done without blocking, then
    os._exit. Only for when a graceful quit has overrun its deadline."""
    try:
        fd = sys.__stderr__.fileno()
        os.set_blocking(fd, False)
        os.write(fd, _RESET_SEQUENCES)
    except (OSError, ValueError, AttributeError):
        pass
    if restore_attrs is not None:
        try:
            termios.tcsetattr(sys.__stdin__.fileno(), termios.TCSANOW, restore_attrs)
        except (termios.error, OSError, ValueError, AttributeError):
            pass
    os._exit(code)
