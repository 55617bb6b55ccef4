"""This host's CPU and memory for the history panel, read with psutil: the engine's own process tree when this
app launched it (its pid), else the whole host (an attached engine's process is not ours to find). Each read is a
few /proc files; the app reads once a second on its history tick."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class HostReading:
    cpu_pct: float  # percent of one core (an engine using 8 cores reads 800 %, as top shows it)
    ram_mib: float
    label: str  # whose: "engine" (its process tree) or "host"


class HostSampler:
    """Reads the CPU and memory of a process tree, or of the host; keeps the psutil handles between reads (CPU
    percentages are the CPU time between two reads of the same handle)."""

    TREE_EVERY = 10  # reads between two walks of the process tree (a walk reads every process in /proc)

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._tree: list[int] = []
        self._root: int | None = None
        self._reads = 0
        psutil.cpu_percent(None)  # the host's first reading starts the interval

    def read(self, pid: int | None) -> HostReading | None:
        if pid is None:
            memory = psutil.virtual_memory()
            return HostReading(psutil.cpu_percent(None) * (psutil.cpu_count() or 1), (memory.total - memory.available)
                               / 2**20, "host")
        if pid != self._root or self._reads % self.TREE_EVERY == 0:
            try:
                root = self._handle(pid)
                self._tree = [pid, *(child.pid for child in root.children(recursive=True))]
            except psutil.Error:
                self._procs.clear()
                return None
            self._root = pid
        self._reads += 1
        cpu, rss = 0.0, 0.0
        alive = set()
        for member in self._tree:
            try:
                handle = self._handle(member)
                with handle.oneshot():
                    cpu += handle.cpu_percent(None)
                    rss += handle.memory_info().rss
                alive.add(member)
            except psutil.Error:
                continue
        if pid not in alive:
            return None
        self._procs = {p: h for p, h in self._procs.items() if p in alive}
        return HostReading(cpu, rss / 2**20, "engine")

    def _handle(self, pid: int) -> psutil.Process:
        handle = self._procs.get(pid)
        if handle is None:
            handle = self._procs[pid] = psutil.Process(pid)
            handle.cpu_percent(None)  # its first reading only starts the interval
        return handle
