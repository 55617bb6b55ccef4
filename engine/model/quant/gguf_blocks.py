"""GGUF's quantized blocks unpacked into this engine's int4 / int8 layouts: each converter takes a tensor's raw
blocks and returns its codes, scales and offsets per group, exactly (every code, scale and minimum of the file is
kept, nothing is requantized); engine.model.quant.gguf_file lists which GGUF type goes to which layout."""

from __future__ import annotations

import numpy as np
import torch


def raw_blocks(t) -> np.ndarray:
    """A GGUF tensor's data as one row of bytes per block."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    return np.ascontiguousarray(np.array(t.data).view(np.uint8).reshape(-1, type_size))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _q8_0(blocks, n, k):  # d, 32 x int8
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].view(np.int8).astype(np.int32) + 128
    return _out(q, d, -128.0 * d, n, k, 8, 32)


def _q4_0(blocks, n, k):  # d, 16 bytes: low nibbles are codes 0..15, high nibbles 16..31
    d = _f16(blocks[:, :2])
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)
    return _out(q, d, -8.0 * d, n, k, 4, 32)


def _q4_1(blocks, n, k):  # d, m, 16 bytes as Q4_0
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)
    return _out(q, d, m, n, k, 4, 32)


def _q4_k(blocks, n, k):  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes: 8 groups of 32
    import gguf

    count = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(count, 256).astype(np.int32)
    scale = d * sc.astype(np.float32)  # [count, 8]
    return _out(q, scale, -dmin * mins.astype(np.float32), n, k, 4, 32)


def _q6_k(blocks, n, k):  # 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, d: 16 groups of 16
    count = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low = (ql.reshape(count, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(count, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(count, 8, 32) | (high.reshape(count, 8, 32) << 4)).reshape(count, 256).astype(np.int32)
    scale = d * scales  # [count, 16]
    return _out(q, scale, -32.0 * scale, n, k, 8, 16)


def _out(codes, scale, offset, n, k, bits, group):
    return (torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(np.ascontiguousarray(scale).reshape(n, k // group)),
            torch.from_numpy(np.ascontiguousarray(offset).reshape(n, k // group)), bits, group)


def _types():
    import gguf

    T = gguf.GGMLQuantizationType
    return ({T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q6_K: _q6_k}, {T.F32, T.F16, T.BF16})


try:
    CONVERTERS, PLAIN_TYPES = _types()
    SUPPORTED_TYPES = {t.name for t in list(CONVERTERS) + list(PLAIN_TYPES)}
except ImportError:  # the gguf package missing: read_gguf's own import names it
    CONVERTERS, PLAIN_TYPES, SUPPORTED_TYPES = {}, set(), set()
