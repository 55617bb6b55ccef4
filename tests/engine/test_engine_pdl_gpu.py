"""Programmatic dependent launch (engine.model.pdl) on the GPU: the decode step's Triton kernels launched with PDL
give the tokens of the same engine without it, bit for bit (every kernel waits before it reads or writes, so the
arithmetic and its order are unchanged), in bf16 with the fused ops, under CUDA graphs, with MTP too."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.model import pdl
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu


def _tokens(ckpt, monkeypatch, on: bool, **kw):
    monkeypatch.setenv("STRATA_PDL", "1" if on else "0")
    engine = Engine(EngineConfig(model=str(ckpt), device="cuda:0", dtype="bfloat16", batch=6, context=2048, **kw),
                    EventBus(), block_tokens=16)
    try:
        assert bool(pdl.launch_kwargs()) == (on and torch.cuda.get_device_capability() >= (9, 0))
        prompts = random_prompts(6, seed=17, lengths=(20, 200))
        return tokens_of(run_all(engine, prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)))
    finally:
        engine.close()


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_gpu_pdl_gives_the_tokens_of_the_engine_without_it(ckpt, monkeypatch, mtp):
    extra = dict(batch_mtp=True, mtp_depth=2) if mtp else {}
    assert _tokens(ckpt, monkeypatch, True, **extra) == _tokens(ckpt, monkeypatch, False, **extra)
