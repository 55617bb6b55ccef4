"""The paged decode kernel never lets a key past a row's length into its output: such keys are masked out of the
scores, but P.V still multiplies what they hold by 0, and 0 * NaN is NaN. With "gather" loads the keys past the
length read pool block 0 (another slot's first block, or KV by use's scratch); with "block" loads they are the rest
of the row's own last block. A NaN there (a slot whose request is ending on NaN logits) reaches every other
decoding row, under graphs and decode ahead too. Run in Triton's interpreter (CPU tensors, fp32), skipped
where Triton is not installed (CI); on the GPU by tests/engine/test_engine_nan_logits.py's gpu cases."""

from __future__ import annotations

import pytest

from tests.engine.exec.triton_interpreter import run_in_interpreter


def check_nan_past_the_length_stays_out(loads: str, int8: bool) -> None:
    """Two slots of 4 blocks of 16 tokens: slot 0 (blocks 0..3) holds NaN everywhere, slot 1 (blocks 4..7) has
    20 finite keys and NaN past them in its own blocks; a query of slot 1 at position 19 gives the reference."""
    import torch

    from engine.model.attention.triton_paged import paged_decode_attention
    from engine.model.attention.triton_paged_config import KernelConfig

    torch.manual_seed(0)
    hkv, hq, d, bt, blocks = 1, 2, 16, 16, 8
    k = torch.randn(hkv, blocks, bt, d)
    v = torch.randn(hkv, blocks, bt, d)
    length = 20
    own = torch.zeros(blocks, bt, dtype=torch.bool)
    own[4], own[5, :length - bt] = True, True  # slot 1's first 20 positions
    k[:, ~own], v[:, ~own] = float("nan"), float("nan")
    ks = vs = None
    k_ref, v_ref = k[:, 4:6].reshape(hkv, 2 * bt, d)[:, :length], v[:, 4:6].reshape(hkv, 2 * bt, d)[:, :length]
    if int8:
        ks = k.abs().amax(-1) / 127.0
        vs = v.abs().amax(-1) / 127.0
        k = torch.round(k / ks[..., None]).nan_to_num(0.0).clamp(-127, 127).to(torch.int8)
        v = torch.round(v / vs[..., None]).nan_to_num(0.0).clamp(-127, 127).to(torch.int8)
        k_ref = (k.float() * ks[..., None])[:, 4:6].reshape(hkv, 2 * bt, d)[:, :length]
        v_ref = (v.float() * vs[..., None])[:, 4:6].reshape(hkv, 2 * bt, d)[:, :length]
    table = torch.arange(blocks, dtype=torch.int32).view(2, 4)
    q = torch.randn(1, hq, 1, d)
    config = KernelConfig(tile_tokens=64 if loads == "gather" else 16, loads=loads)
    out = paged_decode_attention(q, k, v, ks, vs, table, torch.tensor([1]), torch.tensor([[length - 1]]),
                                 span_tokens=64, context_tokens=64, config=config)
    scores = torch.einsum("hd,khd->hk", q[0, :, 0], k_ref.expand(hq, -1, -1).transpose(0, 1)) / d ** 0.5
    want = torch.einsum("hk,hkd->hd", scores.softmax(-1), v_ref.expand(hq, -1, -1))
    assert torch.isfinite(out).all(), out
    torch.testing.assert_close(out[0, :, 0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("loads", ["gather", "block"])
@pytest.mark.parametrize("int8", [False, True])
def test_keys_past_a_rows_length_never_reach_its_output(loads, int8):
    run_in_interpreter(__name__, "check_nan_past_the_length_stays_out", loads, int8)
