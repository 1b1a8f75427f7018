"""Elementwise ops: binary with ggml broadcasting of the second operand, and unary maps.

Shader: shaders/elementwise.wgsl, one entry point per op, one invocation per result element,
generated from the WGSL table below.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from .. import wgsl
from ..tensor import ShapeError
from .registry import (OPS, WORKGROUP, Case, Input, can_repeat, need_float, pad4, register,
                       same_shape, split_rows, tile)

# More than 65535 workgroups of WORKGROUP invocations: forces the 2-D dispatch grid.
LARGE = WORKGROUP * 65535 + 77


def unary_cases(lo=-1.0, hi=1.0):
    def inp(shape, layout="contiguous"):
        return (Input(shape, lo, hi, layout),)
    return [Case(inp((1,))), Case(inp((5, 7))), Case(inp((2, 3, 5), "permuted")),
            Case(inp((4, 9), "strided")), Case(inp((2, 3, 4, 5)), grad=False),
            Case(inp((LARGE,)), grad=False)]


def binary_cases(lo=-1.0, hi=1.0):
    a = lambda shape, layout="contiguous": Input(shape, -1.0, 1.0, layout)
    b = lambda shape, layout="contiguous": Input(shape, lo, hi, layout)
    return [Case((a((1,)), b((1,)))),
            Case((a((5, 7)), b((5, 7)))),
            Case((a((5, 7)), b((1, 7)))),                       # broadcast rows
            Case((a((3, 4, 5)), b((3, 1, 1)))),                 # broadcast columns
            Case((a((2, 3, 2, 5)), b((1, 3, 1, 5)))),           # broadcast in 4-D
            Case((a((6, 4), "permuted"), b((2, 4), "strided"))),
            Case((a((3, 5, 6), "strided"), b((3, 5, 6), "permuted"))),
            Case((a((LARGE,)), b((LARGE,))), grad=False)]


def broadcast_shape(srcs, **_):
    a, b = srcs
    need_float(a, b)
    if not can_repeat(b.shape, a.shape):
        raise ShapeError(f"second operand {b.shape} does not tile the first {a.shape}")
    return a.shape, a.dtype, {}


def unary_shape(srcs, **_):
    need_float(*srcs)
    return same_shape(srcs)


def reduce_to(g, like):
    """The gradient of a broadcast operand: sum `g` over the tiles that made it."""
    return g if g.shape == like.shape else O.repeat_back(g, like.shape)


def tiled(b, shape):
    """b tiled to `shape`; where every dim of b is 1 or already the full size that is NumPy
    broadcasting, a view instead of a copy."""
    b4, s4 = pad4(b.shape), pad4(shape)
    if all(n == 1 or n == m for n, m in zip(b4, s4)):
        return np.broadcast_to(b.reshape(b4), s4).reshape(shape)
    return tile(b, shape)


def binary(name, ufunc, backward, doc, lo=-1.0, hi=1.0):
    return register(name, n_srcs=2, shape=broadcast_shape, shader="elementwise",
                    reference=lambda a, b: ufunc(a, tiled(b, a.shape)), backward=backward,
                    fast=lambda out, a, b: ufunc(a, tiled(b, a.shape), out=out),
                    cases=lambda: binary_cases(lo, hi), doc=doc)


def unary(name, ref, backward, doc, lo=-1.0, hi=1.0, **kw):
    if isinstance(ref, np.ufunc):  # its fast kernel: the same ufunc, into the node
        kw.setdefault("fast", lambda out, a: ref(a, out=out))
    return register(name, n_srcs=1, shape=unary_shape, shader="elementwise", reference=ref,
                    backward=backward, cases=lambda: unary_cases(lo, hi), doc=doc, **kw)


add = binary("add", np.add, lambda n, g: (g, reduce_to(g, n.srcs[1])),
             "a + b, b tiled to a's shape (ggml broadcasting).")
sub = binary("sub", np.subtract, lambda n, g: (g, O.neg(reduce_to(g, n.srcs[1]))),
             "a - b, b tiled to a's shape.")
mul = binary("mul", np.multiply,
             lambda n, g: (O.mul(g, n.srcs[1]), reduce_to(O.mul(g, n.srcs[0]), n.srcs[1])),
             "a * b, b tiled to a's shape.")
div = binary("div", np.divide,
             lambda n, g: (O.div(g, n.srcs[1]),
                           O.neg(reduce_to(O.div(O.mul(g, n), n.srcs[1]), n.srcs[1]))),
             "a / b, b tiled to a's shape.", lo=0.5, hi=2.0)


def add1_shape(srcs, **_):
    a, b = srcs
    need_float(a, b)
    if b.nelements != 1:
        raise ShapeError(f"second operand must have one element, has shape {b.shape}")
    return a.shape, a.dtype, {}


add1 = register(
    "add1", n_srcs=2, shape=add1_shape, shader="elementwise",
    reference=lambda a, b: a + b.reshape(-1)[0],
    fast=lambda out, a, b: np.add(a, b.reshape(-1)[0], out=out),
    backward=lambda n, g: (g, O.reshape(O.sum(g), n.srcs[1].shape)),
    cases=lambda: [Case((Input((1,)), Input((1,)))), Case((Input((5, 7)), Input((1, 1)))),
                   Case((Input((3, 4, 5), layout="permuted"), Input((1,)))),
                   Case((Input((LARGE,)), Input((1,))), grad=False)],
    doc="a + b for a one-element tensor b.")

scale = register(
    "scale", n_srcs=1, params=("s",), shape=unary_shape, shader="elementwise",
    reference=lambda a, s: a * a.dtype.type(s),
    fast=lambda out, a, s: np.multiply(a, a.dtype.type(s), out=out),
    backward=lambda n, g: (O.scale(g, n.params["s"]),),
    uniforms=lambda n: {"f": (float(n.params["s"]),)},
    cases=lambda: [Case(c.inputs, {"s": -1.75}, c.grad) for c in unary_cases()],
    doc="a * s for a Python float s.")

# f16_nmse=0.0: exact on halves (sign flips, comparisons)
neg = unary("neg", np.negative, lambda n, g: (O.neg(g),), "-a", f16_nmse=0.0)
abs = unary("abs", np.abs, lambda n, g: (O.mul(O.sgn(n.srcs[0]), g),), "|a|", f16_nmse=0.0)
sgn = unary("sgn", np.sign, lambda n, g: (None,), "sign of a: -1, 0 or 1 (zero gradient)",
            f16_nmse=0.0)
step = unary("step", lambda a: (a > 0).astype(a.dtype), lambda n, g: (None,),
             "1 where a > 0, else 0 (zero gradient)", f16_nmse=0.0)
relu = unary("relu", lambda a: np.maximum(a, 0), lambda n, g: (O.mul(O.step(n.srcs[0]), g),),
             "max(a, 0)", f16_nmse=0.0)
sqr = unary("sqr", np.square, lambda n, g: (O.scale(O.mul(n.srcs[0], g), 2.0),), "a * a")
sqrt = unary("sqrt", np.sqrt, lambda n, g: (O.div(O.scale(g, 0.5), n),), "sqrt(a)",
             lo=2e-3, hi=2.0)
log = unary("log", np.log, lambda n, g: (O.div(g, n.srcs[0]),), "natural log of a",
            lo=0.05, hi=2.0)
exp = unary("exp", np.exp, lambda n, g: (O.mul(g, n),), "e ** a", lo=-4.0, hi=4.0)


def sigmoid_ref(a):
    return 1 / (1 + np.exp(-a))


def silu_ref(a):
    return a * sigmoid_ref(a)


def silu_back_ref(a, dy):
    s = sigmoid_ref(a)
    return dy * s * (1 + a * (1 - s))


# gelu is ggml's tanh approximation.
GELU_A, SQRT_2_OVER_PI = 0.044715, 0.7978845608028654


def gelu_ref(a):
    return 0.5 * a * (1 + np.tanh(SQRT_2_OVER_PI * a * (1 + GELU_A * a * a)))


def gelu_back_ref(a, dy):
    t = np.tanh(SQRT_2_OVER_PI * a * (1 + GELU_A * a * a))
    return dy * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * SQRT_2_OVER_PI * (1 + 3 * GELU_A * a * a))


silu = unary("silu", silu_ref, lambda n, g: (O.silu_back(n.srcs[0], g),), "a * sigmoid(a)",
             lo=-4.0, hi=4.0)
gelu = unary("gelu", gelu_ref, lambda n, g: (O.gelu_back(n.srcs[0], g),),
             "gelu(a), tanh approximation as ggml", lo=-4.0, hi=4.0)
def softplus_ref(a):
    return np.logaddexp(0, a)


# the backward from the output: 1 - tanh(a)^2 = 1 - y^2
tanh = unary("tanh", np.tanh, lambda n, g: (O.tanh_back(n, g),), "tanh(a)", lo=-4.0, hi=4.0)
# the backward from the output: sigmoid'(a) = y (1 - y)
sigmoid = unary("sigmoid", sigmoid_ref, lambda n, g: (O.sigmoid_back(n, g),),
                "1 / (1 + e ** -a)", lo=-6.0, hi=6.0)
softplus = unary("softplus", softplus_ref, lambda n, g: (O.mul(g, O.sigmoid(n.srcs[0])),),
                 "log(1 + e ** a), exact for large |a| (ggml_softplus)", lo=-6.0, hi=6.0)


def act_back(name, ref, fwd):
    # Second derivatives are not supported: the forward input x takes no gradient here,
    # the incoming gradient dy does (the op is linear in dy).
    return register(
        name, n_srcs=2, shape=back_shape,
        shader="elementwise", reference=ref, no_grad=(0,),
        backward=lambda n, g: (None, getattr(O, name)(n.srcs[0], g)),
        cases=lambda: [Case((Input((1,), -4, 4), Input((1,)))),
                       Case((Input((5, 7), -4, 4), Input((5, 7)))),
                       Case((Input((3, 5), -4, 4, "permuted"), Input((3, 5), layout="strided"))),
                       Case((Input((LARGE,), -4, 4), Input((LARGE,))), grad=False)],
        doc=f"dy * {fwd}'(x): the backward of {fwd}. Inputs x, dy.")


def back_shape(srcs, **_):
    x, dy = srcs
    need_float(x, dy)
    if x.shape != dy.shape:
        raise ShapeError(f"x {x.shape} and dy {dy.shape} must have the same shape")
    return x.shape, x.dtype, {}


silu_back = act_back("silu_back", silu_back_ref, "silu")
gelu_back = act_back("gelu_back", gelu_back_ref, "gelu")
tanh_back = register(
    "tanh_back", n_srcs=2, shape=back_shape, shader="elementwise",
    reference=lambda y, dy: dy * (1 - y * y), no_grad=(0,),
    backward=lambda n, g: (None, O.tanh_back(n.srcs[0], g)),
    cases=lambda: [Case((Input((1,)), Input((1,)))), Case((Input((5, 7)), Input((5, 7)))),
                   Case((Input((3, 5), layout="permuted"), Input((3, 5), layout="strided"))),
                   Case((Input((LARGE,)), Input((LARGE,))), grad=False)],
    doc="dy * (1 - y * y): the backward of tanh from its output y = tanh(x). Inputs y, dy.")


sigmoid_back = register(
    "sigmoid_back", n_srcs=2, shape=back_shape, shader="elementwise",
    reference=lambda y, dy: dy * y * (1 - y), no_grad=(0,),
    backward=lambda n, g: (None, O.sigmoid_back(n.srcs[0], g)),
    cases=lambda: [Case((Input((1,), 0, 1), Input((1,)))),
                   Case((Input((5, 7), 0, 1), Input((5, 7)))),
                   Case((Input((3, 5), 0, 1, "permuted"), Input((3, 5), layout="strided"))),
                   Case((Input((LARGE,), 0, 1), Input((LARGE,))), grad=False)],
    doc="dy * y * (1 - y): the backward of sigmoid from its output y = sigmoid(x). Inputs y, "
        "dy.")


# SwiGLU's gate fused: silu(a) * b in one pass, and its backward without the silu(a) or
# dy * b intermediates.
def swiglu_back_ref(a, b, dy):
    return silu_back_ref(a, dy * b)


def sigmoid_into(out, a):
    """sigmoid_ref(a) into out, one operation at a time."""
    np.negative(a, out=out)
    np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)


def swiglu_into(out, a, b):
    """swiglu's reference (a * sigmoid(a) * b) without temporaries, as a / (1 + exp(-a)) * b:
    one pass fewer than the reciprocal and a product (20 % of the op; rounding may differ
    in the last bit)."""
    np.negative(a, out=out)
    np.exp(out, out=out)
    out += 1
    np.divide(a, out, out=out)
    out *= b


def swiglu_back_into(out, a, b, dy):
    """swiglu_back's reference (dy * b * s * (1 + a * (1 - s)), s = sigmoid(a)), same
    operations, with one temporary."""
    s = np.empty_like(out)
    sigmoid_into(s, a)
    np.multiply(dy, b, out=out)
    out *= s
    np.subtract(1, s, out=s)
    s *= a
    s += 1
    out *= s


def gate_shape(srcs, **_):
    need_float(*srcs)
    if any(s.shape != srcs[0].shape for s in srcs):
        raise ShapeError(f"operands must have one shape, got {[s.shape for s in srcs]}")
    return srcs[0].shape, "f32", {}


def gate_cases(n_srcs):
    def inputs(shape, layouts):
        return tuple(Input(shape, -4.0, 4.0, layout) for layout in layouts[:n_srcs])
    return [Case(inputs((1,), ["contiguous"] * 3)),
            Case(inputs((5, 7), ["contiguous"] * 3)),
            Case(inputs((3, 5), ["permuted", "strided", "contiguous"])),
            Case(inputs((2, 3, 4, 5), ["strided", "contiguous", "permuted"]), grad=False),
            Case(inputs((LARGE,), ["contiguous"] * 3), grad=False)]


swiglu = register(
    "swiglu", n_srcs=2, shape=gate_shape, shader="elementwise",
    reference=lambda a, b: silu_ref(a) * b, fast=swiglu_into, split=split_rows(),
    # db = silu(a) * dy is this op again
    backward=lambda n, g: (O.swiglu_back(*n.srcs, g), O.swiglu(n.srcs[0], g)),
    cases=lambda: gate_cases(2),
    doc="silu(a) * b, the gate of a SwiGLU feed-forward, in one pass. a and b of one shape.")

# a takes no gradient (no second derivatives); the op is linear in b and in dy separately,
# and symmetric in them.
swiglu_back = register(
    "swiglu_back", n_srcs=3, shape=gate_shape, shader="elementwise",
    reference=swiglu_back_ref, fast=swiglu_back_into, split=split_rows(), no_grad=(0,),
    backward=lambda n, g: (None, O.swiglu_back(n.srcs[0], n.srcs[2], g),
                           O.swiglu_back(n.srcs[0], n.srcs[1], g)),
    cases=lambda: gate_cases(3),
    doc="da of swiglu: dy * b * silu'(a). Inputs a, b, dy.")


# GeGLU's gate (Gemma) fused as SwiGLU's is: gelu(a) * b, and its backward.
def geglu_back_ref(a, b, dy):
    return gelu_back_ref(a, dy * b)


def gelu_arg_into(out, a):
    """out = sqrt(2 / pi) * a * (1 + GELU_A * a * a), the argument of gelu's tanh."""
    np.multiply(a, a, out=out)
    out *= GELU_A
    out += 1
    out *= a
    out *= SQRT_2_OVER_PI


def geglu_into(out, a, b):
    """geglu's reference (0.5 * a * (1 + t) * b, t the tanh of gelu's argument) without
    temporaries."""
    gelu_arg_into(out, a)
    np.tanh(out, out=out)
    out += 1
    out *= a
    out *= 0.5
    out *= b


def geglu_back_into(out, a, b, dy):
    """geglu_back's reference (dy * b * (0.5 * (1 + t) + k * (1 - t * t)), k = 0.5 * a *
    sqrt(2 / pi) * (1 + 3 * GELU_A * a * a)), with two temporaries."""
    t, k = np.empty_like(out), np.empty_like(out)
    np.multiply(a, a, out=k)
    k *= 3 * GELU_A
    k += 1
    k *= a
    k *= 0.5 * SQRT_2_OVER_PI
    gelu_arg_into(t, a)
    np.tanh(t, out=t)
    np.multiply(t, t, out=out)
    np.subtract(1, out, out=out)
    out *= k
    t += 1
    t *= 0.5
    out += t
    out *= dy
    out *= b


geglu = register(
    "geglu", n_srcs=2, shape=gate_shape, shader="elementwise",
    reference=lambda a, b: gelu_ref(a) * b, fast=geglu_into, split=split_rows(),
    # db = gelu(a) * dy is this op again
    backward=lambda n, g: (O.geglu_back(*n.srcs, g), O.geglu(n.srcs[0], g)),
    cases=lambda: gate_cases(2),
    doc="gelu(a) * b (gelu's tanh approximation), the gate of a GeGLU feed-forward, in one "
        "pass. a and b of one shape.")

# As swiglu_back: a takes no gradient, the op is linear in b and in dy, symmetric in them.
geglu_back = register(
    "geglu_back", n_srcs=3, shape=gate_shape, shader="elementwise",
    reference=geglu_back_ref, fast=geglu_back_into, split=split_rows(), no_grad=(0,),
    backward=lambda n, g: (None, O.geglu_back(n.srcs[0], n.srcs[2], g),
                           O.geglu_back(n.srcs[0], n.srcs[1], g)),
    cases=lambda: gate_cases(3),
    doc="da of geglu: dy * b * gelu'(a). Inputs a, b, dy.")

# gpt-oss's gate (ggml_swiglu_oai): the gate clipped from above, the linear part clipped both
# ways and offset by one, the gate's sigmoid sharpened by alpha. Its backward is two ops, one
# for each input (each linear in dy; a and b take no second gradient): at the clip bounds
# the gradient passes, as torch's clamp passes it.
def oai_parts(a, b, alpha, limit):
    """(g, u + 1, sigmoid(alpha g)): the clipped gate, the offset linear part, the sigmoid."""
    g = np.minimum(a, a.dtype.type(limit))
    u = np.clip(b, b.dtype.type(-limit), b.dtype.type(limit)) + 1
    return g, u, 1 / (1 + np.exp(-alpha * g))


def swiglu_oai_ref(a, b, alpha, limit):
    g, u, s = oai_parts(a, b, alpha, limit)
    return g * s * u


def swiglu_oai_back_ref(a, b, dy, alpha, limit):
    g, u, s = oai_parts(a, b, alpha, limit)
    return dy * u * (a <= limit) * s * (1 + alpha * g * (1 - s))


def swiglu_oai_back_up_ref(a, b, dy, alpha, limit):
    g, _, s = oai_parts(a, b, alpha, limit)
    return dy * g * s * (np.abs(b) <= limit)


def oai_cases(n_srcs):
    """gate_cases with a limit inside the inputs' range, so both clips are taken."""
    return [Case(c.inputs, {"alpha": 1.702, "limit": 1.5}, c.grad) for c in gate_cases(n_srcs)]


def oai_uniforms(n):
    return {"f": (float(n.params["alpha"]), float(n.params["limit"]))}


OAI = dict(params=("alpha", "limit"), shape=gate_shape, shader="elementwise",
           split=split_rows(), uniforms=oai_uniforms, defaults={"alpha": 1.702, "limit": 7.0})
swiglu_oai = register(
    "swiglu_oai", n_srcs=2, reference=swiglu_oai_ref, **OAI,
    backward=lambda n, g: (O.swiglu_oai_back(*n.srcs, g, **n.params),
                           O.swiglu_oai_back_up(*n.srcs, g, **n.params)),
    cases=lambda: oai_cases(2),
    doc="gpt-oss's gate, ggml_swiglu_oai: g * sigmoid(alpha * g) * (u + 1) with g = min(a, "
        "limit), u = clamp(b, -limit, limit); alpha 1.702 and limit 7 by default.")
swiglu_oai_back = register(
    "swiglu_oai_back", n_srcs=3, reference=swiglu_oai_back_ref, no_grad=(0, 1), **OAI,
    backward=lambda n, g: (None, None, O.swiglu_oai_back(*n.srcs[:2], g, **n.params)),
    cases=lambda: oai_cases(3),
    doc="da of swiglu_oai: dy times its derivative in a (0 where a > limit). Inputs a, b, dy.")
swiglu_oai_back_up = register(
    "swiglu_oai_back_up", n_srcs=3, reference=swiglu_oai_back_up_ref, no_grad=(0, 1), **OAI,
    backward=lambda n, g: (None, None, O.swiglu_oai_back_up(*n.srcs[:2], g, **n.params)),
    cases=lambda: oai_cases(3),
    doc="db of swiglu_oai: dy * g * sigmoid(alpha * g) where |b| <= limit, else 0. Inputs a, "
        "b, dy.")

__all__ = ["add", "sub", "mul", "div", "add1", "scale", "neg", "abs", "sgn", "step", "relu",
           "sqr", "sqrt", "log", "exp", "silu", "gelu", "tanh", "sigmoid", "softplus",
           "silu_back", "gelu_back", "tanh_back", "sigmoid_back", "swiglu", "swiglu_back",
           "geglu", "geglu_back", "swiglu_oai", "swiglu_oai_back", "swiglu_oai_back_up"]


# Each op's kernel: the WGSL value of dst at an element, from a = src0, b = src1 and c = src2
# there (b and c tiled to dst's shape, ggml broadcasting) and the uniforms p, put in
# wgsl.elementwise_kernels' template. The functions called are shaders/elementwise.wgsl's.
WGSL = {"add": "a + b", "sub": "a - b", "mul": "a * b", "div": "a / b",
        "add1": "a + b",                         # b has one element
        "scale": "a * p.f.x", "neg": "-a", "abs": "abs(a)", "sgn": "sign(a)",
        "step": "select(0.0, 1.0, a > 0.0)", "relu": "max(a, 0.0)", "sqr": "a * a",
        "sqrt": "sqrt(a)", "log": "log(a)", "exp": "exp(a)", "silu": "silu(a)",
        "gelu": "gelu(a)", "tanh": "tanh(clamp(a, -10.0, 10.0))",   # clamped: see gelu_tanh
        "sigmoid": "sigmoid(a)", "softplus": "softplus(a)",
        "silu_back": "silu_grad(a, b)",          # a = x, b = dy
        "gelu_back": "b * gelu_grad(a)",
        "tanh_back": "b * (1.0 - a * a)",        # a = y, b = dy
        "sigmoid_back": "b * a * (1.0 - a)",     # a = y, b = dy
        "swiglu": "silu(a) * b",
        "swiglu_back": "silu_grad(a, c * b)",    # a, b, c = dy
        "geglu": "gelu(a) * b",
        "geglu_back": "c * b * gelu_grad(a)",
        # p.f: alpha, limit
        "swiglu_oai": "oai_gate(a, p.f.x, p.f.y) * (clamp(b, -p.f.y, p.f.y) + 1.0)",
        "swiglu_oai_back": "c * (clamp(b, -p.f.y, p.f.y) + 1.0) * oai_gate_grad(a, p.f.x, p.f.y)",
        "swiglu_oai_back_up": "select(0.0, c * oai_gate(a, p.f.x, p.f.y), abs(b) <= p.f.y)"}

wgsl.add_part("elementwise_kernels", lambda: wgsl.elementwise_kernels(
    (OPS[name].entry, OPS[name].n_srcs, value) for name, value in WGSL.items()))
