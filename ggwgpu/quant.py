"""Frozen weight storage in ggml's block formats: f16, q8_0 and q4_0, with NumPy
quantize / dequantize.

A `Quantized` value is what a frozen weight holds: its type, its shape in values (NumPy
order) and the raw ggml blocks as uint8, row after row. Blocks run along the last dim (ggml's
ne0), so a row's length must be a multiple of the block size:

    f16   1 value, 2 bytes     IEEE half
    q8_0  32 values, 34 bytes  f16 scale d, then 32 int8 q: value j = d * q[j]
    q4_0  32 values, 18 bytes  f16 scale d, then 16 bytes qs: value j = d * ((qs[j] & 0xF) - 8),
                               value j + 16 = d * ((qs[j] >> 4) - 8), for j < 16

The quantizers reproduce ggml's reference ones (quantize_row_q8_0_ref, quantize_row_q4_0_ref
in ggml-quants.c) bit for bit, in float32 as they compute. These types are for constants
only: graphs read them (ops/quant.py dequantizes inside its kernels) but never make them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# type -> (values per block, bytes per block): ggml's block layouts.
BLOCKS = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}
QUANT_TYPES = tuple(BLOCKS)
QK = 32   # values per block of q8_0 and q4_0


def storage_bytes(dtype: str, n: int) -> int:
    """Bytes that n values of `dtype` take (n a multiple of the block size)."""
    block, size = BLOCKS[dtype]
    return n // block * size


@dataclass(frozen=True, eq=False)
class Quantized:
    """A frozen weight in a block format: `data` holds the blocks (uint8, 1-D)."""
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self):
        if self.dtype not in BLOCKS:
            raise ValueError(f"unknown block type {self.dtype!r}; one of {', '.join(BLOCKS)}")
        shape = tuple(int(n) for n in self.shape)
        object.__setattr__(self, "shape", shape)
        check_rows(self.dtype, shape)
        data = np.asarray(self.data)
        if data.dtype != np.uint8 or data.ndim != 1:
            data = data.view(np.uint8).reshape(-1)
        want = storage_bytes(self.dtype, int(np.prod(shape)))
        if data.size != want:
            raise ValueError(f"{self.dtype} {shape}: {data.size} bytes of blocks, expected {want}")
        object.__setattr__(self, "data", data)

    @property
    def nbytes(self) -> int:
        return self.data.size

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"Quantized({self.dtype}, shape={self.shape}, {self.nbytes} bytes)"


def check_rows(dtype: str, shape):
    block = BLOCKS[dtype][0]
    if not shape or shape[-1] % block:
        raise ValueError(f"{dtype} needs rows of a multiple of {block} values, got shape "
                         f"{tuple(shape)}")


def quantize(x, dtype: str) -> Quantized:
    """x (any float array, rows a multiple of the block size) in block type `dtype`."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    if dtype not in BLOCKS:
        raise ValueError(f"cannot quantize to {dtype!r}; one of {', '.join(BLOCKS)}")
    check_rows(dtype, x.shape)
    if dtype == "f16":
        return Quantized(dtype, x.shape, x.astype(np.float16).view(np.uint8).reshape(-1))
    blocks = x.reshape(-1, QK)
    scale, qs = (_q8_0 if dtype == "q8_0" else _q4_0)(blocks)
    data = np.concatenate([scale.astype(np.float16).view(np.uint8), qs], axis=1)
    return Quantized(dtype, x.shape, data.reshape(-1))


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d in float32, 0 where d is 0 (ggml: id = d ? 1/d : 0)."""
    safe = np.where(d == 0, np.float32(1), d)
    return np.where(d == 0, np.float32(0), np.float32(1) / safe)


def _q8_0(blocks):
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    v = (blocks * _inverse(d)).astype(np.float64)   # exact; C's roundf: half away from zero
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return d, q.astype(np.int8).view(np.uint8)


def _q4_0(blocks):
    first_max = np.abs(blocks).argmax(axis=1)      # the first value of largest |x|, signed
    d = blocks[np.arange(len(blocks)), first_max][:, None] / np.float32(-8)
    v = blocks * _inverse(d) + np.float32(8.5)     # in [0.5, 16.5]: int8() truncates
    q = np.minimum(15, np.trunc(v).astype(np.int8)).astype(np.uint8)
    return d, q[:, :QK // 2] | (q[:, QK // 2:] << 4)


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 values of `q` (exact: every value is an f16 scale times a small int)."""
    if q.dtype == "f16":
        return q.data.view(np.float16).astype(np.float32).reshape(q.shape)
    size = BLOCKS[q.dtype][1]
    blocks = q.data.reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if q.dtype == "q8_0":
        values = blocks[:, 2:].view(np.int8).astype(np.float32)
    else:
        qs = blocks[:, 2:]
        values = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) - 8
    return (d * values).reshape(q.shape)


def quantize_model(params: dict, dtype: str) -> dict:
    """A model's values with every 2-D weight whose rows are a multiple of 32 values in
    `dtype` (f16, q8_0 or q4_0); 1-D values (norms) and other shapes stay float32.
    Quantized inputs are dequantized first (so q8_0 -> q4_0 works)."""
    if dtype not in BLOCKS:
        raise ValueError(f"cannot quantize to {dtype!r}; one of {', '.join(BLOCKS)}")
    out = {}
    for name, value in params.items():
        value = dequantize(value) if isinstance(value, Quantized) else np.asarray(value, np.float32)
        out[name] = quantize(value, dtype) if value.ndim == 2 and value.shape[1] % QK == 0 \
            else value
    return out
