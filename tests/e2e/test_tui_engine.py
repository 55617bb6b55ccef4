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
from strata_tui.profile_store import ProfileStore
from strata_tui.profiles import Profile
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
        requests = asyncio.create_task(_send(app.view.engine_url, 4, 256))
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
