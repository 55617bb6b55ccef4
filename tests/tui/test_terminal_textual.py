"""What strata_tui/terminal.py takes from Textual's private modules, held: the driver's input loop is Textual's own
with end of file handled (Textual offers no public hook there), so when Textual changes the parser it feeds or the
loop it copies, these fail and say what to compare. The hangup itself is tested in a real terminal
(tests/tui/test_lifecycle_tmux.py)."""

from __future__ import annotations

import hashlib
import inspect

from textual import events
from textual.drivers.linux_driver import LinuxDriver

from strata_tui.terminal import HangupAwareDriver

# sha256 of Textual's LinuxDriver.run_input_thread source, the loop HangupAwareDriver.run_input_thread copies
# (as of textual 8.2.8).
TEXTUAL_INPUT_LOOP_SHA256 = "d796af6d69db337d6fa6bd463984f7d17188d991dbb22f60efb92a8a9619507c"


def test_textuals_input_loop_is_still_the_one_the_driver_copies() -> None:
    source = inspect.getsource(LinuxDriver.run_input_thread)
    assert hashlib.sha256(source.encode()).hexdigest() == TEXTUAL_INPUT_LOOP_SHA256, (
        "Textual changed LinuxDriver.run_input_thread: compare it with HangupAwareDriver.run_input_thread "
        "(strata_tui/terminal.py, the same loop with end of file ending input), carry the change over, then "
        f"update TEXTUAL_INPUT_LOOP_SHA256. Textual's loop now:\n{source}")
    assert HangupAwareDriver.run_input_thread is not LinuxDriver.run_input_thread


def test_the_private_parser_the_loop_feeds_still_turns_bytes_into_key_events() -> None:
    from textual._parser import ParseError
    from textual._xterm_parser import XTermParser

    parser = XTermParser(False)
    keys = [event for text in ("a", "\x1b[A") for event in parser.feed(text)]
    assert [(type(k), k.key) for k in keys] == [(events.Key, "a"), (events.Key, "up")]
    assert list(parser.tick()) == []  # nothing pending: an escape alone would come out here after its timeout
    assert issubclass(ParseError, Exception)
