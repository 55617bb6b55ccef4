"""The block pool and block table: every read and write goes through the table, so a slot may map any blocks.

CPU tests drive the reference backend (the Triton interpreter is not a usable oracle on CPU, KERNELS.md); the
kernel itself is checked against the reference on the GPU in test_kv_paged_gpu.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.engine.engine_helpers import slot_keys

from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.model.attention.backends import kernel_backend
from tests.engine.exec.triton_interpreter import run_in_interpreter

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
    assert torch.equal(slot_keys(plain, 1), slot_keys(shuffled, 1))


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
    assert torch.equal(slot_keys(dst, 0)[1, :, 64:128].float(), slot_keys(src, 0)[0, :, 32:96].float())


def test_columns_round_up_to_whole_blocks_and_the_pool_is_accounted():
    geo = KVGeometry(2, 3, 2, 16, 200, 16, block_tokens=64)
    # 4 blocks hold the context (positions 200..255 of the last are never a token), the margin starts a block of
    # its own: padded rows never write a block that holds a position < context
    assert geo.context_blocks == 4 and geo.pad_start_tokens == 256
    assert geo.blocks_per_slot == 5 and geo.columns == 320 and geo.num_blocks == 15
    cache = SlotKVCache(geo, "int8", torch.float32, "cpu")
    assert cache.k[0].shape == (2, 15, 64, 16) and cache.k_scale[0].shape == (2, 15, 64)
    assert cache.nbytes == geo.total_bytes("int8", torch.float32)


def test_no_kernel_backend_on_cpu_so_paged_runs_the_reference():
    cache = _cache("bf16")
    assert kernel_backend(torch.device("cpu")) is None and cache.kernel is None
    cache.set_path(False, True)
    assert cache.backend is cache.reference


@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("tile_tokens", [8, 16, 32])  # tiles inside a block, one block, across blocks
def test_the_kernel_in_the_triton_interpreter_matches_the_reference(storage, tile_tokens):
    """Where Triton is installed (not in CI: its wheel is ~180 MiB), its interpreter runs the real kernel on
    CPU in fp32: a shuffled block table, GQA 5:1, 3 queries per row, a padding row, one split and several."""
    run_in_interpreter("tests.engine.exec.test_kv_paged", "interpreter_check", storage, tile_tokens)


def interpreter_check(storage: str, tile_tokens: int) -> None:
    from engine.model.attention.triton_paged import paged_decode_attention
    from engine.model.attention.triton_paged_config import KernelConfig

    cache = _cache(storage, block_tokens=16)
    _shuffle_table(cache, seed=3)
    gen = torch.Generator().manual_seed(4)
    geo = cache.geometry
    for slot in range(geo.num_slots):
        k, v = (torch.randn(1, 2, geo.columns, 16, generator=gen) for _ in range(2))
        cache.bind(torch.tensor([slot]))
        cache._write(0, k, v, torch.arange(geo.columns).view(1, -1))
    for t, hq, ends, span in ((1, 4, [150, 17], 200), (3, 10, [199, 90, 5], 200), (2, 2, [40], 64)):
        q = torch.randn(len(ends) + 1, hq, t, 16, generator=gen)
        slots = torch.tensor([i % geo.num_slots for i in range(len(ends) + 1)])
        positions = torch.tensor([[e - t + j for j in range(t)] for e in ends] + [[200 + j for j in range(t)]])
        cache.bind(slots, span)
        reference = cache.reference.attend(cache, 0, q, positions)
        scales = (cache.k_scale[0], cache.v_scale[0]) if storage == "int8" else (None, None)
        # a tile inside one block also through one table entry and through TMA descriptors
        loads = ("gather", "block", "tma") if tile_tokens <= 16 else ("gather",)
        for min_split_tiles, how in itertools.product((1, 4), loads):  # a split per tile, splits of several tiles
            config = KernelConfig(tile_tokens, 4, 2, min_split_tiles, how)
            out = paged_decode_attention(q, cache.k[0], cache.v[0], *scales, cache.block_table, slots, positions,
                                         span, geo.context_tokens, config)
            err = (out[:-1] - reference[:-1]).abs().max()
            assert torch.allclose(out[:-1], reference[:-1], atol=1e-5), (config, err)
            assert not out[-1].any()  # the padding row read nothing
            # laid out [B, T, Hq, D]: the layer's merge of the heads is a view, not a copy, at every T
            assert out.transpose(1, 2).is_contiguous()


def test_a_launch_takes_the_key_loads_its_tile_and_pool_allow(monkeypatch):
    """PrefillConfig.loads / KernelConfig.loads at launch: a tile spanning pool blocks goes through the table key by
    key, TMA falls back to one base address for fp32 on the GPU and inside a torch.compile trace, and a word the
    kernels do not know is refused where the config is made."""
    pytest.importorskip("triton")
    from engine.model.attention.triton_paged import tile_loads
    from engine.model.attention.triton_paged_config import KernelConfig, PrefillConfig

    pool = torch.zeros(2, 4, 64, 16)
    assert [tile_loads(w, 64, 64, pool, False) for w in ("gather", "block", "tma")] == [0, 1, 2]
    assert [tile_loads(w, 128, 64, pool, False) for w in ("gather", "block", "tma")] == [0, 0, 0]  # two blocks
    assert tile_loads("tma", 32, 64, pool, True) == 1  # fp32 on the GPU
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert tile_loads("tma", 64, 64, pool, False) == 1
    for config in (KernelConfig, PrefillConfig):
        with pytest.raises(ValueError, match="loads 'fast'"):
            config(loads="fast")


def test_a_short_prompt_chunk_deep_into_a_span_splits_its_keys_only_when_asked():
    """PrefillConfig.split_programs: a launch of fewer programs than that splits each program's keys, each split
    streaming at least 8 tiles; without it (0, the default) or with programs enough, one pass over the keys."""
    pytest.importorskip("triton")
    from engine.model.attention.triton_prefill import prefill_split_plan

    # a 256-token chunk 32K deep, 16 query heads in 128-query tiles: 32 programs over 516 key tiles of 64
    assert prefill_split_plan(32, 32768 + 256, 64, 0) == (1, 0)
    assert prefill_split_plan(32, 32768 + 256, 64, 132) == (5, 104)  # about 132 programs
    assert prefill_split_plan(256, 32768 + 2048, 64, 132) == (1, 0)  # a 2,048-token chunk fills the device
    assert prefill_split_plan(4, 1024, 64, 1000) == (2, 8)  # 16 tiles: two splits of the fewest tiles each
    assert prefill_split_plan(4, 960, 64, 1000) == (1, 0)  # 15 tiles: too few to split


def test_a_short_span_is_split_a_tile_per_program():
    """The decode kernel's split plan: a short span's tiles go to programs of their own (one program streaming
    them one after the other waits on each tile's loads in turn; docs/BENCHMARKS.md, "Paged decode
    attention"), a long one's to as many splits as fill the device."""
    pytest.importorskip("triton")
    from engine.model.attention.triton_paged import split_plan

    assert split_plan(1, 8, 256, 128) == (2, 1)
    assert split_plan(1, 8, 1024, 128) == (8, 1)
    assert split_plan(1, 8, 131072, 128) == (32, 32)  # 256 programs: ~2 per SM of an H200
    assert split_plan(1, 8, 1024, 128, min_split_tiles=4) == (2, 4)
