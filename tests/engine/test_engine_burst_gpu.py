"""A burst of prompts on the GPU (skipped without CUDA): several prompts' chunks as rows of one forward through
the paged prefill kernel, with graphs, chunks beside the steps and KV by use on, give each prompt the greedy
tokens it gets alone (fp32: the kernels' exact dots)."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
BURST = random_prompts(24, seed=522, lengths=(40, 700))


def _engine(ckpt, **kw) -> Engine:
    base = dict(model=str(ckpt), device="cuda:0", dtype="float32", context=2048, prefill_chunk_tokens=256,
                step_token_budget=2048, kv_pool="by-use")
    base.update(kw)
    return Engine(EngineConfig(**base), EventBus(history=100000), tier_budget_mib=0.0, block_tokens=64)


@pytest.mark.parametrize("kv,mtp", [("bf16", False), ("int8", False), ("bf16", True)])
def test_gpu_a_burst_in_shared_forwards_gives_the_tokens_of_one_prompt_at_a_time(ckpt, kv, mtp, monkeypatch):
    from engine.exec import chunk_rows

    alone = tokens_of(run_all(_engine(ckpt, kv=kv, batch=1, batch_mtp=mtp, mtp_depth=2), BURST, GREEDY))
    engine = _engine(ckpt, kv=kv, batch=len(BURST), batch_mtp=mtp, mtp_depth=2)
    rows: list[int] = []
    real = chunk_rows.prefill_rows

    def counted(runner, shared):
        rows.append(len(shared))
        return real(runner, shared)

    monkeypatch.setattr(chunk_rows, "prefill_rows", counted)
    assert tokens_of(run_all(engine, BURST, GREEDY)) == alone
    assert rows and max(rows) >= 4, rows
    assert engine.health().ready
