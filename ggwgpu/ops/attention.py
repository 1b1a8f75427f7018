"""Fused attention for training: flash_attn and its backward flash_attn_back.

Shader: shaders/attention.wgsl.

    flash_attn(q, k, v, scale, causal)   softmax(scale * q @ k^T + mask) @ v over the keys
    flash_attn_back(q, k, v, dout, ...)  dQ, dK, dV flattened one after another (1-D)

q [.., n_head, n_q, d], k and v [.., n_head_kv, n_kv, d]; query head h reads kv head
h // (n_head / n_head_kv) (grouped-query attention), and the batch dim broadcasts the same
way (as mul_mat's batch dims). causal: query i sees key j only if j <= i + n_kv - n_q
(ggml's diag_mask_inf with n_past = n_kv - n_q). No n_q x n_kv matrix is ever stored: the
kernels run one invocation per query row (or key row) with an online softmax.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import ShapeError, Tensor, constant, contiguous_strides
from .registry import Case, Dispatch, Input, need_f32, pad4, register

MAX_D = 256  # head dim bound: the kernels keep d-float arrays in private memory


# -- shapes ---------------------------------------------------------------------------------------

def check_qkv(q, k, v, causal):
    need_f32(q, k, v)
    if not (2 <= q.ndim == k.ndim == v.ndim):
        raise ShapeError("q, k, v need the same number of dims, at least 2")
    if k.shape != v.shape:
        raise ShapeError(f"k {k.shape} and v {v.shape} must have the same shape")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ShapeError(f"head dims differ: q {d}, k {k.shape[-1]}")
    if d > MAX_D:
        raise ShapeError(f"head dim {d} exceeds the kernels' bound of {MAX_D}")
    q4, k4 = pad4(q.shape), pad4(k.shape)
    if q4[0] % k4[0] or q4[1] % k4[1]:
        raise ShapeError(f"batch/head dims {k4[:2]} of k, v do not divide {q4[:2]} of q")
    if causal and k.shape[-2] < q.shape[-2]:
        raise ShapeError(f"causal attention needs n_kv >= n_q (every query must see a key), "
                         f"got n_q {q.shape[-2]}, n_kv {k.shape[-2]}")


def flash_attn_shape(srcs, scale, causal):
    check_qkv(*srcs, causal)
    return srcs[0].shape, "f32", {}


def flash_attn_back_shape(srcs, scale, causal):
    q, k, v, dout = srcs
    check_qkv(q, k, v, causal)
    need_f32(dout)
    if dout.shape != q.shape:
        raise ShapeError(f"dout {dout.shape} must have q's shape {q.shape}")
    return (q.nelements + k.nelements + v.nelements,), "f32", {}


# -- NumPy reference ------------------------------------------------------------------------------

def expand_kv(x, like):
    """k or v [.., n_head_kv, n_kv, d] repeated to q's batch and head dims (index j reads
    j // ratio)."""
    x4, l4 = x.reshape(pad4(x.shape)), pad4(like.shape)
    x4 = np.repeat(x4, l4[0] // x4.shape[0], axis=0)
    return np.repeat(x4, l4[1] // x4.shape[1], axis=1)


def probs(q, k, scale, causal):
    """softmax(scale * q k^T + mask), shape q4[:2] + (n_q, n_kv)."""
    q4 = q.reshape(pad4(q.shape))
    s = np.matmul(q4, np.swapaxes(expand_kv(k, q), -1, -2)) * q.dtype.type(scale)
    if causal:
        n_q, n_kv = s.shape[-2:]
        hidden = np.arange(n_kv)[None, :] > np.arange(n_q)[:, None] + (n_kv - n_q)
        s = np.where(hidden, -np.inf, s)
    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def flash_attn_ref(q, k, v, scale, causal):
    return np.matmul(probs(q, k, scale, causal), expand_kv(v, q)).reshape(q.shape)


def fold_kv(g4, like):
    """The adjoint of expand_kv: sum the q-head gradients of each kv head."""
    l4 = pad4(like.shape)
    r0, r1 = g4.shape[0] // l4[0], g4.shape[1] // l4[1]
    return g4.reshape(l4[0], r0, l4[1], r1, *g4.shape[2:]).sum(axis=(1, 3)).reshape(like.shape)


def flash_attn_back_ref(q, k, v, dout, scale, causal):
    p = probs(q, k, scale, causal)
    q4, do4 = q.reshape(pad4(q.shape)), dout.reshape(pad4(q.shape))
    k4, v4 = expand_kv(k, q), expand_kv(v, q)
    dp = np.matmul(do4, np.swapaxes(v4, -1, -2))
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True)) * q.dtype.type(scale)
    dq = np.matmul(ds, k4)
    dk = fold_kv(np.matmul(np.swapaxes(ds, -1, -2), q4), k)
    dv = fold_kv(np.matmul(np.swapaxes(p, -1, -2), do4), v)
    return np.concatenate([dq.reshape(-1), dk.reshape(-1), dv.reshape(-1)])


# -- dispatches -----------------------------------------------------------------------------------

def rows(t) -> int:
    return t.nelements // t.shape[-1]


def uniforms(node):
    return {"f": (float(node.params["scale"]),), "u": (int(bool(node.params["causal"])),)}


def flash_attn_dispatch(node):
    return [Dispatch("flash_attn", node, node.srcs, n=rows(node), **uniforms(node))]


def flash_attn_back_dispatch(node):
    """Three passes, no atomics: per query row the softmax statistics (log-sum-exp and
    D = dout . out) next to a copy of dout in a private scratch; then dQ per query row; then
    dK and dV per key row. The scratch stands in for dout in the last two (a dispatch binds
    at most four sources)."""
    q, k, v, dout = node.srcs
    d = q.shape[-1]
    # scratch row: [dout (d) | lse | D], one per query row
    scratch = Tensor(pad4(q.shape)[:3] + (d + 2,), name=f"{node} softmax statistics")
    dq = node.layout(q.shape, contiguous_strides(q.shape), node.offset)
    dk = node.layout(k.shape, contiguous_strides(k.shape), node.offset + q.nelements)
    un = uniforms(node)
    return [Dispatch("flash_attn_back_stats", scratch, (q, k, v, dout), n=rows(q), **un),
            Dispatch("flash_attn_back_q", dq, (q, k, v, scratch), n=rows(q), **un),
            # dV lies k.nelements after dK in the same storage
            Dispatch("flash_attn_back_kv", dk, (q, k, v, scratch), n=rows(k), f=un["f"],
                     u=un["u"] + (k.nelements,))]


# -- backward rules -------------------------------------------------------------------------------

def split(t, *shapes):
    """Contiguous views of 1-D `t`, one after another."""
    t = t if t.is_contiguous() else O.cont(t)
    out, at = [], 0
    for shape in shapes:
        out.append(O.view(t, shape, contiguous_strides(shape), at))
        at += int(np.prod(shape))
    return out


def flash_attn_backward(node, g):
    q, k, v = node.srcs
    both = O.flash_attn_back(q, k, v, g, node.params["scale"], node.params["causal"])
    return tuple(split(both, q.shape, k.shape, v.shape))


def concat_last(a, b):
    """[a, b] along the innermost dim (a and b of one shape), built with acc."""
    shape = a.shape[:-1] + (2 * a.shape[-1],)
    strides = contiguous_strides(shape)
    zeros = constant(np.zeros(shape, np.float32), name="zeros")
    return O.acc(O.acc(zeros, a, strides, 0), b, strides, a.shape[-1])


def flash_attn_back_backward(node, g):
    """The gradient w.r.t. dout; q, k, v take none (no second derivatives of attention).

    flash_attn_back is linear in dout. With G = [Gq, Gk, Gv] (g split like the result), the
    gradient is flash_attn(q, k, Gv) plus, per query row i,
        sum_j P_ij (b_ij - sum_l P_il b_il) V_j * scale,  b_ij = Gq_i . K_j + Q_i . Gk_j,
    which is exactly the second half of dQ' from flash_attn_back on doubled head dims:
    q' = [Q, 0], k' = [K, V] (same softmax P), v' = [K, Gk], dout' = [Gq, Q].
    Exact, and the cost of one attention backward at head dim 2d (d <= MAX_D / 2)."""
    q, k, v, _ = node.srcs
    scale, causal = node.params["scale"], node.params["causal"]
    gq, gk, gv = split(g, q.shape, k.shape, v.shape)
    d = q.shape[-1]
    zeros = constant(np.zeros(q.shape, np.float32), name="zeros")
    big = O.flash_attn_back(concat_last(q, zeros), concat_last(k, v), concat_last(k, gk),
                            concat_last(gq, q), scale, causal)
    shape2 = q.shape[:-1] + (2 * d,)
    from_scores = O.view(big, q.shape, contiguous_strides(shape2), d)  # second half of dQ'
    return None, None, None, O.add(from_scores, O.flash_attn(q, k, gv, scale, causal))


# -- registry -------------------------------------------------------------------------------------

OTHER = {"contiguous": "contiguous", "permuted": "strided", "strided": "permuted"}


def attn_cases(with_dout=False):
    """(q, k, v[, dout]) cases; inputs in [-1, 1], scale 1/sqrt(d) unless said otherwise.
    dout takes the layout q does not (strided for permuted q and the other way round)."""
    def case(q, kv, causal, layouts=("contiguous",) * 3, grad=True, scale=None):
        ins = [Input(q, layout=layouts[0]), Input(kv, layout=layouts[1]),
               Input(kv, layout=layouts[2])]
        if with_dout:
            ins.append(Input(q, layout=OTHER[layouts[0]]))
        scale = scale or round(float(1 / np.sqrt(q[-1])), 4)
        return Case(tuple(ins), {"scale": scale, "causal": causal}, grad)
    return [case((1, 2, 3, 4), (1, 2, 5, 4), False),
            case((1, 2, 3, 4), (1, 2, 5, 4), True),                    # n_q < n_kv, causal
            case((1, 4, 3, 3), (1, 2, 3, 3), True),                    # GQA, d odd
            case((1, 4, 2, 5), (1, 2, 4, 5), False, scale=1.3),        # GQA, d 5
            case((2, 2, 3, 2), (1, 1, 3, 2), True),                    # batch 2 over kv batch 1
            case((2, 1, 3, 4), (2, 1, 4, 4), True,
                 ("permuted", "strided", "permuted")),                 # views
            case((3, 4), (5, 4), False, ("strided", "permuted", "contiguous")),  # 2-D
            case((1, 1, 1, 1), (1, 1, 1, 1), True),                    # all ones
            case((1, 2, 4, 3), (1, 2, 6, 3), True, scale=60.0),        # scores past exp's range
            case((1, 4, 128, 64), (1, 4, 128, 64), True, grad=False),
            case((2, 4, 67, 33), (2, 2, 130, 33), False, ("permuted", "strided", "contiguous"),
                 grad=False),
            case((1, 2, 33, MAX_D), (1, 1, 40, MAX_D), True, grad=False)]


flash_attn = register(
    "flash_attn", n_srcs=3, params=("scale", "causal"), shape=flash_attn_shape,
    shader="attention", reference=flash_attn_ref, dispatches=flash_attn_dispatch,
    backward=flash_attn_backward, cases=attn_cases,
    doc="softmax(scale * q @ k^T + mask) @ v over the keys, fused (no score matrix). q [.., "
        "n_head, n_q, d], k, v [.., n_head_kv, n_kv, d] with query head h reading kv head "
        "h // (n_head / n_head_kv); causal hides key j from query i when j > i + n_kv - n_q.")

flash_attn_back = register(
    "flash_attn_back", n_srcs=4, params=("scale", "causal"), shape=flash_attn_back_shape,
    shader="attention", entry="flash_attn_back_q", reference=flash_attn_back_ref,
    dispatches=flash_attn_back_dispatch,
    backward=flash_attn_back_backward, no_grad=(0, 1, 2),
    cases=lambda: attn_cases(with_dout=True),
    doc="The backward of flash_attn for output gradient dout: dQ, dK, dV (each contiguous "
        "in the shape of q, k, v) one after another in one 1-D tensor, as ggml's "
        "flash_attn_back.")

__all__ = ["flash_attn", "flash_attn_back"]
