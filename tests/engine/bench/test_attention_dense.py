"""The dense flash kernel `bench attention` measures the paged prefill kernel against (engine.bench.attention_dense),
in Triton's interpreter on CPU tensors (fp32): a chunk's causal attention over contiguous keys equals the reference,
with unmasked and masked key tiles, several query tiles, a last tile cut short and grouped query heads."""

from __future__ import annotations

import pytest
import torch

from tests.engine.exec.triton_interpreter import run_in_interpreter


def interpreter_check(start: int, chunk: int, hq: int, hkv: int) -> None:
    from engine.bench.attention_dense import dense_prefill_attention

    gen = torch.Generator().manual_seed(start + chunk)
    d = 32
    q = torch.randn(1, hq, chunk, d, generator=gen)
    k, v = (torch.randn(1, hkv, start + chunk, d, generator=gen) for _ in range(2))
    got = dense_prefill_attention(q, k, v, start)
    keys, values = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    visible = torch.arange(start + chunk)[None, :] <= torch.arange(start, start + chunk)[:, None]
    scores = (q @ keys.transpose(-1, -2)) * d ** -0.5
    want = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ values
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"start {start} chunk {chunk} Hq {hq} Hkv {hkv}: max error {err}"


@pytest.mark.parametrize("start,chunk,hq,hkv", [(40, 24, 4, 2), (100, 70, 2, 2), (0, 33, 4, 1)])
def test_dense_kernel_equals_the_reference_in_the_interpreter(start: int, chunk: int, hq: int, hkv: int) -> None:
    run_in_interpreter("tests.engine.bench.test_attention_dense", "interpreter_check", start, chunk, hq, hkv)


def bench_rows_check() -> None:
    """`bench attention`'s prefill row with the dense backends (the prefix gathered from the pool, contiguous; a
    launch shape in the name), on CPU tensors in the interpreter, in fp32: the interpreter's bf16 dots are not
    bf16's (the engine's paged kernel gives garbage there too; both run bf16 on the GPU)."""
    from engine.bench import attention_prefill

    attention_prefill.DTYPE = torch.float32
    for storage in ("bf16", "int8"):
        row = attention_prefill.prefill_case(96, 32, storage, torch.device("cpu"), 1,
                                             ["torch", "dense", "gather_dense32x32x4x2"], [])
        for name in ("dense", "gather_dense32x32x4x2"):
            assert f"{name}_error" not in row, row
            assert row[f"{name}_ms"] > 0 and row[f"{name}_max_err"] < 1e-4, row


def test_the_bench_row_times_the_dense_kernel_over_the_gathered_prefix() -> None:
    run_in_interpreter("tests.engine.bench.test_attention_dense", "bench_rows_check")
