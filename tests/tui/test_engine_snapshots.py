"""SVG snapshots of the one monitor over each engine kind, at 200x55 and 100x30, fed by what each adapter read
from the replayed fixtures (tests/tui/fixtures/engines/). vLLM has two data-parallel replicas on two hosts,
one of them unreachable.

Update after an intended change: pytest tests/tui/test_engine_snapshots.py --snapshot-update
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest

from strata_tui.adapters import adapter_for
from strata_tui.adapters.view import EndpointView, ForeignView
from strata_tui.engine_io.gpu import GpuProcess, GpuSample
from strata_tui.engine_io.messages import EngineOutput
from strata_tui.profiles.kinds import KIND_NAMES
from tests.tui.conftest import fixed_config_dir, offline_app, screen_text
from tests.tui.engine_replay import replay_server, routes_for

SNAP_CONFIG = Path("/tmp/strata-tui-engine-snapshot-config")
UNREACHABLE_AT = 1_790_000_000.0  # a fixed wall clock, drawn as HH:MM:SS in UTC
LOGS = {
    "vllm": ["(APIServer pid=4242) INFO 10-02 12:00:04 [api_server.py:1805] vLLM API server version 0.10.1.1",
             "(APIServer pid=4242) INFO:     Application startup complete."],
    "sglang": ["[2026-10-02 12:00:09] The server is fired up and ready to roll!"],
    "llamacpp": ["main: server is listening on http://127.0.0.1:8080", "srv  update_slots: all slots are idle"],
}
HOSTS = {"vllm": ["gpu-node-1:8000", "gpu-node-2:8000"], "sglang": ["gpu-node-1:30000"],
         "llamacpp": ["127.0.0.1:8080"]}


def read_fixture(kind: str) -> EndpointView:
    async def read() -> EndpointView:
        with replay_server(routes_for(kind)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
                return await adapter_for(kind, server.url).read(client)
    return asyncio.run(read())


def foreign_view(kind: str) -> ForeignView:
    first = dataclasses.replace(read_fixture(kind), url=f"http://{HOSTS[kind][0]}", read_at=0.0)
    endpoints = [first]
    for host in HOSTS[kind][1:]:
        endpoints.append(EndpointView(f"http://{host}", kind, error="ConnectError: All connection attempts failed",
                                      unreachable_since=UNREACHABLE_AT))
    return ForeignView(kind, endpoints)


def gpus() -> list[GpuSample]:
    ranks = [GpuProcess(4301, "VLLM::Worker_TP0", 70_912.0), GpuProcess(4302, "VLLM::Worker_TP1", 70_880.0)]
    return [GpuSample(i, "NVIDIA H100 80GB HBM3", 72_100.0 - i * 31, 81_559.0, 93.0, 63.0 + i, 611.0 - i * 9,
                      (rank,)) for i, rank in enumerate(ranks)]


@pytest.fixture
def snap_dir(utc) -> Path:
    with fixed_config_dir(SNAP_CONFIG) as path:
        yield path


@pytest.mark.parametrize("size", [(200, 55), (100, 30)], ids=["200x55", "100x30"])
@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
def test_monitor_of_each_engine_kind(snap_compare, snap_dir: Path, kind: str, size: tuple[int, int]) -> None:
    view = foreign_view(kind)
    app = offline_app(snap_dir, history_interval_s=None)

    async def run_before(pilot) -> None:
        app.sub_title = f"{KIND_NAMES[kind]} · attached"
        app.view.gpu_history.add(gpus())
        app.view.gpu_unavailable = None
        app.view.kind, app.view.foreign = kind, view
        app.view.monitor.engine_state = "ready"
        first = view.endpoints[0]
        for second in range(60):  # a minute of readings: the decode rate (from the token counters) rises and falls
            first.prompt_tokens_s = 2000.0 if second % 20 < 3 else 0.0
            first.decode_tokens_s = 400.0 + 25 * (second % 12)
            app.sample_history()
        app.post_message(EngineOutput([("stderr", line) for line in LOGS[kind]]))
        await pilot.pause()
        app.screen.redraw(force=True)
        await pilot.pause(0.1)
        text = screen_text(app)
        assert f"{KIND_NAMES[kind]} · {len(HOSTS[kind])} endpoint" in text  # the panel, not an empty frame

    assert snap_compare(app, terminal_size=size, run_before=run_before)
