"""Telemetry: JSON round trip for every event type, history for late subscribers, bounded slow subscribers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.telemetry import EVENT_TYPES, SCHEMA_VERSION, EventBus, GraphEvent, SlotEvent, event_from_json


@pytest.mark.parametrize("name", sorted(EVENT_TYPES))
def test_every_event_round_trips_through_json(name: str) -> None:
    bus = EventBus()
    event = bus.publish(EVENT_TYPES[name]())
    data = event.to_json()
    assert data["type"] == name and data["v"] == SCHEMA_VERSION and data["seq"] == 1
    assert event_from_json(data) == event


def test_unknown_fields_are_ignored_and_unknown_types_rejected() -> None:
    data = GraphEvent(action="fail", error="CUDA error: out of memory").to_json() | {"future_field": 1}
    assert event_from_json(data).error == "CUDA error: out of memory"
    with pytest.raises(ValueError, match="unknown telemetry event type"):
        event_from_json({"type": "nope"})


def test_late_subscriber_gets_history_after_a_sequence_number() -> None:
    bus = EventBus(history=10)
    for i in range(15):
        bus.publish(SlotEvent(slot=i))
    sub = bus.subscribe(after_seq=12)
    assert [e.seq for e in sub.drain()] == [13, 14, 15]
    assert [e.seq for e in bus.subscribe(after_seq=0).drain()] == list(range(6, 16))  # history is bounded
    assert bus.subscribe(after_seq=None).drain() == []


def test_slow_subscriber_drops_oldest_and_counts_without_blocking_the_publisher() -> None:
    bus = EventBus()
    sub = bus.subscribe(after_seq=None, max_queue=4)
    for i in range(10):
        bus.publish(SlotEvent(slot=i))
    got = sub.drain()
    assert [e.slot for e in got] == [6, 7, 8, 9]
    assert sub.dropped == 6


def test_threaded_publisher_wakes_an_async_subscriber() -> None:
    async def main() -> list[int]:
        bus = EventBus()
        sub = bus.subscribe(after_seq=None, loop=asyncio.get_running_loop())
        threading.Timer(0.05, lambda: bus.publish(SlotEvent(slot=7))).start()
        events = await sub.aget(timeout_s=2.0)
        sub.close()
        bus.publish(SlotEvent(slot=8))  # a closed subscription receives nothing more
        return [e.slot for e in events] + [e.slot for e in sub.drain()]

    assert asyncio.run(main()) == [7]


def test_a_burst_of_events_wakes_an_async_subscriber_once_and_none_is_lost() -> None:
    """A step publishes many events (slot progress for every slot): the subscribing loop (the metrics, an SSE
    stream) is woken once per burst, not once per event; and every event still arrives, in order, when another
    thread publishes while the subscriber is busy with the last burst (how many wakes that takes depends on how
    the two threads interleave, so only order and loss are asserted there)."""
    bursts, per_burst = 20, 100

    async def main() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        bus = EventBus()
        sub = bus.subscribe(after_seq=None, loop=loop)
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal wakes
            wakes += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        for b in range(bursts):  # each burst published whole while the subscriber waits, as a step publishes
            for i in range(per_burst):
                bus.publish(SlotEvent(slot=b * per_burst + i))
            got: list[int] = []
            while len(got) < per_burst:
                got += [e.slot for e in await sub.aget(timeout_s=5.0)]
            assert got == list(range(b * per_burst, (b + 1) * per_burst))
        burst_wakes = wakes
        del loop.call_soon_threadsafe

        def publisher() -> None:
            for b in range(bursts):
                for i in range(per_burst):
                    bus.publish(SlotEvent(slot=b * per_burst + i))
                threading.Event().wait(0.005)  # between steps

        thread = threading.Thread(target=publisher)
        thread.start()
        got = []
        for _ in range(10_000):
            got += [e.slot for e in await sub.aget(timeout_s=5.0)]
            if len(got) == bursts * per_burst:
                break
        thread.join()
        sub.close()
        return burst_wakes, got

    burst_wakes, got = asyncio.run(main())
    assert burst_wakes == bursts  # one per burst (one per event: 2,000)
    assert got == list(range(bursts * per_burst))
