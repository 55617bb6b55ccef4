"""The GPU panel names the processes that hold each card (NVML per-process memory: the tensor-parallel ranks
of one server). NVML is faked at the pynvml boundary (no driver here); the processes are real."""

from __future__ import annotations

import subprocess
import time
import types
from pathlib import Path

from strata_tui.engine_io.gpu import GpuProcess, NvmlSampler, process_name
from strata_tui.engine_io.messages import GpuSampled
from tests.tui.conftest import offline_app, screen_text, wait_for
from tests.tui.test_gpu import fake_nvml


def _wait_until_exec(pid: int) -> None:
    """Popen returns once the child is forked; until it has exec'd, /proc shows no argv (a loaded machine was seen
    sampling in that window), and the name asserted below is sleep's, not the gap's."""
    deadline = time.monotonic() + 30
    while process_name(pid) != "sleep 30" and time.monotonic() < deadline:
        time.sleep(0.01)


def test_ranks_are_read_per_card_with_their_memory(tmp_path: Path) -> None:
    ranks = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        for rank in ranks:
            _wait_until_exec(rank.pid)
        nvml = fake_nvml(count=2)
        per_card = {0: [types.SimpleNamespace(pid=ranks[0].pid, usedGpuMemory=70 * 1024 * 2**20)],
                    1: [types.SimpleNamespace(pid=ranks[1].pid, usedGpuMemory=69 * 1024 * 2**20),
                        types.SimpleNamespace(pid=2**22 + 7, usedGpuMemory=None)]}  # gone, and no memory figure
        nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: per_card[handle]
        sampler = NvmlSampler(loader=lambda: nvml)
        assert sampler.open() is None
        gpus = sampler.sample()
        assert gpus[0].processes == (GpuProcess(ranks[0].pid, "sleep 30", 70 * 1024.0),)
        assert gpus[1].processes[1] == GpuProcess(2**22 + 7, "?", None)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_a_driver_without_per_process_info_leaves_the_line_out() -> None:
    sampler = NvmlSampler(loader=lambda: fake_nvml(count=1))  # no nvmlDeviceGetComputeRunningProcesses
    sampler.open()
    assert sampler.sample()[0].processes == ()


def test_python_programs_are_named_by_module_or_script(tmp_path: Path) -> None:
    proc = tmp_path / "4242"
    proc.mkdir()
    (proc / "cmdline").write_bytes(b"/usr/bin/python3.12\0-m\0sglang.launch_server\0--tp\0002\0")
    assert process_name(4242, tmp_path) == "sglang.launch_server"
    (proc / "cmdline").write_bytes(b"/opt/venv/bin/vllm\0serve\0Qwen/Qwen3-8B\0")
    assert process_name(4242, tmp_path) == "vllm serve"


async def test_the_panel_shows_who_holds_each_card(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=(160, 40)) as pilot:
        sample = fake_gpu(0, [GpuProcess(4242, "VLLM::Worker_TP0", 71 * 1024.0), GpuProcess(77, "python", 512.0)])
        app.post_message(GpuSampled([sample, fake_gpu(1, [])]))
        await wait_for(pilot, lambda: "held by" in screen_text(app), what="the process line")
        text = screen_text(app)
        assert "held by 4242 VLLM::Worker_TP0 71.0 GiB · 77 python 512 MiB" in text
        assert text.count("held by") == 1  # a card nobody holds has no line


def fake_gpu(index: int, processes: list[GpuProcess]):
    from strata_tui.engine_io.gpu import GpuSample
    return GpuSample(index, "NVIDIA H100 80GB HBM3", 72000.0, 81559.0, 91.0, 64.0, 600.0, tuple(processes))
