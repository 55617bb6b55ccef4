"""KV by use's records: the totals since start, and a fetch whose telemetry waits for its copy to complete
(engine.exec.kv.paging)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingFetch:
    """A fetch enqueued on the copy stream; its telemetry is published once `end` has completed."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    blocks: int
    mib: float
    host_mib: float  # what the host held when the fetch was planned
    slots: list[int]


@dataclass
class PagingStats:
    """Totals since start (the snapshot's `kv` section and the Prometheus counters)."""

    spilled_blocks: int = 0
    fetched_blocks: int = 0
    spilled_mib: float = 0.0
    fetched_mib: float = 0.0
    spill_ms: float = 0.0
    fetch_ms: float = 0.0
    grown_blocks: int = 0
    preemptions: int = 0  # slots whose blocks a spill took (one per slot per spill)
    preemption_cause: str = ""
    paused_requests: int = 0  # now, not a total: decoding requests the last step left out (kv.admission.rows_that_fit)
