"""The quantized layouts: packing, the reference dequantization, and the Triton kernels against the reference
(in Triton's interpreter on CPU where Triton is installed; on the GPU in bf16 under the gpu mark)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.model.quant.linear import Fp8Linear, IntGroupLinear, pack_codes, unpack_codes
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
    assert torch.equal(unpack_codes(packed, 4), codes.to(torch.int32))


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


def kernels_check() -> None:
    """In the interpreter: every layout and group shape, rows 1..20, against the reference."""
    from engine.model.quant import kernels

    torch.manual_seed(0)  # the same draws every run: the tolerance is checked on these, not on luck
    layers = [_int_layer(4, 32), _int_layer(4, 128, perm=True), _int_layer(8, 16), _int_layer(8, 256, bias=False),
              _int_layer(4, 264, k=264), _int_layer(8, 64, k=320),
              _fp8_layer((128, 128)), _fp8_layer((1, 300)), _fp8_layer((40, 300))]
    layers.append(_fp8_layer((128, 128), k=512))  # block scales applied per step
    # the default launch shape, and others: split K (3 and 5 splits of unequal share, the last one empty), steps
    # shorter than a group, a block or a word's 8 codes apart
    configs = [None, kernels.QuantConfig(16, 64, 3, 4, 2), kernels.QuantConfig(32, 128, 2, 4, 3),
               kernels.QuantConfig(16, 32, 5, 2, 1)]
    for layer in layers:
        for config in configs:
            for rows in (1, 5, 20):
                x = torch.randn(rows, layer.in_features)
                ref, got = layer.reference(x), kernels.quant_linear(x, layer, config)
                scale, error = ref.abs().max().item(), (ref - got).abs().max().item()
                assert error <= 1e-5 * scale, (layer, config, rows, f"max error {error:.3g} of {scale:.3g}",
                                               f"at {divmod((ref - got).abs().argmax().item(), layer.out_features)}")
    # every finite e4m3 value decodes exactly (subnormals and signs included)
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = every[every.float().isfinite()]
    w = torch.zeros(16, 256, dtype=torch.float8_e4m3fn)
    w[:, :finite.numel()] = finite
    layer = Fp8Linear(w, torch.ones(16, 1), (1, 256))
    assert torch.equal(kernels.quant_linear(torch.eye(256), layer), layer.dequantize().t())


def test_the_launch_shape_follows_the_weight_not_the_rows_and_splits_narrow_outputs():
    from engine.model.quant import kernels

    # the 8B shape's down projection (N 4096, K 12288): 64 column tiles split along K to reach the SMs
    down = SimpleNamespace(format="int4", out_features=4096, in_features=12288, group_size=128)  # its shape only
    config = kernels.default_config(down)
    assert config.split_k > 1 and triton_cdiv(4096, config.block_n) * config.split_k >= 256
    # its gate/up (N 24576) has programs enough without a split, and per-step scales (group 128 = one step)
    assert kernels.default_config(SimpleNamespace(format="int4", out_features=24576, in_features=4096,
                                                  group_size=128)).split_k == 1
    assert kernels.scale_mode(down, config.block_k) == kernels.SCALE_PER_STEP
    # GGUF's groups of 32 expand element by element; per-channel FP8 scales the finished sum once
    assert kernels.scale_mode(_int_layer(4, 32), 128) == kernels.SCALE_PER_ELEMENT
    assert kernels.scale_mode(_fp8_layer((1, 300)), 256) == kernels.SCALE_PER_COLUMN
    assert kernels.scale_mode(_fp8_layer((128, 128), k=512), 128) == kernels.SCALE_PER_STEP
    with pytest.raises(ValueError, match="block_k=48"):
        kernels.QuantConfig(block_k=48)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_bf16_bits_0x4300_or_a_code_are_128_plus_the_code():
    # the int4 kernel's integer-to-bf16 conversion (Marlin's magic number), here in torch: the interpreter has no
    # bf16 arithmetic, the GPU test runs the kernel's
    codes = torch.arange(16, dtype=torch.int32)
    as_bf16 = (codes | 0x4300).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(as_bf16 - 128.0, codes.to(torch.bfloat16))


def test_the_kernels_in_the_triton_interpreter_match_the_reference():
    run_in_interpreter("tests.engine.model.test_quant_kernels", "kernels_check")


@pytest.mark.gpu
@pytest.mark.gpu_shared
@pytest.mark.parametrize("make", ["int4-g128", "int4-g32-perm", "int8-g16", "fp8-block", "fp8-channel"])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_the_kernels_on_the_gpu_match_the_reference_in_bf16(make, rows):
    from engine.model.quant import kernels

    n, k = 4096, 2048
    layer = {
        "int4-g128": lambda: _int_layer(4, 128, n, k, device="cuda"),
        "int4-g32-perm": lambda: _int_layer(4, 32, n, k, perm=True, device="cuda"),
        "int8-g16": lambda: _int_layer(8, 16, n, k, device="cuda"),
        "fp8-block": lambda: _fp8_layer((128, 128), n, k, device="cuda"),
        "fp8-channel": lambda: _fp8_layer((1, k), n, k, device="cuda"),
    }[make]()
    layer.bias.data = layer.bias.data.bfloat16()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float()[:, layer.perm] if getattr(layer, "perm", None) is not None
                                     else x.float(), layer.dequantize(torch.float32), layer.bias.float())
    got = kernels.quant_linear(x, layer).float()
    assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    # capturable: a CUDA graph replays the same product
    static_x = x.clone()
    kernels.quant_linear(static_x, layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.quant_linear(static_x, layer)
    graph.replay()
    torch.testing.assert_close(out.float(), got)


@pytest.mark.gpu
@pytest.mark.gpu_shared
def test_fp8_per_channel_prompt_chunks_multiply_in_fp8_on_hopper():
    from engine.model.quant import kernels

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_mm row-wise needs a Hopper-class device")
    layer = _fp8_layer((1, 2048), 4096, 2048, device="cuda")
    layer.bias = None
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    assert kernels.scaled_mm_takes(x, layer)
    ref = x.float() @ layer.dequantize(torch.float32).t()
    got = layer(x).float()
    assert (got - ref).abs().max().item() <= 5e-2 * ref.abs().max().item()
