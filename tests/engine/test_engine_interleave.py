"""The real engine on CPU interleaving a long admission with running decodes (issue 8, issue 4): four slots
decode, a long fresh prompt arrives, and every decoding slot still gets its token every step while the prompt is
prefilled under measured-cost pacing; the admission completes. Counts, not timings: the CPU's step times only
decide how the prompt is cut, which these tests do not pin."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.api import SamplingParams
from engine.core.prefill_pacer import PrefillPacer
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, small_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHORT = random_prompts(4, seed=80, lengths=(20, 40))
LONG = random_prompts(1, seed=81, lengths=(2500, 2501))[0]
BLOCK_TOKENS = 16


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _admit_next_to_decoders(engine, context: int = 4096, fitted: bool = True) -> int:
    """Four shorts decode; the long prompt arrives; every step must give each short a token until the long
    prompt's first token, and the engine must have fed its timings to the scheduler. Returns the steps the
    admission took."""
    shorts = [engine.add_request(f"s{i}", p, _greedy(context - len(p))) for i, p in enumerate(SHORT)]
    for _ in range(4):  # the shorts prefill, then decode: the engine has measured decode steps
        engine.step()
    assert all(r.num_output_tokens >= 1 for r in shorts)
    long = engine.add_request("long", LONG, _greedy(2))
    steps = 0
    chunks_seen = 0
    while long.num_output_tokens == 0:
        before = [r.num_output_tokens for r in shorts]
        computed_before = long.num_computed_tokens
        engine.step()
        steps += 1
        assert steps <= 40 * len(LONG) // BLOCK_TOKENS, "the long admission stopped making progress"
        gained = [r.num_output_tokens - b for r, b in zip(shorts, before)]
        assert not any(r.is_finished for r in shorts), f"step {steps}: a short ran out of context; give it more"
        assert all(g >= 1 for g in gained), f"step {steps}: a decoding slot got no token ({gained})"
        chunks_seen += long.num_computed_tokens > computed_before
        assert engine.health().ready, engine.health().reason
    assert long.num_computed_tokens == len(LONG)
    assert chunks_seen >= len(LONG) // 512  # chunked: never more than prefill_chunk_tokens a step
    pacer = engine.sched.pacer
    assert pacer.decode_s is not None and pacer.decode_s > 0
    if fitted:  # chunks between the steps: the pacer fits their cost (beside them, it does not)
        assert pacer.cost.coefficients() is not pacer.cost.prior and pacer.cost.predict_s(256, 2000) > 0
    for r in shorts:
        engine.abort(r.request_id)
    while engine.has_work:
        engine.step()
    return steps


@pytest.mark.parametrize("mtp", [False, True])
def test_decoding_slots_get_a_token_every_step_while_a_long_prompt_is_admitted(ckpt, mtp: bool) -> None:
    _admit_next_to_decoders(make_engine(ckpt, batch=5, context=4096, prefill_chunk_tokens=512,
                                        step_token_budget=1024, block_tokens=BLOCK_TOKENS, batch_mtp=mtp,
                                        mtp_depth=2))


@pytest.mark.gpu
def test_on_cuda_with_graphs_decoding_slots_keep_their_token_every_step(ckpt) -> None:
    """The same on the GPU path: captured decode graphs, eager fused chunks, device syncs around the timings. The
    shorts get a 32K context: with FUSED_OPS and FUSED_PROJ on, the admission outlasts the room a 4,096-token
    context leaves a short decoding 3 tokens a step."""
    context = 32768
    config = small_config(ckpt, device="cuda:0", dtype="bfloat16", batch=5, context=context, prefill_chunk_tokens=512,
                          step_token_budget=1024, batch_mtp=True, mtp_depth=2)
    engine = Engine(config, EventBus(), block_tokens=BLOCK_TOKENS)
    assert engine.chunks is not None, "on CUDA prompt chunks run beside the steps by default"
    steps = _admit_next_to_decoders(engine, context, fitted=False)
    print(f"the 2,500-token admission took {steps} steps")


class _WholeChunksBeside(PrefillPacer):
    """Unpaced (share 1: whole chunks, no gap after one beside the steps), and no chunk "fits one step": with
    chunks beside the steps on, every chunk while slots decode goes beside them (the scheduler otherwise runs a
    chunk that fits a step's allowance between the steps, and at share 1 every chunk fits)."""

    def fits_one_step(self, tokens: int, start: int, num_decoding: int, num_prefilling: int) -> bool | None:
        return False


@pytest.mark.parametrize("mtp", [False, True])
def test_chunks_beside_the_steps_keep_every_slots_token_and_land_a_step_later(ckpt, mtp: bool) -> None:
    """`prefill_overlap on` on a CPU: one stream, so each chunk runs at its launch; held "not ready" through the
    step that launched it (a GPU chunk longer than a step), it lands at the end of the next one. The bookkeeping
    of a chunk in flight (no second chunk planned, the last chunk's request decoding only once it landed) is what
    runs on a GPU with the chunk still computing."""
    engine = make_engine(ckpt, batch=5, context=4096, prefill_chunk_tokens=512, step_token_budget=1024,
                         block_tokens=BLOCK_TOKENS, batch_mtp=mtp, mtp_depth=2, prefill_overlap="on")
    assert engine.chunks is not None and engine.sched.overlap_chunks
    # every chunk beside the steps: the default pacer would run one that its timings say fits a step between them,
    # and on a loaded machine those timings vary
    engine.sched.pacer = _WholeChunksBeside(1.0, granule_tokens=BLOCK_TOKENS)
    launched, landed = [], []
    launch, land = engine.chunks.launch, engine.sched.chunk_landed
    engine.chunks.launch = lambda chunk, run: (launched.append((engine.steps, chunk.start)), launch(chunk, run))
    engine.chunks.ready = lambda: engine.steps > launched[-1][0]
    engine.sched.chunk_landed = lambda chunk, s: (landed.append((engine.steps, chunk.start)), land(chunk, s))[1]
    _admit_next_to_decoders(engine, fitted=False)
    long_chunks = [start for _, start in launched]
    assert long_chunks == list(range(0, len(LONG), 512)), "whole chunks, in order, each once"
    assert [(step + 1, start) for step, start in launched] == landed, "each landed at the next step"


def test_chunks_beside_the_steps_give_the_tokens_of_chunks_between_them(ckpt) -> None:
    """Greedy fp32: the same tokens whether the long prompt's chunks ran beside the steps or between them, and
    the prefix tier holds the long prompt's blocks either way (its fills run when a chunk lands)."""
    outputs, cached = [], []
    for overlap in ("off", "on"):
        engine = make_engine(ckpt, batch=3, context=2048, prefill_chunk_tokens=256, step_token_budget=512,
                             block_tokens=BLOCK_TOKENS, prefill_overlap=overlap)
        outputs.append(_two_shorts_then_a_long_prompt(engine))
        again = engine.add_request("again", LONG[:1200], _greedy(1))
        engine.step()
        cached.append(again.num_cached_tokens)
        while engine.has_work:
            engine.step()
    assert outputs[0] == outputs[1]
    assert cached[0] == cached[1] > 1000, cached


@pytest.mark.gpu
def test_on_cuda_chunks_beside_the_steps_give_the_tokens_of_chunks_between_them(ckpt, monkeypatch) -> None:
    """bf16 with graphs and MTP: a long prompt's chunks on the side stream while three slots decode on the steps'
    stream give every request the tokens it gets with the chunks between the steps (all unpaced, so the chunks
    fall at the same positions); chunks up to 2,048 tokens replay graphs of their own pool, beside the decode and
    drafter graphs. The side stream: a plain low-priority one (STRATA_CHUNK_SMS=0), then the default, a green
    context's on a share of the SMs."""
    from engine.exec.cuda_streams import default_chunk_sms

    outputs, beside_steps = [], []
    for overlap, chunk_sms in (("off", None), ("auto", 0), ("auto", default_chunk_sms(torch.device("cuda:0")))):
        if chunk_sms == 0:
            monkeypatch.setenv("STRATA_CHUNK_SMS", "0")
        else:
            monkeypatch.delenv("STRATA_CHUNK_SMS", raising=False)
        config = small_config(ckpt, device="cuda:0", dtype="bfloat16", batch=4, context=8192,
                              prefill_chunk_tokens=512, step_token_budget=1024, batch_mtp=True, mtp_depth=2,
                              prefill_overlap=overlap)
        engine = Engine(config, EventBus(), block_tokens=BLOCK_TOKENS)
        assert (engine.chunks is not None) == (overlap == "auto")
        assert engine.chunks is None or (engine.streams.chunk_sms, engine.streams.note) == (chunk_sms, None)
        engine.sched.pacer = _WholeChunksBeside(1.0, granule_tokens=BLOCK_TOKENS)
        shorts = [engine.add_request(f"s{i}", p, _greedy(400)) for i, p in enumerate(SHORT[:3])]
        for _ in range(4):
            engine.step()
        reqs = shorts + [engine.add_request(f"long{j}", LONG[j * 7:], _greedy(24)) for j in range(2)]
        timings = []  # each step's timing as the scheduler records it: did a chunk run beside its decode?
        record = engine.sched.record_step
        engine.sched.record_step = lambda timing: (timings.append(timing), record(timing))
        while engine.has_work:
            engine.step()
            assert engine.health().ready, engine.health().reason
        steps = sum(1 for timing in timings if timing.beside_chunk)
        outputs.append([list(r.output_token_ids) for r in reqs])
        beside_steps.append(steps)
        engine.close()
        del engine, reqs, shorts
        gc.collect()  # the engine and the side stream's tensors go; the process must not (a green context that
        torch.cuda.synchronize()  # went with its engine aborted the process as its tensors were freed)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert beside_steps[0] == 0 and min(beside_steps[1:]) >= 2 * (len(LONG) // 512), beside_steps


def test_a_request_aborted_with_its_chunk_in_flight_frees_its_slot_for_the_next(ckpt) -> None:
    """Abort the long prompt while its chunk is in flight: the chunk is dropped (waited for on a GPU), the slot
    takes the next request, which gets the tokens it gets alone; the decoding slots never stop."""
    params = _greedy(6)
    alone = make_engine(ckpt, batch=2, context=2048, prefill_chunk_tokens=256, step_token_budget=512,
                        block_tokens=BLOCK_TOKENS, prefill_overlap="on")
    ref = alone.add_request("next", SHORT[1], params)
    while alone.has_work:
        alone.step()
    engine = make_engine(ckpt, batch=2, context=2048, prefill_chunk_tokens=256, step_token_budget=512,
                         block_tokens=BLOCK_TOKENS, prefill_overlap="on")
    short = engine.add_request("s0", SHORT[0], _greedy(200))
    for _ in range(3):
        engine.step()
    # its chunks beside the steps whatever the timings say (a loaded machine's steps can make one fit between them)
    engine.sched.pacer = _WholeChunksBeside(1.0, granule_tokens=BLOCK_TOKENS)
    long = engine.add_request("long", LONG[:1200], params)
    engine.chunks.ready = lambda: False  # one stream on a CPU: a GPU chunk still computing while the slot decodes
    engine.step()  # admitted, its first chunk launched
    assert engine.chunks.holds(long) and engine.sched.chunk_in_flight
    engine.abort("long")
    assert engine.chunks.in_flight is None and not engine.sched.chunk_in_flight
    del engine.chunks.ready  # the chunks from here on land as they run
    nxt = engine.add_request("next", SHORT[1], params)
    while not nxt.is_finished:
        engine.step()
    assert list(nxt.output_token_ids) == list(ref.output_token_ids)
    assert not short.is_finished and engine.health().ready


def test_a_paced_admission_gives_the_tokens_an_unpaced_one_gives(ckpt) -> None:
    """Where the chunks fall must not change what is generated (greedy, fp32)."""
    outputs = []
    for share in (1.0, 0.2):
        engine = make_engine(ckpt, batch=3, context=2048, prefill_chunk_tokens=256, step_token_budget=512,
                             block_tokens=BLOCK_TOKENS)
        engine.sched.pacer = PrefillPacer(share, granule_tokens=BLOCK_TOKENS)  # the engine's, with this share
        outputs.append(_two_shorts_then_a_long_prompt(engine))
    assert outputs[0] == outputs[1]


def _two_shorts_then_a_long_prompt(engine) -> list[list[int]]:
    """Two shorts decode, a 1,200-token prompt arrives, all run to their end: each request's tokens."""
    shorts = [engine.add_request(f"s{i}", p, _greedy(40)) for i, p in enumerate(SHORT[:2])]
    for _ in range(3):
        engine.step()
    long = engine.add_request("long", LONG[:1200], _greedy(8))
    while engine.has_work:
        engine.step()
    return [list(r.output_token_ids) for r in shorts + [long]]


def test_a_chunk_that_fails_at_its_launch_ends_its_request_only(ckpt) -> None:
    """Beside the steps, a chunk's forward that raises (an out-of-memory the tier could not cure, say) ends the
    long request with the real message; the decoding slot keeps its token every step, nothing stays in flight, and
    the next prompt is served."""
    engine = make_engine(ckpt, batch=2, context=2048, prefill_chunk_tokens=256, step_token_budget=512,
                         block_tokens=BLOCK_TOKENS, prefill_overlap="on")
    short = engine.add_request("s0", SHORT[0], _greedy(300))
    for _ in range(3):
        engine.step()
    prefill = engine.runner.prefill

    def failing(slot, token_ids, start, beside=False):
        if start == 512:
            raise RuntimeError("injected: the third chunk's forward failed")
        return prefill(slot, token_ids, start, beside=beside)

    engine.runner.prefill = failing
    long = engine.add_request("long", LONG[:1200], _greedy(4))
    outs = []
    while not long.is_finished:
        before = short.num_output_tokens
        outs += engine.step()
        assert short.num_output_tokens > before
    assert long.finish_reason == "error" and long.num_computed_tokens <= 768
    (final,) = [o for o in outs if o.request_id == "long" and o.finished]
    assert "injected: the third chunk's forward failed" in final.error
    assert engine.chunks.in_flight is None and not engine.sched.chunk_in_flight and engine.health().ready
    engine.runner.prefill = prefill
    nxt = engine.add_request("next", SHORT[1], _greedy(3))
    while not nxt.is_finished:
        engine.step()
    assert nxt.finish_reason == "length" and not short.is_finished
