"""Qwen3-MoE's sparse MLP: a top-k softmax router over `num_experts` SwiGLU experts.

    weights, ids = route(x)                          # x [N, H] -> [N, k] each (softmax, top-k, optional renorm)
    y = sum_j weights[:, j] * expert[ids[:, j]](x)   # [N, H]

The parameters keep the checkpoint's names (`gate.weight`, `experts.E.{gate,up,down}_proj.weight`), so loading,
saving and parity need no renaming. Where the expert weights live at serve time is not this module's business:
an *expert provider* (engine.exec.experts.cache.ExpertCache, attached with `attach_provider`) receives the routed
ids and computes the experts from its own per-layer pool of device slots; without one the block computes from
its own parameters, one expert at a time, in ascending expert order (the reference path).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.moe_quant import ExpertQuant
from engine.model.moe_route import top_k_route
from engine.model.quant.linear import is_quantized


class ExpertProvider(Protocol):
    """Who computes a sparse block's experts once the router has chosen them."""

    def moe_forward(self, moe_index: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H], ids [N, k] long, weights [N, k] (x's dtype), positions [N] or None -> [N, H]."""
        ...


class Expert(nn.Module):
    """One SwiGLU expert (Qwen3-MoE: no bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A projection's [N, K] weight: nn.Linear's own, a quantized layer's dequantized to `dtype`, in the order of
    the inputs it multiplies (an act-order layer stores its columns sorted by group)."""
    if not is_quantized(linear):
        return linear.weight
    unpermuted = getattr(linear, "dequantize_unpermuted", None)
    return unpermuted(dtype) if unpermuted is not None else linear.dequantize(dtype)


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [n, H], w_gate_up [2I, H] (gate rows first), w_down [H, I] -> [n, H]."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def add_expert(out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert: int,
               w_gate_up: torch.Tensor, w_down: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """out[t] += weights[t, j] * expert(x[t]) for every (t, j) routed to `expert` (rows: only those tokens)."""
    hit = ids == expert
    if rows is not None:
        hit &= rows[:, None]
    token_idx, pos = torch.where(hit)
    if token_idx.numel() == 0:
        return
    y = expert_mlp(x[token_idx], w_gate_up, w_down) * weights[token_idx, pos, None]
    out.index_add_(0, token_idx, y.to(out.dtype))


Route = tuple[torch.Tensor, torch.Tensor]  # (token_idx, pos): the (token, position) pairs routed to one expert


def routes_by_expert(ids: torch.Tensor, rows: torch.Tensor | None = None) -> dict[int, Route]:
    """ids [N, k] -> {expert: (token_idx, pos)} for every expert routed to (rows: only those tokens), experts
    ascending and each expert's pairs in the order torch.where(ids == expert) gives them, with a few host syncs
    for the whole layer instead of one per expert (a prompt chunk of a 512-expert layer routes to all of them)."""
    N, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # grouped by expert, flat (token-major) order kept within a group
    if rows is not None:
        order = order[rows[:, None].expand(N, k).flatten()[order]]
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    groups = torch.split(order, counts.tolist())
    return {e: (g // k, g % k) for e, g in zip(experts.tolist(), groups)}


class SparseMoE(nn.Module):
    """Router + experts. `moe_index` numbers the sparse blocks of a model (main layers first, then MTP)."""

    def __init__(self, config: ModelConfig, moe_index: int) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe_index = moe_index
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.intermediate_size = moe.moe_intermediate_size
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(() if moe.shared_store else (
            Expert(config.hidden_size, moe.moe_intermediate_size) for _ in range(moe.num_experts)))
        self._provider: tuple[ExpertProvider, ...] = ()  # a tuple: not a submodule, never saved
        # A synthetic source's experts (engine.model.synthetic): rows of a store shared by every layer, this
        # layer's expert e at row store_rows[e]; None: the experts are this block's own parameters.
        self.expert_store: tuple[torch.Tensor, torch.Tensor] | None = None
        self.store_rows: list[int] = []
        # a quantized store's scales (engine.model.moe_quant: FP8 per channel, or 4-bit codes' per group), each
        # tensor's first dimension the store row; None: the store is 16/32-bit
        self.expert_quant: ExpertQuant | None = None
        # A synthetic source's skewed router: a [phases, E] prior added to the logits, by position phase.
        self.router_prior: torch.Tensor | None = None
        self.drift_tokens = 1

    def fuse(self) -> None:
        """Nothing to fuse here: an expert provider keeps gate/up concatenated in its own pool."""

    def attach_provider(self, provider: ExpertProvider | None) -> None:
        self._provider = (provider,) if provider is not None else ()

    def set_expert_store(self, gate_up: torch.Tensor, down: torch.Tensor, rows: list[int],
                         quant: ExpertQuant | None = None) -> None:
        """Serve the experts from a shared store (gate_up [R, 2I, H], down [R, H, I]; expert e is row rows[e]);
        `quant`: the store is quantized (engine.model.moe_quant: e4m3 with one scale per output channel, or 4-bit
        codes, gate_up [R, 2I, H / 8] and down [R, H, I / 8] int32 words, with a scale and offset per group)."""
        if len(rows) != self.num_experts or min(rows) < 0 or max(rows) >= gate_up.shape[0]:
            raise ValueError(f"rows: expected {self.num_experts} store rows in [0, {gate_up.shape[0]})")
        self.expert_store, self.store_rows, self.expert_quant = (gate_up, down), list(rows), quant

    def set_router_prior(self, prior: torch.Tensor, drift_tokens: int) -> None:
        """Add prior[(position // drift_tokens) % phases] ([phases, E], fp32) to the router's logits."""
        if prior.dim() != 2 or prior.shape[1] != self.num_experts or drift_tokens < 1:
            raise ValueError(f"prior {tuple(prior.shape)}, drift_tokens={drift_tokens}: expected [phases, "
                             f"{self.num_experts}] and drift_tokens >= 1")
        self.router_prior, self.drift_tokens = prior, drift_tokens

    def route(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] (positions [N], used by a router prior) -> (weights [N, k] in x's dtype, ids [N, k] long):
        softmax in fp32, top-k, optional renormalisation, as transformers' Qwen3MoeTopKRouter (one launch after
        the gate's product on CUDA: engine.model.moe_route)."""
        if self.router_prior is not None and positions is None:
            raise ValueError("this router has a position prior: positions are required")
        return top_k_route(F.linear(x, self.gate.weight), self.top_k, self.norm_topk_prob, self.router_prior,
                           positions, self.drift_tokens)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert from this block's own parameters (a quantized expert
        dequantized to the router's dtype, the activations' one)."""
        if self.expert_store is not None:
            row = self.store_rows[expert]
            gate_up, down = self.expert_store[0][row], self.expert_store[1][row]
            if self.expert_quant is None:
                return gate_up, down
            return self.expert_quant.at(row).dequantize(gate_up, down, self.gate.weight.dtype)
        e, dtype = self.experts[expert], self.gate.weight.dtype
        return (torch.cat([dense_weight(e.gate_proj, dtype), dense_weight(e.up_proj, dtype)]),
                dense_weight(e.down_proj, dtype))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H] (positions [B, T]: the router prior's phase) -> [B, T, H]."""
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        flat_positions = None if positions is None else positions.reshape(B * T)
        weights, ids = self.route(flat, flat_positions)
        if self._provider:
            out = self._provider[0].moe_forward(self.moe_index, flat, ids, weights, flat_positions)
        else:
            out = torch.zeros_like(flat)
            for expert in sorted(set(ids.flatten().tolist())):
                add_expert(out, flat, ids, weights, expert, *self.expert_weights(expert))
        return out.view(B, T, H)


def sparse_blocks(model: nn.Module) -> list[SparseMoE]:
    """Every SparseMoE of a model, in moe_index order."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    return sorted(blocks, key=lambda b: b.moe_index)


def moe_index_of(config: ModelConfig, layer_idx: int) -> int | None:
    """The moe_index of decoder layer `layer_idx` (MTP layers: num_hidden_layers + i), or None if it is dense."""
    moe = config.moe
    if moe is None or not moe.is_sparse(layer_idx, config.num_hidden_layers):
        return None
    return sum(1 for i in range(layer_idx) if moe.is_sparse(i, config.num_hidden_layers))
