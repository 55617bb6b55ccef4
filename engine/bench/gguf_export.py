"""A Hugging Face Qwen3 / Qwen2 checkpoint directory written as a GGUF file for llama.cpp, with the `gguf` package.

`bench peers --peers llamacpp` runs llama.cpp on the very weights Strata decodes, so the file is a plain copy of the
checkpoint's tensors (BF16 stays BF16, F32 stays F32, F16 stays F16; `weight_type` "q8_0" or "q4_0" quantizes the
matrices with gguf's own quantizer, for the quantized comparison on one file), named as llama.cpp's converter names them. The MTP layer is left out: llama.cpp's
qwen3 has none. Qwen's converters keep the Hugging Face q / k row order, so nothing is permuted; a Llama
checkpoint (whose rows llama.cpp wants permuted) is refused. The tokenizer is the checkpoint's byte-level BPE
(`tokenizer.json`), padded with unused tokens to the embedding's row count, which llama.cpp requires to match.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import ConfigError

_ARCHITECTURES = ("qwen3", "qwen2")
_WEIGHT_TYPES = ("same", "q8_0", "q4_0")
# llama.cpp's token types: 1 normal, 3 control, 5 unused
_NORMAL, _CONTROL, _UNUSED = 1, 3, 5


def export_gguf(checkpoint: Path, out: Path, weight_type: str = "same") -> Path:
    """Write `checkpoint` (config.json, tokenizer.json, *.safetensors) as the GGUF file `out`; returns `out`.
    Written to a temporary name first, so an interrupted export never leaves a file that looks complete."""
    import gguf
    from safetensors import safe_open

    from engine.model.quant.gguf_file import gguf_name

    if weight_type not in _WEIGHT_TYPES:
        raise ConfigError("weight_type", weight_type, f"expected one of {', '.join(_WEIGHT_TYPES)}")
    config = json.loads((checkpoint / "config.json").read_text())
    arch = config.get("model_type")
    if arch not in _ARCHITECTURES:
        raise ConfigError("model", str(checkpoint), f"model_type {arch!r}: the GGUF export writes "
                                                    f"{', '.join(_ARCHITECTURES)} only")
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    writer.add_name(checkpoint.name)
    add_hyperparameters(writer, config)
    _add_tokenizer(writer, checkpoint, config["vocab_size"])
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for hf_name in tensors.keys():
                if _layer_index(hf_name) >= config["num_hidden_layers"]:
                    continue  # DeepSeek's layout stores the MTP layer as the layer after the last
                try:
                    name = gguf_name(hf_name.removeprefix("model."))
                except (KeyError, ValueError):
                    continue  # the MTP layer and anything else llama.cpp's qwen3 does not have
                _add_tensor(writer, name, tensors.get_tensor(hf_name), weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    return out


def add_hyperparameters(writer, config: dict, default_context_tokens: int = 32768) -> None:
    """The shape keys llama.cpp reads for a Qwen3-family model, from its HF config.json (head_dim derived where the
    config leaves it out)."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", default_context_tokens))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))


def _layer_index(hf_name: str) -> int:
    """model.layers.<i>.… -> i; -1 for tensors outside the layers."""
    parts = hf_name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def _add_tensor(writer, name: str, value, weight_type: str) -> None:
    import gguf
    import torch

    if weight_type != "same" and value.dim() == 2 and value.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType[weight_type.upper()]
        writer.add_tensor(name, gguf.quants.quantize(value.float().numpy(), qtype), raw_dtype=qtype)
    elif value.dim() == 1 or value.dtype == torch.float32:
        writer.add_tensor(name, value.float().numpy())  # llama.cpp's CPU kernels multiply norms in F32 only
    elif value.dtype == torch.bfloat16:
        writer.add_tensor(name, value.contiguous().view(torch.int16).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, value.to(torch.float16).numpy())


def _pre_tokenizer(tok: dict, checkpoint: Path) -> str:
    """llama.cpp's name for the tokenizer's split rule: GPT-2's byte-level regex, or Qwen2's (a Split then a
    byte-level step without its own regex)."""
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if pre.get("type") == "Sequence" and any(step.get("type") == "Split" for step in steps):
        return "qwen2"
    raise ConfigError("model", str(checkpoint), f"tokenizer.json's pre-tokenizer {pre.get('type')!r} has no "
                                                "llama.cpp equivalent the GGUF export knows")


def _add_tokenizer(writer, checkpoint: Path, vocab_size: int) -> None:
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    if tok.get("model", {}).get("type") != "BPE":
        raise ConfigError("model", str(checkpoint), "tokenizer.json is not a byte-level BPE: the GGUF export "
                                                    "writes llama.cpp's 'gpt2' tokenizer only")
    tokens: list[str | None] = [None] * vocab_size
    types = [_UNUSED] * vocab_size
    for text, index in tok["model"]["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = text, _NORMAL
    for added in tok.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = _CONTROL if added.get("special") else _NORMAL
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tok, checkpoint))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    generation = checkpoint / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    if eos is not None:
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_add_bos_token(False)
    tok_config = checkpoint / "tokenizer_config.json"
    template = json.loads(tok_config.read_text()).get("chat_template") if tok_config.is_file() else None
    if template:
        writer.add_chat_template(template)


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.bench.gguf_export CHECKPOINT OUT.gguf [--type q8_0]`: one file both engines of
    `bench peers --model OUT.gguf --peers llamacpp` read."""
    import argparse

    from engine.bench.common import device_of, prepare_model

    parser = argparse.ArgumentParser(prog="python -m engine.bench.gguf_export", description=main.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory, or random:SIZE (written as bench peers does)")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", default="same", choices=_WEIGHT_TYPES, help="the matrices' type (default: as stored)")
    args = parser.parse_args(argv)
    try:
        checkpoint = Path(prepare_model(args.checkpoint, device_of("cpu"), "bfloat16"))
        print(export_gguf(checkpoint, args.out, args.type))
    except ConfigError as exc:
        parser.exit(2, f"gguf_export: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
