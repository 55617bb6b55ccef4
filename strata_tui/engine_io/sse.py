"""A small incremental parser for Server-Sent Events (the `/strata/events` stream). Pure Python.

Fed text in whatever chunks the network delivers; returns the events completed by each chunk. Follows
the WHATWG rules that matter here: `id:`, `event:`, `data:` (joined with newlines), `retry:`, comment
lines starting with `:`, and line ends of \\r\\n, \\n or \\r.

The stream is a server's, read as untrusted: an event (its data lines and the line not yet ended) longer than
`max_event_chars` raises EventTooLarge, so a server that sends one endless line, or data lines without the
blank line that ends an event, cannot grow the app's memory without bound; the reader drops the connection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(r"\r\n|\r|\n")
MAX_EVENT_CHARS = 1 << 20  # the engine's largest event (a slot table, a long error) is tens of KiB


class EventTooLarge(ValueError):
    """An event, or one line of it, past the parser's limit: what was buffered of it is dropped."""


@dataclass(frozen=True)
class SSEMessage:
    """One dispatched event: its id (None if the server sent none), type and data."""

    id: str | None
    event: str
    data: str


class SSEParser:
    """Incremental SSE parser. `last_event_id` survives across events, as the spec's reconnection needs."""

    def __init__(self, max_event_chars: int = MAX_EVENT_CHARS) -> None:
        self.max_event_chars = max_event_chars
        self._buffer = ""
        self._event = ""
        self._data: list[str] = []
        self._data_chars = 0  # the data lines' characters so far in the event being read
        self._id: str | None = None
        self.last_event_id: str | None = None
        self.retry_ms: int | None = None

    def feed(self, chunk: str) -> list[SSEMessage]:
        """Add text; return every event whose terminating blank line arrived in it. EventTooLarge when the
        event being read passes `max_event_chars` (the parser is then reset: nothing of that event is kept)."""
        buffer = self._buffer + chunk if self._buffer else chunk
        out: list[SSEMessage] = []
        start = 0
        for match in _LINE_END.finditer(buffer):
            # A lone \r at the very end may be the first half of \r\n: wait for the next chunk.
            if match.group() == "\r" and match.end() == len(buffer):
                break
            message = self._line(buffer[start:match.start()])
            start = match.end()
            if message is not None:
                out.append(message)
        self._buffer = buffer[start:]
        if len(self._buffer) + self._data_chars > self.max_event_chars:
            self._buffer, self._event, self._data, self._data_chars, self._id = "", "", [], 0, None
            raise EventTooLarge(f"an unended event past {self.max_event_chars:,} characters")
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
            self._data_chars += len(value) + 1
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
            self._event, self._id, self._data_chars = "", None, 0
            return None
        message = SSEMessage(id=self._id, event=self._event or "message", data="\n".join(self._data))
        self._event, self._data, self._data_chars, self._id = "", [], 0, None
        return message
