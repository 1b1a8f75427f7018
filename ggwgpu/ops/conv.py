"""The causal depthwise convolution of a short-convolution block (LFM2; ggml's SSM_CONV with a
fresh state) and its two backward ops.

    ssm_conv(x, w, pos)          x [.., T, C], w [C, L], pos i32 [T] or [.., T] -> like x
        y[.., t, c] = sum_j w[c, j] * x[.., t - d_j, c]   for the taps with t >= d_j and
                                                            pos[.., t] >= d_j, d_j = L - 1 - j
    ssm_conv_back_x(g, w, pos)   the gradient w.r.t. x: g like y -> like x
        dx[.., s, c] = sum_j w[c, j] * g[.., s + d_j, c]  over the same taps
    ssm_conv_back_w(x, g, pos)   the gradient w.r.t. w -> [C, L]
        dw[c, j] = sum_{.., t} g[.., t, c] * x[.., t - d_j, c]  over the same taps

pos is each token's position in its sequence (the rope positions of a packed row): a tap
reaches back no further than the sequence's first token, so sequences packed in one row do
not see each other (llama.cpp runs each sequence from a zero state). The three ops are
linear in each float operand and each other's adjoints, so their backward rules close
among them. Shader: shaders/conv.wgsl.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..kernels import SUM_ROWS_MAX
from ..tensor import ShapeError
from .registry import Case, Dispatch, Input, need_float, register


def check_pos(x, pos):
    if x.ndim < 2:
        raise ShapeError(f"x must be [.., T, C], got {x.shape}")
    if pos.dtype != "i32" or pos.shape not in (x.shape[-2:-1], x.shape[:-1]):
        raise ShapeError(f"pos must be i32 of shape {x.shape[-2:-1]} or {x.shape[:-1]} (a "
                         f"position a token), got {pos.dtype} {pos.shape}")


def conv_shape(srcs):
    x, w, pos = srcs
    need_float(x, w)
    check_pos(x, pos)
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ShapeError(f"w must be [C, L] with x's C = {x.shape[-1]}, got {w.shape}")
    return x.shape, x.dtype


def taps(x_shape, length, pos):
    """(lag d_j, mask [.., T, 1]) of each tap j: where it reaches a token of the sequence."""
    t = np.arange(x_shape[-2])
    pos = np.broadcast_to(pos, x_shape[:-1])
    return [(length - 1 - j, ((pos >= length - 1 - j) & (t >= length - 1 - j))[..., None])
            for j in range(length)]


def shifted(a, d):
    """a moved d tokens later along its token dim (zeros first): out[.., t] = a[.., t - d]."""
    out = np.zeros_like(a)
    if d < a.shape[-2]:
        out[..., d:, :] = a[..., :a.shape[-2] - d, :]
    return out


def conv_ref(x, w, pos):
    return sum(shifted(x, d) * m * w[:, j] for j, (d, m) in enumerate(taps(x.shape, w.shape[1],
                                                                         pos)))


def back_x_ref(g, w, pos):
    out = np.zeros_like(g)
    for j, (d, m) in enumerate(taps(g.shape, w.shape[1], pos)):
        moved = g * m * w[:, j]                     # at t, for x at t - d
        if d < g.shape[-2]:
            out[..., :g.shape[-2] - d, :] += moved[..., d:, :]
    return out


def back_w_ref(x, g, pos, length):
    rows = lambda a: a.reshape(-1, a.shape[-1])     # noqa: E731
    return np.stack([(rows(g * m) * rows(shifted(x, d))).sum(0)
                     for d, m in taps(x.shape, length, pos)], axis=1)


def uniforms(n):
    pos = n.srcs[2]
    return {"u": (int(pos.ndim == 1),)}    # pos shared by every row of tokens


def back_w_shape(srcs, length):
    x, g, pos = srcs
    need_float(x, g)
    check_pos(x, pos)
    if g.shape != x.shape:
        raise ShapeError(f"g {g.shape} must have x's shape {x.shape}")
    if int(length) < 1:
        raise ShapeError(f"length {length} must be at least 1")
    return (x.shape[-1], int(length)), x.dtype


def back_w_dispatch(n):
    """One invocation per (c, j); the tokens summed in parts of SUM_ROWS_MAX, each part after
    the first adding to dst (an invocation's loop is bounded on lavapipe: kernels.py)."""
    x = n.srcs[0]
    rows = x.nelements // x.shape[-1]
    return [Dispatch("ssm_conv_back_w", n, n.srcs, n=n.nelements,
                     u=(int(n.srcs[2].ndim == 1), lo, min(rows, lo + SUM_ROWS_MAX), int(lo > 0)))
            for lo in range(0, rows, SUM_ROWS_MAX)]


def positions(t, hi=None, lead=()):
    return Input((*lead, t), 0, hi or t, "contiguous", "i32")


def conv_cases():
    """(x or g, w, pos) cases."""
    return [
        Case((Input((5, 3)), Input((3, 2)), positions(5))),
        Case((Input((2, 7, 4)), Input((4, 3)), positions(7))),
        Case((Input((2, 6, 5)), Input((5, 4)), positions(6, 3, (2,)))),   # packed: restarts
        Case((Input((3, 5, 4), layout="permuted"), Input((4, 3), layout="strided"),
              positions(5))),
        Case((Input((1, 9, 2, 6)), Input((6, 3)), positions(2, 9, (1, 9)))),
        Case((Input((4, 130, 33)), Input((33, 3)), positions(130, 60, (4,))), grad=False)]


def back_w_cases():
    return [Case((c.inputs[0], c.inputs[0], c.inputs[2]), {"length": c.inputs[1].shape[1]},
                 c.grad) for c in conv_cases()] + [
        Case((Input((2, SUM_ROWS_MAX // 2 + 7, 3)), Input((2, SUM_ROWS_MAX // 2 + 7, 3)),
              positions(SUM_ROWS_MAX // 2 + 7, 64, (2,))), {"length": 3}, grad=False)]


ssm_conv = register(
    "ssm_conv", n_srcs=3, shape=lambda srcs: (*conv_shape(srcs), {}), shader="conv",
    reference=conv_ref, uniforms=uniforms, no_grad=(2,),
    backward=lambda n, g: (O.ssm_conv_back_x(g, n.srcs[1], n.srcs[2]),
                           O.ssm_conv_back_w(n.srcs[0], g, n.srcs[2], n.srcs[1].shape[1]), None),
    cases=conv_cases,
    doc="The causal depthwise convolution of each channel of x [.., T, C] with w [C, L] over "
        "the taps within each token's sequence (pos, i32): ggml_ssm_conv from a zero state.")

ssm_conv_back_x = register(
    "ssm_conv_back_x", n_srcs=3, shape=lambda srcs: (*conv_shape(srcs), {}), shader="conv",
    reference=back_x_ref, uniforms=uniforms, no_grad=(2,),
    backward=lambda n, g: (O.ssm_conv(g, n.srcs[1], n.srcs[2]),
                           O.ssm_conv_back_w(g, n.srcs[0], n.srcs[2], n.srcs[1].shape[1]), None),
    cases=conv_cases,
    doc="The gradient of ssm_conv w.r.t. x: g [.., T, C], w [C, L], pos -> like g.")

ssm_conv_back_w = register(
    "ssm_conv_back_w", n_srcs=3, params=("length",), shape=lambda srcs, length: (
        *back_w_shape(srcs, length), {}), shader="conv",
    reference=back_w_ref, dispatches=back_w_dispatch, no_grad=(2,),
    backward=lambda n, g: (O.ssm_conv_back_x(n.srcs[1], g, n.srcs[2]),
                           O.ssm_conv(n.srcs[0], g, n.srcs[2]), None),
    cases=back_w_cases,
    doc="The gradient of ssm_conv w.r.t. w: x, g [.., T, C], pos -> [C, length], summed over "
        "every token.")

__all__ = ["ssm_conv", "ssm_conv_back_x", "ssm_conv_back_w"]
