"""Rotary position embedding: rope and its backward rope_back (the inverse rotation).

Shader: shaders/rope.wgsl, one entry point for both (p.f.z = +1 forward, -1 backward, as
ggml flips the sign of sin for the backward). Positions are int32 and take no gradient.

Semantics are ggml_rope_ext's with ext_factor 0 and attn_factor 1 (what llama.cpp uses for
llama models without rope scaling): x is (batch, n_tokens, n_head, head_dim), ggml
[head_dim, n_head, n_tokens, batch]; positions (n_tokens,). Pair k < n_dims / 2 of every
head turns by theta_k = pos * freq_scale * freq_base ** (-2k / n_dims):
    (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)
mode "normal" (ggml 0) pairs dims (2k, 2k + 1); "neox" (ggml 2) pairs (k, k + n_dims / 2).
Dims from n_dims on pass through unchanged.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import ShapeError
from .registry import Case, Input, need_f32, register

MODES = {"normal": 0, "neox": 2}  # ggml's mode numbers; the shader takes them in p.u.y
PARAMS = ("n_dims", "mode", "freq_base", "freq_scale")


ROPE_DEFAULTS = {"mode": "normal", "freq_base": 10000.0, "freq_scale": 1.0}


def rope_shape(srcs, n_dims, mode, freq_base, freq_scale):
    x, pos = srcs
    need_f32(x)
    if x.ndim not in (3, 4):
        raise ShapeError(f"x must be ([batch,] n_tokens, n_head, head_dim), has shape {x.shape}")
    if pos.dtype != "i32" or pos.shape != (x.shape[-3],):
        raise ShapeError(f"positions must be i32 of shape ({x.shape[-3]},) (one per token), "
                         f"got {pos.dtype} {pos.shape}")
    if mode not in MODES:
        raise ShapeError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if not (0 < int(n_dims) <= x.shape[-1] and int(n_dims) % 2 == 0):
        raise ShapeError(f"n_dims {n_dims} must be even and in (0, head_dim={x.shape[-1]}]")
    return x.shape, "f32", {}


def rope_ref(x, pos, n_dims, mode, freq_base, freq_scale, sign=1.0):
    """The rotation in float64 angles (then x's dtype); sign -1 turns the other way."""
    half = n_dims // 2
    inv_freq = freq_scale * float(freq_base) ** (-2.0 * np.arange(half) / n_dims)
    theta = pos.astype(np.float64)[:, None] * inv_freq           # (n_tokens, half)
    cos = np.cos(theta)[:, None, :].astype(x.dtype)               # broadcast over heads
    sin = (sign * np.sin(theta))[:, None, :].astype(x.dtype)
    out = np.array(x, copy=True)
    if mode == "normal":
        i0, i1 = np.s_[..., 0:n_dims:2], np.s_[..., 1:n_dims:2]
    else:
        i0, i1 = np.s_[..., :half], np.s_[..., half:n_dims]
    x0, x1 = x[i0], x[i1]
    out[i0] = x0 * cos - x1 * sin
    out[i1] = x0 * sin + x1 * cos
    return out


def uniforms(node, sign):
    p = node.params
    return {"f": (float(p["freq_base"]), float(p["freq_scale"]), sign),
            "u": (int(p["n_dims"]), MODES[p["mode"]])}


def rope_cases():
    def pos(n, hi=2048, layout="contiguous"):
        return Input((n,), 0, hi, layout, "i32")   # random, unsorted, repeats allowed
    def params(n_dims, mode, base=10000.0, scale=1.0):
        return {"n_dims": n_dims, "mode": mode, "freq_base": base, "freq_scale": scale}
    return [
        Case((Input((1, 1, 1, 2)), pos(1, 10)), params(2, "normal")),
        Case((Input((2, 3, 5, 8)), pos(3)), params(8, "normal")),
        Case((Input((2, 3, 5, 8)), pos(3)), params(8, "neox")),
        Case((Input((2, 5, 3, 10)), pos(5)), params(6, "normal", scale=0.25)),   # pass-through
        Case((Input((1, 3, 2, 10), layout="permuted"), pos(3)), params(4, "neox", 500.0)),
        Case((Input((3, 5, 6), layout="strided"), pos(3, layout="strided")),
             params(6, "neox", scale=2.5)),
        Case((Input((7, 3, 12), layout="permuted"), pos(7)), params(8, "normal", 1e6)),
        Case((Input((4, 128, 8, 32)), pos(128)), params(32, "neox"), grad=False),
        Case((Input((2, 200, 6, 48), layout="strided"), pos(200, 4096)),
             params(32, "normal", scale=0.5), grad=False),
    ]


def rope_back_cases():
    return [Case(c.inputs, c.params, c.grad) for c in rope_cases()]


rope = register(
    "rope", n_srcs=2, params=PARAMS, shape=rope_shape, shader="rope",
    reference=rope_ref, uniforms=lambda n: uniforms(n, 1.0), no_grad=(1,),
    backward=lambda n, g: (O.rope_back(g, n.srcs[1], **n.params), None),
    cases=rope_cases, defaults=ROPE_DEFAULTS,
    doc="Rotary position embedding as ggml_rope_ext (ext_factor 0, attn_factor 1):\n"
        "rope(x, positions, n_dims, mode='normal', freq_base=10000, freq_scale=1).\n"
        "x: f32 ([batch,] n_tokens, n_head, head_dim); positions: i32 (n_tokens,). Rotates\n"
        "the first n_dims (even, <= head_dim) dims of every head, pair k by\n"
        "theta_k = pos * freq_scale * freq_base ** (-2k / n_dims); the rest pass through.\n"
        "mode 'normal' (ggml 0) pairs (2k, 2k + 1), 'neox' (ggml 2) pairs (k, k + n_dims/2).")

rope_back = register(
    "rope_back", n_srcs=2, params=PARAMS, shape=rope_shape, shader="rope", entry="rope",
    reference=lambda g, pos, **kw: rope_ref(g, pos, **kw, sign=-1.0),
    uniforms=lambda n: uniforms(n, -1.0), no_grad=(1,),
    backward=lambda n, g: (O.rope(g, n.srcs[1], **n.params), None),
    cases=rope_back_cases, defaults=ROPE_DEFAULTS,
    doc="The backward of rope: the inverse rotation (sin negated).")


__all__ = ["rope", "rope_back"]
