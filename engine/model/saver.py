"""Write a CausalLM as a Hugging Face checkpoint directory (config.json + safetensors), the loader's inverse."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.names import hf_name
from engine.model.causal_lm import CausalLM

DEFAULT_SHARD_MIB = 2048


def checkpoint_tensors(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every parameter, once each (shared ones under their one HF name)."""
    if model.fused:
        raise ValueError("save the model before fuse_projections(): the checkpoint layout has separate q/k/v")
    for name, param in model.named_parameters():
        yield hf_name(name, model.config), param.detach()


def write_config_files(directory: Path, config: ModelConfig, eos_token_ids: tuple[int, ...] = ()) -> None:
    """config.json and generation_config.json (eos ids)."""
    directory.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf()
    if eos_token_ids:
        hf["eos_token_id"] = eos_token_ids[-1]
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = {"eos_token_id": list(eos_token_ids)} if eos_token_ids else {}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_tensors(
    directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], shard_mib: int = DEFAULT_SHARD_MIB
) -> None:
    """model.safetensors, or shards plus model.safetensors.index.json when they exceed `shard_mib`.

    Tensors are consumed from an iterator and each shard is freed after it is written, so a generator of
    fresh tensors never needs the whole checkpoint in memory at once."""
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    shard_bytes, written, total_bytes = 0, 0, 0
    limit = shard_mib << 20
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes and shard_bytes + nbytes > limit:
            _write_shard(directory, shards[-1], written)
            written += 1
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.contiguous().cpu()
        weight_map[name] = written
        shard_bytes += nbytes
        total_bytes += nbytes
    if written == 0:
        save_file(shards[-1], str(directory / "model.safetensors"), metadata={"format": "pt"})
        _mode_as_created(directory / "model.safetensors")
        return
    _write_shard(directory, shards[-1], written)
    count = written + 1
    names = {i: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)}
    for i in range(count):
        (directory / f"shard-{i}.tmp").rename(directory / names[i])
        _mode_as_created(directory / names[i])
    index = {"metadata": {"total_size": total_bytes}, "weight_map": {n: names[i] for n, i in weight_map.items()}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _mode_as_created(path: Path) -> None:
    """The mode any file this process creates gets (0644 under the usual umask): safetensors writes its files 0600,
    so a quantized checkpoint's weights were unreadable to the other users its config and tokenizer files serve."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def _write_shard(directory: Path, shard: dict[str, torch.Tensor], index: int) -> None:
    # The final name needs the shard count, unknown until the end: write under a temporary name first.
    save_file(shard, str(directory / f"shard-{index}.tmp"), metadata={"format": "pt"})
    shard.clear()


def save_checkpoint(
    model: CausalLM, directory: str | Path, eos_token_ids: tuple[int, ...] = (), shard_mib: int = DEFAULT_SHARD_MIB
) -> Path:
    """Write config.json, generation_config.json and the weights (tokenizer files are the caller's)."""
    directory = Path(directory)
    write_config_files(directory, model.config, eos_token_ids)
    write_tensors(directory, checkpoint_tensors(model), shard_mib)
    return directory
