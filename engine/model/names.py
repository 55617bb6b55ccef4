"""Tensor names: this package's parameter names <-> the Hugging Face checkpoint names, per MTP layout.

Main model: `embed_tokens.weight` <-> `model.embed_tokens.weight`, `layers.N.*` <-> `model.layers.N.*`,
`norm.weight` <-> `model.norm.weight`, `lm_head.weight` unchanged.

MTP layer i (L = num_hidden_layers):
  ours                 deepseek                                   qwen3_next (shared across layers)
  mtp.layers.i.enorm   model.layers.{L+i}.enorm                   mtp.pre_fc_norm_embedding
  mtp.layers.i.hnorm   model.layers.{L+i}.hnorm                   mtp.pre_fc_norm_hidden
  mtp.layers.i.eh_proj model.layers.{L+i}.eh_proj                 mtp.fc
  mtp.layers.i.block.* model.layers.{L+i}.*                       mtp.layers.i.*
  mtp.layers.i.norm    model.layers.{L+i}.shared_head.norm        mtp.norm
  mtp.layers.i.embed   model.layers.{L+i}.embed_tokens (optional) -
  mtp.layers.i.head    model.layers.{L+i}.shared_head.head (opt.) -
"""

from __future__ import annotations

from engine.model.config import ModelConfig

_DEEPSEEK_OWN = {
    "enorm": "enorm",
    "hnorm": "hnorm",
    "eh_proj": "eh_proj",
    "norm": "shared_head.norm",
    "embed": "embed_tokens",
    "head": "shared_head.head",
}
_QWEN3_NEXT_SHARED = {
    "enorm": "mtp.pre_fc_norm_embedding",
    "hnorm": "mtp.pre_fc_norm_hidden",
    "eh_proj": "mtp.fc",
    "norm": "mtp.norm",
}


def hf_name(name: str, config: ModelConfig) -> str:
    """The checkpoint name of one of our parameter names (unfused model)."""
    if name.startswith("mtp.layers."):
        return _mtp_hf_name(name, config)
    if name == "lm_head.weight":
        return name
    return "model." + name


def _mtp_hf_name(name: str, config: ModelConfig) -> str:
    _, _, index, rest = name.split(".", 3)  # mtp.layers.<i>.<rest>
    i = int(index)
    module, _, leaf = rest.partition(".")
    layout = config.mtp.layout if config.mtp else "deepseek"
    if layout == "qwen3_next":
        if module == "block":
            return f"mtp.layers.{i}.{leaf}"
        if module in _QWEN3_NEXT_SHARED:
            return f"{_QWEN3_NEXT_SHARED[module]}.{leaf}"
        raise KeyError(f"{name}: the qwen3_next MTP layout has no tensor for it")
    prefix = f"model.layers.{config.num_hidden_layers + i}"
    if module == "block":
        return f"{prefix}.{leaf}"
    return f"{prefix}.{_DEEPSEEK_OWN[module]}.{leaf}"


def optional_mtp_tensors(config: ModelConfig, layer: int) -> dict[str, str]:
    """{our module name: checkpoint weight name} of the optional per-layer embed/head (DeepSeek layout)."""
    if config.mtp is None or config.mtp.layout != "deepseek":
        return {}
    prefix = f"model.layers.{config.num_hidden_layers + layer}"
    return {"embed": f"{prefix}.embed_tokens.weight", "head": f"{prefix}.shared_head.head.weight"}
