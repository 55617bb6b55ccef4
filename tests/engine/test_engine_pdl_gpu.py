"""Launch options that must not change a result, on the GPU: programmatic dependent launch (engine.model.pdl) and the
skinny matmul's L2 prefetch of the weights ahead (engine.model.l2_prefetch). With either on, the decode step gives
the tokens of the same engine without it, bit for bit (every kernel waits before it reads or writes, so the
arithmetic and its order are unchanged; a prefetch is a cache hint), in bf16 with the fused ops, under CUDA graphs,
with MTP too."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.model import l2_prefetch, pdl
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu


def _pdl_on(engine) -> bool:
    return bool(pdl.launch_kwargs())


def _prefetch_planned(engine) -> bool:
    """Every layer's o asks L2 for its MLP's weights, every down but the last for the next layer's attention."""
    layers = engine.lm.model.layers
    planned = [bool(layer.self_attn.prefetch) and bool(layer.mlp.prefetch) for layer in layers[:-1]]
    assert len(set(planned)) == 1 and bool(layers[-1].self_attn.prefetch) == planned[0], planned
    return planned[0] and l2_prefetch.plan_bytes() > 0


SWITCHES = {"STRATA_PDL": _pdl_on, "STRATA_L2_PREFETCH": _prefetch_planned}


def _tokens(ckpt, monkeypatch, env: str, on: bool, **kw):
    monkeypatch.setenv(env, "1" if on else "0")
    engine = Engine(EngineConfig(model=str(ckpt), device="cuda:0", dtype="bfloat16", batch=6, context=2048, **kw),
                    EventBus(), block_tokens=16)
    try:
        assert SWITCHES[env](engine) == (on and torch.cuda.get_device_capability() >= (9, 0))
        prompts = random_prompts(6, seed=17, lengths=(20, 200))
        return tokens_of(run_all(engine, prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)))
    finally:
        engine.close()


@pytest.mark.parametrize("env", list(SWITCHES))
@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_gpu_the_launch_option_gives_the_tokens_of_the_engine_without_it(ckpt, monkeypatch, mtp, env):
    extra = dict(batch_mtp=True, mtp_depth=2) if mtp else {}
    assert _tokens(ckpt, monkeypatch, env, True, **extra) == _tokens(ckpt, monkeypatch, env, False, **extra)
