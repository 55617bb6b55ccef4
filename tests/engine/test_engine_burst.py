"""A burst of prompts admitted together (issue 52, admission at scale): the chunks of many prompts in one step
run as rows of one forward, each request gets the very greedy tokens it gets alone (fp32), every decoding slot
keeps its token each step while the burst is admitted, and a prompt's first token comes in the step its last
chunk runs. Counts, not timings."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from engine.api import SamplingParams
from engine.exec import chunk_rows
from engine.exec.step_buckets import MIN_CHUNK_TOKENS, pow2_bucket
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# lengths over several chunks (64 tokens) and several length buckets: rows of one bucket share a forward
BURST = random_prompts(8, seed=520, lengths=(20, 180))


def _row_forwards(monkeypatch) -> list[int]:
    """Record the row count of every multi-row prompt forward the engines run (the real function, counted)."""
    counts: list[int] = []
    real = chunk_rows.prefill_rows

    def counted(runner, rows):
        counts.append(len(rows))
        return real(runner, rows)

    monkeypatch.setattr(chunk_rows, "prefill_rows", counted)
    return counts


@pytest.mark.parametrize("mtp", [False, True])
def test_a_burst_runs_as_rows_of_one_forward_with_the_tokens_each_prompt_has_alone(ckpt: Path, mtp: bool,
                                                                                   monkeypatch) -> None:
    kw = dict(context=1024, prefill_chunk_tokens=64, step_token_budget=1024, batch_mtp=mtp, mtp_depth=2)
    alone = tokens_of(run_all(make_engine(ckpt, batch=1, **kw), BURST, GREEDY))  # one request at a time
    engine = make_engine(ckpt, batch=len(BURST), **kw)
    rows = _row_forwards(monkeypatch)
    together = tokens_of(run_all(engine, BURST, GREEDY))
    assert together == alone
    assert rows and max(rows) >= 3, rows  # the first chunks of the burst shared forwards
    assert engine.health().ready


def test_decoding_slots_get_a_token_every_step_while_a_burst_is_admitted_and_first_tokens_come_at_once(
        ckpt: Path, monkeypatch) -> None:
    engine = make_engine(ckpt, batch=2 + len(BURST), context=1024, prefill_chunk_tokens=64, step_token_budget=256)
    rows = _row_forwards(monkeypatch)
    shared: list[int] = []  # chunks of one length bucket in one step's plan, where more than one (timing decides)
    execute = engine.executor.execute

    def recorded(plan):
        buckets = Counter(pow2_bucket(c.num_tokens, MIN_CHUNK_TOKENS) for c in plan.prefill)
        for bucket, n in buckets.items():
            # a forward's padded tokens stay within the step's budget: five short chunks of the 64 bucket under a
            # budget of 256 (a loaded machine's pacing makes them) are a forward of four and one alone
            most = max(1, engine.executor.rows_max_tokens // bucket)
            sizes = [most] * (n // most) + ([n % most] if n % most else [])
            shared.extend(size for size in sizes if size > 1)
        return execute(plan)

    engine.executor.execute = recorded
    decoding = [engine.add_request(f"d{i}", p, SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(random_prompts(2, seed=521, lengths=(10, 20)))]
    for _ in range(3):
        engine.step()
    assert all(r.num_output_tokens >= 1 for r in decoding)
    burst = [engine.add_request(f"b{i}", p, GREEDY) for i, p in enumerate(BURST)]
    steps = 0
    while any(r.num_output_tokens == 0 for r in burst):
        before = [r.num_output_tokens for r in decoding]
        engine.step()
        steps += 1
        assert steps <= 10 * sum(len(p) for p in BURST), "the burst stopped making progress"
        gained = [r.num_output_tokens - b for r, b in zip(decoding, before)]
        assert all(g >= 1 for g in gained), f"step {steps}: a decoding slot got no token ({gained})"
        for r in burst:  # a prompt whose last chunk ran has its first token from that very step
            if r.num_computed_tokens >= r.num_prompt_tokens:
                assert r.num_output_tokens >= 1, (steps, r.request_id)
    assert sorted(rows) == sorted(shared)  # each step's chunks of one bucket: one forward
    assert engine.health().ready


def test_a_fault_in_a_shared_forward_fails_only_the_request_it_belongs_to(ckpt: Path, monkeypatch) -> None:
    """The shared forward raises (as it would for one bad row): each chunk runs alone, the faulty one fails."""
    reference = tokens_of(run_all(make_engine(ckpt, batch=1, context=1024, prefill_chunk_tokens=64,
                                              step_token_budget=1024), BURST, GREEDY))
    engine = make_engine(ckpt, batch=len(BURST), context=1024, prefill_chunk_tokens=64, step_token_budget=1024)
    bad = BURST[2]
    real_rows, real_one = chunk_rows.prefill_rows, engine.runner.prefill

    def rows_with_a_fault(runner, rows):
        if any(ids == bad[start:start + len(ids)] and len(ids) for _, ids, start in rows):
            raise RuntimeError("injected: a chunk of the faulty request")
        return real_rows(runner, rows)

    def one_with_a_fault(slot, ids, start, beside=False):
        if ids == bad[start:start + len(ids)]:
            raise RuntimeError("injected: a chunk of the faulty request")
        return real_one(slot, ids, start, beside=beside)

    monkeypatch.setattr(chunk_rows, "prefill_rows", rows_with_a_fault)
    engine.runner.prefill = one_with_a_fault
    outs = run_all(engine, BURST, GREEDY)
    failed = outs.pop("r2")
    assert failed[-1].finish_reason == "error" and "injected" in failed[-1].error
    assert tokens_of(outs) == {rid: toks for rid, toks in reference.items() if rid != "r2"}
    assert engine.health().ready


def kernel_burst_check(model: str) -> None:
    """In Triton's interpreter: a burst through the paged prefill kernel, rows of one launch, gives the tokens of
    one request at a time on the same kernels."""
    from tests.engine.exec.triton_interpreter import run_kernels_on_cpu

    run_kernels_on_cpu()
    calls: list[int] = []
    import engine.model.attention.triton_prefill as prefill_kernel

    real = prefill_kernel.paged_prefill_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    prefill_kernel.paged_prefill_attention = counted
    prompts, params = BURST[:4], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    kw = dict(context=512, prefill_chunk_tokens=64, step_token_budget=512)
    alone = tokens_of(run_all(make_engine(Path(model), batch=1, **kw), prompts, params))
    engine = make_engine(Path(model), batch=len(prompts), **kw)
    assert engine.runner.paged_enabled()
    assert tokens_of(run_all(engine, prompts, params)) == alone
    assert max(calls) >= 2, calls  # several rows in one launch of the prefill kernel


def test_a_burst_through_the_prefill_kernel_in_the_triton_interpreter_gives_the_same_tokens(ckpt: Path) -> None:
    from tests.engine.exec.triton_interpreter import run_in_interpreter

    run_in_interpreter("tests.engine.test_engine_burst", "kernel_burst_check", str(ckpt))


def test_chunks_are_grouped_by_length_bucket_within_the_token_cap() -> None:
    from engine.exec.chunk_rows import chunk_groups
    from engine.step import PrefillChunk

    def chunk(name: str, tokens: int) -> PrefillChunk:
        return PrefillChunk(request=name, slot=0, start=0, end=tokens, is_last=True)  # type: ignore[arg-type]

    plan = [chunk("a", 64), chunk("b", 20), chunk("c", 60), chunk("d", 33), chunk("e", 64), chunk("f", 17)]
    bucket = lambda n: pow2_bucket(n, MIN_CHUNK_TOKENS)  # noqa: E731
    names = [[c.request for c in g] for g in chunk_groups(plan, bucket)]
    assert names == [["a", "c", "d", "e"], ["b", "f"]]
    capped = [[c.request for c in g] for g in chunk_groups(plan, bucket, max_tokens=128)]
    assert capped == [["a", "c"], ["b", "f"], ["d", "e"]]  # at most two 64-token rows a forward
    assert [[c.request for c in g] for g in chunk_groups(plan, bucket, max_tokens=1)] == [[n] for n in "abcdef"]
