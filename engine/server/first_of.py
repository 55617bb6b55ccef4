"""Await one thing unless an event comes first: the shape of a receive that a stalled send must cut short, and
of an event-stream read that a server stop must end."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable


async def result_unless(awaitable: Awaitable[Any], event: asyncio.Event) -> tuple[bool, Any]:
    """(True, its result) when `awaitable` finishes first; (False, None) when `event` is set first (the
    awaitable is cancelled then)."""
    getter = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return True, getter.result()
    return False, None
