"""The strata-tiny recipe on CPU: corpus, tokenizer, packing, metrics, training loop, export, card, and a rehearsal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from engine.model import load_checkpoint
from engine.train.__main__ import main as train_main
from engine.train.card import render_card
from tests.engine.model.card_figures import read_card_figures
from engine.train.corpus import collect, is_heldout
from engine.train.evaluate import EvalFigures, evaluate
from engine.train.export import write_checkpoint
from engine.train.loop import Trainer, TrainSettings, lr_at
from engine.train.packing import BatchSampler, eval_windows, pack_documents, pack_documents_parallel
from engine.train.recipe import ArchSettings, build_model
from engine.train.sample import choose_sample, sample_documents, sample_text, sample_windows
from engine.train.tokenizer_train import EOT_TOKEN, eot_id, train_tokenizer

TINY_ARCH = ArchSettings(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=64)


def _py(i: int) -> str:
    return f"def function_{i}(value):\n    result = value * {i} + {i % 7}\n    return result\n\n\nclass Thing{i}:\n    pass\n"


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    for i in range(300):
        (root / f"pkg{i % 5}").mkdir(exist_ok=True)
        (root / f"pkg{i % 5}" / f"mod_{i}.py").write_text(_py(i))
    (root / "dup_a.py").write_text(_py(3))  # the same content as pkg3/mod_3.py
    (root / "minified.py").write_text("x=1;" * 400 + "\n")
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    (root / "notes.txt").write_text("not python\n")
    return root


@pytest.fixture(scope="module")
def tokenizer(source_tree: Path):
    corpus = collect([str(source_tree)])
    return train_tokenizer((f.text for f in corpus.train), vocab_size=600)


# --- corpus --------------------------------------------------------------------------------------------------


def test_collect_dedups_by_content_and_keeps_only_source(source_tree: Path) -> None:
    corpus = collect([str(source_tree)], heldout_per_mille=100)
    texts = [f.text for f in corpus.train + corpus.heldout]
    assert len(texts) == len(set(texts)) == 300
    assert corpus.duplicates == 1
    assert corpus.rejected == 2  # minified and non-UTF-8; notes.txt is never a candidate
    assert all(f.path.endswith(".py") for f in corpus.train)


def test_split_is_by_content_hash_and_repeatable(source_tree: Path) -> None:
    first = collect([str(source_tree)], heldout_per_mille=100)
    second = collect([str(source_tree)], heldout_per_mille=100)
    assert [f.sha256 for f in first.heldout] == [f.sha256 for f in second.heldout]
    assert all(is_heldout(f.sha256, 100) for f in first.heldout)
    assert not any(is_heldout(f.sha256, 100) for f in first.train)
    assert 10 <= len(first.heldout) <= 60  # about 10% of 300 files


def test_size_cap_drops_files_and_counts_them(source_tree: Path) -> None:
    capped = collect([str(source_tree)], max_total_bytes=5000)
    kept = sum(f.num_bytes for f in capped.train + capped.heldout)
    assert 0 < kept <= 5000
    assert capped.capped == 300 - len(capped.train) - len(capped.heldout)


def test_collect_names_a_missing_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        collect([str(tmp_path / "nowhere")])


# --- tokenizer and packing -----------------------------------------------------------------------------------


def test_tokenizer_round_trips_any_text_and_has_one_eot(tokenizer) -> None:
    text = "def f(x):\n\treturn 'naïve ✓ 日本'  # ok\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.get_vocab_size() <= 600
    assert tokenizer.encode(EOT_TOKEN).ids == [eot_id(tokenizer)]


def test_tokenizer_rejects_a_vocab_that_cannot_pack() -> None:
    with pytest.raises(ValueError, match="vocab_size=70000"):
        train_tokenizer(["x = 1\n"], vocab_size=70000)


def test_pack_puts_eot_after_each_document_and_parallel_matches(tokenizer) -> None:
    docs = [_py(i) for i in range(5000)]
    eos = eot_id(tokenizer)
    serial = pack_documents(docs, lambda batch: [e.ids for e in tokenizer.encode_batch(batch)], eos)
    assert int((serial == eos).sum()) == len(docs)
    assert serial[-1] == eos
    assert np.array_equal(pack_documents_parallel(docs, tokenizer, eos, workers=2), serial)


def test_eval_windows_are_consecutive_rows_of_t_plus_two() -> None:
    stream = np.arange(50, dtype=np.uint16)
    rows = eval_windows(stream, seq_tokens=8)
    assert rows.shape == (5, 10)
    assert rows[1, 0].item() == 10
    with pytest.raises(ValueError, match="no window of 10 tokens"):
        eval_windows(stream[:9], seq_tokens=8)


def test_batch_sampler_is_seeded() -> None:
    stream = np.arange(1000, dtype=np.uint16)
    a = BatchSampler(stream, 16, 4, seed=7, device=torch.device("cpu"))
    b = BatchSampler(stream, 16, 4, seed=7, device=torch.device("cpu"))
    batch = a.next_batch()
    assert torch.equal(batch, b.next_batch())
    assert batch.shape == (4, 18)
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 17, dtype=torch.long))  # contiguous windows


# --- metrics -------------------------------------------------------------------------------------------------


class _SuccessorModel(nn.Module):
    """A model with known answers: the main head predicts (token + 1) % V; the MTP head predicts next_id + 1.

    Hidden states are one-hot rows of the token, so logits = hidden @ shift picks the successor.
    """

    def __init__(self, vocab: int, mtp_offset: int = 1) -> None:
        super().__init__()
        self.vocab = vocab
        self.mtp_offset = mtp_offset
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, ids, positions, kv):
        return nn.functional.one_hot(ids, self.vocab).float() * self.scale

    def logits(self, hidden):
        return hidden.roll(1, dims=-1) * 10  # one-hot of t -> peak at t + 1

    def mtp(self, hidden, next_ids, positions, kv, depth=0):
        return nn.functional.one_hot((next_ids + self.mtp_offset - 1) % self.vocab, self.vocab).float()

    def draft_logits(self, h_mtp, depth=0):
        return self.logits(h_mtp)


def test_metrics_on_a_model_with_known_answers() -> None:
    counting = torch.arange(40).reshape(2, 20) % 16  # every next token is the successor
    figures = evaluate(_SuccessorModel(16), counting)
    assert figures.next_token_accuracy == 1.0 and figures.mtp_accuracy == 1.0 and figures.mtp_agreement == 1.0
    assert figures.tokens == 2 * 18

    # an MTP head that predicts next + 2 never agrees with the main model's successor choice
    assert evaluate(_SuccessorModel(16, mtp_offset=2), counting).mtp_agreement == 0.0


def test_agreement_compares_draft_with_main_greedy_not_with_truth() -> None:
    torch.manual_seed(0)
    random_ids = torch.randint(0, 16, (4, 30))
    figures = evaluate(_SuccessorModel(16), random_ids)
    # on random text the main model is usually wrong, but the draft (next + 1) always equals its greedy choice
    assert figures.next_token_accuracy < 0.3
    assert figures.mtp_agreement == 1.0


# --- training loop -------------------------------------------------------------------------------------------


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    s = TrainSettings(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, s, 100) == pytest.approx(1e-4)
    assert lr_at(9, s, 100) == pytest.approx(1e-3)
    assert lr_at(100, s, 100) == pytest.approx(1e-4)
    assert lr_at(40, s, 100) > lr_at(70, s, 100)


def test_settings_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="mtp_distill=2"):
        TrainSettings(steps=10, mtp_distill=2).validate()
    with pytest.raises(ValueError, match="steps or time_budget_s"):
        TrainSettings().validate()


def _repeating_stream(vocab: int) -> np.ndarray:
    pattern = np.array([1, 5, 9, 2, 7, 3, 8, 4, 6, 10, 11, 12], dtype=np.uint16)
    return np.tile(pattern, 400) % vocab


def test_training_the_real_model_learns_both_heads() -> None:
    stream = _repeating_stream(32)
    model = build_model(TINY_ARCH, 32, seed=0, device=torch.device("cpu"))
    rows = eval_windows(stream, 24, max_windows=4)
    before = evaluate(model, rows)
    settings = TrainSettings(seq_tokens=24, batch_seqs=8, lr=1e-2, warmup_steps=5, steps=60, eval_every_steps=20,
                             mtp_distill=0.5)
    result = Trainer(model, BatchSampler(stream, 24, 8, 0, torch.device("cpu")), rows, settings, log=lambda m: None).run()
    after = evaluate(model, rows)
    assert after.loss < before.loss - 1.0
    assert after.next_token_accuracy > 0.9 and after.mtp_accuracy > 0.9
    assert [h["step"] for h in result.history] == [20, 40, 60]
    assert after.loss == pytest.approx(result.best.loss, abs=1e-4)  # the kept weights are the best evaluated


def test_trainer_keeps_the_best_checkpoint_not_the_last() -> None:
    stream = _repeating_stream(32)
    model = build_model(TINY_ARCH, 32, seed=0, device=torch.device("cpu"))
    rows = eval_windows(stream, 24, max_windows=4)
    # a learning rate this large makes later evaluations worse than earlier ones
    settings = TrainSettings(seq_tokens=24, batch_seqs=8, lr=3.0, warmup_steps=1, steps=30, eval_every_steps=3,
                             patience_evals=100, min_lr_ratio=1.0)
    result = Trainer(model, BatchSampler(stream, 24, 8, 0, torch.device("cpu")), rows, settings, log=lambda m: None).run()
    losses = [h["loss"] for h in result.history]
    assert result.best.loss == min(losses)
    assert evaluate(model, rows).loss == pytest.approx(min(losses), abs=1e-4)


# --- export, sample, card ------------------------------------------------------------------------------------


def test_export_round_trips_through_the_engine_loader(tmp_path: Path, tokenizer) -> None:
    model = build_model(TINY_ARCH, tokenizer.get_vocab_size(), seed=1, device=torch.device("cpu"))
    write_checkpoint(model, tokenizer, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_position_embeddings"] == 262144
    assert config["num_nextn_predict_layers"] == 1
    assert config["eos_token_id"] == eot_id(tokenizer)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    layers = TINY_ARCH.num_hidden_layers
    assert {f"model.layers.{layers}.eh_proj.weight", f"model.layers.{layers}.shared_head.norm.weight"} <= names

    lm = load_checkpoint(tmp_path, dtype="float32", device="cpu")
    rows = torch.randint(0, tokenizer.get_vocab_size(), (2, 18))
    expected = model.to(torch.bfloat16).float()  # the checkpoint holds bf16-rounded weights
    ours, theirs = evaluate(expected, rows), evaluate(lm.model, rows)
    assert ours.loss == pytest.approx(theirs.loss, abs=1e-5)
    assert ours.mtp_agreement == theirs.mtp_agreement
    assert lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("# assistant:\n")
    assert lm.eos_token_ids == (eot_id(tokenizer),)


def test_sample_text_splits_back_into_the_same_windows(tokenizer) -> None:
    docs = choose_sample([_py(i) for i in range(200)] + ["x = '<|endoftext|>'\n"], max_bytes=4000)
    assert 0 < len(docs) < 200 and all(EOT_TOKEN not in d for d in docs)
    text = sample_text(docs)
    assert sample_documents(text) == docs
    rows = sample_windows(text, lambda s: tokenizer.encode(s).ids, eot_id(tokenizer), seq_tokens=16)
    stream = pack_documents(docs, lambda b: [tokenizer.encode(s).ids for s in b], eot_id(tokenizer))
    assert torch.equal(rows, eval_windows(stream, 16))
    with pytest.raises(ValueError, match="no documents"):
        sample_documents("")


def _figures(x: float) -> dict[str, float]:
    return EvalFigures(loss=x, mtp_loss=x + 1, next_token_accuracy=x / 10, mtp_accuracy=x / 20,
                       mtp_agreement=x / 5, tokens=1234).as_dict()


def test_card_figures_read_back(tmp_path: Path) -> None:
    report = {
        "command": "python -m engine.train --out X", "corpus": {"train_files": 3}, "model": {"parameters": 5},
        "settings": {"lr": 0.002}, "environment": {"gpu": "none"},
        "train": {"planned_steps": 10, "steps_run": 10}, "history": [],
        "sample_figures": _figures(2.5), "full_figures": _figures(3.0),
    }
    (tmp_path / "MODEL_CARD.md").write_text(render_card(report))
    figures = read_card_figures(tmp_path / "MODEL_CARD.md")
    assert figures["sample"]["mtp_agreement"] == pytest.approx(0.5)
    assert figures["full"]["next_token_accuracy"] == pytest.approx(0.3)
    assert figures["full"]["tokens"] == 1234
    (tmp_path / "broken.md").write_text("# nothing\n")
    with pytest.raises(ValueError, match="next-token accuracy"):
        read_card_figures(tmp_path / "broken.md")


# --- the whole recipe ----------------------------------------------------------------------------------------


def test_rehearsal_writes_a_loadable_checkpoint_whose_card_matches(tmp_path: Path) -> None:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"]) / "email"  # a few hundred KB of real Python
    out = tmp_path / "tiny"
    argv = ["--out", str(out), "--root", str(root), "--tiny", "--steps", "6", "--device", "cpu", "--seq-tokens", "32",
            "--batch-seqs", "4", "--warmup-steps", "2", "--eval-every-steps", "3", "--vocab-size", "600",
            "--tokenizer-sample-mib", "1", "--heldout-per-mille", "150"]
    assert train_main(argv) == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                               "generation_config.json", "MODEL_CARD.md", "heldout_sample.txt"}
    card = read_card_figures(out / "MODEL_CARD.md")
    lm = load_checkpoint(out, dtype="float32", device="cpu")
    rows = sample_windows((out / "heldout_sample.txt").read_text(), lm.tokenizer.encode, lm.eos_token_ids[0])
    measured = evaluate(lm.model, rows)
    assert measured.next_token_accuracy == pytest.approx(card["sample"]["next_token_accuracy"], abs=1e-4)
    assert measured.mtp_agreement == pytest.approx(card["sample"]["mtp_agreement"], abs=1e-4)
    assert "--steps 6" in (out / "MODEL_CARD.md").read_text()
    assert math.isfinite(card["full"]["loss"])
