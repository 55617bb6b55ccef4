"""The load scenarios against a real `strata-engine serve` on CPU (a tiny random checkpoint)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.loadgen.scenarios import run_scenario

ROOT = Path(__file__).resolve().parents[3]
READY_PREFIX = "strata-engine: ready at "
# The shorts are admitted and decoding before the long prompt is sent (0.2 s once left a short without its first
# token on a busy runner: it was still queued when the long prompt took the prefill).
SHORTS_HEAD_START_S = 1.0
# Room for the shorts that decode "until the long prompt is done": on a busy CI runner the 2500-token prefill
# is paced against their decode, and at 4096 one of them once filled its context first.
CONTEXT_TOKENS = 16384


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from engine.model.random_checkpoint import write_random_checkpoint

    model = write_random_checkpoint(tmp_path_factory.mktemp("tiny"), size="tiny")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # stderr to a file: a pipe nobody drains would block the server once its access log fills it
    err_path = tmp_path_factory.mktemp("serve") / "stderr.log"
    err_file = err_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--device", "cpu", "--batch", "4",
         "--context", str(CONTEXT_TOKENS), "--port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err_file, text=True)
    url: list[str] = []

    def read_ready() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                url.append(line[len(READY_PREFIX):].split()[0])
                return

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(timeout=60)
    try:
        if not url:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail(f"strata-engine serve did not become ready: {err_path.read_text()[-2000:]}")
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        err_file.close()


async def test_reuse_against_the_real_engine_reports_a_cache_hit(server_url: str) -> None:
    # ignore_eos: a random checkpoint may draw EOS early, and the count would no longer be 4
    result = await run_scenario("reuse", server_url, long_tokens=1500, max_tokens=4, ignore_eos=1)
    assert result.ok, result.errors
    first, second = result.requests
    assert first.prompt_tokens == second.prompt_tokens == 1500
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert first.completion_tokens == second.completion_tokens == 4


async def test_seed_against_the_real_engine_completes_and_stays_healthy(server_url: str) -> None:
    events: list[str] = []
    result = await run_scenario("seed", server_url, on_progress=lambda p: events.append(p.event), concurrency=3,
                                short_prompt_tokens=16, delay_s=SHORTS_HEAD_START_S, long_tokens=2500, long_max_tokens=2)
    assert result.ok, result.errors
    assert result.health_after.startswith("200")
    long = result.requests[-1]
    assert long.label == "long" and long.prompt_tokens == 2500 and long.cached_tokens == 0
    shorts = result.requests[:-1]
    assert all(r.finish_reason == "cancelled" and 0 < r.completion_tokens < CONTEXT_TOKENS - 16 for r in shorts), \
        [r.summary() for r in shorts]
    assert events[-1] == "done" and events.count("finished") == 4
    # Stopping the shorts closed their streams: the server must have aborted them and freed their slots.
    async with httpx.AsyncClient() as http:
        for _ in range(50):
            slots = (await http.get(server_url + "/strata/state")).json()["slots"]
            if all(s["state"] == "idle" for s in slots):
                break
            await asyncio.sleep(0.1)
    assert all(s["state"] == "idle" for s in slots), slots


async def test_seed_with_every_slot_taken_frees_one_for_the_long_prompt(server_url: str) -> None:
    # 4 shorts on the server's 4 slots, decoding until the long prompt is done: without a freed slot the long
    # prompt would wait until a short filled its context.
    result = await run_scenario("seed", server_url, concurrency=4, short_prompt_tokens=16, delay_s=SHORTS_HEAD_START_S,
                                long_tokens=2500, long_max_tokens=2)
    assert result.ok, result.errors
    first, kept, long = result.requests[0], result.requests[1:4], result.requests[-1]
    assert long.first_token_s is not None and first.end_s <= long.first_token_s
    assert all(r.end_s >= long.end_s and r.completion_tokens < CONTEXT_TOKENS - 16 for r in kept), \
        (long.summary(), [(r.summary(), r.end_s) for r in kept])
    assert any("1 stopped" in note for note in result.notes), result.notes
    assert result.metrics["short_decode_tok_s_during_long_prefill"] > 0


async def test_a_long_prompt_past_the_real_context_is_refused_up_front(server_url: str) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=f"long_tokens={CONTEXT_TOKENS + 1000}.*context is {CONTEXT_TOKENS} tokens"):
        await run_scenario("seed", server_url, long_tokens=CONTEXT_TOKENS + 1000, delay_s=0)
