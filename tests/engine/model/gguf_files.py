"""GGUF test files written with the `gguf` package's GGUFWriter from a Hugging Face checkpoint directory.

Q8_0, Q4_0, Q4_1 and Q5_0 blocks come from gguf's own `gguf.quants.quantize`. The package has no quantizer for
the K-quants (Q4_K, Q6_K raise NotImplementedError), so `encode_q4_k` / `encode_q6_k` here lay out ggml's
block_q4_K / block_q6_K by the published layout, and every block they write is read back by gguf's own
`gguf.quants.dequantize` (the tests compare our loader with that, never with these encoders).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file

import gguf
from gguf import GGMLQuantizationType as T

from engine.bench.gguf_export import add_hyperparameters

_OURS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_tensor_name(hf: str) -> str | None:
    if hf.startswith("experts:"):  # _stack_experts' stacked tensors
        _, layer, kind = hf.split(":")
        return f"blk.{layer}.ffn_{kind}_exps.weight"
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.i.<module...>.<leaf>
    module, leaf = ".".join(parts[3:-1]), parts[-1]
    if module == "mlp.gate":  # Qwen3-MoE's router
        return f"blk.{parts[2]}.ffn_gate_inp.{leaf}"
    return f"blk.{parts[2]}.{_OURS[module]}.{leaf}" if module in _OURS else None


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K % 256 == 0) -> ggml block_q4_K bytes [rows, K / 256 * 144]."""
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0)
    hi = np.maximum(sub.max(-1), 0)
    scale = (hi - lo) / 15
    mins = -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(mins / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    eff_scale = d[:, None] * sc
    eff_min = dmin[:, None] * mn
    q = np.clip(np.round((sub + eff_min[..., None]) / np.where(eff_scale == 0, 1, eff_scale)[..., None]), 0, 15)
    q = q.astype(np.uint8)
    scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)  # byte [i, t]: sub-blocks 2i (low), 2i+1 (high)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                             dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(x.shape[0], -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K % 256 == 0) -> ggml block_q6_K bytes [rows, K / 256 * 210]."""
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    s = np.abs(sub).max(-1) / 31
    d = (s.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(s / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    eff = d[:, None] * sc
    q = (np.clip(np.round(sub / np.where(eff == 0, 1, eff)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 256)
    n = q.shape[0]
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for c in range(2):
        b = np.arange(64)
        ql[:, c * 64 + b] = (q[:, c * 128 + b] & 0x0F) | ((q[:, c * 128 + 64 + b] & 0x0F) << 4)
        for part in range(4):
            t = np.arange(32)
            qh[:, c * 32 + t] |= ((q[:, c * 128 + part * 32 + t] >> 4) & 0x03) << (2 * part)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(x.shape[0], -1)


def _stack_experts(tensors: dict[str, torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's per-expert projections as llama.cpp stores them: one [experts, rows, K] tensor per projection
    and layer, under a name gguf_tensor_name maps to blk.N.ffn_{gate,up,down}_exps."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = {int(k.split(".")[2]) for k in tensors if ".mlp.experts." in k}
    for layer in sorted(layers):
        for kind in ("gate", "up", "down"):
            out[f"experts:{layer}:{kind}"] = torch.stack(
                [tensors[f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"] for e in range(experts)])
    return out


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.Q4_K:
        return encode_q4_k(x)
    if qtype == T.Q6_K:
        return encode_q6_k(x)
    return gguf.quants.quantize(x, qtype)


Chooser = Callable[[str, tuple[int, ...]], T]


def write_gguf(src: Path, out: Path, choose: Chooser, pre: str = "gpt2") -> dict[str, np.ndarray]:
    """Write src as GGUF; choose(gguf name, shape) picks each 2-D tensor's type (1-D ones are F32). Returns
    {gguf name: the fp32 values gguf.quants.dequantize reads back} for the quantized ones."""
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    arch = config["model_type"].replace("_", "")  # qwen3_moe -> llama.cpp's qwen3moe
    w = gguf.GGUFWriter(str(out), arch)
    if config.get("num_experts"):
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        tensors = _stack_experts(tensors, config["num_experts"])
    add_hyperparameters(w, config, default_context_tokens=4096)  # the product's export writes the same keys
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    added = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    for i, text in added.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    tconf = json.loads((src / "tokenizer_config.json").read_text()) if (src / "tokenizer_config.json").is_file() else {}
    gen = json.loads((src / "generation_config.json").read_text())
    eos = gen.get("eos_token_id")
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if tconf.get("chat_template"):
        w.add_chat_template(tconf["chat_template"])
    read_back = {}
    for hf, value in tensors.items():
        name = gguf_tensor_name(hf)
        if name is None:
            continue  # the MTP layer: llama.cpp's qwen3 has none
        x = value.to(torch.float32).numpy()
        if x.ndim == 1:
            w.add_tensor(name, x)
            continue
        qtype = choose(name, x.shape)
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, x.astype(np.float32 if qtype == T.F32 else np.float16))
            continue
        data = quantize(x.reshape(-1, x.shape[-1]), qtype)  # a 3-D experts tensor: its rows, blocks along K
        data = data.reshape(*x.shape[:-1], data.shape[-1])
        w.add_tensor(name, data, raw_dtype=qtype)
        read_back[name] = gguf.quants.dequantize(data, qtype).reshape(x.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_back
