"""One in-flight generation, tied to its HTTP connection: a client that goes away aborts it.

`RequestHandle` wraps `EngineClient.generate()` and races every wait for the next output against a watcher
of the connection. When the client disconnects (while queued, prefilling or mid-stream) the watcher aborts
the request at once, so the engine frees its slot and KV on its next step instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from engine.api import EngineClient, GenerationRequest, RequestOutput

log = logging.getLogger("strata.server")

WaitDisconnect = Callable[[], Awaitable[None]]


class ClientGone(Exception):
    """The HTTP client disconnected; the request was aborted."""


class RequestHandle:
    """Iterate one request's outputs with `next()`; `close()` aborts it unless it finished."""

    def __init__(self, client: EngineClient, request: GenerationRequest, wait_disconnect: WaitDisconnect | None,
                 on_gone: Callable[["RequestHandle"], None] | None = None) -> None:
        self.client = client
        self._on_gone = on_gone
        self.request = request
        self.request_id = request.request_id
        self.finished = False
        self.aborted = False
        self.last: RequestOutput | None = None
        self._stopped = asyncio.Event()  # set by stop(): the server is shutting down
        self._agen = client.generate(request)
        self._watcher: asyncio.Task[None] | None = (
            asyncio.create_task(self._watch(wait_disconnect)) if wait_disconnect is not None else None
        )

    async def _watch(self, wait_disconnect: WaitDisconnect) -> None:
        await wait_disconnect()
        if not self.finished:
            log.info("client of %s disconnected; aborting it", self.request_id)
            await self.abort()
            # Nobody may ever iterate this request again (a stream whose client left before it started):
            # let the owner forget it now instead of waiting for a close() that might not come.
            if self._on_gone is not None:
                self._on_gone(self)

    async def abort(self) -> None:
        """Abort in the engine (idempotent); the iterator then ends or raises, and `next()` reports ClientGone."""
        if self.aborted or self.finished:
            return
        self.aborted = True
        try:
            await self.client.abort(self.request_id)
        except Exception:  # noqa: BLE001 - an abort of a request the engine already dropped is not an error
            log.debug("abort(%s) raised", self.request_id, exc_info=True)

    def stop(self) -> None:
        """Server shutdown: end the request now, as an abort, without waiting for the engine. Its thread may be
        inside a step that takes seconds (a long prefill chunk on a CPU), and the engine's own abort is
        answered only after that step; the waiting `next()` returns a final "abort" output at once instead.
        The caller still aborts the request in the engine (`abort()`, in the background)."""
        self._stopped.set()

    async def next(self) -> RequestOutput | None:
        """The next output, None when the iterator ended. Raises ClientGone once the client has left, and
        the engine's own errors (RequestRejected, QueueFull, EngineDead) as they come. After `stop()`, a final
        output with finish_reason "abort"."""
        if self.finished:
            return None
        step = asyncio.ensure_future(self._agen.__anext__())
        stopper = asyncio.ensure_future(self._stopped.wait())
        waiters: set[asyncio.Future] = {step, stopper}
        if self._watcher is not None:
            waiters.add(self._watcher)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            step.cancel()
            raise
        finally:
            stopper.cancel()
        if not step.done() and self._stopped.is_set():
            step.cancel()
            return self._stopped_output()
        if not step.done():
            step.cancel()
            raise ClientGone(self.request_id)
        try:
            out = step.result()
        except StopAsyncIteration:
            self.finished = True
            return None
        except asyncio.CancelledError:
            # The engine ends an aborted request's iterator by cancelling it on some implementations.
            if self.aborted:
                raise ClientGone(self.request_id) from None
            raise
        self.last = out
        if out.finished:
            self.finished = True
        return out

    def _stopped_output(self) -> RequestOutput:
        self.finished = self.aborted = True  # the engine abort follows (stop's caller); close() sends none
        last = self.last
        out = RequestOutput(self.request_id, [], "", True, "abort",
                            prompt_tokens=last.prompt_tokens if last else len(self.request.prompt_token_ids),
                            cached_tokens=last.cached_tokens if last else 0,
                            completion_tokens=last.completion_tokens if last else 0)
        self.last = out
        return out

    async def close(self) -> None:
        """Abort if unfinished, stop watching the connection, and close the engine's iterator."""
        if not self.finished:
            await self.abort()
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        aclose = getattr(self._agen, "aclose", None)
        if aclose is None:
            return
        try:
            await aclose()
        except (RuntimeError, asyncio.CancelledError):  # still unwinding from a cancelled step: it closes itself
            pass
