"""Frozen weight storage in ggml's block types, with NumPy quantize / dequantize.

A `Quantized` value is what a frozen weight holds: its type, its shape in values (NumPy
order) and the raw ggml blocks as uint8, row after row. Blocks run along the last dim (ggml's
ne0), so a row's length must be a multiple of the block size. `TYPES` is the one table of
the types: every type there is kept as it is by GGUF loading and read as it is by the
kernels (ops/quant.py, shaders/quant_blocks.wgsl, whose type codes are the table's order).

    type  values bytes  layout (d, m, dmin: f16; value j of a block)
    f16       1    2    IEEE half
    bf16      1    2    the top half of an f32
    q4_0     32   18    d, qs[16]: nibble n_j (low nibbles: j < 16) -> d * (n_j - 8)
    q4_1     32   20    d, m, qs[16] -> d * n_j + m
    q5_0     32   22    d, qh (u32: bit j is bit 4 of q_j), qs[16] -> d * (q_j - 16)
    q5_1     32   24    d, m, qh, qs[16] -> d * q_j + m
    q8_0     32   34    d, int8 q[32] -> d * q_j
    mxfp4    32   17    e (u8), qs[16] as q4_0's -> 2^(e - 128) * E2M1_DOUBLED[n_j] (OCP MX FP4)
    q2_k    256   84    16 sub-blocks of 16 values, 2-bit q, 4-bit scale and min each
    q3_k    256  110    16 of 16, 3-bit q (2 low bits + a high-bit mask), 6-bit scales
    q4_k    256  144    8 of 32, 4-bit q, 6-bit scale and min each
    q5_k    256  176    8 of 32, 5-bit q, 6-bit scale and min each
    q6_k    256  210    16 of 16, 6-bit q, int8 scales

gguf-py's `gguf.quants` is the reference: `dequantize` calls it for every type, `quantize`
for the types it can quantize (all but the k-quants, which only come from files; tests build
them with `random_blocks`). Its quantizers reproduce ggml's reference ones bit for bit. These
types are for constants only: graphs read them but never make them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf import quants as gguf_quants


@dataclass(frozen=True)
class BlockType:
    block: int                 # values per block
    size: int                  # bytes per block
    ggml: GGMLQuantizationType
    file_type: int             # llama.cpp's general.file_type (LlamaFileType) of a file
                               # mostly in this type
    halves: tuple[int, ...]    # byte offsets of a block's f16 scales (d, m, dmin)
    quantizable: bool          # gguf.quants can quantize to it


_G, _F = GGMLQuantizationType, LlamaFileType
# llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE, which gguf-py names only from 0.19 on
MOSTLY_MXFP4_MOE = getattr(_F, "MOSTLY_MXFP4_MOE", 38)
TYPES = {
    "f16": BlockType(1, 2, _G.F16, _F.MOSTLY_F16, (), True),
    "bf16": BlockType(1, 2, _G.BF16, _F.MOSTLY_BF16, (), True),
    "q4_0": BlockType(32, 18, _G.Q4_0, _F.MOSTLY_Q4_0, (0,), True),
    "q4_1": BlockType(32, 20, _G.Q4_1, _F.MOSTLY_Q4_1, (0, 2), True),
    "q5_0": BlockType(32, 22, _G.Q5_0, _F.MOSTLY_Q5_0, (0,), True),
    "q5_1": BlockType(32, 24, _G.Q5_1, _F.MOSTLY_Q5_1, (0, 2), True),
    "q8_0": BlockType(32, 34, _G.Q8_0, _F.MOSTLY_Q8_0, (0,), True),
    "mxfp4": BlockType(32, 17, _G.MXFP4, MOSTLY_MXFP4_MOE, (), True),
    "q2_k": BlockType(256, 84, _G.Q2_K, _F.MOSTLY_Q2_K, (80, 82), False),
    "q3_k": BlockType(256, 110, _G.Q3_K, _F.MOSTLY_Q3_K_M, (108,), False),
    "q4_k": BlockType(256, 144, _G.Q4_K, _F.MOSTLY_Q4_K_M, (0, 2), False),
    "q5_k": BlockType(256, 176, _G.Q5_K, _F.MOSTLY_Q5_K_M, (0, 2), False),
    "q6_k": BlockType(256, 210, _G.Q6_K, _F.MOSTLY_Q6_K, (208,), False),
}
assert all(GGML_QUANT_SIZES[t.ggml] == (t.block, t.size) for t in TYPES.values())
QUANT_TYPES = tuple(TYPES)
QUANTIZABLE = tuple(name for name, t in TYPES.items() if t.quantizable)
QK = 32   # values per block of the 32-value types
# mxfp4's codes: an E2M1 float (sign, 2 exponent bits, 1 mantissa bit) doubled, so that the
# block's power of two scale is 2^(e - 128) (ggml's e8m0 "half")
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# the larger magnitude of the two codes in each byte value
BYTE_LARGEST_E2M1 = np.abs(np.array(E2M1_DOUBLED, np.int8))[np.arange(256)[:, None] >> [0, 4] & 15
                                                           ].max(axis=1).astype(np.uint8)


def type_of_ggml(ggml_type) -> str | None:
    """The name of a GGUF tensor type in `TYPES`, or None (F32 and unsupported types)."""
    return next((name for name, t in TYPES.items() if t.ggml == ggml_type), None)


def is_finite(q: "Quantized") -> bool:
    """Whether every value of `q` is finite, from its f16/bf16 fields alone (a block's values
    are small integers times its f16 scales, so they are finite when the scales are)."""
    t = TYPES[q.dtype]
    if q.dtype == "bf16":
        return not np.any((q.data.view(np.uint16) & 0x7F80) == 0x7F80)
    if q.dtype == "mxfp4":     # the largest code of each block times its scale, in range
        blocks = q.data.reshape(-1, t.size)
        largest = BYTE_LARGEST_E2M1[blocks[:, 1:]].max(axis=1)
        return bool(np.all(largest * np.exp2(blocks[:, 0].astype(np.float64) - 128)
                           <= np.finfo(np.float32).max))
    if q.dtype == "f16":
        halves = q.data.view(np.uint16)
    else:
        blocks = q.data.reshape(-1, t.size)
        halves = np.concatenate([blocks[:, o:o + 2].copy().view(np.uint16).reshape(-1)
                                 for o in t.halves])
    return not np.any((halves & 0x7C00) == 0x7C00)


def storage_bytes(dtype: str, n: int) -> int:
    """Bytes that n values of `dtype` take (n a multiple of the block size)."""
    t = TYPES[dtype]
    return n // t.block * t.size


@dataclass(frozen=True, eq=False)
class Quantized:
    """A frozen weight in a block type: `data` holds the blocks (uint8, 1-D)."""
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self):
        if self.dtype not in TYPES:
            raise ValueError(f"unknown block type {self.dtype!r}; one of {', '.join(TYPES)}")
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
    block = TYPES[dtype].block
    if not shape or shape[-1] % block:
        raise ValueError(f"{dtype} needs rows of a multiple of {block} values, got shape "
                         f"{tuple(shape)}")


def quantize(x, dtype: str) -> Quantized:
    """x (any float array, rows a multiple of the block size) in block type `dtype`, as
    gguf.quants (and ggml's reference quantizers) make it."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    if dtype not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {dtype!r}; one of {', '.join(QUANTIZABLE)}")
    check_rows(dtype, x.shape)
    with np.errstate(all="ignore"):   # gguf.quants divides by zero scales before it masks
        data = gguf_quants.quantize(np.ascontiguousarray(x), TYPES[dtype].ggml)
    return Quantized(dtype, x.shape, data.view(np.uint8).reshape(-1))


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 values of `q` (exact: gguf.quants' float32 arithmetic)."""
    with np.errstate(all="ignore"):   # forged scales may give inf * 0, as in ggml
        values = gguf_quants.dequantize(q.data, TYPES[q.dtype].ggml)
    return np.asarray(values, np.float32).reshape(q.shape)


def random_blocks(dtype: str, shape, rng: np.random.Generator, scale=1.0) -> Quantized:
    """Valid random blocks of `dtype` (for the types gguf.quants cannot quantize): random
    bytes, with the f16 scales of each block set to finite values that keep every value of
    the block within about [-scale, scale]."""
    t = TYPES[dtype]
    shape = tuple(shape)
    check_rows(dtype, shape)
    if not t.halves:
        return quantize(rng.uniform(-scale, scale, shape), dtype)
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // t.block, t.size), dtype=np.uint8)
    scales = np.ones((len(blocks), 1), np.float16).view(np.uint8)
    for at in t.halves:
        blocks[:, at:at + 2] = scales
    largest = np.abs(dequantize(Quantized(dtype, shape, blocks.reshape(-1)))).max()
    for at in t.halves:
        half = rng.uniform(-scale, scale, (len(blocks), 1)) / max(largest, 1.0)
        blocks[:, at:at + 2] = half.astype(np.float16).view(np.uint8)
    return Quantized(dtype, shape, blocks.reshape(-1))


def quantize_model(params: dict, dtype: str) -> dict:
    """A model's values with every 2-D weight and every stack of experts' matrices (3-D)
    whose rows are a multiple of 32 values (and of the block size) in `dtype`; 1-D values
    (norms), norms and convolution taps stored 2-D (Mamba2's grouped ssm_norm, ssm_conv1d),
    the experts' router (ffn_gate_inp) and biases (gpt-oss's stacks of them), gpt2's position
    embedding, none of which llama.cpp quantizes, and other shapes stay float32. Quantized inputs are dequantized
    first (so q8_0 -> q4_0 works)."""
    if dtype not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {dtype!r}; one of {', '.join(QUANTIZABLE)}")
    out = {}
    for name, value in params.items():
        value = dequantize(value) if isinstance(value, Quantized) else np.asarray(value, np.float32)
        kept = name.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight")) or \
            name == "position_embd.weight" or \
            "ssm_conv1d" in name or "conv.weight" in name
        out[name] = quantize(value, dtype) if value.ndim in (2, 3) and \
            value.shape[-1] % QK == 0 and not kept else value
    return out
