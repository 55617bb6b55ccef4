"""How a step becomes a replayable graph: the CUDA backend (torch.cuda.CUDAGraph) and a CPU backend.

`engine.exec.graphs.cache.GraphCache` owns the policy (when to capture, accounting, the out-of-memory recovery); a
backend owns the mechanics of one capture: warm up, record, instantiate, replay, destroy, and leaving the
device clean when any of that fails. The CPU backend records the step as an eager closure and replays it
into the same static output buffers, so the whole recovery flow, its events and its accounting run in CI
without CUDA; it can also model a device capacity, so an instantiate that does not fit fails with the
driver's real message and evicting graphs really makes room.

Both backends call `stage("begin")` just before capture begins, `stage("capture")` once the stream is
recording and `stage("instantiate")` just before instantiation: the cache uses them to name the failing stage,
and fault injection raises at the last two.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Protocol, TYPE_CHECKING

if TYPE_CHECKING:
    from engine.exec.cuda_streams import Streams

MIB = float(1 << 20)
StageHook = Callable[[str], None]
FailureHook = Callable[[BaseException], None]


@dataclass
class CapturedGraph:
    """One instantiated graph: its static output buffers and the non-tensor outputs fixed at capture."""

    handle: Any
    owner: str | None
    outputs: dict[str, Any]
    constants: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MemorySample:
    """Allocator-reserved MiB and driver-free MiB (None where the backend cannot know)."""

    reserved_mib: float
    free_mib: float | None


def delta_mib(before: MemorySample, after: MemorySample) -> float:
    """MiB taken between two samples: the larger of the allocator's growth and the driver's shrink, since
    graph pools show in the first and instantiated executables only in the second."""
    grown = after.reserved_mib - before.reserved_mib
    taken = (before.free_mib - after.free_mib) if before.free_mib is not None and after.free_mib is not None else 0.0
    return max(grown, taken, 0.0)


class GraphBackend(Protocol):
    """What GraphCache needs from a capture mechanism."""

    device: str

    def capture(self, fn: Callable, static_inputs: Mapping[str, Any], owner: str | None, stage: StageHook,
                on_failure: FailureHook) -> CapturedGraph: ...

    def replay(self, graph: CapturedGraph) -> None: ...

    def destroy(self, graph: CapturedGraph) -> None: ...

    def owner_empty(self, owner: str | None) -> None: ...

    def memory_sample(self) -> MemorySample: ...

    def free_mib(self) -> float | None: ...

    def empty_cache(self) -> None: ...


def split_outputs(outputs: Any, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors (kept as static buffers) and other values (fixed at capture) of a step's output dict."""
    if not isinstance(outputs, Mapping):
        raise TypeError(f"{what}: a step function must return a dict of outputs, got {type(outputs).__name__}")
    tensors = {k: v for k, v in outputs.items() if _is_tensor(v)}
    others = {k: v for k, v in outputs.items() if not _is_tensor(v)}
    return tensors, others


def copy_outputs(static: Mapping[str, Any], fresh: Any, what: str) -> None:
    """Copy a step's outputs into the static buffers; a shape change means the key does not fix the shapes."""
    for name, buf in static.items():
        value = fresh[name]
        if tuple(value.shape) != tuple(buf.shape) or value.dtype != buf.dtype:
            raise ValueError(f"{what}: output {name!r} changed from {tuple(buf.shape)} {buf.dtype} to "
                             f"{tuple(value.shape)} {value.dtype} between warm-up and capture")
        buf.copy_(value)


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def _nbytes(values: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in values.values() if _is_tensor(v))


class CpuGraphBackend:
    """A "graph" is the step closure recorded at capture and re-run eagerly into static output buffers.

    `capacity_mib` (optional) models a device: graphs hold their static buffers' bytes, `others_mib()` is
    what the rest of the engine holds (the tier, in tests), and an instantiate that does not fit raises the
    driver's real out-of-memory error.
    """

    def __init__(self, capacity_mib: float | None = None, others_mib: Callable[[], float] = lambda: 0.0) -> None:
        self.device = "cpu"
        self.capacity_mib = capacity_mib
        self.others_mib = others_mib
        self._held_mib: dict[int, float] = {}

    def capture(self, fn: Callable, static_inputs: Mapping[str, Any], owner: str | None, stage: StageHook,
                on_failure: FailureHook) -> CapturedGraph:
        try:
            warm = fn(static_inputs)
            outputs, constants = split_outputs(warm, "cpu graph")
            stage("begin")
            stage("capture")
            copy_outputs(outputs, fn(static_inputs), "cpu graph")
            stage("instantiate")
            size_mib = (_nbytes(static_inputs) + _nbytes(outputs)) / MIB
            free = self.free_mib()
            if free is not None and size_mib > free:
                raise RuntimeError("CUDA error: out of memory")
        except BaseException as exc:
            on_failure(exc)
            raise
        graph = CapturedGraph(handle=(fn, static_inputs), owner=owner, outputs=outputs, constants=constants)
        self._held_mib[id(graph)] = size_mib
        return graph

    def replay(self, graph: CapturedGraph) -> None:
        fn, static_inputs = graph.handle
        copy_outputs(graph.outputs, fn(static_inputs), "cpu graph replay")

    def destroy(self, graph: CapturedGraph) -> None:
        self._held_mib.pop(id(graph), None)
        graph.handle = None

    def owner_empty(self, owner: str | None) -> None:
        return None

    def memory_sample(self) -> MemorySample:
        return MemorySample(sum(self._held_mib.values()), self.free_mib())

    def free_mib(self) -> float | None:
        if self.capacity_mib is None:
            return None
        return self.capacity_mib - sum(self._held_mib.values()) - self.others_mib()

    def empty_cache(self) -> None:
        return None


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture on a side stream, one private memory pool per owner.

    Per-owner pools: graphs of one owner share a pool (the drafter's many small graphs cost one pool, not
    one each), and freeing an owner's graphs frees its whole pool. One pool for everything would make
    freeing the drafter's graphs give nothing back while any decode graph still held the pool. Sharing is
    safe for any replay order because outputs live outside the pool: the warm-up's output tensors become
    the static outputs, and the captured step copies into them, so the pool holds only intermediates.
    """

    def __init__(self, streams: Streams, lean_free_mib: float = 4096.0) -> None:
        """`streams`: the engine's (engine.exec.cuda_streams); warm-ups and captures run on their `capture` stream."""
        import torch

        self._torch = torch
        if not streams.cuda:
            raise ValueError(f"CudaGraphBackend needs a CUDA device, got device={str(streams.device)!r}")
        self._dev = streams.device
        self.device = str(self._dev)
        self.lean_free_mib = lean_free_mib
        self._stream = streams.capture
        self._pools: dict[str | None, Any] = {}
        self._separate_instantiate = True
        self.stale_recordings_cleared = 0  # a health figure: should stay 0

    def capture(self, fn: Callable, static_inputs: Mapping[str, Any], owner: str | None, stage: StageHook,
                on_failure: FailureHook) -> CapturedGraph:
        torch = self._torch
        with torch.cuda.device(self._dev):
            graph = self._new_graph()
            if owner not in self._pools:
                self._pools[owner] = torch.cuda.graph_pool_handle()
            pool = self._pools[owner]
            began = ended = False
            try:
                outputs, constants = self._warm_up(fn, static_inputs)
                stage("begin")
                self._end_stale_recording(pool)
                with torch.cuda.stream(self._stream):
                    # thread_local: a server thread asking cudaMemGetInfo must not invalidate this capture.
                    try:
                        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    except BaseException:
                        self._pool_call("endAllocateToPool", pool)  # begin may have registered the pool
                        self._pool_call("releasePool", pool)
                        self._pools.pop(owner, None)  # never reuse an id the allocator may still hold
                        raise
                    began = True
                    stage("capture")
                    fresh = fn(static_inputs)
                    copy_outputs(outputs, fresh, "cuda graph capture")
                    del fresh
                    graph.capture_end()
                    ended = True
                stage("instantiate")
                if self._separate_instantiate:
                    graph.instantiate()
            except BaseException as exc:
                self._abort(graph, pool, began, ended)
                self._end_stale_recording(pool)  # counts what _abort missed: its filter would dangle
                on_failure(exc)
                self._release(graph)
                raise
        return CapturedGraph(handle=graph, owner=owner, outputs=outputs, constants=constants)

    def _new_graph(self) -> Any:
        # keep_graph=True splits instantiate from capture_end, so an instantiate OOM is named as such.
        # Older PyTorch lacks it: capture_end then instantiates, and its failures count as end of capture.
        try:
            graph = self._torch.cuda.CUDAGraph(keep_graph=True)
            self._separate_instantiate = True
        except TypeError:
            graph = self._torch.cuda.CUDAGraph()
            self._separate_instantiate = False
        return graph

    def _warm_up(self, fn: Callable, static_inputs: Mapping[str, Any]) -> tuple[dict, dict]:
        # Lazy initialisation (cuBLAS workspaces, torch.compile, autotuning) must happen outside capture.
        torch = self._torch
        current = torch.cuda.current_stream(self._dev)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            warm = fn(static_inputs)
        current.wait_stream(self._stream)
        outputs = split_outputs(warm, "cuda graph warm-up")
        del warm
        for tensor in outputs[0].values():
            # Allocated on the side stream, written by replays on this one: free them only after both.
            tensor.record_stream(current)
        free = self.free_mib()
        if free is not None and free < self.lean_free_mib:
            # The warm-up's intermediates sit in the general cache, which the graph's private pool cannot
            # use; when VRAM is short, hand them back so the capture can have the same memory. Torch's cache
            # only: `del warm` freed them (no reference cycle holds a step's tensors), and with VRAM full by
            # design every capture comes here, where a full collection of the process's objects would stall
            # the serving thread for tens of milliseconds (docs/GRAPHS.md).
            torch.cuda.empty_cache()
        return outputs

    def _abort(self, graph: Any, pool: Any, began: bool, ended: bool) -> None:
        """Leave capture mode and give the pool's use back, whatever state the failure left behind."""
        if not began or ended:
            return  # reset() releases the pool of a graph whose capture ended
        torch = self._torch
        cleanly = False
        with torch.cuda.stream(self._stream):
            try:  # ends the capture even when it was invalidated (and then raises)
                graph.capture_end()
                cleanly = True
            except Exception:
                pass
        if not cleanly:
            # capture_end raised at cudaStreamEndCapture, before telling the allocator the capture is over
            # (a later capture_begin on this pool then fails "already recording to mempool_id") and before
            # marking the capture ended, so reset() would not release the pool either.
            self._pool_call("endAllocateToPool", pool)
            if self._separate_instantiate:
                # Without keep_graph, capture_end can fail after marking the capture ended; releasing twice
                # would corrupt the pool's use count, so an older PyTorch gets reset() only.
                self._pool_call("releasePool", pool)

    def _end_stale_recording(self, pool: Any) -> None:
        """Clear a recording some earlier failed capture left registered on this pool, if any."""
        if self._pool_call("endAllocateToPool", pool):
            self.stale_recordings_cleared += 1

    def _pool_call(self, name: str, pool: Any) -> bool:
        """torch._C._cuda_<name>(device, pool); False when it refused (the normal case for a stale check)."""
        fn = getattr(self._torch._C, f"_cuda_{name}", None)
        if fn is None:
            return False
        try:
            fn(self._dev.index, pool)
            return True
        except Exception:
            return False

    def _release(self, graph: Any) -> None:
        try:
            graph.reset()
        except Exception:
            pass
        del graph
        self.empty_cache()

    def replay(self, graph: CapturedGraph) -> None:
        graph.handle.replay()

    def destroy(self, graph: CapturedGraph) -> None:
        handle, graph.handle = graph.handle, None
        if handle is not None:
            handle.reset()

    def owner_empty(self, owner: str | None) -> None:
        # The next capture for this owner starts a fresh pool; the old one is freed by empty_cache.
        self._pools.pop(owner, None)

    def memory_sample(self) -> MemorySample:
        torch = self._torch
        torch.cuda.synchronize(self._dev)
        return MemorySample(torch.cuda.memory_reserved(self._dev) / MIB, self.free_mib())

    def free_mib(self) -> float | None:
        try:
            return self._torch.cuda.mem_get_info(self._dev)[0] / MIB
        except Exception:
            return None

    def empty_cache(self) -> None:
        gc.collect()
        try:
            self._torch.cuda.empty_cache()
        except Exception:
            pass


def default_backend(device: Any, streams: Streams | None = None) -> GraphBackend:
    """CUDA backend for a CUDA device (capturing on the capture stream of `streams`, the engine's), the CPU
    backend otherwise."""
    if str(device).startswith("cuda"):
        from engine.exec.cuda_streams import required  # it imports torch, which this module takes only for CUDA

        return CudaGraphBackend(required(streams, device, "a CUDA graph backend"))
    return CpuGraphBackend()


def key_text(key: Hashable) -> str:
    """A key as shown in events and /strata/state."""
    if isinstance(key, tuple):
        return "(" + ", ".join(str(k) for k in key) + ")"
    return str(key)
