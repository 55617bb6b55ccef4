"""The Triton paged kernels against the PyTorch reference, on the GPU (skipped without CUDA).

Same cache, same bound forward, the two backends: bf16 / fp32 / int8 storage, GQA ratios 1, 2 and 5, 1 to 8
queries per row, a shuffled block table, padding rows, spans that take one split and many. Then a captured
CUDA graph replayed with other lengths and another block table gives what eager gives.
"""

from __future__ import annotations

import pytest
import torch

from engine.exec.kv.cache import SlotKVCache
from engine.model.attention.triton_paged_config import KernelConfig
from tests.engine.exec.cuda_capture import capture
from tests.engine.exec.scrambled_cache import scrambled_cache

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_shared]  # kernels and models: no engine, no VRAM figure

CONTEXT = 3000


def _cache(storage: str, dtype: torch.dtype, hkv: int, seed: int = 0) -> SlotKVCache:
    return scrambled_cache(storage, dtype, hkv, CONTEXT, num_slots=4, seed=seed)


def _both(cache: SlotKVCache, hq: int, t: int, ends: list[int], span: int, config: KernelConfig, pad_rows: int = 1):
    """(kernel, reference, padding rows' kernel output) of one bound forward; rows end at `ends`."""
    from engine.model.attention.triton_paged import paged_decode_attention

    b = len(ends) + pad_rows
    gen = torch.Generator(device="cuda").manual_seed(len(ends) * 7 + t)
    q = torch.randn(b, hq, t, cache.geometry.head_dim, device="cuda", generator=gen, dtype=cache.compute_dtype)
    slots = torch.tensor([i % cache.geometry.num_slots for i in range(b)], device="cuda")
    pos = [[e - t + j for j in range(t)] for e in ends] + [[CONTEXT + j for j in range(t)]] * pad_rows
    positions = torch.tensor(pos, device="cuda")
    cache.bind(slots, span)
    scales = (cache.k_scale[0], cache.v_scale[0]) if cache.storage == "int8" else (None, None)
    kernel = paged_decode_attention(q, cache.k[0], cache.v[0], *scales, cache.block_table, slots, positions, span,
                                    CONTEXT, config)
    reference = cache.reference.attend(cache, 0, q, positions)
    return kernel[:len(ends)], reference[:len(ends)], kernel[len(ends):]


BF16, FP32 = torch.bfloat16, torch.float32
DEFAULT, WIDE, NARROW = KernelConfig(), KernelConfig(128, 8, 2), KernelConfig(32, 4, 2)
BLOCK, TMA = KernelConfig(64, 4, 2, 1, "block"), KernelConfig(64, 4, 2, 1, "tma")  # a tile = one 64-token block
CASES = [  # storage, compute dtype, Hq, Hkv, queries per row, launch shape (fp32 x 40 heads x 8 queries is a long
    # Triton compile for a shape no engine runs, so 3 queries; 40 heads x 8 stays covered in bf16)
    ("bf16", BF16, 16, 8, 1, DEFAULT), ("bf16", BF16, 16, 8, 3, DEFAULT), ("int8", BF16, 16, 8, 1, DEFAULT),
    ("int8", BF16, 16, 8, 3, DEFAULT), ("bf16", BF16, 40, 8, 8, DEFAULT), ("int8", BF16, 40, 8, 2, DEFAULT),
    ("bf16", BF16, 4, 4, 1, DEFAULT), ("bf16", FP32, 16, 8, 3, DEFAULT), ("int8", FP32, 40, 8, 3, DEFAULT),
    ("bf16", BF16, 16, 8, 1, WIDE), ("int8", BF16, 16, 8, 3, WIDE), ("int8", BF16, 16, 8, 1, NARROW),
    ("bf16", BF16, 16, 8, 1, TMA), ("int8", BF16, 16, 8, 3, TMA), ("int8", BF16, 40, 8, 2, BLOCK),
]


@pytest.mark.parametrize("storage,dtype,hq,hkv,t,config", CASES)
def test_kernel_matches_the_reference(storage, dtype, hq, hkv, t, config):
    cache = _cache(storage, dtype, hkv)
    assert cache.kernel is not None
    for ends, span in (([200, 17], 256), ([2900, 1000, 64], 3000)):  # one split; many splits
        kernel, reference, pads = _both(cache, hq, t, ends, span, config)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        err = (kernel.float() - reference.float()).abs().max().item()
        assert err <= tol, (storage, dtype, hq, hkv, t, config, ends, err)
        assert torch.isfinite(pads).all() and not pads.any()  # padding rows read nothing


def test_captured_kernel_replays_with_new_lengths_and_block_table_like_eager():
    cache = _cache("int8", torch.bfloat16, 8)
    b, hq, t, span = 2, 16, 3, 3000
    q = torch.randn(b, hq, t, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([0, 2], device="cuda")
    positions = torch.tensor([[100, 101, 102], [10, 11, 12]], device="cuda")

    def step():
        cache.bind(slots, span)
        return cache.kernel.attend(cache, 0, q, positions)

    graph, out = capture(step)
    positions.copy_(torch.tensor([[2500, 2501, 2502], [700, 701, 702]], device="cuda"))
    perm = torch.randperm(cache.geometry.num_blocks, generator=torch.Generator().manual_seed(4))
    cache.block_table.copy_(perm.view_as(cache.block_table).to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())
