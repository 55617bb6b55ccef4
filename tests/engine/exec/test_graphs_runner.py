"""Graph replay equals eager execution for every graph kind the runner and the drafter produce.

The same sequence (prefill, draft_prefill with its chain steps, decode twice, verify, draft_round, again) runs
on two runners over one model, each with its own KV cache: one through EagerExecutor, one through GraphCache.
On CPU the GraphCache uses the CPU graph backend (recorded closures), which checks the seam and the static
buffer handling; on a GPU (marked `gpu`) it uses real CUDA graphs, which checks capture itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from engine.api import SamplingParams
from engine.exec.drafter import MtpDrafter
from engine.exec.step_fns import EagerExecutor
from tests.fault_injection import FaultPlan
from engine.exec.graphs.backends import CpuGraphBackend, default_backend
from engine.exec.graphs.cache import GraphCache
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.model import load_checkpoint
from engine.exec.runner import ModelRunner, Row, switch_for_key
from engine.exec.sampler import make_generator
from engine.exec.cuda_streams import Streams
from engine.switches import SwitchBoard
from engine.telemetry import EventBus

KINDS = {"prefill", "decode", "verify", "draft_prefill", "draft_round", "draft_step", "verify_draft"}
DEPTH = 2
SLOTS = 2
CONTEXT = 512


def _runner(lm: Any, executor: Any, board: SwitchBoard, bus: EventBus) -> tuple[ModelRunner, MtpDrafter]:
    cfg = lm.config
    layers = cfg.num_hidden_layers + lm.model.mtp_depth_layers
    kv = SlotKVCache(KVGeometry(layers, SLOTS, cfg.num_key_value_heads, cfg.head_dim, CONTEXT, 64), "bf16",
                     lm.dtype, lm.device)
    runner = ModelRunner(lm.model, kv, executor, board, bus, lm.device, SLOTS, DEPTH)
    return runner, MtpDrafter(runner, DEPTH, fused=True)


def _sequence(runner: ModelRunner, drafter: MtpDrafter) -> list[tuple[str, torch.Tensor]]:
    """Every kind of forward once or more; returns what each produced, cloned (outputs are static buffers)."""
    got: list[tuple[str, torch.Tensor]] = []
    prompt = [(7 * i + 3) % 200 + 5 for i in range(20)]
    # On CUDA a short chunk's graph is captured on its (tokens, span) bucket's second sight (runner.py): the same
    # length in the other slot first, so the chunk below replays a prefill graph.
    got.append(("prefill, first sight", runner.prefill(1, prompt[::-1], 0).logits.clone()))
    pre = runner.prefill(0, prompt, 0)
    got.append(("prefill", pre.logits.clone()))
    first = int(pre.logits[0, -1].argmax())
    drafter.prefill(0, pre.hidden, prompt[1:] + [first], 0, is_last=True)
    got.append(("draft_prefill+step", runner.draft_buf.clone()))
    pos = len(prompt)
    for token in (first, (first + 1) % 200):  # the second decode replays the first one's graph
        got.append(("decode", runner.decode([Row(0, token, pos)]).logits.clone()))
        pos += 1
    for _ in range(2):  # the second verify and round replay
        ver = runner.verify([Row(0, first, pos)])
        got.append(("verify", ver.logits.clone()))
        emitted = [int(ver.logits[0, 0].argmax())]
        drafter.round([Row(0, emitted[-1], pos + 1)], ver.hidden, [emitted], [pos])
        got.append(("draft_round+step", runner.draft_buf.clone()))
        pos += 1
    for _ in range(2):  # the fused greedy step (verify, acceptance, round and chain in one graph), replayed
        accepted, best, emitted, _, _ = drafter.verify_and_draft([Row(0, first, pos)])
        assert torch.equal(emitted, torch.cat([accepted.view(-1, 1), best], dim=1))  # one copy to the host
        got.append(("verify_draft best", best.clone()))
        got.append(("verify_draft accepted", accepted.clone()))
        got.append(("verify_draft drafts", runner.draft_buf.clone()))
        pos += 1 + int(accepted[0])
    # The sampled variant (rejection sampling on the device, top-p), with the same seeded draws each time.
    sampled, gens = [SamplingParams(temperature=0.9, top_p=0.95, seed=11)], [make_generator(11)]
    for _ in range(2):
        accepted, tokens, emitted, _, _ = drafter.verify_and_draft([Row(0, first, pos)], sampled, gens)
        assert torch.equal(emitted, torch.cat([accepted.view(-1, 1), tokens], dim=1))
        got.append(("verify_draft sampled tokens", tokens.clone()))
        got.append(("verify_draft sampled accepted", accepted.clone()))
        got.append(("verify_draft sampled drafts", runner.draft_buf.clone()))
        pos += 1 + int(accepted[0])
    return got


def _compare(lm: Any, make_backend: Callable[[], Any], atol: float) -> GraphCache:
    board, bus = SwitchBoard.from_values({}), EventBus()
    cache = GraphCache(lm.device, bus, board, lambda mib, reason: 0.0, fault_plan=FaultPlan(),
                       switch_for_key=switch_for_key, backend=make_backend())
    with torch.inference_mode():  # as Engine.step runs them
        eager = _sequence(*_runner(lm, EagerExecutor(), board, bus))
        graphed = _sequence(*_runner(lm, cache, board, bus))
    for (what, e), (_, g) in zip(eager, graphed, strict=True):
        assert e.shape == g.shape, what
        assert torch.allclose(e.float(), g.float(), atol=atol, rtol=0), f"{what}: max diff {(e - g).abs().max()}"
    snap = cache.snapshot()
    assert {g.kind for g in snap.graphs} == KINDS
    assert sum(g.replays for g in snap.graphs) >= 4 and snap.degraded == []
    # the runner packs a decode's and a verify's small inputs into one tensor: one copy refills them at a replay
    packed = {e.kind: [v[0] for v in e.packs[0].views] for e in cache._entries.values() if e.packs}
    assert sorted(packed["decode"]) == ["positions", "slots", "tokens"]
    assert sorted(packed["verify"]) == sorted(packed["verify_draft"]) == ["draft_rows", "pending", "positions", "slots"]
    return cache


def test_cpu_graph_backend_replay_equals_eager_for_every_kind(tiny_checkpoint: Path) -> None:
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu")
    _compare(lm, CpuGraphBackend, atol=0.0)


@pytest.mark.gpu
@pytest.mark.gpu_shared
def test_cuda_graph_replay_equals_eager_for_every_kind(tiny_checkpoint: Path) -> None:
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cuda:0")
    cache = _compare(lm, lambda: default_backend(lm.device, Streams(lm.device)), atol=1e-4)
    for g in cache.snapshot().graphs:
        print(f"graph {g.kind:14s} {g.key:22s} {g.mib:8.2f} MiB {g.capture_ms:8.1f} ms replays {g.replays}")


@pytest.mark.gpu
def test_a_capture_with_vram_short_empties_torchs_cache_without_a_full_collection(monkeypatch) -> None:
    """With the tier filling VRAM every capture takes the lean warm-up path: the warm-up's cached blocks go back
    to the driver (torch.cuda.empty_cache) with no full collection of the process's objects on the serving
    thread, and the graph replays the step."""
    import gc

    from engine.exec.graphs.backends import CudaGraphBackend

    device = torch.device("cuda:0")
    backend = CudaGraphBackend(Streams(device), lean_free_mib=float("inf"))  # every capture is lean
    collections: list[tuple] = []
    emptied: list[int] = []
    empty_cache = torch.cuda.empty_cache
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (emptied.append(1), empty_cache())[1])
    x = torch.arange(8.0, device=device)
    graph = backend.capture(lambda inputs: {"y": inputs["x"] * 2}, {"x": x}, None, lambda stage: None,
                            lambda exc: None)
    x.fill_(3.0)
    backend.replay(graph)
    torch.cuda.synchronize(device)
    assert torch.equal(graph.outputs["y"], torch.full((8,), 6.0, device=device))
    assert emptied and not collections
    backend.destroy(graph)
