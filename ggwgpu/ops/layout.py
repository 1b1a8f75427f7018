"""Layout ops. view, reshape, permute and transpose are zero-copy (no dispatch: the result
shares its source's storage); cont and cpy materialise; acc adds into a view of a copy;
concat joins two tensors along a dim;
cast is a contiguous copy into another element type (cpy with a type change, as ggml_cast),
and cpy into a tensor of another type converts the same way.

Shader: shaders/layout.wgsl (cpy, acc).
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import FLOAT_DTYPES, ShapeError, check_shape, zeros
from .registry import Case, Dispatch, Input, need_float, register
from .elementwise import LARGE


def storage_view(a: np.ndarray, shape, strides, offset) -> np.ndarray:
    """Elements of contiguous `a` at offset + sum(index * strides), as a writable view."""
    flat = a.reshape(-1)
    return np.lib.stride_tricks.as_strided(flat[offset:], shape,
                                           [s * a.itemsize for s in strides])


def check_view_fits(shape, strides, offset, size, what):
    if len(strides) != len(shape) or any(int(s) < 0 for s in strides) or offset < 0:
        raise ShapeError(f"{what}: strides {tuple(strides)} / offset {offset} invalid "
                         f"for shape {shape}")
    last = offset + sum((n - 1) * int(s) for n, s in zip(shape, strides))
    if last >= size:
        raise ShapeError(f"{what} of shape {shape}, strides {tuple(strides)}, offset {offset} "
                         f"reaches element {last} of only {size}")


def reshape_any(t, shape):
    """reshape, making `t` contiguous first when it is a strided view."""
    if t.shape == tuple(shape):
        return t
    return O.reshape(t if t.is_contiguous() else O.cont(t), shape)


# -- zero-copy views -------------------------------------------------------------------------

def view_shape(srcs, shape, strides, offset):
    (a,) = srcs
    shape = check_shape(shape, "view")
    check_view_fits(shape, strides, a.offset + offset, a.storage.nelements, "view")
    return shape, a.dtype, {"strides": tuple(int(s) for s in strides),
                            "offset": a.offset + offset, "view_src": a}


def view_backward(node, g):
    a = node.srcs[0]
    if not a.is_contiguous():
        raise ShapeError(f"view of non-contiguous {a.shape}: gradient needs a contiguous source")
    return (O.acc(zeros(a.shape), g, node.params["strides"], node.params["offset"]),)


view = register(
    "view", n_srcs=1, params=("shape", "strides", "offset"), shape=view_shape,
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a, shape, strides, offset: storage_view(
        np.ascontiguousarray(a), shape, strides, offset).copy(),
    backward=view_backward,
    cases=lambda: [Case((Input((6, 8)),), {"shape": (3, 4), "strides": (8, 1), "offset": 9}),
                   Case((Input((6, 8)),), {"shape": (2, 3, 2), "strides": (16, 2, 8),
                                           "offset": 9}),
                   Case((Input((7,)),), {"shape": (1,), "strides": (1,), "offset": 6})],
    doc="A view of a's storage: shape, strides and offset in elements, relative to a "
        "(as ggml_view_*; zero-copy).")


def reshape_shape(srcs, shape):
    (a,) = srcs
    shape = check_shape(shape, "reshape")
    if int(np.prod(shape)) != a.nelements:
        raise ShapeError(f"cannot reshape {a.shape} to {shape}")
    if not a.is_contiguous():
        raise ShapeError(f"reshape needs a contiguous tensor (use cont first), got strides "
                         f"{a.strides}")
    return shape, a.dtype, {"offset": a.offset, "view_src": a}


reshape = register(
    "reshape", n_srcs=1, params=("shape",), shape=reshape_shape,
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a, shape: a.reshape(shape),
    backward=lambda n, g: (reshape_any(g, n.srcs[0].shape),),
    cases=lambda: [Case((Input((5, 6)),), {"shape": (3, 10)}),
                   Case((Input((2, 3, 4)),), {"shape": (24,)}),
                   Case((Input((1,)),), {"shape": (1, 1, 1, 1)})],
    doc="The same elements in a new shape; a must be contiguous (zero-copy).")


def permute_shape(srcs, axes):
    (a,) = srcs
    axes = tuple(int(x) for x in axes)
    if sorted(axes) != list(range(a.ndim)):
        raise ShapeError(f"axes {axes} are not a permutation of {a.ndim} dims")
    return (tuple(a.shape[x] for x in axes), a.dtype,
            {"strides": tuple(a.strides[x] for x in axes), "offset": a.offset, "view_src": a})


permute = register(
    "permute", n_srcs=1, params=("axes",), shape=permute_shape,
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a, axes: np.transpose(a, axes),
    backward=lambda n, g: (O.permute(g, tuple(np.argsort(n.params["axes"]))),),
    cases=lambda: [Case((Input((2, 3, 4, 5)),), {"axes": (2, 0, 3, 1)}),
                   Case((Input((3, 4), layout="permuted"),), {"axes": (1, 0)}),
                   Case((Input((3, 4, 5), layout="strided"),), {"axes": (1, 2, 0)})],
    doc="Reorder dims as numpy.transpose(a, axes) (zero-copy).")


def transpose_shape(srcs):
    (a,) = srcs
    if a.ndim < 2:
        raise ShapeError("transpose needs at least 2 dims")
    axes = list(range(a.ndim))
    axes[-2:] = axes[-1], axes[-2]
    return permute_shape(srcs, axes)


transpose = register(
    "transpose", n_srcs=1, shape=transpose_shape,
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a: np.swapaxes(a, -1, -2),
    backward=lambda n, g: (O.transpose(g),),
    cases=lambda: [Case((Input((5, 7)),)), Case((Input((2, 3, 4), layout="strided"),)),
                   Case((Input((1, 1)),))],
    doc="Swap the two innermost dims (zero-copy).")


# -- copies --------------------------------------------------------------------------------

def copy_dispatch(node):
    return [Dispatch("cpy", node, node.srcs[:1], n=node.nelements)]


def cont_shape(srcs):
    need_float(*srcs)
    return srcs[0].shape, srcs[0].dtype, {}


cont = register(
    "cont", n_srcs=1, shape=cont_shape, shader="layout", entry="cpy", dispatches=copy_dispatch,
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a: np.ascontiguousarray(a).copy(),
    fast=lambda out, a: np.copyto(out, a),
    backward=lambda n, g: (g,),
    cases=lambda: [Case((Input((3, 4, 5), layout="permuted"),)),
                   Case((Input((4, 9), layout="strided"),)), Case((Input((1,)),)),
                   Case((Input((LARGE,)),), grad=False)],
    doc="A contiguous copy of a.")


detach = register(
    "detach", n_srcs=1, shape=cont_shape, shader="layout", entry="cpy",
    dispatches=copy_dispatch,
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a: np.ascontiguousarray(a).copy(),
    fast=lambda out, a: np.copyto(out, a),
    backward=lambda n, g: (None,),
    # its backward is zero by definition, which finite differences would contradict
    cases=lambda: [Case((Input((3, 4), layout="permuted"),), grad=False),
                   Case((Input((1,)),), grad=False)],
    doc="A contiguous copy of a that passes no gradient back (torch's detach): a value "
        "a loss uses as a constant, as KTO's KL estimate.")


def cpy_shape(srcs):
    a, b = srcs
    need_float(a, b)
    if a.nelements != b.nelements:
        raise ShapeError(f"cannot copy {a.nelements} elements into {b.nelements}")
    return b.shape, b.dtype, {"strides": b.strides, "offset": b.offset, "view_src": b}


cpy = register(
    "cpy", n_srcs=2, shape=cpy_shape, shader="layout", dispatches=copy_dispatch,
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a, b: a.reshape(b.shape).copy(),
    fast=lambda out, a, b: np.copyto(out, a.reshape(out.shape)),
    backward=lambda n, g: (reshape_any(g, n.srcs[0].shape), None),
    cases=lambda: [Case((Input((3, 4), layout="permuted"), Input((4, 3)))),
                   Case((Input((12,)), Input((2, 6), layout="strided"))),
                   Case((Input((1,)), Input((1, 1)))),
                   Case((Input((LARGE,)), Input((LARGE,))), grad=False)],
    doc="Write a's elements (in order) into b's storage; the result is a view of b, "
        "as ggml_cpy. Runs where the graph orders it: read b before it only through it.")


def concat_shape(srcs, dim):
    a, b = srcs
    need_float(a, b)
    if a.dtype != b.dtype or a.ndim != b.ndim or not -a.ndim <= dim < a.ndim or \
            any(n != m for d, (n, m) in enumerate(zip(a.shape, b.shape)) if d != dim % a.ndim):
        raise ShapeError(f"cannot concatenate {a.shape} {a.dtype} and {b.shape} {b.dtype} "
                         f"along dim {dim}")
    shape = list(a.shape)
    shape[dim % a.ndim] += b.shape[dim % a.ndim]
    return tuple(shape), a.dtype, {}


def concat_parts(node) -> list[tuple[tuple, tuple, int]]:
    """(shape, strides, offset) of each source's place in the contiguous result."""
    shape, dim = node.shape, node.params["dim"] % len(node.shape)
    strides = tuple(int(np.prod(shape[d + 1:])) for d in range(len(shape)))
    a = node.srcs[0].shape
    return [(a, strides, 0), (node.srcs[1].shape, strides, a[dim] * strides[dim])]


def concat_backward(node, g):
    g = g if g.is_contiguous() else O.cont(g)
    return tuple(O.view(g, *part) for part in concat_parts(node))


concat = register(
    "concat", n_srcs=2, params=("dim",), shape=concat_shape, shader="layout", entry="cpy",
    dispatches=lambda n: [Dispatch("cpy", n.layout(*part), (src,), n=src.nelements)
                          for part, src in zip(concat_parts(n), n.srcs)],
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a, b, dim: np.concatenate([a, b], axis=dim),
    fast=lambda out, a, b, dim: np.concatenate([a, b], axis=dim, out=out),
    backward=concat_backward,
    cases=lambda: [Case((Input((2, 3, 4)), Input((2, 5, 4))), {"dim": 1}),
                   Case((Input((3, 4), layout="permuted"), Input((2, 4), layout="strided")),
                        {"dim": 0}),
                   Case((Input((2, 3)), Input((2, 1))), {"dim": -1}),
                   Case((Input((1,)), Input((LARGE,))), {"dim": 0}, grad=False)],
    doc="a and b joined along dim (their other dims equal), as ggml_concat; the gradient "
        "is the result's gradient cut back into the two parts.")


def cast_shape(srcs, dtype):
    (a,) = srcs
    need_float(a)
    if dtype not in FLOAT_DTYPES:
        raise ShapeError(f"casts to one of {', '.join(FLOAT_DTYPES)}, not {dtype!r}")
    return a.shape, dtype, {}


def cast_cases():
    return [Case((Input(shape, -3.0, 3.0, layout),), {"dtype": dtype})
            for dtype in FLOAT_DTYPES
            for shape, layout in (((1,), "contiguous"), ((5, 7), "contiguous"),
                                  ((3, 4, 5), "permuted"), ((4, 9), "strided"))] + \
        [Case((Input((LARGE,)),), {"dtype": "f16"}, grad=False)]


cast = register(
    "cast", n_srcs=1, params=("dtype",), shape=cast_shape, shader="layout", entry="cpy",
    dispatches=copy_dispatch, result="own",
    # the rounding happens where the value is stored: float16 storage on the NumPy backend
    reference=lambda a, dtype: np.ascontiguousarray(a).copy(),
    backward=lambda n, g: (O.cast(g, n.srcs[0].dtype),),
    cases=cast_cases,
    doc="A contiguous copy of a as dtype 'f32' or 'f16' (ggml_cast). To f16: IEEE "
        "round-to-nearest-even, magnitudes from 65520 up become +-inf (the overflow is "
        "placed explicitly in the kernel, where WGSL leaves it to the implementation; "
        "the in-range rounding is the adapter's: to nearest even on lavapipe). The gradient "
        "is cast back to a's dtype.")


def acc_shape(srcs, strides, offset):
    a, b = srcs
    need_float(a, b)
    check_view_fits(b.shape, strides, offset, a.nelements, "acc view")
    return a.shape, a.dtype, {}


def acc_ref(a, b, strides, offset):
    out = np.ascontiguousarray(a).copy()
    storage_view(out, b.shape, strides, offset)[...] += b
    return out


acc = register(
    "acc", n_srcs=2, params=("strides", "offset"), shape=acc_shape, shader="layout",
    reference=acc_ref,
    dispatches=lambda n: [
        Dispatch("cpy", n, n.srcs[:1], n=n.nelements),
        Dispatch("acc", n.layout(n.srcs[1].shape, n.params["strides"],
                                 n.offset + n.params["offset"]), n.srcs[1:],
                 n=n.srcs[1].nelements)],
    backward=lambda n, g: (g, O.view(g if g.is_contiguous() else O.cont(g), n.srcs[1].shape,
                                     n.params["strides"], n.params["offset"])),
    cases=lambda: [Case((Input((5, 7)), Input((2, 3))), {"strides": (7, 1), "offset": 8}),
                   Case((Input((4, 6), layout="permuted"), Input((3, 2), layout="strided")),
                        {"strides": (1, 6), "offset": 2}),
                   Case((Input((1,)), Input((1,))), {"strides": (1,), "offset": 0})],
    doc="A copy of a with b added into its view (strides, offset in elements, non-"
        "overlapping): the backward of view.")

def diag_shape(srcs):
    (a,) = srcs
    need_float(a)
    if a.ndim > 1 and a.shape[-2] != 1:
        raise ShapeError(f"diag takes rows: shape (n,) or (.., 1, n), got {a.shape}")
    n = a.shape[-1]
    return (a.shape[:-2] if a.ndim > 1 else ()) + (n, n), "f32", {}


def diag_ref(a):
    n = a.shape[-1]
    return a.reshape(a.shape[:-2] + (1, n) if a.ndim > 1 else (1, n)) * np.eye(n, dtype=a.dtype)


def diag_backward(node, g):
    """The gradient of the row is the diagonal of g: a strided view, step n + 1."""
    a = node.srcs[0]
    g = g if g.is_contiguous() else O.cont(g)
    n = a.shape[-1]
    strides = g.strides[:-2] + (n * n, n + 1) if a.ndim > 1 else (n + 1,)
    return (O.view(g, a.shape, strides, 0),)


diag = register(
    "diag", n_srcs=1, shape=diag_shape, shader="layout", reference=diag_ref,
    f16_nmse=0.0,  # exact: copies halves
    backward=diag_backward,
    cases=lambda: [Case((Input((1,)),)), Case((Input((7,)),)), Case((Input((1, 5)),)),
                   Case((Input((2, 3, 1, 4), layout="strided"),)),
                   Case((Input((3, 1, 6), layout="permuted"),)),
                   Case((Input((1, 130)),), grad=False)],
    doc="A row (n,) or (.., 1, n) as a diagonal matrix (.., n, n), as ggml_diag.")

__all__ = ["view", "reshape", "permute", "transpose", "cont", "detach", "cpy", "cast", "acc",
           "concat", "diag",
           "reshape_any"]
