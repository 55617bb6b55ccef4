"""Finishes an engine's stop after strata-tui has left (`q`): a tiny process of its own, standard library only.

    python reaper.py PGID TIMEOUT_S FD [FD ...]

The app SIGTERMs the engine's process group, starts this with the read ends of the engine's stdout and
stderr, and exits at once, giving the terminal back as htop does. This keeps reading those pipes (an engine
writing its last log lines into a closed pipe would fail in the middle of its graceful stop), and when the
group is still there after TIMEOUT_S it SIGKILLs it. It runs in its own session, so closing the terminal
does not cut it short. Run as a file, not a module: it must not depend on how strata_tui was installed.
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import time


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(pgid: int, timeout_s: float, fds: list[int]) -> None:
    deadline = time.monotonic() + timeout_s
    selector = selectors.DefaultSelector()
    for fd in fds:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    while time.monotonic() < deadline and group_alive(pgid):
        events = selector.select(timeout=0.05) if selector.get_map() else time.sleep(0.05) or []
        for key, _ in events:
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:  # every writer is gone
                selector.unregister(key.fd)
    if group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str]) -> int:
    pgid, timeout_s, fds = int(argv[1]), float(argv[2]), [int(fd) for fd in argv[3:]]
    reap(pgid, timeout_s, fds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
