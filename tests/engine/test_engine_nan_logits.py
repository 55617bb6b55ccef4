"""A checkpoint that produces NaN logits is answered with the documented error on every path that reads tokens,
and the engine serves on: the real engine on CPU over a real model one of whose weights is made NaN.

The weight is one token's row of the (untied) embedding: a sequence that holds that token has NaN hidden states
from there on (attention spreads it to every later position), one that never holds it is untouched. So a request
whose greedy output reaches the token meets NaN logits in its next step, on whichever path decodes it (plain
decode, a decode step launched ahead, MTP's fused step, verify + sample), a prompt that holds it meets them in its
first token's forward, and a request beside them, and one after them, must get the tokens of a clean run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from engine.api import SamplingParams
from engine.exec.sampler import NO_TOKEN
from tests.engine.engine_helpers import lively_checkpoint, make_engine, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ERROR = "non-finite logits"
PROMPTS = random_prompts(8, seed=390, lengths=(8, 30))
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # untied: a NaN embedding row must not also be a NaN row of the output head (every logit vector)
    return lively_checkpoint(tmp_path_factory.mktemp("nan"), seed=5, tie_word_embeddings=False)


def _poison(engine, token: int) -> None:
    with torch.no_grad():
        engine.lm.model.embed_tokens.weight[token] = float("nan")


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 500) -> dict[str, dict]:
    """Add the requests, step until idle: per request its tokens, finish reason and error."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, dict] = {rid: {"tokens": [], "reason": None, "error": None} for rid in requests}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for out in engine.step():
            row = got[out.request_id]
            row["tokens"] += out.token_ids
            if out.finished:
                row["reason"], row["error"] = out.finish_reason, out.error
    assert not engine.has_work
    return got


def _pick_poison(clean: dict[str, dict], requests: dict, victim: str) -> tuple[int, int]:
    """A token the victim emits (its index in the victim's output) that no other request's prompt or output,
    nor the victim's prompt or earlier output, holds; past the first token, so the victim decodes before it."""
    others = {t for rid, row in clean.items() if rid != victim for t in row["tokens"] + requests[rid][0]}
    out = clean[victim]["tokens"]
    for k in range(1, len(out) - 4):
        token = out[k]
        if token not in others and token not in requests[victim][0] and token not in out[:k]:
            return token, k
    pytest.skip("no token of the victim's output is its own: pick other prompts")


PATHS: dict[str, tuple[dict, SamplingParams, bool]] = {
    # name: (engine options, the victim's sampling, fused MTP step forced on as on CUDA)
    "plain decode": ({"decode_ahead": "off"}, GREEDY, False),
    "decode ahead": ({"decode_ahead": "on"}, GREEDY, False),
    "fused greedy mtp": ({"decode_ahead": "off", "batch_mtp": True, "mtp_depth": 2}, GREEDY, True),
    "fused greedy mtp ahead": ({"decode_ahead": "on", "batch_mtp": True, "mtp_depth": 2}, GREEDY, True),
    "fused sampled mtp": ({"decode_ahead": "off", "batch_mtp": True, "mtp_depth": 2}, SAMPLED, True),
    "verify + sample": ({"decode_ahead": "off", "batch_mtp": True, "mtp_depth": 2}, SAMPLED, False),
}


def _engine(untied: Path, options: dict, fused: bool):
    engine = make_engine(untied, **options)
    if fused:
        engine.drafter.fused = True  # the CUDA default, forced on the CPU backend
    return engine


def _spy(obj, name: str, seen: list) -> None:
    """Record what `obj.name` returns (the real method runs)."""
    real = getattr(obj, name)

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(result)
        return result

    setattr(obj, name, wrapped)


def _flagged_reads(engine, path: str) -> Callable[[], bool]:
    """Whether the path under test read a flagged row (its tokens read without the host sampler)."""
    seen: list = []
    if path == "decode ahead":
        _spy(engine.ahead, "read_and_launch", seen)
        return lambda: any(NO_TOKEN in toks for tokens in seen for toks in tokens)
    if path == "fused greedy mtp ahead":
        _spy(engine.ahead, "read_and_launch_verify", seen)
        return lambda: any(NO_TOKEN in toks for result in seen for toks in result.tokens)
    if path.startswith("fused"):
        _spy(engine.drafter, "verify_and_draft", seen)
        return lambda: any(bool((step.emitted[:, 1:] == NO_TOKEN).any()) for step in seen)
    return lambda: True  # the host sampler's check (sample_isolating_rows), covered by its own tests too


@pytest.mark.parametrize("path", list(PATHS))
def test_nan_logits_in_a_step_end_that_request_with_the_error_and_the_engine_serves_on(untied, path):
    options, victim_params, fused = PATHS[path]
    # a step goes ahead only when every decoding row is greedy
    beside_params = GREEDY if path.endswith("ahead") else SAMPLED
    requests = {"victim": (PROMPTS[0], victim_params), "beside": (PROMPTS[1], GREEDY),
                "beside_sampled": (PROMPTS[2], beside_params)}
    clean = _run(_engine(untied, options, fused), requests)
    after = {"after": (PROMPTS[3], GREEDY), "after_sampled": (PROMPTS[4], SAMPLED)}
    clean_after = _run(_engine(untied, options, fused), after)
    token, k = _pick_poison({**clean, **clean_after}, {**requests, **after}, "victim")

    engine = _engine(untied, options, fused)
    flagged = _flagged_reads(engine, path)
    _poison(engine, token)
    got = _run(engine, requests)

    victim = got["victim"]
    assert victim["reason"] == "error" and ERROR in (victim["error"] or ""), victim
    # the tokens before the broken step are the clean run's (a step whose logits are not all finite emits none)
    assert victim["tokens"] == clean["victim"]["tokens"][:len(victim["tokens"])], (victim, clean["victim"])
    assert 1 <= len(victim["tokens"]) <= k + 1 and NO_TOKEN not in victim["tokens"]
    assert flagged(), f"the {path} path did not read the flagged row"
    for rid in ("beside", "beside_sampled"):
        assert got[rid] == clean[rid], (rid, got[rid], clean[rid])
    # the engine serves on, and what the broken request left in its slot's blocks reaches no later request
    assert engine.health().ready
    assert _run(engine, after) == clean_after


@pytest.mark.parametrize("mtp", [False, True])
def test_nan_logits_in_a_prompts_first_forward_end_that_request_only(untied, mtp):
    options = {"batch_mtp": True, "mtp_depth": 2} if mtp else {}
    requests = {"beside": (PROMPTS[5], GREEDY), "beside_sampled": (PROMPTS[6], SAMPLED)}
    clean = _run(make_engine(untied, **options), requests)
    seen = {t for row in clean.values() for t in row["tokens"]} | {t for p, _ in requests.values() for t in p}
    token = next(t for t in PROMPTS[7] if t not in seen)
    # the token first, in a prompt longer than any that follows: NaN keys and values from its first position on
    victim_prompt = [token] + [t for t in PROMPTS[7] + PROMPTS[6] + PROMPTS[5] if t != token]
    engine = make_engine(untied, **options)
    _poison(engine, token)
    got = _run(engine, {**requests, "victim": (victim_prompt, GREEDY), "victim_logprobs": (
        victim_prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))})
    for rid in ("victim", "victim_logprobs"):
        assert got[rid]["tokens"] == [] and got[rid]["reason"] == "error" and ERROR in got[rid]["error"], got[rid]
    for rid in requests:
        assert got[rid] == clean[rid], (rid, got[rid], clean[rid])
    assert engine.health().ready
    # the slots the prompts' NaN keys and values were written to serve later requests as a clean engine does
    after = {f"after{i}": (prompt[:8], GREEDY) for i, prompt in enumerate(PROMPTS[:4]) if token not in prompt[:8]}
    assert _run(engine, after) == _run(make_engine(untied, **options), after)


GPU_PATHS = {  # on CUDA with graphs the defaults take these: the steps' finite checks run inside captured graphs
    "decode ahead": {},
    "fused greedy mtp ahead": {"batch_mtp": True, "mtp_depth": 2},
}


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(GPU_PATHS))
def test_gpu_graph_captured_steps_flag_nan_logits_and_the_engine_serves_on(untied, path):
    from engine.config import EngineConfig
    from engine.orchestration.engine import Engine
    from engine.telemetry import EventBus

    def engine():
        config = EngineConfig(model=str(untied), device="cuda:0", dtype="float32", batch=4, context=1024,
                              graphs=True, prefill_chunk_tokens=64, step_token_budget=128, **GPU_PATHS[path])
        built = Engine(config, EventBus(), block_tokens=16)
        assert type(built.graphs).__name__ == "GraphCache" and built.ahead.enabled
        assert not path.startswith("fused") or built.drafter.fused
        return built

    requests = {"victim": (PROMPTS[0], GREEDY), "beside": (PROMPTS[1], GREEDY), "beside_2": (PROMPTS[2], GREEDY)}
    after = {"after": (PROMPTS[3], GREEDY), "after_sampled": (PROMPTS[4], SAMPLED)}
    clean, clean_after = _run(engine(), requests), _run(engine(), after)
    token, k = _pick_poison({**clean, **clean_after}, {**requests, **after}, "victim")
    poisoned = engine()
    flagged = _flagged_reads(poisoned, path)
    _poison(poisoned, token)
    got = _run(poisoned, requests)
    victim = got["victim"]
    assert victim["reason"] == "error" and ERROR in (victim["error"] or ""), victim
    assert victim["tokens"] == clean["victim"]["tokens"][:len(victim["tokens"])] and len(victim["tokens"]) <= k + 1
    assert flagged(), f"the {path} path did not read the flagged row"
    assert got["beside"] == clean["beside"] and got["beside_2"] == clean["beside_2"]
    assert poisoned.health().ready
    assert _run(poisoned, after) == clean_after
