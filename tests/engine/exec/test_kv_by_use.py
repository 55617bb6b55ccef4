"""KV by use, the default on a CPU: slots take pool blocks as their tokens need them and give them back when their
request ends (engine.exec.kv.blocks, paging). A long --context is a per-request limit, not a reservation: a real
engine process serving six slots of 262,144 tokens stays small; an abort mid-prefill returns every block; 256
slots run at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.api import SamplingParams
from engine.telemetry import EventBus
from tests.engine.engine_helpers import (fill_the_pool_beside_a_chunk, make_engine, random_prompts, run_all,
                                        tokens_of)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONGER = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
REPO = Path(__file__).resolve().parents[3]

# One short request through a real engine in a fresh process: its peak resident memory (ru_maxrss, KiB on Linux).
_RSS_SCRIPT = """
import json, resource, sys
import torch
torch.set_num_threads(1)
from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
config = EngineConfig(model="builtin:strata-tiny", device="cpu", dtype="float32", batch=6, context=262144,
                      kv_pool=sys.argv[1])
engine = Engine(config, EventBus())
engine.add_request("one", list(range(3, 11)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
tokens = []
while engine.has_work:
    tokens += [t for out in engine.step() for t in out.token_ids]
print(json.dumps({"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "tokens": len(tokens),
                  "pool_blocks": engine.kv.paging.ledger.pool_blocks if engine.kv.paging else None}))
"""


def test_six_slots_of_262k_context_serve_one_short_request_in_under_3_gb(tmp_path):
    """Every slot reserving its whole context held 12.8 GB of resident memory for one 8-token request."""
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, "auto"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 8
    assert result["rss_mib"] < 3 * 1024, result


def test_an_abort_mid_prefill_returns_every_block_of_its_slot(ckpt):
    engine = make_engine(ckpt, batch=2, context=4096, prefill_chunk_tokens=64, step_token_budget=64, block_tokens=64)
    ledger = engine.kv.paging.ledger
    prompt = random_prompts(1, seed=90, lengths=(2000, 2001))[0]
    engine.add_request("long", prompt, GREEDY)
    for _ in range(5):
        engine.step()
    req = engine.sched.get("long")
    scratch = engine.kv.paging.layout.scratch_block
    slot = req.slot
    mapped = [p for p in ledger.table_row(slot) if p not in (scratch, engine.kv.paging.layout.sink_block)]  # its own blocks and those lent to the tier
    assert 0 < req.num_computed_tokens < len(prompt) and len(mapped) >= 5
    engine.abort("long")
    engine.step()  # idle: the retired slot is reclaimed at the step's start
    assert ledger.used_blocks(slot) == 0 and ledger.host_held_blocks == 0
    assert set(ledger.table_row(slot)) == {scratch, engine.kv.paging.layout.sink_block}
    shared = engine.tier.shared  # the tier's blocks in the same pool, where its blocks are whole pool blocks
    tier_blocks = sum(len(b) for b in shared.backing.values()) if shared is not None else 0
    assert ledger.free_pool_blocks + tier_blocks == ledger.pool_blocks
    assert engine.kv.paging.snapshot().free_pool_blocks == ledger.free_pool_blocks


def test_a_request_that_finishes_gives_its_blocks_back_and_the_next_one_takes_them(ckpt):
    engine = make_engine(ckpt, batch=1, context=4096, tier_budget_mib=0.0)
    ledger = engine.kv.paging.ledger
    first = tokens_of(run_all(engine, random_prompts(1, seed=91, lengths=(600, 601)), GREEDY, prefix="a"))
    engine.step()
    pool = ledger.pool_blocks
    assert ledger.free_pool_blocks == pool
    run_all(engine, random_prompts(1, seed=92, lengths=(600, 601)), GREEDY, prefix="b")
    assert ledger.pool_blocks == pool  # no growth: the second request took the first one's blocks
    again = tokens_of(run_all(engine, random_prompts(1, seed=91, lengths=(600, 601)), GREEDY, prefix="a"))
    assert again == first


def test_256_slots_run_at_once_on_the_tiny_model():
    from engine.config import EngineConfig
    from engine.orchestration.engine import Engine
    from engine.telemetry import EventBus

    config = EngineConfig(model="builtin:strata-tiny", device="cpu", dtype="float32", batch=256, context=512,
                          queue_max=256)
    engine = Engine(config, EventBus())
    prompts = random_prompts(256, seed=93, lengths=(4, 24), vocab=200)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    most_running = 0
    outs: dict[str, list] = {}
    for _ in range(200):
        if not engine.has_work:
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        most_running = max(most_running, engine.sched.num_running)
    assert not engine.has_work and most_running == 256
    assert all(seq[-1].finish_reason == "length" and sum(len(o.token_ids) for o in seq) == 4
               for seq in outs.values()) and len(outs) == 256
    state = engine.state()
    assert len([s for s in state.slots]) == 256
    engine.step()
    ledger = engine.kv.paging.ledger
    assert all(ledger.used_blocks(s) == 0 for s in range(256))


def _overlap_engine(ckpt, bus=None, **kw):
    from engine.config import EngineConfig
    from engine.orchestration.engine import Engine

    base = dict(model=str(ckpt), device="cpu", dtype="float32", batch=4, context=2048, prefill_chunk_tokens=256,
                step_token_budget=512, prefill_overlap="on")
    base.update(kw)
    return Engine(EngineConfig(**base), bus or EventBus(history=100000), tier_budget_mib=0.0, block_tokens=64)


def test_a_pool_that_fills_while_a_chunk_runs_beside_the_steps(ckpt):
    """Two slots decode while a long prompt's chunks run beside them on a pool too small for all three (a
    resident window of 64, no tier to grow from): the steps spill the decoding slots' blocks, never the chunk's
    slot's while the chunk may write them (a step that cannot fit without them waits for the chunk first: without
    that its requests ended with an error), and every request gets the tokens of a run with room. On a CPU the
    chunk runs at its launch and lands at the end of that step: the bookkeeping; the GPU test runs the two streams."""
    short = random_prompts(2, seed=190, lengths=(500, 600))
    long = random_prompts(1, seed=191, lengths=(1800, 1801))
    reference = _overlap_engine(ckpt, batch=3, kv_pool="reserved")
    want = tokens_of(run_all(reference, short + long, LONGER))
    bus = EventBus(history=100000)
    engine = _overlap_engine(ckpt, bus=bus, batch=3, kv_resident=64)
    outs, spills, held = fill_the_pool_beside_a_chunk(engine, bus, short, long[0], LONGER)
    assert tokens_of(outs) == want
    assert spills, "the pool never filled"
    assert any(held_slots for held_slots in held), "no chunk ran beside the steps"


@pytest.mark.parametrize("context", [1024, 1000])  # 1000: the last context block also holds columns past it
def test_padded_rows_never_write_the_scratch_block_every_unmapped_entry_reads(ckpt, context):
    """Three requests in a batch bucket of four (one padded row a step) and prompt chunks padded to their bucket:
    the scratch block that every slot's unmapped entries point at stays as made (zeros). A padded row writes the
    margin's own sink block: it reads slot 0's keys, so what it writes is NaN once slot 0's are, and attention
    reads masked keys too (0 * NaN is NaN): through the scratch block one slot's NaN would reach every slot."""
    engine = make_engine(ckpt, batch=4, context=context, prefill_chunk_tokens=64, step_token_budget=128,
                         block_tokens=16)
    layout = engine.kv.paging.layout
    assert engine.kv.geometry.pad_start_tokens % 16 == 0 and engine.kv.geometry.pad_start_tokens >= context
    for pool in (*engine.kv.k, *engine.kv.v):  # as if padded rows had written there: the test's premise
        pool[:, layout.sink_block] = 1.0
    run_all(engine, random_prompts(3, seed=12, lengths=(20, 90)), LONGER)
    assert all(pool[:, layout.sink_block].ne(1.0).any() for pool in (*engine.kv.k, *engine.kv.v))  # padded rows wrote
    assert all(not pool[:, layout.scratch_block].any() for pool in (*engine.kv.k, *engine.kv.v))
    row = engine.kv.paging.ledger.table_row(0)
    assert set(row[:layout.context_blocks]) == {layout.scratch_block}
    assert set(row[layout.context_blocks:]) == {layout.sink_block}


def test_a_request_waits_in_the_queue_for_blocks_rather_than_preempt_the_running_ones(ckpt, monkeypatch):
    """A pool that cannot grow, full with two running requests: a third waits in the queue with the reason in the
    snapshot (a slot is free), no running request is spilled to the host for it, and it is admitted once one of
    them ends, with the tokens it gets alone."""
    import engine.orchestration.part_makers as part_makers

    prompts = random_prompts(3, seed=77, lengths=(80, 81))  # 88 tokens and the lookahead: two 64-token blocks
    alone = make_engine(ckpt, batch=1, context=1024, tier_budget_mib=0.0)
    want = tokens_of(run_all(alone, prompts[2:], GREEDY, prefix="c"))
    # a pool of 4 blocks that cannot grow (no headroom, no tier to take from): the two running requests fill it
    monkeypatch.setattr(part_makers, "CPU_START_POOL_MIB", 4 * alone.kv.paging.block_mib)
    engine = make_engine(ckpt, batch=3, context=1024, prefill_chunk_tokens=64, step_token_budget=128,
                         tier_budget_mib=0.0)
    paging = engine.kv.paging
    paging.grow_limit_blocks = paging.ledger.pool_blocks
    assert paging.ledger.pool_blocks == 4 and paging.layout.block_tokens == 64
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.sched.num_decoding < 2:
        engine.step()
    assert paging.ledger.free_pool_blocks == 0
    engine.add_request("c0", prompts[2], GREEDY)
    outs: dict[str, list] = {}
    waited = []
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.publish_snapshot(force=True)
        waited.append(engine.snapshot.queue.admission_wait)
        admitted = engine.sched.get("c0") is None or engine.sched.get("c0").slot is not None
        assert not admitted or any(o.finished for rid in ("r0", "r1") for o in outs.get(rid, [])), "admitted early"
    assert waited[0].startswith("KV pool full:"), waited[:3]
    assert waited[-1] == ""
    assert paging.stats.preemptions == 0 and paging.stats.spilled_blocks == 0
    assert tokens_of({"c0": outs["c0"]}) == want


@pytest.mark.parametrize("end", ["finished", "aborted"])
def test_a_burst_after_a_burst_is_admitted_in_one_step_as_under_reserved(ckpt, end):
    """The requests that ended in the last step give their blocks back when the next step starts, after the
    scheduler has planned it: the admission gate counted their blocks (and the tier's blocks only they mapped) as
    held, and a burst that followed a burst (a bench's timed burst after its warm-up, a batch job's next wave) was
    admitted a few prompts a step while its slots stood free: 4 of 16 here, 7 of 32 in `bench throughput --model
    random:tiny --device cpu --concurrency 32`. Admitted in one step, it gets the tokens it gets under reserved."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first, second = (random_prompts(16, seed=seed, lengths=(256, 257)) for seed in (5, 6))
    tokens, admitted = {}, {}
    for pool in ("reserved", "by-use"):
        engine = make_engine(ckpt, batch=16, context=352, prefill_chunk_tokens=256, step_token_budget=16384,
                             block_tokens=64, kv_pool=pool)
        if end == "finished":
            run_all(engine, first, params, prefix="a")
        else:  # a warm-up cut short: every request aborted mid-decode, between two steps
            for i, prompt in enumerate(first):
                engine.add_request(f"a{i}", prompt, params)
            while engine.sched.num_decoding < 16:
                engine.step()
            engine.step()
            for i in range(16):
                engine.abort(f"a{i}")
        for i, prompt in enumerate(second):
            engine.add_request(f"b{i}", prompt, params)
        outs: dict[str, list] = {}
        for step in range(1000):
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
            if step == 0:
                admitted[pool] = (engine.sched.num_running, engine.sched.admission_wait)
            if not engine.has_work:
                break
        tokens[pool] = tokens_of({rid: o for rid, o in outs.items() if rid.startswith("b")})
        engine.close()
    assert admitted["by-use"] == admitted["reserved"] == (16, ""), admitted
    assert len(tokens["by-use"]) == 16 and tokens["by-use"] == tokens["reserved"]


def _burst_engine(ckpt, **kw):
    """An engine of 64 slots on CPU, KV by use, and its bus."""
    from engine.config import EngineConfig
    from engine.orchestration.engine import Engine

    bus = EventBus(history=100000)
    config = EngineConfig(model=str(ckpt), device="cpu", dtype="float32", batch=64, context=512 + 64, queue_max=64,
                          **kw)
    return Engine(config, bus), bus


def _pool_growths_of_a_burst(engine, bus, seed: int, max_tokens: int) -> list:
    """64 prompts of about 512 tokens added at once and run to the end; the pool's `grow` events meanwhile."""
    for i, prompt in enumerate(random_prompts(64, seed=seed, lengths=(500, 512), vocab=200)):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for _ in range(2000):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work
    return [e for e in bus.latest(["kv"]) if e.action == "grow"]


def test_a_burst_of_prompts_grows_the_pool_a_few_times_never_for_the_tiers_hand_overs(ckpt):
    """A burst of prompts admitted together, their full blocks handed to the prefix-cache tier as each prompt is
    prefilled. Each pool growth copies the whole pool (and on a GPU drops every captured graph and waits for the
    device): the tier, which takes a slot's own blocks, backed each block first with free pool blocks, and past
    them grew the pool by a few blocks at a time, over a hundred ms a growth on this model."""
    engine, bus = _burst_engine(ckpt)
    grows = _pool_growths_of_a_burst(engine, bus, seed=95, max_tokens=2)
    assert not [e for e in grows if "tier" in e.reason], [(e.blocks, e.reason) for e in grows]
    assert engine.tier.filled_blocks > 0  # the tier took the prompts' blocks
    # geometric growth from one prompt chunk per slot to every slot's whole context: a few growths
    assert len(grows) <= 4, [(e.blocks, e.reason) for e in grows]


def test_a_pool_that_grows_from_the_tier_grows_geometrically_through_a_burst(ckpt):
    """Where the pool has no headroom of its own (a GPU's: it starts at one slot's window and grows from what the
    prefix-cache tier gives back), a burst of prompts was short a few blocks at nearly every step and took just
    that much each time: a reallocation of the whole pool, a dropped graph cache and a device sync per step."""
    engine, bus = _burst_engine(ckpt, kv_resident=64, step_token_budget=1024, prefill_chunk_tokens=512)
    paging = engine.kv.paging
    assert paging.grow_limit_blocks <= paging.ledger.pool_blocks  # no headroom: every growth asks the tier
    paging.take_memory = lambda mib, reason: mib  # a tier with that much memory to give back, as a GPU's has
    grows = _pool_growths_of_a_burst(engine, bus, seed=96, max_tokens=24)
    # from one window to every slot's blocks, half as much again each time: ~7 growths (26 a few blocks at a time)
    assert grows and len(grows) <= 10, [(e.blocks, e.reason) for e in grows]


def _three_requests_on_a_pool_of_8_blocks(ckpt, monkeypatch, seed: int, chunk_tokens: int):
    """Three requests (80-token prompts, 300 new: 7 blocks each at their ends) added to an engine whose pool holds 8
    blocks and cannot grow; returns it and the tokens each request gets alone."""
    import engine.orchestration.part_makers as part_makers

    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=seed, lengths=(80, 81))
    alone = make_engine(ckpt, batch=1, context=1024, tier_budget_mib=0.0)
    want = {f"r{i}": tokens_of(run_all(alone, [p], params, prefix=f"r{i}-"))[f"r{i}-0"] for i, p in enumerate(prompts)}
    monkeypatch.setattr(part_makers, "CPU_START_POOL_MIB", 8 * alone.kv.paging.block_mib)
    engine = make_engine(ckpt, batch=3, context=1024, prefill_chunk_tokens=chunk_tokens,
                         step_token_budget=2 * chunk_tokens, tier_budget_mib=0.0)
    paging = engine.kv.paging
    paging.grow_limit_blocks = paging.ledger.pool_blocks
    assert paging.ledger.pool_blocks == 8
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return engine, want


def test_with_no_host_memory_to_spill_to_requests_wait_in_the_queue_and_none_fails(ckpt, monkeypatch):
    """Admission counts what the requests reach at their ends (prompt + max_tokens) against the pool and the host
    memory spilled KV may take. A pool that cannot grow, on a host at its floor: three requests whose first chunks
    fit together, but whose ends do not, run one after another (the snapshot says why the others wait), with the
    tokens each gets alone and no spill, where they used to be admitted together and their spills to fill the host
    (HostKVFull ends every request of that step)."""
    from engine.exec.kv import host

    monkeypatch.setattr(host, "host_memory_mib", lambda: (16384.0, 1000.0))  # under the 2 GiB floor
    engine, want = _three_requests_on_a_pool_of_8_blocks(ckpt, monkeypatch, seed=78, chunk_tokens=64)
    paging = engine.kv.paging
    outs: dict[str, list] = {}
    waits, running = set(), 0
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.publish_snapshot(force=True)
        waits.add(engine.snapshot.queue.admission_wait)
        running = max(running, engine.sched.num_running)
    assert all(o[-1].finish_reason == "length" for o in outs.values()), [o[-1].error for o in outs.values()]
    assert tokens_of(outs) == want and running == 1 and paging.stats.spilled_blocks == 0
    assert any(w.startswith("KV full at the requests' ends") and "host memory 0 more" in w for w in waits), waits


def test_requests_past_the_pool_decode_oldest_first_and_the_others_pause_instead_of_spilling_every_step(ckpt,
                                                                                                    monkeypatch):
    """Three requests admitted together whose KV outgrows a pool that cannot grow (host memory to spill to): the
    oldest decode, the youngest pause with their KV spilled once (the snapshot and /metrics count them), and each
    gets the tokens it gets alone. Every step used to decode every request in forwards that each spilled the
    others' blocks and fetched their own back: a burst past the pool moved its whole KV across PCIe every step."""
    from engine.server.kv_metrics import kv_metric_families

    engine, want = _three_requests_on_a_pool_of_8_blocks(ckpt, monkeypatch, seed=79, chunk_tokens=128)
    paging = engine.kv.paging
    outs: dict[str, list] = {}
    paused, swapped, finished = 0, 0.0, []
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            if out.finished:
                finished.append(out.request_id)
        engine.publish_snapshot(force=True)
        paused = max(paused, engine.snapshot.kv.paging.paused_requests)
        metric = [m for m in kv_metric_families(engine.snapshot) if m.name == "strata_num_requests_swapped"]
        swapped = max(swapped, metric[0].samples[0].value)
    assert all(o[-1].finish_reason == "length" for o in outs.values()), [o[-1].error for o in outs.values()]
    assert tokens_of(outs) == want
    assert finished == ["r0", "r1", "r2"]  # oldest first
    assert paused == 2 and swapped == 2  # at the end the oldest decodes alone
    # the youngest two spilled once each on their way out (7 blocks at most each), never back and forth
    assert 0 < paging.stats.spilled_blocks <= 14, paging.stats.spilled_blocks
    assert engine.snapshot.kv.paging.paused_requests == 0  # nothing decodes now: nothing paused


def test_requests_that_share_a_cached_prefix_count_it_once_and_all_decode(ckpt, monkeypatch):
    """Four requests map one 512-token prefix from the tier (by reference) on a pool of 16 blocks that cannot grow:
    their own blocks and the prefix's fit it, so every step decodes all four, though each one alone addresses 9
    blocks (36 together)."""
    import engine.orchestration.part_makers as part_makers

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    base = random_prompts(1, seed=80, lengths=(512, 513))[0]
    prompts = [base + suffix for suffix in random_prompts(4, seed=81, lengths=(40, 41))]
    roomy = make_engine(ckpt, batch=4, context=1024, block_tokens=64)
    want = tokens_of(run_all(roomy, prompts, params))
    monkeypatch.setattr(part_makers, "CPU_START_POOL_MIB", 16 * roomy.kv.paging.block_mib)
    engine = make_engine(ckpt, batch=4, context=1024, block_tokens=64)
    paging = engine.kv.paging
    paging.grow_limit_blocks = paging.ledger.pool_blocks
    assert paging.ledger.pool_blocks == 16
    run_all(engine, [base + [7]], SamplingParams(max_tokens=1, temperature=0.0), prefix="base")
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outs: dict[str, list] = {}
    paused = 0
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        paused = max(paused, paging.stats.paused_requests)
    assert [o[-1].cached_tokens for o in outs.values()] == [512] * 4
    assert tokens_of(outs) == want
    assert paused == 0 and paging.stats.spilled_blocks == 0
