"""`bench peers` at tiny sizes on CPU: Strata, HF transformers eager and static-cache, and the bandwidth floor
are all measured on the same checkpoint in one run. No timing assertions."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from engine.bench.common import device_of, prepare_model, weight_bytes
from engine.bench.peers import copy_bandwidth_gb_s, hf_generate_tok_s
from tests.engine.bench.test_bench import TINY, _checkpoint_cache_and_one_thread, bench  # noqa: F401 (fixture)


def test_peers_measures_every_engine_on_the_same_weights(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["peers", *TINY, "--batches", "1,2", "--prompt-tokens", "8", "--new-tokens", "6",
                           "--copy-mib", "8", "--repeats", "3"])
    by = {(r["engine"], r["batch"]): r for r in doc["rows"]}
    assert set(by) == {(e, b) for e in ("floor", "strata", "hf_eager", "hf_static") for b in (1, 2)}
    for (engine, _), row in by.items():
        assert row["error"] is None, row
        assert row["tok_s"] > 0
        if engine != "floor":  # the figure is the median of three timed calls, each kept
            assert len(row["tok_s_runs"]) == 3 and row["tok_s"] == statistics.median(row["tok_s_runs"]), row
    assert math.isclose(by[("floor", 2)]["tok_s"], 2 * by[("floor", 1)]["tok_s"])
    summary = doc["summary"]
    path = prepare_model("random:tiny", device_of("cpu"))
    assert math.isclose(summary["weight_mib"], weight_bytes(path) / 2**20)
    assert math.isclose(summary["floor_b1_tok_s"], summary["copy_bandwidth_gb_s"] * 1e9 / weight_bytes(path))
    assert math.isclose(summary["strata_vs_hf_eager_b1"], by[("strata", 1)]["tok_s"] / by[("hf_eager", 1)]["tok_s"])
    assert summary["meets_b1_target"] in (True, False)
    assert doc["env"]["transformers"]


def test_hf_peer_failure_is_recorded_not_raised(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3"}')  # no weights: transformers cannot load it
    result = hf_generate_tok_s(str(broken), torch.device("cpu"), torch.float32, [[1, 2]], 2,
                               static=False, compile_=False)
    assert result["tok_s"] is None and result["wall_s"] is None
    assert result["error"] and ":" in result["error"] and result["error"].split(":")[0].endswith("Error")


def test_copy_bandwidth_is_positive_and_finite() -> None:
    bw = copy_bandwidth_gb_s(torch.device("cpu"), 4)
    assert 0 < bw < 1e5


def test_repeats_below_one_are_refused_by_name(tmp_path: Path, capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        bench(tmp_path, ["peers", *TINY, "--repeats", "0"])
    assert "'0' is not a whole number of at least 1" in capsys.readouterr().err
