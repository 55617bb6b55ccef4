"""A long prompt's chunks beside the decoding slots' steps: two CUDA streams, one chunk in flight.

Between steps, a prompt chunk stops every decoding slot for as long as it runs, so time slicing cannot give a
fresh long prompt its first token in less than twice its time alone while the slots keep half their rate
(docs/BENCHMARKS.md, "A fresh 176K prompt beside six decoding slots"). Here, while slots decode, the engine
launches a chunk on a side stream and goes back to the slots at once; their steps run on a high-priority stream.
The engine lands the chunk (samples the first token, prefills MTP's drafter, hands full blocks to the prefix tier)
at the start of a later step, once its event has completed, and only then plans the next one.

The streams are the engine's (engine.exec.cuda_streams.Streams: `steps` and `side`). On CUDA the side stream is a green
context's, on CHUNK_SM_SHARE of the SMs, so the other SMs stay free for the steps' kernels. Priority alone (a
low-priority side stream on every SM) did not keep the slots going: a decode kernel waits for a whole chunk thread
block to retire before it gets an SM.

What may not run at the same time is kept apart: a chunk beside the steps runs eagerly, never a captured graph
(ModelRunner.prefill's `beside`: bursts of mixed prompts came out with NaN logits whenever such chunks replayed
graphs on the side stream, under either KV pool, and never with them eager), with its own split counters (the
"chunks" lane: `Streams.on`); a KV pool reallocation waits for the device first (SlotKVCache.resize_pool). A slot
whose request ends while its chunk is in flight waits for the chunk before the slot changes hands (`drop`). With
KV by use the chunk's slot is held while the chunk is in flight: a step short of blocks spills other slots' blocks,
never its (a pool growth waits for the device first, as above). Where the two streams would share more than that,
the overlap is off: MoE models (the expert cache's slots are shared by every forward).

On a CPU there is one stream: with `prefill_overlap on` (the tests) `launch` runs the chunk then and there, and it
lands at the start of the next step: the engine's bookkeeping of a chunk in flight, without the concurrency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from engine.config import mode_wanted
from engine.errors import ConfigError
from engine.exec.cuda_streams import Streams

CHUNK_SMS_ENV = "STRATA_CHUNK_SMS"


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
    state."""
    blocked = None
    if moe:
        blocked = ("cannot run chunks beside the steps here: an MoE model's expert cache is shared by every forward "
                   "(its long prompts run between the steps, in layer-major windows: --prefill-window-tokens)")
    return mode_wanted("prefill_overlap", mode, device.type == "cuda", blocked)


@dataclass
class InFlight:
    """The chunk on the side stream: what it will return, and the events around its kernels."""

    chunk: Any  # engine.step.PrefillChunk
    out: Any  # engine.exec.runner.StepOutput (its tensors written by the side stream)
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    seconds: float  # on a CPU: the chunk's time; on CUDA filled in by `take` (start to end event)


class ChunkStream:
    """The one chunk in flight beside the steps, on the engine's side stream (see the module docstring)."""

    def __init__(self, streams: Streams, paging: Any = None) -> None:
        """`streams`: the engine's (engine.exec.cuda_streams), built with the overlap on: their `side` stream runs the
        chunks and their `steps` stream the steps. `paging`: KV by use (engine.exec.kv.paging.KVPaging): the chunk's
        slot is held from its launch until it is taken or dropped, so no step's prepare spills the blocks it writes."""
        if not streams.overlap:
            raise ValueError("ChunkStream needs Streams built with overlap=True (a side stream for the chunks)")
        self.streams = streams
        self.device = streams.device
        self.cuda = streams.cuda
        self.in_flight: InFlight | None = None
        self.paging = paging

    def launch(self, chunk: Any, run: Callable[[], Any]) -> None:
        """Queue `run()` (the chunk's forward, returning a StepOutput) on the side stream, after everything the
        current stream has queued (the admission's block mapping, the previous chunk's landing)."""
        assert self.in_flight is None, "one chunk in flight at a time"
        if self.paging is not None:
            self.paging.hold(chunk.slot, self.settle)
        if not self.cuda:
            t0_s = time.perf_counter()
            out = run()
            self.in_flight = InFlight(chunk, out, None, None, time.perf_counter() - t0_s)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self.streams.on("chunks", beside=True):
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
