"""Tensors: graph nodes with a shape, a dtype and a place in some storage.

Shapes, strides and offsets are in NumPy order (outermost first) and counted in elements.
ggml counts the other way (ne[0] is the innermost dimension); `Tensor.ne` and `Tensor.nb`
are the one place that converts, for the shaders.

A tensor either owns its storage (leaves and most op results, always contiguous) or is a
view into the storage of `view_src` (view, reshape, permute, transpose, cpy), which makes
views zero-copy: the shaders read any tensor through its strides and offset.

Element types (DTYPES): f32, f16 (IEEE halves in storage; ops compute in f32 and round on
store, ops/registry.py's dtype rule) and i32. Params are f32 (trainable weights are f32
masters).

Frozen weights may be stored in ggml's block types (f16, bf16, q4_0 .. q6_k: ggwgpu/quant.py):
such tensors are constants (or views of them), never params or op results. Their storage
is the raw blocks, held by the backends as u32 words (`storage_dtype`, `storage_len`).
"f16" means halves in storage either way: a constant made from a `Quantized` f16 value is a
frozen weight that mul_mat and get_rows read through ops/quant.py's kernels (which bind a
weight larger than one storage binding in parts, and which the NumPy backend feeds with
values converted once), while any other f16 tensor is an element-type tensor every op with
an f16 kernel reads.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from .quant import QUANT_TYPES, Quantized, quantize, storage_bytes

MAX_DIMS = 4

# Element types of inputs, params and op results; frozen constants may also be QUANT_TYPES.
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "i32": np.dtype(np.int32)}
FLOAT_DTYPES = ("f32", "f16")
WORD = np.dtype(np.uint32)   # the storage unit of the block types on both backends


class ShapeError(ValueError):
    """An op was given tensors whose shapes or dtypes it cannot take."""


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def check_shape(shape, what="tensor") -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError:
        raise ShapeError(f"{what}: shape must be a sequence of ints, got {shape!r}") from None
    if not 1 <= len(shape) <= MAX_DIMS:
        raise ShapeError(f"{what}: shape {shape} must have 1 to {MAX_DIMS} dims")
    if any(n < 1 for n in shape):
        raise ShapeError(f"{what}: shape {shape} has a dimension < 1")
    return shape


class Tensor:
    """A node of a computation graph.

    Leaves have `op is None`: inputs fed at run time, parameters (`is_param`) and constants
    (`value` set). Other tensors record the op that makes them, its sources and parameters.
    """

    __slots__ = ("shape", "dtype", "strides", "offset", "op", "srcs", "params",
                 "view_src", "name", "value", "is_param", "__weakref__")

    def __init__(self, shape, dtype="f32", *, op=None, srcs=(), params=None, strides=None,
                 offset=0, view_src=None, name=None, value=None, is_param=False):
        self.shape = check_shape(shape, name or op or "tensor")
        if dtype not in DTYPES and dtype not in QUANT_TYPES:
            raise ShapeError(f"{name or op or 'tensor'}: unknown dtype {dtype!r}")
        if dtype in QUANT_TYPES and dtype not in DTYPES and value is None and view_src is None:
            raise ShapeError(f"{name or op or 'tensor'}: {dtype} holds frozen weights: only "
                             f"constants (and views of them) can have it")
        self.dtype = dtype
        self.strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)
        self.offset = int(offset)
        self.op = op
        self.srcs = tuple(srcs)
        self.params = dict(params or {})
        self.view_src = view_src
        self.name = name
        self.value = value
        self.is_param = is_param

    # -- geometry -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nelements(self) -> int:
        return math.prod(self.shape)  # np.prod costs ~30 µs a call; planning asks often

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        """Stored in a block type (ggwgpu.quant.TYPES): raw blocks, read by ops/quant.py.
        An f16 tensor is so only when it is (a view of) a constant with a Quantized value."""
        if self.dtype not in QUANT_TYPES:
            return False
        return self.dtype not in DTYPES or isinstance(self.storage.value, Quantized)

    @property
    def storage_dtype(self) -> np.dtype:
        """The NumPy type a backend holds this tensor's storage in."""
        return WORD if self.is_quantized else DTYPES[self.dtype]

    @property
    def storage_len(self) -> int:
        """Storage units (elements, or u32 words of blocks rounded up) this tensor's values take."""
        if self.is_quantized:
            return -(-storage_bytes(self.dtype, self.nelements) // WORD.itemsize)
        return self.nelements

    @property
    def ne(self) -> tuple[int, int, int, int]:
        """Sizes in ggml order (innermost first), padded to 4 dims."""
        return tuple(reversed(self.shape)) + (1,) * (MAX_DIMS - self.ndim)

    @property
    def nb(self) -> tuple[int, int, int, int]:
        """Strides in elements, ggml order, padded to 4 dims."""
        pad = self.nelements  # any stride works for a size-1 dim
        return tuple(reversed(self.strides)) + (pad,) * (MAX_DIMS - self.ndim)

    def is_contiguous(self) -> bool:
        return all(s == c for s, c, n in zip(self.strides, contiguous_strides(self.shape), self.shape)
                   if n > 1)

    @property
    def storage(self) -> "Tensor":
        """The tensor that owns the storage this one lives in."""
        t = self
        while t.view_src is not None:
            t = t.view_src
        return t

    def layout(self, shape, strides, offset) -> "Tensor":
        """A view of this tensor's storage with another geometry (not a graph node)."""
        return Tensor(shape, self.dtype, op="view", srcs=(self,), strides=strides,
                      offset=offset, view_src=self, name=self.name)

    def __repr__(self):
        what = self.name or self.op or ("param" if self.is_param else "leaf")
        return f"Tensor({what}, shape={self.shape}, {self.dtype})"


def input_tensor(shape, dtype="f32", name=None) -> Tensor:
    """A leaf whose value is given when the graph runs."""
    return Tensor(shape, dtype, name=name)


def param(value, name=None) -> Tensor:
    """A trainable leaf with an initial value; build_backward computes its gradient."""
    if isinstance(value, Quantized):
        raise ShapeError(f"{name or 'param'}: a {value.dtype} weight is frozen; make it a "
                         f"constant() (params are f32)")
    value = np.asarray(value, dtype=np.float32)
    if value.ndim == 0:
        value = value.reshape(1)
    return Tensor(value.shape, "f32", name=name, value=value, is_param=True)


def constant(value, dtype="f32", name=None) -> Tensor:
    """A leaf with a fixed value, uploaded once when a graph is planned.

    A `Quantized` value (ggwgpu.quant) gives a frozen weight of its block type, stored on the
    device as its raw blocks; a float array with a block dtype ("bf16", "q4_1", ...) is
    quantized first. mul_mat and get_rows read such weights directly (ops/quant.py). A float
    array with dtype "f16" gives an element-type f16 constant (its values rounded to halves)."""
    if dtype in QUANT_TYPES and dtype not in DTYPES and not isinstance(value, Quantized):
        value = quantize(value, dtype)
    if isinstance(value, Quantized):
        return Tensor(value.shape, value.dtype, name=name, value=value)
    value = np.asarray(value, dtype=DTYPES[dtype])
    if value.ndim == 0:
        value = value.reshape(1)
    return Tensor(value.shape, dtype, name=name, value=value)


_ZEROS = weakref.WeakValueDictionary()    # shape -> the read-only zeros all such constants hold


def zeros(shape) -> Tensor:
    """An f32 constant of zeros (what a backward scatters a view's gradient into). All of one
    shape hold the same read-only array while any lives, so a backend stores it once
    however many nodes and graphs use it (SharedConstants keys on the value object): a
    128k-vocabulary step's 32 logits chunks made 32 copies of the (rows, n_embd) zeros."""
    shape = tuple(int(n) for n in shape)
    value = _ZEROS.get(shape)
    if value is None:
        value = _ZEROS[shape] = np.zeros(shape, np.float32)
        value.flags.writeable = False
    return constant(value, name="zeros")
