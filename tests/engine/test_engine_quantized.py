"""The serving Engine on quantized weights: greedy output with MTP on is token-for-token the output with it off
for every format (--quantize fp8 / int4, an AWQ file, a Qwen FP8 file, a GPTQ act-order file), and
/strata/state's VRAM books name the weight format. CPU (the reference path) in CI; the same on the GPU (the
Triton kernels, CUDA graphs) under the gpu mark."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.telemetry import EventBus
from tests.engine.engine_helpers import beside_others_reserve_mib, make_engine, random_prompts, run_all, tokens_of
from tests.engine.model import quant_files

PROMPTS = random_prompts(6, seed=7, lengths=(3, 90))
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
FORMATS = {
    "quantize-fp8": ("fp8", None),
    "quantize-int4": ("int4", None),
    "awq": ("off", quant_files.write_awq),
    "qwen-fp8": ("off", quant_files.write_qwen_fp8),
    "gptq-act-order": ("off", lambda s, d: quant_files.write_gptq(s, d, sym=False, act_order=True)),
}
WEIGHT_FORMAT_START = {"quantize-fp8": "fp8", "quantize-int4": "int4", "awq": "int4 (awq",
                       "qwen-fp8": "fp8 (block 128x128)", "gptq-act-order": "int4 (gptq"}


def _model(fmt: str, ckpt, tmp_path_factory):
    quantize, writer = FORMATS[fmt]
    if writer is None:
        return ckpt, quantize
    out = tmp_path_factory.mktemp(fmt)
    writer(ckpt, out)
    return out, quantize


def _mtp_on_equals_off(model, quantize: str, **kw) -> None:
    plain = make_engine(model, batch=3, quantize=quantize, **kw)
    try:
        expected = tokens_of(run_all(plain, PROMPTS, GREEDY))
        vram = plain.state().to_json()["vram"][0]
    finally:
        plain.close()
    bus = EventBus(history=100000)
    mtp = make_engine(model, bus=bus, batch=3, quantize=quantize, batch_mtp=True, mtp_depth=2, **kw)
    try:
        got = tokens_of(run_all(mtp, PROMPTS, GREEDY))
        assert mtp.mtp_on, mtp.mtp_off_reason
    finally:
        mtp.close()
    assert got == expected
    assert len({tuple(t) for t in expected.values()}) > 1  # the prompts do not all collapse to one output
    return vram


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_mtp_on_equals_off_and_the_books_name_the_format(fmt, ckpt, tmp_path_factory):
    model, quantize = _model(fmt, ckpt, tmp_path_factory)
    vram = _mtp_on_equals_off(model, quantize)
    assert vram["weight_format"].startswith(WEIGHT_FORMAT_START[fmt]), vram


@pytest.mark.gpu
@pytest.mark.gpu_shared  # its engines keep to 4 GiB (beside_others_reserve_mib)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_on_the_gpu_greedy_mtp_on_equals_off_for_every_format(fmt, ckpt, tmp_path_factory):
    model, quantize = _model(fmt, ckpt, tmp_path_factory)
    _mtp_on_equals_off(model, quantize, device="cuda", dtype="bfloat16", tier_budget_mib=64.0,
                       vram_reserve_mib=beside_others_reserve_mib())


def test_int4_decode_tinygemm_is_refused_where_no_product_takes_it(ckpt):
    """`--int4-decode` picks the kernel of quantized weights on CUDA: on the CPU (dequantize + matmul) or on
    weights that are not quantized it would do nothing, so the engine refuses it by name."""
    from engine.errors import ConfigError

    for quantize in ("int4", "off"):
        with pytest.raises(ConfigError, match="int4_decode.*picks the kernel of quantized weights on CUDA"):
            make_engine(ckpt, batch=1, quantize=quantize, int4_decode="tinygemm")


@pytest.mark.gpu
@pytest.mark.gpu_shared  # its engines keep to 4 GiB (beside_others_reserve_mib)
def test_on_the_gpu_int4_decode_tinygemm_keeps_mtp_on_equal_off_and_books_its_packs(ckpt):
    """Decode and verify steps of 1-4 sequences through PyTorch's tinygemm: greedy MTP on = off (one path for every
    step of 1-4 sequences), and the VRAM books count its pack of the codes as weights and name the kernel."""
    kw = dict(device="cuda", dtype="bfloat16", tier_budget_mib=64.0, vram_reserve_mib=beside_others_reserve_mib())
    ours = _mtp_on_equals_off(ckpt, "int4", **kw)
    tiny = _mtp_on_equals_off(ckpt, "int4", int4_decode="tinygemm", **kw)
    assert tiny["weights_mib"] > ours["weights_mib"], (tiny, ours)
    assert tiny["weight_format"].endswith("int4 decode on tinygemm") and "tinygemm" not in ours["weight_format"]


@pytest.mark.gpu  # alone: the 0.6B shape's random weights are drawn on the GPU at start, past a 4 GiB share
@pytest.mark.parametrize("quantize", ["fp8", "int4"])
def test_on_the_gpu_split_k_products_keep_mtp_on_equal_off_without_fused_ops(quantize):
    # the 0.6B shape's narrow products (o: K 2048 -> N 1024; down) split K in the quantized kernels, whose split
    # counters must exist before the first capture even where FUSED_OPS (which makes them too) is off; the
    # model is drawn on the GPU at start (random:, no checkpoint)
    from pathlib import Path
    from types import SimpleNamespace

    from engine.model.quant import kernels

    o_proj = SimpleNamespace(format="int4" if quantize == "int4" else "fp8", out_features=1024, in_features=2048,
                             group_size=128, block_k=2048, bits=4)
    assert kernels.default_config(o_proj).split_k > 1
    _mtp_on_equals_off(Path("random:0.6b+mtp"), quantize, device="cuda", dtype="bfloat16", tier_budget_mib=64.0,
                       switches={"FUSED_OPS": False})
