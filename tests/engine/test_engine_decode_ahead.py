"""The next greedy decode step launched before this one's tokens are read (engine.exec.decode_ahead), on the real
engine on CPU with `decode_ahead="on"` (eager: the same bookkeeping, one stream): every request gets the tokens
of a run without it, through what changes the next plan between two steps (a stop token, an abort, a request
arriving, a sampled row, a launch that fails), and the steps launched ahead are really taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api import SamplingParams
from engine.errors import ConfigError
from engine.exec.step_fns import EagerExecutor
from tests.engine.engine_helpers import lively_checkpoint, make_engine, random_prompts, small_config, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(4, seed=140, lengths=(8, 40))


@pytest.fixture(scope="module")
def lively(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lively_checkpoint(tmp_path_factory.mktemp("ahead"), seed=3)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _drive(engine, script: dict[int, list], steps: int = 400) -> dict[str, list[int]]:
    """Step until idle; before step k, run script[k]'s calls (add_request / abort) on the engine."""
    outs: dict = {}
    for k in range(steps):
        for call in script.get(k, []):
            call(engine)
        if not engine.has_work and not any(j > k for j in script):
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work
    return tokens_of(outs)


def _both(lively: Path, script: dict[int, list], **kw) -> tuple[dict, dict, object]:
    off = _drive(make_engine(lively, decode_ahead="off", **kw), script)
    engine = make_engine(lively, decode_ahead="on", **kw)
    on = _drive(engine, script)
    return off, on, engine.ahead


def _add(rid: str, prompt: list[int], params: SamplingParams):
    return lambda e: e.add_request(rid, prompt, params)


def test_greedy_tokens_are_those_of_a_run_without_it_and_the_steps_ahead_are_taken(lively):
    script = {0: [_add(f"r{i}", p, _greedy(12 + 5 * i)) for i, p in enumerate(PROMPTS)]}
    off, on, ahead = _both(lively, script)
    assert on == off
    assert [len(on[f"r{i}"]) for i in range(4)] == [12, 17, 22, 27]
    # every step after the prompts whose rows all need another token went ahead and was taken
    assert ahead.taken >= 20, ahead.taken
    assert not ahead.pending


def test_a_stop_token_an_abort_and_an_arrival_between_two_steps_lose_nothing(lively):
    plain = _drive(make_engine(lively, decode_ahead="off"),
                   {0: [_add("a", PROMPTS[0], _greedy(30)), _add("b", PROMPTS[1], _greedy(30))]})
    stop_at = plain["a"][6]  # a's seventh token ends it, mid-run, while b decodes on
    first_stop = plain["a"].index(stop_at)
    script = {
        0: [_add("a", PROMPTS[0], _greedy(30, stop_token_ids=(stop_at,))), _add("b", PROMPTS[1], _greedy(30)),
            _add("c", PROMPTS[2], _greedy(30))],
        12: [lambda e: e.abort("c")],
        15: [_add("d", PROMPTS[3], _greedy(20))],
    }
    off, on, ahead = _both(lively, script)
    assert on == off
    assert on["a"] == plain["a"][:first_stop + 1]
    assert len(on["b"]) == 30 and len(on["d"]) == 20 and 0 < len(on["c"]) < 30
    assert ahead.dropped >= 2  # the stop and the abort each dropped the step in flight
    assert ahead.taken >= 20


def test_a_sampled_row_decodes_as_before_and_the_greedy_rows_go_ahead_once_it_ends(lively):
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    script = {0: [_add("s", PROMPTS[0], sampled), _add("g", PROMPTS[1], _greedy(30))]}
    off, on, ahead = _both(lively, script)
    assert on == off
    assert ahead.taken >= 15  # the greedy row alone, after the sampled one finished


class _FailingDecode(EagerExecutor):
    """Eager, but the `fail_at`th decode raises what a failed launch would."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.decodes = 0
        self.fail_at = fail_at

    def run(self, kind, key, fn, inputs, owner=None):
        if kind == "decode":
            self.decodes += 1
            if self.decodes == self.fail_at:
                raise RuntimeError("CUDA error: an illegal memory access was encountered [injected]")
        return super().run(kind, key, fn, inputs, owner)


def test_a_launch_ahead_that_fails_costs_that_launch_only(lively):
    script = {0: [_add(f"r{i}", p, _greedy(15)) for i, p in enumerate(PROMPTS[:2])]}
    off = _drive(make_engine(lively, decode_ahead="off"), script)
    engine = make_engine(lively, decode_ahead="on", executor=_FailingDecode(fail_at=6))
    on = _drive(engine, script)
    assert on == off
    assert engine.health().ready
    assert engine.graphs.decodes > 6 and engine.ahead.taken >= 8


def test_off_and_mtp_without_its_fused_step_never_launch_ahead(lively):
    script = {0: [_add("r0", PROMPTS[0], _greedy(12))]}
    for kw in ({"decode_ahead": "off"}, {"decode_ahead": "on", "batch_mtp": True}):  # CPU: verify + round apart
        engine = make_engine(lively, **kw)
        _drive(engine, script)
        assert engine.ahead.taken == 0 and engine.ahead.dropped == 0


def _fused_mtp(lively: Path, ahead: str, depth: int):
    engine = make_engine(lively, decode_ahead=ahead, batch_mtp=True, mtp_depth=depth)
    engine.drafter.fused = True  # the CUDA default, forced on the CPU backend
    return engine


@pytest.mark.parametrize("depth", [1, 3])
def test_mtp_fused_greedy_steps_go_ahead_and_keep_the_tokens_of_plain_decode(lively, depth):
    """MTP's fused step launched before the host reads the one before it: its pending token and positions come
    from that step's accepted count on the device. Through a stop token, an abort and an arrival, every request
    gets plain greedy decoding's tokens (MTP is lossless), and steps launched ahead are taken."""
    plain = _drive(make_engine(lively, decode_ahead="off"),
                   {0: [_add(r, p, _greedy(40)) for r, p in zip("abcd", PROMPTS)]})
    stop_at = plain["a"][9]
    first_stop = plain["a"].index(stop_at)
    script = {
        0: [_add("a", PROMPTS[0], _greedy(40, stop_token_ids=(stop_at,))), _add("b", PROMPTS[1], _greedy(40)),
            _add("c", PROMPTS[2], _greedy(40))],
        8: [lambda e: e.abort("c")],
        10: [_add("d", PROMPTS[3], _greedy(25))],
    }
    off = _drive(_fused_mtp(lively, "off", depth), script)
    engine = _fused_mtp(lively, "on", depth)
    on = _drive(engine, script)
    assert on == off  # the same steps: the abort lands after the same tokens
    assert on["a"] == plain["a"][:first_stop + 1] and on["b"] == plain["b"] and on["d"] == plain["d"][:25]
    assert 0 < len(on["c"]) < 40 and on["c"] == plain["c"][:len(on["c"])]
    assert engine.ahead.taken >= 5, engine.ahead.taken
    assert engine.ahead.dropped >= 2  # the stop and the abort each dropped the step in flight
    assert not engine.ahead.pending


def test_a_fused_step_in_flight_is_not_taken_for_rows_it_did_not_compute(lively):
    """The step launched ahead assumed each row's real next token and position: a plan with other rows (here one
    position further) drops it, and the request still ends with plain decoding's tokens."""
    from engine.exec.runner import Row

    engine = _fused_mtp(lively, "on", 2)
    engine.add_request("r0", PROMPTS[0], _greedy(30))
    while not engine.ahead.pending:
        engine.step()
    req = engine.sched.running()[0]
    assert engine.ahead.take([Row(req.slot, req.output_token_ids[-1], req.num_tokens - 1)], "decode") is None
    assert not engine.ahead.pending and engine.ahead.dropped == 1  # a plain decode does not take a fused step
    rest = _drive(engine, {})
    full = _drive(make_engine(lively, decode_ahead="off"), {0: [_add("r0", PROMPTS[0], _greedy(30))]})
    assert full["r0"][-len(rest["r0"]):] == rest["r0"]


def test_the_option_names_itself_when_it_cannot_work(lively):
    with pytest.raises(ConfigError) as err:
        small_config(lively, decode_ahead="sometimes")
    assert err.value.param == "decode_ahead" and "sometimes" in str(err.value)
    # auto: an eager CPU engine has no device time to overlap
    assert not make_engine(lively).ahead.enabled


def test_a_step_in_flight_for_other_rows_is_dropped_not_taken(lively):
    from engine.exec.runner import Row

    engine = make_engine(lively, decode_ahead="on")
    engine.add_request("r0", PROMPTS[0], _greedy(20))
    while not engine.ahead.pending:
        engine.step()
    req = engine.sched.running()[0]
    moved = Row(req.slot, req.output_token_ids[-1], req.num_tokens)  # one position past the step in flight
    assert engine.ahead.take([moved]) is None
    assert not engine.ahead.pending and engine.ahead.dropped == 1
    rest = _drive(engine, {})
    full = _drive(make_engine(lively, decode_ahead="off"), {0: [_add("r0", PROMPTS[0], _greedy(20))]})
    assert full["r0"][-len(rest["r0"]):] == rest["r0"]


def test_beside_a_long_prompts_chunks_the_steps_go_ahead_and_keep_their_tokens(lively):
    """Chunks beside the steps (`prefill_overlap on`; one stream on a CPU): the decoding slots' steps go ahead while
    the long prompt's chunks are in flight, the chunk that lands (its request decoding next) drops the step in
    flight, and every request gets the tokens of a run with neither."""
    long_prompt = random_prompts(1, seed=141, lengths=(600, 601), vocab=500)[0]
    script = {0: [_add("s0", PROMPTS[0], _greedy(60)), _add("s1", PROMPTS[1], _greedy(60))],
              3: [_add("long", long_prompt, _greedy(6))]}
    kw = dict(prefill_chunk_tokens=128, step_token_budget=256)
    off = _drive(make_engine(lively, decode_ahead="off", prefill_overlap="off", **kw), script)
    engine = make_engine(lively, decode_ahead="on", prefill_overlap="on", **kw)
    beside = []
    launch = engine.ahead._launch
    engine.ahead._launch = lambda rows, best: (beside.append(engine.chunks.in_flight is not None),
                                               launch(rows, best))[1]
    on = _drive(engine, script)
    assert on == off
    assert sum(beside) >= 3, "steps launched ahead with a chunk in flight"
    assert engine.ahead.dropped >= 1  # the last chunk landed with a step in flight


def test_mtp_fused_steps_go_ahead_beside_a_long_prompts_chunks_and_keep_plain_decodings_tokens(lively):
    """MTP's fused steps launched ahead while a long prompt's chunks run beside them (one stream on a CPU): the
    chunk that lands (its request drafting its first tokens into the buffer, then decoding) drops the step in
    flight, whose rows get their own drafts back; every request gets plain greedy decoding's tokens."""
    long_prompt = random_prompts(1, seed=142, lengths=(500, 501), vocab=500)[0]
    script = {0: [_add("s0", PROMPTS[0], _greedy(50)), _add("s1", PROMPTS[1], _greedy(50))],
              3: [_add("long", long_prompt, _greedy(8))]}
    kw = dict(prefill_chunk_tokens=128, step_token_budget=256)
    plain = _drive(make_engine(lively, decode_ahead="off", prefill_overlap="off", **kw), script)
    engine = make_engine(lively, decode_ahead="on", prefill_overlap="on", batch_mtp=True, mtp_depth=2, **kw)
    engine.drafter.fused = True  # the CUDA default, forced on the CPU backend
    beside = []
    launch = engine.ahead._launch_verify
    engine.ahead._launch_verify = lambda rows, step: (beside.append(engine.chunks.in_flight is not None),
                                                      launch(rows, step))[1]
    assert _drive(engine, script) == plain
    assert sum(beside) >= 2, "fused steps launched ahead with a chunk in flight"
    assert engine.ahead.taken >= 5 and engine.ahead.dropped >= 1


@pytest.mark.parametrize("mtp,kv_resident,max_tokens", [(False, 128, 24), (True, None, 48)])
def test_kv_by_use_steps_go_ahead_while_slots_take_blocks_and_spill_each_other(lively, mtp, kv_resident, max_tokens):
    """KV by use: steps go ahead where their blocks need no copy (slots mapping free blocks as they grow; with
    --kv-resident 128 and no tier, a pool too small for the slots together, so they also spill each other's
    blocks between the steps that go ahead), and the tokens are those of a run with room and no step ahead. MTP's
    fused step ahead knows its positions on the device only: it wrote past its mapped blocks (into the scratch
    block) until the launch mapped every block it may write."""
    from tests.engine.engine_helpers import run_all

    prompts = random_prompts(4, seed=141, lengths=(400, 800))
    params = _greedy(max_tokens)
    small = dict(batch=4, context=1024, tier_budget_mib=0.0, batch_mtp=mtp, mtp_depth=2)
    engine = make_engine(lively, decode_ahead="on", kv_resident=kv_resident, **small)
    if mtp:
        engine.drafter.fused = True  # the CUDA default, forced on the CPU backend (MTP's steps go ahead fused)
    got = tokens_of(run_all(engine, prompts, params))
    assert engine.ahead.taken > 0 and engine.kv.paging is not None
    if kv_resident is not None:
        assert engine.kv.paging.stats.spilled_blocks > 0, "the pool was never short: nothing moved"
    want = tokens_of(run_all(make_engine(lively, decode_ahead="off", kv_pool="reserved", **small), prompts, params))
    assert got == want


def test_an_moe_engine_with_every_expert_resident_goes_ahead_and_one_that_may_miss_says_why():
    """Every expert resident: no route can miss, so a step may go ahead as on a dense model (same tokens). An
    expert cache that may miss loads a step's experts from its routing: `on` is refused naming that."""
    prompts = random_prompts(3, seed=4, lengths=(10, 30))
    script = {0: [_add(f"r{i}", p, _greedy(10 + 3 * i)) for i, p in enumerate(prompts)]}
    off = _drive(make_engine("random:moe-synth-tiny", decode_ahead="off", batch=3), script)
    engine = make_engine("random:moe-synth-tiny", decode_ahead="on", batch=3)
    assert _drive(engine, script) == off
    assert engine.ahead.taken > 0
    with pytest.raises(ConfigError, match="does not hold every expert"):
        make_engine("random:moe-synth-tiny", decode_ahead="on", batch=3, expert_cache_mib=1)


def test_mtp_fused_steps_ahead_that_miss_an_expert_run_again_on_their_own_inputs():
    """An MoE engine whose expert cache shrinks after start (so steps go ahead, then miss) on the graph cache's CPU
    backend (outputs in static buffers, as CUDA graphs): a fused MTP step launched ahead takes its inputs from the
    step before's `next_inputs`, an output of the very graph it replays. When it misses an expert it is replayed
    or rerun eagerly, and it must verify the position it was launched for: it once read its own replay's
    `next_inputs` instead, verified one step further on, and the tokens of the step it skipped (in the KV) never
    reached the host (H100: each row one token short of plain greedy decoding)."""
    from engine.exec.graphs.backends import CpuGraphBackend
    from engine.exec.graphs.cache import GraphCache
    from engine.switches import SwitchBoard
    from engine.telemetry import EventBus

    prompts = random_prompts(2, seed=11, lengths=(20, 90))
    script = {0: [_add(f"r{i}", p, _greedy(24)) for i, p in enumerate(prompts)]}
    plain = _drive(make_engine("random:moe-synth-tiny", decode_ahead="off", batch=2), script)
    graphs = GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), release_tier=lambda mib, reason: 0.0,
                        wait_interval_s=0.0, backend=CpuGraphBackend())
    engine = make_engine("random:moe-synth-tiny", decode_ahead="on", batch=2, batch_mtp=True, mtp_depth=2,
                         executor=graphs)
    engine.drafter.fused = True  # the CUDA default, forced on the CPU backend
    cache = engine.lm.model.expert_provider
    cache.set_budget(cache.mib_for(8), "test")  # every expert resident at start: steps go ahead, then miss
    cache.capturing = lambda x: True  # the graph-safe path (misses counted, the step run again), on the CPU
    ran_again = []  # per fused step launched ahead: how many times it ran again after a miss
    launch = engine.ahead._launch_verify

    def watched(rows, step):
        before = cache.stats.replays + cache.stats.reruns
        launched = launch(rows, step)
        ran_again.append(cache.stats.replays + cache.stats.reruns - before)
        return launched

    engine.ahead._launch_verify = watched
    try:
        assert _drive(engine, script) == plain
    finally:
        engine.close()
    assert engine.ahead.taken > 0 and sum(n > 0 for n in ran_again) >= 2, ran_again
