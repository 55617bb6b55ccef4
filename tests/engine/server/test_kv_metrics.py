"""`--kv-resident` in /strata/state and Prometheus: the typed snapshot round-trips the paging section and the
per-slot placement, an older engine's JSON (without them) still parses, and the collector's series carry the
host-held bytes and the spill / fetch traffic of a real engine that spilled."""

from __future__ import annotations

import pytest
from engine.api import Health, HealthStatus, SamplingParams
from engine.server.kv_metrics import kv_metric_families
from engine.server.metrics import ServerMetrics
from engine.snapshot import EngineSnapshot
from tests.engine.engine_helpers import make_engine, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _series(state: EngineSnapshot) -> str:
    """What GET /metrics answers for an engine that published `state` (the server reads the published one)."""

    class _Published:
        def state(self):
            return state

        def health(self):
            return Health(HealthStatus.READY)

    return ServerMetrics(_Published()).render().decode()


def test_state_and_prometheus_series_of_an_engine_that_spilled(ckpt):
    engine = make_engine(ckpt, batch=4, context=1024, kv_resident=128, tier_budget_mib=0.0)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(4, seed=71, lengths=(400, 800))):
        engine.add_request(f"r{i}", prompt, params)
    state = None
    while engine.has_work:
        engine.step()
        state = engine.state().to_json()
        if state["kv"]["paging"]["host_mib"] > 0 and any(s["kv_host_tokens"] for s in state["slots"]):
            break
    assert state is not None and state["kv"]["paging"]["host_mib"] > 0
    snap = EngineSnapshot.from_json(state)
    assert snap.kv.paging.spilled_mib == state["kv"]["paging"]["spilled_mib"] > 0
    assert [s.kv_host_tokens for s in snap.slots] == [s["kv_host_tokens"] for s in state["slots"]]
    assert snap.to_json()["kv"] == state["kv"]
    text = _series(snap)
    host_bytes = state["kv"]["paging"]["host_mib"] * (1 << 20)
    assert f"strata_kv_host_bytes {host_bytes}" in text
    assert "strata_kv_spilled_bytes_total" in text and "strata_kv_fetch_seconds_total" in text
    busy = next(s for s in state["slots"] if s["kv_host_tokens"])
    assert f'strata_kv_slot_tokens{{slot="{busy["slot"]}",where="host"}} {float(busy["kv_host_tokens"])}' in text
    # vLLM's names under this project's prefix: pool use, preemptions (a slot spilled to make room), requests
    paging = state["kv"]["paging"]
    assert paging["preemptions"] > 0 and paging["preemption_cause"]
    assert f'strata_num_preemptions_total{{cause="pool_short"}} {float(paging["preemptions"])}' in text
    usage = (paging["pool_blocks"] - paging["free_pool_blocks"]) / paging["pool_blocks"]
    assert f"strata_kv_cache_usage_perc {usage}" in text and 0 < usage <= 1
    assert f"strata_num_requests_running {float(sum(s['state'] != 'idle' for s in state['slots']))}" in text
    assert "strata_num_requests_waiting 0.0" in text


def test_an_older_engines_state_without_paging_still_parses_and_yields_no_kv_series():
    old = {"kv": {"storage": "int8", "mib": 12.0, "context_tokens": 4096, "slots": 2},
           "slots": [{"slot": 0, "state": "decode", "prompt_tokens": 10}]}
    snap = EngineSnapshot.from_json(old)
    assert snap.kv.paging is None and snap.slots[0].kv_host_tokens == 0
    assert list(kv_metric_families(snap)) == [] and list(kv_metric_families(EngineSnapshot())) == []
