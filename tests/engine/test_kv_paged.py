"""The block pool and block table: every read and write goes through the table, so a slot may map any blocks.

CPU tests drive the reference backend (the Triton interpreter is not a usable oracle on CPU, KERNELS.md); the
kernel itself is checked against the reference on the GPU in test_kv_paged_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.exec.kv_cache import KVGeometry, SlotKVCache
from engine.model.attention.backends import kernel_backend

PATHS = ["sdpa", "split", "blocked", "chunk"]


def _cache(storage: str, block_tokens: int = 16) -> SlotKVCache:
    geo = KVGeometry(num_layers=2, num_slots=3, num_kv_heads=2, head_dim=16, context_tokens=200, margin_tokens=16,
                     block_tokens=block_tokens)
    return SlotKVCache(geo, storage, torch.float32, "cpu")


def _shuffle_table(cache: SlotKVCache, seed: int) -> None:
    """Map every slot's logical blocks to a random permutation of the pool's physical blocks."""
    perm = torch.randperm(cache.geometry.num_blocks, generator=torch.Generator().manual_seed(seed))
    cache.block_table.copy_(perm.view_as(cache.block_table).to(torch.int32))


def _run(cache: SlotKVCache, path: str, seed: int) -> list[torch.Tensor]:
    """Prefill two slots, then one step of the path; every attention output, in order."""
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for slot, n in ((0, 150), (2, 37)):
        q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h in (4, 2, 2))
        cache.bind(torch.tensor([slot]), span_tokens=200)
        outs.append(cache.attend(1, q, k, v, torch.arange(n).view(1, -1)))
    if path == "split":
        cache.set_path(True, False)
        cache.split_tokens = 32
    if path == "blocked":
        cache.block_kv_bytes = 1
    t = 12 if path == "chunk" else 3
    q, k, v = (torch.randn(2, h, t, 16, generator=gen) for h in (4, 2, 2))
    positions = torch.stack([torch.arange(150, 150 + t), torch.arange(37, 37 + t)])
    if path == "chunk":
        cache.bind_chunk(torch.tensor([0]), 200, 150, t)
        outs.append(cache.attend(1, q[:1], k[:1], v[:1], positions[:1]))
    else:
        cache.bind(torch.tensor([0, 2]), span_tokens=200)
        outs.append(cache.attend(1, q, k, v, positions))
    return outs


@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("path", PATHS)
def test_any_block_table_gives_the_same_attention(storage, path):
    plain, shuffled = _cache(storage), _cache(storage)
    _shuffle_table(shuffled, seed=5)
    assert not torch.equal(plain.block_table, shuffled.block_table)
    for a, b in zip(_run(plain, path, 1), _run(shuffled, path, 1)):
        assert torch.equal(a, b)
    # ...because the tokens really sit elsewhere in the pool, and read back the same through the table
    assert not torch.equal(plain.k[1], shuffled.k[1])
    assert torch.equal(plain.slot_keys(1), shuffled.slot_keys(1))


def test_block_size_does_not_change_the_output():
    outs = [_run(_cache("bf16", block_tokens=bt), "sdpa", 2) for bt in (8, 64)]
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-6)


def test_tier_spans_move_through_the_block_table():
    src, dst = _cache("int8"), _cache("int8")
    _shuffle_table(dst, seed=9)
    _run(src, "sdpa", 3)
    data, scales = src.read_span(0, 32, 96)
    dst.write_span(1, 64, data, scales)
    again, again_scales = dst.read_span(1, 64, 128)
    assert torch.equal(again, data) and torch.equal(again_scales, scales)
    assert torch.equal(dst.slot_keys(0)[1, :, 64:128].float(), src.slot_keys(0)[0, :, 32:96].float())


def test_columns_round_up_to_whole_blocks_and_the_pool_is_accounted():
    geo = KVGeometry(2, 3, 2, 16, 200, 16, block_tokens=64)
    assert geo.blocks_per_slot == 4 and geo.columns == 256 and geo.num_blocks == 12
    cache = SlotKVCache(geo, "int8", torch.float32, "cpu")
    assert cache.k[0].shape == (2, 12, 64, 16) and cache.k_scale[0].shape == (2, 12, 64)
    assert cache.nbytes == geo.total_bytes("int8", torch.float32)


def test_no_kernel_backend_on_cpu_so_paged_runs_the_reference():
    cache = _cache("bf16")
    assert kernel_backend(torch.device("cpu")) is None and cache.kernel is None
    cache.set_path(False, True)
    assert cache.backend is cache.reference
