"""n choices of one request: n engine requests whose outputs are merged into one stream, and one reader of
the connection shared by their disconnect watchers."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from engine.api import RequestOutput
from engine.server.handle import WaitDisconnect


async def merged(outputs: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) as each choice produces them; an error of any choice is raised here."""
    if len(outputs) == 1:
        async for out in outputs[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in source:
                await queue.put((index, out, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))
        finally:
            await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(outputs)]
    try:
        running = len(tasks)
        while running:
            index, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                running -= 1
                continue
            yield index, out
    finally:
        for task in tasks:
            task.cancel()


def shared_waiter(wait_disconnect: WaitDisconnect) -> WaitDisconnect:
    """A waiter that many handles may await: the first call starts the one task reading the connection (two
    readers of one ASGI receive channel would race for its messages); each call awaits it shielded, so a
    handle that stops watching does not stop the others. The task ends with the connection (after the
    response, the server's receive reports a disconnect)."""
    task: asyncio.Future | None = None

    async def wait() -> None:
        nonlocal task
        if task is None:
            task = asyncio.ensure_future(wait_disconnect())
        await asyncio.shield(task)

    return wait
