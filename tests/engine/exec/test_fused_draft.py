"""The fused greedy MTP step (kind verify_draft: verify, greedy acceptance and the next drafts in one step
function, MtpDrafter.verify_and_draft) gives exactly what the separate verify + sampler + draft_round path
gives: the same tokens, the same accepted counts per draft position; and it fails like any drafting step:
a graph that cannot be had turns MTP off (or degrades the switch to blame) and no request is lost.

On CUDA with graphs the fused step is the default for all-greedy batches; here it is forced on CPU."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.exec.drafter import FUSED_KIND
from engine.exec.step_fns import GraphDegraded
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of
from tests.engine.test_engine_faults import OOM, FailingExecutor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(8, seed=91, lengths=(4, 100))
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _run(ckpt, fused: bool, batch: int, depth: int, executor=None, switches=None, bus=None):
    engine = make_engine(ckpt, bus=bus or EventBus(history=50000), batch=batch, batch_mtp=True,
                         mtp_depth=depth, executor=executor, switches=switches or {})
    engine.drafter.fused = fused
    reqs = {}
    orig_add = engine.add_request

    def add(rid, prompt, params):
        reqs[rid] = orig_add(rid, prompt, params)
        return reqs[rid]

    engine.add_request = add
    outputs = run_all(engine, PROMPTS, GREEDY)
    drafts = {rid: (list(r.draft_proposed), list(r.draft_accepted)) for rid, r in reqs.items()}
    return engine, tokens_of(outputs), drafts


@pytest.mark.parametrize("batch,depth", [(1, 1), (3, 2), (6, 3)])
def test_fused_greedy_step_equals_the_separate_path(ckpt, batch, depth):
    plain_engine, plain_tokens, plain_drafts = _run(ckpt, False, batch, depth)
    executor = FailingExecutor(lambda kind, key: False, nth=0, error=None)  # records the kinds that ran
    engine, tokens, drafts = _run(ckpt, True, batch, depth, executor=executor)
    assert engine.mtp_on and plain_engine.mtp_on
    assert tokens == plain_tokens
    assert drafts == plain_drafts  # same drafts proposed and accepted, position by position
    assert sum(a[0] for _, a in drafts.values()) > 0  # drafts were really accepted along the way
    kinds = {kind for kind, _ in executor.seen}
    assert FUSED_KIND in kinds and "draft_round" not in kinds and "verify" not in kinds


def _run_mixed(ckpt, fused: bool, executor=None):
    """Three rows: greedy, sampled, sampled with top-p, each seeded: the same draws on either path."""
    engine = make_engine(ckpt, batch=3, batch_mtp=True, mtp_depth=2, executor=executor)
    engine.drafter.fused = fused
    kinds = [GREEDY,
             SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True)]
    reqs = [engine.add_request(f"m{i}", PROMPTS[i], p) for i, p in enumerate(kinds)]
    while engine.has_work:
        engine.step()
    return ([list(r.output_token_ids) for r in reqs],
            [(list(r.draft_proposed), list(r.draft_accepted)) for r in reqs])


def test_sampled_rows_take_the_fused_step_with_the_same_draws(ckpt):
    plain_tokens, plain_drafts = _run_mixed(ckpt, fused=False)
    executor = FailingExecutor(lambda kind, key: False, nth=0, error=None)
    tokens, drafts = _run_mixed(ckpt, fused=True, executor=executor)
    assert tokens == plain_tokens  # seeded rejection sampling on the device = the same on the host path
    assert drafts == plain_drafts
    fused_keys = [key for kind, key in executor.seen if kind == FUSED_KIND]
    assert fused_keys and any("top_p" in key.shape for key in fused_keys)  # the batch holds a top-p row
    assert not {"verify", "draft_round"} & {kind for kind, _ in executor.seen}


def test_fused_step_failure_turns_drafting_off_and_no_request_is_lost(ckpt):
    _, reference, _ = _run(ckpt, False, 3, 2)
    bus = EventBus(history=50000)
    executor = FailingExecutor(lambda kind, key: kind == FUSED_KIND, nth=2,
                               error=lambda kind, key: GraphDegraded(kind, key, None, OOM))
    engine, tokens, _ = _run(ckpt, True, 3, 2, executor=executor, bus=bus)
    assert executor.raised == 1
    assert tokens == reference
    assert not engine.mtp_on and "out of memory" in engine.mtp_off_reason
    assert any("MTP drafting turned off" in e.message and "out of memory" in e.message
               for e in bus.history() if e.type == "warning")
    assert FUSED_KIND not in [kind for kind, _ in executor.seen[-6:]]
    assert engine.health().ready


def test_fused_step_degrades_split_attn_and_keeps_drafting(ckpt):
    _, reference, _ = _run(ckpt, False, 3, 2)
    executor = FailingExecutor(lambda kind, key: kind == FUSED_KIND and key.depends_on("SPLIT_ATTN"), nth=2,
                               error=lambda kind, key: GraphDegraded(kind, key, "SPLIT_ATTN", OOM))
    engine, tokens, _ = _run(ckpt, True, 3, 2, executor=executor, switches={"SPLIT_ATTN": True})
    assert executor.raised == 1 and tokens == reference
    state = engine.board.states["SPLIT_ATTN"]
    assert state.degraded and "out of memory" in state.reason
    assert engine.mtp_on
