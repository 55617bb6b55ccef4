"""The GPU panel against the real NVIDIA driver: real pynvml (nvidia-ml-py), no stand-ins.

tests/tui/test_gpu.py checks NvmlSampler with a fake NVML on CPU machines; this file checks, on a machine
with an NVIDIA GPU, that the readings are real and right (they agree with pynvml called directly and with
CUDA's own count), that they follow a real VRAM allocation, and that the panel draws them.

    python3 -m pytest -m gpu -q -rA -s tests/tui/test_gpu_nvml.py

`-s` shows the printed readings. With STRATA_GPU_SCREENSHOT_DIR set, the pilot tests save SVG screenshots
there. Without CUDA the root conftest skips these; where NVML cannot start the `nvml` fixture skips them
with NvmlSampler's one-line reason. The pilot tests are plain functions around asyncio.run() so that they
do not need pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from strata_tui.engine_io.gpu import GpuHistory, GpuSample, NvmlSampler

pytestmark = pytest.mark.gpu

MIB = 2**20
ALLOC_MIB = 2048  # what test (b) allocates on cuda:0
MIN_RISE_MIB = 1843  # ~1.8 GiB: the allocation shows in NVML's "used", allowing for nothing but rounding
BACK_DOWN_SLACK_MIB = 256  # after empty_cache, "used" is back within this of where it started


def cuda_free_tolerance_mib(total_mib: float) -> float:
    """How far NVML's free MiB may be from cudaMemGetInfo's free MiB for the same GPU.

    Both count the same free pages, but not the same way: NVML's (v1) memory info counts the region the
    driver reserves for itself in "total" and "used" while CUDA leaves it out of its total, CUDA reports in
    its own allocation granularity, and the two reads are not one atomic snapshot. On A100/H100/H200 the
    totals differ by 0.5-1% (e.g. 143771 MiB from NVML against ~143000 from CUDA on an H200), so 2% of the
    total, and never less than 512 MiB on small cards, lets that through while still catching a wrong unit
    (GiB vs MiB is a factor of 1024), a wrong device, or a stale reading.
    """
    return max(512.0, 0.02 * total_mib)


# --- helpers --------------------------------------------------------------------------------------------

def _torch_cuda() -> Any | None:
    """torch, when it is importable and sees a CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # NotSupported: a GPU without MIG
        return False
    return current == pynvml.NVML_DEVICE_MIG_ENABLE


def nvml_index_of_cuda(torch: Any, pynvml: Any, cuda_index: int) -> int:
    """NVML's index of torch's cuda:N. They can differ (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), so
    match by UUID, else by PCI address, else assume the same index."""
    props = torch.cuda.get_device_properties(cuda_index)
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        want = str(uuid).lower()
        for i, handle in enumerate(handles):
            got = _text(pynvml.nvmlDeviceGetUUID(handle)).lower()
            if got.removeprefix("gpu-") == want.removeprefix("gpu-"):
                return i
    if all(hasattr(props, f) for f in ("pci_bus_id", "pci_device_id", "pci_domain_id")):
        for i, handle in enumerate(handles):
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            if (pci.domain, pci.bus, pci.device) == (props.pci_domain_id, props.pci_bus_id, props.pci_device_id):
                return i
    return cuda_index


def wait_for_used(sampler: NvmlSampler, index: int, condition: Callable[[float], bool],
                  timeout_s: float = 5.0) -> float:
    """Sample GPU `index` until its used MiB satisfies `condition` (or time runs out); return the last."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = sampler.sample()[index].used_mib
        assert used is not None, f"NVML stopped reporting memory of GPU{index}"
        if condition(used) or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


def describe(gpu: GpuSample) -> str:
    return (f"GPU{gpu.index} {gpu.name!r}: used {gpu.used_mib} MiB / total {gpu.total_mib} MiB, "
            f"util {gpu.util_pct} %, temp {gpu.temp_c} °C, power {gpu.power_w} W")


def screenshot(app: Any, name: str) -> None:
    folder = os.environ.get("STRATA_GPU_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        print("screenshot:", app.save_screenshot(filename=name, path=folder))


def panel_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip()]


# --- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nvml() -> NvmlSampler:
    """The real NvmlSampler, opened; the tests skip with its reason where NVML cannot start."""
    sampler = NvmlSampler()
    reason = sampler.open()
    if reason is not None:
        sampler.close()
        pytest.skip(f"real NVML needed: {reason}")
    yield sampler
    sampler.close()


# --- (a) the readings are real and right ----------------------------------------------------------------

def test_real_nvml_readings_are_sane_and_agree_with_pynvml_and_cuda(nvml: NvmlSampler) -> None:
    import pynvml  # importable: the fixture opened NVML through it

    gpus = nvml.sample()
    for gpu in gpus:
        print("NVML via NvmlSampler:", describe(gpu))

    count = pynvml.nvmlDeviceGetCount()
    assert len(gpus) == count > 0
    assert [gpu.index for gpu in gpus] == list(range(count))
    for gpu in gpus:
        assert isinstance(gpu.name, str) and gpu.name.strip(), f"GPU{gpu.index} has no name"
        assert gpu.total_mib is not None and gpu.total_mib > 0
        assert gpu.used_mib is not None and 0 <= gpu.used_mib <= gpu.total_mib
        assert gpu.util_pct is None or 0 <= gpu.util_pct <= 100
        assert gpu.temp_c is None or 0 < gpu.temp_c < 120, f"implausible temperature {gpu.temp_c} °C"
        assert gpu.power_w is None or 0 < gpu.power_w < 2000, f"implausible power {gpu.power_w} W"

        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
        assert gpu.name == _text(pynvml.nvmlDeviceGetName(handle))
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        assert gpu.total_mib == memory.total / MIB
        # "used" moves with every other process on the GPU; the two reads are a moment apart
        assert abs(gpu.used_mib - memory.used / MIB) <= 256, (gpu.used_mib, memory.used / MIB)

    torch = _torch_cuda()
    if torch is None:
        print("torch with CUDA not importable: no comparison with cudaMemGetInfo")
        return
    assert torch.cuda.device_count() <= count
    for cuda_index in range(torch.cuda.device_count()):
        index = nvml_index_of_cuda(torch, pynvml, cuda_index)
        if _mig_enabled(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)):
            print(f"cuda:{cuda_index} is a MIG slice of GPU{index}: CUDA and NVML see different memory, skipped")
            continue
        free_before, cuda_total = torch.cuda.mem_get_info(cuda_index)  # creates the context first
        gpu = nvml.sample()[index]
        free_after, _ = torch.cuda.mem_get_info(cuda_index)
        cuda_free_mib = (free_before + free_after) / 2 / MIB
        nvml_free_mib = gpu.total_mib - gpu.used_mib
        tolerance = cuda_free_tolerance_mib(gpu.total_mib) + abs(free_before - free_after) / MIB
        print(f"cuda:{cuda_index} = NVML GPU{index}: CUDA free {cuda_free_mib:.0f} / total {cuda_total / MIB:.0f} "
              f"MiB; NVML free {nvml_free_mib:.0f} / total {gpu.total_mib:.0f} MiB; "
              f"free differs by {nvml_free_mib - cuda_free_mib:+.0f} MiB (tolerance {tolerance:.0f})")
        assert abs(nvml_free_mib - cuda_free_mib) <= tolerance
        assert abs(gpu.total_mib - cuda_total / MIB) <= cuda_free_tolerance_mib(gpu.total_mib)


# --- (b) the readings follow real VRAM ------------------------------------------------------------------

def test_nvml_used_follows_a_real_2gib_allocation(nvml: NvmlSampler) -> None:
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("needs torch with CUDA to allocate VRAM")
    import pynvml

    index = nvml_index_of_cuda(torch, pynvml, 0)
    if _mig_enabled(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)):
        pytest.skip("cuda:0 is a MIG slice: NVML's memory figures are for the whole GPU")
    torch.zeros(1, device="cuda:0")  # the CUDA context (hundreds of MiB) exists before the baseline
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    baseline = nvml.sample()[index].used_mib
    assert baseline is not None

    block = torch.ones(ALLOC_MIB * MIB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize(0)
    peak = wait_for_used(nvml, index, lambda used: used - baseline >= MIN_RISE_MIB)
    print(f"GPU{index} (cuda:0): used {baseline:.0f} MiB before, {peak:.0f} MiB holding {ALLOC_MIB} MiB "
          f"(+{peak - baseline:.0f}; torch reserved {torch.cuda.memory_reserved(0) / MIB:.0f} MiB)")
    assert peak - baseline >= MIN_RISE_MIB

    del block
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    after = wait_for_used(nvml, index, lambda used: used <= baseline + BACK_DOWN_SLACK_MIB)
    print(f"GPU{index} (cuda:0): used {after:.0f} MiB after freeing and empty_cache ({after - peak:+.0f})")
    assert after <= baseline + BACK_DOWN_SLACK_MIB
    assert peak - after >= MIN_RISE_MIB


# --- (c) the panel draws them ---------------------------------------------------------------------------

def test_gpu_panel_draws_real_readings(nvml: NvmlSampler) -> None:
    pytest.importorskip("textual")
    from textual.app import App

    from strata_tui.widgets.gpu_panel import GpuPanel
    from tests.tui.conftest import screen_text

    history = GpuHistory()
    for _ in range(5):  # a few readings, so the sparkline has something to draw
        history.add(nvml.sample())
        time.sleep(0.1)
    shown = history.latest

    class PanelApp(App):
        def compose(self):
            yield GpuPanel(id="gpus")

    async def run() -> str:
        app = PanelApp()
        async with app.run_test(size=(160, max(12, len(shown) + 4))) as pilot:
            app.query_one(GpuPanel).show(history, None, {})
            await pilot.pause()
            screenshot(app, "gpu_panel.svg")
            return screen_text(app)

    text = asyncio.run(run())
    print("GpuPanel fed real samples:\n" + "\n".join(panel_lines(text)))
    lines = text.splitlines()
    for gpu in shown:
        row = next((line for line in lines if f"GPU{gpu.index} " in line), None)
        assert row is not None, f"no row for GPU{gpu.index} in:\n{text}"
        assert gpu.name[:24] in row  # the panel shows the first 24 characters of the name
        assert f"{gpu.used_mib:.0f}/{gpu.total_mib:.0f} MiB" in row
        assert ("util N/A" if gpu.util_pct is None else f"util {gpu.util_pct:.0f}%") in row
    assert "no GPU readings yet" not in text and "NVML unavailable" not in text


def test_strata_app_polls_real_nvml_into_the_gpu_panel(nvml: NvmlSampler, config_dir: Path) -> None:
    """The whole path: StrataApp's thread worker runs the real NvmlSampler, the monitor screen draws it."""
    pytest.importorskip("textual")
    from strata_tui.widgets.gpu_panel import GpuPanel
    from tests.tui.conftest import offline_app, screen_text

    expected = nvml.sample()
    app = offline_app(config_dir, sampler_factory=NvmlSampler, gpu_interval_s=0.2)

    async def run() -> str:
        async with app.run_test(size=(160, 50)) as pilot:
            deadline = time.monotonic() + 15
            while len(app.view.gpu_history.latest) < len(expected) or min(
                    (len(app.view.gpu_history.used_mib.get(g.index, ())) for g in expected), default=0) < 3:
                assert time.monotonic() < deadline, f"no NVML readings reached the app ({app.view.gpu_unavailable})"
                await pilot.pause(0.1)
            await pilot.pause(0.5)  # the monitor redraws every refresh_s (0.25 s)
            app.screen.query_one(GpuPanel)  # the monitor screen, with its panel, is showing
            screenshot(app, "strata_app_gpus.svg")
            return screen_text(app)

    text = asyncio.run(run())
    print("StrataApp monitor screen, real NVML polling:\n" + "\n".join(panel_lines(text)[:len(expected) + 6]))
    assert app.view.gpu_unavailable is None
    for gpu in expected:
        row = next((line for line in text.splitlines() if f"GPU{gpu.index} " in line), None)
        assert row is not None, f"no row for GPU{gpu.index} in:\n{text}"
        assert gpu.name[:24] in row
        assert f"/{gpu.total_mib:.0f} MiB" in row  # used moves between polls; the total does not
