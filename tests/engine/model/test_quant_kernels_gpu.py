"""The quantized kernels on the GPU (skipped without CUDA): every path against cuBLAS on the dequantized weight,
capturable in CUDA graphs, a row's output independent of the other rows, the prompt chunks' FP8 GEMMs, and greedy
decoding with MTP on equal to MTP off on quantized weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, tokens_of
from tests.engine.model.test_quant_kernels import _fp8_layer, _int_layer

pytestmark = [pytest.mark.gpu]

N, K = 4096, 2048
LAYERS = {
    "int4-g128": lambda: _int_layer(4, 128, N, K, device="cuda"),
    "int4-g32-perm": lambda: _int_layer(4, 32, N, K, perm=True, device="cuda"),
    "int8-g16": lambda: _int_layer(8, 16, N, K, device="cuda"),  # GGUF's Q6_K
    "int8-g32": lambda: _int_layer(8, 32, N, K, device="cuda"),  # GGUF's Q8_0
    "fp8-block": lambda: _fp8_layer((128, 128), N, K, device="cuda"),
    "fp8-channel": lambda: _fp8_layer((1, K), N, K, device="cuda"),
}


def _bf16(layer):
    """As a bf16 model holds it: a bf16 bias, fp16 group scales and offsets."""
    layer.bias.data = layer.bias.data.bfloat16()
    for name in ("scales", "offsets"):
        if hasattr(layer, name):
            getattr(layer, name).data = getattr(layer, name).data.half()
    return layer


def _cublas(layer, x: torch.Tensor) -> torch.Tensor:
    """cuBLAS in bf16 on the dequantized weight (act-order columns gathered as the layer does)."""
    if getattr(layer, "perm", None) is not None:
        x = x.index_select(-1, layer.perm)
    return F.linear(x, layer.dequantize(torch.bfloat16), layer.bias)


@pytest.mark.gpu_shared
@pytest.mark.parametrize("make", list(LAYERS))
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 64, 128, 2048])
def test_every_path_matches_cublas_on_the_dequantized_weight(make, rows):
    from engine.model.quant import kernels, tinygemm

    kernels.prepare("cuda")
    layer = _bf16(LAYERS[make]())
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    ref = _cublas(layer, x).float()
    scale = ref.abs().max().item()
    paths = [None] + (["gemv"] if rows <= 4 else []) + (["tc"] if rows <= 256 else []) + \
        (["dense"] if rows >= 16 else []) + (["tinygemm"] if tinygemm.takes(layer) else [])
    for path in paths:
        got = kernels.quant_linear(x, layer, path).float()
        # the prompt chunks' FP8 GEMMs quantize the activations too (per token): a coarser product
        fp8_gemm = make.startswith("fp8") and (path or kernels.path_of(layer, rows)) == "dense"
        tolerance = 6e-2 if fp8_gemm else 2e-2
        assert (got - ref).abs().max().item() <= tolerance * scale, (make, rows, path)
    if rows <= 64:  # a decode or verify step: capturable, and a replay gives the same product
        static_x = x.clone()
        eager = kernels.quant_linear(static_x, layer)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kernels.quant_linear(static_x, layer)
        graph.replay()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.gpu_shared
@pytest.mark.parametrize("make", list(LAYERS))
def test_a_rows_product_does_not_depend_on_the_other_rows_of_its_path(make):
    from engine.model.quant import kernels

    layer = _bf16(LAYERS[make]())
    x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
    one = kernels.quant_linear(x[:1], layer, "gemv")
    assert torch.equal(kernels.quant_linear(x[:3], layer, "gemv")[:1], one)  # a verify step's rows as decode's
    steps = x[:12].view(4, 3, K)  # 4 sequences verifying 3 tokens: each row as one sequence's step computes it
    differ = {}
    for path in ("gemv", "tc"):  # on each path (the launch table picks one by the step's sequences)
        verify = kernels.quant_linear(steps, layer, path)
        for b in range(4):
            for t in range(3):
                alone = kernels.quant_linear(steps[b:b + 1, t:t + 1], layer, path)[0, 0]
                if not torch.equal(alone, verify[b, t]):  # keyed by the row's place in a GEMV program's 4 rows
                    differ[(path, b, t, (3 * b + t) % 4)] = (alone.float() - verify[b, t].float()).abs().max().item()
    assert not differ, f"rows (path, sequence, token, place) that differ, by their largest difference: {differ}"
    assert torch.equal(kernels.quant_linear(x[:5], layer, "tc")[:5], kernels.quant_linear(x, layer, "tc")[:5])


@pytest.mark.gpu_shared
@pytest.mark.parametrize("shape", ["64x128x4x4x3xpairs", "128x128x4x4x3xpairs"])
def test_the_pair_unpacking_kernel_matches_cublas_captures_and_keeps_each_rows_product(shape):
    """The `xpairs` launch shapes (int4, group 128): against cuBLAS on the dequantized weight at 5-64 rows, the same
    product replayed from a CUDA graph, and a row's output the same bits alone as in a tile of 16 (MTP on = off)."""
    from engine.model.quant import kernels

    config = kernels.QuantConfig.parse(shape)
    layer = _bf16(LAYERS["int4-g128"]())
    x = torch.randn(64, K, device="cuda", dtype=torch.bfloat16)
    for rows in (5, 16, 64):
        ref = _cublas(layer, x[:rows]).float()
        got = kernels.quant_linear(x[:rows], layer, "tc", config).float()
        assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), (shape, rows)
    static_x = x[:16].clone()
    eager = kernels.quant_linear(static_x, layer, "tc", config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.quant_linear(static_x, layer, "tc", config)
    graph.replay()
    assert torch.equal(out, eager)
    for row in (0, 7, 15):
        assert torch.equal(kernels.quant_linear(x[row:row + 1], layer, "tc", config)[0], eager[row]), (shape, row)


@pytest.mark.gpu_shared
def test_fp8_prompt_chunks_multiply_in_fp8_on_hopper():
    from engine.model.quant import dense, kernels

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 GEMMs need a Hopper-class device")
    kernels.prepare("cuda")
    channel = _fp8_layer((1, 2048), 4096, 2048, device="cuda")
    channel.bias = None
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    assert dense.rowwise_takes(channel, x.device) and kernels.path_of(channel, 512) == "dense"
    ref = x.float() @ channel.dequantize(torch.float32).t()
    assert (channel(x).float() - ref).abs().max().item() <= 6e-2 * ref.abs().max().item()
    block = _fp8_layer((128, 128), 4096, 2048, device="cuda")
    ref = x.float() @ block.dequantize(torch.float32).t() + block.bias.float()
    got = block(x).float()
    print(f"block-scaled FP8 GEMM on this device: {dense.blockwise_works(x.device)}")
    assert (got - ref).abs().max().item() <= 6e-2 * ref.abs().max().item()


@pytest.mark.gpu_shared
@pytest.mark.parametrize("make", ["int4-g128", "int8-g32", "fp8-block", "fp8-channel"])
@pytest.mark.parametrize("batch", [1, 6, 8, 20, 24, 32])
@pytest.mark.parametrize("tokens", [2, 3])
def test_a_verify_steps_rows_are_the_decode_steps_bit_for_bit(make, batch, tokens):
    """A verify step's rows take the path of the decode step of the same sequences (the GEMV up to 4, the tensor
    cores above, the row tile by sequences), so each sequence's first row is its decode row bit for bit: at 6
    sequences 18 rows against 6 (one tile of 32 rows would round otherwise than one of 16), at 20 60 against 20."""
    from engine.model.quant import kernels

    kernels.prepare("cuda")
    layer = _bf16(LAYERS[make]())
    decode = torch.randn(batch, 1, K, device="cuda", dtype=torch.bfloat16)
    verify = torch.randn(batch, tokens, K, device="cuda", dtype=torch.bfloat16)
    verify[:, :1] = decode
    assert kernels.path_of(layer, batch * tokens, batch) == kernels.path_of(layer, batch, batch)
    assert torch.equal(kernels.quant_linear(verify, layer)[:, :1], kernels.quant_linear(decode, layer))


@pytest.mark.parametrize("batch, depth", [(1, 1)])
def test_greedy_decoding_on_quantized_weights_is_the_same_with_mtp_on(ckpt, batch, depth):
    """The engine end to end, one sequence: its verify rows through the GEMV as its decode rows. (At 6 and 20
    sequences, depth 2, the quantized layers' rows are the decode rows' bit for bit, the test above, yet greedy
    tokens of this bf16 model differed on an H100: the rest of a bf16 verify step, attention whose key splits
    follow each row's length and the bf16 head's GEMM at three times the rows, need not round as a decode step
    does; docs/KV.md.)"""
    prompts = random_prompts(max(3, batch), seed=92, lengths=(10, 200))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def engine(**kw) -> Engine:
        config = EngineConfig(model=str(ckpt), device="cuda:0", dtype="bfloat16", batch=batch, context=2048,
                              prefill_chunk_tokens=256, step_token_budget=512, quantize="int4", **kw)
        return Engine(config, EventBus(history=100000), block_tokens=16)

    off = tokens_of(run_all(engine(), prompts, params))
    mtp = engine(batch_mtp=True, mtp_depth=depth)
    assert tokens_of(run_all(mtp, prompts, params)) == off and mtp.mtp_on


@pytest.mark.gpu_shared
@pytest.mark.parametrize("rows", [1, 4, 16, 300])
def test_the_fp8_head_gives_the_bf16_heads_logits(rows):
    """--quantize-head through the kernels (a decode step's rows, a chunk's), on the hidden states of held-out
    text: each path against the FP8 weight's own product, and the tokens against the bf16 head's. (Random hidden
    states put the top two logits within FP8's rounding of each other: their argmax is a coin toss.)"""
    from engine.model.loader import MODELS_DIR, load_checkpoint
    from engine.model.quant.rtn import quantize_head

    lm = load_checkpoint("builtin:strata-tiny", dtype="bfloat16", device="cuda")
    ids = lm.tokenizer.encode((MODELS_DIR / "strata-tiny" / "heldout_sample.txt").read_text())[:300]
    with torch.no_grad():
        hidden = lm.model(torch.tensor([ids], device="cuda"), torch.arange(300, device="cuda")[None])[:, :rows]
        ref = lm.model.logits(hidden).float()
        quantize_head(lm.model)
        got = lm.model.logits(hidden).float()
    own = hidden.float() @ lm.model.lm_head.dequantize(torch.float32).t()
    assert got.shape == ref.shape == own.shape
    scale = ref.abs().max().item()
    # a chunk past the tensor-core rows multiplies FP8 activations too (per token): a coarser product
    assert (got - own).abs().max().item() <= (6e-2 if rows > 64 else 2e-2) * scale
    assert (got - ref).abs().max().item() <= 0.06 * scale
    if rows >= 100:  # enough tokens for a rate
        agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"fp8 head, {rows} rows of held-out text: top-1 agreement with the bf16 head {agreement:.4f}")
        assert agreement >= 0.9
