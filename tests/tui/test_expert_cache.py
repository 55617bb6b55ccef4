"""The expert-cache panel and its budget keys, against tests/tui/fake_engine.py serving a recorded MoE state
(fixtures/moe_state.json, recorded from the real engine on CPU by fixtures/record_moe.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from strata_tui.widgets.expert_panel import ExpertPanel
from tests.tui.conftest import FAKE_ENGINE, FIXTURES, fake_engine_app, offline_app, screen_text, wait_for

SIZE = (160, 50)
MOE_STATE = FIXTURES / "moe_state.json"
SLOT_MIB = 3 * 0.1875  # the recorded model: 3 sparse layers of 0.1875 MiB experts


def _log_has(app, text: str) -> bool:
    return any(text in line for _, line in app.view.log_lines)


@pytest.fixture
def moe_engine(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENGINE_EXPERTS", str(MOE_STATE))


async def test_panel_shows_the_cache_and_greater_than_grows_it_live_and_saves(config_dir: Path, monkeypatch,
                                                                              moe_engine) -> None:
    ProfileStore(config_dir).save(Profile("default"))
    path = ProfileStore(config_dir).path("default")
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.monitor.experts is not None, what="the experts section")
        await pilot.pause(0.3)
        app.screen.redraw(force=True)
        await pilot.pause()
        panel = app.screen.query_one(ExpertPanel)
        assert panel.display
        text = screen_text(app)
        assert "Expert cache" in text and "slots 4/16" in text and "hits 41.3%" in text and "oracle" in text
        assert ">< Experts" in text  # the footer shows the keys for an MoE engine
        await pilot.press("greater_than_sign")
        await wait_for(pilot, lambda: "applied live" in app.view.expert_note, what="the budget applied")
        mib = app.store.load("default").engine.expert_cache_mib
        assert mib == 4 and _log_has(app, "POST /strata/expert-cache mib=4")  # ceil(0.5625 x (4 + 2))
        assert "expert_cache_mib = 4" in path.read_text()
        await wait_for(pilot, lambda: app.view.monitor.experts.slots == 6, what="the grown cache")
        # the VRAM event comes on the event stream, whose reads are posted in batches: up to half a refresh later
        vram = app.view.monitor.vram
        await wait_for(pilot, lambda: "cpu" in vram and vram["cpu"].experts_mib == pytest.approx(SLOT_MIB * 7),
                       what="the VRAM books with the grown cache")
        await pilot.press("less_than_sign")
        await wait_for(pilot, lambda: app.store.load("default").engine.expert_cache_mib == 3, what="shrink saved")
        await wait_for(pilot, lambda: app.view.monitor.experts.slots == 4, what="the shrunk cache")


async def test_a_dense_engine_shows_no_panel_and_no_keys(config_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv("FAKE_ENGINE_EXPERTS", raising=False)
    ProfileStore(config_dir).save(Profile("default"))
    before = ProfileStore(config_dir).path("default").read_text()
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        await pilot.pause(0.3)
        assert app.view.monitor.experts is None and not app.screen.query_one(ExpertPanel).display
        assert "Experts" not in screen_text(app)
        await pilot.press("greater_than_sign")
        await pilot.pause(0.3)
        assert not _log_has(app, "POST /strata/expert-cache")
        assert ProfileStore(config_dir).path("default").read_text() == before


async def test_attach_mode_applies_the_budget_and_writes_nothing(config_dir: Path, monkeypatch, moe_engine) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "serve")
    monkeypatch.delenv("FAKE_ENGINE_EVENTS", raising=False)
    engine = subprocess.Popen([*FAKE_ENGINE, "serve"], stdout=subprocess.PIPE, text=True)
    try:
        line = engine.stdout.readline()
        while "ready at" not in line:
            line = engine.stdout.readline()
        store = ProfileStore(config_dir)
        store.save(Profile("default"))
        store.set_last_used("default")
        before = store.path("default").read_text()
        app = offline_app(config_dir, attach_url=line.split()[-1])
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.monitor.experts is not None, what="the experts section")
            await pilot.press("less_than_sign")
            await wait_for(pilot, lambda: "applied live" in app.view.expert_note, what="applied live")
            # 4 -> the largest whole MiB under 4 slots' budget: 2 MiB, 2 slots (0.5625 MiB a slot per layer)
            assert app.view.monitor.experts.slots == 2 and "saved" not in app.view.expert_note
        assert store.path("default").read_text() == before
    finally:
        engine.kill()
        engine.wait()


def _seed_scale_state(path: Path) -> Path:
    """The recorded state grown to the seed's scale: 49 sparse layers (48 + MTP) x 512 experts, one cold layer."""
    import json

    doc = json.loads(MOE_STATE.read_text())
    experts = doc["experts"]
    rates = [0.95 - 0.01 * (i % 7) for i in range(49)]
    rates[17] = 0.31  # one cold layer: it must show, not be averaged away or cut off
    experts.update(num_layers=49, num_experts=512, slots=435, target_slots=435,
                   layers=[{"layer": i, "hits": 0, "misses": 0, "evictions": 0, "hit_rate": r}
                           for i, r in enumerate(rates)])
    out = path / "moe_seed_scale.json"
    out.write_text(json.dumps(doc))
    return out


async def test_the_panel_reads_well_at_48_layers_of_512_experts_at_100x30(config_dir: Path, monkeypatch,
                                                                         tmp_path: Path) -> None:
    monkeypatch.setenv("FAKE_ENGINE_EXPERTS", str(_seed_scale_state(tmp_path)))
    ProfileStore(config_dir).save(Profile("default"))
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.view.monitor.experts is not None, what="the experts section")
        await pilot.pause(0.3)
        app.screen.redraw(force=True)
        await pilot.pause()
        panel = app.screen.query_one(ExpertPanel)
        lines = [line for line in screen_text(app).splitlines() if "L0-48" in line]
        assert len(lines) == 1, screen_text(app)  # the layers are one heat row, not 49 lines
        row = lines[0]
        assert "worst L17 31%" in row  # the cold layer is named, and the row still fits the panel's line
        cells = row.split("L0-48 ", 1)[1].split("  worst", 1)[0]
        assert 8 <= len(cells.strip()) <= min(49, panel.content_size.width)
        assert "slots 435/512" in screen_text(app)
