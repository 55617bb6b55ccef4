"""GET /metrics against the real engine on CPU with --batch-mtp (issue 15, item 5): every `strata_*` series
docs/API.md documents is exported, and the MTP ones carry the engine's real per-position counts."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server.real import real_server

pytestmark = pytest.mark.timeout(180)
API_MD = Path(__file__).resolve().parents[3] / "docs" / "API.md"


def documented_series() -> set[str]:
    """Every `strata_...` name in the metrics table of docs/API.md (labels stripped)."""
    text = API_MD.read_text()
    table = text[text.index("## Metrics"):]
    table = table[:table.index("\n## ", 5)]
    return {re.sub(r"\{.*", "", name) for name in re.findall(r"`(strata_[a-z_]+(?:\{[^`]*\})?)`", table)}


def test_every_documented_series_appears_with_real_mtp_counts(tmp_path: Path) -> None:
    from engine.model.random_checkpoint import write_random_checkpoint

    ckpt = write_random_checkpoint(tmp_path / "tiny-mtp", mtp_layout="deepseek")
    with real_server(str(ckpt), batch=2, context=512, batch_mtp=True, mtp_depth=2) as (url, client, _):
        for i in range(3):
            resp = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": client.model_name, "prompt": f"metrics {i}", "max_tokens": 12, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
        assert httpx.post(url + "/strata/switches/SPLIT_ATTN", json={"enabled": True}, timeout=10).status_code == 200
        text = httpx.get(url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name: s for f in families.values() for s in f.samples}
    exported = set(families) | set(samples)
    documented = documented_series()
    assert len(documented) >= 20, documented
    missing = sorted(n for n in documented if n not in exported and n.removesuffix("_total") not in exported)
    assert not missing, f"documented in docs/API.md but not exported: {missing}"

    def by_position(name: str) -> dict[str, float]:
        return {s.labels["position"]: s.value for s in families[name].samples if s.name.startswith(name)}

    proposed = by_position("strata_draft_tokens_proposed")
    accepted = by_position("strata_draft_tokens_accepted")
    ratio = by_position("strata_draft_acceptance_ratio")
    assert set(proposed) == {"0", "1"} and all(v > 0 for v in proposed.values())  # the real engine's counts
    assert all(0 <= accepted[p] <= proposed[p] for p in proposed)
    assert all(abs(ratio[p] - accepted[p] / proposed[p]) < 1e-9 for p in proposed)
    assert samples["strata_prefill_queue_tokens"].value == 0  # nothing left to prefill once all finished
    assert samples["strata_generation_tokens_total"].value == 36
