"""GGUF files (llama.cpp's format), read with the `gguf` package: config, weights and tokenizer from one file.

    model, config, tokenizer, eos_ids, weight_format = read_gguf(path, dtype, device, with_tokenizer=True)

Architectures: `qwen3`, `qwen2`, `llama` (whose q/k rows llama.cpp's converter permuted for its interleaved
rotary; they are put back here), `qwen3moe` (Qwen3-MoE: the router `ffn_gate_inp` loads dense, each layer's
`ffn_{gate,up,down}_exps` [experts, rows, K] splits into one quantized layer per expert, on the W4 / W8 layouts
as below; a layer without a router is a dense MLP layer). Tensor types and where each goes (exactly: every code, scale and minimum of
the file is kept, nothing is requantized):

| GGUF type | internal layout |
|---|---|
| F32, F16, BF16 | the model's dtype |
| Q4_0 (w = d(q - 8), 32 a block), Q4_1 (w = dq + m), Q4_K (256 a block, a 6-bit scale and min per 32) | int4, groups of 32 |
| Q8_0 (w = dq, 32 a block), Q6_K (256 a block, an 8-bit scale per 16) | int8, groups of 32 / 16 |

Other types (Q2_K, Q3_K, Q5_*, IQ*, TQ*, MXFP4) are refused with one line naming the tensor and its type. The
tokenizer is rebuilt from `tokenizer.ggml.*` (a byte-level BPE: tokens, merges, the pre-tokenizer's name) and
the chat template from `tokenizer.chat_template`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.errors import CheckpointError
from engine.model.causal_lm import CausalLM
from engine.model.config import ModelConfig
from engine.model.quant.gguf_blocks import CONVERTERS, PLAIN_TYPES, SUPPORTED_TYPES, raw_blocks
from engine.model.quant.gguf_header import check_gguf_structure
from engine.model.quant.linear import IntGroupLinear
from engine.model.tokenizer import Tokenizer

ARCHITECTURES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "qwen3moe": "qwen3_moe"}
# llama.cpp's "qwen2" pre-tokenizer (Qwen2/Qwen3): its split regex, then byte-level without its own regex
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE's router
}
# Qwen3-MoE's routed experts: one 3-D tensor [experts, rows, K] per projection and layer
_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj")


def gguf_name(name: str) -> str:
    """Our parameter / module name -> the GGUF tensor name (module names map to their `.weight` base)."""
    if name.startswith("embed_tokens."):
        return "token_embd." + name.split(".", 1)[1]
    if name.startswith("norm."):
        return "output_norm." + name.split(".", 1)[1]
    if name.startswith("lm_head."):
        return "output." + name.split(".", 1)[1]
    _, index, rest = name.split(".", 2)  # layers.<i>.<rest>
    for ours, theirs in _LAYER_NAMES.items():
        if rest == ours or rest.startswith(ours + "."):
            return f"blk.{index}.{theirs}{rest[len(ours):]}"
    raise KeyError(name)


def read_gguf(path: Path, dtype: torch.dtype, device: torch.device, with_tokenizer: bool = True,
              expert_device: torch.device | None = None):
    """(model, config, tokenizer or None, eos ids, weight format) of a GGUF file; CheckpointError (one line
    naming the file, and the tensor where one is at fault) for what cannot load. A Qwen3-MoE file's routed
    experts go to `expert_device` when given (the expert cache places them), else with the rest."""
    meta, tensors, config, model = _checked(path)
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
    types: dict[str, int] = {}
    converted: dict[str, Any] = {}  # the current layer's 3-D expert tensors, each converted once for its experts
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head" or name.endswith(".mlp.gate"):
            continue  # the head and a MoE router load dense below, with the embeddings and norms
        expert = _EXPERTS.fullmatch(name)
        if expert is not None:
            layer = _expert_layer(tensors, converted, types, expert, module, config, path, dtype,
                                  expert_device or device, scale_dtype)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer)
            continue
        t = _tensor(tensors, gguf_name(name) + ".weight", (module.out_features, module.in_features), path)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        bias = _plain(tensors, gguf_name(name) + ".bias", (module.out_features,), path, dtype, device) \
            if module.bias is not None else None
        rows = _unpermute_rows(config, name)
        if t.tensor_type in PLAIN_TYPES:
            weight = _plain(tensors, t.name, (module.out_features, module.in_features), path, dtype, device)
            layer = nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(weight[rows] if rows is not None else weight, requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias, requires_grad=False)
        else:
            codes, scale, offset, bits, group = CONVERTERS[t.tensor_type](raw_blocks(t), module.out_features,
                                                                            module.in_features)
            if rows is not None:
                codes, scale, offset = codes[rows], scale[rows], offset[rows]
            layer = IntGroupLinear(codes, scale, offset, bits, group, bias, scale_dtype=scale_dtype).to(device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        value = _dense(tensors, _dense_name(name, tensors), tuple(param.shape), path, dtype, device)
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(value, requires_grad=False))
    model.rotary.reset_parameters(device)
    model.requires_grad_(False)
    fmt = "gguf " + " + ".join(f"{k}" for k, _ in sorted(types.items(), key=lambda kv: -kv[1]))
    model.weight_format = fmt
    tok = _tokenizer(meta, str(path)) if with_tokenizer else None
    eos = tuple(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta)
    return model.eval(), config, tok, tuple(dict.fromkeys(eos)), fmt


def check_gguf(path: Path) -> None:
    """Everything `read_gguf` would refuse about a file, from its header alone (nothing is converted)."""
    _checked(path)


def _checked(path: Path) -> tuple[dict, dict, ModelConfig, CausalLM]:
    """The file's metadata, tensors (gguf's ReaderTensor, by name), config and the model on the meta device,
    once the file's structure, its architecture, every tensor's type and every shape the model needs are
    checked."""
    import gguf

    check_gguf_structure(path)  # the header's claims against the file, before gguf trusts them
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the package raises ValueError / struct errors for a corrupt header
        raise CheckpointError(str(path), f"cannot read as GGUF: {exc}") from None
    meta = {f.name: _field_value(f) for f in reader.fields.values()}
    tensors = {t.name: t for t in reader.tensors}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(str(path), f"GGUF architecture {arch!r} is not supported "
                                         f"(supported: {', '.join(ARCHITECTURES)})")
    for t in reader.tensors:
        if t.tensor_type not in CONVERTERS and t.tensor_type not in PLAIN_TYPES:
            raise CheckpointError(str(path), f"tensor {t.name} has type {t.tensor_type.name}, which Strata does not "
                                             f"load (supported: {', '.join(sorted(SUPPORTED_TYPES))})")
    config = _config(meta, arch, tensors, str(path))
    with torch.device("meta"):
        model = CausalLM(config)
    linears = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name == "lm_head" or name.endswith(".mlp.gate"):
            continue
        linears.add(name)
        expert = _EXPERTS.fullmatch(name)
        if expert is not None:
            layer_idx, kind = expert.group(1), expert.group(3)
            _tensor(tensors, f"blk.{layer_idx}.ffn_{kind}_exps.weight",
                    (config.moe.num_experts, module.out_features, module.in_features), path)
            continue
        _tensor(tensors, gguf_name(name) + ".weight", (module.out_features, module.in_features), path)
        if module.bias is not None:
            _plain_tensor(tensors, gguf_name(name) + ".bias", (module.out_features,), path)
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in linears:
            _tensor(tensors, _dense_name(name, tensors), tuple(param.shape), path)
    return meta, tensors, config, model


def _dense_name(name: str, tensors: dict) -> str:
    """The GGUF tensor a dense parameter loads from (a tied head: the token embeddings)."""
    return "token_embd.weight" if name == "lm_head.weight" and "output.weight" not in tensors else gguf_name(name)


def _expert_layer(tensors: dict, converted: dict, types: dict, match: re.Match, module: nn.Linear,
                  config: ModelConfig, path, dtype: torch.dtype, device: torch.device, scale_dtype: torch.dtype):
    """One routed expert's projection from its layer's blk.N.ffn_{gate,up,down}_exps tensor: the expert's rows
    of the tensor converted as a whole (the blocks run along K, so an expert's rows are its own blocks)."""
    layer_idx, expert, kind = int(match.group(1)), int(match.group(2)), match.group(3)
    name = f"blk.{layer_idx}.ffn_{kind}_exps.weight"
    experts, n, k = config.moe.num_experts, module.out_features, module.in_features
    if name not in converted:
        if len(converted) >= 3:  # a new layer: the previous one's gate, up and down are done
            converted.clear()
        t = _tensor(tensors, name, (experts, n, k), path)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + experts
        if t.tensor_type in PLAIN_TYPES:
            converted[name] = _dense(tensors, name, (experts, n, k), path, dtype, torch.device("cpu"))
        else:
            converted[name] = CONVERTERS[t.tensor_type](raw_blocks(t), experts * n, k)
    value = converted[name]
    if isinstance(value, torch.Tensor):
        layer = nn.Linear(k, n, bias=False, device="meta")
        layer.weight = nn.Parameter(value[expert].to(device), requires_grad=False)
        return layer
    codes, scale, offset, bits, group = value
    rows = slice(expert * n, (expert + 1) * n)
    return IntGroupLinear(codes[rows], scale[rows], offset[rows], bits, group, None,
                          scale_dtype=scale_dtype).to(device)


def _field_value(field) -> Any:
    import gguf

    if not field.types:
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8", errors="replace") for p in items]
        return [p.tolist()[0] if len(p) == 1 else p.tolist() for p in items]
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def _config(meta: dict, arch: str, tensors: dict, where: str) -> ModelConfig:
    def get(key, default=None, required=True):
        value = meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(where, f"GGUF metadata has no {arch}.{key}")
        return value

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    raw: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch], "hidden_size": hidden, "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length", required=arch != "qwen3moe"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0), "max_position_embeddings": get("context_length", 32768),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else 0,
        "tie_word_embeddings": "output.weight" not in tensors, "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors and arch != "qwen2",
    }
    if arch == "qwen3moe":  # llama.cpp's qwen3moe normalises the top-k weights, as Qwen3-MoE does
        layers = range(raw["num_hidden_layers"])
        raw.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                   moe_intermediate_size=get("expert_feed_forward_length"), norm_topk_prob=True,
                   mlp_only_layers=[i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
        raw["intermediate_size"] = get("feed_forward_length", raw["moe_intermediate_size"], required=False)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raw["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor", 1.0),
                               "original_max_position_embeddings": get("rope.scaling.original_context_length",
                                                                       required=False)}
    return ModelConfig.from_hf(raw, f"{where} (GGUF metadata)")


def _tensor(tensors: dict, name: str, shape: tuple[int, ...], path) -> Any:
    if name not in tensors:
        raise CheckpointError(str(path), f"missing tensor {name} (expected shape {list(shape)})")
    t = tensors[name]
    got = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    if got != tuple(shape):
        raise CheckpointError(str(path), f"tensor {name} has shape {list(got)}, expected {list(shape)}")
    return t


def _plain_tensor(tensors, name, shape, path) -> Any:
    t = _tensor(tensors, name, shape, path)
    if t.tensor_type not in PLAIN_TYPES:
        raise CheckpointError(str(path), f"tensor {name} has type {t.tensor_type.name}: expected F32, F16 or BF16")
    return t


def _plain(tensors, name, shape, path, dtype, device) -> torch.Tensor:
    _plain_tensor(tensors, name, shape, path)
    return _dense(tensors, name, shape, path, dtype, device)


def _dense(tensors, name, shape, path, dtype, device) -> torch.Tensor:
    """Any supported tensor as a dense [shape] tensor (embeddings and norms; gguf's own dequantize for a
    quantized embedding table)."""
    import gguf

    t = _tensor(tensors, name, shape, path)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        values = torch.from_numpy(np.array(t.data).view(np.int16).astype(np.int16)).view(torch.bfloat16)
    elif t.tensor_type in PLAIN_TYPES:
        values = torch.from_numpy(np.array(t.data))
    else:
        values = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type))
    return values.reshape(shape).to(device=device, dtype=dtype)


def _unpermute_rows(config: ModelConfig, name: str) -> torch.Tensor | None:
    """llama.cpp's converter reorders a Llama model's q/k rows per head (halves interleaved for its rotary);
    the row order that undoes it, or None (Qwen's converters keep the Hugging Face order)."""
    if config.arch != "llama" or not name.endswith(("q_proj", "k_proj")):
        return None
    heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
    d = config.head_dim
    # converter: w.reshape(heads, 2, d/2, K).swapaxes(1, 2): stored row h*d + 2i + j is original h*d + j*d/2 + i
    stored = torch.arange(heads * d).view(heads, 2, d // 2).transpose(1, 2).reshape(-1)
    inverse = torch.empty_like(stored)
    inverse[stored] = torch.arange(stored.numel())
    return inverse


def _tokenizer(meta: dict, where: str) -> Tokenizer:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind != "gpt2" or not tokens:
        raise CheckpointError(where, f"GGUF tokenizer model {kind!r} is not supported (a byte-level BPE, 'gpt2', is)")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    hf = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    if meta.get("tokenizer.ggml.pre") == "qwen2":
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]  # control, user-defined
    if special:
        from tokenizers import AddedToken

        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    names = {}
    for key, field in (("eos_token", "tokenizer.ggml.eos_token_id"), ("bos_token", "tokenizer.ggml.bos_token_id")):
        if field in meta and 0 <= int(meta[field]) < len(tokens):
            names[key] = tokens[int(meta[field])]
    return Tokenizer(hf, meta.get("tokenizer.chat_template"), names)
