"""Row normalisations over the innermost dim: rms_norm and norm (ggml_norm), each with its
*_back op. Shader: shaders/norm.wgsl, one workgroup per row.

    rms_norm(x, eps):  y = x * r,         r = 1 / sqrt(mean(x^2) + eps)
                       dx = r * (dy - y * mean(dy * y))
    norm(x, eps):      y = (x - mean) * s, s = 1 / sqrt(var + eps)
                       dx = s * (dy - mean(dy) - y * mean(dy * y))

The *_back ops take (x, dy): they recompute y from x instead of storing it.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import ShapeError
from .registry import Case, Dispatch, Input, need_f32, register


def norm_shape(srcs, eps):
    need_f32(*srcs)
    if any(s.shape != srcs[0].shape for s in srcs):
        raise ShapeError(f"x and dy must have the same shape, got {[s.shape for s in srcs]}")
    if not float(eps) >= 0:
        raise ShapeError(f"eps must be >= 0, got {eps}")
    return srcs[0].shape, "f32", {}


def row_dispatch(node):
    """One workgroup per row; eps in p.f.x."""
    x = node.srcs[0]
    rows = x.nelements // x.shape[-1]
    return [Dispatch(node.op, node, node.srcs, n=rows, workgroups=rows,
                     f=(float(node.params["eps"]),))]


def rms_norm_ref(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm_back_ref(x, dy, eps):
    r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x * r
    return r * (dy - y * np.mean(dy * y, axis=-1, keepdims=True))


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

__all__ = ["rms_norm", "rms_norm_back", "norm", "norm_back"]
