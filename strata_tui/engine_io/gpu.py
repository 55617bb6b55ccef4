"""GPU readings from NVML (nvidia-ml-py's `pynvml`), collected apart from drawing, as nvitop does.

Every field is read on its own so that one failing call (a field this GPU or driver does not support)
shows as None ("N/A" on screen) instead of hiding the GPU. Without NVML (no driver, a CPU-only machine)
`open()` returns one line saying why, and the rest of the app carries on. These calls block: the app
makes them from a thread worker, never on the event loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HISTORY_SAMPLES = 60  # one sample a second: a minute of history


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (a tensor-parallel rank of a server, say): NVML's per-process view."""

    pid: int
    name: str
    used_mib: float | None


def process_name(pid: int, proc: Path = Path("/proc")) -> str:
    """The command as `ps` shows it, shortened: a retitled worker keeps its title ("VLLM::Worker_TP1"), a
    Python program shows its module or script ("vllm serve", "sglang.launch_server")."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return "?"
    if Path(words[0]).name.startswith("python"):
        words = words[2:3] if len(words) > 2 and words[1] == "-m" else words[1:2]
    words = [Path(words[0]).name, *words[1:2]] if words else ["python"]
    return " ".join(words)[:28]


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. None means NVML could not read that field."""

    index: int
    name: str | None
    used_mib: float | None
    total_mib: float | None
    util_pct: float | None
    temp_c: float | None
    power_w: float | None
    processes: tuple[GpuProcess, ...] = ()  # who holds this card (empty where NVML cannot say)


def _load_pynvml() -> Any:
    import pynvml  # nvidia-ml-py; imported lazily so a broken install only disables the GPU panel

    return pynvml


class NvmlSampler:
    """Reads every GPU NVML can see. Construct, `open()`, then `sample()` from one thread."""

    def __init__(self, loader: Callable[[], Any] = _load_pynvml) -> None:
        self._loader = loader
        self._nvml: Any = None
        self._handles: list[Any] = []
        self.unavailable: str | None = None

    def open(self) -> str | None:
        """Initialise NVML; returns None when it works, else one line saying why it does not."""
        try:
            nvml = self._loader()
        except Exception as exc:  # ImportError, or a broken ctypes load
            self.unavailable = f"NVML unavailable: cannot import pynvml ({type(exc).__name__}: {exc})"
            return self.unavailable
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.unavailable = f"NVML unavailable: {_nvml_reason(exc)} (no NVIDIA driver here?)"
            return self.unavailable
        self._nvml = nvml
        if not self._handles:
            self.unavailable = "NVML found no GPUs"
            return self.unavailable
        return None

    def sample(self) -> list[GpuSample]:
        if self._nvml is None:
            return []
        return [self._read_one(i, h) for i, h in enumerate(self._handles)]

    def _read_one(self, index: int, handle: Any) -> GpuSample:
        nvml = self._nvml
        name = _field(lambda: nvml.nvmlDeviceGetName(handle))
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        memory = _field(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        util = _field(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        temp = _field(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        power_mw = _field(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        running = _field(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        processes = tuple(
            GpuProcess(int(p.pid), process_name(int(p.pid)),
                       p.usedGpuMemory / 2**20 if isinstance(getattr(p, "usedGpuMemory", None), int) else None)
            for p in running)
        return GpuSample(
            index=index,
            name=name,
            used_mib=memory.used / 2**20 if memory is not None else None,
            total_mib=memory.total / 2**20 if memory is not None else None,
            util_pct=float(util.gpu) if util is not None else None,
            temp_c=float(temp) if temp is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            processes=processes,
        )

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down a half-initialised library: nothing useful to report
                pass
            self._nvml = None


def _field(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:  # NVMLError_NotSupported and friends: this field is N/A, the rest still shows
        return None


def _nvml_reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text


class GpuHistory:
    """The last minute of used-MiB and utilisation per GPU, for the sparklines."""

    def __init__(self, samples: int = HISTORY_SAMPLES) -> None:
        self.samples = samples
        self.used_mib: dict[int, deque[float]] = {}
        self.util_pct: dict[int, deque[float]] = {}
        self.latest: list[GpuSample] = []

    def add(self, readings: list[GpuSample]) -> None:
        self.latest = readings
        for gpu in readings:
            for series, value in ((self.used_mib, gpu.used_mib), (self.util_pct, gpu.util_pct)):
                ring = series.setdefault(gpu.index, deque(maxlen=self.samples))
                if value is not None:
                    ring.append(value)
