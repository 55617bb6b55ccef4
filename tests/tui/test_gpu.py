"""NVML sampling: a failing field shows N/A, a missing driver gives one clear line, history is bounded."""

from __future__ import annotations

import types

from strata_tui.engine_io.gpu import GpuHistory, GpuSample, NvmlSampler


class NVMLError(Exception):
    pass


def fake_nvml(count: int = 2, fail: set[str] = frozenset(), init_error: str | None = None) -> types.SimpleNamespace:
    """A stand-in for the NVIDIA driver (pynvml's functions), which this CPU machine does not have."""

    def field(name, value):
        def read(*_args):
            if name in fail:
                raise NVMLError(f"{name}: Not Supported")
            return value
        return read

    def init():
        if init_error:
            raise NVMLError(init_error)

    return types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, nvmlInit=init, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: count, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=field("name", b"NVIDIA H200"),
        nvmlDeviceGetMemoryInfo=field("memory", types.SimpleNamespace(used=1024 * 2**20, total=143771 * 2**20)),
        nvmlDeviceGetUtilizationRates=field("util", types.SimpleNamespace(gpu=87)),
        nvmlDeviceGetTemperature=field("temp", 61),
        nvmlDeviceGetPowerUsage=field("power", 512_000),
    )


def test_every_field_read_and_one_failure_is_none() -> None:
    sampler = NvmlSampler(loader=lambda: fake_nvml(fail={"power"}))
    assert sampler.open() is None
    gpus = sampler.sample()
    assert len(gpus) == 2
    assert gpus[0] == GpuSample(0, "NVIDIA H200", 1024.0, 143771.0, 87.0, 61.0, None)


def test_no_driver_gives_one_line() -> None:
    sampler = NvmlSampler(loader=lambda: fake_nvml(init_error="NVML Shared Library Not Found"))
    reason = sampler.open()
    assert reason.startswith("NVML unavailable") and "Shared Library Not Found" in reason
    assert sampler.sample() == []


def test_import_failure_gives_one_line() -> None:
    def broken():
        raise ImportError("No module named 'pynvml'")
    assert "cannot import pynvml" in NvmlSampler(loader=broken).open()


def test_real_pynvml_on_this_machine_does_not_raise() -> None:
    sampler = NvmlSampler()
    reason = sampler.open()
    assert reason is None or reason.startswith(("NVML unavailable", "NVML found no GPUs"))
    sampler.close()


def test_history_keeps_a_minute() -> None:
    history = GpuHistory(samples=60)
    for i in range(100):
        history.add([GpuSample(0, "g", float(i), 100.0, None, None, None)])
    assert list(history.used_mib[0]) == [float(i) for i in range(40, 100)]
    assert len(history.util_pct[0]) == 0
