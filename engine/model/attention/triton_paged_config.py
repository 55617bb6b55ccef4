"""Launch shapes of the paged kernels (engine.model.attention.triton_paged, triton_prefill), importable without
Triton (the bench's argument parsing runs on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

TILE_LOADS = ("gather", "block", "tma")  # KernelConfig.loads, PrefillConfig.loads, in the kernels' LOADS numbering


def check_loads(loads: str) -> None:
    if loads not in TILE_LOADS:
        raise ValueError(f"loads {loads!r}: expected one of {', '.join(TILE_LOADS)}")


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the decode kernel: keys per tile (any multiple or divisor of the pool's block size),
    warps, pipeline stages, and the fewest tiles one split streams (fewer: more programs for a short span, each
    with less to do one tile after the other). `bench attention --tune` times the alternatives."""

    tile_tokens: int = 128
    num_warps: int = 4
    num_stages: int = 2
    min_split_tiles: int = 1
    loads: str = "gather"  # as PrefillConfig.loads

    def __post_init__(self) -> None:
        check_loads(self.loads)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel: queries per tile (a short chunk takes fewer), keys per tile, warps and
    pipeline stages (fp32 halves the tiles: triton_prefill.launch_shape), and how a tile's keys are loaded:
    "gather" each key through its own block-table entry (a tile may span pool blocks), "block" a tile inside
    one pool block (keys per tile dividing the block's: one table entry and one base address a tile), "tma" the
    same through TMA descriptors of the pools (Triton's host-side tensor descriptors). What a launch cannot
    take falls back ("tma" to "block", "block" to "gather"). `bench attention --prefill-tune` times the
    alternatives."""

    query_tokens: int = 128
    tile_tokens: int = 64
    num_warps: int = 8
    num_stages: int = 2
    loads: str = "block"
    split_programs: int = 0  # a launch of fewer programs splits each one's keys to reach about this many (0: never)

    def __post_init__(self) -> None:
        check_loads(self.loads)


DEFAULT_CONFIG = KernelConfig()
# Chosen by `bench attention --rows prefill --prefill-tune` (docs/BENCHMARKS.md, "Paged prefill attention"): the
# fastest measured shape per KV dtype at 8K, 32K and 128K cached tokens. bf16 loads one-block tiles through TMA.
# int8 keeps its tile of two blocks (keys through the table one by one): the shape its end-to-end figures ran, and
# the faster ones were within a few percent.
# A launch of fewer programs than the device has SMs (a short chunk deep into a span: a reused prompt's tail, a new
# turn of a long conversation) splits its keys to about one program per SM (132 on an H100 / H200).
PREFILL_SPLIT_PROGRAMS = 132
DEFAULT_PREFILL_CONFIG_BF16 = PrefillConfig(query_tokens=128, tile_tokens=64, num_warps=4, num_stages=3, loads="tma",
                                            split_programs=PREFILL_SPLIT_PROGRAMS)
DEFAULT_PREFILL_CONFIG_INT8 = PrefillConfig(query_tokens=128, tile_tokens=128, num_warps=8, num_stages=2,
                                            loads="gather", split_programs=PREFILL_SPLIT_PROGRAMS)


def default_prefill_config(int8_kv: bool) -> PrefillConfig:
    """The prefill kernel's launch shape when none is given: it differs by KV dtype (int8 dequantizes in the
    tile loop, which favours longer key tiles)."""
    return DEFAULT_PREFILL_CONFIG_INT8 if int8_kv else DEFAULT_PREFILL_CONFIG_BF16
