"""A long prompt's chunks beside the decoding slots' steps: two CUDA streams, one chunk in flight.

Between steps, a prompt chunk stops every decoding slot for as long as it runs, so time slicing cannot give a
fresh long prompt its first token in less than twice its time alone while the slots keep half their rate
(docs/BENCHMARKS.md, "A fresh 176K prompt beside six decoding slots"). Here, while slots decode, the engine
launches a chunk on a side stream and goes back to the slots at once; their steps run on a high-priority stream. The engine lands the chunk (samples the first token, prefills MTP's drafter, hands full blocks to the prefix tier)
at the start of a later step, once its event has completed, and only then plans the next one.

On CUDA the side stream is a green context's, on CHUNK_SM_SHARE of the SMs, so the other SMs stay free for the
steps' kernels. Priority alone (a low-priority side stream on every SM) did not keep the slots going: a decode
kernel waits for a whole chunk thread block to retire before it gets an SM.

What may not run at the same time is kept apart: prompt chunks capture their graphs into their own pool
(ModelRunner.prefill_owner) and use their own split counters (`lane`: the skinny matmul's), and a KV pool
reallocation waits for the device first (SlotKVCache.resize_pool). A slot whose request ends while its chunk is in
flight waits for the chunk before the slot changes hands (`drop`). Where the two streams would share more than
that, the overlap is off: MoE models (the expert cache's slots are shared by every forward). With KV by use the
chunk's slot is held while the chunk is in flight: a step short of blocks spills other slots' blocks, never its
(a pool growth waits for the device first, as above).

On a CPU there is one stream: with `prefill_overlap on` (the tests) `launch` runs the chunk then and there, and it
lands at the start of the next step: the engine's bookkeeping of a chunk in flight, without the concurrency.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from engine.config import mode_wanted
from engine.errors import ConfigError

CHUNK_SMS_ENV = "STRATA_CHUNK_SMS"
# The chunks' share of the SMs: the rest stays free for the decoding slots' kernels. Fewer SMs slow the chunks
# (the first token comes later); more leave decode less of its rate and do not speed the chunks up
# (docs/BENCHMARKS.md, "A fresh 176K prompt beside six decoding slots").
CHUNK_SM_SHARE = 0.75
_SM_GROUP = 8
CHUNK_OWNER = "chunks"  # the graph pool of prompt chunks while they may overlap the steps' graphs
_HIGHEST_PRIORITY = -100  # torch maps a priority past the device's range to its highest (lower is higher)
_LOWEST_PRIORITY = 0


def default_chunk_sms(device: torch.device) -> int:
    """The chunks' SM share: CHUNK_SM_SHARE of the device's SMs, in whole groups of _SM_GROUP (what a green
    context is split by)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return int(sms * CHUNK_SM_SHARE) // _SM_GROUP * _SM_GROUP


def chunk_sms_from_env(environ: Mapping[str, str]) -> int | None:
    """STRATA_CHUNK_SMS: SMs of the green context the chunks run in (0: none, a plain low-priority stream;
    unset: the default share)."""
    text = environ.get(CHUNK_SMS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(CHUNK_SMS_ENV, text, "expected a whole number of SMs (0: no green context)")
    return int(text)


def overlap_wanted(mode: str, device: torch.device, moe: bool) -> bool:
    """Whether chunks run beside the steps: `auto` where it is safe and useful (CUDA, a dense model), `on` also on
    a CPU (one stream: the bookkeeping alone), `off` never. ConfigError for `on` where the streams would share
    state. With KV by use the chunk's slot is held (`ChunkStream.paging`): no step spills its blocks meanwhile."""
    blocked = None
    if moe:
        blocked = "cannot run chunks beside the steps here: an MoE model's expert cache is shared by every forward"
    return mode_wanted("prefill_overlap", mode, device.type == "cuda", blocked)


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


@dataclass
class InFlight:
    """The chunk on the side stream: what it will return, and the events around its kernels."""

    chunk: Any  # engine.core.step_plan.PrefillChunk
    out: Any  # engine.exec.runner.StepOutput (its tensors written by the side stream)
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    seconds: float  # on a CPU: the chunk's time; on CUDA filled in by `take` (start to end event)


class ChunkStream:
    """The side stream, the steps' stream and the one chunk in flight (see the module docstring)."""

    def __init__(self, device: torch.device, chunk_sms: int | None = None) -> None:
        """The side stream belongs to a CUDA green context of `chunk_sms` SMs (torch's GreenContext; None: the
        default share, `default_chunk_sms`), so a chunk's kernels never hold the other SMs, which the steps'
        kernels find free; 0, or a torch or driver without green contexts (`note` says why): a plain
        low-priority stream, where the steps' kernels get an SM only as a chunk's thread blocks retire."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.note: str | None = None
        self.chunk_sms = 0
        self._steps = self._side = None
        if self.cuda:
            self._steps = torch.cuda.Stream(device, priority=_HIGHEST_PRIORITY)
            sms = default_chunk_sms(device) if chunk_sms is None else chunk_sms
            if sms:
                try:
                    self._side, self.chunk_sms = _green_stream(device.index or 0, sms), sms
                except Exception as exc:  # noqa: BLE001 - an older torch or driver: the priority stream serves
                    self.note = (f"prompt chunks beside the steps without an SM share: no green context of {sms} "
                                 f"SMs ({type(exc).__name__}: {exc})")
            if self._side is None:
                self._side = torch.cuda.Stream(device, priority=_LOWEST_PRIORITY)
        self.in_flight: InFlight | None = None
        # KV by use (engine.exec.kv.paging.KVPaging; the engine builder sets it): the chunk's slot is held from its
        # launch until it is taken or dropped, so no step's prepare spills the blocks it writes.
        self.paging: Any = None

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """The engine's own work runs inside on the high-priority stream, ordered after what the caller's stream
        queued before and before what it queues after."""
        if not self.cuda:
            yield
            return
        outer = torch.cuda.current_stream(self.device)
        self._steps.wait_stream(outer)
        try:
            with torch.cuda.stream(self._steps):
                yield
        finally:
            outer.wait_stream(self._steps)

    def lane(self) -> contextlib.AbstractContextManager:
        """Every prompt chunk's launches (beside the steps or not): the chunks' split counters."""
        if not self.cuda:
            return contextlib.nullcontext()
        from engine.model.triton_linear import counter_lane  # Triton: CUDA builds only

        return counter_lane("chunks")

    def launch(self, chunk: Any, run: Callable[[], Any]) -> None:
        """Queue `run()` (the chunk's forward, returning a StepOutput) on the side stream, after everything the
        current stream has queued (the admission's block mapping, the previous chunk's landing)."""
        assert self.in_flight is None, "one chunk in flight at a time"
        if self.paging is not None:
            self.paging.hold(chunk.slot)
        if not self.cuda:
            t0_s = time.perf_counter()
            out = run()
            self.in_flight = InFlight(chunk, out, None, None, time.perf_counter() - t0_s)
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._side), self.lane():
            start.record()
            out = run()
            end.record()
        self.in_flight = InFlight(chunk, out, start, end, 0.0)

    def holds(self, request: Any) -> bool:
        return self.in_flight is not None and self.in_flight.chunk.request is request

    def ready(self) -> bool:
        """A chunk is in flight and its kernels have finished (raises the CUDA error of one that failed)."""
        return self.in_flight is not None and (self.in_flight.end is None or self.in_flight.end.query())

    def take(self) -> InFlight:
        """The chunk in flight, waited for: the current stream is ordered after it, and its outputs are marked
        as used there (the side stream must not reuse their memory before the current stream is done)."""
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        self._unhold(flight)
        if flight.end is not None:
            flight.end.synchronize()
            current = torch.cuda.current_stream(self.device)
            current.wait_event(flight.end)
            for tensor in (flight.out.logits, flight.out.hidden):
                tensor.record_stream(current)
            flight.seconds = flight.start.elapsed_time(flight.end) / 1e3
        return flight

    def drop(self, wait: bool = True) -> None:
        """Forget the chunk in flight (its request ended, or the step failed). `wait`: first let its kernels
        finish, so its slot's blocks are not written after they change hands (False after a sticky CUDA error,
        when nothing on the device can be waited for)."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None and flight.end is not None and wait:
            flight.end.synchronize()
        if flight is not None:
            self._unhold(flight)

    def settle(self) -> None:
        """KV by use: a step cannot find its blocks without the held slot's: wait for the chunk's kernels (it still
        lands at a later step, as usual) and lift the hold, so its blocks may be spilled like any other's."""
        flight = self.in_flight
        if flight is None:
            return
        if flight.end is not None:
            flight.end.synchronize()
        self._unhold(flight)

    def _unhold(self, flight: InFlight) -> None:
        if self.paging is not None:
            self.paging.unhold(flight.chunk.slot)

    def sync(self) -> None:
        """The current stream's work done (not the side stream's: a chunk in flight keeps running)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
