"""`strata-engine generate` run for real in a subprocess: output on success, one clear line and exit 2 on errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[3]


def _generate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "engine.cli", "generate", "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_generate_prints_text_then_speed_line(tiny_checkpoint):
    result = _generate("--model", str(tiny_checkpoint), "--prompt", "Hello, world", "--max-tokens", "12",
                       "--temperature", "0.7", "--top-p", "0.9", "--seed", "5")
    assert result.returncode == 0, result.stderr
    *_, stats = result.stdout.rstrip("\n").splitlines()
    match = re.search(r"\[(\d+) tokens \((stop|length)\), prompt (\d+) tokens .* decode ([\d.]+) tokens/s", stats)
    assert match, stats
    assert 1 <= int(match.group(1)) <= 12 and int(match.group(3)) > 0 and float(match.group(4)) > 0
    again = _generate("--model", str(tiny_checkpoint), "--prompt", "Hello, world", "--max-tokens", "12",
                      "--temperature", "0.7", "--top-p", "0.9", "--seed", "5")
    assert again.stdout.splitlines()[:-1] == result.stdout.splitlines()[:-1]  # the seed makes it repeatable


def test_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    line = _one_error_line(_generate("--model", str(tmp_path), "--prompt", "hi"))
    assert str(tmp_path) in line and "no config.json" in line


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    line = _one_error_line(_generate("--model", str(tmp_path), "--prompt", "hi"))
    assert str(tmp_path / "config.json") in line and "unsupported architecture 'mamba'" in line


def test_missing_tensor(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    line = _one_error_line(_generate("--model", str(tmp_path), "--prompt", "hi"))
    assert "missing tensor model.layers.0.self_attn.k_norm.weight (expected shape [16])" in line
    assert str(tmp_path / "model.safetensors") in line


def test_shape_mismatch(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = torch.zeros(500, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    line = _one_error_line(_generate("--model", str(tmp_path), "--prompt", "hi"))
    assert "tensor model.embed_tokens.weight has shape [500, 64], expected [512, 64]" in line


@pytest.mark.parametrize("option,value", [("--max-tokens", "0"), ("--top-p", "1.5"), ("--temperature", "-1")])
def test_bad_sampling_option(tiny_checkpoint, option, value):
    line = _one_error_line(_generate("--model", str(tiny_checkpoint), "--prompt", "hi", option, value))
    assert option.lstrip("-").replace("-", "_") in line and value in line
