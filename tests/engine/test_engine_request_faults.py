"""One request must never kill the engine (issue 15, item 1): a fault injected at each stage of add_request
and of a step, for one request among several, fails that request only; the others finish with exactly the
tokens they would have had, and the engine stays ready."""

from __future__ import annotations

from typing import Any

import pytest

import engine.exec.sampler as sampler_module
from engine.api import SamplingParams
from engine.errors import QueueFull, RequestRejected
from engine.exec import chunk_rows
from engine.telemetry import AdmissionEvent, EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(3, seed=15, lengths=(20, 90))
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
MARK = 0.125  # the faulty request is the one with this presence penalty (it changes nothing else here)
FAULTY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=MARK)


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def reference(ckpt):
    from tests.engine.engine_helpers import one_thread

    with one_thread():
        return tokens_of(run_all(make_engine(ckpt, batch=4), PROMPTS, GREEDY))


def test_a_seed_torch_refuses_is_rejected_and_leaves_nothing_behind(ckpt, reference) -> None:
    engine = make_engine(ckpt, batch=4)
    for seed in (1 << 64, -(1 << 63) - 1, 1 << 200):
        with pytest.raises(RequestRejected) as err:
            engine.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=4, seed=seed))
        assert err.value.param == "seed"
        assert engine.output.get("bad") is None and not engine.has_work
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == reference
    assert engine.health().ready


@pytest.mark.parametrize("stage", ["generator", "decoder", "scheduler"])
def test_a_failure_while_adding_a_request_leaves_the_engine_as_it_was(ckpt, reference, stage, monkeypatch) -> None:
    engine = make_engine(ckpt, batch=4)
    if stage == "generator":
        monkeypatch.setattr(sampler_module, "make_generator", _raise_for_seed(666, sampler_module.make_generator))
    elif stage == "decoder":
        monkeypatch.setattr(engine.tokenizer, "incremental_decoder", _raising("no decoder"), raising=False)
    else:
        real_add = engine.sched.add

        def add(req):
            if req.request_id == "bad":
                raise QueueFull(1, 1, 1.0)
            real_add(req)

        monkeypatch.setattr(engine.sched, "add", add)
    with pytest.raises((RequestRejected, QueueFull, Injected)):
        engine.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=4, seed=666))
    assert engine.output.get("bad") is None and "bad" not in engine.executor.generators and not engine.has_work
    if stage == "decoder":
        monkeypatch.undo()
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == reference
    assert engine.health().ready


@pytest.mark.parametrize("stage", ["admission", "prefill", "first_token_sampling", "decode_sampling", "output"])
def test_a_fault_in_one_requests_part_of_a_step_fails_that_request_only(ckpt, reference, stage, monkeypatch) -> None:
    bus = _FaultyBus() if stage == "admission" else EventBus(history=50000)
    engine = make_engine(ckpt, bus=bus, batch=4)
    if stage == "prefill":
        real_prefill = engine.runner.prefill

        def prefill(slot, ids, start, beside=False):
            if engine.sched.slot_request(slot).params.presence_penalty == MARK:
                raise Injected("prefill of the faulty request")
            return real_prefill(slot, ids, start, beside=beside)

        real_rows = chunk_rows.prefill_rows

        def prefill_rows(runner, rows):  # several prompts' chunks in one forward: the faulty one's fails it
            if any(engine.sched.slot_request(slot).params.presence_penalty == MARK for slot, _, _ in rows):
                raise Injected("prefill of the faulty request")
            return real_rows(runner, rows)

        monkeypatch.setattr(engine.runner, "prefill", prefill)
        monkeypatch.setattr(chunk_rows, "prefill_rows", prefill_rows)
    elif stage in ("first_token_sampling", "decode_sampling"):
        real_penalize = sampler_module.penalize
        at_decode = stage == "decode_sampling"

        def penalize(logits, drafts, params, histories):
            if any(p.presence_penalty == MARK and bool(h[1]) == at_decode for p, h in zip(params, histories)):
                raise Injected(f"{stage} of the faulty request")
            return real_penalize(logits, drafts, params, histories)

        monkeypatch.setattr(sampler_module, "penalize", penalize)
    elif stage == "output":
        real_append = engine.output.append

        def append(track, tokens, logprobs=None, finishing=False):
            if track.request.params.presence_penalty == MARK and track.request.num_output_tokens >= 2:
                raise Injected("detokenizer of the faulty request")
            return real_append(track, tokens, logprobs, finishing)

        monkeypatch.setattr(engine.output, "append", append)
    engine.add_request("bad", PROMPTS[1], FAULTY)
    outs = run_all(engine, PROMPTS, GREEDY)
    bad = outs.pop("bad")
    assert bad[-1].finished and bad[-1].finish_reason == "error" and "faulty request" in bad[-1].error
    assert tokens_of(outs) == reference  # every other request: the very tokens it has alone
    errors = [e for e in bus.history() if e.type == "error"]
    assert len(errors) == 1 and not errors[0].fatal and "bad" in errors[0].where
    assert engine.health().ready and not engine.has_work
    monkeypatch.undo()
    again = run_all(engine, PROMPTS[:1], GREEDY, prefix="again")
    assert tokens_of(again)["again0"] == reference["r0"]


class _FaultyBus(EventBus):
    """Raises while the faulty request's admission is published (a fault inside `Engine._admit`)."""

    def __init__(self) -> None:
        super().__init__(history=50000)

    def publish(self, event):
        if isinstance(event, AdmissionEvent) and event.request_id == "bad":
            raise Injected("admission of the faulty request")
        return super().publish(event)


def _raising(message: str):
    def fail(*_args, **_kwargs):
        raise Injected(message)

    return fail


def _raise_for_seed(seed: int, real):
    def make(s):
        if s == seed:
            raise ValueError("Overflow when unpacking long long")
        return real(s)

    return make
