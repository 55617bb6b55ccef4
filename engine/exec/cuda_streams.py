"""Streams: the one owner of an engine's CUDA streams and of the split-counter lane their launches use.

Built once by the engine builder (engine.orchestration.engine_setup) and handed to every component that queues
work off the current stream; none makes a stream of its own (tests/engine/exec/test_streams.py holds that).

- `steps`: a step's work while a chunk may run beside it, at high priority (engine.exec.plan_executor,
  `on("steps")`);
- `side`: a prompt chunk beside the steps, on a green context's SMs or at low priority (engine.exec.chunk_stream,
  `on("chunks", beside=True)`);
- `capture`: graph warm-ups and captures (engine.exec.graphs.backends.CudaGraphBackend);
- `kv_copy`: host-to-pool block fetches, --kv-resident (engine.exec.kv.paging.KVPaging);
- `expert_copy`: an MoE model's expert loads into their device slots (engine.exec.experts.cache.ExpertCache).

`steps` and `side` exist only where prompt chunks run beside the steps (--prefill-overlap); every stream is None
on a CPU, where everything runs in order on the one thread. The two copy streams stay apart: a step waits for the
whole of its copy stream before it reads what was copied, and an expert load should not wait behind KV fetches
queued for later layers, nor a KV fetch behind expert loads.

The lane: the skinny matmul's split counters (engine.model.triton_linear) are one array per lane, and two launches
sharing an array at once would each see the other's splits finish. A prompt chunk beside the steps runs on `side`
while the steps run on `steps`, so its launches (eager: engine.exec.runner.ModelRunner.prefill) use the "chunks"
lane. Everything on the steps' stream uses "steps", prompt chunks between the steps included: they run in order
with the steps, so the "chunks" lane has one user, the side stream. Without the overlap every launch uses "steps".
The kernels deep in the model read the lane from a ContextVar (passing it down every forward would
reach through every layer); `on` is the only thing that sets it.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator

import torch

# The chunks' share of the SMs: the rest stays free for the decoding slots' kernels. Fewer SMs slow the chunks
# (the first token comes later); more leave decode less of its rate and do not speed the chunks up
# (docs/BENCHMARKS.md, "A fresh 176K prompt beside six decoding slots").
CHUNK_SM_SHARE = 0.75
_SM_GROUP = 8
_HIGHEST_PRIORITY = -100  # torch maps a priority past the device's range to its highest (lower is higher)
_LOWEST_PRIORITY = 0
LANES = ("steps", "chunks")  # engine.model.triton_linear.COUNTER_LANES


def default_chunk_sms(device: torch.device) -> int:
    """The chunks' SM share: CHUNK_SM_SHARE of the device's SMs, in whole groups of _SM_GROUP (what a green
    context is split by)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return int(sms * CHUNK_SM_SHARE) // _SM_GROUP * _SM_GROUP


# One green context per (device, SMs), never destroyed: tensors the side stream allocated outlive an engine in
# torch's allocator cache, and freeing one after its stream's context was destroyed aborts the process ("CUDA
# error: context is destroyed" from the allocator). That includes the interpreter's exit,
# which would destroy the context while graphs and weights are still being freed: `serve` ended by SIGTERM would exit
# -6 (SIGABRT) instead of 0. So each context keeps one reference no module teardown drops,
# and the driver releases it with the process.
_GREEN_STREAMS: dict[tuple[int, int], tuple[Any, torch.cuda.Stream]] = {}


def _immortal(obj: Any) -> Any:
    """`obj` with one reference that nothing ever releases (its destructor never runs, not even at exit)."""
    incref = ctypes.pythonapi.Py_IncRef
    incref.argtypes, incref.restype = [ctypes.py_object], None
    incref(obj)
    return obj


def _green_stream(device_index: int, sms: int) -> torch.cuda.Stream:
    key = (device_index, sms)
    if key not in _GREEN_STREAMS:
        from torch.cuda.green_contexts import GreenContext

        context = GreenContext.create(num_sms=sms, device_id=device_index)
        _GREEN_STREAMS[key] = _immortal((context, context.Stream()))
    return _GREEN_STREAMS[key][1]


def required(streams: "Streams | None", device: object, user: str) -> "Streams":
    """The engine's `streams` for `user`, a component on the CUDA `device`; ValueError naming both when they were
    not handed down (the component would otherwise have to make a stream of its own)."""
    if streams is None or not streams.cuda:
        raise ValueError(f"{user} on device={str(device)!r} needs the engine's streams (engine.exec.cuda_streams.Streams)")
    return streams


class Streams:
    """An engine's CUDA streams and the lane of each (see the module docstring)."""

    def __init__(self, device: torch.device | str, overlap: bool = False, chunk_sms: int | None = None) -> None:
        """`overlap`: prompt chunks run beside the steps (engine.exec.chunk_stream.overlap_wanted), so the steps
        get their own high-priority stream and the chunks a side stream. The side stream belongs to a CUDA green
        context of `chunk_sms` SMs (torch's GreenContext; None: the default share, `default_chunk_sms`), so a
        chunk's kernels never hold the other SMs, which the steps' kernels find free; 0, or a torch or driver
        without green contexts (`note` says why): a plain low-priority stream, where the steps' kernels get an SM
        only as a chunk's thread blocks retire."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = device.type == "cuda"
        self.overlap = overlap
        self.note: str | None = None
        self.chunk_sms = 0
        self.steps: torch.cuda.Stream | None = None
        self.side: torch.cuda.Stream | None = None
        self.capture = self.kv_copy = self.expert_copy = None
        if not self.cuda:
            return
        self.capture = torch.cuda.Stream(device)
        self.kv_copy = torch.cuda.Stream(device)
        self.expert_copy = torch.cuda.Stream(device)
        if overlap:
            self.steps = torch.cuda.Stream(device, priority=_HIGHEST_PRIORITY)
            sms = default_chunk_sms(device) if chunk_sms is None else chunk_sms
            if sms:
                try:
                    self.side, self.chunk_sms = _green_stream(device.index or 0, sms), sms
                except Exception as exc:  # noqa: BLE001 - an older torch or driver: the priority stream serves
                    self.note = (f"prompt chunks beside the steps without an SM share: no green context of {sms} "
                                 f"SMs ({type(exc).__name__}: {exc})")
            if self.side is None:
                self.side = torch.cuda.Stream(device, priority=_LOWEST_PRIORITY)

    def lane_of(self, work: str, beside: bool = False) -> str:
        """The split-counter lane `work` ("steps" or "chunks": a prompt chunk's launches) uses: "chunks" for a chunk
        beside the steps only (see the module docstring)."""
        if work not in LANES:
            raise ValueError(f"unknown work {work!r} (expected one of {', '.join(LANES)})")
        return "chunks" if self.overlap and work == "chunks" and beside else "steps"

    def stream_of(self, work: str, beside: bool = False) -> torch.cuda.Stream | None:
        """The stream `work` runs on: "steps" on `steps`, a chunk `beside` the steps on `side`; None: the current
        stream (a chunk between the steps, or no overlap, or a CPU)."""
        self.lane_of(work)  # checks `work`
        if work == "chunks":
            return self.side if beside else None
        return self.steps

    @contextlib.contextmanager
    def on(self, work: str, beside: bool = False) -> Iterator[None]:
        """Launches inside run on `work`'s stream (`stream_of`) with its lane (`lane_of`). The stream is ordered
        after what the caller's stream queued before; for "steps" the caller's stream is ordered after it again
        on the way out (the step's results are read there). A chunk beside the steps is not joined: the chunk
        stream's owner waits for its event (engine.exec.chunk_stream.ChunkStream.take)."""
        stream, lane = self.stream_of(work, beside), self.lane_of(work, beside)
        if not self.cuda:
            yield
            return
        from engine.model.triton_linear import counter_lane  # Triton: CUDA builds only

        if stream is None:
            with counter_lane(lane):
                yield
            return
        outer = torch.cuda.current_stream(self.device)
        stream.wait_stream(outer)
        try:
            with torch.cuda.stream(stream), counter_lane(lane):
                yield
        finally:
            if work == "steps":
                outer.wait_stream(stream)
