"""`--kv-resident` fetches overlapped with the forward, the parts a CPU reaches: attend asks paging to wait for
each layer's blocks (every layer, MTP included, and only when paging is on), and a fetch's telemetry is published
once its copy has completed, never before. The copy stream itself runs in test_kv_resident_gpu.py."""

from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.exec.kv.paging import KVPaging, PendingFetch
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SMALL = dict(batch=2, context=1024, tier_budget_mib=0.0)


def test_attend_waits_for_every_layers_fetch_when_paging_and_never_without(ckpt, monkeypatch):
    waited: list[int] = []
    real_wait = KVPaging.wait_fetched

    def recording_wait(self, layer: int) -> None:
        waited.append(layer)
        real_wait(self, layer)

    monkeypatch.setattr(KVPaging, "wait_fetched", recording_wait)
    prompts = random_prompts(2, seed=9, lengths=(150, 300))
    engine = make_engine(ckpt, kv_resident=128, batch_mtp=True, mtp_depth=2, **SMALL)
    run_all(engine, prompts, GREEDY)
    assert engine.mtp_on, engine.mtp_off_reason
    num_layers = engine.kv.geometry.num_layers
    assert num_layers > engine.lm.config.num_hidden_layers  # the MTP head's KV layer is among them
    assert set(waited) == set(range(num_layers))  # attend's layer index is the paging's layer index

    waited.clear()
    run_all(make_engine(ckpt, batch_mtp=True, mtp_depth=2, kv_pool="reserved", **SMALL), prompts, GREEDY)
    assert waited == []


def test_only_a_resident_window_puts_a_wait_for_each_layers_fetch_in_the_forwards(ckpt):
    """With `--kv-resident` fetches are routine and each layer's attention waits for its own blocks (the forward
    overlaps the copy); KV by use without a window fetches only after a spill, so its forwards and graphs carry no
    wait (a replayed wait node costs the device time every step) and a fetch is waited for whole instead."""
    assert make_engine(ckpt, kv_resident=128, **SMALL).kv.paging.layer_waits
    assert not make_engine(ckpt, kv_pool="by-use", **SMALL).kv.paging.layer_waits


class _TimingEvent:
    """Stands in for one of the copy stream's CUDA timing events (the CPU has none): complete when told."""

    def __init__(self, complete: bool) -> None:
        self.complete = complete

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, end: _TimingEvent) -> float:
        return 2.5


def _paged_cpu_cache() -> SlotKVCache:
    geometry = KVGeometry(num_layers=2, num_slots=2, num_kv_heads=1, head_dim=4, context_tokens=256,
                          margin_tokens=8, block_tokens=16)
    return SlotKVCache(geometry, "bf16", torch.float32, "cpu", resident_tokens=32, pool_blocks=14)


def test_a_fetch_is_counted_and_published_once_its_copy_has_completed_and_only_once():
    kv = _paged_cpu_cache()
    paging = kv.paging
    paging.bus = bus = EventBus(history=100)
    end = _TimingEvent(complete=False)
    paging._pending.append(PendingFetch(_TimingEvent(True), end, blocks=3, mib=0.5, host_mib=1.25, slots=[1]))

    def fetch_events() -> list:
        return [e for e in bus.history() if e.type == "kv" and e.action == "fetch"]

    paging.prepare({0: 16})
    assert paging.snapshot().fetched_blocks == 0 and fetch_events() == []  # still copying: nothing waited for
    end.complete = True
    snap = paging.snapshot()
    assert snap.fetched_blocks == 3 and snap.fetch_ms == 2.5 and snap.fetched_mib == 0.5
    [event] = fetch_events()
    assert (event.blocks, event.ms, event.mib, event.host_mib, event.slots) == (3, 2.5, 0.5, 1.25, [1])
    paging.prepare({0: 16})
    assert len(fetch_events()) == 1 and paging.stats.fetched_blocks == 3

    paging._pending.append(PendingFetch(_TimingEvent(True), _TimingEvent(False), 2, 0.25, 1.0, [0]))
    kv.free()  # shutdown waits for what is in flight
    assert paging.stats.fetched_blocks == 5 and len(fetch_events()) == 2
