"""`bench profile`'s phase pass: a steady decode step's host wall time split by what the engine does in it.

Timers wrap the engine's own calls on their objects (instance attributes, removed afterwards), so the pass
runs the real step; a phase's time excludes the phases nested inside it:

    schedule     Scheduler.schedule: the plan (admissions, decodes, KV blocks)
    forward      the runner's decode / verify (and the fused verify + draft): on CPU the model's compute
    sample       sampling and the tokens' readback (sample_isolating_rows, decode_ahead's read)
    execute      the rest of PlanExecutor.execute: rows, generators, the SampledTokens
    update       Scheduler.update: token bookkeeping, stop tokens, max_tokens, finishing
    detokenize   OutputProcessor.append / close: incremental detokenization, stop strings, the increments
    deliver      the rest of Engine._deliver: ends, slot events of first tokens and ends
    telemetry    Engine._publish_progress and publish_snapshot: paced slot events (each slot's at most every
                 SLOT_EVENT_INTERVAL_S, longer past FULL_RATE_SLOTS busy slots: per step, they grow with the
                 step's time), VRAM books, the snapshot
    to_clients   OutputRouter.deliver: AsyncEngine's hand-over to the waiting clients' asyncio queues (here one
                 event loop on its own thread, as the server's, with a task per request awaiting its queue and
                 one awaiting the telemetry, as the server's metrics do)
    other        the step's wall time not in a phase above

`us_per_row` is `us_per_step / batch`: a phase whose per-row figure stays flat as the batch grows costs per
request; one whose per-step figure stays flat does not grow with the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import engine.exec.plan_executor as plan_executor_module
from engine.orchestration.delivery import OutputRouter

PHASES = ("schedule", "forward", "sample", "execute", "update", "detokenize", "deliver", "telemetry",
          "to_clients", "other")


class _Clock:
    """Exclusive time per phase: a nested phase's time is taken out of the phase around it."""

    def __init__(self) -> None:
        self.own_s = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self._stack: list[list[Any]] = []  # [phase, start, time of nested phases]

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [phase, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[1]
                self.own_s[phase] += spent - frame[2]
                self.calls[phase] += 1
                if self._stack:
                    self._stack[-1][2] += spent

        return timed


@contextlib.contextmanager
def _installed(clock: _Clock, engine: Any) -> Iterator[None]:
    """The timers on the engine's objects; everything put back on exit."""
    targets = [(engine.sched, "schedule", "schedule"), (engine.executor, "execute", "execute"),
               (engine.runner, "decode", "forward"), (engine.runner, "verify", "forward"),
               (engine.sched, "update", "update"), (engine.output, "append", "detokenize"),
               (engine.output, "close", "detokenize"), (engine, "_deliver", "deliver"),
               (engine, "_publish_progress", "telemetry"), (engine, "publish_snapshot", "telemetry"),
               (engine.ahead, "read_and_launch", "sample"), (engine.ahead, "read_and_launch_verify", "sample")]
    if engine.drafter is not None and hasattr(engine.drafter, "verify_and_draft"):
        targets.append((engine.drafter, "verify_and_draft", "forward"))
    for owner, name, phase in targets:
        setattr(owner, name, clock.wrap(phase, getattr(owner, name)))
    sample = plan_executor_module.sample_isolating_rows
    plan_executor_module.sample_isolating_rows = clock.wrap("sample", sample)
    try:
        yield
    finally:
        plan_executor_module.sample_isolating_rows = sample
        for owner, name, _ in targets:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)  # the class's method again


async def _started(fn: Callable[[], Any]) -> asyncio.Task:
    return asyncio.ensure_future(fn())


def phase_pass(bench: Any, reqs: list[Any], steps: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`steps` steps with the phase timers on and the outputs handed to an OutputRouter whose queues live on an
    event loop in another thread (as AsyncEngine's do); rows per phase and the pass's mean step time."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-clients", daemon=True)
    thread.start()
    router = OutputRouter()

    async def clients() -> list[asyncio.Task]:  # one waiting client per request, as the server's streams are
        async def drain(queue: asyncio.Queue) -> None:
            while True:
                await queue.get()

        tasks = []
        for req in reqs:
            queue: asyncio.Queue = asyncio.Queue()
            router.register(req.request_id, loop, queue)
            tasks.append(asyncio.ensure_future(drain(queue)))
        return tasks

    tasks = asyncio.run_coroutine_threadsafe(clients(), loop).result(timeout=60)
    # and the telemetry's reader a server always has (its metrics), awaiting the bus on the same loop
    events = bench.bus.subscribe(after_seq=None, loop=loop)
    stopping = threading.Event()

    async def watch() -> None:
        # Python 3.11's asyncio.wait_for (inside aget) can swallow a cancel that lands as its wait completes: the
        # loop then ends on the flag instead of waiting forever for a cancel that was eaten
        while not stopping.is_set():
            await events.aget(timeout_s=1.0)

    tasks.append(asyncio.run_coroutine_threadsafe(_started(watch), loop).result(timeout=60))
    clock = _Clock()
    deliver = clock.wrap("to_clients", router.deliver)
    wall_s = 0.0
    try:
        with _installed(clock, bench.engine):
            for _ in range(steps):
                t0 = time.perf_counter()
                deliver(bench.step())
                wall_s += time.perf_counter() - t0
    finally:
        async def stop() -> None:
            stopping.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=60)
        events.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    clock.own_s["other"] = max(0.0, wall_s - sum(clock.own_s.values()))
    batch = max(1, len(reqs))
    rows = [{"section": "phase", "name": phase, "calls_per_step": clock.calls[phase] / steps,
             "us_per_step": clock.own_s[phase] / steps * 1e6, "us_per_row": clock.own_s[phase] / steps / batch * 1e6}
            for phase in PHASES]
    host_s = wall_s - clock.own_s["forward"]
    return rows, {"phase_step_ms": wall_s / steps * 1e3, "host_us_per_step": host_s / steps * 1e6,
                  "host_us_per_row": host_s / steps / batch * 1e6}
