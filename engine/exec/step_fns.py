"""The step-executor seam between the runner and the graph cache.

The runner expresses each forward it needs (decode/verify for a batch bucket, the drafter's prefill, round
and chain steps) as a *step function*: a pure tensor function of a dict of static-shape input tensors that
returns a dict of output tensors, reading and writing only buffers allocated before it runs (KV, scratch).
Such a function can be replayed from a captured CUDA graph. The runner hands every step to an executor:

    outputs = executor.run(kind="decode", key=("b8", "t2", "L4096"), fn=step_fn, inputs={...}, owner=None)

`EagerExecutor` (CPU, or graphs off) just calls the function. `engine.exec.graphs.cache.GraphCache` captures it on first
need, replays it afterwards, and owns the out-of-memory recovery path. Outputs from a graph replay are the
graph's static buffers: consume (or clone) them before the next `run` of the same key.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Mapping, Protocol

from engine.snapshot import GraphsSnapshot

StepFn = Callable[[Mapping[str, Any]], dict[str, Any]]


class StepExecutor(Protocol):
    def run(
        self,
        kind: str,
        key: Hashable,
        fn: StepFn,
        inputs: Mapping[str, Any],
        owner: str | None = None,
    ) -> dict[str, Any]:
        """Run `fn(inputs)`, possibly from a captured graph identified by (kind, key).

        `owner` names who the graph belongs to (e.g. "drafter") so the out-of-memory path can free that
        owner's *other* graphs first. Raises `engine.exec.graphs.cache.GraphDegraded` when the step could not be captured
        even after recovery: the caller turns the responsible switch or MTP off and takes its eager path.
        """
        ...

    def release(self, owner: str | None = None) -> float:
        """Drop captured graphs (all, or one owner's); returns the MiB given back."""
        ...

    def invalidate(self, predicate: Callable[[str, Hashable], bool]) -> None:
        """Drop graphs whose (kind, key) match, e.g. after a live switch change alters the code path."""
        ...

    def snapshot(self) -> GraphsSnapshot:
        """For /strata/state: the graphs held, their MiB, the degraded ones."""
        ...

    def precapture(self, specs: Iterable[Any]) -> dict[str, Any] | None:
        """CAPTURE_ALL: capture these buckets now; None from an executor that captures nothing."""
        ...


class EagerExecutor:
    """Runs every step eagerly. The CPU path, and the GPU path with `--no-graphs`."""

    def run(self, kind: str, key: Hashable, fn: StepFn, inputs: Mapping[str, Any], owner: str | None = None) -> dict[str, Any]:
        return fn(inputs)

    def release(self, owner: str | None = None) -> float:
        return 0.0

    def invalidate(self, predicate: Callable[[str, Hashable], bool]) -> None:
        return None

    def snapshot(self) -> GraphsSnapshot:
        return GraphsSnapshot(enabled=False)

    def precapture(self, specs: Iterable[Any]) -> dict[str, Any] | None:
        return None


class GraphDegraded(RuntimeError):
    """A step could not be captured even after the out-of-memory recovery path.

    `switch` names the opt-in switch responsible (the caller degrades it), or None when the step belongs to
    MTP drafting itself (the caller turns drafting off). `error` is the real error text.
    """

    def __init__(self, kind: str, key: object, switch: str | None, error: str) -> None:
        self.kind = kind
        self.key = key
        self.switch = switch
        self.error = error
        super().__init__(f"{kind} graph {key!r} degraded ({switch or 'mtp'}): {error}")
