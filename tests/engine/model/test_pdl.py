"""Programmatic dependent launch (engine.model.pdl): on only where a CUDA device has it, and each kernel that takes
it waits for the kernel before ahead of its first global read or write (its compiled code for sm_90 on CPU: the
Triton wheel's own compiler). A read before the wait could see the kernel before's output half written."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from engine.model import pdl

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def test_pdl_is_off_on_the_cpu_and_its_kernels_launch_as_before():
    assert pdl.enable(torch.device("cpu")) is False
    assert pdl.launch_kwargs() == {}


_ACCESS = re.compile(r"\b(ld\.global|st\.global|atom\.global|red\.global|cp\.async|cp\.reduce|ld\.param\.u64)\b")


def _cases():
    from engine.model import triton_linear, triton_ops
    from engine.model.quant import gemv

    skinny = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
              "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32",
              "stride_wn": "i32", "stride_om": "i32"}
    norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
            "stride_x": "i32", "stride_res": "i32", "stride_out": "i32", "stride_sum": "i32", "n_cols": "i32",
            "eps": "fp32"}
    silu = {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "stride_g": "i32", "stride_u": "i32",
            "n_cols": "i32"}
    int_gemv = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16", "b_ptr": "*fp16",
                "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                "KW": "i32", "kw_per_split": "i32", "stride_xm": "i32", "stride_qn": "i32", "stride_sn": "i32",
                "stride_om": "i32", "magic": "i32"}
    return [
        ("skinny", triton_linear._skinny_kernel, skinny,
         dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT=2, HAS_BIAS=False), 4, 4),
        ("add_rms_norm", triton_ops._add_rms_norm_kernel, norm, dict(HAS_RES=True, BLOCK=1024), 4, 1),
        ("silu_mul", triton_ops._silu_mul_kernel, silu, dict(BLOCK=1024), 4, 1),
        ("int4 gemv", gemv.int_gemv_kernel, int_gemv, dict(GROUP=128, BITS=4, RUN=4, SCALES=1, ROWS=1, RB=1,
                                                            BLOCK_N=128, BLOCK_KW=16, SPLIT=4, HAS_BIAS=False,
                                                            EVEN_K=True), 4, 2),
    ]


@pytest.mark.parametrize("case", range(4), ids=["skinny", "add_rms_norm", "silu_mul", "int4 gemv"])
def test_a_kernel_with_pdl_waits_before_its_first_global_access(case, tmp_path):
    from tests.engine.model.sm90_compile import _cubin_for_sm90

    label, kernel, signature, constants, warps, stages = _cases()[case]
    compiled, _ = _cubin_for_sm90(kernel, signature, {**constants, "USE_GDC": True}, warps, stages, tmp_path, ("M",))
    body = compiled.asm["ptx"].split("griddepcontrol.wait", 1)
    assert len(body) == 2, f"{label}: no griddepcontrol.wait"
    ahead = [m.group(1) for m in _ACCESS.finditer(body[0]) if m.group(1) != "ld.param.u64"]
    assert not ahead, f"{label} reads or writes global memory before its wait: {ahead}"
    assert "griddepcontrol.launch_dependents" in body[1], label
    plain, _ = _cubin_for_sm90(kernel, signature, constants, warps, stages, tmp_path, ("M",))
    assert "griddepcontrol" not in plain.asm["ptx"], f"{label} without PDL compiles as before"


def test_with_pdl_on_the_quantized_gemv_launches_with_it_and_the_tensor_core_path_without(monkeypatch):
    """The quantized GEMV (1-4 rows) takes PDL like the other kernels of a step; the tensor-core path (5-256 rows)
    launches without it: with it, decode at batch 16 measured slower (docs/MODEL.md, "Why these kernels")."""
    from engine.model.quant import kernels
    from tests.engine.model.test_quant_kernels import _fp8_layer, _int_layer

    launches = []

    class Recorder:  # stands in for a Triton kernel (no launch on a CPU): what a launch asked for
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **options: launches.append((self.name, options.get("launch_pdl", False)))

    for name in ("int_gemv_kernel", "int_tc_kernel", "fp8_gemv_kernel", "fp8_tc_kernel"):
        monkeypatch.setattr(kernels, name, Recorder(name))
    monkeypatch.setattr(pdl, "_on", True)
    for layer in (_int_layer(4, 128), _fp8_layer((128, 128))):
        kernels.quant_linear(torch.randn(1, 1, layer.in_features), layer, path="gemv")
        kernels.quant_linear(torch.randn(16, 1, layer.in_features), layer, path="tc")
    assert launches == [("int_gemv_kernel", True), ("int_tc_kernel", False),
                        ("fp8_gemv_kernel", True), ("fp8_tc_kernel", False)]
