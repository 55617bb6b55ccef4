"""Prometheus series of `--kv-resident` paging, from the `kv.paging` section of the engine's state snapshot.

A small collector function kept apart from metrics.py so the server's owner can merge it: call
`kv_metric_families(state)` from the state collector's `collect` (it yields nothing when every slot keeps its
whole context on the device).

    strata_kv_host_bytes                      KV held in host memory now
    strata_kv_pool_blocks{state="total"|"free"}  the shared device pool
    strata_kv_spilled_bytes_total / strata_kv_fetched_bytes_total   spill (device -> host) and fetch traffic
    strata_kv_spill_seconds_total / strata_kv_fetch_seconds_total   time spent in those copies
    strata_kv_slot_tokens{slot, where="resident"|"pooled"|"host"}   where each busy slot's KV lies
    strata_kv_cache_usage_perc                fraction of the pool's blocks in use (slots' and the tier's), 0..1
    strata_num_preemptions{cause="pool_short"}  running requests whose KV was spilled to make room (a counter)

The last two are named as vLLM names its series (`vllm:kv_cache_usage_perc`, `vllm:num_preemptions`), under this
project's prefix.
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
    pool.add_metric(["used"], float(snap.used_blocks))
    pool.add_metric(["tier"], float(snap.tier_blocks))
    yield pool
    usage = (snap.pool_blocks - snap.free_pool_blocks) / snap.pool_blocks if snap.pool_blocks else 0.0
    yield GaugeMetricFamily("strata_kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0..1)",
                            value=usage)
    preemptions = CounterMetricFamily("strata_num_preemptions", "Running requests whose KV was spilled to host "
                                      "memory to make room", labels=["cause"])
    preemptions.add_metric(["pool_short"], float(snap.preemptions))  # the one cause: a forward's slots lacked blocks
    yield preemptions
    yield GaugeMetricFamily("strata_num_requests_swapped", "Running requests the last step left out, their KV where "
                            "it is, because theirs and the others' exceed the KV pool (vLLM's name)",
                            value=float(snap.paused_requests))
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
