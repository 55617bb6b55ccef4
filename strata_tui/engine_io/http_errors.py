"""HTTP failures said the way a person reads them: "connection refused" rather than httpx's "All connection
attempts failed", and an HTML error page (a web server that is not an engine) as its text, not its markup."""

from __future__ import annotations

import errno
import re
from html.parser import HTMLParser

import httpx

_ERRNO_WORDS = {errno.ECONNREFUSED: "connection refused (nothing listens there)",
                errno.EHOSTUNREACH: "host unreachable", errno.ENETUNREACH: "network unreachable",
                errno.ETIMEDOUT: "timed out", errno.ECONNRESET: "connection reset by the server"}
_HTML = re.compile(r"<!doctype html|<html[\s>]", re.IGNORECASE)


def describe_http_error(exc: BaseException) -> str:
    """One line for a failed request: the OS's reason where one is in the exception's chain (httpx wraps it),
    else httpx's class and message."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _ERRNO_WORDS:
            return _ERRNO_WORDS[cause.errno]
        if isinstance(cause, ConnectionRefusedError):
            return _ERRNO_WORDS[errno.ECONNREFUSED]
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in ("script", "style", "head"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "head") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip and data.strip():
            self.parts.append(" ".join(data.split()))


def plain_error(text: str, limit: int = 320) -> str:
    """`text` with any HTML page in it replaced by that page's words ("an HTML page: Error response ...: not an
    engine's answer"), whitespace folded, cut at `limit` characters."""
    match = _HTML.search(text)
    if match is not None:
        parser = _Text()
        parser.feed(text[match.start():])
        words: list[str] = []
        for part in parser.parts:  # a page repeats its title as its heading: once is enough
            if part not in words:
                words.append(part)
        page = "; ".join(words)
        text = f"{text[:match.start()].rstrip()} an HTML page ({page}): not an engine's answer".strip()
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
