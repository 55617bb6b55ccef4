"""The paged prefill kernel (engine.model.attention.triton_prefill) against the PyTorch reference on CPU, in
Triton's interpreter (where Triton is installed: not in CI, its wheel is ~180 MiB). On the GPU the same kernel is
checked at bf16 and long prefixes in test_kv_paged_gpu.py.

The interpreter computes in fp32 (its bf16 dots are not a usable oracle, KERNELS.md), over bf16-kind storage
(the compute dtype, fp32 here) and int8 storage with its per-(token, head) scales. Then a whole CPU engine on the
kernels (prompt chunks through the prefill kernel, decode through the decode kernel) gives the reference's
greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.model.attention.triton_paged_config import PrefillConfig
from tests.engine.exec.triton_interpreter import run_in_interpreter

CONTEXT, MARGIN, BLOCK = 200, 16, 16
# (slot, first position, real tokens, length bucket): rows of one forward. The bucket's tail past the real
# tokens is padding at positions CONTEXT + j, as ModelRunner.prefill pads a chunk.
CASES = [
    [(0, 0, 37, 37)],  # a fresh prompt's first chunk, not a multiple of any tile
    [(1, 133, 40, 64)],  # starts mid-block deep into its prefix; padded to its bucket
    [(2, 64, 16, 16), (0, 150, 16, 16)],  # two rows at once, one of them at a block edge
    [(1, 5, 70, 70)],  # query tiles of the chunk whose rows see different numbers of key tiles
]


def _cache(storage: str) -> SlotKVCache:
    geo = KVGeometry(num_layers=1, num_slots=3, num_kv_heads=2, head_dim=16, context_tokens=CONTEXT,
                     margin_tokens=MARGIN, block_tokens=BLOCK)
    cache = SlotKVCache(geo, storage, torch.float32, "cpu")
    perm = torch.randperm(geo.num_blocks, generator=torch.Generator().manual_seed(3))
    cache.block_table.copy_(perm.view_as(cache.block_table).to(torch.int32))  # slots map scattered blocks
    gen = torch.Generator().manual_seed(4)
    for slot in range(geo.num_slots):  # every column written, so a key read past a row's limit would show
        k, v = (torch.randn(1, 2, geo.columns, 16, generator=gen) for _ in range(2))
        cache.bind(torch.tensor([slot]))
        cache._write(0, k, v, torch.arange(geo.columns).view(1, -1))
    return cache


def _rows(case: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    bucket = max(c[3] for c in case)
    slots = torch.tensor([c[0] for c in case])
    positions = torch.tensor([[start + j if j < n else CONTEXT + j for j in range(bucket)] for _, start, n, _ in case])
    return slots, positions, bucket


def interpreter_check(storage: str, hq: int) -> None:
    from engine.model.attention.backends import TritonPagedAttention
    from engine.model.attention.triton_prefill import paged_prefill_attention

    cache = _cache(storage)
    kernel = TritonPagedAttention()
    gen = torch.Generator().manual_seed(5)
    scales = (cache.k_scale[0], cache.v_scale[0]) if storage == "int8" else (None, None)
    for case in CASES:
        slots, positions, bucket = _rows(case)
        q = torch.randn(len(case), hq, bucket, 16, generator=gen)
        span = 208 if max(s + n for _, s, n, _ in case) > 128 else 128
        cache.bind(slots, span)
        reference = cache.reference.attend(cache, 0, q, positions)
        out = kernel.paged(cache, 0, q, positions)  # the backend's dispatch: more than 8 queries -> prefill kernel
        # tiles inside one block (its keys each through the table, one entry a tile, TMA), tiles across blocks,
        # and each program's keys split in three (split_programs far above the launch's programs) then combined
        for config in (PrefillConfig(32, 16, 4, 2, "gather"), PrefillConfig(32, 16, 4, 2, "block"),
                       PrefillConfig(32, 8, 4, 2, "tma"), PrefillConfig(16, 32, 4, 2),
                       PrefillConfig(32, 8, 4, 2, "block", 1000), PrefillConfig(16, 8, 4, 2, "tma", 1000)):
            again = paged_prefill_attention(q, cache.k[0], cache.v[0], *scales, cache.block_table, slots, positions,
                                            span, CONTEXT, config)
            assert torch.allclose(again, out, atol=1e-5), (case, config)
            assert again.transpose(1, 2).is_contiguous()  # [B, T, Hq, D] memory: the heads merge as a view
        for row, (_, start, n, _) in enumerate(case):
            err = (out[row, :, :n] - reference[row, :, :n]).abs().max().item()
            assert err <= 1e-5, (storage, hq, case, row, err)
            assert not out[row, :, n:].any()  # padding rows read nothing
        if len(case) == 1:  # the fused chunk binding (bottom-right-aligned causal SDPA) agrees too
            _, start, n, _ = case[0]
            cache.bind_chunk(slots, span, start, bucket)
            fused = cache.reference.attend(cache, 0, q, positions)
            assert torch.allclose(kernel.paged(cache, 0, q, positions)[:, :, :n], fused[:, :, :n], atol=1e-5)


@pytest.mark.parametrize("storage,hq", [("bf16", 4), ("int8", 10)])  # GQA 2:1 and 5:1
def test_the_prefill_kernel_in_the_triton_interpreter_matches_the_reference(storage, hq):
    """Shuffled block table, chunks fresh and deep into a prefix (starting mid-block), lengths off the tile,
    padded buckets, two rows in one launch, two launch shapes. In a fresh process: TRITON_INTERPRET must be set
    before Triton (or torch, which may import it) loads."""
    run_in_interpreter("tests.engine.exec.test_kv_paged_prefill", "interpreter_check", storage, hq)


def engine_check(model: str, kv: str) -> None:
    """Greedy tokens of a whole CPU engine whose attention runs the Triton kernels (in the interpreter: the
    device check of kernel_backend is the only thing bypassed) equal the reference engine's."""
    import engine.exec.kv.cache as kv_cache
    from engine.api import SamplingParams
    from engine.model.attention.backends import TritonPagedAttention
    from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

    calls = {"prefill": 0, "decode": 0}

    class InterpretedKernels(TritonPagedAttention):
        def runs_on(self, q):
            return True

        def paged(self, kv, layer, q, positions):
            calls["prefill" if q.shape[2] > 8 else "decode"] += 1
            return super().paged(kv, layer, q, positions)

    prompts = random_prompts(2, seed=95, lengths=(130, 200))  # three or four 64-token chunks each
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reference = tokens_of(run_all(make_engine(Path(model), batch=2, kv=kv), prompts, params))
    kv_cache.kernel_backend = lambda device: InterpretedKernels()
    decode_only = make_engine(Path(model), batch=2, kv=kv, switches={"PAGED_PREFILL": False})  # chunks gather
    assert decode_only.runner.paged_enabled()
    assert tokens_of(run_all(decode_only, prompts, params)) == reference
    assert calls["decode"] and not calls["prefill"], calls
    kernels = make_engine(Path(model), batch=2, kv=kv)  # PAGED_PREFILL on by default
    assert tokens_of(run_all(kernels, prompts, params)) == reference
    assert calls["prefill"], calls


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_an_engine_on_the_kernels_in_the_triton_interpreter_gives_the_reference_tokens(ckpt, kv):
    """Chunked prefill through the prefill kernel and decode through the decode kernel, end to end."""
    run_in_interpreter("tests.engine.exec.test_kv_paged_prefill", "engine_check", str(ckpt), kv)
