"""POST /strata/expert-cache: the MoE expert cache's budget retuned live, on a real engine (CPU) behind uvicorn.

A shrink gives the pools back at once and publishes an `expert` shrink event; a grow takes the budget back
(on CPU there are no VRAM books to measure, so it grows to the target at once, as at start). Greedy output
after a shrink is the all-resident run's (misses change where experts live, never the sums)."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.engine_helpers import shared_lively_checkpoint
from tests.engine.server.real import random_checkpoint, real_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def moe_served(tmp_path_factory):
    # wider experts (0.19 MiB each), so whole-MiB budgets name a few slots and 1 MiB falls below the minimum
    ckpt = shared_lively_checkpoint(tmp_path_factory, size="moe-tiny", hidden_size=256)
    with real_server(str(ckpt), batch=2, context=256, api_key="k3y") as running:
        yield running


AUTH = {"Authorization": "Bearer k3y"}


def _post(url: str, body, **kw) -> httpx.Response:
    return httpx.post(url + "/strata/expert-cache", json=body, headers=AUTH, timeout=60, **kw)


def _greedy(url: str, model: str) -> str:
    body = {"model": model, "prompt": [5, 9, 33, 2, 17, 40, 8], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_shrink_then_grow_live_publishes_events_and_keeps_greedy_output(moe_served) -> None:
    url, client, _ = moe_served
    state = httpx.get(url + "/strata/state", headers=AUTH, timeout=10).json()["experts"]
    assert state["slots"] == state["num_experts"] == 16  # all resident by default
    resident = _greedy(url, client.model_name)
    per_slot_mib = state["num_layers"] * state["expert_mib"]
    small_mib = int(per_slot_mib * 4) + 1  # a few slots per layer (plus each layer's miss slot)
    small_slots = int(small_mib // per_slot_mib) - 1
    assert 1 <= small_slots < 8
    before = client.bus.last_seq
    shrunk = _post(url, {"mib": small_mib})
    assert shrunk.status_code == 200, shrunk.text
    body = shrunk.json()
    assert body["expert_cache_mib"] == small_mib
    assert body["experts"]["slots"] == body["experts"]["target_slots"] == small_slots
    assert body["experts"]["mib"] <= small_mib
    events = [e for e in client.bus.history(before) if e.type == "expert"]
    assert any(e.action == "shrink" and e.slots == small_slots and "expert cache" in e.reason for e in events), events
    assert any(e.type == "vram" and e.experts_mib == pytest.approx(body["experts"]["mib"], abs=0.1)
               for e in client.bus.history(before))
    snap = httpx.get(url + "/strata/state", headers=AUTH, timeout=10).json()["experts"]
    assert snap["slots"] == snap["target_slots"] == small_slots
    assert _greedy(url, client.model_name) == resident  # misses now, same tokens
    assert httpx.get(url + "/strata/state", headers=AUTH, timeout=10).json()["experts"]["misses"] > 0
    before = client.bus.last_seq
    grown = _post(url, {"mib": 1 << 20})  # more than every expert: capped at every expert
    assert grown.status_code == 200 and grown.json()["experts"]["slots"] == 16, grown.text
    assert any(e.type == "expert" and e.action == "grow" and e.slots == 16 for e in client.bus.history(before))


def test_bad_budgets_are_400_naming_mib(moe_served) -> None:
    url, client, _ = moe_served
    slots = httpx.get(url + "/strata/state", headers=AUTH, timeout=10).json()["experts"]["slots"]
    for body, param in (({"mib": 0}, "mib"), ({"mib": -5}, "mib"), ({"mib": "64"}, "mib"), ({"mib": 2.5}, "mib"),
                        ({"mib": True}, "mib"), ({"mib": 1 << 30}, "mib"), ({}, "mib"), ({"mib": 9, "x": 1}, "x")):
        resp = _post(url, body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)
    tiny = _post(url, {"mib": 1})  # below one slot per layer plus the miss slots
    assert tiny.status_code == 400 and tiny.json()["error"]["param"] == "mib" and "minimum" in tiny.text
    assert httpx.post(url + "/strata/expert-cache", json={"mib": 64}, timeout=10).status_code == 401
    form = httpx.post(url + "/strata/expert-cache", content=b"mib=64", headers={**AUTH, "Content-Type":
                      "application/x-www-form-urlencoded"}, timeout=10)
    assert form.status_code == 415
    assert httpx.get(url + "/strata/state", headers=AUTH, timeout=10).json()["experts"]["slots"] == slots


def test_dense_model_answers_409(tmp_path_factory) -> None:
    ckpt = random_checkpoint(tmp_path_factory.mktemp("dense"))
    with real_server(str(ckpt), batch=1, context=128) as (url, _, _):
        resp = httpx.post(url + "/strata/expert-cache", json={"mib": 64}, timeout=30)
        assert resp.status_code == 409, resp.text
        err = resp.json()["error"]
        assert err["code"] == "no_expert_cache" and "no MoE layers" in err["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
