"""A checkpoint whose logits are NaN (a broken final norm here) is answered with a clear error naming the
problem: not garbage text, not a 500 from serializing a NaN logprob, and never a non-JSON NaN in a stream.
The real AsyncEngine on CPU behind uvicorn."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.server.real import real_server


def _no_constants(name: str):
    raise AssertionError(f"a stream chunk holds {name}, which is not JSON")


@pytest.fixture(scope="module")
def nan_server(tmp_path_factory):
    from engine.model.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(tmp_path_factory.mktemp("nan") / "broken")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with real_server(str(path), batch=2, context=128) as (url, client, _):
        yield url, client.model_name


@pytest.mark.parametrize("fields", [{}, {"temperature": 0.0}, {"logprobs": 3}, {"temperature": 0.0, "logprobs": 2}])
def test_nan_logits_are_a_clear_error_not_text(nan_server, fields) -> None:
    url, model = nan_server
    resp = httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": "hello", "max_tokens": 4, **fields})
    assert resp.status_code == 500, resp.text
    error = resp.json()["error"]
    assert "non-finite logits" in error["message"], error


def test_a_stream_over_nan_logits_ends_with_an_error_chunk_all_json(nan_server) -> None:
    url, model = nan_server
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "logprobs": True, "top_logprobs": 2}) as resp:
        assert resp.status_code in (200, 500)
        text = resp.read().decode()
    if resp.status_code == 500:
        assert "non-finite logits" in json.loads(text)["error"]["message"]
        return
    payloads = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    parsed = [json.loads(p, parse_constant=_no_constants) for p in payloads[:-1]]
    assert any("non-finite logits" in (p.get("error") or {}).get("message", "") for p in parsed), text
