"""The quantized layouts: packing, the reference dequantization, and the Triton kernels against the reference
(in Triton's interpreter on CPU where Triton is installed; on the GPU in bf16 under the gpu mark)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.model.quant.linear import Fp8Linear, IntGroupLinear, pack_codes
from tests.engine.exec.triton_interpreter import run_in_interpreter


def _int_layer(bits: int, group: int, n: int = 48, k: int = 256, seed: int = 0, bias: bool = True,
               perm: bool = False, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    offset = -scale * torch.randint(0, 2 ** bits, (n, k // group), generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    p = torch.randperm(k, generator=gen) if perm else None
    return IntGroupLinear(codes, scale, offset, bits, group, b, perm=p, scale_dtype=torch.float32).to(device)


def _fp8_layer(block, n: int = 40, k: int = 300, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    bn, bk = block
    scale = torch.rand(math.ceil(n / bn), math.ceil(k / bk), generator=gen) + 0.5
    return Fp8Linear(w, scale, block, torch.randn(n, generator=gen)).to(device)


def test_4bit_codes_pack_eight_to_a_word_low_nibble_first_and_unpack_back():
    codes = torch.randint(0, 16, (5, 64))
    packed = pack_codes(codes, 4)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert int(packed[0, 0]) & 0xF == int(codes[0, 0]) and (int(packed[0, 0]) >> 28) & 0xF == int(codes[0, 7])
    unpacked = (packed.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    assert torch.equal(unpacked.view(5, 64), codes.to(torch.int32))


def test_the_reference_dequantizes_by_the_layout_formulas():
    layer = _int_layer(4, 32, bias=False)
    codes = layer.codes().float()
    w = layer.dequantize()
    n, g = 7, 3  # one element: u * scale + offset of its group
    assert w[n, g * 32 + 5].item() == pytest.approx(codes[n, g * 32 + 5].item() * layer.scales[n, g].item()
                                                   + layer.offsets[n, g].item())
    fp8 = _fp8_layer((128, 128))
    assert fp8.dequantize()[39, 299].item() == pytest.approx(
        fp8.weight[39, 299].float().item() * fp8.weight_scale[0, 2].item())


def test_a_permuted_layer_gathers_the_input_columns():
    layer = _int_layer(4, 32, perm=True)
    x = torch.randn(3, 256)
    expected = x @ layer.dequantize_unpermuted().t() + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def _layers():
    """Every layout, with odd shapes: N off the column tiles, K off the steps, words and runs, an int8 K padded
    to whole words, GGUF's groups of 32 and 16, act-order, FP8 blocks that are not 128 and per-tensor scales."""
    return [_int_layer(4, 32), _int_layer(4, 128, perm=True), _int_layer(8, 16), _int_layer(8, 256, bias=False),
            _int_layer(4, 264, k=264), _int_layer(8, 64, k=320), _int_layer(8, 302, n=37, k=302),
            _int_layer(4, 40, n=33, k=80), _int_layer(4, 128, n=72, k=512),
            _fp8_layer((128, 128)), _fp8_layer((1, 300)), _fp8_layer((40, 300)), _fp8_layer((128, 128), k=512),
            _fp8_layer((40, 300), n=40), _fp8_layer((1, 1024), n=72, k=1024)]


def _check(layer, x, got, what) -> None:
    ref = layer.reference(x)
    scale, error = ref.abs().max().item(), (ref - got).abs().max().item()
    assert error <= 1e-5 * scale, (what, f"max error {error:.3g} of {scale:.3g}",
                                   f"at {divmod((ref - got).abs().argmax().item(), layer.out_features)}")


KERNEL_CHECK_PARTS = 3  # a process each: the interpreter takes about 100 s for all layers on an idle core


def kernels_check(part: int) -> None:
    """In the interpreter: every layout and group shape through each path, rows 1-64 and a prompt chunk, at the
    default launch shapes and others (split K, steps shorter than a group or a block), against the reference; the
    layers whose index is `part` modulo KERNEL_CHECK_PARTS (the last part also every e4m3 value)."""
    from engine.model.quant import kernels

    gemv_configs = [None, kernels.QuantConfig(16, 64, 3, 4, 2), kernels.QuantConfig(32, 128, 5, 2, 1)]
    tc_configs = [None, kernels.QuantConfig(16, 128, 3, 4, 2), kernels.QuantConfig(32, 256, 2, 4, 3)]
    for index, layer in enumerate(_layers()):
        if index % KERNEL_CHECK_PARTS != part:
            continue
        torch.manual_seed(index)  # the same draws every run: the tolerance is checked on these, not on luck
        for config in gemv_configs:
            for rows in ((1, 2, 3, 4, 11) if config is None else (1, 6)):  # past 4: groups of 4 rows
                x = torch.randn(rows, layer.in_features)
                _check(layer, x, kernels.quant_linear(x, layer, "gemv", config), (layer, "gemv", config, rows))
        # a verify step's rows (1 sequence, 3 tokens: the GEMV) are computed exactly as its decode step's rows;
        # on the tensor cores (5 sequences) the interpreter's dot is numpy's BLAS, whose sums round by a row's place
        # in the tile: there the rows are checked against the reference, and bit for bit on the GPU
        # (test_quant_kernels_gpu.py); test_the_path_follows_the_rows_... checks the tile goes by sequences
        for b_rows in (1, 5):
            x = torch.randn(b_rows, 3, layer.in_features)
            verify = kernels.quant_linear(x, layer)
            for t in range(3):
                if b_rows == 1:
                    assert torch.equal(kernels.quant_linear(x[:, t:t + 1], layer)[:, 0], verify[:, t]), (layer, t)
                else:
                    _check(layer, x[:, t], verify[:, t], (layer, "verify", t))
        for config in tc_configs:
            for rows in ((5, 17, 64) if config is None else (6,)):
                x = torch.randn(rows, layer.in_features)
                _check(layer, x, kernels.quant_linear(x, layer, "tc", config), (layer, "tc", config, rows))
        x = torch.randn(2, 3, layer.in_features)  # [B, T, K] as the model passes it, through the default path
        _check(layer, x, kernels.quant_linear(x, layer), (layer, "default", 6))
        x = torch.randn(70, layer.in_features)
        _check(layer, x, kernels.quant_linear(x, layer, "dense"), (layer, "dense", 70))
    if part != KERNEL_CHECK_PARTS - 1:
        return
    # every finite e4m3 value decodes exactly (subnormals and signs included), in both paths
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = every[every.float().isfinite()]
    w = torch.zeros(16, 256, dtype=torch.float8_e4m3fn)
    w[:, :finite.numel()] = finite
    layer = Fp8Linear(w, torch.ones(16, 1), (1, 256))
    for path in ("gemv", "tc"):
        eye = torch.eye(256)[:4] if path == "gemv" else torch.eye(256)
        assert torch.equal(kernels.quant_linear(eye, layer, path), layer.dequantize()[:, :eye.shape[0]].t()), path


def dense_check() -> None:
    """In the interpreter: the prompt-chunk path's kernels: the dequantizing kernel writes the reference weight
    exactly, and the rows' FP8 quantization matches torch's (amax / 448 per row and block, e4m3 by rounding)."""
    from engine.model.quant import dense

    torch.manual_seed(0)
    # and FP8 blocks narrower than the kernel's tile (a tile a block wide), or of a width no tile is (a scale per
    # weight): the tile's scales loaded a row at a time where its columns lie in one block
    for layer in _layers() + [_fp8_layer((64, 64), n=72, k=320), _fp8_layer((40, 96))]:
        assert torch.equal(dense.dequantize(layer, torch.float32), layer.dequantize(torch.float32)), layer
    x = torch.randn(5, 300) * 3
    for group, column_major in ((128, True), (300, False)):
        q, scales = dense.quantize_rows(x, group, scales_column_major=column_major)
        assert scales.shape == (5, -(-300 // group)) and (scales.stride(1) == 5) == column_major
        expected = torch.stack([x[:, g:g + group].abs().amax(1) / 448 for g in range(0, 300, group)], 1)
        torch.testing.assert_close(scales, expected)
        scaled = x / scales.repeat_interleave(group, 1)[:, :300]
        ref = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        # Triton's interpreter rounds a value just under a power of two down a whole binade (its e4m3 cast does
        # not carry the mantissa into the exponent); the GPU test checks those too
        carried = (ref.abs() > scaled.abs()) & (torch.log2(ref.abs()) == torch.log2(ref.abs()).round())
        assert torch.equal(q.float()[~carried], ref[~carried]) and carried.float().mean() < 0.2


def pairs_check() -> None:
    """In the interpreter: the pair-unpacking int4 kernel (`xpairs` launch shapes) against the reference: groups of
    128 and 256, act-order, N off the column tiles, K off the splits (masked steps), rows 5-64."""
    from engine.model.quant import kernels

    torch.manual_seed(0)
    configs = [kernels.QuantConfig(64, 128, 1, 4, 3, "pairs"), kernels.QuantConfig(16, 128, 3, 4, 2, "pairs"),
               kernels.QuantConfig(32, 256, 2, 4, 3, "pairs")]
    for layer in (_int_layer(4, 128, n=72, k=512), _int_layer(4, 128, n=48, k=256, perm=True),
                  _int_layer(4, 128, n=33, k=384, bias=False), _int_layer(4, 256, n=40, k=512)):
        for config in configs:
            if not kernels.takes_pairs(layer, config):  # a step longer than the group: the slots' only
                assert config.block_k > layer.group_size, (layer, config)
                continue
            for rows in ((5, 17, 64) if config is configs[0] else (6,)):
                x = torch.randn(rows, layer.in_features)
                _check(layer, x, kernels.quant_linear(x, layer, "tc", config), (layer, "tc pairs", config, rows))


def test_the_pair_unpacking_kernel_in_the_triton_interpreter_matches_the_reference():
    run_in_interpreter("tests.engine.model.test_quant_kernels", "pairs_check")


def test_a_pairs_launch_shape_reads_back_and_names_what_it_cannot_take():
    from engine.model.quant import kernels

    pairs = kernels.QuantConfig.parse("128x128x4x4x3xpairs")
    assert pairs.unpack == "pairs" and pairs.label() == "128x128x4x4x3xpairs"
    assert kernels.QuantConfig.parse("64x128x1x4x3").label() == "64x128x1x4x3"  # slots: the label as before
    with pytest.raises(ValueError, match="unpack='nibbles'"):
        kernels.QuantConfig.parse("64x128x1x4x3xnibbles")
    assert kernels.takes_pairs(_int_layer(4, 128), pairs)
    assert not any(kernels.takes_pairs(layer, pairs) for layer in (_int_layer(8, 128), _int_layer(4, 32),
                                                                    _fp8_layer((128, 128))))
    x = torch.randn(6, 256)
    with pytest.raises(ValueError, match=r"128x128x4x4x3xpairs: pairs unpack int4 .* int4-g32 \(group 32"):
        kernels.quant_linear(x, _int_layer(4, 32), "tc", pairs)
    with pytest.raises(ValueError, match="128x128x4x4x3xpairs: the GEMV unpacks one code at a time"):
        kernels.quant_linear(x[:1], _int_layer(4, 128), "gemv", pairs)
    # a launch-table entry naming pairs for a class (K rounded up to a power of two): each layer of the class its
    # groups let take them, the others the default shape
    entry = {"tc": pairs.label()}
    assert kernels.launch_of(_int_layer(4, 128, k=512), entry, torch.device("cpu")).tc == pairs
    one_group = _int_layer(4, 264, k=264)  # one group of 264: scales per code across the steps
    assert kernels.launch_of(one_group, entry, torch.device("cpu")).tc == kernels.default_config(one_group, "tc")


def test_the_kernel_layout_packs_runs_of_words_and_unpacks_to_the_codes():
    from engine.model.quant.linear import kernel_pack, kernel_unpack, run_words

    for bits, group, k, run in ((4, 128, 256, 4), (4, 32, 256, 4), (4, 264, 264, 1), (4, 40, 80, 1), (8, 16, 256, 4),
                                (8, 302, 302, 4), (8, 300, 300, 1), (8, 64, 320, 4)):
        assert run_words(bits, group, k) == run, (bits, group, k)
        codes = torch.randint(0, 2 ** bits, (5, k))
        packed = kernel_pack(codes, bits, run)
        assert packed.dtype == torch.int32 and packed.shape == (5, -(-k // (32 // bits)))
        assert torch.equal(kernel_unpack(packed, bits, run, k), codes.to(torch.int32))
    # 4-bit, a run of 4 words: slot 1 of word 2 holds input 4 * 1 + 2 of the run's 32
    codes = torch.arange(32).remainder(16).view(1, 32)
    word = int(kernel_pack(codes, 4, 4)[0, 2])
    assert (word >> 4) & 0xF == 6 and word & 0xF == 2
    with pytest.raises(ValueError, match="group_size=4"):
        _int_layer(4, 4, k=64)


def test_the_path_follows_the_rows_and_the_launch_shape_follows_the_weight():
    from engine.model.quant import kernels

    layer = _int_layer(4, 128, n=4096, k=12288)
    assert [kernels.path_of(layer, r) for r in (1, 2, 3, 4, 5, 64, 256, 257, 2048)] == \
        ["gemv", "gemv", "gemv", "gemv", "tc", "tc", "tc", "dense", "dense"]
    # a decode / verify step goes by its sequences: 2 sequences verifying 3 tokens each take the decode's GEMV,
    # one sequence verifying 4 too (MTP at depth 3), 4 sequences verifying 3; 5 the tensor cores, as their decode
    assert [kernels.path_of(layer, 6, 2), kernels.path_of(layer, 4, 1), kernels.path_of(layer, 12, 4),
            kernels.path_of(layer, 5, 5)] == ["gemv", "gemv", "gemv", "tc"]
    # 128 sequences verifying 3 tokens: the decode step's tensor cores, not the prompt chunks' GEMM past 256 rows;
    # and tiled as the decode step (20 sequences: rows of 32, whether 20 or 60 of them)
    assert [kernels.path_of(layer, 384, 128), kernels.path_of(layer, 384)] == ["tc", "dense"]
    assert [kernels.tc_block_m(60, 20), kernels.tc_block_m(20, 20), kernels.tc_block_m(60)] == [32, 32, 64]
    assert [kernels.tc_block_m(1), kernels.tc_block_m(384, 128), kernels.tc_block_m(2048)] == [16, 128, 128]
    fp8 = _fp8_layer((128, 128), 256, 1024)  # no FP8 GEMM for its prompt chunks here: they start at 257 rows too
    assert [kernels.path_of(fp8, r) for r in (1, 2, 4, 65, 256, 257)] == ["tc", "tc", "tc", "tc", "tc", "dense"]
    assert kernels.path_of(fp8, 4, 1) == "tc"  # one sequence verifying 4 tokens: its decode step's path
    # the 8B shape's down projection (N 4096, K 12288): 64 column tiles split along K to reach the SMs
    for path in ("gemv", "tc"):
        config = kernels.default_config(layer, path)
        assert config.split_k > 1 and -(-4096 // config.block_n) * config.split_k >= 256
        assert kernels.scale_mode(layer, config.block_k) == kernels.SCALE_PER_STEP  # group 128 spans a step
    # its gate/up (N 24576) has programs enough without a split
    assert kernels.default_config(_int_layer(4, 128, n=24576, k=256), "tc").split_k == 1
    # GGUF's groups of 32 are scaled per run; per-channel FP8 scales the finished sum once
    assert kernels.scale_mode(_int_layer(4, 32), 128) == kernels.SCALE_PER_ELEMENT
    assert kernels.scale_mode(_fp8_layer((1, 300)), 256) == kernels.SCALE_PER_COLUMN
    assert kernels.scale_mode(_fp8_layer((128, 128), k=512), 128) == kernels.SCALE_PER_STEP
    with pytest.raises(ValueError, match="block_k=48"):
        kernels.QuantConfig(block_k=48)
    with pytest.raises(ValueError, match="BLOCK_NxBLOCK_K"):
        kernels.QuantConfig.parse("64x128x1")


def _layer_of_class(fmt: str):
    """A small CPU layer of a launch-table FORMAT (engine.model.quant.launch_table)."""
    if fmt.startswith("fp8"):
        return _fp8_layer((128, 128) if fmt == "fp8-block" else (1, 256), n=64, k=256)
    bits, _, group = fmt.partition("-g")
    return _int_layer(int(bits[3:]), int(group or 128), n=64, k=256)


def test_a_decode_step_of_one_to_four_sequences_takes_one_path_whatever_its_batch():
    """A request's token is computed in a step of as many sequences as run beside it then, and that differs between
    two runs of the same requests: with MTP on they finish sooner, so the steps after hold fewer. The GEMV and the
    tensor cores round differently, so a token at 2 sequences and the same token at 3 could differ: on an H100
    `test_on_the_gpu_greedy_mtp_on_equals_off_for_every_format` (3 slots) gave other tokens with MTP on for
    `--quantize int4` and an AWQ file while the GEMV took 1-2 sequences and the tensor cores 3-4. So every path
    choice, the defaults and each committed table entry, keeps the 1-4 sequences of an engine of up to 4 slots
    (the default) on one path, verify steps (3 tokens a sequence) included."""
    from engine.model.quant import kernels, launch_table

    def paths(layer) -> set[str]:
        return {kernels.path_of(layer, seqs * tokens, seqs) for seqs in (1, 2, 3, 4) for tokens in (1, 3)}

    for fmt in ("int4", "int8", "int4-g32", "fp8", "fp8-block"):
        assert len(paths(_layer_of_class(fmt))) == 1, (fmt, paths(_layer_of_class(fmt)))
    for device, classes in launch_table.load().items():
        for cls, entry in classes.items():
            layer = _layer_of_class(cls.split("/")[0])
            layer.__dict__["_quant_launch"] = kernels.launch_of(layer, entry, torch.device("cpu"))
            assert len(paths(layer)) == 1, (device, cls, entry, paths(layer))


def test_the_launch_table_routes_a_weight_class_and_names_a_bad_entry(tmp_path, monkeypatch):
    from engine.model.quant import kernels, launch_table

    assert launch_table.shape_class("int4", 24576, 4096) == "int4/n32768/k4096"
    assert launch_table.layer_format(_int_layer(4, 32)) == "int4-g32"
    assert launch_table.layer_format(_fp8_layer((1, 300))) == "fp8"
    assert launch_table.load() is not None  # the committed table is well formed
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"devices": {"cpu": {"int4/n4096/k16384": {
        "gemv": "128x512x2x8x1", "tc": "32x256x4x4x2", "gemv_rows": 0, "tc_rows": 32}}}}))
    monkeypatch.setattr(launch_table, "TABLE_PATH", table)
    launch_table.read.cache_clear()
    try:
        layer = _int_layer(4, 128, n=4096, k=12288)
        assert [kernels.path_of(layer, r) for r in (1, 4, 32, 33)] == ["tc", "tc", "tc", "dense"]
        assert kernels.plan(layer).gemv.label() == "128x512x2x8x1" and kernels.plan(layer).tc.split_k == 4
        # PyTorch's int4 kernel for the rows where the table measured it faster (a layer it takes)
        table.write_text(json.dumps({"devices": {"cpu": {"int4/n4096/k16384": {
            "tinygemm_rows": 8, "gemv_rows": 4, "tc_rows": 32}}}}))
        launch_table.read.cache_clear()
        layer = _int_layer(4, 128, n=4096, k=12288)
        assert [kernels.path_of(layer, r) for r in (1, 4, 8, 9, 33)] == ["tinygemm", "tinygemm", "tinygemm", "tc",
                                                                          "dense"]
        assert kernels.path_of(layer, 12, sequences=4) == "tinygemm"  # a verify step of four sequences
        for key, value in (("gemv_rows", 2), ("tinygemm_rows", 3)):  # 1-4 sequences split between two paths
            table.write_text(json.dumps({"devices": {"cpu": {"int4/n64/k256": {key: value}}}}))
            launch_table.read.cache_clear()
            with pytest.raises(ValueError, match=rf"devices.cpu.int4/n64/k256.{key}={value}: expected 0"):
                kernels.plan(_int_layer(4, 128, n=64, k=256))
        table.write_text(json.dumps({"devices": {"cpu": {"int4/n64/k256": {"backend": "marlin"}}}}))
        launch_table.read.cache_clear()
        with pytest.raises(ValueError, match=r"devices.cpu.int4/n64/k256.backend='marlin'"):
            kernels.plan(_int_layer(4, 128, n=64, k=256))
    finally:
        launch_table.read.cache_clear()


def test_tinygemm_on_the_cpu_computes_the_layers_product_from_our_codes():
    from engine.model.quant import tinygemm

    layer = _int_layer(4, 32, n=64, k=256, bias=True)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    ref = layer.reference(x.float())
    got = tinygemm.tinygemm_linear(x, layer).float()
    # tinygemm holds its scales and zeros in bf16 (ours are fp32 here): an error of bf16's rounding of them
    assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    assert not tinygemm.takes(_int_layer(8, 32, n=64, k=256)) and not tinygemm.takes(_int_layer(4, 40, k=80))


def test_the_layers_routed_to_tinygemm_are_packed_at_start_and_their_packs_count_as_weights(tmp_path, monkeypatch):
    from engine.model.quant import kernels, launch_table, tinygemm
    from engine.model.quant.linear import model_bytes

    table = tmp_path / "table.json"
    table.write_text(json.dumps({"devices": {"cpu": {"int4-g32/n64/k256": {"tinygemm_rows": 4}}}}))
    monkeypatch.setattr(launch_table, "TABLE_PATH", table)
    launch_table.read.cache_clear()
    try:
        routed, other = _int_layer(4, 32, n=64, k=256), _int_layer(4, 32, n=128, k=256)
        model = torch.nn.Sequential(routed, other)
        before = model_bytes(model)
        kernels.prepare("cpu", model, torch.bfloat16)
        # the routed layer's codes a second time, packed (a byte per two codes), and a scale and zero per group
        # and column in bf16; the layer the table does not route keeps its own codes alone
        assert tinygemm.pack_bytes(routed) == 64 * 256 // 2 + (256 // 32) * 64 * 2 * 2
        assert tinygemm.pack_bytes(other) == 0
        assert model_bytes(model) == before + tinygemm.pack_bytes(routed)
        x = torch.randn(2, 256, dtype=torch.bfloat16)
        assert torch.equal(tinygemm.tinygemm_linear(x, routed), tinygemm.tinygemm_linear(x, routed))
        assert model_bytes(model) == before + tinygemm.pack_bytes(routed)  # the product reuses the pack made
    finally:
        launch_table.read.cache_clear()


def test_int4_decode_tinygemm_routes_every_int4_layer_it_takes_for_decode_steps_of_1_to_4_sequences():
    """`--int4-decode tinygemm`: the decode and verify steps of 1-4 sequences of every int4 layer tinygemm takes go
    to it whatever the launch table says (one path for all of them: MTP on = off), steps of more sequences and
    prompt chunks keep their paths, the packs are made at start and counted as weights; a model with no layer it
    takes is refused by name."""
    from engine.errors import ConfigError
    from engine.model.quant import kernels, tinygemm
    from engine.model.quant.linear import model_bytes

    routed, grouped, small_group = _int_layer(4, 128, n=64, k=256), _int_layer(4, 32, n=64, k=256), \
        _int_layer(8, 32, n=64, k=256)
    model = torch.nn.Sequential(routed, grouped, small_group)
    before = model_bytes(model)
    kernels.prepare("cpu", model, torch.bfloat16, int4_decode="tinygemm")
    for layer in (routed, grouped):
        assert [kernels.path_of(layer, 3 * b, sequences=b) for b in (1, 2, 3, 4)] == ["tinygemm"] * 4
        assert kernels.path_of(layer, 5, sequences=5) == "tc" and kernels.path_of(layer, 300) == "dense"
        assert tinygemm.pack_bytes(layer) > 0
    assert kernels.path_of(small_group, 1, sequences=1) == "gemv" and tinygemm.pack_bytes(small_group) == 0
    assert model_bytes(model) == before + tinygemm.pack_bytes(routed) + tinygemm.pack_bytes(grouped)
    x = torch.randn(2, 1, 256, dtype=torch.bfloat16)  # a decode step of two sequences, through tinygemm
    ref = routed.reference(x.float())
    assert (kernels.quant_linear(x, routed).float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    with pytest.raises(ConfigError, match="int4_decode.*no int4 projection tinygemm takes"):
        kernels.prepare("cpu", torch.nn.Sequential(_int_layer(8, 32, n=64, k=256)), int4_decode="tinygemm")


@pytest.mark.parametrize("part", range(KERNEL_CHECK_PARTS))
def test_the_kernels_in_the_triton_interpreter_match_the_reference(part):
    run_in_interpreter("tests.engine.model.test_quant_kernels", "kernels_check", part)


def test_the_prompt_chunk_kernels_in_the_triton_interpreter_match_the_reference():
    run_in_interpreter("tests.engine.model.test_quant_kernels", "dense_check")
