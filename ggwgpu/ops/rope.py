"""Rotary position embedding: rope and its backward rope_back (the inverse rotation), and
rope_ff / rope_ff_back, the same with per-pair frequency factors (Llama 3's rope_freqs).

Shader: shaders/rope.wgsl, one body for all four (p.f.z's sign +1 forward, -1 backward, as
ggml flips the sign of sin for the backward; the rope_ff entry point also reads the
factors). Positions are int32 and factors a fixed table: neither takes a gradient.

Semantics are ggml_rope_ext's: x is (batch, n_tokens, n_head, head_dim), ggml [head_dim,
n_head, n_tokens, batch]; positions (n_tokens,). Pair k < n_dims / 2 of every head turns by
    theta_k = pos * freq_scale * freq_base ** (-2k / n_dims) / factor_k
(factor_k = 1 without factors; ggml_rope_ext's third source), and is scaled by m:
    (x0, x1) -> m (x0 cos - x1 sin, x0 sin + x1 cos)
mode "normal" (ggml 0) pairs dims (2k, 2k + 1); "neox" (ggml 2) pairs (k, k + n_dims / 2).
Dims from n_dims on pass through unchanged. m is attn_factor. With ext_factor r != 0 this is
YaRN (rope_yarn in ggml): pairs below the ramp [lo, hi] (yarn_corr_dims: the pairs that turn
more than beta_fast times within n_ctx_orig positions, up to those that turn less than
beta_slow times) keep more of their unscaled angle,
    theta_k = theta_k * (1 - r_k) + theta_k / freq_scale * r_k,
    r_k = r * (1 - clamp((k - lo) / max(0.001, hi - lo), 0, 1)),
and m = attn_factor * (1 + 0.1 ln(1 / freq_scale)). llama.cpp calls it with ext_factor 1 for
its "yarn" files, 0 for the others.

Two op pairs rather than an optional source: an op has a fixed number of sources, and
plain rope (every model without rope_freqs) keeps reading nothing but x and positions.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops as O
from ..tensor import FLOAT_DTYPES, ShapeError
from .registry import Case, Input, need_float, register

MODES = {"normal": 0, "neox": 2}  # ggml's mode numbers; the shader takes them in p.u.y
# ggml_rope_ext's, in its order but for n_ctx_orig (last here: callers without YaRN omit it)
PARAMS = ("n_dims", "mode", "freq_base", "freq_scale", "ext_factor", "attn_factor",
          "beta_fast", "beta_slow", "n_ctx_orig")
YARN_DEFAULTS = {"ext_factor": 0.0, "attn_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "n_ctx_orig": 0}
ROPE_DEFAULTS = {"mode": "normal", "freq_base": 10000.0, "freq_scale": 1.0, **YARN_DEFAULTS}


def yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow) -> tuple[int, int]:
    """ggml_rope_yarn_corr_dims: the pairs where YaRN's ramp starts and ends, the pair that
    turns beta_fast times over n_ctx_orig positions (rounded down) and the one that turns
    beta_slow times (rounded up), within [0, n_dims - 1]."""
    def pair(turns):
        return n_dims * math.log(n_ctx_orig / (turns * 2 * math.pi)) / (2 * math.log(freq_base))
    return max(0, math.floor(pair(beta_fast))), min(n_dims - 1, math.ceil(pair(beta_slow)))


def magnitude(freq_scale, ext_factor, attn_factor) -> float:
    """m, what cos and sin are multiplied by (rope_yarn's mscale)."""
    if ext_factor == 0:
        return float(attn_factor)
    return float(attn_factor) * (1.0 + 0.1 * math.log(1.0 / freq_scale))


def rope_shape(srcs, n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor, beta_fast,
               beta_slow, n_ctx_orig):
    x, pos = srcs[:2]
    need_float(x)
    if x.ndim not in (3, 4):
        raise ShapeError(f"x must be ([batch,] n_tokens, n_head, head_dim), has shape {x.shape}")
    if pos.dtype != "i32" or pos.shape != (x.shape[-3],):
        raise ShapeError(f"positions must be i32 of shape ({x.shape[-3]},) (one per token), "
                         f"got {pos.dtype} {pos.shape}")
    if mode not in MODES:
        raise ShapeError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if not (0 < int(n_dims) <= x.shape[-1] and int(n_dims) % 2 == 0):
        raise ShapeError(f"n_dims {n_dims} must be even and in (0, head_dim={x.shape[-1]}]")
    if not (freq_base > 0 and freq_scale > 0):
        raise ShapeError(f"freq_base {freq_base} and freq_scale {freq_scale} must be positive")
    if ext_factor != 0 and not (int(n_ctx_orig) > 0 and beta_fast > 0 and beta_slow > 0):
        raise ShapeError(f"YaRN (ext_factor {ext_factor}) needs a positive n_ctx_orig, "
                         f"beta_fast and beta_slow, got {n_ctx_orig}, {beta_fast}, {beta_slow}")
    if not magnitude(freq_scale, ext_factor, attn_factor) > 0:
        raise ShapeError(f"attn_factor {attn_factor} must make cos and sin's factor positive "
                         f"(freq_scale {freq_scale}, ext_factor {ext_factor})")
    return x.shape, "f32", {}


def rope_ff_shape(srcs, n_dims, **params):
    factors = srcs[2]
    if factors.dtype not in FLOAT_DTYPES or factors.shape != (int(n_dims) // 2,):
        raise ShapeError(f"factors must be f32 of shape ({int(n_dims) // 2},) or f16 (one per "
                         f"pair of the n_dims {n_dims} rotated dims), got {factors.dtype} "
                         f"{factors.shape}")
    return rope_shape(srcs, n_dims, **params)


def rope_tables(dtype, pos, n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor,
                beta_fast, beta_slow, n_ctx_orig, sign, factors):
    """m cos and m sin of every (token, pair) angle, computed in float64, then `dtype`; the
    index of each pair's first and second dims."""
    half = n_dims // 2
    k = np.arange(half)
    inv_freq = float(freq_base) ** (-2.0 * k / n_dims)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    scale = np.full(half, float(freq_scale))
    if ext_factor != 0:    # YaRN: the fast pairs keep (some of) their unscaled angle
        lo, hi = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        ramp = ext_factor * (1 - np.clip((k - lo) / max(0.001, hi - lo), 0, 1))
        scale = scale * (1 - ramp) + ramp
    theta = pos.astype(np.float64)[:, None] * (scale * inv_freq)   # (n_tokens, half)
    m = magnitude(freq_scale, ext_factor, attn_factor)
    cos = (m * np.cos(theta))[:, None, :].astype(dtype)             # broadcast over heads
    sin = (sign * m * np.sin(theta))[:, None, :].astype(dtype)
    if mode == "normal":
        return cos, sin, np.s_[..., 0:n_dims:2], np.s_[..., 1:n_dims:2]
    return cos, sin, np.s_[..., :half], np.s_[..., half:n_dims]


def rope_ref(x, pos, *, sign=1.0, factors=None, **params):
    """The rotation in float64 angles (then x's dtype); sign -1 turns the other way."""
    cos, sin, i0, i1 = rope_tables(x.dtype, pos, **params, sign=sign, factors=factors)
    out = np.array(x, copy=True)
    x0, x1 = x[i0], x[i1]
    out[i0] = x0 * cos - x1 * sin
    out[i1] = x0 * sin + x1 * cos
    return out


def complex_pairs(a: np.ndarray, n_dims: int):
    """The first n_dims of a's last dim as complex numbers x0 + i x1, one per adjacent pair
    (mode normal), a view; None where the last dim is not contiguous."""
    if a.strides[-1] != a.itemsize:
        return None
    return a[..., :n_dims].view(np.complex64 if a.dtype == np.float32 else np.complex128)


def rope_into(out, x, pos, *, sign=1.0, factors=None, **params):
    """rope_ref into out: no copy of the rotated dims. In mode normal with contiguous rows,
    one complex product (x0 + i x1)(cos + i sin) per pair, the reference's formula in one
    SIMD pass (3x faster than four strided ones; rounding may differ where it fuses a
    multiply-add); else one temporary per half."""
    cos, sin, i0, i1 = rope_tables(x.dtype, pos, **params, sign=sign, factors=factors)
    n_dims, mode = params["n_dims"], params["mode"]
    if n_dims < x.shape[-1]:  # dims that pass through
        np.copyto(out, x)
    pairs, out_pairs = complex_pairs(x, n_dims), complex_pairs(out, n_dims)
    if mode == "normal" and pairs is not None and out_pairs is not None:
        turn = np.empty(cos.shape, pairs.dtype)
        turn.real, turn.imag = cos, sin
        np.multiply(pairs, turn, out=out_pairs)
        return
    x0, x1, out0, out1 = x[i0], x[i1], out[i0], out[i1]
    np.multiply(x0, cos, out=out0)
    out0 -= x1 * sin
    np.multiply(x0, sin, out=out1)
    out1 += x1 * cos


def uniforms(node, sign):
    """f: (freq_base, freq_scale, sign * m (sin's factor; cos's is its magnitude), ext_factor),
    u: (n_dims, mode, the ramp's first and last pair)."""
    p = node.params
    ramp = (0, 0)
    if p["ext_factor"] != 0:
        ramp = yarn_corr_dims(int(p["n_dims"]), int(p["n_ctx_orig"]), p["freq_base"],
                              p["beta_fast"], p["beta_slow"])
    m = magnitude(p["freq_scale"], p["ext_factor"], p["attn_factor"])
    return {"f": (float(p["freq_base"]), float(p["freq_scale"]), sign * m,
                  float(p["ext_factor"])),
            "u": (int(p["n_dims"]), MODES[p["mode"]], *ramp)}


def pos(n, hi=2048, layout="contiguous"):
    return Input((n,), 0, hi, layout, "i32")   # random, unsorted, repeats allowed


def params(n_dims, mode, base=10000.0, scale=1.0, **yarn):
    return {"n_dims": n_dims, "mode": mode, "freq_base": base, "freq_scale": scale,
            **YARN_DEFAULTS, **yarn}


# YaRN as llama.cpp runs a "yarn" file (at 16 dims, base 500: a ramp over pairs 0 .. 5 of 8),
# magnitude 1.2 * 1.139; and an ext_factor between 0 and 1 with other betas (pairs 7 .. 11
# of 16)
YARN = {"ext_factor": 1.0, "attn_factor": 1.2, "n_ctx_orig": 256}
YARN_HALF = {"ext_factor": 0.5, "beta_fast": 8.0, "beta_slow": 2.0, "n_ctx_orig": 4096}


def rope_cases():
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
        Case((Input((2, 3, 5, 16)), pos(3, 1024)), params(16, "neox", 500.0, 0.25, **YARN)),
        Case((Input((3, 5, 2, 12), layout="permuted"), pos(5, 1024)),
             params(8, "normal", 500.0, 0.25, **YARN)),                      # pass-through
        Case((Input((2, 4, 3, 32)), pos(4, 8192)), params(32, "neox", 1e4, 0.125, **YARN_HALF)),
        Case((Input((2, 3, 4, 8)), pos(3)), params(8, "normal", attn_factor=0.8)),
        Case((Input((2, 160, 4, 64), layout="strided"), pos(160, 8192)),
             params(64, "neox", 1e6, 0.125, ext_factor=1.0, n_ctx_orig=2048), grad=False),
    ]


def factors(n_dims, lo=1.0, hi=8.0, layout="contiguous"):
    # Llama 3's factors: 1 for the fast pairs, up to the scaling factor (8) for the slow ones
    return Input((n_dims // 2,), lo, hi, layout)


def rope_ff_cases():
    return [
        Case((Input((1, 1, 1, 2)), pos(1, 10), factors(2)), params(2, "normal")),
        Case((Input((2, 3, 5, 8)), pos(3), factors(8)), params(8, "normal")),
        Case((Input((2, 3, 5, 8)), pos(3), factors(8, 0.5, 2.0)), params(8, "neox")),
        Case((Input((2, 5, 3, 10)), pos(5), factors(6)), params(6, "normal", scale=0.25)),
        Case((Input((1, 3, 2, 10), layout="permuted"), pos(3), factors(4, layout="strided")),
             params(4, "neox", 500.0)),
        Case((Input((3, 5, 6), layout="strided"), pos(3, layout="strided"), factors(6)),
             params(6, "neox", 5e5)),
        Case((Input((4, 128, 8, 32)), pos(128, 8192), factors(24)), params(24, "normal", 5e5),
             grad=False),
        Case((Input((2, 200, 6, 48), layout="strided"), pos(200, 4096), factors(48)),
             params(48, "neox", 5e5), grad=False),
        Case((Input((2, 3, 5, 16)), pos(3, 1024), factors(16)),
             params(16, "normal", 500.0, 0.25, **YARN)),
        Case((Input((2, 3, 5, 16)), pos(3, 1024), factors(16, 0.5, 2.0)),
             params(16, "neox", 1e4, 0.5, **YARN_HALF)),
    ]


def same_cases(cases):
    return lambda: [Case(c.inputs, c.params, c.grad) for c in cases()]


ROPE_DOC = (
    "x: f32 ([batch,] n_tokens, n_head, head_dim); positions: i32 (n_tokens,). Rotates\n"
    "the first n_dims (even, <= head_dim) dims of every head, pair k by\n"
    "theta_k = pos * freq_scale * freq_base ** (-2k / n_dims){}, times attn_factor;\n"
    "the rest pass through. mode 'normal' (ggml 0) pairs (2k, 2k + 1), 'neox' (ggml 2)\n"
    "pairs (k, k + n_dims/2). ext_factor != 0: YaRN, the fast pairs' angles mixed back\n"
    "towards unscaled (ramp from beta_fast to beta_slow turns over n_ctx_orig positions),\n"
    "the factor times 1 + 0.1 ln(1 / freq_scale).")
SIGNATURE = ("n_dims, mode='normal', freq_base=10000, freq_scale=1, ext_factor=0,\n"
             "attn_factor=1, beta_fast=32, beta_slow=1, n_ctx_orig=0")

rope = register(
    "rope", n_srcs=2, params=PARAMS, shape=rope_shape, shader="rope",
    reference=rope_ref, fast=rope_into, uniforms=lambda n: uniforms(n, 1.0), no_grad=(1,),
    backward=lambda n, g: (O.rope_back(g, n.srcs[1], **n.params), None),
    cases=rope_cases, defaults=ROPE_DEFAULTS,
    doc="Rotary position embedding as ggml_rope_ext, YaRN included:\n"
        f"rope(x, positions, {SIGNATURE}).\n" + ROPE_DOC.format(""))

rope_back = register(
    "rope_back", n_srcs=2, params=PARAMS, shape=rope_shape, shader="rope", entry="rope",
    reference=lambda g, pos, **kw: rope_ref(g, pos, **kw, sign=-1.0),
    fast=lambda out, g, pos, **kw: rope_into(out, g, pos, **kw, sign=-1.0),
    uniforms=lambda n: uniforms(n, -1.0), no_grad=(1,),
    backward=lambda n, g: (O.rope(g, n.srcs[1], **n.params), None),
    cases=same_cases(rope_cases), defaults=ROPE_DEFAULTS,
    doc="The backward of rope: the transposed map (sin negated, the same factor m).")

rope_ff = register(
    "rope_ff", n_srcs=3, params=PARAMS, shape=rope_ff_shape, shader="rope",
    dtype_from=(0,),  # x's dtype: the factors are a table of the model
    reference=lambda x, pos, ff, **kw: rope_ref(x, pos, **kw, factors=ff),
    fast=lambda out, x, pos, ff, **kw: rope_into(out, x, pos, **kw, factors=ff),
    uniforms=lambda n: uniforms(n, 1.0), no_grad=(1, 2),
    backward=lambda n, g: (O.rope_ff_back(g, *n.srcs[1:], **n.params), None, None),
    cases=rope_ff_cases, defaults=ROPE_DEFAULTS,
    doc="rope with per-pair frequency factors, as ggml_rope_ext with freq_factors (Llama 3's\n"
        f"rope_freqs.weight): rope_ff(x, positions, factors, {SIGNATURE});\n"
        "factors: f32 (n_dims / 2,), no gradient.\n" + ROPE_DOC.format(" / factors[k]"))

rope_ff_back = register(
    "rope_ff_back", n_srcs=3, params=PARAMS, shape=rope_ff_shape, shader="rope",
    dtype_from=(0,),  # x's dtype: the factors are a table of the model
    entry="rope_ff", reference=lambda g, pos, ff, **kw: rope_ref(g, pos, **kw, sign=-1.0,
                                                                  factors=ff),
    fast=lambda out, g, pos, ff, **kw: rope_into(out, g, pos, **kw, sign=-1.0, factors=ff),
    uniforms=lambda n: uniforms(n, -1.0), no_grad=(1, 2),
    backward=lambda n, g: (O.rope_ff(g, *n.srcs[1:], **n.params), None, None),
    cases=same_cases(rope_ff_cases), defaults=ROPE_DEFAULTS,
    doc="The backward of rope_ff: the transposed map (sin negated, the same factor m).")


__all__ = ["rope", "rope_back", "rope_ff", "rope_ff_back"]
