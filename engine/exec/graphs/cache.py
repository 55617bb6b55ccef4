"""The graph cache: capture each step once, replay it after, and survive running out of memory doing so.

`GraphCache` implements `engine.exec.step_fns.StepExecutor`. On the first `run(kind, key, ...)` it stages static
input buffers, captures the step through a backend (`engine.exec.graphs.backends`: CUDA graphs on a GPU, recorded
closures on CPU), records the graph's measured MiB and capture ms and emits `GraphEvent(capture)`; later
calls copy inputs in and replay.

When a capture or instantiate fails for memory (the seed report's crash), the cache, in order:
  1. reports the real error: type and message through `__cause__`/`__context__`, and VRAM free right then;
  2. leaves the device clean: capture mode ended, the failed graph and its pool use released (the backend);
  3. frees this owner's other graphs and retries once (`evict` per graph, then `retry`);
  4. asks the adaptive tier to release memory and polls for room, `wait_polls` x `wait_interval_s` (`wait`);
  5. gives up: `fail` + `degrade`, remembers the (kind, key) so it is never captured again this run (it runs
     eagerly from then on: no retry storm), and raises GraphDegraded naming the responsible switch.
A sticky CUDA error is never retried: it raises StickyCudaError, which the engine turns into a fatal stop.
docs/GRAPHS.md describes the flow, the memory pools and the fault-injection hook that tests it on CPU.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Mapping, Protocol, TYPE_CHECKING

from engine.exec.compile import StepCompiler
from engine.exec.step_fns import GraphDegraded, StepFn
from engine.exec.gpu_errors import classify, exception_chain, real_message, sticky_from
from engine.exec.graphs.backends import CapturedGraph, GraphBackend, default_backend, delta_mib, key_text
from engine.exec.graphs.inputs import Pack, fill_inputs, stage_inputs
from engine.snapshot import DegradedGraph, GraphsSnapshot
from engine.snapshot import GraphEntry as GraphSnapshotEntry
from engine.switches import SwitchBoard
from engine.telemetry import EventBus, GraphEvent

if TYPE_CHECKING:
    from engine.exec.cuda_streams import Streams

__all__ = ["GraphCache", "GraphDegraded", "GraphSpec"]

ReleaseTier = Callable[[float, str], float]
SwitchForKey = Callable[[str, Hashable], "str | None"]


class FaultHook(Protocol):
    """Called at each capture stage ("capture", "instantiate") of a graph kind; raises to fail that attempt.
    The out-of-memory paths only run when VRAM runs out at the wrong moment, which a test cannot arrange, so
    tests fail attempts on purpose (tests/fault_injection.py's FaultPlan)."""

    def check(self, stage: str, kind: str) -> None: ...


# The hook a GraphCache built without one uses: None in a product run. Tests install theirs here, for the
# caches an engine builds (tests/fault_injection.py, in process or, by sitecustomize, in an engine process).
installed_faults: FaultHook | None = None
_TRIED_MIB = re.compile(r"Tried to allocate ([0-9.]+) (KiB|MiB|GiB)")
_UNIT_MIB = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}


@dataclass
class GraphSpec:
    """One graph to capture ahead of need (CAPTURE_ALL): the arguments `run` would get."""

    kind: str
    key: Hashable
    fn: StepFn
    inputs: Mapping[str, Any]
    owner: str | None = None


@dataclass
class GraphEntry:
    """A captured graph and its accounting."""

    kind: str
    key: Hashable
    owner: str | None
    static_inputs: dict[str, Any]
    scalars: dict[str, Any]
    graph: CapturedGraph
    mib: float
    capture_ms: float
    replays: int = 0
    packs: list[Pack] = field(default_factory=list)  # inputs refilled with one copy (engine.exec.graphs.inputs)


@dataclass
class _Failure:
    """One failed attempt, already reduced to text so no traceback keeps graph memory alive."""

    category: str  # oom | sticky | other
    stage: str  # warmup | capture | instantiate
    message: str
    vram_free_mib: float | None
    exc: BaseException | None = field(default=None, repr=False)


class GraphCache:
    """Captures and replays steps as graphs; owns the out-of-memory recovery. See the module docstring."""

    def __init__(
        self,
        device: Any,
        bus: EventBus,
        board: SwitchBoard,
        release_tier: ReleaseTier,
        wait_polls: int = 20,
        wait_interval_s: float = 0.08,
        fault_plan: FaultHook | None = None,
        switch_for_key: SwitchForKey | None = None,
        backend: GraphBackend | None = None,
        compiler: StepCompiler | None = None,
        default_need_mib: float = 256.0,
        sleep: Callable[[float], None] = time.sleep,
        streams: Streams | None = None,
    ) -> None:
        """`streams`: the engine's (engine.exec.cuda_streams), whose capture stream a CUDA device's captures run on
        (needed there unless `backend` is given; None on a CPU)."""
        self.device = str(device)
        self.bus = bus
        self.board = board
        self.release_tier = release_tier
        self.wait_polls = max(0, int(wait_polls))
        self.wait_interval_s = float(wait_interval_s)
        self.fault_plan = fault_plan if fault_plan is not None else installed_faults
        self.switch_for_key = switch_for_key or (lambda kind, key: None)
        self.backend = backend if backend is not None else default_backend(device, streams)
        self.compiler = compiler if compiler is not None else StepCompiler(board, bus)
        self.default_need_mib = default_need_mib
        self._sleep = sleep
        self._entries: dict[tuple[str, Hashable], GraphEntry] = {}
        self._degraded: dict[tuple[str, Hashable], str] = {}
        self._size_hint_mib: dict[str, float] = {}
        self._lock = threading.Lock()

    # --- the executor seam ---------------------------------------------------------------------------

    def run(self, kind: str, key: Hashable, fn: StepFn, inputs: Mapping[str, Any],
            owner: str | None = None) -> dict[str, Any]:
        """Replay the (kind, key) graph with `inputs`, capturing it first if needed.

        Returns the graph's static outputs (valid until the next run of the same key). A (kind, key) that
        degraded earlier runs `fn` eagerly. Raises GraphDegraded or StickyCudaError as described above.
        """
        entry = self._entries.get((kind, key))
        if entry is None:
            if (kind, key) in self._degraded:
                return fn(inputs)
            entry = self._capture_with_recovery(kind, key, fn, inputs, owner)
            # The warm-up ran the step on these very inputs and capture does not execute it, so the static
            # outputs already hold this call's results.
            return {**entry.graph.outputs, **entry.graph.constants}
        self._fill(entry, inputs)
        try:
            self.backend.replay(entry.graph)
        except Exception as exc:
            if classify(exc) == "sticky":
                raise sticky_from(exc, f"graph replay {kind} {key_text(key)}", self.device) from exc
            raise
        entry.replays += 1
        return {**entry.graph.outputs, **entry.graph.constants}

    def release(self, owner: str | None = None) -> float:
        """Drop every graph (owner None) or one owner's graphs; returns the MiB given back."""
        return self._drop(lambda e: owner is None or e.owner == owner, action="release")[1]

    def invalidate(self, predicate: Callable[[str, Hashable], bool]) -> None:
        """Drop graphs whose (kind, key) match, e.g. after a live switch change alters the code path."""
        self._drop(lambda e: predicate(e.kind, e.key), action="release")

    def snapshot(self) -> GraphsSnapshot:
        """For /strata/state: every graph's kind, key, owner, MiB, capture ms and replays, and the degraded."""
        with self._lock:
            graphs = [GraphSnapshotEntry(kind=e.kind, key=key_text(e.key), owner=e.owner, mib=round(e.mib, 2),
                                         capture_ms=round(e.capture_ms, 2), replays=e.replays)
                      for e in self._entries.values()]
            degraded = [DegradedGraph(kind=k, key=key_text(key), error=err)
                        for (k, key), err in self._degraded.items()]
        return GraphsSnapshot(enabled=True, device=self.device, graphs=graphs,
                              total_mib=round(sum(g.mib for g in graphs), 2), degraded=degraded,
                              **self.compiler.cache_stats())

    @property
    def total_mib(self) -> float:
        with self._lock:
            return sum(e.mib for e in self._entries.values())

    def precapture(self, specs: Iterable[GraphSpec]) -> dict[str, Any]:
        """CAPTURE_ALL: capture every given bucket now. A bucket that cannot be captured degrades
        CAPTURE_ALL itself (the rest are captured lazily, as without the switch) instead of the step."""
        captured, started = 0, time.perf_counter()
        for spec in specs:
            if (spec.kind, spec.key) in self._entries:
                continue
            try:
                self._capture_with_recovery(spec.kind, spec.key, spec.fn, spec.inputs, spec.owner)
            except GraphDegraded as exc:
                self._degraded.pop((spec.kind, spec.key), None)
                self._degrade_switch("CAPTURE_ALL", f"precapture of {spec.kind} {key_text(spec.key)}: {exc.error}")
                break
            captured += 1
        return {"captured": captured, "total_mib": self.total_mib,
                "ms": (time.perf_counter() - started) * 1e3}

    # --- capture and recovery ------------------------------------------------------------------------

    def _capture_with_recovery(self, kind: str, key: Hashable, fn: StepFn, inputs: Mapping[str, Any],
                               owner: str | None) -> GraphEntry:
        static_inputs, scalars, packs = stage_inputs(inputs)
        entry = self._capture_staged(kind, key, fn, static_inputs, scalars, owner)
        entry.packs = packs  # until here a replay would refill the pack's views one by one: the same bytes
        return entry

    def _capture_staged(self, kind: str, key: Hashable, fn: StepFn, static_inputs: dict, scalars: dict,
                        owner: str | None) -> GraphEntry:
        started = time.perf_counter()
        step = self.compiler.prepare(fn)
        result = self._attempt(kind, key, step, static_inputs, scalars, owner)
        if isinstance(result, _Failure) and step is not fn and result.category == "other":
            # Dynamo/Inductor failures surface at the first call (the warm-up) or while capturing compiled
            # kernels; memory shortages are not the compiler's fault and take the normal path below.
            self.compiler.degrade(result.message, where=f"graph {kind} {key_text(key)}")
            step = fn
            result = self._attempt(kind, key, step, static_inputs, scalars, owner)
        if isinstance(result, GraphEntry):
            return result
        failure = result
        if failure.category == "other" and failure.stage == "warmup":
            raise failure.exc  # the step itself is broken; not a graph problem
        if failure.category == "oom":
            entry_or_failure = self._recover(kind, key, step, static_inputs, scalars, owner, failure)
            if isinstance(entry_or_failure, GraphEntry):
                return entry_or_failure
            failure = entry_or_failure
        return self._give_up(kind, key, failure, started)

    def _recover(self, kind: str, key: Hashable, step: StepFn, static_inputs: dict, scalars: dict,
                 owner: str | None, failure: _Failure) -> GraphEntry | _Failure:
        """Steps 3 and 4: free this owner's other graphs and retry once, then shrink the tier and poll."""
        def attempt() -> GraphEntry | _Failure:
            return self._attempt(kind, key, step, static_inputs, scalars, owner)

        evicted, freed = self._drop(lambda e: e.owner == owner, action="evict", error=failure.message)
        if evicted:
            self._emit("retry", kind, key, mib=freed, error=failure.message)
            result = attempt()
            if not isinstance(result, _Failure) or result.category != "oom":
                return result
            failure = result
        if self.wait_polls == 0:
            return failure
        released = self._ask_tier(kind, key, failure)
        last_free = failure.vram_free_mib
        for poll in range(self.wait_polls):
            if poll:
                self._sleep(self.wait_interval_s)
            free = self.backend.free_mib()
            final = poll == self.wait_polls - 1
            # Retrying while nothing came back only repeats the failure; the first and last polls always try.
            if poll and not final and free is not None and last_free is not None and free < last_free + 1.0:
                continue
            result = attempt()
            if not isinstance(result, _Failure) or result.category != "oom":
                return result
            failure, last_free = result, result.vram_free_mib
            if released > 0 and not final:
                # The tier gave memory and the step still ran short: a warm-up allocates many buffers, and
                # the failed one named only its own size (docs/GRAPHS.md: a 128K split-KV graph would degrade
                # with most of the tier still held). Ask again.
                released = self._ask_tier(kind, key, failure)
        return failure

    def _ask_tier(self, kind: str, key: Hashable, failure: _Failure) -> float:
        """Ask the tier for what `failure` lacked; a `wait` event says how much it gave."""
        need_mib = self._need_mib(kind, failure.message)
        released = float(self.release_tier(need_mib, f"graph {kind} {key_text(key)} out of memory") or 0.0)
        self._emit("wait", kind, key, mib=released, error=failure.message)
        return released

    def _give_up(self, kind: str, key: Hashable, failure: _Failure, started: float) -> GraphEntry:
        if failure.category == "sticky":
            raise sticky_from(failure.exc or RuntimeError(failure.message),
                              f"graph {failure.stage} {kind} {key_text(key)}", self.device)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        switch = self.switch_for_key(kind, key)
        self._emit("fail", kind, key, ms=elapsed_ms, error=failure.message)
        self._emit("degrade", kind, key, error=f"{switch or 'mtp'} off: {failure.message}")
        with self._lock:
            self._degraded[(kind, key)] = failure.message
        raise GraphDegraded(kind, key, switch, failure.message)

    def _attempt(self, kind: str, key: Hashable, step: StepFn, static_inputs: dict, scalars: dict,
                 owner: str | None) -> GraphEntry | _Failure:
        """One capture + instantiate. Never raises for a failed capture: returns what failed, as text."""
        stage = ["warmup"]
        failure: list[_Failure] = []

        def on_stage(name: str) -> None:
            # "begin" (just before capture begins) only names the stage: faults fire while capturing.
            stage[0] = "capture" if name == "begin" else name
            if self.fault_plan is not None and name != "begin":
                self.fault_plan.check(name, kind)

        def on_failure(exc: BaseException) -> None:
            # Called once capture mode is over but before the pool is released: the VRAM free "right then".
            free = self.backend.free_mib()
            where = f"{kind} graph {key_text(key)} {stage[0]}"
            shown = "unknown" if free is None else f"{free:.0f} MiB"
            failure.append(_Failure(classify(exc), stage[0], f"{where}: {real_message(exc)} (vram free {shown})",
                                    free, exc))

        before = self.backend.memory_sample()
        t0 = time.perf_counter()
        try:
            graph = self.backend.capture(lambda ins: step({**ins, **scalars}), static_inputs, owner,
                                         on_stage, on_failure)
        except Exception as exc:
            if not failure:  # a backend that failed before it could report
                on_failure(exc)
            if not (failure[0].category == "other" and failure[0].stage == "warmup"):
                _drop_tracebacks(exc)  # the step's own bug keeps its traceback: it is re-raised as is
            del exc
            with self._lock:
                owner_has_graphs = any(e.owner == owner for e in self._entries.values())
            if not owner_has_graphs:
                self.backend.owner_empty(owner)  # the next attempt records into a fresh pool id
            self.backend.empty_cache()
            return failure[0]
        capture_ms = (time.perf_counter() - t0) * 1e3
        mib = delta_mib(before, self.backend.memory_sample())
        entry = GraphEntry(kind, key, owner, static_inputs, scalars, graph, mib, capture_ms)
        with self._lock:
            self._entries[(kind, key)] = entry
        self._size_hint_mib[kind] = max(self._size_hint_mib.get(kind, 0.0), mib)
        self._emit("capture", kind, key, mib=mib, ms=capture_ms)
        return entry

    # --- helpers ---------------------------------------------------------------------------------------

    def _drop(self, match: Callable[[GraphEntry], bool], action: str,
              error: str | None = None) -> tuple[int, float]:
        """Destroy matching graphs, one event each; returns how many and the MiB given back (measured)."""
        with self._lock:
            victims = [e for e in self._entries.values() if match(e)]
            for e in victims:
                del self._entries[(e.kind, e.key)]
        count = len(victims)
        if not victims:
            return 0, 0.0
        before = self.backend.memory_sample()
        owners = {e.owner for e in victims}
        for e in victims:
            self.backend.destroy(e.graph)
            self._emit(action, e.kind, e.key, mib=e.mib, error=error)
        with self._lock:
            remaining = {e.owner for e in self._entries.values()}
        for owner in owners - remaining:
            self.backend.owner_empty(owner)
        victims.clear()
        self.backend.empty_cache()
        return count, delta_mib(self.backend.memory_sample(), before)

    def _need_mib(self, kind: str, message: str) -> float:
        """What to ask the tier for: the larger of the failed allocation and this kind's largest graph."""
        tried = _TRIED_MIB.search(message)
        tried_mib = float(tried.group(1)) * _UNIT_MIB[tried.group(2)] if tried else 0.0
        return max(tried_mib, self._size_hint_mib.get(kind, 0.0), self.default_need_mib)

    def _fill(self, entry: GraphEntry, inputs: Mapping[str, Any]) -> None:
        fill_inputs(f"{entry.kind} graph {key_text(entry.key)}", entry.static_inputs, entry.scalars, entry.packs,
                    inputs)

    def _emit(self, action: str, kind: str, key: Hashable, mib: float = 0.0, ms: float = 0.0,
              error: str | None = None) -> None:
        self.bus.publish(GraphEvent(action=action, kind=kind, key=key_text(key), mib=round(mib, 3),
                                    ms=round(ms, 3), error=error, device=self.device))

    def _degrade_switch(self, name: str, reason: str) -> None:
        self.board.degrade(name, reason, self.bus, where="graphs")


def _drop_tracebacks(exc: BaseException) -> None:
    """Break exception -> frame references so tensors allocated in a failed capture can be freed."""
    for cur in exception_chain(exc):
        cur.__traceback__ = None
