"""`--model random:SIZE`: weights drawn on the device at load (seeded, no checkpoint), any --quantize after."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.model.random_source import load_random, source_dir
from engine.model.quant.linear import QuantLinear
from engine.model.random_checkpoint import SIZES


@pytest.fixture(autouse=True)
def _sources_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_RANDOM_SOURCES", str(tmp_path / "sources"))


def _logits(lm) -> torch.Tensor:
    ids = torch.tensor([[5, 9, 2, 77]])
    with torch.no_grad():
        return lm.model.logits(lm.model(ids, torch.arange(4)[None]))


def test_a_random_source_is_the_sizes_shape_and_the_same_model_at_every_load():
    a, b = load_random("random:tiny+mtp", dtype="float32", device="cpu"), load_random("random:tiny+mtp")
    assert a.config.hidden_size == SIZES["tiny"]["hidden_size"] and a.model.mtp is not None
    assert a.weight_format == "fp32" and a.tokenizer is not None and a.eos_token_ids
    assert torch.equal(_logits(a), _logits(b))
    # nothing but the config and tokenizer is written
    directory = source_dir("random:tiny+mtp")
    assert directory == a.path and not list(directory.glob("*.safetensors"))
    assert {p.name for p in directory.iterdir()} >= {"config.json", "tokenizer.json"}
    norm = a.model.layers[0].input_layernorm.weight
    assert 0.5 < norm.mean().item() < 1.5 and norm.std().item() > 0.01  # norms near 1, weights near 0.02
    assert abs(a.model.layers[0].mlp.down_proj.weight.std().item() - 0.02) < 0.002


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_random_source_quantizes_at_load_close_to_its_16_bit_self(fmt):
    base = load_random("random:tiny", dtype="float32", device="cpu")
    lm = load_random("random:tiny", dtype="float32", device="cpu", quantize=fmt)
    assert lm.weight_format.startswith(fmt) and any(isinstance(m, QuantLinear) for m in lm.model.modules())
    ref, got = _logits(base), _logits(lm)
    assert (ref - got).abs().max() <= 0.2 * ref.abs().max() and not torch.equal(ref, got)


def test_the_engine_starts_on_a_random_source_and_an_unknown_size_is_one_line():
    ok = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "random:moe-tiny", "--prompt",
                         "hi", "--max-tokens", "3", "--quantize", "int4", "--device", "cpu"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "[3 tokens" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "random:7b", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "model='random:7b': unknown random size" in bad.stderr


def test_the_benchmarks_leave_the_8b_shape_to_the_engine():
    from engine.bench.common import prepare_model

    assert prepare_model("random:8b", torch.device("cpu")) == "random:8b"  # returns at once: nothing written
