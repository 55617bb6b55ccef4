"""The incremental SSE parser: chunk boundaries anywhere, every line ending, comments, ids."""

from __future__ import annotations

import pytest

from strata_tui.engine_io.sse import SSEParser

STREAM = ": hello\r\nid: 7\r\nevent: slot\r\ndata: {\"a\": 1}\r\n\r\nid: 8\nevent: graph\ndata: line1\ndata: line2\n\n"


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 17, len(STREAM)])
def test_any_chunking_gives_the_same_events(chunk_size: int) -> None:
    parser = SSEParser()
    out = []
    for i in range(0, len(STREAM), chunk_size):
        out += parser.feed(STREAM[i:i + chunk_size])
    assert [(m.id, m.event, m.data) for m in out] == [("7", "slot", '{"a": 1}'), ("8", "graph", "line1\nline2")]
    assert parser.last_event_id == "8"


def test_lone_cr_line_endings_and_retry() -> None:
    parser = SSEParser()
    # The last \r could be half of a \r\n, so the event completes when the next byte arrives.
    assert parser.feed("retry: 1500\rdata: x\r\r") == []
    out = parser.feed(": keep-alive\n")
    assert [m.data for m in out] == ["x"] and parser.retry_ms == 1500


def test_incomplete_event_waits_for_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed("id: 1\ndata: {}\n") == []
    assert [m.id for m in parser.feed("\n")] == ["1"]


def test_event_without_data_is_not_dispatched_but_keeps_id() -> None:
    parser = SSEParser()
    assert parser.feed("id: 5\n\n") == []
    assert parser.last_event_id == "5"


def test_an_event_past_the_limit_raises_and_nothing_of_it_is_kept() -> None:
    from strata_tui.engine_io.sse import EventTooLarge

    parser = SSEParser(max_event_chars=1000)
    assert parser.feed("data: " + "x" * 900 + "\n\n")[0].data == "x" * 900  # under the limit: an event
    with pytest.raises(EventTooLarge, match="unended event past 1,000 characters"):
        for _ in range(100):  # one line that never ends, fed as the network would
            parser.feed("y" * 64)
    with pytest.raises(EventTooLarge):
        for _ in range(500):  # short data lines, never the blank line that ends the event
            parser.feed("data: zz\n")
    assert parser.feed("data: ok\n\n")[0].data == "ok"  # what the parser held was dropped, it reads on
