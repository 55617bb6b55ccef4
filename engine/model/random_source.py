"""`--model random:SIZE[+mtp]`: a random-weight model of one of random_checkpoint.SIZES' shapes, its weights
generated on the device at load (seeded), no checkpoint written or read.

    lm = load_random("random:8b", "bfloat16", "cuda:0", quantize="int4")   # as load_checkpoint loads a path

Writing the 8B shape's 16 GiB as safetensors and reading it back takes minutes; generating it where it runs
takes a second, so a benchmark can start an engine per weight format in its time limit. The weights are those of
`normal(0, 0.02)` from a generator seeded with `seed` on the device (norm weights 1 + 0.1 normal, biases 0.02
normal, as write_random_checkpoint draws them): the same spec, device and dtype give the same model, whichever
--quantize rounds it after. The source's directory (`source_dir`) holds what a checkpoint has besides the weights:
config.json, generation_config.json and the tokenizer (the tiny one: ids above 511 decode to nothing). The
engine takes the spec as --model (engine.orchestration.engine_setup loads it here instead of load_checkpoint).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from engine.errors import ConfigError
from engine.model.causal_lm import CausalLM
from engine.model.config import ModelConfig
from engine.model.loader import LoadedModel, read_eos_token_ids, resolve_device, resolve_dtype
from engine.model.quant.rtn import quantize_model
from engine.model.random_checkpoint import SIZES, random_config, write_tokenizer_files
from engine.model.saver import write_config_files
from engine.model.tokenizer import Tokenizer

RANDOM_PREFIX = "random:"
SEED = 0
# sizes the benchmarks leave to the engine to generate (engine.bench.common.prepare_model writes the others as a
# checkpoint, which the peers read too): writing them outruns a benchmark step's time limit
GENERATED_AT_LOAD = ("8b",)
_INIT_STD = 0.02  # transformers' initializer_range default, as write_random_checkpoint
_DIR_ENV = "STRATA_RANDOM_SOURCES"  # where the sources' config and tokenizer files go (default: the temp dir)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parse(spec: str) -> tuple[str, bool]:
    """`random:8b+mtp` -> ("8b", True); an unknown size or suffix is a ConfigError naming --model."""
    size, _, extra = spec[len(RANDOM_PREFIX):].partition("+")
    if extra not in ("", "mtp"):
        raise ConfigError("model", spec, "expected random:SIZE or random:SIZE+mtp")
    if size not in SIZES:
        raise ConfigError("model", spec, f"unknown random size; known: {', '.join(SIZES)}")
    return size, extra == "mtp"


def source_config(spec: str) -> ModelConfig:
    size, mtp = parse(spec)
    return random_config("qwen3", "deepseek" if mtp else None, size)


def source_dir(spec: str) -> Path:
    """The spec's directory of config and tokenizer files (written on first use, a few KiB, no weights)."""
    size, mtp = parse(spec)
    root = Path(os.environ.get(_DIR_ENV) or Path(tempfile.gettempdir()) / "strata-random-sources")
    directory = root / f"{size}-{'mtp' if mtp else 'nomtp'}"
    if not (directory / "config.json").is_file():
        config = source_config(spec)
        eos_ids = write_tokenizer_files(directory, min(512, config.vocab_size))
        write_config_files(directory, config, eos_ids)
    return directory


def _fill(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):  # near 1 but not 1, so tests can tell which norm was applied where
        return (1.0 + 0.1 * torch.randn(shape, device=device, generator=gen)).to(dtype)
    if name.endswith(".bias"):
        return (0.02 * torch.randn(shape, device=device, generator=gen)).to(dtype)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, _INIT_STD, generator=gen)


def load_random(spec: str, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
                tokenizer: bool = True, expert_device: str | torch.device | None = None,
                quantize: str | None = None, seed: int = SEED) -> LoadedModel:
    """The model of `spec`, its weights drawn on `device` (routed experts on `expert_device` when given), then
    rounded to `quantize` ("fp8" | "int4") when asked, one projection at a time (the 16-bit copy of a projection
    is freed as its quantized one replaces it). A synthetic source (random:moe-80b ...) is engine.model.synthetic's,
    which load_checkpoint builds."""
    from engine.model.synthetic import is_synthetic

    if is_synthetic(spec):
        from engine.model.loader import load_checkpoint

        return load_checkpoint(spec, dtype=dtype, device=device, tokenizer=tokenizer, expert_device=expert_device,
                               quantize=quantize)
    directory = source_dir(spec)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config = replace(source_config(spec), torch_dtype=str(torch_dtype).removeprefix("torch."))
    experts_at = torch.device(expert_device) if expert_device is not None else None
    with torch.device("meta"):
        model = CausalLM(config)
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in list(model.named_parameters()):
        where = experts_at if experts_at is not None and ".mlp.experts." in name else dev
        gen = gens.setdefault(where, torch.Generator(device=where).manual_seed(seed))
        module_name, _, leaf = name.rpartition(".")
        tensor = _fill(name, tuple(param.shape), torch_dtype, where, gen)
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))
    model.rotary.reset_parameters(dev)
    model.requires_grad_(False)
    model.eval()
    weight_format = _DTYPE_NAMES[torch_dtype]
    if quantize is not None:
        weight_format = quantize_model(model, quantize)
    model.weight_format = weight_format
    tok = Tokenizer.from_dir(directory) if tokenizer else None
    return LoadedModel(model, config, tok, read_eos_token_ids(directory, tok), directory, torch_dtype, dev,
                       weight_format)
