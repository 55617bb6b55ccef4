"""Where prompt chunks may run beside the steps, and with how many SMs (engine.exec.chunk_stream). Pure logic:
the streams themselves run on the GPU (tests/engine/test_engine_interleave.py, `-m gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.exec.chunk_stream import ChunkStream, chunk_sms_from_env, overlap_wanted
from engine.exec.cuda_streams import Streams

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_runs_chunks_beside_the_steps_on_cuda_only_where_the_streams_share_nothing() -> None:
    assert overlap_wanted("auto", CUDA, moe=False)  # KV by use too: the chunk's slot is held (below)
    assert not overlap_wanted("auto", CPU, moe=False)  # one stream: nothing to overlap
    assert not overlap_wanted("auto", CUDA, moe=True)  # the expert cache's slots are every forward's
    assert overlap_wanted("on", CPU, moe=False)  # the bookkeeping alone (the CPU tests)
    assert not overlap_wanted("off", CUDA, moe=False)


def test_on_where_the_streams_would_share_state_is_refused_naming_why() -> None:
    with pytest.raises(ConfigError, match="MoE") as err:
        overlap_wanted("on", CUDA, moe=True)
    assert err.value.param == "prefill_overlap"


def test_a_chunk_stream_needs_streams_with_a_side_stream() -> None:
    with pytest.raises(ValueError, match="overlap=True"):
        ChunkStream(Streams(CPU))


def test_a_chunk_in_flight_holds_its_slot_so_no_step_spills_the_blocks_it_writes() -> None:
    from engine.exec.kv.blocks import BlockLayout, BlockLedger

    class Paging:  # the ledger behind KVPaging.hold / unhold
        def __init__(self) -> None:
            self.ledger = BlockLedger(BlockLayout(2, 5, 4, 0, 64), 4)

        def hold(self, slot: int, settle=None) -> None:
            self.ledger.hold(slot)

        def unhold(self, slot: int) -> None:
            self.ledger.unhold(slot)

    class Chunk:
        slot = 0

    paging = Paging()
    ledger = paging.ledger
    ledger.plan({0: 4 * 64})  # slot 0's chunk took the whole pool
    stream = ChunkStream(Streams(CPU, overlap=True), paging=paging)
    stream.launch(Chunk(), lambda: None)
    from engine.exec.kv.blocks import PoolTooSmall

    with pytest.raises(PoolTooSmall):  # slot 1 may not spill the held slot's blocks
        ledger.plan({1: 64})
    stream.take()
    assert len(ledger.plan({1: 64}).spills) == 1  # landed: its blocks may go to the host again


def test_the_option_is_checked_where_every_option_is() -> None:
    with pytest.raises(ConfigError, match="auto, on, off") as err:
        EngineConfig(prefill_overlap="sometimes")
    assert err.value.param == "prefill_overlap"
    assert "--prefill-overlap" in EngineConfig(prefill_overlap="off").to_argv()


def test_strata_chunk_sms_is_a_whole_number_or_unset() -> None:
    assert chunk_sms_from_env({}) is None and chunk_sms_from_env({"STRATA_CHUNK_SMS": " "}) is None
    assert chunk_sms_from_env({"STRATA_CHUNK_SMS": "96"}) == 96
    assert chunk_sms_from_env({"STRATA_CHUNK_SMS": "0"}) == 0
    with pytest.raises(ConfigError, match="whole number") as err:
        chunk_sms_from_env({"STRATA_CHUNK_SMS": "3/4"})
    assert err.value.param == "STRATA_CHUNK_SMS" and err.value.value == "3/4"


def test_on_a_cpu_a_launched_chunk_is_done_and_taken_once() -> None:
    streams = Streams(CPU, overlap=True, chunk_sms=64)
    assert streams.chunk_sms == 0 and streams.note is None  # no SMs to share on a CPU
    stream = ChunkStream(streams)
    with streams.on("steps"):
        pass
    assert not stream.ready()
    chunk = type("Chunk", (), {"request": object()})()
    stream.launch(chunk, lambda: "out")
    assert stream.holds(chunk.request) and stream.ready()
    with pytest.raises(AssertionError, match="one chunk"):
        stream.launch(chunk, lambda: "again")
    flight = stream.take()
    assert flight.out == "out" and flight.seconds >= 0 and stream.in_flight is None
    stream.launch(chunk, lambda: "out")
    stream.drop()
    assert stream.in_flight is None and not stream.holds(chunk.request)


def test_an_immortal_object_is_never_destroyed_not_even_at_the_interpreters_exit() -> None:
    """What keeps a green context alive past `serve`'s exit (its destroy at the interpreter's teardown aborts
    the process on CUDA): the object's destructor never runs, while a plain module global's does."""
    import subprocess
    import sys

    code = ("from engine.exec.cuda_streams import _immortal\n"
            "class Noisy:\n"
            "    def __init__(self, name): self.name = name\n"
            "    def __del__(self): print('destroyed', self.name, flush=True)\n"
            "KEPT = {'green': _immortal((Noisy('kept'), 1))}\n"
            "PLAIN = {'green': (Noisy('plain'), 1)}\n"
            "KEPT.clear(); PLAIN.clear()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).resolve().parents[3]))
    assert out.returncode == 0, out.stderr
    assert "destroyed plain" in out.stdout and "destroyed kept" not in out.stdout, out.stdout
