"""The quantized layers' products on CUDA: which kernel takes a product, at which launch shape.

    y = quant_linear(x, layer)                      # x [..., K] (bf16 / fp16, any rows) -> [..., N]
    y = quant_linear(x, layer, "gemv", config)      # one path at another launch shape (`bench linear --quant`)

By the product's rows (the thresholds are per weight class and device, engine.model.quant.launch_table):
- 1-4 rows, or a decode / verify step of 1-4 sequences (`gemv`, engine.model.quant.gemv): fp32 multiply-adds on
  the weight as loaded, no tensor-core dot: a step is bound by how fast the SM turns quantized bytes into products.
- up to `tc_rows` (`tc`, engine.model.quant.tensor_core): verify steps, batches, short prompt chunks. Tensor-core
  dots on weights unpacked in registers by shifts and masks; the weight is read once per 16-64 rows, never
  written back as bf16.
- more (`dense`, engine.model.quant.dense): prompt chunks. FP8 GEMMs (torch._scaled_mm) or one kernel writing
  the bf16 weight into cuBLAS: compute-bound, where cuBLAS is what is fast.
- int4 layers whose class the table routes to `tinygemm`: torch._weight_int4pack_mm (PyTorch's own int4 kernel)
  up to `tinygemm_rows` (where it measured faster than these kernels: a decode step's few rows), on the layer's
  weight repacked once (engine.model.quant.tinygemm); with `--int4-decode tinygemm` every int4 layer it takes,
  for the steps of 1-4 sequences (`route_decode_to_tinygemm`).

The launch shape is a function of the weight's shape only, never of the row count, and a decode or verify step's
path and tensor-core row tile follow its sequences, not its rows (so a row's output does not depend on the other
rows of its step: a decode step's row and the same row in a verify step are computed alike; across the paths'
thresholds they agree to rounding, not bit for bit). The shape is found in the
committed table or worked out here (`default_config`): enough
programs to keep every SM streaming (K split where the output is narrow). No autotuning at run time, no host
synchronisation, no allocation but the output and the split-K partial sums: the launches are capturable in CUDA
graphs. The same kernels run in Triton's interpreter on CPU (the tests' oracle is the layer's `reference`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

from engine.errors import ConfigError
from engine.model.pdl import launch_kwargs
from engine.model.quant import launch_table, tinygemm
from engine.model.quant.gemv import MAGIC_BITS, fp8_gemv_kernel, int_gemv_kernel
from engine.model.quant.tensor_core import fp8_tc_kernel, int_tc_kernel
from engine.model.quant.tensor_core_pairs import int4_pairs_kernel
from engine.model.triton_linear import COUNTER_LANES, split_counters

PATHS = ("gemv", "tc", "dense", "tinygemm")
# the GEMV keeps one accumulator per row, for a group of 4 rows a program: the rows a decode step's one path spans
GEMV_MAX_ROWS = launch_table.ONE_PATH_ROWS
VERIFY_TOKENS = 8  # an input [B, T, K] with T up to this is a decode / verify step: its path follows B
# Defaults where the launch table has no entry. A decode or verify step of 1-4 sequences takes one path whatever its
# batch (launch_table checks each entry for it): a request's token is computed in a step of as many sequences as
# run beside it then, which differs between two runs of the same requests (with MTP on they finish sooner), and the
# GEMV and the tensor cores round differently; on one path an engine of up to 4 slots (the default) gives the
# same greedy tokens with MTP on as off. The int GEMV at 1-4 rows costs less in sum than the tensor-core kernel,
# whose 16-row tile costs at 1 row what it does at 16; the FP8 GEMV does not (`bench linear --quant`, an H100).
DEFAULT_GEMV_ROWS = {"fp8": 0, "int": GEMV_MAX_ROWS}
DEFAULT_TC_ROWS = {"fp8": 64, "int": 256}  # past these, prompt chunks go to cuBLAS (engine.model.quant.dense)
_TC_MAX_BLOCK_M = 128
_TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs): enough loads in flight to stream the weight
_MIN_STEPS_PER_SPLIT = 4  # a split shorter than this many K steps spends more on its partial sum than it saves

# how a layer's scales reach the product (constexpr SCALES of the kernels)
SCALE_PER_COLUMN = 0  # fp8: one scale per output column, applied to the finished sum
SCALE_PER_STEP = 1  # one scale (int: and offset) per column per K step, applied to the step's partial product
SCALE_PER_ELEMENT = 2  # fp8: the weight tile scaled before the product; int: a scale per run of words


# How the tensor-core path unpacks int codes: "slots" one code at a time, the weight as the dot's second operand
# (engine.model.quant.tensor_core); "pairs" two int4 codes at a time, the weight as its first
# (engine.model.quant.tensor_core_pairs: int4 in groups that span a step, the tensor-core path only)
UNPACKS = ("slots", "pairs")


@dataclass(frozen=True)
class QuantConfig:
    """Launch shape: output columns per program, K (codes) per loop step, K splits (1: no partial sums), warps,
    stages, and how the tensor-core path unpacks int codes (UNPACKS)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    unpack: str = "slots"

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value}: a power of two, at least 16")
        if self.unpack not in UNPACKS:
            raise ValueError(f"unpack={self.unpack!r}: expected one of {', '.join(UNPACKS)}")

    def label(self) -> str:
        shape = f"{self.block_n}x{self.block_k}x{self.split_k}x{self.num_warps}x{self.num_stages}"
        return shape if self.unpack == "slots" else f"{shape}x{self.unpack}"

    @classmethod
    def parse(cls, text: str) -> "QuantConfig":
        parts = text.split("x")
        if len(parts) not in (5, 6) or not all(p.isdigit() for p in parts[:5]):
            raise ValueError(f"{text!r}: a launch shape is BLOCK_NxBLOCK_KxSPLITxWARPSxSTAGES[xUNPACK]")
        return cls(*map(int, parts[:5]), *parts[5:])


def takes_pairs(layer, cfg: QuantConfig) -> bool:
    """Whether the pair-unpacking kernel runs `layer` at `cfg`'s steps: int4 codes, a group spanning each step."""
    return layer.format == "int4" and scale_mode(layer, cfg.block_k) == SCALE_PER_STEP


def scale_mode(layer, block_k: int) -> int:
    """How `layer`'s scales reach the product at steps of `block_k` codes (SCALE_PER_*)."""
    if layer.format == "fp8":
        if layer.block_k >= layer.in_features:
            return SCALE_PER_COLUMN
        return SCALE_PER_STEP if layer.block_k % block_k == 0 else SCALE_PER_ELEMENT
    return SCALE_PER_STEP if layer.group_size % block_k == 0 and layer.in_features % block_k == 0 \
        else SCALE_PER_ELEMENT


def _split(n: int, k: int, block_n: int, block_k: int) -> int:
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < _TARGET_PROGRAMS and k // (split * 2) >= _MIN_STEPS_PER_SPLIT * block_k:
        split *= 2
    return split


def default_config(layer, path: str = "tc") -> QuantConfig:
    """The launch shape of `path` for `layer` where the table has none (its shape and layout only)."""
    n, k = layer.out_features, layer.in_features
    if layer.format == "fp8":
        # gemv: 16-byte loads along K, 8 threads a row at 128 codes; tc: a step of one block-FP8 scale block
        block_n, block_k = (32, 128) if path == "gemv" else (32, 256 if layer.block_k >= k else 128)
    elif path == "gemv":
        # 16 words a row per step (4 threads of one 16-byte run each), 4 rows of the weight a thread: the
        # activations' share of the work (loads, scaling, sums) spread over them; 4 rows at most without spills
        block_n, block_k = 128, 16 * (32 // layer.bits)
    else:
        block_n, block_k = 64, 16 * (32 // layer.bits)  # 16 words: each slot's dot is one k16 MMA deep
    return QuantConfig(block_n=block_n, block_k=block_k, split_k=_split(n, k, block_n, block_k),
                       num_warps=4, num_stages=2 if path == "gemv" else 3)


@dataclass(frozen=True)
class Launch:
    """A layer's launch plan on one device: each path's shape and scale mode, and the row thresholds."""

    gemv: QuantConfig
    tc: QuantConfig
    gemv_rows: int
    tc_rows: int
    tinygemm_rows: int


def plan(layer) -> Launch:
    """The layer's launch plan, worked out at its first product and kept on it (the table, else defaults)."""
    launch = layer.__dict__.get("_quant_launch")
    if launch is None:
        device = layer.scale_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        entry = launch_table.lookup(name, launch_table.layer_format(layer), layer.out_features, layer.in_features)
        launch = layer.__dict__["_quant_launch"] = launch_of(layer, entry, device)
    return launch


def launch_of(layer, entry: dict, device: torch.device) -> Launch:
    """The launch plan a launch-table entry (engine.model.quant.launch_table; {}: the defaults) gives `layer`."""
    tc_rows = int(entry.get("tc_rows", _default_tc_rows(layer, device)))
    tiny = int(entry.get("tinygemm_rows", tc_rows if entry.get("backend") == "tinygemm" else 0))
    tc = QuantConfig.parse(entry["tc"]) if "tc" in entry else default_config(layer, "tc")
    if tc.unpack == "pairs" and not takes_pairs(layer, tc):  # a layer of the class whose groups split its steps
        tc = default_config(layer, "tc")
    return Launch(
        gemv=QuantConfig.parse(entry["gemv"]) if "gemv" in entry else default_config(layer, "gemv"),
        tc=tc,
        gemv_rows=int(entry.get("gemv_rows", DEFAULT_GEMV_ROWS["fp8" if layer.format == "fp8" else "int"])),
        tc_rows=tc_rows, tinygemm_rows=min(tiny, tc_rows) if tinygemm.takes(layer) else 0)


def _default_tc_rows(layer, device: torch.device) -> int:
    """FP8 prompt chunks past 64 rows multiply in FP8 where cuBLAS can (reading 1 byte a weight, at FP8's rate);
    the rest leave the tensor-core kernel at 256 rows, where the bf16 weight one kernel writes costs less than
    the tiles of rows re-reading the quantized one."""
    from engine.model.quant import dense

    if layer.format == "fp8" and (dense.rowwise_takes(layer, device) or dense.blockwise_takes(layer, device)):
        return DEFAULT_TC_ROWS["fp8"]
    return DEFAULT_TC_ROWS["int"]


def path_of(layer, rows: int, sequences: int | None = None) -> str:
    """Which path a product of `rows` rows takes through `layer`; a decode or verify step (`sequences`: its batch)
    by its sequences, so that a verify step's rows take the path the decode step's do (MTP: the same tokens)."""
    launch = plan(layer)
    by = rows if sequences is None else sequences
    if by > launch.tc_rows:
        return "dense"
    if by <= launch.tinygemm_rows:
        return "tinygemm"
    return "gemv" if by <= launch.gemv_rows else "tc"


def tc_block_m(rows: int, sequences: int | None = None) -> int:
    """The tensor-core path's row tile: a power of two from 16 that holds the rows, or for a decode or verify step
    the sequences, so a verify step's rows are tiled as its decode step's (a 64-row tile compiles to other MMA
    instructions than a 32-row one, and a row's sum need not round alike in both)."""
    return min(_TC_MAX_BLOCK_M, max(16, triton.next_power_of_2(rows if sequences is None else sequences)))


@functools.lru_cache(maxsize=None)
def _native_fp8(device: torch.device) -> bool:
    """Whether the device converts e4m3 in hardware (sm_89 and up; Triton's interpreter on CPU does too)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def prepare(device: torch.device | str, model: torch.nn.Module | None = None,
            dtype: torch.dtype = torch.bfloat16, int4_decode: str = "strata") -> None:
    """Before any CUDA graph capture of a quantized model: every lane's split counters, the one-off probe of the
    block-scaled FP8 GEMM the prompt chunks may take, and tinygemm's pack of each of `model`'s layers the launch
    table routes to it (made now, so the VRAM books count it as weights: `linear.model_bytes`); with
    `int4_decode="tinygemm"` (`--int4-decode`) every int4 layer tinygemm takes is routed to it first
    (`route_decode_to_tinygemm`)."""
    from engine.model.quant.dense import blockwise_works

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for lane in COUNTER_LANES:
        split_counters(device, lane)
    blockwise_works(device)
    if int4_decode == "tinygemm" and route_decode_to_tinygemm(model) == 0:
        raise ConfigError("int4_decode", int4_decode, "the model has no int4 projection tinygemm takes (4-bit codes "
                                                      "in groups of 32-256, outputs a multiple of 8)")
    for layer in model.modules() if model is not None else ():
        if getattr(layer, "quantized", False) and plan(layer).tinygemm_rows > 0:  # a QuantLinear
            tinygemm.packed(layer, dtype)


def route_decode_to_tinygemm(model: torch.nn.Module | None) -> int:
    """Route the decode and verify steps of 1-4 sequences of each of `model`'s int4 layers that tinygemm takes to
    tinygemm (their launch plans; the steps past 4 sequences and the prompt chunks keep their paths); the number
    of layers routed."""
    routed = 0
    for layer in model.modules() if model is not None else ():
        if getattr(layer, "quantized", False) and tinygemm.takes(layer):
            launch = plan(layer)
            rows = max(launch.tinygemm_rows, min(GEMV_MAX_ROWS, launch.tc_rows))
            layer.__dict__["_quant_launch"] = dataclasses.replace(launch, tinygemm_rows=rows)
            routed += 1
    return routed


def quant_linear(x: torch.Tensor, layer, path: str | None = None, config: QuantConfig | None = None) -> torch.Tensor:
    """x [..., K] times `layer`'s weight (+ bias) -> [..., N], by the path its rows take (or `path`)."""
    if getattr(layer, "perm", None) is not None:
        x = x.index_select(-1, layer.perm)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    assert k == layer.in_features, (tuple(x.shape), k, layer.in_features)
    # [B, T, K] with a few tokens a sequence: a decode (T = 1) or verify (T = depth + 1) step of B sequences
    sequences = x.shape[0] if x.dim() == 3 and x.shape[1] <= VERIFY_TOKENS else None
    path = path or path_of(layer, m, sequences)
    if path == "dense":
        from engine.model.quant.dense import dense_linear

        out = dense_linear(rows, layer)
    elif path == "tinygemm":
        from engine.model.quant.tinygemm import tinygemm_linear

        out = tinygemm_linear(rows, layer)
    elif path == "gemv":
        out = _gemv(rows, layer, config or plan(layer).gemv)
    elif path == "tc":
        out = _tc(rows, layer, config or plan(layer).tc, tc_block_m(m, sequences))
    else:
        raise ValueError(f"path={path!r}: expected one of {', '.join(PATHS)}")
    return out.view(*x.shape[:-1], layer.out_features)


def _partials(rows: torch.Tensor, n: int, cfg: QuantConfig, tiles: int):
    """The split-K partial sums and counters of a launch (the output itself where there is no split)."""
    if cfg.split_k == 1:
        return None, None
    counters = split_counters(rows.device)
    assert tiles <= counters.numel(), (n, rows.shape, cfg)
    return torch.empty(cfg.split_k, rows.shape[0], n, dtype=torch.float32, device=rows.device), counters


def _gemv(rows: torch.Tensor, layer, cfg: QuantConfig) -> torch.Tensor:
    if cfg.unpack != "slots":
        raise ValueError(f"launch shape {cfg.label()}: the GEMV unpacks one code at a time (pairs: the tensor cores')")
    m = rows.shape[0]
    n = layer.out_features
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, GEMV_MAX_ROWS))  # a program per 4 rows
    part, counters = _partials(rows, n, cfg, grid[0] * grid[2])
    part, counters = (out, out) if part is None else (part, counters)
    has_bias = layer.bias is not None
    group = min(m, GEMV_MAX_ROWS)
    common = dict(ROWS=group, RB=triton.next_power_of_2(group), BLOCK_N=cfg.block_n, SPLIT=cfg.split_k,
                  HAS_BIAS=has_bias, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs())
    return _launch(fp8_gemv_kernel, int_gemv_kernel, 4, grid, rows, layer, cfg, out, part, counters, common)


def _block_words(layer, cfg: QuantConfig, least: int) -> int:
    """Words of a step: BLOCK_K's codes, at least `least` words (a whole run; the tensor cores' 16)."""
    words = cfg.block_k // (32 // layer.bits)
    if words < least:
        raise ValueError(f"block_k={cfg.block_k} is {words} words of {layer.bits}-bit codes: this path steps "
                         f"{least} words ({least * (32 // layer.bits)} codes) at least")
    return words


def _tc(rows: torch.Tensor, layer, cfg: QuantConfig, block_m: int) -> torch.Tensor:
    m = rows.shape[0]
    n = layer.out_features
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, block_m))
    part, counters = _partials(rows, n, cfg, grid[0] * grid[2])
    part, counters = (out, out) if part is None else (part, counters)
    has_bias = layer.bias is not None
    # a taller row tile keeps fewer steps in flight (its activation tiles fill the shared memory a step's
    # pipeline holds); the stages change when loads are issued, never the order of the sums
    # a row tile of 64 and up takes 8 warps at least (at 4 its accumulators and activation tiles spill: sm_90's
    # register counts, compiled); warps change which thread sums what, never the order of a column's sums.
    # No PDL here (the GEMV and the step's other kernels have it): a tensor-core kernel's programs placed while
    # the kernel before drains made decode at 16 rows slower, not faster (docs/MODEL.md, "Why these kernels")
    common = dict(BLOCK_M=block_m, BLOCK_N=cfg.block_n, SPLIT=cfg.split_k, HAS_BIAS=has_bias,
                  num_warps=max(cfg.num_warps, 8) if block_m >= 64 else cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.unpack == "pairs":
        return _pairs(rows, layer, cfg, grid, out, part, counters, common)
    return _launch(fp8_tc_kernel, int_tc_kernel, 16, grid, rows, layer, cfg, out, part, counters, common)


def _pairs(rows: torch.Tensor, layer, cfg: QuantConfig, grid: tuple, out: torch.Tensor, part: torch.Tensor,
           counters: torch.Tensor, common: dict) -> torch.Tensor:
    """The tensor-core path through the pair-unpacking kernel (engine.model.quant.tensor_core_pairs)."""
    if not takes_pairs(layer, cfg):
        raise ValueError(f"launch shape {cfg.label()}: pairs unpack int4 codes in groups that span a step of "
                         f"{cfg.block_k} codes; {launch_table.layer_format(layer)} (group {layer.group_size}, "
                         f"K {layer.in_features}) takes the slots")
    block_kw, words, kw_per_split, even = _int_steps(layer, cfg, 16)
    m, k = rows.shape
    int4_pairs_kernel[grid](
        rows, layer.qweight, layer.scales, layer.offsets, layer.bias if layer.bias is not None else layer.scales,
        out, part, counters, m, layer.out_features, k, words, kw_per_split, rows.stride(0), layer.qweight.stride(0),
        layer.scales.stride(0), out.stride(0), GROUP=layer.group_size, RUN=layer.run, BLOCK_KW=block_kw,
        EVEN_K=even, **common)
    return out


def _launch(fp8_kernel, int_kernel, least_words: int, grid: tuple, rows: torch.Tensor, layer, cfg: QuantConfig,
            out: torch.Tensor, part: torch.Tensor, counters: torch.Tensor, common: dict) -> torch.Tensor:
    """One path's launch (the GEMV's or the tensor cores': their kernels, grid and launch options) for the
    layer's format; an int path steps at least `least_words` words of codes."""
    m, k = rows.shape
    n = layer.out_features
    has_bias = layer.bias is not None
    if layer.format == "fp8":
        native = _native_fp8(rows.device)
        k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
        fp8_kernel[grid](
            rows, layer.weight if native else layer.weight.view(torch.uint8), layer.weight_scale,
            layer.bias if has_bias else layer.weight_scale, out, part, counters, m, n, k, k_per_split,
            rows.stride(0), layer.weight.stride(0), layer.weight_scale.stride(0), out.stride(0),
            SCALE_BLOCK_N=layer.block_n, SCALE_BLOCK_K=layer.block_k, SCALES=scale_mode(layer, cfg.block_k),
            NATIVE_FP8=native, BLOCK_K=cfg.block_k, **common)
        return out
    block_kw, words, kw_per_split, even = _int_steps(layer, cfg, least_words)
    int_kernel[grid](
        rows, layer.qweight, layer.scales, layer.offsets, layer.bias if has_bias else layer.scales, out, part,
        counters, m, n, k, words, kw_per_split, rows.stride(0), layer.qweight.stride(0), layer.scales.stride(0),
        out.stride(0), MAGIC_BITS, GROUP=layer.group_size, BITS=layer.bits, RUN=layer.run,
        SCALES=scale_mode(layer, block_kw * (32 // layer.bits)), BLOCK_KW=block_kw, EVEN_K=even, **common)
    return out


def _int_steps(layer, cfg: QuantConfig, least_words: int) -> tuple[int, int, int, bool]:
    """An int launch's K walk: words a step, words of the layer, words a split (whole steps), and whether every
    step of every split is whole (no padding code, no step past K: no mask along K)."""
    block_kw = _block_words(layer, cfg, least_words)
    words = layer.qweight.shape[1]
    kw_per_split = triton.cdiv(triton.cdiv(words, cfg.split_k), block_kw) * block_kw
    even = words * (32 // layer.bits) == layer.in_features and kw_per_split * cfg.split_k == words
    return block_kw, words, kw_per_split, even
