"""Load a Hugging Face checkpoint directory (or builtin:NAME, or a synthetic random:NAME) into a CausalLM, with
tokenizer and eos ids.

The model is built on the meta device and each parameter is read from safetensors straight into its final
dtype and device, so a checkpoint is never held twice in memory. Every failure names the file or tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.errors import CheckpointError, ConfigError
from engine.model.config import ModelConfig, read_small_file
from engine.model.names import hf_name, optional_mtp_tensors
from engine.model.causal_lm import CausalLM
from engine.model.quant.formats import FLOAT_DTYPES, Scheme, check_linear, read_linear, scheme_from_config
from engine.model.quant.rtn import quantize_model
from engine.model.synthetic import PREFIX as SYNTHETIC_PREFIX, SPECS as SYNTHETIC_SPECS
from engine.model.synthetic import build_synthetic, is_synthetic, synthetic_tokenizer
from engine.model.tensors import TensorSource
from engine.model.tokenizer import Tokenizer

BUILTIN_PREFIX = "builtin:"
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    """What load_checkpoint returns: the model (eval mode, on device) and what goes with it."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    path: Path
    dtype: torch.dtype
    device: torch.device
    weight_format: str = "bf16"


def resolve_model_path(model: str | Path) -> Path:
    """A checkpoint directory, or `builtin:NAME` -> the packaged engine/models/NAME directory."""
    text = str(model)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX):]
        path = MODELS_DIR / name
        if not name or "/" in name or not (path / "config.json").is_file():
            raise CheckpointError(text, f"the embedded model is not installed (expected a checkpoint in {path})")
        return path
    path = Path(text).expanduser()
    if not path.exists():
        raise CheckpointError(text, "no such directory")
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir():
        raise CheckpointError(text, "not a directory: expected a Hugging Face checkpoint directory or a .gguf file")
    return path


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` -> cuda:0 when CUDA is available, else cpu."""
    if str(device) == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError("device", str(device), "expected auto, cpu or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", str(device), "CUDA device requested but torch sees no CUDA device")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 on CPU; otherwise one of float32 | bfloat16 | float16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError("dtype", dtype, "expected auto, float32, bfloat16 or float16") from None


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               expert_device: torch.device | None = None, scheme: Scheme | None = None) -> CausalLM:
    """Build the model on meta and fill every parameter from the checkpoint's safetensors; routed experts
    (MoE) go to `expert_device` when given (the expert cache then places them). With a quantization `scheme`
    (config.json's quantization_config) each projection the checkpoint stores quantized becomes a quantized
    layer (engine.model.quant.formats). Every tensor's shape and dtype is checked from the headers before
    the first is read."""
    with TensorSource(path) as source:
        model = _checked_meta_model(config, source, scheme)
        if scheme is not None:
            _load_quantized_linears(model, config, source, scheme, dtype, device, expert_device)
        for name, param in list(model.named_parameters()):
            if param.device.type != "meta":
                continue  # a quantized layer's bias, already read
            where = expert_device if expert_device is not None and ".mlp.experts." in name else device
            _set_parameter(model, name, _read_tensor(source, hf_name(name, config), tuple(param.shape), dtype, where))
        _drop_duplicate_mtp_modules(model)
    model.rotary.reset_parameters(device)
    model.requires_grad_(False)  # inference by default; a trainer calls model.requires_grad_(True)
    return model.eval()


def _checked_meta_model(config: ModelConfig, source: TensorSource, scheme: Scheme | None) -> CausalLM:
    """The model on the meta device (no memory), once the checkpoint's tensors hold what it needs: every
    layer the config counts, and every tensor of the shape and dtype the config gives (headers only)."""
    _check_layer_count(config, source)
    with torch.device("meta"):
        model = CausalLM(config)
    _attach_optional_mtp_modules(model, config, source)
    quantized: set[str] = set()
    if scheme is not None:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                prefix = hf_name(f"{name}.weight", config)[:-len(".weight")]
                if check_linear(source, prefix, scheme, (module.out_features, module.in_features)):
                    quantized.add(f"{name}.weight")
    for name, param in model.named_parameters():
        if name not in quantized:
            _check_tensor(source, hf_name(name, config), tuple(param.shape))
    return model


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def _check_layer_count(config: ModelConfig, source: TensorSource) -> None:
    """The config's layer and expert counts against what the tensors hold, before a module is built for each."""
    present = {int(m.group(1)) for m in map(_LAYER_INDEX.match, source.file_of) if m is not None}
    missing = next((i for i in range(config.num_hidden_layers) if i not in present), None)
    if missing is not None:
        held = f"layers 0..{max(present)}" if present else "no layers"
        raise CheckpointError(source.where, f"config.json says num_hidden_layers={config.num_hidden_layers}, but "
                                            f"the tensors hold {len(present)} layers ({held}; model.layers.{missing} "
                                            f"is missing)")
    if config.moe is not None and any(config.moe.is_sparse(i, config.num_hidden_layers)
                                      for i in range(config.num_hidden_layers)):
        experts = {int(m.group(1)) for m in map(_EXPERT_INDEX.match, source.file_of) if m is not None}
        if len(experts) < config.moe.num_experts:
            raise CheckpointError(source.where, f"config.json says num_experts={config.moe.num_experts}, but the "
                                                f"tensors hold {len(experts)} experts")


def check_checkpoint(path_or_builtin: str | Path, quantize: str | None = None) -> None:
    """Everything `load_checkpoint` would refuse about a checkpoint's files, found from its config and tensor
    headers without reading the weights or allocating the model: `strata-engine serve` calls it before it
    binds its port, so a bad checkpoint is one line and exit 2, not a server that starts and then fails."""
    if is_synthetic(path_or_builtin):
        return  # generated at load: no files to check
    path = resolve_model_path(path_or_builtin)
    if path.is_file():
        from engine.model.quant.gguf_file import check_gguf  # imports the gguf package

        if quantize is not None:
            raise ConfigError("quantize", quantize, f"{path} is a GGUF file, already quantized")
        check_gguf(path)
        return
    config = ModelConfig.from_file(path / "config.json")
    scheme = scheme_from_config(_raw_config(path / "config.json"), str(path / "config.json"))
    if scheme is not None and quantize is not None:
        raise ConfigError("quantize", quantize, f"{path} is already quantized ({scheme.describe()})")
    with TensorSource(path) as source:
        _checked_meta_model(config, source, scheme)


def _load_quantized_linears(model: CausalLM, config: ModelConfig, source: TensorSource, scheme: Scheme,
                            dtype: torch.dtype, device: torch.device, expert_device: torch.device | None) -> None:
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        prefix = hf_name(f"{name}.weight", config)[:-len(".weight")]
        where = expert_device if expert_device is not None and ".mlp.experts." in name else device
        bias = None
        if module.bias is not None:
            bias = _read_tensor(source, f"{prefix}.bias", tuple(module.bias.shape), dtype, where)
        layer = read_linear(source, prefix, scheme, (module.out_features, module.in_features), bias, where,
                            scale_dtype)
        if layer is not None:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer)


_DTYPE_WORDS = {"I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
                "F8_E4M3": "fp8 (e4m3)", "F8_E5M2": "fp8 (e5m2)"}


def _check_tensor(source: TensorSource, name: str, expected: tuple[int, ...]) -> None:
    """A plain tensor: present, of the config's shape, holding floats (an int8 or fp8 weight in a checkpoint
    whose config declares no quantization would be read as its raw codes)."""
    if name not in source:
        raise CheckpointError(source.where, f"missing tensor {name} (expected shape {list(expected)})")
    shape = source.shape(name)
    if shape != expected:
        raise CheckpointError(
            source.path_of(name), f"tensor {name} has shape {list(shape)}, expected {list(expected)} from config.json"
        )
    stored = source.dtype(name)
    if stored not in FLOAT_DTYPES:
        raise CheckpointError(source.path_of(name), f"tensor {name} holds {_DTYPE_WORDS.get(stored, stored)} values; "
                                                    f"config.json declares no quantization for it (a plain tensor "
                                                    f"is float32, float16 or bfloat16)")


def _read_tensor(source: TensorSource, name: str, expected: tuple[int, ...], dtype, device) -> torch.Tensor:
    _check_tensor(source, name, expected)
    return source.get(name).to(device=device, dtype=dtype)


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))


def _attach_optional_mtp_modules(model: CausalLM, config: ModelConfig, source: TensorSource) -> None:
    """DeepSeek MTP layers may carry their own embed_tokens / shared_head.head: give them modules to load into."""
    if model.mtp is None:
        return
    for i, layer in enumerate(model.mtp.layers):
        optional = optional_mtp_tensors(config, i)
        if optional.get("embed") in source:
            layer.embed = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        if optional.get("head") in source:
            layer.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")


def _drop_duplicate_mtp_modules(model: CausalLM) -> None:
    """DeepSeek checkpoints repeat the shared embedding/head in each MTP layer: keep one copy in memory."""
    if model.mtp is None:
        return
    for layer in model.mtp.layers:
        if layer.embed is not None and torch.equal(layer.embed.weight, model.embed_tokens.weight):
            layer.embed = None
        if layer.head is not None and torch.equal(layer.head.weight, model.head_weight):
            layer.head = None


def read_eos_token_ids(path: Path, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """eos ids from generation_config.json, then config.json, then the tokenizer's eos token."""
    for file_name in ("generation_config.json", "config.json"):
        file_path = path / file_name
        if not file_path.is_file():
            continue
        try:
            value = json.loads(read_small_file(file_path)).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(str(file_path), f"cannot read JSON: {exc}") from None
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return tuple(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    return ()


def load_checkpoint(
    path_or_builtin: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    tokenizer: bool = True,
    expert_device: str | torch.device | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Load model, config, tokenizer (tokenizer.json; skipped with tokenizer=False) and eos ids.

    `expert_device` ("cpu"): where an MoE checkpoint's routed experts are loaded (the engine's expert cache
    moves them into pinned host memory and device slots); by default with the rest. `quantize` ("fp8" | "int4"):
    round a 16/32-bit checkpoint's projections to nearest at load (engine.model.quant.rtn). A GGUF file (or a
    directory holding one) loads through engine.model.quant.gguf_file.
    Raises CheckpointError naming the file or tensor that is missing or does not fit."""
    if is_synthetic(path_or_builtin):  # random:NAME without a file: generated on the device (synthetic.py)
        return _load_synthetic(str(path_or_builtin), dtype, device, tokenizer, expert_device, quantize)
    path = resolve_model_path(path_or_builtin)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if path.is_file():  # a .gguf file (resolve_model_path lets no other file through)
        from engine.model.quant.gguf_file import read_gguf  # imports the gguf package

        if quantize is not None:
            raise ConfigError("quantize", quantize, f"{path} is a GGUF file, already quantized")
        model, config, tok, eos, weight_format = read_gguf(path, torch_dtype, dev, tokenizer,
                                                           torch.device(expert_device) if expert_device else None)
        return LoadedModel(model, config, tok, eos, path, torch_dtype, dev, weight_format)
    config = ModelConfig.from_file(path / "config.json")
    scheme = scheme_from_config(_raw_config(path / "config.json"), str(path / "config.json"))
    if scheme is not None and quantize is not None:
        raise ConfigError("quantize", quantize, f"{path} is already quantized ({scheme.describe()})")
    model = load_model(path, config, torch_dtype, dev, torch.device(expert_device) if expert_device else None,
                       scheme)
    weight_format = scheme.describe() if scheme is not None else _DTYPE_NAMES[torch_dtype]
    if quantize is not None:
        weight_format = quantize_model(model, quantize)
    model.weight_format = weight_format
    tok = Tokenizer.from_dir(path) if tokenizer else None
    return LoadedModel(model, config, tok, read_eos_token_ids(path, tok), path, torch_dtype, dev, weight_format)


def _load_synthetic(spec: str, dtype: str | torch.dtype, device: str | torch.device, tokenizer: bool,
                    expert_device: str | torch.device | None, quantize: str | None) -> LoadedModel:
    """A synthetic source (engine.model.synthetic): its weights generated on the device from their seeds;
    `quantize` fp8 or int4: its experts generated straight into a quantized store (per-channel FP8, or 4-bit
    codes with a scale and offset per group), its other projections rounded after."""
    if quantize not in (None, "fp8", "int4"):
        raise ConfigError("quantize", quantize, f"{spec} is generated at load; of the quantized forms it has fp8 "
                          "(per channel) and int4 (per group) only")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    name = spec[len(SYNTHETIC_PREFIX):]
    model = build_synthetic(name, torch_dtype, dev, torch.device(expert_device) if expert_device else None,
                            experts_format=quantize)
    model.weight_format = quantize_model(model, quantize) if quantize else _DTYPE_NAMES[torch_dtype]
    tok, eos = synthetic_tokenizer() if tokenizer else (None, synthetic_tokenizer()[1])
    return LoadedModel(model, model.config, tok, eos, Path(spec), torch_dtype, dev, model.weight_format)


def model_config(model: str | Path) -> ModelConfig:
    """The ModelConfig of a `--model` value without loading it: a synthetic source's, or config.json's."""
    if is_synthetic(model):
        return SYNTHETIC_SPECS[str(model)[len(SYNTHETIC_PREFIX):]].config
    return ModelConfig.from_file(resolve_model_path(model) / "config.json")


def _raw_config(path: Path) -> dict:
    try:
        raw = json.loads(read_small_file(path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(path), f"cannot read JSON: {exc}") from None
    return raw if isinstance(raw, dict) else {}
