"""Prometheus series of the MoE expert cache, from the `experts` section of the engine's state snapshot.

A small collector function kept apart from metrics.py so the server's owner can merge it: call
`expert_metric_families(state.experts)` from the state collector's `collect` (it yields nothing for a dense
model).

    strata_expert_cache_mib{device}                 device memory of the slot pools
    strata_expert_cache_budget_slots / _slots       slots per layer: the target, and held now
    strata_expert_host_mib{device}                  the host (pinned) store: every expert once (0 with a peer store)
    strata_expert_peer_mib{device}                  the store on the --peer-device card (its label), 0 on the host
    strata_expert_hits_total{layer} / _misses_total{layer} / _evictions_total{layer}
    strata_expert_loaded_mib_total, strata_expert_load_seconds_total, strata_expert_reruns_total, strata_expert_replays_total
    strata_expert_hit_rate{kind="live"|"oracle"|"lru_replay"|"lfu_replay"}
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.snapshot import ExpertCacheSnapshot


def expert_metric_families(snap: ExpertCacheSnapshot | None) -> Iterator[Metric]:
    """The series above for the snapshot's `experts` section (None: a dense model)."""
    if snap is None:
        return
    device = snap.device
    g = GaugeMetricFamily("strata_expert_cache_mib", "Expert cache slot pools on the device", labels=["device"])
    g.add_metric([device], float(snap.mib))
    yield g
    g = GaugeMetricFamily("strata_expert_host_mib", "Expert host store (every expert once)", labels=["device"])
    g.add_metric([device], float(snap.host_mib))
    yield g
    store = snap.store_device or "host"
    g = GaugeMetricFamily("strata_expert_peer_mib", "Expert store on the --peer-device card", labels=["device"])
    g.add_metric([store if store != "host" else device], float(snap.peer_mib))
    yield g
    yield GaugeMetricFamily("strata_expert_cache_slots", "Expert slots per sparse layer held now",
                            value=float(snap.slots))
    yield GaugeMetricFamily("strata_expert_cache_budget_slots", "Expert slots per sparse layer the budget aims for",
                            value=float(snap.target_slots))
    for name, key, text in (("strata_expert_hits", "hits", "Routed experts found in a slot"),
                            ("strata_expert_misses", "misses", "Routed experts copied in from host memory"),
                            ("strata_expert_evictions", "evictions", "Experts evicted from a slot")):
        c = CounterMetricFamily(name, text, labels=["layer"])
        for layer in snap.layers:
            c.add_metric([str(layer.layer)], float(getattr(layer, key)))
        yield c
    yield CounterMetricFamily("strata_expert_loaded_mib", "MiB of experts copied to the device",
                              value=float(snap.loaded_mib))
    yield CounterMetricFamily("strata_expert_load_seconds", "Time spent copying experts in",
                              value=float(snap.load_ms) / 1e3)
    yield CounterMetricFamily("strata_expert_reruns", "Captured steps run again eagerly after a miss",
                              value=float(snap.reruns))
    yield CounterMetricFamily("strata_expert_replays", "Extra graph replays after loading a missed layer",
                              value=float(snap.replays))
    rate = GaugeMetricFamily("strata_expert_hit_rate", "Expert hit rate: live, Belady oracle, LRU (and LFU) replay "
                             "of the recorded routing trace at the current budget", labels=["kind"])
    for kind, value in (("live", snap.hit_rate), ("oracle", snap.oracle_hit_rate),
                        ("lru_replay", snap.lru_replay_hit_rate),
                        ("lfu_replay", snap.lfu_replay_hit_rate)):  # lfu_replay: only while EXPERT_LFU is on
        if value is not None:
            rate.add_metric([kind], float(value))
    yield rate
