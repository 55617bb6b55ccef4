"""The runner's side of a degrade, driven through a real GraphCache (CPU backend) with injected OOMs.

The seed scenario with SPLIT_ATTN on: every draft_round capture runs out of memory. The graph cache degrades
the split key (SPLIT_ATTN is blamed), the runner turns SPLIT_ATTN off and retries without it, the retry's
own degrade names no switch, so MTP must go off (MtpUnavailable), never an exception that kills the step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fault_injection import FaultPlan
from engine.exec.graphs.backends import CpuGraphBackend
from engine.exec.graphs.cache import GraphCache
from engine.model import load_checkpoint
from engine.exec.runner import MtpUnavailable, Row, switch_for_key
from engine.switches import SwitchBoard
from engine.telemetry import EventBus

from tests.engine.exec.test_graphs_runner import _runner


def test_persistent_drafter_oom_turns_split_attn_then_mtp_off(tiny_checkpoint: Path) -> None:
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu")
    bus, board = EventBus(), SwitchBoard.from_values({"SPLIT_ATTN": True})
    cache = GraphCache("cpu", bus, board, lambda mib, reason: 0.0, wait_polls=2, wait_interval_s=0.0,
                       fault_plan=FaultPlan.parse("instantiate:draft_round:*:oom"), switch_for_key=switch_for_key,
                       backend=CpuGraphBackend(), sleep=lambda s: None)
    runner, drafter = _runner(lm, cache, board, bus)
    prompt = list(range(5, 25))
    with torch.inference_mode():
        pre = runner.prefill(0, prompt, 0)
        first = int(pre.logits[0, -1].argmax())
        drafter.prefill(0, pre.hidden, prompt[1:] + [first], 0, is_last=True)
        ver = runner.verify([Row(0, first, len(prompt))])
        with pytest.raises(MtpUnavailable, match="CUDA error: out of memory"):
            drafter.round([Row(0, first, len(prompt) + 1)], ver.hidden, [[first]], [len(prompt)])
        # Still serving: a plain decode works after MTP went off.
        assert runner.decode([Row(0, first, len(prompt) + 1)]).logits.shape[-1] == lm.config.vocab_size
    state = board.states["SPLIT_ATTN"]
    assert state.degraded and "out of memory" in state.reason
    degrades = [e for e in bus.history() if e.type == "graph" and e.action == "degrade"]
    assert [d.error.split(":")[0] for d in degrades] == ["SPLIT_ATTN off", "mtp off"]
