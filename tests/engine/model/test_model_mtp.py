"""MTP head: loading from the DeepSeek and Qwen3-Next layouts, concat order, save/load, chaining, training."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.model import load_checkpoint, save_checkpoint
from tests.engine.model.dense_kv import DenseKVCache

LAYOUT_NAMES = {
    # (embedding norm, hidden norm, projection, output norm, a block tensor) in each layout, L = 2 main layers
    "deepseek": ("model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
                 "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.q_proj.weight"),
    "qwen3_next": ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                   "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"),
}


def _raw(path, name: str) -> torch.Tensor:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _inputs(lm, tokens: int = 12):
    ids = torch.randint(0, lm.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(tokens)[None].expand(2, -1)
    return ids, positions


@pytest.mark.parametrize("layout", sorted(LAYOUT_NAMES))
def test_mtp_loads_layout_with_shapes(make_checkpoint, layout):
    path = make_checkpoint(mtp_layout=layout)
    lm = load_checkpoint(path, dtype="float32", device="cpu")
    config_key = "num_nextn_predict_layers" if layout == "deepseek" else "mtp_num_hidden_layers"
    assert json.loads((path / "config.json").read_text())[config_key] == 1
    assert lm.config.mtp.layout == layout and lm.model.mtp_depth_layers == 1
    layer = lm.model.mtp.layers[0]
    H = lm.config.hidden_size
    assert layer.eh_proj.weight.shape == (H, 2 * H)
    enorm, hnorm, proj, norm, q_proj = LAYOUT_NAMES[layout]
    assert torch.equal(layer.enorm.weight, _raw(path, enorm))
    assert torch.equal(layer.hnorm.weight, _raw(path, hnorm))
    assert torch.equal(layer.eh_proj.weight, _raw(path, proj))
    assert torch.equal(layer.norm.weight, _raw(path, norm))
    assert torch.equal(layer.block.self_attn.q_proj.weight, _raw(path, q_proj))
    ids, positions = _inputs(lm)
    with torch.no_grad():
        hidden = lm.model(ids, positions)
        draft = lm.model.logits(lm.model.mtp(hidden[:, :-1], ids[:, 1:], positions[:, :-1], None))
    assert draft.shape == (2, ids.shape[1] - 1, lm.config.vocab_size)


@pytest.mark.parametrize("layout", sorted(LAYOUT_NAMES))
def test_mtp_concat_order_embedding_first(make_checkpoint, layout):
    path = make_checkpoint(mtp_layout=layout)
    lm = load_checkpoint(path, dtype="float32", device="cpu")
    enorm, hnorm, *_ = LAYOUT_NAMES[layout]
    ids, positions = _inputs(lm)
    seen: list[torch.Tensor] = []
    handle = lm.model.mtp.layers[0].eh_proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        hidden = lm.model(ids, positions)
        lm.model.mtp(hidden[:, :-1], ids[:, 1:], positions[:, :-1], None)
    handle.remove()
    emb = _raw(path, "model.embed_tokens.weight")[ids[:, 1:]]
    emb_part = _rms(emb, _raw(path, enorm))
    hid_part = _rms(hidden[:, :-1], _raw(path, hnorm))
    expected, swapped = torch.cat([emb_part, hid_part], -1), torch.cat([hid_part, emb_part], -1)
    assert torch.allclose(seen[0], expected, atol=1e-5)
    assert not torch.allclose(seen[0], swapped, atol=1e-2)


@pytest.mark.parametrize("layout", sorted(LAYOUT_NAMES))
def test_mtp_save_load_identical_draft_logits(make_checkpoint, tmp_path, layout):
    lm = load_checkpoint(make_checkpoint(mtp_layout=layout), dtype="float32", device="cpu")
    save_checkpoint(lm.model, tmp_path, lm.eos_token_ids)
    again = load_checkpoint(tmp_path, dtype="float32", device="cpu", tokenizer=False)
    assert again.config == lm.config and again.eos_token_ids == lm.eos_token_ids
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert LAYOUT_NAMES[layout][2] in f.keys()
    ids, positions = _inputs(lm)
    with torch.no_grad():
        drafts = []
        for model in (lm.model, again.model):
            hidden = model(ids, positions)
            drafts.append(model.draft_logits(model.mtp(hidden[:, :-1], ids[:, 1:], positions[:, :-1], None)))
    assert torch.equal(drafts[0], drafts[1])


def test_mtp_kv_path_matches_kv_none_and_chains(tiny_checkpoint):
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu")
    model, L = lm.model, lm.config.num_hidden_layers
    ids, positions = _inputs(lm, tokens=10)
    kv = DenseKVCache.for_config(lm.config, 2, 16)
    assert kv.num_layers == L + 1 and L + model.mtp.layer_index(0) == L and L + model.mtp.layer_index(3) == L
    with torch.no_grad():
        hidden = model(ids, positions)
        reference = model.mtp(hidden[:, :-1], ids[:, 1:], positions[:, :-1], None)
        first = model.mtp(hidden[:, :5], ids[:, 1:6], positions[:, :5], kv)
        rest = [model.mtp(hidden[:, t : t + 1], ids[:, t + 1 : t + 2], positions[:, t : t + 1], kv) for t in range(5, 9)]
        stepwise = torch.cat([first, *rest], dim=1)
        # depth 1 chains the 1-layer head on its own output at the next position
        token_t2 = model.draft_logits(stepwise[:, -1:]).argmax(-1)
        chained = model.mtp(stepwise[:, -1:], token_t2, positions[:, 9:10], kv, depth=1)
    assert (stepwise - reference).abs().max().item() <= 1e-5
    assert chained.shape == (2, 1, lm.config.hidden_size) and torch.isfinite(chained).all()
    assert not torch.equal(kv.k[L][:, :, 9], torch.zeros_like(kv.k[L][:, :, 9]))  # depth 1 wrote KV at L


def test_mtp_trains_with_kv_none(tiny_checkpoint):
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu")
    model = lm.model.train().requires_grad_(True)
    ids, positions = _inputs(lm, tokens=16)
    hidden = model(ids, positions)
    main = F.cross_entropy(model.logits(hidden[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    draft_h = model.mtp(hidden[:, :-1], ids[:, 1:], positions[:, :-1], None)
    draft = F.cross_entropy(model.logits(draft_h[:, :-1]).flatten(0, 1), ids[:, 2:].flatten())
    (main + 0.3 * draft).backward()
    mtp_layer = model.mtp.layers[0]
    assert mtp_layer.eh_proj.weight.grad is not None and mtp_layer.eh_proj.weight.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad.abs().sum() > 0
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_mtp_own_head_is_kept_and_used(make_checkpoint, tmp_path):
    src = make_checkpoint(mtp_layout="deepseek", tie_word_embeddings=False)
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    own_head = torch.randn_like(tensors["lm_head.weight"])
    tensors["model.layers.2.shared_head.head.weight"] = own_head
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()  # a duplicate
    save_file(tensors, str(tmp_path / "model.safetensors"))
    lm = load_checkpoint(tmp_path, dtype="float32", device="cpu")
    layer = lm.model.mtp.layers[0]
    assert layer.embed is None  # identical to the main embedding: not kept twice
    assert torch.equal(layer.head.weight, own_head)
    h = torch.randn(1, 3, lm.config.hidden_size)
    assert torch.allclose(lm.model.draft_logits(h), h @ own_head.T, atol=1e-5)


def test_mtp_declared_but_missing_tensor_names_it(make_checkpoint, tmp_path):
    src = make_checkpoint(mtp_layout="deepseek")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.eh_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.eh_proj\.weight"):
        load_checkpoint(tmp_path, dtype="float32", device="cpu")


def test_qwen3_next_layers_share_fc_and_norms(tmp_path):
    from dataclasses import replace

    from engine.model import CausalLM
    from engine.model.config import MTPConfig
    from engine.model.random_checkpoint import random_config

    config = replace(random_config(mtp_layout="qwen3_next"), mtp=MTPConfig(2, "qwen3_next"))
    model = CausalLM(config)
    save_checkpoint(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight", "mtp.layers.1.mlp.up_proj.weight"} <= names
    again = load_checkpoint(tmp_path, dtype="float32", device="cpu", tokenizer=False)
    first, second = again.model.mtp.layers
    assert first.eh_proj is second.eh_proj and first.block is not second.block
    assert again.model.mtp.layer_index(3) == 1
