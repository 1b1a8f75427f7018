"""Softmax family over the innermost dim: soft_max, soft_max_ext (additive mask), their
backward soft_max_back, the causal masks diag_mask_inf / diag_mask_zero, and
cross_entropy_loss with cross_entropy_loss_back, and cross_entropy_ids (int32 target ids,
what training feeds) with cross_entropy_ids_back.

Shader: shaders/softmax.wgsl; the row ops run one workgroup per row, or one invocation per
row (the 'rowwise' variant, for CPU adapters: ggwgpu/kernels.py), and subtract the row max
before exp (f32 exp overflows past 88).

    soft_max(x, s, n_past)     y = softmax(x * s), over each row's causal part where n_past
                               >= 0: soft_max(diag_mask_inf(x, n_past), s) in one pass
                               that skips the masked end of each row (attention's scores)
    soft_max_ext(x, m, s)      y = softmax(x * s + m), m tiled over x (ggml broadcasting;
                               the usual mask is [rows, cols], shared by batches and heads)
    soft_max_back(y, dy)       dx = y * (dy - sum(y * dy))  (linear time, no n x n Jacobian)
    diag_mask_inf(x, n_past)   x with -inf where col > n_past + row, in every matrix
    cross_entropy_loss(x, p)   -sum(p * log_softmax(x)) / n_rows, shape (1,)
    cross_entropy_ids(x, t, w) -sum over rows r with t[r] >= 0 of w[r] * log_softmax(x[r])[t[r]],
                               shape (1,); a negative id ignores its row
    cross_entropy_ids_rows(x, t, w)  the same terms, row by row: shape x.shape[:-1]
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..kernels import ROW_VARIANTS, row_module
from ..tensor import ShapeError, Tensor, constant
from .registry import (Case, Dispatch, Input, can_repeat, need_float, register,
                       register_row_modules, row_dispatch, split_rows, tile)
from .rows import check_range
from .elementwise import LARGE, reduce_to, tiled
from .reduce import sum_into


def n_rows(t) -> int:
    """Rows of a tensor or array: elements / innermost dim."""
    return int(np.prod(t.shape[:-1]))


def softmax_dispatch(node, variant="workgroup", **uniforms):
    """The row kernel of the variant over the rows of the first source."""
    return [row_dispatch(node, variant, **uniforms)]


def same_shapes(*srcs):
    need_float(*srcs)
    if any(s.shape != srcs[0].shape for s in srcs):
        raise ShapeError(f"inputs must have the same shape, got {[s.shape for s in srcs]}")


def softmax_ref(v):
    e = np.exp(v - np.max(v, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def softmax_into(out, v):
    """softmax_ref(v) into out (v may be out): the same operations, no temporaries but the
    row maxima and sums."""
    np.subtract(v, np.max(v, axis=-1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= np.sum(out, axis=-1, keepdims=True)


def soft_max_into(out, x, scale, mask=None, n_past=-1):
    if scale == 1 and mask is None and n_past < 0:   # x * 1 is x: one pass fewer
        softmax_into(out, x)
        return
    np.multiply(x, x.dtype.type(scale), out=out)
    if mask is not None:
        out += tiled(mask, x.shape)
    if n_past >= 0:
        diag_mask_into(out, out, n_past, -np.inf)
    softmax_into(out, out)


def log_softmax_ref(v):
    c = v - np.max(v, axis=-1, keepdims=True)
    return c - np.log(np.sum(np.exp(c), axis=-1, keepdims=True))


# Shapes of the row-op cases: a row of one, rows longer than one workgroup (67, odd), views,
# and more than 65535 rows (the row grid folds into 2-D; grad=False; attention has that many
# rows: n_ctx * n_head * batch).
ROW_SHAPES = [((1,), "contiguous", True), ((5, 1, 7), "contiguous", True),
              ((3, 4, 67), "contiguous", True), ((2, 3, 5), "permuted", True),
              ((4, 9), "strided", True), ((2, 3, 4, 5), "contiguous", False),
              ((70001, 3), "contiguous", False)]
OTHER = {"contiguous": "contiguous", "permuted": "strided", "strided": "permuted"}

# -- soft_max ----------------------------------------------------------------------------------


def soft_max_shape(srcs, scale, n_past=-1):
    need_float(*srcs)
    if not -1 <= int(n_past) < 2 ** 31:
        raise ShapeError(f"n_past must be -1 (no mask) or in [0, 2^31), got {n_past}")
    return srcs[0].shape, "f32", {}


def soft_max_ref(x, scale, n_past=-1):
    v = x * x.dtype.type(scale)
    return softmax_ref(v if n_past < 0 else diag_mask_ref(v, n_past, -np.inf))


def soft_max_ext_shape(srcs, scale):
    x, mask = srcs
    need_float(x, mask)
    if not can_repeat(mask.shape, x.shape):
        raise ShapeError(f"mask {mask.shape} does not tile x {x.shape}")
    return x.shape, "f32", {}


def scaled(g, s):
    return g if s == 1.0 else O.scale(g, s)


def soft_max_ext_backward(node, g):
    d = O.soft_max_back(node, g)  # the gradient w.r.t. x * scale + mask
    return scaled(d, node.params["scale"]), reduce_to(d, node.srcs[1])


soft_max = register(
    "soft_max", n_srcs=1, params=("scale", "n_past"), defaults={"n_past": -1},
    shape=soft_max_shape, shader="softmax", reference=soft_max_ref,
    fast=lambda out, x, scale, n_past: soft_max_into(out, x, scale, n_past=n_past),
    split=split_rows(keep=2),     # the causal rule needs a matrix's rows in one piece
    dispatches=lambda n, variant="workgroup": softmax_dispatch(
        n, variant, f=(float(n.params["scale"]),),
        u=(0, int(n.params["n_past"] >= 0), max(0, n.params["n_past"]))),
    variants=ROW_VARIANTS,
    # the masked ends of the rows are 0 in y: soft_max_back gives them 0, as
    # diag_mask_zero would
    backward=lambda n, g: (scaled(O.soft_max_back(n, g), n.params["scale"]),),
    cases=lambda: [Case((Input(shape, -4, 4, layout),), {"scale": 1.0}, grad)
                   for shape, layout, grad in ROW_SHAPES]
    + [Case((Input((3, 17), 60, 100),), {"scale": 1.0}),    # exp(x) alone would overflow
       Case((Input((4, 6), layout="permuted"),), {"scale": -0.35}),
       # causal: square and wider than tall, rows past a workgroup, views, a row of one
       Case((Input((2, 3, 6, 6), -4, 4),), {"scale": 1.0, "n_past": 0}),
       Case((Input((3, 5, 9), -4, 4, "permuted"),), {"scale": 0.5, "n_past": 2}),
       Case((Input((4, 70), -4, 4, "strided"),), {"scale": 1.0, "n_past": 60}),
       Case((Input((2, 67, 67), -4, 4),), {"scale": 0.125, "n_past": 0}, grad=False),
       Case((Input((5,), -4, 4),), {"scale": 2.0, "n_past": 1}),
       Case((Input((3, 4), -4, 4),), {"scale": 1.0, "n_past": 7})],   # nothing masked
    doc="softmax(x * scale) over the innermost dim (ggml_soft_max with scale; scale 1.0 "
        "for the plain one); with n_past >= 0 over each row's causal part only, as "
        "soft_max(diag_mask_inf(x, n_past), scale) (attention's scores), the masked "
        "columns 0.")

soft_max_ext = register(
    "soft_max_ext", n_srcs=2, params=("scale",), shape=soft_max_ext_shape, shader="softmax",
    entry="soft_max",
    reference=lambda x, m, scale: softmax_ref(x * x.dtype.type(scale) + tile(m, x.shape)),
    fast=lambda out, x, m, scale: soft_max_into(out, x, scale, m), split=split_rows(keep=1),
    dispatches=lambda n, variant="workgroup": softmax_dispatch(
        n, variant, f=(float(n.params["scale"]),), u=(1,)),
    variants=ROW_VARIANTS,
    backward=soft_max_ext_backward,
    cases=lambda: [Case((Input((5, 7), -4, 4), Input((5, 7))), {"scale": 1.0}),
                   Case((Input((2, 3, 5, 7), -4, 4), Input((5, 7))), {"scale": 0.35}),
                   Case((Input((5, 7), -4, 4), Input((1, 7))), {"scale": 1.0}),
                   Case((Input((3, 4, 67), -4, 4), Input((4, 67), layout="strided")),
                        {"scale": 0.125}),
                   Case((Input((2, 4, 6), -4, 4, "permuted"), Input((4, 6), layout="permuted")),
                        {"scale": 2.0}),
                   Case((Input((1,)), Input((1,))), {"scale": 1.0}),
                   Case((Input((3, 8, 16, 40), -4, 4), Input((16, 40))), {"scale": 0.25},
                        grad=False)],
    doc="softmax(x * scale + mask) over the innermost dim, mask tiled over x (ggml "
        "broadcasting, e.g. [rows, cols] shared by every batch and head), as "
        "ggml_soft_max_ext without ALiBi (max_bias 0).")


def soft_max_back_shape(srcs):
    same_shapes(*srcs)
    return srcs[0].shape, "f32", {}


def soft_max_back_ref(y, dy):
    return y * (dy - np.sum(y * dy, axis=-1, keepdims=True))


def soft_max_back_into(out, y, dy):
    np.multiply(y, dy, out=out)
    np.subtract(dy, np.sum(out, axis=-1, keepdims=True), out=out)
    out *= y


# Second derivatives are not supported: y takes no gradient. The op is linear in dy with
# the symmetric Jacobian diag(y) - y y^T, so its dy-gradient is the op itself.
soft_max_back = register(
    "soft_max_back", n_srcs=2, shape=soft_max_back_shape, shader="softmax",
    reference=soft_max_back_ref, fast=soft_max_back_into, split=split_rows(keep=1),
    no_grad=(0,),
    dispatches=softmax_dispatch, variants=ROW_VARIANTS,
    backward=lambda n, g: (None, O.soft_max_back(n.srcs[0], g)),
    cases=lambda: [Case((Input(shape, layout=layout, dist="probs"),
                         Input(shape, layout=OTHER[layout])), {}, grad)
                   for shape, layout, grad in ROW_SHAPES],
    doc="The backward of soft_max: y * (dy - sum(y * dy)) per row. Inputs y (the softmax "
        "output), dy.")

# -- causal masks --------------------------------------------------------------------------------


def diag_mask_shape(srcs, n_past):
    need_float(*srcs)
    if not 0 <= int(n_past) < 2 ** 31:
        raise ShapeError(f"n_past must be in [0, 2^31), got {n_past}")
    return srcs[0].shape, "f32", {}


def diag_masked(x, n_past):
    """Where the mask goes: [rows, cols] of x's two innermost dims ([cols] for a row)."""
    rows = x.shape[-2] if x.ndim > 1 else 1
    masked = np.arange(x.shape[-1])[None, :] > n_past + np.arange(rows)[:, None]  # [rows, cols]
    return masked if x.ndim > 1 else masked[0]


def diag_mask_ref(x, n_past, fill):
    return np.where(diag_masked(x, n_past), x.dtype.type(fill), x)


def diag_mask_into(out, x, n_past, fill):
    """x into out, then `fill` over the masked end of each row (its columns past n_past +
    row), one slice a row: half the time of a where over every element."""
    np.copyto(out, x)
    if x.ndim == 1:
        out[n_past + 1:] = fill
        return
    for row in range(min(x.shape[-2], max(0, x.shape[-1] - n_past - 1))):
        out[..., row, n_past + row + 1:] = fill


def diag_mask_dispatch(node, fill):
    # fill comes in as a uniform: WGSL has no infinity literal. The kernel is in both of the
    # family's variant modules (row ops or not); either serves.
    return [Dispatch("diag_mask", node, node.srcs, n=node.nelements, f=(fill,),
                     u=(int(node.params["n_past"]),), shader=row_module("softmax", "workgroup"))]


def diag_mask_cases(large=False):
    cases = [Case((Input((5, 7)),), {"n_past": 2}),
             Case((Input((3, 4, 6)),), {"n_past": 0}),
             Case((Input((2, 3, 5), layout="permuted"),), {"n_past": 1}),
             Case((Input((4, 9), layout="strided"),), {"n_past": 3}),
             Case((Input((4, 3)),), {"n_past": 5}),      # nothing masked
             Case((Input((1,)),), {"n_past": 0}),
             Case((Input((2, 3, 4, 5)),), {"n_past": 1}, grad=False)]
    # a folded 2-D grid: only once for the kernel both masks share (0.4 s on lavapipe)
    return cases + [Case((Input((LARGE,)),), {"n_past": LARGE // 2}, grad=False)] * large


diag_mask_inf = register(
    "diag_mask_inf", n_srcs=1, params=("n_past",), shape=diag_mask_shape, shader="softmax",
    f16_nmse=0.0,  # exact: copies halves, or masks them
    entry="diag_mask", reference=lambda x, n_past: diag_mask_ref(x, n_past, -np.inf),
    fast=lambda out, x, n_past: diag_mask_into(out, x, n_past, -np.inf),
    dispatches=lambda n: diag_mask_dispatch(n, -np.inf),
    backward=lambda n, g: (O.diag_mask_zero(g, n.params["n_past"]),),
    cases=diag_mask_cases, grad_head=lambda n: O.soft_max(n, 1.0),
    doc="x with -inf at (row i, col j) where j > n_past + i, in every matrix of the two "
        "innermost dims (causal attention mask, as ggml_diag_mask_inf).")

diag_mask_zero = register(
    "diag_mask_zero", n_srcs=1, params=("n_past",), shape=diag_mask_shape, shader="softmax",
    f16_nmse=0.0,  # exact: copies halves, or masks them
    entry="diag_mask", reference=lambda x, n_past: diag_mask_ref(x, n_past, 0.0),
    fast=lambda out, x, n_past: diag_mask_into(out, x, n_past, 0.0),
    dispatches=lambda n: diag_mask_dispatch(n, 0.0),
    backward=lambda n, g: (O.diag_mask_zero(g, n.params["n_past"]),),
    cases=lambda: diag_mask_cases(large=True),
    doc="x with 0 where diag_mask_inf puts -inf: the backward of diag_mask_inf.")

# -- cross-entropy -------------------------------------------------------------------------------

def ce_shape(srcs):
    same_shapes(*srcs)
    return (1,), "f32", {}


def ce_ref(x, p):
    return (-np.sum(p * log_softmax_ref(x), dtype=x.dtype) / n_rows(x)).reshape(1)


def ce_dispatch(node, variant="workgroup"):
    """Each row's share of the loss into a private scratch, then their sum with reduce's
    k_sum."""
    x = node.srcs[0]
    rows = n_rows(x)
    losses = Tensor((rows,), name=f"{node} row losses")  # dispatch-private storage
    return [row_dispatch(node, variant, losses, f=(1.0 / rows,)), *sum_into(node, losses)]


def ce_backward(node, g):
    x, p = node.srcs
    # d/dp = -log_softmax(x) * g / n_rows, composed from existing ops as log(soft_max(x)):
    # -inf where a softmax entry underflows f32 (logits more than ~87 apart). Targets are
    # data in training; this gradient is for the rare graph that learns them.
    dp = O.mul(O.log(O.soft_max(x, 1.0)), O.scale(g, -1.0 / n_rows(x)))
    return O.cross_entropy_loss_back(x, p, g), dp


def ce_cases():
    probs = lambda shape, layout="contiguous": Input(shape, layout=layout, dist="probs")
    return [Case((Input((1, 3), -0.1, 0.1), probs((1, 3)))),
            Case((Input((5, 7), -4, 4), probs((5, 7)))),
            Case((Input((3, 4, 67), -4, 4), probs((3, 4, 67)))),
            # views: permuted / strided target rows no longer sum to 1; the loss and its
            # gradient hold for any p
            Case((Input((2, 3, 5), -4, 4, "permuted"), probs((2, 3, 5), "strided"))),
            Case((Input((4, 9), -0.1, 0.1, "strided"), probs((4, 9), "permuted"))),
            Case((Input((2, 3, 4, 5), -4, 4), probs((2, 3, 4, 5))), grad=False),
            Case((Input((70001, 3), -4, 4), probs((70001, 3))), grad=False)]


cross_entropy_loss = register(
    "cross_entropy_loss", n_srcs=2, shape=ce_shape, shader="softmax", reference=ce_ref,
    result="f32",
    dispatches=ce_dispatch, variants=ROW_VARIANTS, backward=ce_backward, cases=ce_cases,
    doc="-sum(p * log_softmax(x)) / n_rows for logits x and target probabilities p (rows "
        "over the innermost dim), shape (1,); as ggml_cross_entropy_loss, with an exact "
        "log-sum-exp instead of log(softmax * (1 - 1e-9) + 1e-9).")


def ce_back_shape(srcs):
    x, p, d = srcs
    same_shapes(x, p)
    need_float(d)
    if d.nelements != 1:
        raise ShapeError(f"dloss must have one element, has shape {d.shape}")
    return x.shape, "f32", {}


def ce_back_ref(x, p, d):
    s = softmax_ref(x)
    return (s * np.sum(p, axis=-1, keepdims=True) - p) * (d.reshape(-1)[0] / n_rows(x))


def ce_back_backward(node, g):
    # Linear in dloss: d/d(dloss) = sum(g * cross_entropy_loss_back(x, p, 1)). Second
    # derivatives in x and p are not supported.
    x, p, d = node.srcs
    one = constant(np.ones(d.shape, np.float32), name="one")
    return None, None, O.reshape(O.sum(O.mul(g, O.cross_entropy_loss_back(x, p, one))), d.shape)


cross_entropy_loss_back = register(
    "cross_entropy_loss_back", n_srcs=3, shape=ce_back_shape, shader="softmax",
    reference=ce_back_ref, no_grad=(0, 1), backward=ce_back_backward,
    dtype_from=(0,),  # the logits' gradient has their type (the loss's gradient is f32)
    dispatches=lambda n, variant="workgroup": softmax_dispatch(
        n, variant, f=(1.0 / n_rows(n.srcs[0]),)),
    variants=ROW_VARIANTS,
    # no 70001-row case (0.4 s): the row indexing is cross_entropy_loss's
    cases=lambda: [Case((*c.inputs, Input((1,))), grad=c.grad) for c in ce_cases()[:-1]],
    doc="The backward of cross_entropy_loss w.r.t. the logits: (softmax(x) * sum(p) - p) * "
        "dloss / n_rows (ggml's (softmax(x) - p) * dloss / n_rows when rows of p sum to 1). "
        "Inputs x, p, dloss (one element).")

# -- cross-entropy with target ids ---------------------------------------------------------------
# Training targets are token ids, not probability rows: no one-hot of batch x n_vocab floats
# to upload. A row weight input w makes the mean: the caller puts 1 / (counted rows of the
# whole batch) on counted rows, so a batch split into row chunks still averages over all of
# it (ggwgpu.models.TrainGraph.feeds). Ignored rows (negative id) give 0 and a zero
# gradient whatever their weight and logits.

def check_ce_ids(srcs):
    x, ids, w = srcs[:3]
    need_float(x, w, *srcs[3:])
    if x.ndim < 2:
        raise ShapeError(f"logits must have rows (at least 2 dims), have shape {x.shape}")
    if ids.dtype != "i32":
        raise ShapeError(f"target ids must be i32, got {ids.dtype}")
    if ids.shape != x.shape[:-1] or w.shape != x.shape[:-1]:
        raise ShapeError(f"target ids {ids.shape} and row weights {w.shape} must have the "
                         f"logits' row shape {x.shape[:-1]}")


def ce_ids_shape(srcs):
    check_ce_ids(srcs)
    return (1,), "f32", {}


def ce_ids_terms(x, ids):
    """Per row: counted (id >= 0), and the one-hot of the id (of id 0 on ignored rows)."""
    check_range("cross_entropy_ids", np.maximum(ids, 0), x.shape[-1])
    counted = ids >= 0
    onehot = np.arange(x.shape[-1]) == np.maximum(ids, 0)[..., None]
    return counted, onehot


def ce_ids_ref(x, ids, w):
    counted, onehot = ce_ids_terms(x, ids)
    picked = np.sum(np.where(onehot, log_softmax_ref(x), 0), axis=-1)
    return np.sum(np.where(counted, -picked * w, 0), dtype=x.dtype).reshape(1)


def ce_ids_row_terms(x, ids, w):
    """Each row's w * -log_softmax(x)[id] (0 where the id is negative), without a one-hot or
    a log_softmax the size of x: the log-softmax of the picked entries only, each computed
    as the reference does."""
    check_range("cross_entropy_ids", np.maximum(ids, 0), x.shape[-1])
    top = np.max(x, axis=-1, keepdims=True)
    e = np.subtract(x, top)
    np.exp(e, out=e)
    picked = np.take_along_axis(x, np.maximum(ids, 0)[..., None], axis=-1) - top
    picked -= np.log(np.sum(e, axis=-1, keepdims=True))
    return np.where(ids >= 0, -picked[..., 0] * w, 0)


def ce_ids_into(out, x, ids, w):
    """ce_ids_ref, summing ce_ids_row_terms."""
    out[0] = np.sum(ce_ids_row_terms(x, ids, w), dtype=x.dtype)


def ce_ids_dispatch(node, variant="workgroup"):
    """Each row's weighted loss into a private scratch, then their sum (reduce's k_sum), as
    cross_entropy_loss does."""
    rows = n_rows(node.srcs[0])
    losses = Tensor((rows,), name=f"{node} row losses")  # dispatch-private storage
    return [row_dispatch(node, variant, losses), *sum_into(node, losses)]


def ce_ids_cases():
    """Logits, ids in [-2, n_vocab) (negative ones ignore their rows; none in the first
    case, all in the second) and weights in [0, 1), with views of each."""
    cases = []
    for x, layout, id_layout, grad in [
            ((1, 3), "contiguous", "contiguous", True), ((5, 7), "contiguous", "contiguous", True),
            ((3, 4, 67), "contiguous", "contiguous", True),
            ((2, 3, 5), "permuted", "strided", True), ((4, 9), "strided", "permuted", True),
            ((2, 3, 4, 5), "contiguous", "contiguous", False),
            ((2, 40000), "contiguous", "contiguous", False),   # past ROWWISE_MAX
            ((70001, 3), "contiguous", "contiguous", False)]:
        lo = 0 if x == (1, 3) else -2
        cases.append(Case((Input(x, -4, 4, layout), Input(x[:-1], lo, x[-1], id_layout, "i32"),
                           Input(x[:-1], 0, 1, OTHER[id_layout])), grad=grad))
    # every row ignored: loss and gradient 0
    return cases[:1] + [Case((Input((3, 5)), Input((3,), -3, 0, dtype="i32"),
                              Input((3,), 0, 1)))] + cases[1:]


cross_entropy_ids = register(
    "cross_entropy_ids", n_srcs=3, shape=ce_ids_shape, shader="softmax", reference=ce_ids_ref,
    result="f32",
    fast=ce_ids_into, no_grad=(1, 2),
    dispatches=ce_ids_dispatch, variants=ROW_VARIANTS,
    backward=lambda n, g: (O.cross_entropy_ids_back(*n.srcs, g), None, None),
    cases=ce_ids_cases,
    doc="Cross-entropy of logits x [..., n_vocab] against int32 target ids [...] with row "
        "weights w [...]: -sum of w[r] * log_softmax(x[r])[ids[r]] over the rows whose id is "
        ">= 0 (a negative id ignores its row), shape (1,). With w = 1 / (rows counted) on "
        "counted rows it is the mean loss per counted token. ids and w take no gradient. "
        "Ids >= n_vocab raise IndexError in the reference; the shaders clamp them.")


def ce_ids_back_ref(x, ids, w, d):
    counted, onehot = ce_ids_terms(x, ids)
    k = np.where(counted, w * d.reshape(-1)[0], 0)[..., None]
    return ((softmax_ref(x) - onehot) * k).astype(x.dtype)


def ce_ids_back_into(out, x, ids, w, d):
    """ce_ids_back_ref with the one-hot subtracted at the ids only."""
    check_range("cross_entropy_ids", np.maximum(ids, 0), x.shape[-1])
    softmax_into(out, x)
    rows = out.reshape(-1, out.shape[-1])
    rows[np.arange(len(rows)), np.maximum(ids, 0).reshape(-1)] -= 1
    out *= np.where(ids >= 0, w * d.reshape(-1)[0], 0)[..., None]


def ce_ids_back_backward(node, g):
    # Linear in dloss: d/d(dloss) = sum(g * cross_entropy_ids_back(x, ids, w, 1)). Second
    # derivatives in x are not supported.
    x, ids, w, d = node.srcs
    one = constant(np.ones(d.shape, np.float32), name="one")
    dd = O.reshape(O.sum(O.mul(g, O.cross_entropy_ids_back(x, ids, w, one))), d.shape)
    return None, None, None, dd


def ce_ids_back_shape(srcs):
    check_ce_ids(srcs)
    if srcs[3].nelements != 1:
        raise ShapeError(f"dloss must have one element, has shape {srcs[3].shape}")
    return srcs[0].shape, "f32", {}


cross_entropy_ids_back = register(
    "cross_entropy_ids_back", n_srcs=4, shape=ce_ids_back_shape, shader="softmax",
    reference=ce_ids_back_ref, fast=ce_ids_back_into, no_grad=(0, 1, 2),
    split=split_rows(keep=1, rows=(1, 2), whole=(3,)),   # ids and weights: one per row
    backward=ce_ids_back_backward, dtype_from=(0,),  # as cross_entropy_loss_back
    dispatches=softmax_dispatch, variants=ROW_VARIANTS,
    # no 70001-row case: the row indexing is cross_entropy_ids's
    cases=lambda: [Case((*c.inputs, Input((1,))), grad=c.grad) for c in ce_ids_cases()[:-1]],
    doc="The backward of cross_entropy_ids w.r.t. the logits: (softmax(x) - onehot(ids)) * "
        "w * dloss per row, 0 on ignored rows (negative ids). Inputs x, ids, w, dloss (one "
        "element).")


# -- per-row cross-entropy: the log-probabilities of sequences ---------------------------------
# A preference loss (DPO, ORPO) needs each sequence's log-probability, the sum over its tokens:
# cross_entropy_ids_rows keeps each row's term apart (the kernel of cross_entropy_ids, whose
# row terms it writes as the result instead of a scratch), and a product with a 0/1 matrix
# sums a sequence's rows (ggwgpu.training.preference).

def ce_ids_rows_shape(srcs):
    check_ce_ids(srcs)
    return srcs[0].shape[:-1], "f32", {}


def ce_ids_rows_ref(x, ids, w):
    counted, onehot = ce_ids_terms(x, ids)
    picked = np.sum(np.where(onehot, log_softmax_ref(x), 0), axis=-1)
    return np.where(counted, -picked * w, 0).astype(x.dtype)


def ce_ids_rows_into(out, x, ids, w):
    out[...] = ce_ids_row_terms(x, ids, w)


def ce_ids_rows_backward(node, g):
    # d row_r / d x_r = (softmax(x_r) - onehot(id_r)) * w_r: cross_entropy_ids_back with the
    # row weights times the rows' gradients, and dloss 1
    x, ids, w = node.srcs
    one = constant(np.ones(1, np.float32), name="one")
    return O.cross_entropy_ids_back(x, ids, O.mul(w, g), one), None, None


cross_entropy_ids_rows = register(
    "cross_entropy_ids_rows", n_srcs=3, shape=ce_ids_rows_shape, shader="softmax",
    entry="cross_entropy_ids", reference=ce_ids_rows_ref, result="f32",
    fast=ce_ids_rows_into, no_grad=(1, 2),
    dispatches=lambda node, variant="workgroup": [row_dispatch(node, variant)],
    variants=ROW_VARIANTS, backward=ce_ids_rows_backward, cases=ce_ids_cases,
    doc="Cross-entropy of each row of logits x [..., n_vocab] against int32 target ids [...] "
        "with row weights w [...]: -w[r] * log_softmax(x[r])[ids[r]], 0 where the id is "
        "negative; shape [...] (cross_entropy_ids is its sum). With w = 1 a row's term is "
        "minus its token's log-probability. ids and w take no gradient.")

register_row_modules("softmax")

__all__ = ["soft_max", "soft_max_ext", "soft_max_back", "diag_mask_inf", "diag_mask_zero",
           "cross_entropy_loss", "cross_entropy_loss_back", "cross_entropy_ids",
           "cross_entropy_ids_back", "cross_entropy_ids_rows"]
