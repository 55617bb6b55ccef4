"""The quantized kernels compiled for an H200 (sm_90) on CPU, by the Triton wheel's own compiler and ptxas: Triton's
interpreter (the CPU tests' runner) accepts code that the GPU compiler refuses, and a kernel that spills its
registers to local memory loses the speed it exists for. Each kernel at the launch shapes the engine uses by
default for the 8B model's shapes: it compiles, and its registers fit (no stack, no local memory)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.engine.model.sm90_compile import compile_for_sm90, global_access_sm90, loop_opcodes_sm90

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

_INT = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16", "b_ptr": "*fp16", "out_ptr": "*bf16",
        "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KW": "i32",
        "kw_per_split": "i32", "stride_xm": "i32", "stride_qn": "i32", "stride_sn": "i32", "stride_om": "i32",
        "magic": "i32"}
_FP8 = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16",
        "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
        "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}

_DEQUANT_INT = {"q_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                "KW": "i32", "stride_qn": "i32", "stride_sn": "i32", "stride_on": "i32"}
_DEQUANT_FP8 = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32",
                "stride_sn": "i32", "stride_on": "i32"}


def _magic_as_launched(kernel) -> dict:
    """The fp32 magic as engine.model.quant.kernels passes it (positionally, gemv.MAGIC_BITS): a constant where the
    kernel declares it constexpr, else a run-time i32 (`_INT`'s)."""
    from engine.model.quant import gemv

    constexpr = next(param.is_constexpr for param in kernel.params if param.name == "magic")
    return {"magic": gemv.MAGIC_BITS} if constexpr else {}


def _cases():
    from engine.model.quant import dense, gemv, tensor_core

    cases = []
    for bits, group, scales in ((4, 128, 1), (4, 32, 2), (8, 32, 2), (8, 16, 2)):
        for rows in (1, 4):
            cases.append((f"int{bits}-g{group} gemv rows {rows}", gemv.int_gemv_kernel, _INT, 4, 2, dict(
                GROUP=group, BITS=bits, RUN=4, SCALES=scales, ROWS=rows, RB=rows, BLOCK_N=128, BLOCK_KW=16, SPLIT=4,
                HAS_BIAS=False, EVEN_K=True)))
        for block_m, warps in ((16, 4), (64, 8), (128, 8)):
            cases.append((f"int{bits}-g{group} tc {block_m} rows", tensor_core.int_tc_kernel, _INT, warps, 3, dict(
                **_magic_as_launched(tensor_core.int_tc_kernel), GROUP=group, BITS=bits, RUN=4, SCALES=scales,
                BLOCK_M=block_m, BLOCK_N=64, BLOCK_KW=16, SPLIT=2, HAS_BIAS=True, EVEN_K=True)))
    for name, sbn, sbk, scales in (("fp8", 1, 4096, 0), ("fp8-block", 128, 128, 1)):
        for rows in (1, 4):
            cases.append((f"{name} gemv rows {rows}", gemv.fp8_gemv_kernel, _FP8, 4, 2, dict(
                SCALE_BLOCK_N=sbn, SCALE_BLOCK_K=sbk, SCALES=scales, NATIVE_FP8=True, ROWS=rows, RB=rows, BLOCK_N=32,
                BLOCK_K=128, SPLIT=2, HAS_BIAS=False)))
        for block_m, warps in ((16, 4), (64, 8), (128, 8)):
            cases.append((f"{name} tc {block_m} rows", tensor_core.fp8_tc_kernel, _FP8, warps, 3, dict(
                SCALE_BLOCK_N=sbn, SCALE_BLOCK_K=sbk, SCALES=scales, NATIVE_FP8=True, BLOCK_M=block_m, BLOCK_N=32,
                BLOCK_K=128, SPLIT=2, HAS_BIAS=False)))
    cases.append(("int4 dequantize", dense._dequant_int_kernel, _DEQUANT_INT, 4, 1,
        dict(GROUP=128, BITS=4, RUN=4, BLOCK_N=dense._DEQUANT_INT_BLOCK_N, BLOCK_W=dense._DEQUANT_INT_BLOCK_W)))
    cases.append(("fp8 dequantize", dense._dequant_fp8_kernel, _DEQUANT_FP8, 4, 1, dict(
        SCALE_BLOCK_N=128, SCALE_BLOCK_K=128, BLOCK_N=32, BLOCK_K=128, TILE_IN_ONE_BLOCK=True)))
    cases.append(("rows to fp8", dense._quantize_rows_kernel, {
        "x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "group_len": "i32", "stride_xm": "i32",
        "stride_qm": "i32", "stride_sm": "i32", "stride_sg": "i32"}, 4, 1, dict(BLOCK=128)))
    return cases


@pytest.mark.parametrize("case", range(len(_cases())))
def test_each_kernel_compiles_for_sm90_without_spilling(case, tmp_path):
    label, kernel, signature, warps, stages, constants = _cases()[case]
    registers, stack, local, shared = compile_for_sm90(kernel, signature, constants, warps, stages, tmp_path)
    print(f"{label}: {registers} registers, {shared} bytes of shared memory")
    assert stack == 0 and local == 0, f"{label} spills: stack {stack}, local {local}"


@pytest.mark.parametrize("bits, group, run", [(4, 128, 4), (4, 32, 4), (4, 128, 1), (8, 32, 4), (8, 128, 2)])
def test_the_dequantizing_kernel_writes_whole_16_byte_pieces(bits, group, run, tmp_path):
    """A prompt chunk's weight is written at the rate its stores fill sectors: each thread's store must be 16
    contiguous bytes (STG.E.128), not a slot's RUN * 2 bytes strided a run apart (STG.E.64 / .32)."""
    from engine.model.quant import dense

    stores = global_access_sm90(dense._dequant_int_kernel, _DEQUANT_INT, dict(
        GROUP=group, BITS=bits, RUN=run, BLOCK_N=dense._DEQUANT_INT_BLOCK_N, BLOCK_W=dense._DEQUANT_INT_BLOCK_W),
        4, 1, tmp_path, unaligned=("N",))
    assert stores and set(stores) == {"STG.E.128"}, stores


@pytest.mark.parametrize("block, tile_k", [((128, 128), 128), ((1, 4096), 256)])
def test_the_fp8_dequantizing_kernel_loads_a_scale_a_row_not_a_weight(block, tile_k, tmp_path):
    """Qwen's 128 x 128 blocks (a tile a block wide) and per-channel scales: each row of a tile has one scale,
    loaded once (a few 4-byte loads a thread), where a gather per weight issued one load for each of the 64
    weights a thread holds."""
    from engine.model.quant import dense

    loads = global_access_sm90(dense._dequant_fp8_kernel, _DEQUANT_FP8, dict(
        SCALE_BLOCK_N=block[0], SCALE_BLOCK_K=block[1], BLOCK_N=dense._DEQUANT_BLOCK_N, BLOCK_K=tile_k,
        TILE_IN_ONE_BLOCK=True), 4, 1, tmp_path, unaligned=("N",), kind="LDG")
    assert loads.get("LDG.E", 0) <= 4 and set(loads) <= {"LDG.E", "LDG.E.128"}, loads


@pytest.mark.parametrize("rows", [1, 4])
def test_the_int4_gemv_spends_one_logic_op_a_code_on_its_unpacking(rows, tmp_path):
    """A batch-1 int4 decode step's GEMV is bound by its instructions (Nsight Compute on an H100: its SM throughput
    well above its memory throughput), and a code's unpacking is one lop3 (mask and the fp32 magic) only where the
    magic comes from a register: sm_90's lop3 takes one immediate, so with both constants ptxas spent a mov or a
    second lop3 a code. 8B gate/up launch shape, group 128."""
    from engine.model.quant import gemv

    constants = dict(GROUP=128, BITS=4, RUN=4, SCALES=1, ROWS=rows, RB=rows, BLOCK_N=128, BLOCK_KW=16, SPLIT=8,
                     HAS_BIAS=False, EVEN_K=True)
    ops = loop_opcodes_sm90(gemv.int_gemv_kernel, _INT, constants, 4, 2, tmp_path)
    codes = 128 * 16 * 8 // (4 * 32)  # a thread's codes a step
    assert ops.count("LOP3.LUT") <= 1.25 * codes, ops.count("LOP3.LUT")
    assert len(ops) <= (5.4 if rows == 1 else 12.5) * codes, len(ops)


def test_the_int4_tensor_core_kernel_unpacks_in_registers_for_its_dot(tmp_path):
    """5-64 rows (a batch-16 decode step) on int4: the unpacked codes go from registers into the dot's operand.
    With the fp32 magic a run-time argument (as the GEMV takes it) Triton staged every unpacked tile through shared
    memory, with a barrier each, and took more registers: a loop of more instructions for the same dot. The engine's
    16-row launch shape at the 8B shapes, group 128."""
    from engine.model.quant import tensor_core

    constants = dict(**_magic_as_launched(tensor_core.int_tc_kernel), GROUP=128, BITS=4, RUN=4, SCALES=1, BLOCK_M=16,
                     BLOCK_N=64, BLOCK_KW=16, SPLIT=4, HAS_BIAS=False, EVEN_K=True)
    ops = loop_opcodes_sm90(tensor_core.int_tc_kernel, _INT, constants, 4, 3, tmp_path)
    barriers = sum(op.startswith("BAR.SYNC") for op in ops)
    shared_stores = sum(op.startswith("STS") for op in ops)
    assert barriers <= 4 and shared_stores <= 4, (barriers, shared_stores)


def test_the_pair_unpacking_int4_kernel_spends_fewer_instructions_a_code_than_the_slots(tmp_path):
    """The `xpairs` launch shapes exist because the 16-row int4 tensor-core kernel is bound by its instructions:
    at the same launch shape (the 8B shapes' 16 rows, 128 columns a program, group 128) the pair-unpacking kernel's
    loop spends fewer instructions a code, and neither spills."""
    from engine.model.quant import tensor_core, tensor_core_pairs

    shape = dict(GROUP=128, RUN=4, BLOCK_M=16, BLOCK_N=128, BLOCK_KW=16, SPLIT=4, HAS_BIAS=False, EVEN_K=True)
    slots = dict(**_magic_as_launched(tensor_core.int_tc_kernel), BITS=4, SCALES=1, **shape)
    pairs_signature = {name: kind for name, kind in _INT.items() if name != "magic"}
    codes = 128 * 16 * 8 / (32 * 4)  # a thread's codes a step (4 warps)
    per_code = {}
    kernels = (("slots", tensor_core.int_tc_kernel, _INT, slots),
               ("pairs", tensor_core_pairs.int4_pairs_kernel, pairs_signature, shape))
    for label, kernel, signature, constants in kernels:
        per_code[label] = len(loop_opcodes_sm90(kernel, signature, constants, 4, 3, tmp_path)) / codes
        assert compile_for_sm90(kernel, signature, constants, 4, 3, tmp_path)[2] == 0, f"{label} spills"
    assert per_code["pairs"] < 0.85 * per_code["slots"], per_code
