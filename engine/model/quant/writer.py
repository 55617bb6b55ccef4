"""Write a quantized model as a compressed-tensors checkpoint (`strata-engine quantize`), the layout llmcompressor
writes and vLLM, SGLang and transformers read, so a model quantized once starts fast everywhere (block FP8 in
Qwen's own FP8 layout).

    save_quantized(lm, "out/")   # config.json (+ quantization_config), model.safetensors, tokenizer files

* fp8 (per channel): `weight` e4m3 [N, K], `weight_scale` [N, 1]; format float-quantized, the FP8_DYNAMIC
  scheme (activations quantized per token at run time, as the Hopper prompt path does).
* fp8-block: Qwen's `*-FP8` layout instead (quant_method fp8, `weight_block_size` [128, 128]): `weight` e4m3,
  `weight_scale_inv` [N/128, K/128]; layers left in 16 bits are stored as such (the loaders tell them by dtype).
* int4 (group): `weight_packed` int32 [N, K/8] (dense: value i at bits 4i, plus 8), `weight_scale` [N, K/G],
  `weight_zero_point` packed along the output rows [N/8, K/G], `weight_shape`; format pack-quantized, the
  W4A16 asymmetric group scheme.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from engine.errors import ConfigError
from engine.model.names import hf_name
from engine.model.quant.linear import Fp8Linear, IntGroupLinear, QuantLinear, pack_codes
from engine.model.quant.rtn import quantizable
from engine.model.saver import write_config_files, write_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IGNORED = ["lm_head", "re:.*eh_proj$", "re:.*mlp\\.gate$"]  # what rtn.quantizable leaves in 16 bits
QWEN_FP8_BLOCK = 128


def _qwen_blocks(layer: Fp8Linear) -> bool:
    return (layer.block_n, layer.block_k) == (QWEN_FP8_BLOCK, QWEN_FP8_BLOCK)


def quantized_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every parameter and every quantized layer's compressed-tensors tensors."""
    if getattr(model, "fused", False):
        raise ValueError("save the model before fuse_projections(): the checkpoint layout has separate q/k/v")
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            prefix = hf_name(f"{name}.weight", model.config)[:-len(".weight")]
            yield from ((f"{prefix}.{leaf}", t) for leaf, t in _layer_tensors(module))
    for name, param in model.named_parameters():
        yield hf_name(name, model.config), param.detach()


def _layer_tensors(layer: QuantLinear) -> list[tuple[str, torch.Tensor]]:
    if isinstance(layer, Fp8Linear):
        if _qwen_blocks(layer):
            return [("weight", layer.weight), ("weight_scale_inv", layer.weight_scale.to(torch.float32))]
        if (layer.block_n, layer.block_k) != (1, layer.in_features):
            raise ValueError(f"fp8 is written per channel or in blocks of {QWEN_FP8_BLOCK}x{QWEN_FP8_BLOCK} (this "
                             f"layer has blocks {layer.block_n}x{layer.block_k})")
        return [("weight", layer.weight), ("weight_scale", layer.weight_scale.to(torch.float32))]
    assert isinstance(layer, IntGroupLinear) and layer.bits == 4 and layer.perm is None
    scale = layer.scales.to(torch.float32)
    zero = torch.round(-layer.offsets.to(torch.float32) / scale).clamp(0, 15).to(torch.int32)  # unsigned zero
    zero_packed = pack_codes(zero.t().contiguous(), 4).t().contiguous()  # along the output rows
    return [("weight_packed", pack_codes(layer.codes(), 4)), ("weight_scale", scale),  # the kernels' layout unpacked
            ("weight_zero_point", zero_packed),
            ("weight_shape", torch.tensor([layer.out_features, layer.in_features], dtype=torch.int64))]


def kept_as_loaded(model: nn.Module) -> list[str]:
    """The checkpoint names of the projections rtn.quantize_model kept in 16 bits (4-bit codes fill whole words:
    inputs not a multiple of 8), which the config's `ignore` must name for a reader not to expect them packed."""
    return [hf_name(f"{name}.weight", model.config)[:-len(".weight")] for name, module in model.named_modules()
            if type(module) is nn.Linear and quantizable(name)]


def quantization_config(model: nn.Module) -> dict[str, Any]:
    """The compressed-tensors quantization_config of a model quantized by engine.model.quant.rtn."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        raise ValueError("the model has no quantized layers")
    for name, module in model.named_modules():  # checked before anything is written
        if isinstance(module, IntGroupLinear) and module.out_features % 8:
            layer = hf_name(f"{name}.weight", model.config)[:-len(".weight")]
            raise ConfigError("format", "int4", f"{layer} has {module.out_features} outputs, not a multiple of 8: "
                              "compressed-tensors packs 4-bit zero points 8 to a word along them")
    kinds = {(m.format, getattr(m, "group_size", None), isinstance(m, Fp8Linear) and _qwen_blocks(m)) for m in layers}
    if len(kinds) != 1:
        raise ValueError(f"one scheme per checkpoint: the layers mix {sorted(map(str, kinds))}")
    fmt, group, blocks = kinds.pop()
    if blocks:  # Qwen's FP8 layout (transformers' FineGrainedFP8, vLLM and SGLang read it)
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [QWEN_FP8_BLOCK, QWEN_FP8_BLOCK]}
    if fmt == "fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                   "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
                  "group_size": None, "block_structure": None, "actorder": None, "observer": None}
        format_name = "float-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group,
                   "dynamic": False, "block_structure": None, "actorder": None, "observer": "minmax"}
        inputs = None
        format_name = "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": format_name,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None, "format": format_name}},
        "ignore": IGNORED + kept_as_loaded(model),
        "kv_cache_scheme": None,
    }


def save_quantized(model: nn.Module, source_dir: Path, out_dir: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Path:
    """config.json with the quantization_config, generation_config.json, the weights, and the source's
    tokenizer files."""
    out = Path(out_dir)
    config = quantization_config(model)
    write_config_files(out, model.config, eos_token_ids)
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_tensors(out, quantized_tensors(model))
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file() and source_dir.resolve() != out.resolve():
            shutil.copy(source_dir / name, out / name)
    return out
