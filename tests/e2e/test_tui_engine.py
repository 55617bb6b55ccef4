"""End to end: the TUI launches the real strata-engine on CPU from a profile, requests are sent, and the slots
table on screen changes as they are served. Then the engine is stopped with the app's own key."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from strata_tui.app import create_app
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from tests.tui.conftest import screen_text

pytestmark = pytest.mark.slow
SLOT_ROW = re.compile(r"[│┃]\s*(\d+)\s+(idle|prefill|decode|finished|aborted|error)\s+(\S*)")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from engine.model.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-mtp", mtp_layout="deepseek", seed=1)


async def _send(url: str, n: int, max_tokens: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> int:
            body = {"model": model, "prompt": [5 + i + j % 300 for j in range(48 + 40 * i)],
                    # ignore_eos: a random checkpoint may emit eos at once and finish between two screen polls
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            return response.status_code
        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_tui_launches_engine_and_shows_slots_changing(tmp_path: Path, checkpoint: Path) -> None:
    config_dir = tmp_path / "config"
    ProfileStore(config_dir).save(Profile("e2e").with_engine(
        model=str(checkpoint), device="cpu", batch=4, batch_mtp=True, context=2048, port=0))
    app = create_app(config_dir=config_dir, profile="e2e", engine_cwd=str(ROOT))
    async with app.run_test(size=(160, 48)) as pilot:
        deadline = time.monotonic() + 180
        while not app.view.telemetry_connected:
            assert app.view.crash is None, f"engine exited: {app.view.crash.error}\n" + "\n".join(l for _, l in app.view.log_lines)
            assert time.monotonic() < deadline, "engine never became ready"
            await pilot.pause(0.2)
        # 1,024 tokens each: on a loaded box the app may miss a shorter busy spell between two of its polls
        requests = asyncio.create_task(_send(app.view.engine_url, 4, 1024))
        seen: dict[str, list[tuple[str, str]]] = {}
        while not requests.done():
            for slot, state, request in SLOT_ROW.findall(screen_text(app)):
                history = seen.setdefault(slot, [])
                if not history or history[-1] != (state, request):
                    history.append((state, request))
            await pilot.pause(0.25)
        assert await requests == [200, 200, 200, 200]
        await pilot.pause(0.5)
        for slot, state, request in SLOT_ROW.findall(screen_text(app)):
            seen.setdefault(slot, []).append((state, request))
        busy = [(s, h) for s, h in seen.items() if any(st in ("prefill", "decode") and rq for st, rq in h)]
        assert busy, f"no slot was ever shown busy: {seen}"
        assert any(len(h) >= 2 for _, h in busy), f"no slot row changed on screen: {seen}"
        assert "engine ready" in screen_text(app)
        process = app.process
        await pilot.press("q")  # the quit stops the engine in a worker (SIGKILL after 2 s), then exits
        deadline = time.monotonic() + 5
        while process.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    assert not process.running


async def test_ttft_agrees_with_the_engines_prompt_rate_and_an_idle_pool_holds_nothing_in_use(
        tmp_path: Path, checkpoint: Path) -> None:
    """A 64-token prompt is prefilled in one chunk: its admission and first token are published in one step, a
    fraction of a millisecond apart, so the time between them read `TTFT 0.0s @ 69 tok/s` (the engine's own rate
    says 64 tokens took ~0.9 s). And once every slot is idle, the blocks the finished request held (given back at
    the engine's next step) are not shown as in use."""
    config_dir = tmp_path / "config"
    ProfileStore(config_dir).save(Profile("e2e").with_engine(
        model=str(checkpoint), device="cpu", batch=2, context=2048, kv_pool="by-use", port=0))
    app = create_app(config_dir=config_dir, profile="e2e", engine_cwd=str(ROOT), sampler_factory=None)
    async with app.run_test(size=(160, 48)) as pilot:
        deadline = time.monotonic() + 180
        while not app.view.telemetry_connected:
            assert app.view.crash is None, f"engine exited: {app.view.crash.error}"
            assert time.monotonic() < deadline, "engine never became ready"
            await pilot.pause(0.2)
        async with httpx.AsyncClient(base_url=app.view.engine_url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            body = {"model": model, "prompt": [5 + j for j in range(64)], "max_tokens": 16, "temperature": 0.0,
                    "ignore_eos": True}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        deadline = time.monotonic() + 30
        while True:
            admission = app.view.monitor.last_admission
            track = app.view.monitor.prefills.get(admission.request_id) if admission else None
            idle = app.view.monitor.slots and not app.view.monitor.any_running()
            if track is not None and track.ttft_s is not None and idle and app.view.monitor.kv_pool is not None:
                break
            assert time.monotonic() < deadline, "no first token, or the slots never went idle"
            await pilot.pause(0.1)
        # the TTFT shown covers at least the prompt's tokens at the engine's own prompt rate
        assert track.prompt_tok_s and track.ttft_s >= 0.95 * 64 / track.prompt_tok_s, (track.ttft_s, track.prompt_tok_s)
        # on screen at the monitor's next tick (a loaded machine may run it late)
        deadline = time.monotonic() + 10
        while (shown := re.search(r"TTFT ([\d.]+)(ms|s)\b", screen_text(app))) is None:
            assert time.monotonic() < deadline, screen_text(app)
            await pilot.pause(0.1)
        assert float(shown.group(1)) > 0, screen_text(app)
        # idle: nothing in use in the slots' title (on CPU the pool is read once more after the last request ends)
        await pilot.pause(1.5)
        title = app.screen.query_one("#slots").border_title
        assert " 0 used" in title or "KV pool" not in title, title
        await pilot.press("q")


async def test_strata_read_as_the_other_engines_shows_a_decode_rate_while_its_slots_decode(checkpoint: Path) -> None:
    """The endpoints row of a Strata engine (adapters/strata.py, as `--attach` with a Strata URL beside a vLLM one
    reads it) while four requests decode: its rate is never 0 (nor missing) while tokens flow, as the llama.cpp,
    vLLM and SGLang rows' are (tests/tui/test_engine_adapters.py)."""
    import sys

    from strata_tui.adapters import adapter_for
    from strata_tui.engine_io.launcher import READY_RE

    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine.cli", "serve", "--model", str(checkpoint), "--device", "cpu", "--batch", "4",
        "--context", "2048", "--port", "0", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        said: list[str] = []
        url = None
        while url is None:
            line = (await asyncio.wait_for(engine.stdout.readline(), 180)).decode(errors="replace")
            assert line, "the engine exited before it was ready:\n" + "".join(said[-10:])
            said.append(line)
            match = READY_RE.match(line.strip())
            url = match.group(1) if match else None

        async def drain() -> None:
            while await engine.stdout.read(65536):
                pass

        draining = asyncio.create_task(drain())
        requests = asyncio.create_task(_send(url, 4, 1500))
        adapter = adapter_for("strata", url)
        rates: list[float | None] = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            deadline = time.monotonic() + 120
            while len(rates) < 5 and not requests.done():
                assert time.monotonic() < deadline, f"never saw the slots decode: {rates}"
                view = await adapter.read(client)
                if view.running == 4:  # every slot holds a request: tokens are flowing
                    state = (await client.get("/strata/state")).json()
                    if all(s["state"] == "decode" and s["generated_tokens"] > 1 for s in state["slots"]):
                        rates.append(view.decode_tokens_s)
                await asyncio.sleep(0.3)
        assert len(rates) >= 3 and all(r is not None and r > 0 for r in rates), rates
        requests.cancel()
        draining.cancel()
    finally:
        engine.terminate()
        await engine.wait()
