"""Tensors: graph nodes with a shape, a dtype and a place in some storage.

Shapes, strides and offsets are in NumPy order (outermost first) and counted in elements.
ggml counts the other way (ne[0] is the innermost dimension); `Tensor.ne` and `Tensor.nb`
are the one place that converts, for the shaders.

A tensor either owns its storage (leaves and most op results, always contiguous) or is a
view into the storage of `view_src` (view, reshape, permute, transpose, cpy), which makes
views zero-copy: the shaders read any tensor through its strides and offset.
"""
from __future__ import annotations

import numpy as np

MAX_DIMS = 4

# Storage types. f16 and the quantized block types join this table later.
DTYPES = {"f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}


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
        if dtype not in DTYPES:
            raise ShapeError(f"{name or op or 'tensor'}: unknown dtype {dtype!r}")
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
        return int(np.prod(self.shape))

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

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
    value = np.asarray(value, dtype=np.float32)
    if value.ndim == 0:
        value = value.reshape(1)
    return Tensor(value.shape, "f32", name=name, value=value, is_param=True)


def constant(value, dtype="f32", name=None) -> Tensor:
    """A leaf with a fixed value, uploaded once when a graph is planned."""
    value = np.asarray(value, dtype=DTYPES[dtype])
    if value.ndim == 0:
        value = value.reshape(1)
    return Tensor(value.shape, dtype, name=name, value=value)
