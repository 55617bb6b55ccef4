"""DenseKVCache: batched rows at different positions, rewinding by overwrite, bounds."""

from __future__ import annotations

import pytest
import torch

from engine.model import load_checkpoint
from tests.engine.model.dense_kv import DenseKVCache


def test_rows_at_different_positions_match_their_own_full_forward(tiny_checkpoint):
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu", tokenizer=False)
    model = lm.model
    a = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    b = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(1))
    kv = DenseKVCache.for_config(lm.config, 2, 32)
    with torch.no_grad():
        ref_a = model(a, torch.arange(12)[None])[:, -1]
        ref_b = model(b, torch.arange(7)[None])[:, -1]
        # prefill both rows to 6 tokens together, then feed each row's remaining tokens one by one
        model(torch.cat([a[:, :6], b[:, :6]]), torch.arange(6)[None].expand(2, -1), kv)
        for t in range(6, 11):
            pos_b = min(t, 6)
            ids = torch.tensor([[a[0, t]], [b[0, pos_b]]])
            out = model(ids, torch.tensor([[t], [pos_b]]), kv)
        last = model(torch.tensor([[a[0, 11]], [b[0, 6]]]), torch.tensor([[11], [6]]), kv)
    assert torch.allclose(last[0], ref_a, atol=1e-5)
    assert torch.allclose(last[1], ref_b, atol=1e-5)
    assert out.shape == (2, 1, lm.config.hidden_size)


def test_rewind_by_overwriting_rejected_positions(tiny_checkpoint):
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu", tokenizer=False)
    model = lm.model
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(2))
    kv = DenseKVCache.for_config(lm.config, 1, 16)
    with torch.no_grad():
        ref = model(ids, torch.arange(10)[None])
        model(ids[:, :8], torch.arange(8)[None], kv)
        wrong = (ids[:, 8:10] + 1) % 512
        model(wrong, torch.tensor([[8, 9]]), kv)  # a rejected 2-token draft
        again = model(ids[:, 8:10], torch.tensor([[8, 9]]), kv)  # the accepted tokens overwrite it
    assert torch.allclose(again, ref[:, 8:10], atol=1e-5)


def test_bounds_are_clear_errors():
    kv = DenseKVCache(num_layers=1, batch_size=1, max_tokens=4, num_kv_heads=1, head_dim=2)
    q = torch.zeros(1, 1, 1, 2)
    with pytest.raises(ValueError, match=r"positions reach 4; this cache holds positions 0\.\.3"):
        kv.attend(0, q, q, q, torch.tensor([[4]]))
    with pytest.raises(IndexError, match="layer_idx=1"):
        kv.attend(1, q, q, q, torch.tensor([[0]]))
    with pytest.raises(ValueError, match="max_tokens=0"):
        DenseKVCache(num_layers=1, batch_size=1, max_tokens=0, num_kv_heads=1, head_dim=2)
    assert kv.nbytes() == 2 * 4 * 2 * 4
