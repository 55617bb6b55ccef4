"""AsyncEngine: engine.api.EngineClient over an Engine stepped by one engine thread.

The engine thread owns the Engine: it loads the model (health "loading: ..."), then loops: run queued
commands (add, abort, switch, reserve), step while there is work, otherwise sleep until a command arrives.
Outputs go back to each request's asyncio queue on the loop that called `generate` (engine.orchestration.delivery:
one hand-over per loop per step), so any number of event loops (the server's, a test's) can use one engine.

`generate()` raises RequestRejected / QueueFull / EngineDead before its first yield (the add runs in the
engine thread and its exception is re-raised in the caller). Closing or cancelling the iterator aborts the
request at the engine's next loop turn, i.e. within one step. Use `contextlib.aclosing` (or exhaust the
iterator): an `async for` that breaks out early leaves closing to the garbage collector.

A prompt's text is encoded with the context as its `max_tokens`: one far past the context is refused for what a
head of it holds (engine.model.prompt_heads), so the refusal costs what the context does, not what the text does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import threading
from collections import deque
from typing import Any, AsyncIterator, Callable

from engine.api import GenerationRequest, Health, HealthStatus, RequestOutput
from engine.config import EngineConfig
from engine.errors import EngineDead
from engine.option_checks import check_expert_cache_mib, check_vram_reserve_mib
from engine.exec.gpu_errors import real_message
from engine.orchestration.delivery import OutputRouter
from engine.snapshot import EngineSnapshot, ExpertCacheSnapshot, HealthSnapshot
from engine.switches import SwitchState
from engine.telemetry import EngineEvent, EventBus, SwitchEvent, WarningEvent

_IDLE_WAIT_S = 0.05


class AsyncEngine:
    """The EngineClient the server uses. Construct, then `await ready()` (or poll `health()`)."""

    def __init__(self, config: EngineConfig, bus: EventBus | None = None, *,
                 engine_factory: Callable[[EngineConfig, EventBus], Any] | None = None) -> None:
        self.config = config
        self.bus = bus if bus is not None else EventBus()
        self.model_name = config.model
        self.context_tokens = config.context
        self.vocab_size: int | None = None  # known once the model is loaded
        self.engine: Any = None
        self._factory = engine_factory
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._load_error: str | None = None
        self._loaded = threading.Event()
        self._router = OutputRouter()  # each request's asyncio queue (engine.orchestration.delivery)
        self.bus.publish(EngineEvent(state="starting", detail=f"model {config.model}"))
        self._thread = threading.Thread(target=self._main, name="strata-engine", daemon=True)
        self._thread.start()

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def ready(self, timeout_s: float | None = None) -> Health:
        """Wait until the model is loaded (or failed to load); returns the health then."""
        await asyncio.get_running_loop().run_in_executor(None, self._loaded.wait, timeout_s)
        return self.health()

    async def start(self) -> Health:
        """The server's start hook: wait for the load (a failed load shows in health(), not as an exception)."""
        return await self.ready()

    def health(self) -> Health:
        if self._load_error is not None:
            return Health(HealthStatus.DEAD, self._load_error)
        if self.engine is None:
            return Health(HealthStatus.STOPPED) if self._stopping else Health(HealthStatus.LOADING, self.config.model)
        health = self.engine.health()
        if health.ready and self._stopping:
            return Health(HealthStatus.STOPPED)
        return health

    async def shutdown(self, wait_s: float | None = None) -> None:
        """Stop the engine thread; requests still running finish with an abort. With `wait_s`, return after
        that long even if the thread is still inside a step (it is a daemon: it ends with the process)."""
        if self._stopping:
            return
        self.bus.publish(EngineEvent(state="stopping"))
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, wait_s)
        self.bus.publish(EngineEvent(state="exit", exit_code=0))

    # --- tokenizer -----------------------------------------------------------------------------------------

    def _tokenizer(self):
        if self.engine is None:
            raise EngineDead(self.health().reason)
        if self.engine.tokenizer is None:
            raise EngineDead(f"the checkpoint {self.config.model} has no tokenizer")
        return self.engine.tokenizer

    def encode(self, text: str) -> list[int]:
        # a user's text, never control tokens
        return self._tokenizer().encode(text, specials_in_text=False, max_tokens=self.context_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer().decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        tok = self._tokenizer()
        return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False, specials_in_text=True,
                          max_tokens=self.context_tokens)

    # --- requests ------------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's output increments; the last has finished=True."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = request.request_id

        def add() -> None:
            self._require_engine().add_request(rid, list(request.prompt_token_ids), request.params)
            self._router.register(rid, loop, queue)

        try:
            await self._call(add)
        except asyncio.CancelledError:
            self._submit(lambda: self._abort_now(rid))  # the add may still run: take it back
            raise
        finished = False
        try:
            while True:
                out: RequestOutput = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._submit(lambda: self._abort_now(rid))

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self._abort_now(request_id))

    def state(self) -> EngineSnapshot:
        """The snapshot the engine thread published last (never built here: this runs on the server's thread),
        with the health of now."""
        health = self.health()
        now = HealthSnapshot(ready=health.ready, reason=health.reason, status=health.status)
        if self.engine is None:
            return EngineSnapshot(model=self.model_name, config=self.config.to_dict(), health=now)
        return dataclasses.replace(self.engine.snapshot, health=now)

    async def set_switch(self, name: str, enabled: bool) -> SwitchState:
        def toggle() -> SwitchState:
            state = self._require_engine().set_switch(name, enabled)
            if state.unavailable:  # the toggle changed nothing: say why rather than "off"
                self.bus.publish(SwitchEvent(name=state.name, state="unavailable", reason=state.reason))
            else:
                self.bus.publish(SwitchEvent(name=state.name, state="on" if state.enabled else "off",
                                             reason="live toggle"))
            return state

        return await self._call(toggle)

    async def set_vram_reserve(self, mib: int) -> int:
        check_vram_reserve_mib(mib)
        return await self._call(lambda: self._require_engine().set_vram_reserve(mib))

    async def set_expert_cache_mib(self, mib: int) -> ExpertCacheSnapshot:
        check_expert_cache_mib(mib)
        return await self._call(lambda: self._require_engine().set_expert_cache_mib(mib))

    # --- engine thread -------------------------------------------------------------------------------------

    def _require_engine(self):
        if self.engine is None:
            raise EngineDead(self.health().reason)
        return self.engine

    def _abort_now(self, request_id: str) -> None:
        if self.engine is not None:
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver([out])

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._stopping:
                fut.set_exception(EngineDead("the engine is shutting down"))
                return fut
            self._commands.append((fn, fut))
            self._wake.notify_all()
        return fut

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _main(self) -> None:
        try:
            self.engine = (self._factory or _default_factory)(self.config, self.bus)
        except BaseException as exc:  # noqa: BLE001 - a failed load is reported through health, not lost
            self._load_error = real_message(exc)
            self.bus.publish(EngineEvent(state="dead", detail=self._load_error))
        else:
            self.vocab_size = self.engine.vocab_size
        finally:
            self._loaded.set()
        while True:
            with self._wake:
                if self._stopping:
                    break
                if not self._commands and not (self.engine is not None and self.engine.has_work):
                    self._wake.wait(_IDLE_WAIT_S)
                commands = list(self._commands)
                self._commands.clear()
            self._run_commands(commands)
            if self.engine is not None and not self.engine.has_work and not commands:
                self.engine.idle_tick()
            if self.engine is not None and self.engine.has_work:
                try:
                    self._deliver(self.engine.step())
                except Exception as exc:  # noqa: BLE001 - Engine.step reports its own failures; this is a bug
                    self._load_error = f"engine thread: {real_message(exc)}"
                    self.bus.publish(EngineEvent(state="dead", detail=self._load_error))
                    break
        self._drain_on_stop()

    def _run_commands(self, commands: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        """Run a batch of queued commands, publish one snapshot for all of them, then answer their callers:
        what a command changed is in /strata/state when it returns (a burst of requests builds one snapshot,
        not one each)."""
        done: list[tuple[concurrent.futures.Future, bool, Any]] = []
        for fn, fut in commands:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                done.append((fut, True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                done.append((fut, False, exc))
        if done and self.engine is not None:
            try:
                self.engine.publish_snapshot(force=True)
            except Exception as exc:  # noqa: BLE001 - a bug here must not cost the commands their answers
                self.bus.publish(WarningEvent(where="engine.snapshot", message=f"not published: {real_message(exc)}"))
        for fut, ok, value in done:
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def _drain_on_stop(self) -> None:
        with self._wake:
            self._stopping = True  # no command can be queued behind a thread that is leaving
            commands = list(self._commands)
            self._commands.clear()
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDead(self._load_error or "the engine is shutting down"))
        if self.engine is not None and self._load_error is None:
            for rid in self._router.request_ids():
                self._abort_now(rid)
        else:  # the thread crashed: nobody will step again, so end every stream with the reason
            self._deliver([RequestOutput(rid, [], "", True, "error", error=self._load_error)
                           for rid in self._router.request_ids()])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._router.deliver(outputs)


def _default_factory(config: EngineConfig, bus: EventBus):
    from engine.orchestration.engine import Engine

    return Engine(config, bus)


