"""Reductions and tiling: sum, sum_sqr, add_sum_sqr(3), sum_rows, mean, repeat, repeat_back.

Shader: shaders/reduce.wgsl. Row reductions use one workgroup per row.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import ShapeError, Tensor, check_shape
from .registry import (WORKGROUP, Case, Dispatch, Input, can_repeat, need_float, register, tile,
                       untile)
from .elementwise import LARGE


def reduce_cases(large):
    return [Case((Input((1,)),)), Case((Input((5, 7)),)), Case((Input((3, 4, 70)),)),
            Case((Input((2, 3, 5), layout="permuted"),)), Case((Input((4, 9), layout="strided"),)),
            Case((Input((2, 3, 4, 5)),), grad=False), Case((Input(large),), grad=False)]


def sum_shape(srcs, **_):
    need_float(*srcs)
    return (1,), "f32", {}


def add_sum_sqr_shape(srcs, **_):
    acc, a = srcs
    need_float(acc, a)
    if acc.nelements != 1:
        raise ShapeError(f"the accumulator must have one element, has shape {acc.shape}")
    return (1,), "f32", {}


def rows_shape(srcs, **_):
    need_float(*srcs)
    return srcs[0].shape[:-1] + (1,), "f32", {}


SUM_SPAN = WORKGROUP * 1024  # elements one workgroup of k_sum adds


def sum_into(dst, a, square=False, acc=None) -> list[Dispatch]:
    """Dispatches of k_sum adding all of `a` (squared with `square`) into the one-element
    `dst`, plus the one element of `acc` where given: in two steps past one span (partial
    sums into dispatch-private storage; the second adds them and acc). Other families
    reuse it."""
    flags = (int(square), int(acc is not None))
    tail = () if acc is None else (acc,)
    if a.nelements <= SUM_SPAN:
        return [Dispatch("sum", dst, (a, *tail), n=a.nelements, workgroups=1,
                         u=(SUM_SPAN, *flags), shader="reduce")]
    groups = -(-a.nelements // SUM_SPAN)
    partial = Tensor((groups,), name=f"{dst} partial sums")
    return [Dispatch("sum", partial, (a,), n=a.nelements, workgroups=groups,
                     u=(SUM_SPAN, int(square), 0), shader="reduce"),
            Dispatch("sum", dst, (partial, *tail), n=groups, workgroups=1,
                     u=(SUM_SPAN, 0, flags[1]), shader="reduce")]


def row_dispatch(node, scale):
    a = node.srcs[0]
    rows = a.nelements // a.shape[-1]
    return [Dispatch("sum_rows", node, (a,), n=rows, workgroups=rows, f=(scale,))]


sum = register(
    "sum", n_srcs=1, shape=sum_shape, shader="reduce", result="f32",  # a loss
    reference=lambda a: np.sum(a, dtype=a.dtype).reshape(1),
    dispatches=lambda n: sum_into(n, n.srcs[0]),
    backward=lambda n, g: (O.repeat(g, n.srcs[0].shape),),
    cases=lambda: reduce_cases((LARGE,)), doc="The sum of all elements, shape (1,).")


# The sum of squares of a chain of tensors (the clip's gradient norm, L-BFGS's norms):
# sum_sqr(t0), then add_sum_sqr(acc, t) for each other tensor, one dispatch each (two past
# SUM_SPAN elements) instead of sqr, sum and an add, and no temporary of t's size. Both run
# k_sum; an inf or NaN in t, or a square that overflows f32 (|t| > 1.8e19), makes the result
# one, which the trainer's finite flag relies on.
def sum_sqr_ref(a):
    return np.sum(np.square(a), dtype=a.dtype).reshape(1)


def sumsq_of(a) -> np.ndarray:
    """Sum of a * a by one BLAS dot product: one pass, no temporary (a copy only where a is
    not contiguous)."""
    v = a.reshape(-1)
    return np.dot(v, v)


def sum_sqr_into(out, a):
    out[0] = sumsq_of(a)


def add_sum_sqr_into(out, acc, a):
    out[0] = acc.reshape(-1)[0] + sumsq_of(a)


def sum_sqr_cases(extra=()):
    """reduce_cases with `extra` inputs first (the accumulator), plus a non-finite input."""
    return [Case((*extra, *c.inputs), grad=c.grad) for c in reduce_cases((LARGE,))] + \
        [Case((*extra, Input((6, 11), dist="nonfinite")), grad=False)]


sum_sqr = register(
    "sum_sqr", n_srcs=1, shape=sum_shape, shader="reduce", entry="sum", result="f32",
    reference=sum_sqr_ref, fast=sum_sqr_into,
    dispatches=lambda n: sum_into(n, n.srcs[0], square=True),
    backward=lambda n, g: (O.mul(n.srcs[0], O.scale(g, 2.0)),),
    cases=sum_sqr_cases, doc="The sum of a * a over all elements, shape (1,), in f32.")

add_sum_sqr = register(
    "add_sum_sqr", n_srcs=2, shape=add_sum_sqr_shape, shader="reduce", entry="sum",
    result="f32",
    reference=lambda acc, a: acc.reshape(1) + sum_sqr_ref(a), fast=add_sum_sqr_into,
    # the dispatch binds a first: k_sum sums its source 0 and adds source 1's element
    dispatches=lambda n: sum_into(n, n.srcs[1], square=True, acc=n.srcs[0]),
    backward=lambda n, g: (g if n.srcs[0].shape == g.shape else O.reshape(g, n.srcs[0].shape),
                           O.mul(n.srcs[1], O.scale(g, 2.0))),
    cases=lambda: sum_sqr_cases((Input((1,)),)) + [Case((Input((1, 1)), Input((5, 7))))],
    doc="acc + the sum of a * a over all elements, shape (1,), in f32: acc has one element. "
        "A chain of them sums the squares of many tensors, one dispatch each.")


def add_sum_sqr3_shape(srcs, **_):
    acc = srcs[0]
    need_float(*srcs)
    if acc.nelements != 1:
        raise ShapeError(f"the accumulator must have one element, has shape {acc.shape}")
    for t in srcs[1:]:
        if t.nelements > SUM_SPAN:
            raise ShapeError(f"add_sum_sqr3 adds tensors of at most {SUM_SPAN} elements, "
                             f"got {t.shape}")
    return (1,), "f32", {}


def add_sum_sqr3_into(out, acc, a, b, c):
    out[0] = acc.reshape(-1)[0] + sumsq_of(a) + sumsq_of(b) + sumsq_of(c)


add_sum_sqr3 = register(
    "add_sum_sqr3", n_srcs=4, shape=add_sum_sqr3_shape, shader="reduce", entry="sum_sqr3",
    result="f32",
    reference=lambda acc, a, b, c: (acc.reshape(1) + sum_sqr_ref(a) + sum_sqr_ref(b)
                                    + sum_sqr_ref(c)),
    fast=add_sum_sqr3_into,
    # the tensors are sources 0 .. 2, the accumulator source 3
    dispatches=lambda n: [Dispatch("sum_sqr3", n, (*n.srcs[1:], n.srcs[0]), n=1,
                                   workgroups=1)],
    backward=lambda n, g: (g if n.srcs[0].shape == g.shape else O.reshape(g, n.srcs[0].shape),
                           *(O.mul(t, O.scale(g, 2.0)) for t in n.srcs[1:])),
    cases=lambda: [Case((Input((1,)), Input((5, 7)), Input((3,)), Input((2, 3, 4)))),
                   Case((Input((1, 1)), Input((2, 3, 5), layout="permuted"),
                         Input((4, 9), layout="strided"), Input((1,)))),
                   Case((Input((1,)), Input((SUM_SPAN,)), Input((7, 3)), Input((SUM_SPAN,))),
                        grad=False),
                   Case((Input((1,)), Input((6, 11)), Input((4,), dist="nonfinite"),
                         Input((2,))), grad=False)],
    doc="acc + the sums of a * a, b * b and c * c over all their elements, shape (1,), in "
        "f32, in one dispatch: acc has one element, a, b and c at most SUM_SPAN each (a chain "
        "of small tensors' squares, three at a time).")


def sum_of_squares(tensors) -> Tensor:
    """The sum of the squares of every element of `tensors` (at least one), shape (1,), f32.
    Each item is a tensor, or a list of tensors (one block's gradients) whose small ones (at
    most SUM_SPAN elements: a LoRA's pairs) are added three at a time (add_sum_sqr3); every
    other tensor is added alone (add_sum_sqr), after sum_sqr of the very first. Grouped by
    block, a step's dispatches grow by the same count with every block."""
    groups = [[t] if isinstance(t, Tensor) else list(t) for t in tensors]
    first = next((group for group in groups if group), None)
    if first is None:
        raise ValueError("sum_of_squares needs at least one tensor")
    total = sum_sqr(first.pop(0))
    for group in groups:
        small = [t for t in group if t.nelements <= SUM_SPAN]
        threes = len(small) // 3 * 3
        for at in range(0, threes, 3):
            total = add_sum_sqr3(total, *small[at:at + 3])
        for t in small[threes:] + [t for t in group if t.nelements > SUM_SPAN]:
            total = add_sum_sqr(total, t)
    return total


sum_rows = register(
    "sum_rows", n_srcs=1, shape=rows_shape, shader="reduce",
    reference=lambda a: np.sum(a, axis=-1, keepdims=True, dtype=a.dtype),
    dispatches=lambda n: row_dispatch(n, 1.0),
    backward=lambda n, g: (O.repeat(g, n.srcs[0].shape),),
    cases=lambda: reduce_cases((3, 70001)), doc="Sum over the innermost dim; that dim becomes 1.")

mean = register(
    "mean", n_srcs=1, shape=rows_shape, shader="reduce", entry="sum_rows",
    reference=lambda a: np.mean(a, axis=-1, keepdims=True, dtype=a.dtype),
    dispatches=lambda n: row_dispatch(n, 1.0 / n.srcs[0].shape[-1]),
    backward=lambda n, g: (O.repeat(O.scale(g, 1.0 / n.srcs[0].shape[-1]), n.srcs[0].shape),),
    cases=lambda: reduce_cases((70001, 3)), doc="Mean over the innermost dim (as ggml_mean); that dim becomes 1.")


def repeat_shape(srcs, shape):
    need_float(*srcs)
    shape = check_shape(shape, "target")
    if not can_repeat(srcs[0].shape, shape):
        raise ShapeError(f"cannot tile {srcs[0].shape} to {shape}")
    return shape, "f32", {}


def repeat_back_shape(srcs, shape):
    need_float(*srcs)
    shape = check_shape(shape, "target")
    if not can_repeat(shape, srcs[0].shape):
        raise ShapeError(f"{shape} does not tile {srcs[0].shape}")
    return shape, "f32", {}


repeat = register(
    "repeat", n_srcs=1, params=("shape",), shape=repeat_shape, shader="reduce",
    f16_nmse=0.0,  # exact: copies halves
    reference=lambda a, shape: tile(a, shape),
    backward=lambda n, g: (O.repeat_back(g, n.srcs[0].shape),),
    cases=lambda: [Case((Input((1,)),), {"shape": (3,)}),
                   Case((Input((1, 7)),), {"shape": (5, 7)}),
                   Case((Input((2, 3)),), {"shape": (2, 4, 6)}),
                   Case((Input((3, 2), layout="permuted"),), {"shape": (2, 3, 6, 4)}),
                   Case((Input((2, 5), layout="strided"),), {"shape": (4, 15)}),
                   Case((Input((1,)),), {"shape": (LARGE,)}, grad=False)],
    doc="Tile a to `shape` (every dim a multiple of a's), as ggml_repeat.")

repeat_back = register(
    "repeat_back", n_srcs=1, params=("shape",), shape=repeat_back_shape, shader="reduce",
    reference=lambda a, shape: untile(a, shape),
    backward=lambda n, g: (O.repeat(g, n.srcs[0].shape),),
    cases=lambda: [Case((Input((3,)),), {"shape": (1,)}),
                   Case((Input((5, 7)),), {"shape": (1, 7)}),
                   Case((Input((2, 4, 6)),), {"shape": (2, 3)}),
                   Case((Input((2, 3, 6, 4), layout="permuted"),), {"shape": (3, 2)}),
                   Case((Input((4, 15), layout="strided"),), {"shape": (2, 5)}),
                   Case((Input((300, 7)),), {"shape": (1, 7)}, grad=False)],
    doc="Sum the tiles of a into `shape`: the backward of repeat.")

__all__ = ["sum", "sum_sqr", "add_sum_sqr", "add_sum_sqr3", "sum_of_squares", "sum_rows",
           "mean", "repeat", "repeat_back"]
