"""Which switches this engine can run, settled once at start after the model and the KV cache exist: switches
whose code path cannot run here are marked unavailable (quietly: the reference path is what runs, and turning
them on cannot change that), FUSED_OPS puts its kernels in place, each switch set at start is announced, and the
Triton kernels launch with PDL from then on where the device has it (engine.model.pdl; before any graph capture)."""

from __future__ import annotations

from typing import Any

import engine.model.attention.backends as attention_backends
from engine.config import EngineConfig
from engine.exec.gpu_errors import real_message
from engine.exec.kv.cache import SlotKVCache
from engine.model import pdl
from engine.switches import SWITCHES, SwitchBoard
from engine.telemetry import EventBus, SwitchEvent


def settle_switches(board: SwitchBoard, bus: EventBus, config: EngineConfig, model: Any, kv: SlotKVCache,
                    has_experts: bool) -> None:
    pdl.enable(kv.device)
    if not has_experts:
        for sw in SWITCHES:
            if sw.moe_only:
                board.mark_unavailable(sw.name, f"the model {config.model} has no MoE layers: no expert cache")
    no_triton = f"needs a CUDA device with Triton (this engine runs on {kv.device})"
    if kv.kernel is None:
        for name in ("PAGED_ATTN", "PAGED_PREFILL"):
            board.mark_unavailable(name, no_triton)
    if not attention_backends.triton_runs(kv.device):
        board.mark_unavailable("FUSED_OPS", no_triton)
    elif board.enabled("FUSED_OPS"):
        use_fused_ops(model, kv, board, bus)
    for name, on in config.switches.items():
        if on and board.enabled(name):
            bus.publish(SwitchEvent(name=name, state="on", reason="set at start"))


def use_fused_ops(model: Any, kv: SlotKVCache, board: SwitchBoard, bus: EventBus) -> None:
    """FUSED_OPS on this engine: the layers' kernels and the KV writer, each launched once first. A kernel that
    cannot run here (its compile or its launch fails) degrades the switch at start with the real error and one
    WARNING, and the PyTorch ops serve: never a request's forward that fails."""
    try:
        model.use_fused_ops()
        kv.use_write_kernel()
        from engine.model import triton_ops  # Triton: CUDA builds only

        weight = model.embed_tokens.weight  # the cache's write kernel makes the layers' norm + RoPE kernel write too
        triton_ops.launch_rope_kv_once(model.config, weight.dtype, weight.device, kv.k[0].dtype)
    except Exception as exc:  # Triton's compile and launch errors share no base class
        model.use_fused_ops(False)
        kv.use_write_kernel(False)
        board.degrade("FUSED_OPS", real_message(exc), bus, what="its kernels do not run on this device")
