"""A small incremental parser for Server-Sent Events (the `/strata/events` stream). Pure Python.

Fed text in whatever chunks the network delivers; returns the events completed by each chunk. Follows
the WHATWG rules that matter here: `id:`, `event:`, `data:` (joined with newlines), `retry:`, comment
lines starting with `:`, and line ends of \\r\\n, \\n or \\r.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class SSEMessage:
    """One dispatched event: its id (None if the server sent none), type and data."""

    id: str | None
    event: str
    data: str


class SSEParser:
    """Incremental SSE parser. `last_event_id` survives across events, as the spec's reconnection needs."""

    def __init__(self) -> None:
        self._buffer = ""
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None
        self.last_event_id: str | None = None
        self.retry_ms: int | None = None

    def feed(self, chunk: str) -> list[SSEMessage]:
        """Add text; return every event whose terminating blank line arrived in it."""
        self._buffer += chunk
        out: list[SSEMessage] = []
        while True:
            match = _LINE_END.search(self._buffer)
            if match is None:
                break
            # A lone \r at the very end may be the first half of \r\n: wait for the next chunk.
            if match.group() == "\r" and match.end() == len(self._buffer):
                break
            line = self._buffer[: match.start()]
            self._buffer = self._buffer[match.end():]
            message = self._line(line)
            if message is not None:
                out.append(message)
        return out

    def _line(self, line: str) -> SSEMessage | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> SSEMessage | None:
        if self._id is not None:
            self.last_event_id = self._id
        if not self._data:
            self._event, self._id = "", None
            return None
        message = SSEMessage(id=self._id, event=self._event or "message", data="\n".join(self._data))
        self._event, self._data, self._id = "", [], None
        return message
