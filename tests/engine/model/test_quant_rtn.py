"""Round-to-nearest quantization (`--quantize`, `strata-engine quantize`): the quality bound on the embedded
model, and the written checkpoint read back by compressed-tensors' own decompressors and by our loader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.model.loader import MODELS_DIR, load_checkpoint
from engine.model.quant.linear import Fp8Linear, IntGroupLinear, QuantLinear
from engine.model.random_checkpoint import write_random_checkpoint

WINDOW_TOKENS = 1024


@pytest.fixture(scope="module")
def heldout_ids():
    lm = load_checkpoint("builtin:strata-tiny", dtype="float32", device="cpu")
    ids = lm.tokenizer.encode((MODELS_DIR / "strata-tiny" / "heldout_sample.txt").read_text())
    windows = len(ids) // WINDOW_TOKENS
    return torch.tensor(ids[:windows * WINDOW_TOKENS]).view(windows, WINDOW_TOKENS), lm


def _loss_and_top1(lm, ids):
    pos = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
    with torch.no_grad():
        logits = lm.model.logits(lm.model(ids[:, :-1], pos))
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    return loss, logits.argmax(-1)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, max_loss_delta, min_top1", [("fp8", 0.005, 0.97), ("fp8-block", 0.005, 0.97),
                                                          ("int4", 0.03, 0.88)])
def test_the_embedded_model_quantized_stays_within_the_quality_bound(fmt, max_loss_delta, min_top1, heldout_ids):
    ids, base = heldout_ids
    base_loss, base_top1 = _loss_and_top1(base, ids)
    lm = load_checkpoint("builtin:strata-tiny", dtype="float32", device="cpu", quantize=fmt)
    assert sum(isinstance(m, QuantLinear) for m in lm.model.modules()) == 8 * 7 + 7  # main layers + MTP block
    loss, top1 = _loss_and_top1(lm, ids)
    delta = (loss - base_loss) / base_loss
    agreement = (top1 == base_top1).float().mean().item()
    print(f"{fmt}: held-out loss {base_loss:.4f} -> {loss:.4f} ({delta:+.2%}), top-1 agreement {agreement:.4f}")
    assert delta <= max_loss_delta and agreement >= min_top1, (delta, agreement)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    # bf16, as `strata-engine quantize` loads it: --quantize at an fp32 load then starts from the same values
    write_random_checkpoint(path, mtp_layout="deepseek", dtype="bfloat16", hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return path


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantize_writes_a_compressed_tensors_checkpoint_that_loads_to_the_same_model(fmt, source, tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    out = tmp_path / "q"
    done = _cli("quantize", "--model", str(source), "--format", fmt, "--out", str(out), "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: {fmt}")
    config = json.loads((out / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()
    # compressed-tensors itself reads the config and decompresses the tensors
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(config["quantization_config"])
    scheme = qc.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    tensors = load_file(str(out / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"
    state = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    decompressed = compressor.decompress(state, scheme)["weight"].to(torch.float32)

    at_load = load_checkpoint(source, dtype="float32", device="cpu", quantize=fmt)
    from_file = load_checkpoint(out, dtype="float32", device="cpu")
    layer = from_file.model.layers[1].mlp.down_proj
    assert isinstance(layer, Fp8Linear if fmt == "fp8" else IntGroupLinear)
    torch.testing.assert_close(decompressed, layer.dequantize(), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(layer.dequantize(), at_load.model.layers[1].mlp.down_proj.dequantize(),
                               rtol=1e-3, atol=1e-6)
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    pos = torch.arange(5)[None]
    with torch.no_grad():
        a = at_load.model.logits(at_load.model(ids, pos))
        b = from_file.model.logits(from_file.model(ids, pos))
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)  # the file keeps int4 scales in fp16
    assert from_file.weight_format.startswith("compressed-tensors")


def test_int4_keeps_a_projection_of_inputs_not_a_multiple_of_8_as_loaded_and_a_file_of_it_is_refused_by_name(
        tmp_path):
    """An MLP of 60 (`--quantize int4` refused the whole model: 4-bit codes fill whole 32-bit words): its down
    projections stay in 16 bits, the weight format says so, and the model generates. `strata-engine quantize`
    cannot write its up projections (compressed-tensors packs 4-bit zero points 8 to a word along the 60 outputs):
    one line naming the layer, exit 2, nothing written (it was a RuntimeError about a shape)."""
    src = write_random_checkpoint(tmp_path / "src", dtype="bfloat16", intermediate_size=60)
    at_load = load_checkpoint(src, dtype="float32", device="cpu", quantize="int4")
    assert type(at_load.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(at_load.model.layers[0].mlp.up_proj, IntGroupLinear)
    assert "as loaded" in at_load.weight_format, at_load.weight_format
    ids, pos = torch.tensor([[5, 9, 200, 31, 7]]), torch.arange(5)[None]
    with torch.no_grad():
        assert torch.isfinite(at_load.model.logits(at_load.model(ids, pos))).all()
    out = tmp_path / "q"
    done = _cli("quantize", "--model", str(src), "--format", "int4", "--out", str(out), "--device", "cpu")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "model.layers.0.mlp.gate_proj has 60 outputs" in done.stderr and not (out / "config.json").exists()


def test_quantize_fp8_block_writes_qwens_fp8_layout_that_loads_to_the_same_model(source, tmp_path):
    out = tmp_path / "q"
    done = _cli("quantize", "--model", str(source), "--format", "fp8-block", "--out", str(out), "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    tensors = load_file(str(out / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"  # [128, 256]: blocks of 128 x 128
    assert tensors[f"{prefix}.weight"].dtype == torch.float8_e4m3fn
    assert tuple(tensors[f"{prefix}.weight_scale_inv"].shape) == (1, 2)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings (and head) stay in 16 bits
    at_load = load_checkpoint(source, dtype="float32", device="cpu", quantize="fp8-block")
    from_file = load_checkpoint(out, dtype="float32", device="cpu")
    assert from_file.weight_format == "fp8 (block 128x128)"
    layer = from_file.model.layers[1].mlp.down_proj
    assert isinstance(layer, Fp8Linear) and (layer.block_n, layer.block_k) == (128, 128)
    # the block's scale is its amax over 448: the largest code of each block is 448
    w = at_load.model.layers[1].mlp.down_proj.weight.to(torch.float32)
    assert w[:, :128].abs().max().item() == 448.0 and w[:, 128:].abs().max().item() == 448.0
    torch.testing.assert_close(layer.dequantize(), at_load.model.layers[1].mlp.down_proj.dequantize())
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    pos = torch.arange(5)[None]
    with torch.no_grad():
        a = at_load.model.logits(at_load.model(ids, pos))
        b = from_file.model.logits(from_file.model(ids, pos))
    torch.testing.assert_close(a, b)


def test_quantize_refuses_a_quantized_checkpoint_and_an_occupied_directory(source, tmp_path):
    out = tmp_path / "q"
    assert _cli("quantize", "--model", str(source), "--format", "int4", "--out", str(out), "--device", "cpu").returncode == 0
    again = _cli("quantize", "--model", str(out), "--format", "fp8", "--out", str(tmp_path / "r"), "--device", "cpu")
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "already quantized" in again.stderr
    occupied = _cli("quantize", "--model", str(source), "--format", "fp8", "--out", str(out), "--device", "cpu")
    assert occupied.returncode == 2 and "already holds a checkpoint" in occupied.stderr


def test_the_quantize_option_is_validated_with_the_others():
    from engine.config import EngineConfig
    from engine.errors import ConfigError

    assert EngineConfig(quantize="int4").to_argv()[-2:] == ["--quantize", "int4"]
    with pytest.raises(ConfigError, match="quantize='int3'"):
        EngineConfig(quantize="int3")


def test_moe_experts_quantize_and_run_in_the_reference_path_and_the_expert_cache(tmp_path):
    from engine.model.moe import SparseMoE, sparse_blocks
    from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of
    from engine.api import SamplingParams

    src = tmp_path / "moe"
    write_random_checkpoint(src, size="moe-tiny")
    lm = load_checkpoint(src, dtype="float32", device="cpu", quantize="int4")
    block = sparse_blocks(lm.model)[0]
    assert isinstance(block, SparseMoE) and isinstance(block.experts[3].down_proj, IntGroupLinear)
    assert not isinstance(block.gate, QuantLinear)  # the router stays in the model's dtype
    # the reference path computes each routed expert from its dequantized weights
    gate_up, down = block.expert_weights(3)
    torch.testing.assert_close(down, block.experts[3].down_proj.dequantize())
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        reference = lm.model.logits(lm.model(ids, torch.arange(6)[None]))
    assert torch.isfinite(reference).all()
    # the engine's expert cache (a budget holding some experts per layer) gives the reference path's tokens
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=3, lengths=(4, 30))
    outs = []
    for budget in (None, 1):
        engine = make_engine(src, batch=3, quantize="int4", expert_cache_mib=budget)
        try:
            outs.append(tokens_of(run_all(engine, prompts, params)))
            assert engine.state().to_json()["vram"][0]["weight_format"].startswith("int4")
        finally:
            engine.close()
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_the_fp8_head_keeps_the_logits_of_the_unquantized_one(heldout_ids):
    """--quantize-head: the embedded model's held-out loss and top-1 tokens with its (tied) head in FP8, against
    the same model's own head; the embedding table it is tied to stays as loaded."""
    from engine.model.quant.rtn import quantize_head

    ids, base = heldout_ids
    base_loss, base_top1 = _loss_and_top1(base, ids)
    lm = load_checkpoint("builtin:strata-tiny", dtype="float32", device="cpu")
    embedding = lm.model.embed_tokens.weight.clone()
    assert quantize_head(lm.model) == "fp8 head" and isinstance(lm.model.lm_head, Fp8Linear)
    assert torch.equal(lm.model.embed_tokens.weight, embedding)
    loss, top1 = _loss_and_top1(lm, ids)
    delta = (loss - base_loss) / base_loss
    agreement = (top1 == base_top1).float().mean().item()
    print(f"fp8 head: held-out loss {base_loss:.4f} -> {loss:.4f} ({delta:+.2%}), top-1 agreement {agreement:.4f}")
    assert abs(delta) <= 0.005 and agreement >= 0.97, (delta, agreement)
    hidden = base.model(ids[:1, :64], torch.arange(64)[None])
    ref, got = base.model.logits(hidden), lm.model.logits(hidden)
    assert (got - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def test_quantize_head_is_an_engine_option_whose_head_decodes(tmp_path):
    from engine.api import SamplingParams
    from engine.config import EngineConfig
    from engine.orchestration.engine import Engine
    from engine.telemetry import EventBus

    engine = Engine(EngineConfig(model="builtin:strata-tiny", device="cpu", batch=1, context=256,
                                 quantize_head=True), EventBus(history=1000))
    try:
        assert isinstance(engine.lm.model.lm_head, Fp8Linear) and "fp8 head" in engine.lm.weight_format
        req = engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while not req.is_finished:
            engine.step()
        assert req.num_output_tokens == 4
    finally:
        engine.close()
