"""ModelConfig: the architecture read from a Hugging Face config.json (Qwen3, Llama, Qwen2, with MTP).

One parser for the three families: they differ only in flags (q/k norm, qkv bias, tied head), so the model
code has one path with switches instead of three classes. Anything we cannot run faithfully is refused here
with a CheckpointError naming config.json and the key, never silently approximated.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engine.errors import CheckpointError

ARCHS = ("qwen3", "llama", "qwen2")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
MTP_LAYOUTS = ("deepseek", "qwen3_next")

_ARCH_BY_MODEL_TYPE = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2", "mistral": "llama", "qwen3_moe": "qwen3"}
_ARCH_BY_CLASS = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "llama",
}
# Bounds on the sizes a config may declare, far past any published model: a config past them is broken, and
# building it would hang the start (a trillion layers are a trillion modules, even on the meta device).
MAX_SIZES = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 24,
    "num_experts": 1 << 14, "num_local_experts": 1 << 14, "num_experts_per_tok": 1 << 14,
    "moe_intermediate_size": 1 << 20, "decoder_sparse_step": 1024,
}
MAX_MTP_LAYERS = 16
_MTP_KEYS = (
    ("num_nextn_predict_layers", "deepseek"),
    ("num_mtp_layers", "qwen3_next"),
    ("mtp_num_hidden_layers", "qwen3_next"),
)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `type` is one of ROPE_TYPES."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor/mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class MTPConfig:
    """The multi-token-prediction head: how many layers and which tensor-name layout they load from."""

    num_layers: int = 1
    layout: str = "deepseek"  # deepseek | qwen3_next


@dataclass(frozen=True)
class MoEConfig:
    """Qwen3-MoE's sparse MLP: which layers route, and how (engine/model/moe.py; docs/MODEL.md, "MoE")."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # A synthetic source (engine.model.synthetic) serves its experts from a store shared by the layers: the blocks
    # then hold no module per expert (48 x 512 of them would take seconds to build). Never read from a file.
    shared_store: bool = False

    def is_sparse(self, layer_idx: int, num_hidden_layers: int) -> bool:
        """Transformers' rule for main layers; MTP layers (index >= num_hidden_layers) are sparse, as in
        DeepSeek-V3 and Qwen3-Next, whose MTP blocks are MoE blocks."""
        if layer_idx >= num_hidden_layers:
            return True
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """The sizes and flags of one Qwen3 / Llama / Qwen2 checkpoint."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True
    rope: RopeConfig = field(default_factory=RopeConfig)
    mtp: MTPConfig | None = None
    torch_dtype: str | None = None  # the dtype the checkpoint was saved in, as config.json says
    moe: MoEConfig | None = None  # Qwen3-MoE (model_type qwen3_moe); None: every MLP is dense

    @property
    def num_kv_layers(self) -> int:
        """Layers that own KV: the main stack plus the MTP layers (indexed L..L+n-1)."""
        return self.num_hidden_layers + (self.mtp.num_layers if self.mtp else 0)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict; raise CheckpointError naming `source` and the offending key."""
        return _parse(raw, source)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read and parse a config.json file."""
        path = Path(path)
        try:
            raw = json.loads(read_small_file(path))
        except FileNotFoundError:
            raise CheckpointError(str(path.parent), "no config.json: not a Hugging Face checkpoint directory") from None
        except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(str(path), f"cannot read JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise CheckpointError(str(path), "expected a JSON object")
        return _parse(raw, str(path))

    def to_hf(self) -> dict[str, Any]:
        """The config.json this config was (or would be) read from, in the pre-v5 HF format."""
        arch_class = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.moe else arch_class[self.arch]],
            "model_type": "qwen3_moe" if self.moe else self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "rope_theta": self.rope.theta,
            "rope_scaling": _rope_to_hf(self.rope),
        }
        if self.arch != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.arch == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.torch_dtype:
            out["torch_dtype"] = self.torch_dtype
        if self.moe is not None:
            out.update(num_experts=self.moe.num_experts, num_experts_per_tok=self.moe.num_experts_per_tok,
                       moe_intermediate_size=self.moe.moe_intermediate_size, norm_topk_prob=self.moe.norm_topk_prob,
                       decoder_sparse_step=self.moe.decoder_sparse_step, mlp_only_layers=list(self.moe.mlp_only_layers))
        if self.mtp is not None:
            key = "num_nextn_predict_layers" if self.mtp.layout == "deepseek" else "mtp_num_hidden_layers"
            out[key] = self.mtp.num_layers
        return out


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any] | None:
    if rope.type == "default":
        return None
    out: dict[str, Any] = {"rope_type": rope.type, "factor": rope.factor}
    if rope.original_max_position_embeddings is not None:
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    if rope.type == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    if rope.type == "yarn":
        out.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate)
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(rope, name) is not None:
                out[name] = getattr(rope, name)
    return out


def _arch_of(raw: Mapping[str, Any], source: str) -> str:
    model_type = raw.get("model_type")
    if model_type in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[model_type]
    for cls_name in raw.get("architectures") or ():
        if cls_name in _ARCH_BY_CLASS:
            return _ARCH_BY_CLASS[cls_name]
    named = model_type or raw.get("architectures")
    raise CheckpointError(
        source,
        f"unsupported architecture {named!r}: expected model_type qwen3, qwen3_moe, llama or qwen2 "
        "(or architectures Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM)",
    )


def _req(raw: Mapping[str, Any], key: str, source: str) -> int:
    if key not in raw or raw[key] is None:
        raise CheckpointError(source, f"missing required key {key!r}")
    return _size(raw[key], key, source)


def _size(value: Any, key: str, source: str) -> int:
    """A positive whole number within MAX_SIZES[key]."""
    upper = MAX_SIZES.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or (upper is not None and value > upper):
        bound = f"1..{upper}" if upper is not None else "a positive whole number"
        raise CheckpointError(source, f"{key}={_short(value)}: expected a whole number in {bound}")
    return value


def _number(value: Any, key: str, source: str, positive: bool = True) -> float:
    """A finite number (JSON has no NaN or Infinity, but Python's json reads them): a NaN epsilon or rope base
    loads fine and makes every logit NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise CheckpointError(source, f"{key}={_short(value)}: expected a finite number"
                                      + (" above 0" if positive else ""))
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parse(raw: Mapping[str, Any], source: str) -> ModelConfig:
    arch = _arch_of(raw, source)
    hidden = _req(raw, "hidden_size", source)
    heads = _req(raw, "num_attention_heads", source)
    kv_heads = _size(raw.get("num_key_value_heads") or heads, "num_key_value_heads", source)
    if heads % kv_heads:
        raise CheckpointError(source, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = _size(raw.get("head_dim") or max(1, hidden // heads), "head_dim", source)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(source, f"hidden_act={act!r}: only silu (SwiGLU) is supported")
    if raw.get("use_sliding_window"):
        raise CheckpointError(source, "use_sliding_window=true: sliding-window attention is not supported")
    max_pos = _size(raw.get("max_position_embeddings") or 32768, "max_position_embeddings", source)
    return ModelConfig(
        arch=arch,
        vocab_size=_req(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_req(raw, "intermediate_size", source),
        num_hidden_layers=_req(raw, "num_hidden_layers", source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias (and no config key for it); Qwen3 and Llama declare it
        attention_bias=True if arch == "qwen2" else bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)) if arch == "llama" else False,
        qk_norm=arch == "qwen3",
        rope=_parse_rope(raw, source),
        mtp=_parse_mtp(raw, source),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        moe=_parse_moe(raw, source),
    )


def _parse_moe(raw: Mapping[str, Any], source: str) -> MoEConfig | None:
    is_moe = raw.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (raw.get("architectures") or ())
    if not is_moe:
        return None
    # transformers 5 writes num_local_experts, the Hub's Qwen3-MoE configs num_experts
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    experts = _req(raw, key, source)
    top_k = _req(raw, "num_experts_per_tok", source)
    if top_k > experts:
        raise CheckpointError(source, f"num_experts_per_tok={top_k} exceeds {key}={experts}")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise CheckpointError(source, f"mlp_only_layers={only!r}: expected a list of layer indices")
    return MoEConfig(
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=_req(raw, "moe_intermediate_size", source),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=_req(raw, "decoder_sparse_step", source) if "decoder_sparse_step" in raw else 1,
        mlp_only_layers=tuple(only),
    )


def _parse_rope(raw: Mapping[str, Any], source: str) -> RopeConfig:
    # transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes one rope_parameters dict
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = _number(merged.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", source)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            source, f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type != "default" and "factor" not in merged and rope_type != "yarn":
        raise CheckpointError(source, f"rope_scaling type {rope_type!r} needs a 'factor'")
    original = merged.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        original = raw.get("max_position_embeddings")
    if rope_type == "llama3" and original is None:
        raise CheckpointError(source, "rope_scaling type 'llama3' needs original_max_position_embeddings")
    def number(key: str, default: float | None, positive: bool = True) -> float | None:
        value = merged.get(key)
        return default if value is None else _number(value, f"rope_scaling.{key}", source, positive)

    if original is not None:
        original = _size(original, "max_position_embeddings", source)
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=number("factor", 1.0) or 1.0,
        original_max_position_embeddings=original,
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        beta_fast=number("beta_fast", 32.0),
        beta_slow=number("beta_slow", 1.0),
        attention_factor=number("attention_factor", None),
        mscale=number("mscale", None, positive=False),
        mscale_all_dim=number("mscale_all_dim", None, positive=False),
        truncate=bool(merged.get("truncate", True)),
    )


def _parse_mtp(raw: Mapping[str, Any], source: str) -> MTPConfig | None:
    for key, layout in _MTP_KEYS:
        value = raw.get(key)
        if value in (None, 0):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_MTP_LAYERS:
            raise CheckpointError(source, f"{key}={_short(value)}: expected a whole number of MTP layers "
                                          f"(0..{MAX_MTP_LAYERS})")
        return MTPConfig(num_layers=value, layout=layout)
    return None


MAX_JSON_FILE_BYTES = 16 << 20  # a config.json is a few KiB; a bigger file is not one


def read_small_file(path: Path, limit_bytes: int = MAX_JSON_FILE_BYTES) -> str:
    """The text of a regular file of at most `limit_bytes`. A FIFO, a device or a directory named config.json
    would block the load (a FIFO until a writer comes, deaf to SIGTERM) or fill the memory: CheckpointError."""
    info = os.stat(path)  # FileNotFoundError is the caller's to word
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(str(path), "not a regular file (a FIFO, device or directory cannot be a config)")
    if info.st_size > limit_bytes:
        raise CheckpointError(str(path), f"{info.st_size} bytes; a config file is at most {limit_bytes} bytes")
    with open(path, "rb") as f:
        return f.read(limit_bytes + 1).decode("utf-8")
