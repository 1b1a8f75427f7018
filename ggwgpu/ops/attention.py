"""Fused attention for training: flash_attn and flash_attn_ext (with an additive mask), and
their backward flash_attn_back and flash_attn_ext_back.

Shader: shaders/attention.wgsl, one body for both pairs (flash_attn is flash_attn_ext with
the causal rule in place of a mask).

    flash_attn(q, k, v, scale, causal)         softmax(scale * q @ k^T [+ causal mask]) @ v
    flash_attn_ext(q, k, v, mask, scale)       softmax(scale * q @ k^T + mask) @ v
    flash_attn_back(q, k, v, dout, ...)        dQ, dK, dV flattened one after another (1-D)
    flash_attn_ext_back(q, k, v, mask, dout, scale)   likewise

q [.., n_head, n_q, d], k and v [.., n_head_kv, n_kv, d]; query head h reads kv head
h // (n_head / n_head_kv) (grouped-query attention), and the batch dim broadcasts the same
way (as mul_mat's batch dims); the output has q's shape. causal: query i sees key j only if
j <= i + n_kv - n_q (ggml's diag_mask_inf with n_past = n_kv - n_q). The mask (f32) tiles
the scores [.., n_head, n_q, n_kv] by ggml broadcasting ([n_q, n_kv] for every batch and
head, [batch, 1, n_q, n_kv] per batch, ...): ggml's GGML_OP_FLASH_ATTN_EXT without ALiBi or
softcap, the mask unpadded and f32. A key whose mask is -inf is hidden; a query row that
sees no key at all (every key -inf) gives 0, as ggml's CPU kernel does, and its gradients
are 0. No n_q x n_kv matrix is ever stored: the kernels run one invocation per query row (or
key row) with an online softmax.

Two op pairs rather than an optional mask, as rope and rope_ff: an op has a fixed number of
sources. The mask takes no gradient (a constant input: causality, document boundaries).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import ops as O
from ..tensor import ShapeError, Tensor, contiguous_strides, zeros
from .registry import Case, Dispatch, Input, can_repeat, need_float, pad4, register

MAX_D = 256  # head dim bound: the kernels keep d-float arrays in private memory


# -- shapes ---------------------------------------------------------------------------------------

def check_qkv(q, k, v, causal=False):
    need_float(q, k, v)
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


def scores_shape(q, k) -> tuple[int, ...]:
    """The shape of the scores q k^T: q's dims with d replaced by n_kv."""
    return q.shape[:-1] + (k.shape[-2],)


def check_mask(q, k, v, mask):
    check_qkv(q, k, v)
    need_float(mask)
    scores = scores_shape(q, k)
    if not can_repeat(mask.shape, scores):
        raise ShapeError(f"mask {mask.shape} does not tile the scores {scores} ([.., n_q, "
                         f"n_kv]; e.g. a mask ({scores[-2]}, {scores[-1]}) or (batch, 1, "
                         f"{scores[-2]}, {scores[-1]}))")


def check_dout(q, dout):
    need_float(dout)
    if dout.shape != q.shape:
        raise ShapeError(f"dout {dout.shape} must have q's shape {q.shape}")


def flash_attn_shape(srcs, scale, causal):
    check_qkv(*srcs, causal)
    return srcs[0].shape, "f32", {}


def flash_attn_ext_shape(srcs, scale):
    check_mask(*srcs)
    return srcs[0].shape, "f32", {}


def packed_grads(q, k, v):
    return (q.nelements + k.nelements + v.nelements,), "f32", {}


def flash_attn_back_shape(srcs, scale, causal):
    q, k, v, dout = srcs
    check_qkv(q, k, v, causal)
    check_dout(q, dout)
    return packed_grads(q, k, v)


def flash_attn_ext_back_shape(srcs, scale):
    q, k, v, mask, dout = srcs
    check_mask(q, k, v, mask)
    check_dout(q, dout)
    return packed_grads(q, k, v)


# -- NumPy reference ------------------------------------------------------------------------------

def expand_kv(x, like):
    """k or v [.., n_head_kv, n_kv, d] repeated to q's batch and head dims (index j reads
    j // ratio)."""
    x4, l4 = x.reshape(pad4(x.shape)), pad4(like.shape)
    x4 = np.repeat(x4, l4[0] // x4.shape[0], axis=0)
    return np.repeat(x4, l4[1] // x4.shape[1], axis=1)


def probs(q, k, scale, causal=False, mask=None):
    """softmax(scale * q k^T + mask), shape q4[:2] + (n_q, n_kv); a row whose keys are all
    hidden (-inf) is 0."""
    q4 = q.reshape(pad4(q.shape))
    s = np.matmul(q4, np.swapaxes(expand_kv(k, q), -1, -2)) * q.dtype.type(scale)
    n_q, n_kv = s.shape[-2:]
    if causal:
        hidden = np.arange(n_kv)[None, :] > np.arange(n_q)[:, None] + (n_kv - n_q)
        s = np.where(hidden, -np.inf, s)
    if mask is not None:
        s = s + np.tile(mask.reshape(pad4(mask.shape)),
                        [a // b for a, b in zip(s.shape, pad4(mask.shape))]).astype(s.dtype)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))  # all hidden: e = 0
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1)


def attn_ref(q, k, v, scale, causal=False, mask=None):
    return np.matmul(probs(q, k, scale, causal, mask), expand_kv(v, q)).reshape(q.shape)


def fold_kv(g4, like):
    """The adjoint of expand_kv: sum the q-head gradients of each kv head."""
    l4 = pad4(like.shape)
    r0, r1 = g4.shape[0] // l4[0], g4.shape[1] // l4[1]
    return g4.reshape(l4[0], r0, l4[1], r1, *g4.shape[2:]).sum(axis=(1, 3)).reshape(like.shape)


def attn_back_ref(q, k, v, dout, scale, causal=False, mask=None):
    p = probs(q, k, scale, causal, mask)
    q4, do4 = q.reshape(pad4(q.shape)), dout.reshape(pad4(q.shape))
    k4, v4 = expand_kv(k, q), expand_kv(v, q)
    dp = np.matmul(do4, np.swapaxes(v4, -1, -2))
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True)) * q.dtype.type(scale)
    dq = np.matmul(ds, k4)
    dk = fold_kv(np.matmul(np.swapaxes(ds, -1, -2), q4), k)
    dv = fold_kv(np.matmul(np.swapaxes(p, -1, -2), do4), v)
    return np.concatenate([dq.reshape(-1), dk.reshape(-1), dv.reshape(-1)])


# -- dispatches -----------------------------------------------------------------------------------
# Every kernel binds (mask, k, v, q-or-scratch); without a mask k stands in for it, unread.

def rows(t) -> int:
    return t.nelements // t.shape[-1]


class Parts(NamedTuple):
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    dout: Tensor | None
    causal: bool

    @property
    def mask_slot(self) -> Tensor:
        """What src0 binds: the mask, or k standing in (unread)."""
        return self.k if self.mask is None else self.mask


def parts(node) -> Parts:
    """The sources and causal rule of any of the four ops."""
    srcs = list(node.srcs)
    q, k, v = srcs[:3]
    mask = srcs.pop(3) if node.op.startswith("flash_attn_ext") else None
    dout = srcs[3] if len(srcs) > 3 else None
    return Parts(q, k, v, mask, dout, bool(node.params.get("causal", False)))


def uniforms(node, at: Parts, dv_at=0):
    return {"f": (float(node.params["scale"]),),
            "u": (int(at.causal), dv_at, int(at.mask is not None))}


def forward_dispatch(node):
    at = parts(node)
    return [Dispatch("flash_attn", node, (at.mask_slot, at.k, at.v, at.q), n=rows(node),
                     **uniforms(node, at))]


def backward_dispatch(node):
    """Three passes, no atomics: per query row the softmax statistics (log-sum-exp and
    D = dout . out) into a private scratch next to copies of q and dout; then dQ per query
    row; then dK and dV per key row. The scratch stands in for q and dout in the last two (a
    dispatch binds at most four sources), and dout is copied into it first."""
    at = parts(node)
    q, k, v, mask = at.q, at.k, at.v, at.mask_slot
    d = q.shape[-1]
    # scratch row: [q (d) | dout (d) | lse | D], one per query row
    scratch = Tensor(pad4(q.shape)[:3] + (2 * d + 2,), name=f"{node} softmax statistics")
    dout_in = scratch.layout(pad4(q.shape), scratch.strides, d)
    dq = node.layout(q.shape, contiguous_strides(q.shape), node.offset)
    dk = node.layout(k.shape, contiguous_strides(k.shape), node.offset + q.nelements)
    return [Dispatch("cpy", dout_in, (at.dout,), n=q.nelements, shader="layout"),
            Dispatch("flash_attn_back_stats", scratch, (mask, k, v, q), n=rows(q),
                     **uniforms(node, at)),
            Dispatch("flash_attn_back_q", dq, (mask, k, v, scratch), n=rows(q),
                     **uniforms(node, at)),
            # dV lies k.nelements after dK in the same storage
            Dispatch("flash_attn_back_kv", dk, (mask, k, v, scratch), n=rows(k),
                     **uniforms(node, at, k.nelements))]


# -- backward rules -------------------------------------------------------------------------------

def split(t, *shapes):
    """Contiguous views of 1-D `t`, one after another."""
    t = t if t.is_contiguous() else O.cont(t)
    out, at = [], 0
    for shape in shapes:
        out.append(O.view(t, shape, contiguous_strides(shape), at))
        at += int(np.prod(shape))
    return out


def same_attention(node):
    """The forward and backward constructors (q, k, v[, dout]) -> Tensor with node's mask,
    scale and causal rule."""
    at, scale = parts(node), node.params["scale"]
    mask, causal = at.mask, at.causal
    if mask is None:
        return (lambda q, k, v: O.flash_attn(q, k, v, scale, causal),
                lambda q, k, v, dout: O.flash_attn_back(q, k, v, dout, scale, causal))
    return (lambda q, k, v: O.flash_attn_ext(q, k, v, mask, scale),
            lambda q, k, v, dout: O.flash_attn_ext_back(q, k, v, mask, dout, scale))


def attn_backward(node, g):
    """The backward of flash_attn and flash_attn_ext: dq, dk, dv from one *_back node; the
    mask takes none."""
    q, k, v, mask, _, _ = parts(node)
    _, back = same_attention(node)
    grads = tuple(split(back(q, k, v, g), q.shape, k.shape, v.shape))
    return grads if mask is None else grads + (None,)


def concat_last(a, b):
    """[a, b] along the innermost dim (a and b of one shape), built with acc."""
    shape = a.shape[:-1] + (2 * a.shape[-1],)
    strides = contiguous_strides(shape)
    return O.acc(O.acc(zeros(shape), a, strides, 0), b, strides, a.shape[-1])


def attn_back_backward(node, g):
    """The gradient w.r.t. dout; q, k, v (and the mask) take none (no second derivatives
    of attention).

    The *_back ops are linear in dout. With G = [Gq, Gk, Gv] (g split like the result), the
    gradient is attention(q, k, Gv) plus, per query row i,
        sum_j P_ij (b_ij - sum_l P_il b_il) V_j * scale,  b_ij = Gq_i . K_j + Q_i . Gk_j,
    which is exactly the second half of dQ' from the backward on doubled head dims:
    q' = [Q, 0], k' = [K, V] (same scores, so the same softmax P under the same mask),
    v' = [K, Gk], dout' = [Gq, Q]. Exact, and the cost of one attention backward at head
    dim 2d (d <= MAX_D / 2)."""
    q, k, v, mask, _, _ = parts(node)
    fwd, back = same_attention(node)
    gq, gk, gv = split(g, q.shape, k.shape, v.shape)
    d = q.shape[-1]
    big = back(concat_last(q, zeros(q.shape)), concat_last(k, v), concat_last(k, gk),
               concat_last(gq, q))
    shape2 = q.shape[:-1] + (2 * d,)
    from_scores = O.view(big, q.shape, contiguous_strides(shape2), d)  # second half of dQ'
    no_grads = (None,) * (4 if mask is not None else 3)
    return no_grads + (O.add(from_scores, fwd(q, k, gv)),)


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


def ext_cases(with_dout=False):
    """(q, k, v, mask[, dout]) cases. Masks (testing.MASKS) hold values in [-1, 1] where a
    key is seen and -inf where not: 'causal', 'documents' (packed rows: each query sees the
    keys of its own document up to itself), 'hidden_rows' (documents, and every third query
    row sees nothing); plain uniform masks hide nothing."""
    def case(q, kv, mask, dist="documents", layouts=("contiguous",) * 4, grad=True,
             scale=None):
        ins = [Input(q, layout=layouts[0]), Input(kv, layout=layouts[1]),
               Input(kv, layout=layouts[2]), Input(mask, layout=layouts[3], dist=dist)]
        if with_dout:
            ins.append(Input(q, layout=OTHER[layouts[0]]))
        scale = scale or round(float(1 / np.sqrt(q[-1])), 4)
        return Case(tuple(ins), {"scale": scale}, grad)
    return [case((1, 2, 3, 4), (1, 2, 5, 4), (3, 5), "uniform"),      # nothing hidden
            case((1, 2, 5, 4), (1, 2, 5, 4), (5, 5), "causal"),
            case((1, 4, 7, 3), (1, 2, 7, 3), (7, 7)),                 # GQA, d odd, documents
            case((2, 4, 6, 5), (2, 2, 6, 5), (2, 1, 6, 6), scale=1.3),  # a mask per batch
            case((2, 2, 6, 2), (1, 1, 8, 2), (2, 1, 6, 8), "hidden_rows"),  # batch broadcast
            case((2, 1, 5, 4), (2, 1, 5, 4), (5, 5), "hidden_rows",
                 ("permuted", "strided", "permuted", "strided")),     # views
            case((3, 4), (5, 4), (3, 5), "uniform",
                 ("strided", "permuted", "contiguous", "permuted")),  # 2-D
            case((1, 1, 1, 1), (1, 1, 1, 1), (1, 1), "uniform"),
            case((1, 2, 4, 3), (1, 2, 6, 3), (1, 6), "uniform", scale=60.0),  # one mask row
            case((1, 2, 4, 3), (1, 2, 4, 3), (1, 2, 4, 4), "hidden_rows"),    # a mask per head
            case((1, 4, 128, 64), (1, 4, 128, 64), (128, 128), grad=False),
            case((2, 4, 67, 33), (2, 2, 130, 33), (2, 1, 67, 130), "hidden_rows",
                 ("permuted", "strided", "contiguous", "strided"), grad=False),
            case((1, 2, 33, MAX_D), (1, 1, 40, MAX_D), (33, 40), "causal", grad=False)]


flash_attn = register(
    "flash_attn", n_srcs=3, params=("scale", "causal"), shape=flash_attn_shape,
    shader="attention", reference=attn_ref, dispatches=forward_dispatch,
    backward=attn_backward, cases=attn_cases,
    doc="softmax(scale * q @ k^T + causal mask) @ v over the keys, fused (no score matrix). "
        "q [.., n_head, n_q, d], k, v [.., n_head_kv, n_kv, d] with query head h reading kv "
        "head h // (n_head / n_head_kv); causal hides key j from query i when "
        "j > i + n_kv - n_q.")

flash_attn_back = register(
    "flash_attn_back", n_srcs=4, params=("scale", "causal"), shape=flash_attn_back_shape,
    shader="attention", entry="flash_attn_back_q", reference=attn_back_ref,
    dispatches=backward_dispatch, backward=attn_back_backward, no_grad=(0, 1, 2),
    cases=lambda: attn_cases(with_dout=True),
    doc="The backward of flash_attn for output gradient dout: dQ, dK, dV (each contiguous "
        "in the shape of q, k, v) one after another in one 1-D tensor, as ggml's "
        "flash_attn_back.")

flash_attn_ext = register(
    "flash_attn_ext", n_srcs=4, params=("scale",), shape=flash_attn_ext_shape,
    shader="attention", entry="flash_attn",
    reference=lambda q, k, v, mask, scale: attn_ref(q, k, v, scale, mask=mask),
    dispatches=forward_dispatch, backward=attn_backward, no_grad=(3,), cases=ext_cases,
    doc="softmax(scale * q @ k^T + mask) @ v over the keys, fused (ggml's flash_attn_ext "
        "without ALiBi): q, k, v as flash_attn's; the f32 mask tiles the scores [.., n_head, "
        "n_q, n_kv] (e.g. [n_q, n_kv] or [batch, 1, n_q, n_kv]) and carries causality. Keys "
        "at -inf are hidden; a query that sees no key gives 0 (and zero gradients). The "
        "mask takes no gradient.")

flash_attn_ext_back = register(
    "flash_attn_ext_back", n_srcs=5, params=("scale",), shape=flash_attn_ext_back_shape,
    shader="attention", entry="flash_attn_back_q",
    reference=lambda q, k, v, mask, dout, scale: attn_back_ref(q, k, v, dout, scale,
                                                               mask=mask),
    dispatches=backward_dispatch, backward=attn_back_backward, no_grad=(0, 1, 2, 3),
    cases=lambda: ext_cases(with_dout=True),
    doc="The backward of flash_attn_ext for output gradient dout: dQ, dK, dV packed as "
        "flash_attn_back's; the mask takes no gradient.")

__all__ = ["flash_attn", "flash_attn_back", "flash_attn_ext", "flash_attn_ext_back"]
