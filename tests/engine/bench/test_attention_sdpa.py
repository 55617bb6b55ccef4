"""The vendor-SDPA comparison path of `bench attention` (engine.bench.attention_sdpa), its CPU-reachable parts: the
prefix gathered through the block table in query-head order, and segments merged by their log-sum-exps. The
cuDNN and flash calls themselves run on the GPU (`bench attention --backends cudnn,flash`)."""

from __future__ import annotations

import pytest
import torch

from engine.bench.attention_common import HEAD_DIM, HKV, HQ, filled_cache
from engine.bench.attention_sdpa import gather_heads, merge_into


def _lse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        t = q.shape[2]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v.float(), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_segments_merged_by_lse_equal_one_causal_read_of_the_slot(storage: str) -> None:
    prefix, chunk = 320, 48
    cache = filled_cache(prefix + chunk, 2, storage, torch.float32, torch.device("cpu"))
    cache.block_table = cache.block_table.flip(0).contiguous()  # slot 1's blocks are not slot 0's
    cache.bind(torch.tensor([1]), prefix + chunk)
    q = torch.randn(1, HQ, chunk, HEAD_DIM)
    acc = None
    for seg in range(0, prefix, 128):  # 128, 128, 64: uneven segments, block-crossing bounds
        kk, vv = gather_heads(cache, 0, seg, min(prefix, seg + 128), HQ)
        acc = merge_into(acc, *_lse_attention(q, kk, vv, False))
    kk, vv = gather_heads(cache, 0, prefix, prefix + chunk, HQ)
    merged = merge_into(acc, *_lse_attention(q, kk, vv, True))[0]

    keys, values = cache.read(0, torch.tensor([1]), 0, prefix + chunk)  # the reference's own gather
    keys, values = (x.repeat_interleave(HQ // HKV, dim=1) for x in (keys, values))
    visible = torch.arange(prefix + chunk)[None, :] <= torch.arange(prefix, prefix + chunk)[:, None]
    scores = (q @ keys.transpose(-1, -2)) * HEAD_DIM ** -0.5
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ values
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-5)
