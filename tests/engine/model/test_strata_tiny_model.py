"""The shipped builtin:strata-tiny: its files, its card's figures re-measured on CPU, and that it writes Python."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.model import load_checkpoint, resolve_model_path
from tests.engine.model.dense_kv import DenseKVCache
from engine.train.card import CARD_FILE
from tests.engine.model.card_figures import read_card_figures
from engine.train.evaluate import evaluate
from engine.train.sample import SAMPLE_FILE, sample_windows

MODEL = "builtin:strata-tiny"
MAX_DIRECTORY_BYTES = 40 * 1000 * 1000
CARD_TOLERANCE = 0.02
AGREEMENT_GOAL = 0.6


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def lm():
    return load_checkpoint(MODEL, dtype="auto", device="cpu")  # auto is fp32 on CPU: what the card was measured in


def test_shipped_directory_is_a_standard_checkpoint_within_budget(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", CARD_FILE, SAMPLE_FILE}
    assert expected <= names, f"missing: {expected - names}"
    assert sum(p.stat().st_size for p in model_dir.iterdir()) <= MAX_DIRECTORY_BYTES
    assert (model_dir / SAMPLE_FILE).stat().st_size <= 200 * 1024

    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["max_position_embeddings"] == 262144
    assert config["num_nextn_predict_layers"] == 1
    mtp_layer = config["num_hidden_layers"]  # DeepSeek layout: the MTP layer follows the main stack
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert f"model.layers.{mtp_layer}.eh_proj.weight" in keys
    assert f"model.layers.{mtp_layer}.self_attn.q_proj.weight" in keys
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())


def test_loader_reads_the_mtp_head_and_eos(lm) -> None:
    assert lm.model.mtp_depth_layers == 1
    assert lm.eos_token_ids == (lm.tokenizer.token_to_id("<|endoftext|>"),)
    assert lm.dtype == torch.float32


def test_card_figures_hold_on_the_shipped_sample(lm, model_dir: Path) -> None:
    card = read_card_figures(model_dir / CARD_FILE)
    rows = sample_windows((model_dir / SAMPLE_FILE).read_text(), lm.tokenizer.encode, lm.eos_token_ids[0])
    measured = evaluate(lm.model, rows, batch_rows=4)
    assert measured.tokens == card["sample"]["tokens"]
    assert measured.next_token_accuracy == pytest.approx(card["sample"]["next_token_accuracy"], abs=CARD_TOLERANCE)
    assert measured.mtp_agreement == pytest.approx(card["sample"]["mtp_agreement"], abs=CARD_TOLERANCE)
    assert measured.loss == pytest.approx(card["sample"]["loss"], abs=0.05)
    # the goal, on the full held-out set as the card records it
    assert card["full"]["mtp_agreement"] >= AGREEMENT_GOAL


@torch.no_grad()
def test_greedy_continuation_of_a_def_is_an_indented_body(lm) -> None:
    prompt_ids = lm.tokenizer.encode("def fibonacci(n):")
    kv = DenseKVCache.for_config(lm.config, batch_size=1, max_tokens=64)
    ids = torch.tensor([prompt_ids])
    hidden = lm.model(ids, torch.arange(len(prompt_ids))[None], kv)
    generated: list[int] = []
    for _ in range(16):
        next_id = int(lm.model.logits(hidden[:, -1]).argmax(-1))
        generated.append(next_id)
        position = len(prompt_ids) + len(generated) - 1
        hidden = lm.model(torch.tensor([[next_id]]), torch.tensor([[position]]), kv)
    text = lm.tokenizer.decode(generated)
    first_line = text.lstrip("\n").splitlines()[0]
    assert text.startswith("\n") and first_line.startswith("    ") and first_line.strip(), repr(text)
