"""SlotKVCache: every attention path (SDPA, blocked online softmax, split-KV) against plain dense attention."""

from __future__ import annotations

import pytest
import torch

from engine.exec.kv.cache import SlotKVCache, dequantize_int8, quantize_int8
from engine.exec.kv.geometry import KVGeometry


def _reference(q, ks, vs, positions):
    """Dense causal attention per row: q [B,Hq,T,D], ks/vs lists of [Hkv, L, D] per row."""
    outs = []
    for b in range(q.shape[0]):
        hq, hkv = q.shape[1], ks[b].shape[0]
        k = ks[b].repeat_interleave(hq // hkv, 0)
        v = vs[b].repeat_interleave(hq // hkv, 0)
        s = q[b] @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # [Hq, T, L]
        keys = torch.arange(k.shape[1])
        s = s.masked_fill(keys.view(1, 1, -1) > positions[b].view(1, -1, 1), float("-inf"))
        outs.append(torch.softmax(s, -1) @ v)
    return torch.stack(outs)


def _cache(storage="bf16", slots=3, context=600, hkv=2, d=16):
    geo = KVGeometry(num_layers=2, num_slots=slots, num_kv_heads=hkv, head_dim=d, context_tokens=context, margin_tokens=32)
    return SlotKVCache(geo, storage, torch.float32, "cpu")


def _fill(cache, slot, layer, length, gen):
    """Write `length` tokens into a slot through attend (prefill), return the k, v written."""
    k = torch.randn(1, 2, length, 16, generator=gen)
    v = torch.randn(1, 2, length, 16, generator=gen)
    q = torch.randn(1, 4, length, 16, generator=gen)
    cache.bind(torch.tensor([slot]), span_tokens=length)
    cache.attend(layer, q, k, v, torch.arange(length).view(1, -1))
    return k[0], v[0]


@pytest.mark.parametrize("path", ["sdpa", "split", "blocked", "blocked_keys", "blocked_decode", "fused_chunk"])
def test_attention_paths_match_dense_reference(path):
    gen = torch.Generator().manual_seed(0)
    cache = _cache()
    lengths = {0: 530, 2: 97}
    written = {s: _fill(cache, s, 1, n, gen) for s, n in lengths.items()}
    if path == "split":
        cache.set_path(True, cache.paged, cache.paged_prefill)
        cache.split_tokens = 128
    if path == "blocked":
        cache.block_scores_bytes = 1  # every multi-token forward attends a few queries at a time
    if path == "blocked_keys":
        cache.block_kv_bytes = 1  # a chunk whose key copy would be too big reads block by block
    if path == "blocked_decode":
        cache.block_kv_bytes = 1  # a decode whose key copy would be too big reads block by block
    if path == "fused_chunk":
        cache.fused_prefill = True  # the CUDA flash path; on CPU torch runs the same math unfused
        _check_chunk(cache, written[0], gen)
        return
    t = 12 if path in ("blocked", "blocked_keys") else 2
    q = torch.randn(2, 4, t, 16, generator=gen)
    k_new = torch.randn(2, 2, t, 16, generator=gen)
    v_new = torch.randn(2, 2, t, 16, generator=gen)
    positions = torch.stack([torch.arange(530, 530 + t), torch.arange(97, 97 + t)])
    cache.bind(torch.tensor([0, 2]), span_tokens=560)
    out = cache.attend(1, q, k_new, v_new, positions)
    ks = [torch.cat([written[0][0], k_new[0]], 1), torch.cat([written[2][0], k_new[1]], 1)]
    vs = [torch.cat([written[0][1], v_new[0]], 1), torch.cat([written[2][1], v_new[1]], 1)]
    ref = _reference(q, ks, vs, positions)
    assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()


def _check_chunk(cache, written, gen):
    """A 12-token chunk at position 530 padded to 16 rows: the real rows match dense attention."""
    n, tb, start = 12, 16, 530
    q = torch.randn(1, 4, tb, 16, generator=gen)
    k_new = torch.randn(1, 2, tb, 16, generator=gen)
    v_new = torch.randn(1, 2, tb, 16, generator=gen)
    positions = torch.cat([torch.arange(start, start + n), torch.arange(600, 600 + tb - n)]).view(1, -1)  # pads: scratch
    cache.bind_chunk(torch.tensor([0]), 560, start, tb)
    out = cache.attend(1, q, k_new, v_new, positions)
    ks = [torch.cat([written[0], k_new[0, :, :n]], 1)]
    vs = [torch.cat([written[1], v_new[0, :, :n]], 1)]
    ref = _reference(q[:, :, :n], ks, vs, positions[:, :n])
    assert torch.allclose(out[:, :, :n], ref, atol=1e-4), (out[:, :, :n] - ref).abs().max()


def test_stale_kv_past_a_rolled_back_position_is_invisible():
    gen = torch.Generator().manual_seed(1)
    cache = _cache()
    k, v = _fill(cache, 1, 0, 40, gen)
    q = torch.randn(1, 4, 1, 16, generator=gen)
    cache.bind(torch.tensor([1]), span_tokens=64)
    # Re-writing position 20 (as after a rejected draft) must hide the old tokens 21..39.
    out = cache.attend(0, q, k[:, 20:21].unsqueeze(0), v[:, 20:21].unsqueeze(0), torch.tensor([[20]]))
    ref = _reference(q, [k[:, :21]], [v[:, :21]], torch.tensor([[20]]))
    assert torch.allclose(out, ref, atol=1e-5)


def test_int8_roundtrip_error_is_within_half_a_step_per_token_and_head():
    x = torch.randn(3, 5, 7, 64) * torch.rand(3, 5, 7, 1) * 10
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    err = (dequantize_int8(q, scale, torch.float32) - x).abs()
    assert bool((err <= scale.unsqueeze(-1) * 0.5 + 1e-6).all())


def test_int8_cache_attention_is_close_to_bf16_cache():
    gen = torch.Generator().manual_seed(2)
    a, b = _cache("bf16"), _cache("int8")
    k = torch.randn(1, 2, 50, 16, generator=gen)
    v = torch.randn(1, 2, 50, 16, generator=gen)
    q = torch.randn(1, 4, 50, 16, generator=gen)
    outs = []
    for cache in (a, b):
        cache.bind(torch.tensor([0]), span_tokens=64)
        outs.append(cache.attend(0, q, k, v, torch.arange(50).view(1, -1)))
    assert 0 < (outs[0] - outs[1]).abs().max() < 0.05


def test_span_roundtrip_moves_one_slots_tokens_to_another():
    gen = torch.Generator().manual_seed(3)
    for storage in ("bf16", "int8"):
        cache = _cache(storage)
        _fill(cache, 0, 0, 64, gen)
        _fill(cache, 0, 1, 64, gen)
        data, scales = cache.read_span(0, 16, 48)
        assert data.shape == (2, 2, 2, 32, 16)
        cache.write_span(2, 16, data, scales)
        again, again_scales = cache.read_span(2, 16, 48)
        assert torch.equal(again, data)
        assert (scales is None) == (storage == "bf16")


def test_geometry_accounts_int8_scales():
    geo = KVGeometry(num_layers=4, num_slots=2, num_kv_heads=8, head_dim=128, context_tokens=1000, margin_tokens=24)
    assert geo.bytes_per_token("bf16", torch.bfloat16) == 2 * 4 * 8 * 128 * 2
    assert geo.bytes_per_token("int8", torch.bfloat16) == 2 * 4 * 8 * (128 + 4)
    cache = SlotKVCache(KVGeometry(2, 2, 2, 16, 100, 4), "int8", torch.float32, "cpu")
    assert cache.nbytes == cache.geometry.total_bytes("int8", torch.float32)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_non_finite_blocks_are_found_a_slice_at_a_time_and_zeroed(storage, monkeypatch):
    """What a request that met NaN logits leaves behind: the blocks holding NaN or inf, in any layer's keys,
    values or int8 scales, found however small the slices the check takes; zeroed, they hold a fresh pool's
    data and the rest is untouched."""
    import engine.exec.kv.cache as cache_module

    cache = _cache(storage)
    gen = torch.Generator().manual_seed(0)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randint(-50, 50, pool.shape, generator=gen).to(pool.dtype))
    before = [p.clone() for p in (*cache.k, *cache.v, *cache.k_scale, *cache.v_scale)]
    if storage == "int8":
        cache.k_scale[1][0, 3, 5] = float("nan")
        cache.v_scale[0][1, 7, 0] = float("inf")
        want = {3, 7}
    else:
        cache.k[1][0, 3, 5, 2] = float("nan")
        cache.v[0][1, 7, 0, 0] = float("-inf")
        want = {3, 7}
    monkeypatch.setattr(cache_module, "SCRUB_CHUNK_BYTES", 1)  # one block a slice
    assert cache.non_finite_blocks() == want
    cache.zero_blocks(want)
    assert cache.non_finite_blocks() == set()
    for old, new in zip(before, (*cache.k, *cache.v, *cache.k_scale, *cache.v_scale)):
        keep = [b for b in range(new.shape[1]) if b not in want]
        assert torch.equal(old[:, keep], new[:, keep])
        fill = 1 if new.is_floating_point() and new.dim() == 3 and storage == "int8" else 0
        assert bool((new[:, sorted(want)] == fill).all())
    assert cache.blocks_of([1]) == set(cache.block_table[1].tolist())
