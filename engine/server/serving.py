"""The serving logic of the OpenAI routes, over an `EngineClient` only.

A request goes: parsed body (protocol.py) -> refusals of what this engine does not do, each naming its
parameter (param_checks.py) -> prompt token ids (text, token ids, or a chat template) -> context and max_tokens
checks with the numbers -> `RequestHandle` (engine generation tied to the connection) -> a response or an SSE stream.
Routes (app.py) only parse, call one method here and turn ApiError into a response.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio

from engine.api import EngineClient, GenerationRequest, RequestOutput, SamplingParams
from engine.errors import EngineDead, MaxTokensTooLarge, PromptTooLong
from engine.server import choices, streams
from engine.server.chat import chat_prompt_ids
from engine.server.errors import ApiError, from_exception, invalid_param, unsupported_param
from engine.server.handle import ClientGone, RequestHandle, WaitDisconnect
from engine.server.metrics import ServerMetrics
from engine.server.param_checks import (logit_bias_pairs, refuse_chat_extras, refuse_completion_extras,
                                        stop_strings, top_k_or_off)
from engine.server.logprobs import CompletionLogprobs, chat_logprobs
from engine.server.streams import usage_of_choices
from engine.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)

log = logging.getLogger("strata.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions; chat defaults to what is left


@dataclass
class Prepared:
    """A validated request, ready to hand to the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices: one engine request each
    logprobs_top: int | None = None  # None: no logprobs; else top logprobs per token

    def choice_requests(self) -> list[GenerationRequest]:
        """One engine request per choice. With a seed, choice i samples from seed XOR i: reproducible, and
        the choices differ (same seed for all would give n copies)."""
        if self.n == 1:
            return [GenerationRequest(self.request_id, self.prompt_token_ids, self.params)]
        seed = self.params.seed
        return [GenerationRequest(f"{self.request_id}-{i}", self.prompt_token_ids,
                                  self.params if seed is None else replace(self.params, seed=seed ^ i))
                for i in range(self.n)]


@dataclass
class Collected:
    """One choice's whole output, for a non-streamed response."""

    text: str
    token_ids: list[int]
    last: RequestOutput  # the finishing output: its finish reason and cumulative counts
    logprobs: list  # TokenLogprob per token, when asked for


class Serving:
    """OpenAI completions and chat completions over one engine client."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics | None = None, slots: int | None = None) -> None:
        self.client = client
        self.metrics = metrics
        self.slots = slots  # requests the engine runs at once (--batch): a stream's choices must fit in them
        self.stopping = asyncio.Event()  # set: new requests are refused
        self.events_closed = asyncio.Event()  # set: telemetry streams flush and end
        self._inflight: dict[str, RequestHandle] = {}
        self._aborts: set[asyncio.Task] = set()  # engine aborts sent at shutdown

    # --- models and lifecycle ------------------------------------------------------------------------------

    def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    def model_card(self, model_id: str) -> ModelCard:
        """GET /v1/models/{id} (the OpenAI SDK's models.retrieve): the served model, else 404."""
        if model_id != self.client.model_name:
            raise ApiError(404, f"model {model_id!r} does not exist; this server serves {self.client.model_name!r}",
                           param="model", code="model_not_found")
        return self._card()

    def _card(self) -> ModelCard:
        vocab = getattr(self.client, "vocab_size", None)
        return ModelCard(id=self.client.model_name, max_model_len=self.client.context_tokens, vocab_size=vocab)

    @property
    def inflight_count(self) -> int:
        return len(self._inflight)

    async def begin_shutdown(self) -> None:
        """Refuse new requests and end the running ones at once (streams end with finish_reason abort, a
        request not yet answered gets 503 shutting_down); their engine aborts go out in the background, since
        the engine answers them only after the step it is in (a long prefill chunk can take seconds)."""
        self.stopping.set()
        handles = list(self._inflight.values())
        for handle in handles:
            handle.stop()
        for handle in handles:
            task = asyncio.create_task(self.client.abort(handle.request_id))
            self._aborts.add(task)
            task.add_done_callback(self._abort_done)

    def _abort_done(self, task: asyncio.Task) -> None:
        self._aborts.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the engine stopped first: nothing to abort
            log.debug("abort at shutdown: %s", task.exception())

    async def shutdown(self, stop_engine: Callable[[], Awaitable[None]] | None = None) -> None:
        """Drain, stop the engine (its stopping/exit events still reach the event streams), then end the
        event streams so every connection can close."""
        await self.begin_shutdown()
        try:
            if stop_engine is not None:
                await stop_engine()
        finally:
            self.events_closed.set()

    # --- the two generation routes -------------------------------------------------------------------------

    async def completion(self, req: CompletionRequest, wait_disconnect: WaitDisconnect | None
                         ) -> CompletionResponse | AsyncIterator[str]:
        self._check_common(req)
        refuse_completion_extras(req)
        prompt_ids = await self._completion_prompt(req)
        prep = self._prepare("cmpl", req, prompt_ids, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, req.logprobs)
        opened = await self._open_choices(prep, wait_disconnect)
        if prep.stream:
            return self._tracked_stream([h for h, _ in opened], streams.completion_chunks(
                self.client, self._merged(opened), prep.request_id, prep.include_usage, len(prompt_ids),
                prep.logprobs_top, return_ids_of_prompt=prompt_ids if req.return_token_ids else None))
        results = await self._collect_choices(opened)
        choices = []
        for i, result in enumerate(results):
            formatted = None
            if prep.logprobs_top is not None:
                formatted = CompletionLogprobs(self.client.decode, prep.logprobs_top).part(result.logprobs)
            ids = dict(prompt_token_ids=prompt_ids, token_ids=result.token_ids) if req.return_token_ids else {}
            choices.append(CompletionChoice(index=i, text=result.text, logprobs=formatted,
                                            finish_reason=result.last.finish_reason, **ids))
        return CompletionResponse(id=prep.request_id, model=self.client.model_name, choices=choices,
                                  usage=usage_of_choices([r.last for r in results], len(prompt_ids)))

    async def chat(self, req: ChatCompletionRequest, wait_disconnect: WaitDisconnect | None
                   ) -> ChatCompletionResponse | AsyncIterator[str]:
        self._check_common(req)
        refuse_chat_extras(req)
        prompt_ids = await self._chat_prompt(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        prep = self._prepare("chatcmpl", req, prompt_ids, requested, None, top)
        opened = await self._open_choices(prep, wait_disconnect)
        if prep.stream:
            return self._tracked_stream([h for h, _ in opened], streams.chat_chunks(
                self.client, self._merged(opened), prep.request_id, prep.include_usage, len(prompt_ids),
                prep.logprobs_top))
        results = await self._collect_choices(opened)
        choices = [ChatChoice(index=i, message=ChatMessageOut(content=r.text), finish_reason=r.last.finish_reason,
                              logprobs=None if prep.logprobs_top is None else
                              chat_logprobs(self.client.decode, r.logprobs, prep.logprobs_top))
                   for i, r in enumerate(results)]
        return ChatCompletionResponse(id=prep.request_id, model=self.client.model_name, choices=choices,
                                      usage=usage_of_choices([r.last for r in results], len(prompt_ids)))

    # --- validation ----------------------------------------------------------------------------------------

    def _check_common(self, req: Any) -> None:
        if self.stopping.is_set():
            raise ApiError(503, "server is shutting down", type="server_unavailable", code="shutting_down")
        health = self.client.health()
        if health.dead:
            raise from_exception(EngineDead(health.reason.partition(":")[2].strip() or health.reason))
        if not health.ready:
            raise ApiError(503, f"engine is not ready: {health.reason}", type="server_unavailable",
                           code="engine_not_ready")
        if req.model != self.client.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{self.client.model_name!r}", param="model", code="model_not_found")

    async def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise unsupported_param("prompt", f"<{len(prompt)} prompts>",
                                        "one prompt per request; send a batch as separate requests")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise invalid_param("prompt", prompt, "the prompt is empty")
            return await asyncio.to_thread(self.client.encode, prompt)
        ids = list(prompt)
        if not ids:
            raise invalid_param("prompt", ids, "the prompt is empty")
        vocab = getattr(self.client, "vocab_size", None)
        if vocab is not None and max(ids) >= vocab:  # one C pass on the loop, not a Python loop over every id
            bad = list(itertools.islice((t for t in ids if t >= vocab), 8))
            raise invalid_param("prompt", bad, f"token ids must be below the vocabulary size {vocab}")
        return ids

    async def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        return await chat_prompt_ids(self.client, req.messages)

    def _prepare(self, prefix: str, req: Any, prompt_ids: list[int], requested: int | None,
                 default_max: int | None, logprobs_top: int | None) -> Prepared:
        context = self.client.context_tokens
        prompt_tokens = len(prompt_ids)
        # The same rules as the engine's own admission check (Request.check_servable), answered before
        # tokenized work reaches the engine thread.
        if prompt_tokens > context:
            raise PromptTooLong(prompt_tokens, context)
        left = context - prompt_tokens
        if requested is None:
            max_tokens = left if default_max is None else min(default_max, left)
        else:
            max_tokens = requested
        if max_tokens < 1 or max_tokens > left:
            raise MaxTokensTooLarge(max(max_tokens, 1), prompt_tokens, context)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=stop_strings(req.stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            top_k=top_k_or_off(req.top_k, getattr(self.client, "vocab_size", None)),
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=logit_bias_pairs(req.logit_bias, getattr(self.client, "vocab_size", None)),
            logprobs=logprobs_top,
        )
        if req.stream_options is not None and not req.stream:
            raise invalid_param("stream_options", req.stream_options.model_dump(), "only allowed with stream=true")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream and self.slots is not None and req.n > self.slots:
            # A stream starts once every choice has its first token: past the slots one would wait for another
            # choice's whole generation, and the client would see nothing, not even headers, meanwhile.
            raise invalid_param("n", req.n, f"a stream runs its choices together and this engine runs "
                                            f"{self.slots} requests at once (--batch {self.slots}); ask for at "
                                            f"most {self.slots} choices, or for more without stream")
        return Prepared(f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params, req.stream, include_usage, req.n,
                        logprobs_top)

    # --- running -------------------------------------------------------------------------------------------

    async def _open_choices(self, prep: Prepared, wait_disconnect: WaitDisconnect | None
                            ) -> list[tuple[RequestHandle, RequestOutput | None]]:
        """Submit every choice and wait for each first output, so admission errors still get their own status
        code; when one is refused, the others are aborted."""
        handles = []
        requests = prep.choice_requests()
        if wait_disconnect is not None and len(requests) > 1:
            wait_disconnect = choices.shared_waiter(wait_disconnect)  # one reader of the connection for n choices
        for gen in requests:
            handle = RequestHandle(self.client, gen, wait_disconnect, on_gone=self._forget)
            self._inflight[gen.request_id] = handle
            if self.stopping.is_set():  # shutdown began while this request was parsed or tokenized
                handle.stop()
            if self.metrics is not None:
                self.metrics.request_started(gen.request_id)
            handles.append(handle)
        firsts = await asyncio.gather(*(h.next() for h in handles), return_exceptions=True)
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            for handle in handles:
                await self._finish(handle)
            if isinstance(failure, ClientGone) or not isinstance(failure, Exception):
                raise failure
            if self.stopping.is_set():  # the engine refused it because it is stopping: say why
                raise _shutting_down() from failure
            raise from_exception(failure) from failure
        for handle, first in zip(handles, firsts):
            self._observe(handle, first)
        return list(zip(handles, firsts))

    async def _outputs(self, handle: RequestHandle, first: RequestOutput | None) -> AsyncIterator[RequestOutput]:
        out = first
        while out is not None:
            yield out
            if out.finished:
                return
            out = await handle.next()
            self._observe(handle, out)

    def _merged(self, opened: list[tuple[RequestHandle, RequestOutput | None]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of every choice as they come, tagged with the choice index."""
        return choices.merged([self._outputs(handle, first) for handle, first in opened])

    async def _collect_choices(self, opened: list[tuple[RequestHandle, RequestOutput | None]]
                               ) -> list[Collected]:
        """Every choice's whole output; aborts them all if one fails."""
        try:
            return list(await asyncio.gather(*(self._collect(h, f) for h, f in opened)))
        finally:
            for handle, _ in opened:
                await self._finish(handle)

    async def _collect(self, handle: RequestHandle, first: RequestOutput | None) -> Collected:
        pieces: list[str] = []
        token_ids: list[int] = []
        logprobs: list = []
        try:
            async for out in self._outputs(handle, first):
                pieces.append(out.text)
                token_ids.extend(out.token_ids)
                logprobs.extend(out.logprobs or ())
        except ClientGone:
            raise
        except Exception as exc:
            raise from_exception(exc) from exc
        finally:
            await self._finish(handle)
        last = handle.last
        if last is None:
            raise ApiError(500, "the engine ended the request without any output", type="server_error")
        if last.finish_reason == "error":
            raise streams.generation_error(self.client, last)
        if handle.aborted and self.stopping.is_set():
            raise _shutting_down()
        return Collected("".join(pieces), token_ids, last, logprobs)

    async def _tracked_stream(self, handles: list[RequestHandle], chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            for handle in handles:
                await self._finish(handle)

    def _observe(self, handle: RequestHandle, out: RequestOutput | None) -> None:
        if self.metrics is not None and out is not None:
            self.metrics.request_output(handle.request_id, out)

    async def _finish(self, handle: RequestHandle) -> None:
        # Shielded: a stream cancelled by its disconnecting client must still abort its engine request.
        with anyio.CancelScope(shield=True):
            await handle.close()
        self._forget(handle)

    def _forget(self, handle: RequestHandle) -> None:
        if self._inflight.pop(handle.request_id, None) is not None and self.metrics is not None:
            self.metrics.request_finished(handle.request_id, handle.last)


def _shutting_down() -> ApiError:
    return ApiError(503, "server is shutting down; the request was aborted", type="server_unavailable",
                    code="shutting_down")
