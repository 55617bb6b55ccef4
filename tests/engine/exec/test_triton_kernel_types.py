"""The paged attention kernels compile whatever type a caller gives their softmax scale: torch.compile (inductor)
passes a Python float as fp64, which turned the running max fp64 and failed the prompt-chunk kernel's compile
under COMPILE. Triton's front end (source to IR) runs on CPU, no GPU needed;
skipped where Triton is not installed (CI)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_BF16_POINTERS = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}
_FP32_POINTERS = {"ks_ptr", "vs_ptr", "mid_o_ptr", "mid_lse_ptr"}
_KV_SOURCES = {"k_src", "v_src"}  # the prefill kernel's keys and values: pools, or TMA descriptors (LOADS 2)


def _front_end(kernel, scale_name: str, scale_type: str, constexprs: dict[str, object]) -> None:
    """Triton's source-to-IR step for a Hopper target, with `scale_name` typed `scale_type`; raises what the
    compile of a launch would raise there. With LOADS 2 the key and value sources are TMA descriptors of
    BLOCK_N x D tiles."""
    tma = constexprs.get("LOADS") == 2
    desc = f"tensordesc<bf16[{constexprs['BLOCK_N']}, {constexprs['D']}]>"
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif tma and (name in _KV_SOURCES or name in ("k_ptr", "v_ptr")):
            signature[name] = desc
        elif name.endswith("_ptr") or name in _KV_SOURCES:
            signature[name] = ("*bf16" if name in _BF16_POINTERS | _KV_SOURCES else "*fp32" if name in _FP32_POINTERS
                               else "*i32")
        else:
            signature[name] = scale_type if name == scale_name else "i32"
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


@pytest.mark.parametrize("scale_type", ["fp32", "fp64"])
@pytest.mark.parametrize("int8,loads,splits", [(False, 0, 1), (True, 0, 1), (False, 1, 3), (False, 2, 1),
                                               (True, 2, 3)])
def test_prefill_kernel_compiles_with_the_scale_torch_compile_passes(scale_type, int8, loads, splits):
    from engine.model.attention.triton_prefill import _paged_prefill_kernel

    _front_end(_paged_prefill_kernel, "qk_scale", scale_type,
               dict(G=2, D=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, PAGE=64, INT8=int8, PRECISION="tf32",
                    LOADS=loads, SPLITS=splits))


@pytest.mark.parametrize("scale_type", ["fp32", "fp64"])
@pytest.mark.parametrize("single,loads", [(False, 0), (True, 0), (False, 1), (True, 2)])
def test_decode_kernel_compiles_with_the_scale_torch_compile_passes(scale_type, single, loads):
    from engine.model.attention.triton_paged import _paged_decode_kernel

    _front_end(_paged_decode_kernel, "sm_scale", scale_type,
               dict(T=1, G=2, D=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=64, PAGE=64, SINGLE=single, INT8=True,
                    PRECISION="tf32", LOADS=loads))
