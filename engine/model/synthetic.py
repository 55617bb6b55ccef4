"""Seeded synthetic MoE models without a file: `--model random:moe-80b` and its smaller relatives.

A seed-scale mixture of experts (48 layers x 512 experts, bf16: ~147 GiB of routed experts) cannot be written to
the GPU machine's disk, so these sources are generated at load, on the target device, deterministically: every
tensor's values come from a Philox generator seeded by (the model's seed, the tensor's name), so two starts on one
device are the same model, and generation runs at the device's memory bandwidth.

    lm = load_synthetic("moe-80b", dtype, device, expert_device)   # a LoadedModel, as load_checkpoint returns

**The expert store.** 48 x 512 distinct bf16 experts are more than the GPU machine's host memory (128 GiB), so a
pinned host copy of each cannot exist. Instead each sparse layer's experts are rows of one shared store of
`store_rows` distinct experts (`SparseMoE.expert_store`: gate_up [R, 2I, H], down [R, H, I] and the layer's
`rows[E]`, expert -> store row, a seeded draw): generated on the device a chunk at a time, then copied straight
into pinned host memory when the experts live on the host (the engine's expert cache), or kept on the device.
A cache miss is still a whole expert copied over PCIe from pinned memory (its cost is real); what is synthetic is
only that two (layer, expert) pairs may share bytes. Regenerating a missed expert on the device from its seed was
the alternative: it needs no host memory, but a miss would cost a few microseconds of generation instead of a
PCIe copy, and the cold-expert measurements would mean nothing for a real checkpoint.

**The skewed router.** Random gates route almost uniformly, so no cache policy could matter. Each sparse layer
adds a seeded Zipf prior to its router logits (`SparseMoE.router_bias [phases, E]`: `-skew * ln(rank + 1)` over a
seeded permutation of the experts) which drifts with the token's position: every `drift_tokens` positions the
ranking rolls by `drift_experts`, so the hot set moves slowly along a long prompt, as real routing does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.model.causal_lm import CausalLM
from engine.model.config import MoEConfig, MTPConfig, ModelConfig, RopeConfig
from engine.model.moe import sparse_blocks
from engine.model.moe_quant import CODES_PER_WORD, ExpertQuant, Fp8Experts, Int4Experts, int4_layout, quant_tensors, \
    round_int4
from engine.model.quant.linear import FP8_MAX
from engine.model.quant.rtn import int4_group_size
from engine.model.tokenizer import CHATML_TEMPLATE, Tokenizer
from engine.model.toy_tokenizer import SPECIAL_TOKENS, toy_tokenizer_json

PREFIX = "random:"
EXPERT_FORMATS = (None, "fp8", "int4")  # how the store may round the generated experts (`--quantize`)
_INIT_STD = 0.02
_TOKENIZER_VOCAB = 512
_CHUNK_ROWS = 64  # store rows generated on the device at once before their copy to the host


@dataclass(frozen=True)
class SyntheticSpec:
    """One synthetic source: the model's shape and how its experts and router are generated."""

    config: ModelConfig
    store_rows: int  # distinct experts in the shared store (each layer's experts are rows of it)
    router_skew: float = 1.0  # the Zipf exponent of the router prior (0: uniform, the gates alone route)
    drift_tokens: int = 2048  # positions per phase of the prior
    drift_experts: int = 8  # how far the ranking rolls from one phase to the next
    phases: int = 64  # distinct phases in the table (position phases wrap around after phases x drift_tokens)
    seed: int = 0


def _moe_config(layers: int, experts: int, top_k: int, hidden: int, inter: int, heads: int, kv_heads: int,
                head_dim: int, vocab: int) -> ModelConfig:
    return ModelConfig(
        arch="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=False,
        max_position_embeddings=262144, rope=RopeConfig(theta=10_000_000.0), rms_norm_eps=1e-6, qk_norm=True,
        mtp=MTPConfig(1, "deepseek"), torch_dtype="bfloat16",
        moe=MoEConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                      norm_topk_prob=True, shared_store=True),
    )


SPECS: dict[str, SyntheticSpec] = {
    # The seed report's scale (a Qwen3-Next-80B-A3B shape with standard attention): 48 x 512 experts of 6 MiB in
    # bf16, ~147 GiB, more than an H200 holds; plus an MTP layer (a 49th sparse layer). 2,048 distinct experts
    # (12 GiB) fill the pinned host store.
    "moe-80b": SyntheticSpec(_moe_config(48, 512, 10, 2048, 512, 16, 2, 256, 151936), store_rows=2048),
    # The comparison: the same shape with 40 layers, whose ~123 GiB of experts all fit the card.
    "moe-80b-40l": SyntheticSpec(_moe_config(40, 512, 10, 2048, 512, 16, 2, 256, 151936), store_rows=2048),
    # Tests on CPU: 3 sparse layers + MTP of 16 experts (top-2); 24 distinct experts shared by 64 (layer, expert).
    "moe-synth-tiny": SyntheticSpec(_moe_config(3, 16, 2, 64, 32, 4, 2, 16, 512), store_rows=24,
                                    router_skew=1.5, drift_tokens=8, drift_experts=2, phases=8),
}


def is_synthetic(model: str | Path) -> bool:
    """Whether `--model` names a synthetic source (random:NAME with NAME in SPECS)."""
    text = str(model)
    return text.startswith(PREFIX) and text[len(PREFIX):] in SPECS


def tensor_seed(seed: int, name: str) -> int:
    """The Philox seed of one tensor: a hash of (the model's seed, the tensor's name), so the value of a tensor
    does not depend on the order tensors are made in or on which other tensors exist."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_normal(shape: tuple[int, ...], name: str, seed: int, dtype: torch.dtype, device: torch.device,
                  std: float = _INIT_STD, mean: float = 0.0) -> torch.Tensor:
    """N(mean, std) of `shape`, generated on `device` from `tensor_seed(seed, name)`."""
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=device).normal_(mean, std, generator=gen)


def router_prior(spec: SyntheticSpec, moe_index: int, device: torch.device) -> torch.Tensor:
    """[phases, E] fp32: the skewed, drifting prior added to one layer's router logits (see the module doc)."""
    E = spec.config.moe.num_experts
    gen = torch.Generator().manual_seed(tensor_seed(spec.seed, f"router_prior.{moe_index}"))
    order = torch.randperm(E, generator=gen)  # order[r]: the expert of rank r in phase 0
    base_rank = torch.empty(E, dtype=torch.long)
    base_rank[order] = torch.arange(E)
    phase = torch.arange(spec.phases)[:, None]
    rank = (base_rank[None, :] + phase * spec.drift_experts) % E  # [phases, E]
    return (-spec.router_skew * torch.log1p(rank.to(torch.float32))).to(device)


def _per_channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 [..., N, K], fp32 scale [..., N]): each output channel's amax maps to e4m3's 448, as
    `--quantize fp8` rounds a projection (engine.model.quant.rtn.quantize_fp8)."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _store(spec: SyntheticSpec, dtype: torch.dtype, gen_device: torch.device, where: torch.device,
           pin: bool, fmt: str | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], ExpertQuant | None]:
    """The shared expert store: `store_rows` experts, generated on `gen_device` a chunk at a time into `where`;
    `fmt` "fp8": each chunk rounded to e4m3 per output channel before it moves, "int4": to 4-bit codes with a
    scale and offset per group as `--quantize int4` rounds a projection (gate_up [R, 2I, H / 8], down
    [R, H, I / 8] int32 words); then also their scales (engine.model.moe_quant)."""
    cfg = spec.config
    H, I, R = cfg.hidden_size, cfg.moe.moe_intermediate_size, spec.store_rows

    def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(R, *shape, dtype=dtype, device=where, pin_memory=pin)

    quant: ExpertQuant | None = None
    if fmt == "int4":
        gu_group, dn_group = int4_group_size(H), int4_group_size(I)
        # the scale dtype `--quantize int4` gives the model's other projections (engine.model.quant.rtn)
        sdtype = torch.float32 if dtype == torch.float32 else torch.float16
        gate_up = empty(2 * I, H // CODES_PER_WORD, dtype=torch.int32)
        down = empty(H, I // CODES_PER_WORD, dtype=torch.int32)
        quant = Int4Experts(empty(2 * I, H // gu_group, dtype=sdtype), empty(2 * I, H // gu_group, dtype=sdtype),
                            empty(H, I // dn_group, dtype=sdtype), empty(H, I // dn_group, dtype=sdtype),
                            gu_group, dn_group, int4_layout(H, gu_group), int4_layout(I, dn_group))
    else:
        held = torch.float8_e4m3fn if fmt == "fp8" else dtype
        gate_up, down = empty(2 * I, H, dtype=held), empty(H, I, dtype=held)
        if fmt == "fp8":
            quant = Fp8Experts(empty(2 * I), empty(H))
    for start in range(0, R, _CHUNK_ROWS):
        end = min(R, start + _CHUNK_ROWS)
        chunk_gu = torch.stack([seeded_normal((2 * I, H), f"experts.{r}.gate_up", spec.seed, dtype, gen_device)
                                for r in range(start, end)])
        chunk_dn = torch.stack([seeded_normal((H, I), f"experts.{r}.down", spec.seed, dtype, gen_device)
                                for r in range(start, end)])
        parts: tuple[torch.Tensor, ...] = ()  # the chunk's scale tensors, in quant.tensors()'s order
        if fmt == "fp8":
            (chunk_gu, gu_scale), (chunk_dn, dn_scale) = _per_channel_fp8(chunk_gu), _per_channel_fp8(chunk_dn)
            parts = (gu_scale, dn_scale)
        elif fmt == "int4":
            chunk_gu, gu_scales, gu_offsets = round_int4(chunk_gu, quant.gate_up_group, quant.gate_up_scales.dtype)
            chunk_dn, dn_scales, dn_offsets = round_int4(chunk_dn, quant.down_group, quant.down_scales.dtype)
            parts = (gu_scales, gu_offsets, dn_scales, dn_offsets)
        for dst, src in zip(quant_tensors(quant), parts):
            dst[start:end].copy_(src, non_blocking=pin)
        gate_up[start:end].copy_(chunk_gu, non_blocking=pin)
        down[start:end].copy_(chunk_dn, non_blocking=pin)
    if gen_device.type == "cuda":
        torch.cuda.synchronize(gen_device)  # the pinned copies are asynchronous; the chunks are freed after
    return (gate_up, down), quant


def build_synthetic(name: str, dtype: torch.dtype, device: torch.device,
                    expert_device: torch.device | None = None, experts_format: str | None = None) -> CausalLM:
    """The model of `random:NAME`, every parameter generated from its seed on `device`; the routed experts in the
    shared store on `expert_device` (pinned host memory when that is the CPU and `device` is CUDA), rounded as
    `experts_format` says (None: the 16/32-bit values; "fp8": e4m3 with per-channel scales; "int4": 4-bit codes
    with a scale and offset per group; the values the 16-bit store holds, rounded)."""
    if experts_format not in EXPERT_FORMATS:
        raise ValueError(f"experts_format={experts_format!r}: expected one of {EXPERT_FORMATS}")
    spec = SPECS[name]
    cfg = spec.config
    with torch.device("meta"):
        model = CausalLM(cfg)
    blocks = sparse_blocks(model)  # with no module per expert (MoEConfig.shared_store): the store holds them
    for pname, param in list(model.named_parameters()):
        if pname.endswith("norm.weight"):
            # near 1 but not exactly 1, as write_random_checkpoint's norms
            tensor = seeded_normal(tuple(param.shape), pname, spec.seed, torch.float32, device, 0.1, 1.0).to(dtype)
        else:
            tensor = seeded_normal(tuple(param.shape), pname, spec.seed, dtype, device)
        module_name, _, leaf = pname.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))
    where = expert_device or device
    pin = where.type == "cpu" and device.type == "cuda"
    (gate_up, down), quant = _store(spec, dtype, device, where, pin, experts_format)
    for block in blocks:
        gen = torch.Generator().manual_seed(tensor_seed(spec.seed, f"store_rows.{block.moe_index}"))
        rows = torch.randint(spec.store_rows, (block.num_experts,), generator=gen)
        block.set_expert_store(gate_up, down, rows.tolist(), quant)
        if spec.router_skew:
            block.set_router_prior(router_prior(spec, block.moe_index, device), spec.drift_tokens)
    model.rotary.reset_parameters(device)
    model.requires_grad_(False)
    return model.eval()


def synthetic_tokenizer() -> tuple[Tokenizer, tuple[int, ...]]:
    """The toy ChatML tokenizer random checkpoints carry, and its eos ids (<|im_end|>, <|endoftext|>)."""
    from tokenizers import Tokenizer as HFTokenizer

    endoftext, _, im_end = SPECIAL_TOKENS
    special = {"eos_token": im_end, "pad_token": endoftext, "bos_token": None, "chat_template": CHATML_TEMPLATE}
    tok = Tokenizer(HFTokenizer.from_str(toy_tokenizer_json(_TOKENIZER_VOCAB)), CHATML_TEMPLATE, special)
    return tok, (SPECIAL_TOKENS.index(im_end), SPECIAL_TOKENS.index(endoftext))
