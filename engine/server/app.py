"""The FastAPI app: thin routes over `Serving`, the telemetry bus and the engine client.

`create_app(client, config)` builds one app per engine client (tests build several in one process: each
has its own metrics registry). Routes parse the body, call one method and turn `ApiError` into the
OpenAI error shape; everything else lives in serving.py, sse.py, metrics.py and auth.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, TypeVar

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.api import EngineClient
from engine.config import EngineConfig
from engine.errors import PromptTooLong, StrataError
from engine.server import sse
from engine.server.guard import RequestGuard
from engine.server.errors import ApiError, from_exception, invalid_param
from engine.server.handle import ClientGone
from engine.server.json_chunked import Steps
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SwitchRequest,
    BodyT,
    VramReserveRequest,
    ExpertCacheRequest,
    LARGE_BODY_BYTES,
    parse_body,
    parse_body_steps,
    probe_bytes,
    refuse_early_steps,
)
from engine.server.serving import Serving
from engine.switches import get_switch

log = logging.getLogger("strata.server")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")
LARGE_BODY_TURN_WAIT_S = 5.0  # a large body waits this long at most for the one before it (_turn)


def create_app(client: EngineClient, config: EngineConfig, keepalive_s: float = sse.DEFAULT_KEEPALIVE_S) -> FastAPI:
    """The HTTP app for one engine client. The caller owns the client (and shuts it down)."""
    metrics = ServerMetrics(client)
    serving = Serving(client, metrics=metrics, slots=config.batch)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        consumer = asyncio.create_task(metrics.consume_events(serving.events_closed))
        try:
            yield
        finally:
            await serving.shutdown()
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer

    app = FastAPI(title="strata-engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.client = client
    app.state.large_body_turn = asyncio.Semaphore(1)  # large bodies are read and parsed one at a time (_parsed)
    _install_error_handlers(app)
    # Host, API key, Origin, Content-Type and body size are checked before any route runs (guard.py).
    app.add_middleware(RequestGuard, config=config)
    _openai_routes(app, serving)
    _strata_routes(app, client, serving, keepalive_s)
    _monitoring_routes(app, client, metrics)
    return app


async def _parsed(model: type[BodyT], request: Request) -> BodyT:
    """Read the body and parse and validate it, so that the event loop keeps answering /health meanwhile: a
    small body in a worker thread; a large one on the loop itself, in steps (protocol.parse_body_steps) with
    the loop's other work between two steps. A large body parsed in a worker thread contended for the GIL:
    each time the loop took the GIL back it waited for the interpreter's switch interval. Large bodies are
    also read and parsed one at a time."""
    context_tokens = getattr(request.app.state.client, "context_tokens", None)
    if not _large(request):
        return await asyncio.to_thread(parse_body, model, await request.body(), context_tokens)
    # One large body at a time, read and parsed: the others wait in their senders' sockets (uvicorn stops
    # reading a connection whose app does not take its body), costing no CPU while /health is answered.
    async with _turn(request.app.state.large_body_turn):
        raw = await _large_body(request, context_tokens)
        return await run_steps(parse_body_steps(model, raw, context_tokens))


async def run_steps(steps: Steps[T]) -> T:
    """Drive `steps` on the event loop to its result, letting the loop run everything else that is ready
    (other requests' I/O, /health) between two steps."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def _turn(turn: asyncio.Semaphore) -> AsyncIterator[None]:
    """The large-body turn, waited for at most LARGE_BODY_TURN_WAIT_S: a sender that trickles its body holds
    the turn, and the bodies behind it then go on without it rather than wait for it."""
    try:
        await asyncio.wait_for(turn.acquire(), LARGE_BODY_TURN_WAIT_S)
    except TimeoutError:
        yield
        return
    try:
        yield
    finally:
        turn.release()


def _large(request: Request) -> bool:
    """The body's Content-Length is past LARGE_BODY_BYTES (the guard has held it to the limit)."""
    length = request.headers.get("content-length", "")
    return length.isascii() and length.isdigit() and int(length) > LARGE_BODY_BYTES


async def _large_body(request: Request, context_tokens: int | None) -> bytearray:
    """A large request body, copied piece by piece as each arrives into one buffer of its length (Starlette's
    `body()` joins the pieces at the end in one copy of the whole body, which held the event loop for
    milliseconds per body). Each time the next of its `probe_bytes` are in, what is in is looked at, in steps
    on the loop (protocol.refuse_early_steps): a prompt or array longer than the context is refused there,
    without the rest of the body, which uvicorn_server drops as it arrives."""
    length = request.headers["content-length"]
    buffer = bytearray(int(length))
    view, end = memoryview(buffer), 0
    probes = list(probe_bytes(context_tokens))
    async for piece in request.stream():
        if end + len(piece) > len(buffer):  # h11 holds a body to its Content-Length: never, but never past it
            raise invalid_param("Content-Length", length, "the body is longer than its Content-Length")
        view[end:end + len(piece)] = piece
        end += len(piece)
        if context_tokens is not None and probes and probes[0] <= end < len(buffer):
            while probes and probes[0] <= end:
                probes.pop(0)
            head = await run_steps(refuse_early_steps(bytes(view[:end]), context_tokens))
            if head is not None:
                await _refuse_text_head(request.app.state.client, head)
    return buffer if end == len(buffer) else buffer[:end]


async def _refuse_text_head(client: EngineClient, head: str) -> None:
    """The 400 for a text prompt whose part already in holds more tokens than the context (a lower bound: the
    rest is never read, parsed or tokenized); nothing when it does not, or when it cannot be counted now (the
    whole body's path then says why)."""
    try:
        await asyncio.to_thread(client.encode, head)
    except PromptTooLong as exc:
        raise from_exception(PromptTooLong(exc.prompt_tokens, exc.context_tokens, at_least=True)) from None
    except Exception:  # noqa: BLE001 - an engine not ready, a lone surrogate: answered as the whole body is
        return


def _openai_routes(app: FastAPI, serving: Serving) -> None:
    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        return JSONResponse(serving.model_card(model_id).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parsed(CompletionRequest, request)
        return _respond(await serving.completion(req, _disconnect_waiter(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parsed(ChatCompletionRequest, request)
        return _respond(await serving.chat(req, _disconnect_waiter(request)))


def _monitoring_routes(app: FastAPI, client: EngineClient, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        h = client.health()
        return JSONResponse({"status": h.status.value, "reason": h.reason}, status_code=200 if h.ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/strata/state")
    async def state() -> JSONResponse:
        data = jsonable_encoder(client.state().to_json())
        # Which engine process answers (its event bus's epoch, as in the SSE ids): a monitor that reconnects
        # to the same address can tell another engine from the one it followed.
        data["instance_id"] = client.bus.epoch
        return JSONResponse(data)


def _strata_routes(app: FastAPI, client: EngineClient, serving: Serving, keepalive_s: float) -> None:
    @app.get("/strata/events")
    async def events(request: Request, last_event_id: str | None = None) -> StreamingResponse:
        raw = request.headers.get("last-event-id") or last_event_id
        resume = sse.parse_last_event_id(raw)
        if raw is not None and resume is None:
            shown = raw if "last-event-id" not in request.headers else _header_text(raw)
            raise invalid_param("Last-Event-ID", shown, "expected EPOCH-SEQ (an event id) or a sequence number")
        stream = sse.event_stream(client.bus, resume, serving.events_closed, keepalive_s=keepalive_s)
        return StreamingResponse(stream, media_type="text/event-stream", headers=_SSE_HEADERS)

    @app.post("/strata/switches/{name}")
    async def set_switch(name: str, request: Request) -> JSONResponse:
        switch = get_switch(name)  # UnknownSwitch -> 404 before the body is even looked at
        body = await _parsed(SwitchRequest, request)
        result = await client.set_switch(switch.name, body.enabled)
        return JSONResponse({"switch": result.to_json()})

    @app.post("/strata/vram-reserve")
    async def set_vram_reserve(request: Request) -> JSONResponse:
        body = await _parsed(VramReserveRequest, request)
        mib = await client.set_vram_reserve(body.mib)
        return JSONResponse({"vram_reserve_mib": mib})

    @app.post("/strata/expert-cache")
    async def set_expert_cache(request: Request) -> JSONResponse:
        body = await _parsed(ExpertCacheRequest, request)
        snapshot = await client.set_expert_cache_mib(body.mib)
        return JSONResponse({"expert_cache_mib": body.mib, "experts": snapshot.to_json()})


def _header_text(value: str) -> str:
    """A header value as its sender wrote it: Starlette decodes header bytes as latin-1, so UTF-8 text would be
    echoed back as mojibake."""
    return value.encode("latin-1", "replace").decode("utf-8", "replace")


def _respond(result: Any) -> Response:
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)


def _disconnect_waiter(request: Request):
    """A coroutine function that returns once the client has gone (the body was already read)."""

    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return wait


def _install_error_handlers(app: FastAPI) -> None:
    def answer(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(StrataError)
    async def strata_error(_request: Request, exc: StrataError) -> JSONResponse:
        return answer(from_exception(exc))

    @app.exception_handler(ClientGone)
    async def client_gone(_request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; the request was already aborted

    @app.exception_handler(ClientDisconnect)
    async def client_left_mid_upload(request: Request, _exc: ClientDisconnect) -> Response:
        log.info("%s %s: the client disconnected before its body was read", request.method, request.url.path)
        return Response(status_code=499)  # nobody is listening

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
        return answer(invalid_param(loc or "request", err.get("input"), err.get("msg", "invalid")))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return answer(ApiError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        if err.status >= 500:
            log.exception("request failed: %s", err.message)
        return answer(err)
