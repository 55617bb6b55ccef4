"""GGUF files written by the `gguf` package load into Strata: the weights are the ones gguf's own dequantize
reads, the logits match the source checkpoint's within the quantization's error, the tokenizer and chat template
come from the file; an unsupported tensor type or a corrupt file is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from engine.errors import CheckpointError  # noqa: E402
from engine.model.loader import MODELS_DIR, load_checkpoint  # noqa: E402
from engine.model.quant.linear import IntGroupLinear  # noqa: E402
from engine.model.random_checkpoint import write_random_checkpoint  # noqa: E402
from tests.engine.model.gguf_files import gguf_tensor_name, write_gguf  # noqa: E402

TINY = MODELS_DIR / "strata-tiny"


def _mixed(name: str, shape) -> T:
    """A Q4_K_M-like mix: K-quants where the row length allows (256 a block), the 32-block types elsewhere."""
    k = shape[1]
    if name == "token_embd.weight":
        return T.Q8_0
    if k % 256 == 0:
        return T.Q6_K if "ffn_down" in name or "attn_v" in name else T.Q4_K
    return {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0}.get(name.split(".")[2], T.Q4_0)


def _logits(lm, ids):
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return lm.model.logits(lm.model(ids, pos))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "strata-tiny.gguf"
    read_back = write_gguf(TINY, path, _mixed)
    return path, read_back


def test_strata_tiny_as_gguf_round_trips_with_its_tokenizer_and_close_logits(tiny_gguf):
    path, read_back = tiny_gguf
    lm = load_checkpoint(path, dtype="float32", device="cpu")
    source = load_checkpoint("builtin:strata-tiny", dtype="float32", device="cpu")
    # every quantized projection is the weight gguf's own dequantize reads from the file
    layers = {name: m for name, m in lm.model.named_modules() if isinstance(m, IntGroupLinear)}
    assert len(layers) == 8 * 7
    for ours, theirs in (("layers.0.self_attn.q_proj", "blk.0.attn_q.weight"),
                         ("layers.0.self_attn.k_proj", "blk.0.attn_k.weight"),
                         ("layers.3.self_attn.v_proj", "blk.3.attn_v.weight"),
                         ("layers.5.mlp.down_proj", "blk.5.ffn_down.weight")):
        torch.testing.assert_close(layers[ours].dequantize(), torch.from_numpy(read_back[theirs]),
                                   rtol=1e-3, atol=1e-5)
    assert {layers["layers.5.mlp.down_proj"].bits, layers["layers.0.self_attn.q_proj"].bits} == {8, 4}
    assert lm.weight_format.startswith("gguf ") and "Q6_K" in lm.weight_format and "Q4_0" in lm.weight_format
    text = "def parse(path):\n    with open(path) as f:\n        return f.read()\n"
    assert lm.tokenizer.encode(text) == source.tokenizer.encode(text)
    assert lm.eos_token_ids[0] in source.eos_token_ids
    chat = [{"role": "user", "content": "hi"}]
    assert lm.tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        source.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    ids = torch.tensor([source.tokenizer.encode(text * 4)])
    a, b = _logits(lm, ids), _logits(source, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.85
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item() >= 0.98


def test_every_projection_in_k_quants_reads_as_gguf_dequantizes_it(tmp_path):
    src = tmp_path / "src"
    write_random_checkpoint(src, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64)
    path = tmp_path / "k.gguf"
    read_back = write_gguf(src, path, lambda name, shape: T.Q6_K if "ffn_down" in name else T.Q4_K)
    lm = load_checkpoint(path, dtype="float32", device="cpu")
    q = lm.model.layers[1].self_attn.q_proj
    assert isinstance(q, IntGroupLinear) and (q.bits, q.group_size) == (4, 32)
    torch.testing.assert_close(q.dequantize(), torch.from_numpy(read_back["blk.1.attn_q.weight"]), rtol=1e-3, atol=1e-5)
    down = lm.model.layers[1].mlp.down_proj
    assert (down.bits, down.group_size) == (8, 16)
    torch.testing.assert_close(down.dequantize(), torch.from_numpy(read_back["blk.1.ffn_down.weight"]),
                               rtol=1e-3, atol=1e-5)


def _generate(model: str):
    return subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", model, "--prompt", "x",
                           "--max-tokens", "2", "--device", "cpu"], capture_output=True, text=True, timeout=300)


def test_an_unsupported_tensor_type_is_one_line_naming_the_tensor_and_exit_2(tmp_path):
    path = tmp_path / "q5.gguf"
    write_gguf(TINY, path, lambda name, shape: T.Q5_0 if name == "blk.2.ffn_up.weight" else T.Q8_0)
    with pytest.raises(CheckpointError, match="tensor blk.2.ffn_up.weight has type Q5_0"):
        load_checkpoint(path, dtype="float32", device="cpu")
    done = _generate(str(path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "blk.2.ffn_up.weight has type Q5_0" in done.stderr


def test_a_corrupt_gguf_file_is_one_line_and_exit_2(tmp_path, tiny_gguf):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf[0].read_bytes()[:5000])
    done = _generate(str(path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert str(path) in done.stderr


def _moe_types(name: str, shape) -> T:
    """Qwen3-MoE as a Q4_K_M-like file: experts' gate Q4_K, up Q8_0, down Q6_K; the router F32."""
    if "ffn_gate_inp" in name:
        return T.F32
    kind = name.split(".")[-2]
    return {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q8_0, "ffn_down_exps": T.Q6_K}.get(kind, T.Q8_0)


def test_a_qwen3_moe_gguf_loads_its_experts_quantized_with_the_dequantized_sources_logits(tmp_path):
    from engine.model.config import MoEConfig
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    write_random_checkpoint(src, size="moe-tiny", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64,
                            moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                                          norm_topk_prob=True, mlp_only_layers=(1,)))
    path = tmp_path / "moe.gguf"
    read_back = write_gguf(src, path, _moe_types)
    lm = load_checkpoint(path, dtype="float32", device="cpu", expert_device="cpu")
    moe = lm.config.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 256)
    assert moe.mlp_only_layers == (1,) and moe.norm_topk_prob
    block = lm.model.layers[2].mlp
    for kind, bits, group in (("gate", 4, 32), ("up", 8, 32), ("down", 8, 16)):
        stacked = torch.from_numpy(read_back[f"blk.2.ffn_{kind}_exps.weight"])
        for e in range(4):
            layer = getattr(block.experts[e], f"{kind}_proj")
            assert isinstance(layer, IntGroupLinear) and (layer.bits, layer.group_size) == (bits, group)
            torch.testing.assert_close(layer.dequantize(), stacked[e], rtol=1e-3, atol=1e-5)
    assert not isinstance(block.gate, IntGroupLinear)
    assert "Q4_K" in lm.weight_format and "Q6_K" in lm.weight_format
    # the source with every quantized weight replaced by what gguf's dequantize reads: the same logits
    tensors = load_file(str(src / "model.safetensors"))
    for name in tensors:
        if ".mlp.experts." in name:
            layer, expert, kind = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6][:-len("_proj")]
            tensors[name] = torch.from_numpy(read_back[f"blk.{layer}.ffn_{kind}_exps.weight"][expert]).contiguous()
        else:
            theirs = gguf_tensor_name(name)
            if theirs in read_back:
                tensors[name] = torch.from_numpy(read_back[theirs]).contiguous()
    save_file(tensors, str(src / "model.safetensors"))
    source = load_checkpoint(src, dtype="float32", device="cpu")
    ids = torch.tensor([[3, 17, 99, 250, 4, 8, 15, 16]])
    torch.testing.assert_close(_logits(lm, ids), _logits(source, ids), rtol=1e-4, atol=1e-4)
    # and the engine serves it (its expert cache takes the quantized experts)
    done = _generate(str(path))
    assert done.returncode == 0 and "[2 tokens" in done.stdout, done.stderr[-2000:]
