"""`strata-engine bench scenario NAME --url URL` against a stand-in server on a real loopback socket."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import uvicorn

from engine.bench import command as cli_bench
from engine.errors import ConfigError
from tests.engine.loadgen.test_scenarios_fakeserver import AsgiAdapter, FakeOpenAIServer


def _serve(server: FakeOpenAIServer) -> Iterator[str]:
    config = uvicorn.Config(AsgiAdapter(server), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert uv.started, "stand-in server did not start"
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def fake() -> FakeOpenAIServer:
    return FakeOpenAIServer(vocab_size=500, context_tokens=50_000, long_prompt_tokens=1000)


@pytest.fixture
def url(fake: FakeOpenAIServer) -> Iterator[str]:
    yield from _serve(fake)


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    return cli_bench.run(parser.parse_args(argv))


def test_cli_plays_seed_and_writes_json(url: str, fake: FakeOpenAIServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "seed.json"
    status = _bench(["scenario", "seed", "--url", url, "--json", str(out), "--set", "concurrency=2",
                     "--set", "long_tokens=3000", "--set", "short_max_tokens=40", "--set", "delay_s=0.05"])
    assert status == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "scenario" and doc["params"]["long_tokens"] == 3000
    assert [r["label"] for r in doc["rows"]] == ["short-0", "short-1", "long"]
    assert doc["rows"][2]["prompt_tokens"] == 3000 and doc["rows"][2]["completion_tokens"] == 16
    assert doc["summary"]["ok"] is True and doc["summary"]["health_after"].startswith("200")
    printed = capsys.readouterr()
    assert "short-1" in printed.out and "first_token" in printed.err
    assert max(len(b["prompt"]) for b in fake.bodies) == 3000


def test_cli_exits_1_when_the_engine_dies(url: str, fake: FakeOpenAIServer, tmp_path: Path, capsys) -> None:
    fake.die_on_long = True
    fake.token_interval_s = 0.02
    out = tmp_path / "dead.json"
    status = _bench(["scenario", "seed", "--url", url, "--json", str(out), "--set", "concurrency=1",
                     "--set", "long_tokens=2000", "--set", "delay_s=0.05"])
    assert status == 1
    doc = json.loads(out.read_text())
    assert doc["summary"]["health_after"] == "503 dead: CUDA error: out of memory"
    assert any(e.startswith("long:") for e in doc["scenario"]["errors"])
    assert "error: long:" in capsys.readouterr().out


def test_cli_bad_set_is_a_config_error(url: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--set='long_tokens'.*NAME=VALUE"):
        _bench(["scenario", "seed", "--url", url, "--json", str(tmp_path / "x.json"), "--set", "long_tokens"])
    with pytest.raises(ConfigError, match="scenario='flood'"):
        _bench(["scenario", "flood", "--url", url, "--json", str(tmp_path / "x.json")])


def test_size_lists_accept_k_suffixes() -> None:
    assert cli_bench.int_list("32K,128k,6") == [32768, 131072, 6]
    with pytest.raises(argparse.ArgumentTypeError, match="'x1'"):
        cli_bench.int_list("1,x1")
