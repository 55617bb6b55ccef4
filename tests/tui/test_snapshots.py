"""SVG snapshots of the monitor, profiles and crash views, fed by recorded telemetry (tests/tui/fixtures).

Update after an intended change: pytest tests/tui/test_snapshots.py --snapshot-update
"""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_tui.engine_io.gpu import GpuSample
from strata_tui.engine_io.messages import EngineExited, EngineOutput, TelemetryBatch
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from tests.tui.conftest import fixed_config_dir, offline_app, recorded, screen_text, wait_for

SIZE = (160, 48)
# A fixed directory: the profiles screen shows its path, and a tmp path would change every run.
SNAP_CONFIG = Path("/tmp/strata-tui-snapshot-config")

LOG = [("stdout", "strata-engine: loading builtin:strata-tiny on cuda:0"),
       ("stdout", "strata-engine: ready at http://127.0.0.1:8765"),
       ("stderr", "\x1b[33mWARNING\x1b[0m graphs: draft_round b7 captured after freeing own graphs and waiting 240 ms"),
       ("stderr", "WARNING switches: SPLIT_ATTN degraded: CUDA error: out of memory")]


@pytest.fixture
def snap_dir(utc) -> Path:
    with fixed_config_dir(SNAP_CONFIG) as path:
        yield path


async def _settle(pilot) -> None:
    """Handle every queued message, draw now instead of waiting for the refresh tick, then wait until two renders
    50 ms apart agree: on a loaded runner a table's rows can land a refresh after the messages that filled it (the
    crash panel's graph-event rows would then be read blank). Each render is read once the app has handled what
    the last one queued (a table's new height after its rows went, its repaint): two reads 50 ms apart of an app
    the machine's load kept from running would agree on a half-drawn screen."""
    await pilot.pause()
    pilot.app.screen.redraw(force=True)
    last = None
    for _ in range(40):
        await pilot.pause(0.05)
        await pilot.pause()
        now = screen_text(pilot.app)
        if now == last:
            return
        last = now


def _gpu_second(app, second: int) -> None:
    used = 120_000.0 + 300 * second
    app.view.gpu_history.add([
        GpuSample(0, "NVIDIA H200", used, 143771.0, 60.0 + second % 30, 58.0 + second % 5, 480.0),
        GpuSample(1, "NVIDIA H200", 9000.0, 143771.0, None, 41.0, None),
    ])
    app.view.gpu_unavailable = None


def _gpu_minute(app) -> None:
    for second in range(60):
        _gpu_second(app, second)


def _history_of(app, events: list, seconds: int = 60) -> None:
    """The recorded run folded in over `seconds` one-second samples (as the app's history tick takes them), so the
    history panel shows the run as it went; the GPU readings move with it."""
    step = max(1, len(events) // seconds)
    for second in range(seconds):
        app.view.monitor.apply_all(events[second * step:(second + 1) * step], 1000.0)
        _gpu_second(app, second)
        app.sample_history()


@pytest.mark.parametrize("size", [SIZE, (100, 30), (200, 55)], ids=["160x48", "100x30", "200x55"])
def test_monitor_during_long_prompt_admission(snap_compare, snap_dir: Path, size: tuple[int, int]) -> None:
    ProfileStore(snap_dir).save(Profile("seed").with_switch("SPLIT_ATTN", True))
    app = offline_app(snap_dir, profile="seed", history_interval_s=None)

    async def run_before(pilot) -> None:
        app.clock = lambda: 1000.0  # the ETA counts down on this clock: frozen, the picture is fixed
        app.post_message(EngineOutput(LOG))
        _history_of(app, recorded("seed_run.jsonl"))
        app.view.changed()
        await _settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_profiles_with_a_broken_file(snap_compare, snap_dir: Path) -> None:
    store = ProfileStore(snap_dir)
    store.open_initial()
    store.save(Profile("seed-6slots").with_engine(batch=6, batch_mtp=True, kv="int8", kv_resident=16384,
                                                  context=262144, vram_reserve_mib=1280)
               .with_switch("SPLIT_ATTN", True))
    (store.profiles_dir / "typo.toml").write_text('[engine]\nmodel = "builtin:strata-tiny"\nkv = "fp8"\n')
    app = offline_app(snap_dir, history_interval_s=None)

    async def run_before(pilot) -> None:
        await pilot.press("p")
        await pilot.pause()
        screen = pilot.app.screen
        await wait_for(pilot, lambda: screen.reads_done >= 1, what="the profiles read")
        await pilot.press("down", "down")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("size", [SIZE, (100, 30)], ids=["160x48", "100x30"])
def test_crash_panel(snap_compare, snap_dir: Path, size: tuple[int, int]) -> None:
    app = offline_app(snap_dir, history_interval_s=None)

    async def run_before(pilot) -> None:
        app.clock = lambda: 1000.0
        app.post_message(EngineOutput(LOG + [("stderr", "runner.decode: RuntimeError: CUDA error: an illegal "
                                                        "memory access was encountered")]))
        app.post_message(TelemetryBatch(recorded("crash_run.jsonl")))
        await pilot.pause(0.3)
        app.post_message(EngineExited(1, False, None, app.run_id))
        await _settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_monitor_with_an_moe_engine_at_100x30(snap_compare, snap_dir: Path) -> None:
    """An MoE engine recorded on CPU (fixtures/record_moe.py): the expert-cache panel and `experts` in the books."""
    import json

    from strata_tui.engine_io.messages import StateSnapshot
    from tests.tui.conftest import FIXTURES

    ProfileStore(snap_dir).save(Profile("moe"))
    app = offline_app(snap_dir, profile="moe", history_interval_s=None)
    state = json.loads((FIXTURES / "moe_state.json").read_text())

    async def run_before(pilot) -> None:
        app.clock = lambda: 1000.0
        app.post_message(StateSnapshot(state))  # as on a connection: the state first, then the events
        app.post_message(TelemetryBatch(recorded("moe_run.jsonl")))
        await _settle(pilot)

    assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)
