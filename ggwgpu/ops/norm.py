"""Row normalisations over the innermost dim: rms_norm and norm (ggml_norm), each with its
*_back op, and rms_norm_mul, llama's weighted rms_norm fused into one pass. Shader:
shaders/norm.wgsl, one workgroup per row; rms_norm_mul(_back) also have a 'rowwise'
variant, one invocation per row, that the backend picks on CPU adapters (ggwgpu/kernels.py).

    rms_norm(x, eps):        y = x * r,         r = 1 / sqrt(mean(x^2) + eps)
                             dx = r * (dy - y * mean(dy * y))
    norm(x, eps):            y = (x - mean) * s, s = 1 / sqrt(var + eps)
                             dx = s * (dy - mean(dy) - y * mean(dy * y))
    rms_norm_mul(x, w, eps): y = x * r * w       (w tiles x)
                             dx = rms_norm_back(x, dy * w), dw = sum over tiles of dy * x * r

The *_back ops take (x, dy): they recompute y from x instead of storing it.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..kernels import ROW_VARIANTS, row_kernel
from ..tensor import ShapeError
from .elementwise import reduce_to, tiled
from .registry import Case, Dispatch, Input, can_repeat, need_float, register, tile


def norm_shape(srcs, eps):
    need_float(*srcs)
    if any(s.shape != srcs[0].shape for s in srcs):
        raise ShapeError(f"x and dy must have the same shape, got {[s.shape for s in srcs]}")
    if not float(eps) >= 0:
        raise ShapeError(f"eps must be >= 0, got {eps}")
    return srcs[0].shape, "f32", {}


def weighted_shape(srcs, eps):
    """(x, w) or (x, w, dy): w tiles x, dy is shaped like x."""
    x, w = srcs[0], srcs[1]
    need_float(*srcs)
    if not can_repeat(w.shape, x.shape):
        raise ShapeError(f"weight {w.shape} does not tile x {x.shape}")
    return norm_shape((x,) + tuple(srcs[2:]), eps)


def row_dispatch(node, variant="workgroup"):
    """One workgroup per row, or one invocation per row ('rowwise'); eps in p.f.x."""
    x = node.srcs[0]
    rows = x.nelements // x.shape[-1]
    eps = (float(node.params["eps"]),)
    if row_kernel(variant, x.shape[-1]) == "rowwise":
        return [Dispatch(f"{node.op}_rowwise", node, node.srcs, n=rows, f=eps)]
    return [Dispatch(node.op, node, node.srcs, n=rows, workgroups=rows, f=eps)]


def rms_norm_ref(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm_back_ref(x, dy, eps):
    r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x * r
    return r * (dy - y * np.mean(dy * y, axis=-1, keepdims=True))


def rms_norm_mul_ref(x, w, eps):
    return rms_norm_ref(x, eps) * tile(w, x.shape)


def rms_norm_mul_back_ref(x, w, dy, eps):
    return rms_norm_back_ref(x, dy * tile(w, x.shape), eps)


def rms_scale(out, x, eps):
    """1 / sqrt(mean(x^2) + eps) per row, as the references compute it (out: scratch)."""
    np.multiply(x, x, out=out)
    return 1 / np.sqrt(np.mean(out, axis=-1, keepdims=True) + eps)


def rms_norm_mul_into(out, x, w, eps):
    """rms_norm_mul's reference (x / sqrt(mean(x^2) + eps) * w), no temporaries."""
    np.multiply(x, x, out=out)
    np.divide(x, np.sqrt(np.mean(out, axis=-1, keepdims=True) + eps), out=out)
    out *= tiled(w, x.shape)


def rms_norm_mul_back_into(out, x, w, dy, eps):
    """rms_norm_mul_back's reference: r * (dy w - y * mean(dy w * y)), y = x * r."""
    dyw = np.multiply(dy, tiled(w, x.shape))
    r = rms_scale(out, x, eps)
    np.multiply(x, r, out=out)                                   # y
    mean = np.mean(np.multiply(dyw, out), axis=-1, keepdims=True)
    out *= mean
    np.subtract(dyw, out, out=out)
    out *= r


def norm_ref(x, eps):
    c = x - np.mean(x, axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)


def norm_back_ref(x, dy, eps):
    c = x - np.mean(x, axis=-1, keepdims=True)
    s = 1 / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)
    y = c * s
    return s * (dy - np.mean(dy, axis=-1, keepdims=True)
                - y * np.mean(dy * y, axis=-1, keepdims=True))


# x in [-10, 10] as ggml's tests draw it; (3, 4, 67): rows longer than one workgroup and odd.
SHAPES = [((1,), "contiguous", True), ((5, 1, 7), "contiguous", True),
          ((3, 4, 67), "contiguous", True), ((2, 3, 5), "permuted", True),
          ((4, 9), "strided", True), ((2, 3, 4, 5), "contiguous", False)]
# More than 65535 rows: the row grid folds into 2-D. About 0.5 s on lavapipe, so only
# rms_norm carries it; the other kernels index rows the same way (flat_group).
FOLDED = ((70001, 3), "contiguous", False)


def case_eps(shape):
    # A row of one element: dx = dy * eps / (x^2 + eps) * r cancels to ~0 in f32 when
    # eps << x^2 (f32 keeps nothing of 1 - y^2), so that row gets a large eps.
    return {"eps": 0.5 if shape[-1] == 1 else 1e-5}


def forward_cases(folded=False):
    return [Case((Input(shape, -10, 10, layout),), case_eps(shape), grad)
            for shape, layout, grad in SHAPES + [FOLDED] * folded]


def back_cases():
    other = {"contiguous": "contiguous", "permuted": "strided", "strided": "permuted"}
    return [Case((Input(shape, -10, 10, layout), Input(shape, layout=other[layout])),
                 case_eps(shape), grad) for shape, layout, grad in SHAPES]


rms_norm = register(
    "rms_norm", n_srcs=1, params=("eps",), shape=norm_shape, shader="norm",
    reference=rms_norm_ref, dispatches=row_dispatch,
    backward=lambda n, g: (O.rms_norm_back(n.srcs[0], g, n.params["eps"]),),
    cases=lambda: forward_cases(folded=True),
    doc="x / sqrt(mean(x^2) + eps) over the innermost dim, as ggml_rms_norm.")

# Second derivatives are not supported: x takes no gradient; the op is linear in dy, and
# its Jacobian in dy is symmetric, so the gradient w.r.t. dy is the op itself.
rms_norm_back = register(
    "rms_norm_back", n_srcs=2, params=("eps",), shape=norm_shape, shader="norm",
    reference=rms_norm_back_ref, dispatches=row_dispatch, no_grad=(0,),
    backward=lambda n, g: (None, O.rms_norm_back(n.srcs[0], g, n.params["eps"])),
    cases=back_cases,
    doc="The backward of rms_norm: dx from x and dy. Inputs x, dy.")

# Weights: a row (llama), one that also tiles an outer dim, and one of x's own shape (the
# backward's rms_norm_mul(x, dy)), through strided and permuted views.
WEIGHTS = {(1,): (1,), (5, 1, 7): (7,), (3, 4, 67): (67,), (2, 3, 5): (3, 5), (4, 9): (4, 9),
           (2, 3, 4, 5): (5,)}
WEIGHT_LAYOUT = {"contiguous": "contiguous", "permuted": "strided", "strided": "permuted"}


def weighted_cases(with_dy=False):
    cases = []
    for shape, layout, grad in SHAPES:
        inputs = [Input(shape, -10, 10, layout), Input(WEIGHTS[shape], 0.5, 2.0,
                                                       WEIGHT_LAYOUT[layout])]
        if with_dy:
            inputs.append(Input(shape))
        cases.append(Case(tuple(inputs), case_eps(shape), grad))
    return cases


def rms_norm_mul_grads(n, g):
    x, w = n.srcs
    eps = n.params["eps"]
    return O.rms_norm_mul_back(x, w, g, eps), reduce_to(O.rms_norm_mul(x, g, eps), w)


def rms_norm_mul_back_grads(n, g):
    # linear in dy with the symmetric rms_norm_back Jacobian R: d(dy) = w * R g and
    # dw = sum over tiles of dy * R g; x takes no gradient (no second derivatives)
    x, w, dy = n.srcs
    rg = O.rms_norm_back(x, g, n.params["eps"])
    return None, reduce_to(O.mul(dy, rg), w), O.mul(rg, w)


rms_norm_mul = register(
    "rms_norm_mul", n_srcs=2, params=("eps",), shape=weighted_shape, shader="norm",
    reference=rms_norm_mul_ref, fast=rms_norm_mul_into, dispatches=row_dispatch,
    variants=ROW_VARIANTS,
    backward=rms_norm_mul_grads, cases=weighted_cases,
    doc="rms_norm(x, eps) * w in one pass, w tiled to x's shape (llama's weighted norm).")

rms_norm_mul_back = register(
    "rms_norm_mul_back", n_srcs=3, params=("eps",), shape=weighted_shape, shader="norm",
    reference=rms_norm_mul_back_ref, fast=rms_norm_mul_back_into, dispatches=row_dispatch,
    variants=ROW_VARIANTS,
    no_grad=(0,), backward=rms_norm_mul_back_grads, cases=lambda: weighted_cases(with_dy=True),
    doc="dx of rms_norm_mul: rms_norm_back(x, dy * w). Inputs x, w, dy.")

norm = register(
    "norm", n_srcs=1, params=("eps",), shape=norm_shape, shader="norm",
    reference=norm_ref, dispatches=row_dispatch,
    backward=lambda n, g: (O.norm_back(n.srcs[0], g, n.params["eps"]),),
    cases=forward_cases,
    doc="(x - mean) / sqrt(var + eps) over the innermost dim, as ggml_norm (no affine).")

# As rms_norm_back: x takes no gradient, and the (symmetric) op is its own dy-gradient.
norm_back = register(
    "norm_back", n_srcs=2, params=("eps",), shape=norm_shape, shader="norm",
    reference=norm_back_ref, dispatches=row_dispatch, no_grad=(0,),
    backward=lambda n, g: (None, O.norm_back(n.srcs[0], g, n.params["eps"])),
    cases=back_cases,
    doc="The backward of norm: dx from x and dy. Inputs x, dy.")

__all__ = ["rms_norm", "rms_norm_back", "rms_norm_mul", "rms_norm_mul_back", "norm",
           "norm_back"]
