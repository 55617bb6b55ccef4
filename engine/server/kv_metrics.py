"""Prometheus series of `--kv-resident` paging, from the `kv.paging` section of the engine's state snapshot.

A small collector function kept apart from metrics.py so the server's owner can merge it: call
`kv_metric_families(state)` from the state collector's `collect` (it yields nothing when every slot keeps its
whole context on the device).

    strata_kv_host_bytes                      KV held in host memory now
    strata_kv_pool_blocks{state="total"|"free"}  the shared device pool
    strata_kv_spilled_bytes_total / strata_kv_fetched_bytes_total   spill (device -> host) and fetch traffic
    strata_kv_spill_seconds_total / strata_kv_fetch_seconds_total   time spent in those copies
    strata_kv_slot_tokens{slot, where="resident"|"pooled"|"host"}   where each busy slot's KV lies
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.snapshot import EngineSnapshot

_MIB = float(1 << 20)


def kv_metric_families(state: EngineSnapshot) -> Iterator[Metric]:
    """The series above for one state snapshot (its `kv.paging`; None: no paging)."""
    snap = state.kv.paging if state.kv is not None else None
    if snap is None:
        return
    yield GaugeMetricFamily("strata_kv_host_bytes", "KV cache held in host memory (--kv-resident spill)",
                            value=float(snap.host_mib) * _MIB)
    pool = GaugeMetricFamily("strata_kv_pool_blocks", "Blocks of the shared device KV pool", labels=["state"])
    pool.add_metric(["total"], float(snap.pool_blocks))
    pool.add_metric(["free"], float(snap.free_pool_blocks))
    yield pool
    for name, key, text in (("strata_kv_spilled_bytes", "spilled_mib", "KV copied from the device to host memory"),
                            ("strata_kv_fetched_bytes", "fetched_mib", "KV copied back from host memory")):
        yield CounterMetricFamily(name, text, value=float(getattr(snap, key)) * _MIB)
    for name, key, text in (("strata_kv_spill_seconds", "spill_ms", "Time spent spilling KV to host memory"),
                            ("strata_kv_fetch_seconds", "fetch_ms", "Time spent fetching KV from host memory")):
        yield CounterMetricFamily(name, text, value=float(getattr(snap, key)) / 1e3)
    slots = GaugeMetricFamily("strata_kv_slot_tokens", "Tokens of a busy slot's KV by where they lie",
                              labels=["slot", "where"])
    for slot in state.slots:
        if slot.state == "idle":
            continue
        for where in ("resident", "pooled", "host"):
            slots.add_metric([str(slot.slot), where], float(getattr(slot, f"kv_{where}_tokens")))
    yield slots
