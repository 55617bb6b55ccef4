"""L2 prefetch of the weights ahead (engine.model.l2_prefetch) on the GPU: the skinny matmul's launches ask L2 for
the next products' weights, and the engine gives the tokens of the same engine without it, bit for bit (a prefetch
is a cache hint: it reads nothing the step writes and changes no arithmetic), under CUDA graphs, with MTP too."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.model import l2_prefetch
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu


def _tokens(ckpt, monkeypatch, on: bool, **kw):
    monkeypatch.setenv("STRATA_L2_PREFETCH", "1" if on else "0")
    engine = Engine(EngineConfig(model=str(ckpt), device="cuda:0", dtype="bfloat16", batch=6, context=2048, **kw),
                    EventBus(), block_tokens=16)
    try:
        layers = engine.lm.model.layers
        planned = [len(layer.self_attn.prefetch) + len(layer.mlp.prefetch) for layer in layers]
        if on and torch.cuda.get_device_capability() >= (9, 0):
            # every layer's o asks for its MLP's weights, every down but the last for the next layer's attention
            assert all(planned[:-1]) and len(layers[-1].self_attn.prefetch) > 0, planned
        else:
            assert not any(planned), planned
        prompts = random_prompts(6, seed=17, lengths=(20, 200))
        return tokens_of(run_all(engine, prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)))
    finally:
        engine.close()


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_gpu_l2_prefetch_gives_the_tokens_of_the_engine_without_it(ckpt, monkeypatch, mtp):
    extra = dict(batch_mtp=True, mtp_depth=2) if mtp else {}
    assert _tokens(ckpt, monkeypatch, True, **extra) == _tokens(ckpt, monkeypatch, False, **extra)
    assert l2_prefetch.plan_bytes() == 0  # the last engine ran with it off
