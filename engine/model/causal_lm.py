"""CausalLM: one implementation of the Qwen3 architecture that also runs Llama and Qwen2 checkpoints.

    hidden = model(input_ids, positions, kv)   # [B, T] long, [B, T] long -> [B, T, H], after the final norm
    logits = model.logits(hidden)              # [B, T, V]

`kv=None` is plain causal attention over the T given tokens (training, full forward); otherwise every
attention layer calls `kv.attend(layer_idx, q, k, v, positions)` (the serving KV: engine.exec.kv.cache.SlotKVCache).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.layers import DecoderLayer, RMSNorm
from engine.model.mtp import MTPHead
from engine.model.rope import RotaryEmbedding


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head (tied or not), and the optional MTP head."""

    # An MoE model's expert cache (engine.exec.experts.cache) sets itself here; a dense model has none.
    expert_provider: Any = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # _weight skips nn.Embedding's own init, whose normal_ on the meta device imports torch._dynamo (~2 s)
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MTPHead(config, self.embed_tokens, self.rotary) if config.mtp is not None else None
        self.fused = False
        self.ops: Any = None  # engine.model.triton_ops under FUSED_OPS (use_fused_ops)
        if weight.device.type != "meta":
            self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """Fresh-training init as transformers does it: N(0, std) for Linear and Embedding, zero biases."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()

    @property
    def mtp_depth_layers(self) -> int:
        """How many MTP layers the checkpoint has (0 without a head)."""
        return self.mtp.num_layers if self.mtp is not None else 0

    @property
    def head_weight(self) -> torch.Tensor:
        """The [V, H] output projection: lm_head's weight, or the embedding when tied (an FP8 head, --quantize-head:
        dequantized)."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        if getattr(self.lm_head, "quantized", False):
            return self.lm_head.dequantize(self.embed_tokens.weight.dtype)
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv=None) -> torch.Tensor:
        """input_ids, positions [B, T] long -> hidden [B, T, H] after the final norm."""
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ")
        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary(positions, x.dtype)
        if self.ops is not None:  # FUSED_OPS: each residual add rides in the next norm's kernel
            residual = None
            for i, layer in enumerate(self.layers):
                x, residual = layer.forward_carry(x, residual, cos, sin, positions, kv, i)
            return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, kv, i)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [B, T, V] through the (tied or untied, or FP8) head."""
        if getattr(self.lm_head, "quantized", False):  # --quantize-head: the quantized kernels
            return self.lm_head(hidden)
        return F.linear(hidden, self.head_weight)

    def draft_logits(self, h_mtp: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits of an MTP output: the MTP layer's own head when the checkpoint has one, else the main head."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP head")
        head = self.mtp.layers[self.mtp.layer_index(depth)].head
        return head(h_mtp) if head is not None else self.logits(h_mtp)

    def fuse_projections(self) -> None:
        """Concatenate q/k/v and gate/up into one Linear each (the FUSED_PROJ switch). Same logits."""
        for layer in self.layers:
            layer.fuse()
        if self.mtp is not None:
            for mtp_layer in self.mtp.layers:
                mtp_layer.block.fuse()
        self.fused = True

    def use_fused_ops(self, enabled: bool = True) -> None:
        """The FUSED_OPS switch: every decoder layer (MTP blocks included) runs its residual add + RMSNorm, q/k
        norm + RoPE and SiLU * up as Triton kernels (engine.model.triton_ops). Inference only: the kernels
        have no backward. Launches each kernel once first: raises here what they cannot do on this device, and then
        the layers keep the PyTorch ops."""
        ops = None
        if enabled:
            import engine.model.triton_ops as ops

            ops.launch_each_once(self.config, self.embed_tokens.weight.dtype, self.embed_tokens.weight.device)
        self.ops = self.rotary.ops = ops
        blocks = list(self.layers) + ([m.block for m in self.mtp.layers] if self.mtp is not None else [])
        for block in blocks:
            block.use_ops(ops)
