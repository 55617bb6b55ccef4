"""`bench peers`' llama.cpp peer: the checkpoint's GGUF export read back by Strata's own GGUF loader (the same
logits as the checkpoint it came from, so llama.cpp is given the very weights Strata decodes), a missing
llama-server refused in one line before anything is measured, and (marker `llamacpp`) a real llama-server measured
on those weights beside Strata in one run. No timing assertions."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.bench.common import device_of, prepare_model
from engine.bench.gguf_export import export_gguf
from engine.errors import ConfigError
from engine.model import load_checkpoint
from tests.engine.bench.test_bench import TINY, _checkpoint_cache_and_one_thread, bench  # noqa: F401 (fixture)


def _logits(lm, tokens: int = 12) -> torch.Tensor:
    ids = (torch.arange(tokens)[None] * 37) % lm.config.vocab_size
    with torch.no_grad():
        return lm.model.logits(lm.model(ids, torch.arange(tokens)[None])).float()


def test_gguf_export_reads_back_as_the_same_model(tmp_path: Path) -> None:
    checkpoint = Path(prepare_model("random:tiny+mtp", device_of("cpu")))
    out = export_gguf(checkpoint, tmp_path / "peer.gguf")
    assert out.is_file() and not (tmp_path / "peer.gguf.partial").exists()
    source = load_checkpoint(str(checkpoint), dtype="float32", device="cpu")
    back = load_checkpoint(str(out), dtype="float32", device="cpu")
    assert back.config.vocab_size == source.config.vocab_size
    assert back.config.num_hidden_layers == source.config.num_hidden_layers
    assert torch.equal(_logits(source), _logits(back))
    text = "the quick brown fox, 42 times"
    assert back.tokenizer.encode(text) == source.tokenizer.encode(text)

    import gguf

    names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
    assert not any("mtp" in n or n.startswith("blk.2.") for n in names), sorted(names)  # the MTP layer left out


def test_gguf_export_q8_0_is_close_and_smaller(tmp_path: Path) -> None:
    checkpoint = Path(prepare_model("random:tiny", device_of("cpu")))
    same = export_gguf(checkpoint, tmp_path / "same.gguf")
    q8 = export_gguf(checkpoint, tmp_path / "q8.gguf", weight_type="q8_0")
    assert q8.stat().st_size < same.stat().st_size
    source = _logits(load_checkpoint(str(checkpoint), dtype="float32", device="cpu", tokenizer=False))
    quantized = _logits(load_checkpoint(str(q8), dtype="float32", device="cpu", tokenizer=False))
    assert not torch.equal(source, quantized)
    assert (source - quantized).abs().max().item() < 0.05 * source.abs().max().item()


def test_gguf_export_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    checkpoint = Path(prepare_model("random:tiny", device_of("cpu")))
    with pytest.raises(ConfigError, match="weight_type.*'q4'"):
        export_gguf(checkpoint, tmp_path / "x.gguf", weight_type="q4")
    llama = tmp_path / "llama"
    shutil.copytree(checkpoint, llama)
    config = (llama / "config.json").read_text().replace('"model_type": "qwen3"', '"model_type": "llama"')
    (llama / "config.json").write_text(config)
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        export_gguf(llama, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_llamacpp_peer_without_a_server_is_one_line_before_any_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("STRATA_LLAMA_SERVER", raising=False)
    with pytest.raises(ConfigError, match="llama-server.*--llama-server PATH"):
        bench(tmp_path, ["peers", *TINY, "--peers", "llamacpp", "--llama-server", str(tmp_path / "nope")])
    assert not (tmp_path / "peers.json").exists()


def _llama_server() -> str | None:
    from tests.tui.test_llamacpp_real import find_llama_server

    return find_llama_server()


@pytest.mark.llamacpp
def test_llamacpp_peer_measures_llama_server_on_the_same_weights(tmp_path: Path) -> None:
    server = os.environ.get("STRATA_LLAMA_SERVER") or _llama_server()
    if not server:
        pytest.skip("no llama-server: run scripts/build_llama_server.sh (or set STRATA_LLAMA_SERVER)")
    doc = bench(tmp_path, ["peers", *TINY, "--batches", "1,2", "--prompt-tokens", "8", "--new-tokens", "6",
                           "--copy-mib", "8", "--repeats", "1", "--peers", "llamacpp", "--llama-server", server])
    by = {(r["engine"], r["batch"]): r for r in doc["rows"]}
    for batch in (1, 2):
        row = by[("llamacpp", batch)]
        assert row["error"] is None, row
        assert row["tok_s"] > 0 and row["version"].startswith("version")
    assert doc["summary"]["strata_vs_llamacpp_b2"] == by[("strata", 2)]["tok_s"] / by[("llamacpp", 2)]["tok_s"]


@pytest.mark.llamacpp
def test_one_gguf_file_read_by_both_engines(tmp_path: Path) -> None:
    server = os.environ.get("STRATA_LLAMA_SERVER") or _llama_server()
    if not server:
        pytest.skip("no llama-server: run scripts/build_llama_server.sh (or set STRATA_LLAMA_SERVER)")
    from engine.bench.gguf_export import main as export_main

    gguf_file = tmp_path / "tiny-q8_0.gguf"
    assert export_main(["random:tiny", str(gguf_file), "--type", "q8_0"]) == 0
    doc = bench(tmp_path, ["peers", "--model", str(gguf_file), "--device", "cpu", "--batches", "1",
                           "--prompt-tokens", "8", "--new-tokens", "6", "--copy-mib", "8", "--repeats", "1",
                           "--peers", "llamacpp,eager", "--llama-server", server])
    by = {r["engine"]: r for r in doc["rows"]}
    assert by["strata"]["error"] is None and by["strata"]["tok_s"] > 0
    assert by["llamacpp"]["error"] is None and by["llamacpp"]["tok_s"] > 0
    assert by["hf_eager"]["tok_s"] is None and "dequantize" in by["hf_eager"]["error"]
    assert doc["summary"]["weight_mib"] == gguf_file.stat().st_size / 2**20
