"""`--kv-resident`: each slot's window stays on the device, the rest comes from a shared pool that grows from the
tier and spills to host memory, losslessly. Greedy output is token for token that of a run with room for every
slot's whole context; the start-up fit check counts the resident KV and names it."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.errors import ConfigError
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Four slots of 455-637 tokens against a 128-token window and a pool of one slot's window (14 blocks of 64):
# together they need 28 pool blocks, so slots spill each other's blocks step after step.
PROMPTS = random_prompts(4, seed=71, lengths=(400, 800))
SMALL = dict(batch=4, context=1024, tier_budget_mib=0.0)


def _kv_events(bus: EventBus, action: str) -> list:
    return [e for e in bus.history() if e.type == "kv" and e.action == action]


@pytest.fixture(scope="module")
def roomy(ckpt):
    """Tokens of the same prompts with every slot's whole context on the device, per (kv, mtp)."""
    cache: dict = {}

    def get(kv: str, mtp: bool) -> dict:
        if (kv, mtp) not in cache:
            engine = make_engine(ckpt, kv=kv, batch_mtp=mtp, mtp_depth=2, **SMALL)
            cache[kv, mtp] = tokens_of(run_all(engine, PROMPTS, GREEDY))
        return cache[kv, mtp]

    return get


def free_device_mib(monkeypatch, free_mib: float) -> None:
    """The device as having `free_mib` MiB free, to every stage that sizes a part against it."""
    import engine.orchestration.engine_setup as setup
    import engine.orchestration.part_makers as part_makers

    for module in (setup, part_makers):
        monkeypatch.setattr(module, "device_memory_mib", lambda device: (4096.0, free_mib))


@pytest.mark.parametrize("kv,mtp", [("bf16", False), ("int8", False), ("bf16", True), ("int8", True)])
def test_spilled_kv_gives_the_tokens_of_a_run_with_room(ckpt, roomy, kv, mtp):
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, kv=kv, batch_mtp=mtp, mtp_depth=2, kv_resident=128, **SMALL)
    paging = engine.kv.paging
    assert paging.layout.resident_blocks == 2 and paging.ledger.pool_blocks == 14
    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    assert got == roomy(kv, mtp)
    spills, fetches = _kv_events(bus, "spill"), _kv_events(bus, "fetch")
    assert spills and fetches, "the pool was never short: the test does not exercise host memory"
    assert all(e.mib > 0 and e.ms >= 0 and e.slots for e in spills + fetches)
    state = engine.state().to_json()["kv"]["paging"]
    assert state["spilled_blocks"] == sum(e.blocks for e in spills) and state["fetched_mib"] > 0
    if mtp:
        assert engine.mtp_on, engine.mtp_off_reason


def test_a_device_with_room_to_stage_one_block_still_spills_and_fetches_losslessly(ckpt, roomy, monkeypatch):
    """VRAM is full by design: a step that stages every block it moves at once can run out of memory, which ends
    every request in it. With room to stage one block at a time, and an
    out-of-memory error for any larger staging buffer, the same slots spill and fetch to the same tokens."""
    from engine.exec.kv import host

    monkeypatch.setattr(host, "STAGE_BYTES", 1)  # a slice of one block
    real, largest = host.device_scratch, [0]

    def device_scratch(shape, dtype, device):
        if shape[0] > 1:
            raise torch.OutOfMemoryError(f"CUDA out of memory staging {shape[0]} blocks")
        largest[0] = max(largest[0], shape[0])
        return real(shape, dtype, device)

    monkeypatch.setattr(host, "device_scratch", device_scratch)
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, kv_resident=128, **SMALL)
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == roomy("bf16", False)
    assert max(e.blocks for e in _kv_events(bus, "spill")) > 1 and largest[0] == 1


def test_host_memory_taken_after_admission_fails_the_step_with_the_numbers_and_the_engine_serves_on(ckpt,
                                                                                                    monkeypatch):
    """Admitted while the host had room, requests whose spill would then take the host below its floor (something
    else took the memory) end with an error naming the MiB, where the store used to double whatever the host had
    left; the engine serves on, and the next request, with room again, runs."""
    from engine.exec.kv import host

    monkeypatch.setattr(host, "host_memory_mib", lambda: (16384.0, 16000.0))
    engine = make_engine(ckpt, kv_resident=128, **SMALL)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outs: dict = {}
    for out in engine.step():  # all four admitted; no spill yet
        outs.setdefault(out.request_id, []).append(out)
    assert engine.sched.num_running == len(PROMPTS) and engine.kv.paging.stats.spilled_blocks == 0
    monkeypatch.setattr(host, "host_memory_mib", lambda: (16384.0, 1000.0))
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    errors = [o[-1].error for o in outs.values() if o[-1].finish_reason == "error"]
    assert errors and all("HostKVFull" in e and "under the 2048 MiB it keeps" in e for e in errors), errors
    monkeypatch.setattr(host, "host_memory_mib", lambda: (16384.0, 16000.0))
    again = tokens_of(run_all(engine, PROMPTS[:1], GREEDY, prefix="again"))
    assert engine.health().status.value == "ready" and len(again["again0"]) == GREEDY.max_tokens


def test_slot_events_and_the_snapshot_say_where_each_slots_kv_lies(ckpt):
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, kv_resident=128, **SMALL)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    seen_host = seen_books = False
    while engine.has_work:
        engine.step()
        state = engine.state().to_json()
        slots = [s for s in state["slots"] if s["state"] in ("prefill", "decode")]
        for s in slots:
            assert s["kv_resident_tokens"] <= 128
            seen_host |= s["kv_host_tokens"] > 0
        seen_books |= state["vram"][0]["host_kv_mib"] > 0
        assert state["vram"][0]["host_kv_mib"] == round(engine.kv.paging.host_mib, 1)
    assert seen_host and seen_books
    events = [e for e in bus.history() if e.type == "slot" and e.state == "decode"]
    assert events and all(e.kv_resident_tokens + e.kv_pooled_tokens + e.kv_host_tokens > 128 for e in events)
    assert engine.state().to_json()["kv"]["paging"]["host_mib"] >= 0
    # finished requests gave their pool and host blocks back (the next step reclaims them)
    engine.step()
    assert engine.kv.paging.ledger.free_pool_blocks == 14 and engine.kv.paging.ledger.host_held_blocks == 0


def test_reserved_kv_every_token_is_resident_and_there_is_no_paging(ckpt):
    engine = make_engine(ckpt, kv_pool="reserved", **SMALL)
    run_all(engine, PROMPTS[:1], GREEDY)
    assert engine.kv.paging is None and engine.state().to_json()["kv"]["paging"] is None


def test_kv_by_use_is_the_default_on_a_cpu_and_the_pool_grows_as_slots_use_it(ckpt, monkeypatch):
    import engine.orchestration.part_makers as part_makers

    monkeypatch.setattr(part_makers, "CPU_START_POOL_MIB", 0.0)  # start at one prompt chunk per slot, not 256 MiB
    engine = make_engine(ckpt, **SMALL)
    paging = engine.kv.paging
    assert paging is not None and paging.layout.resident_blocks == 0
    start_blocks = paging.ledger.pool_blocks
    assert start_blocks < 4 * paging.layout.window_blocks  # not every slot's whole context
    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    assert paging.ledger.pool_blocks > start_blocks and paging.stats.spilled_blocks == 0
    assert got == tokens_of(run_all(make_engine(ckpt, kv_pool="reserved", **SMALL), PROMPTS, GREEDY))


def test_the_tier_gives_memory_back_before_anything_spills(ckpt):
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, kv_resident=128, **{**SMALL, "tier_budget_mib": 64.0})
    run_all(engine, random_prompts(6, seed=72, lengths=(100, 200)), GREEDY, prefix="warm")  # fills tier blocks
    assert engine.tier.mib > 0
    pool_before = engine.kv.paging.ledger.pool_blocks
    run_all(engine, PROMPTS, GREEDY)
    kinds = [(e.type, getattr(e, "action", ""), getattr(e, "reason", "")) for e in bus.history()
             if e.type in ("kv", "tier")]
    shrink = next(i for i, k in enumerate(kinds) if k[0] == "tier" and k[1] == "shrink" and "kv pool" in k[2])
    grow = next(i for i, k in enumerate(kinds) if k[0] == "kv" and k[1] == "grow")
    first_spill = next((i for i, k in enumerate(kinds) if k[:2] == ("kv", "spill")), len(kinds))
    assert shrink < grow < first_spill
    assert engine.kv.paging.ledger.pool_blocks > pool_before
    assert engine.budget.kv_mib == pytest.approx(engine.kv.mib)


def test_resident_kv_that_cannot_fit_is_one_config_error_with_the_numbers(ckpt, monkeypatch):
    free_device_mib(monkeypatch, 1024.0 + 3.0)  # 3 MiB past the reserve
    with pytest.raises(ConfigError) as info:
        make_engine(ckpt, batch=4, context=8192, kv_resident=4096, vram_reserve_mib=1024)
    assert info.value.param == "kv_resident"
    message = str(info.value)
    assert "4 slots x 4096 resident tokens" in message and "MiB" in message and "only 3 MiB" in message


def test_a_context_too_large_for_the_device_starts_with_a_small_resident_window(ckpt, monkeypatch):
    # 8 MiB past the reserve: 4 slots x 8192 tokens need ~16 MiB; 4 x 256 resident + one slot's window ~4.4 MiB
    free_device_mib(monkeypatch, 1024.0 + 8.0)
    with pytest.raises(ConfigError) as info:  # every slot's whole context: too much
        make_engine(ckpt, batch=4, context=8192, vram_reserve_mib=1024, kv_pool="reserved")
    assert info.value.param == "context"
    engine = make_engine(ckpt, batch=4, context=8192, kv_resident=256, vram_reserve_mib=1024)
    assert engine.kv.mib < 8.0 and engine.budget.kv_mib == pytest.approx(engine.kv.mib)


def test_captured_steps_replay_correctly_while_their_blocks_move(ckpt):
    """The graph cache's CPU backend (a "graph" re-runs its recorded step into static buffers): slot 0's decode
    step is captured and replayed, slot 1's prefill spills slot 0's blocks, and the replay after the fetch
    gives the same logits. The same sequence runs with real CUDA graphs in test_kv_resident_gpu.py."""
    from engine.exec.graphs.backends import CpuGraphBackend
    from engine.exec.graphs.cache import GraphCache
    from engine.exec.runner import Row
    from engine.switches import SwitchBoard

    bus = EventBus(history=10000)
    graphs = GraphCache("cpu", bus, SwitchBoard.from_values({}), release_tier=lambda mib, reason: 0.0,
                        wait_interval_s=0.0, backend=CpuGraphBackend())
    engine = make_engine(ckpt, bus=bus, batch=2, context=1024, kv_resident=64, executor=graphs, tier_budget_mib=0.0)
    runner, kv = engine.runner, engine.kv
    prompt = random_prompts(2, seed=5, lengths=(700, 701))

    with torch.inference_mode():
        for start in range(0, 640, 64):
            runner.prefill(0, prompt[0][start:start + 64], start)
        first = runner.decode([Row(0, 11, 640)]).logits.clone()
        second = runner.decode([Row(0, 11, 640)]).logits.clone()
        for start in range(0, 700, 64):
            runner.prefill(1, prompt[1][start:start + 64], start)
        assert kv.paging.placement_tokens(0, 640)[2] > 0, "slot 0 has nothing on the host"
        again = runner.decode([Row(0, 11, 640)]).logits.clone()
    assert kv.paging.stats.fetched_blocks > 0
    assert sum(g.replays for g in graphs.snapshot().graphs) >= 2
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_help_says_what_kv_resident_guarantees():
    import argparse

    from engine.config import add_engine_options

    parser = argparse.ArgumentParser(prog="strata-engine serve")
    add_engine_options(parser)
    text = " ".join(parser.format_help().split())
    assert "--kv-resident TOKENS" in text
    assert "guaranteed in VRAM" in text and "shared pool" in text and "host memory" in text


def test_the_cli_says_it_in_one_line_and_exits_2(ckpt, monkeypatch, capsys):
    from engine.cli import main

    free_device_mib(monkeypatch, 1024.0 + 3.0)
    code = main(["generate", "--model", str(ckpt), "--device", "cpu", "--context", "8192", "--kv-resident", "4096",
                 "--max-tokens", "2", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "kv_resident=4096" in err and "MiB" in err and "Traceback" not in err
