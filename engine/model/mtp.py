"""MTPHead: DeepSeek-V3-style multi-token prediction, predicting token t+2 from (h_t, token t+1).

    h_mtp = norm(block(eh_proj(cat[enorm(embed(token_{t+1})), hnorm(h_t)])))

`h_t` is the main model's hidden state *after* its final norm. The embedding comes first in the concat in
both layouts (vLLM deepseek_mtp.py and qwen3_next_mtp.py). The output is already normed, so
`model.logits(h_mtp)` (or `model.draft_logits(h_mtp, depth)` when a layer has its own head) gives the draft.
Depth d > num_layers-1 reuses layer d % num_layers on its own output, so a 1-layer head drafts any depth.

Layouts: "deepseek" layers are self-contained (enorm, hnorm, eh_proj, block, shared_head.norm, optional own
embed/head). "qwen3_next" shares fc (= eh_proj), the two pre-fc norms and the final norm across its layers.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.layers import DecoderLayer, RMSNorm
from engine.model.rope import RotaryEmbedding


class MTPLayer(nn.Module):
    """One MTP depth: the two input norms, the 2H -> H projection, one decoder block and the output norm."""

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.rms_norm_eps)
        self.hnorm = RMSNorm(H, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = DecoderLayer(config, config.num_hidden_layers + index)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        # Optional per-layer copies; None means "share the main model's" (the usual case).
        self.embed: nn.Embedding | None = None
        self.head: nn.Linear | None = None


class MTPHead(nn.Module):
    """The MTP layers plus references to what they share with the main model (embedding, rotary)."""

    def __init__(self, config: ModelConfig, embed_tokens: nn.Embedding, rotary: RotaryEmbedding) -> None:
        super().__init__()
        assert config.mtp is not None
        self.config = config
        self.layout = config.mtp.layout
        self.layers = nn.ModuleList(MTPLayer(config, i) for i in range(config.mtp.num_layers))
        if self.layout == "qwen3_next":
            first = self.layers[0]
            for layer in list(self.layers)[1:]:
                layer.enorm, layer.hnorm, layer.eh_proj, layer.norm = first.enorm, first.hnorm, first.eh_proj, first.norm
        # A tuple keeps these out of this module's parameters: they belong to (and are saved by) the parent.
        self._shared = (embed_tokens, rotary)

    @property
    def num_layers(self) -> int:
        """MTP layers in the checkpoint (config.mtp.num_layers)."""
        return len(self.layers)

    def layer_index(self, depth: int) -> int:
        """Which MTP layer drafts at `depth` (chained depths reuse the layers cyclically)."""
        if depth < 0:
            raise ValueError(f"depth={depth}: expected >= 0")
        return depth % len(self.layers)

    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        kv,
        depth: int = 0,
    ) -> torch.Tensor:
        """hidden [B, T, H] (h_t, after the final norm), next_ids [B, T] (token t+1), positions [B, T] (t)
        -> h_mtp [B, T, H], normed, whose logits predict token t+2. kv=None attends causally within T."""
        idx = self.layer_index(depth)
        layer = self.layers[idx]
        embed_tokens, rotary = self._shared
        embed = layer.embed if layer.embed is not None else embed_tokens
        ops = layer.block.ops
        # FUSED_OPS: each norm with its weight in one kernel, and the block's last add in the final norm's
        if ops is not None:
            emb = ops.add_rms_norm(embed(next_ids), None, layer.enorm.weight, layer.enorm.eps)[0]
            h = ops.add_rms_norm(hidden, None, layer.hnorm.weight, layer.hnorm.eps)[0]
        else:
            emb, h = layer.enorm(embed(next_ids)), layer.hnorm(hidden)
        x = layer.eh_proj(torch.cat([emb, h], dim=-1))  # embedding first: vLLM deepseek_mtp / qwen3_next_mtp
        cos, sin = rotary(positions, x.dtype)
        kv_layer = self.config.num_hidden_layers + idx
        if ops is not None:
            x, residual = layer.block.forward_carry(x, None, cos, sin, positions, kv, kv_layer)
            return ops.add_rms_norm(x, residual, layer.norm.weight, layer.norm.eps)[0]
        return layer.norm(layer.block(x, cos, sin, positions, kv, kv_layer))
