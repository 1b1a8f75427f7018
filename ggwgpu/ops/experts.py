"""Mixture-of-experts routing: which experts a token takes (top_k, one_hot) and the products
through the experts it took (mul_mat_id, and its weight gradient out_prod_id), as llama.cpp's
build_moe_ffn uses ggml_argsort_top_k, ggml_get_rows on the router's probabilities and
ggml_mul_mat_id. Shader: shaders/experts.wgsl.

Shapes in NumPy order, T tokens, k experts each of E:
    top_k(x [.., n], k)             -> i32 [.., k]: the k largest of each row, largest first
    one_hot(ids [..], n)            -> [.., n]: 1 where the column is the id
    mul_mat_id(a [E, M, K], b [T, nb, K], ids [T, k])   -> [T, k, M]
        out[t, j] = a[ids[t, j]] @ b[t, j % nb]  (nb: 1, every slot reads the token's row,
        or k, a row per slot: the down projection of each expert's own activations)
    out_prod_id(b [T, nb, K], g [T, k, M], ids [T, k], n_expert)   -> [E, M, K]
        out[e] = sum over the slots (t, j) routed to e of outer(g[t, j], b[t, j % nb])
A token's probability of each expert it took is one_hot(ids) times its row of probabilities
(a product, so the router learns through the ordinary mul_mat backward); the ids take no
gradient, and integer tensors never carry one (graph.build_backward).

out_prod_id adds its slots in slot order without atomics: rows.wgsl's two passes link each
expert's slots into a list (get_rows_back's), then each invocation walks its expert's list
for 4 consecutive elements of the result, the work a dense product would do and no more.
The kernels make 4 outputs an invocation, sharing their loads; they read an expert's
matrix once per slot that took it (a kernel tiled over the slots grouped by expert would
read it once per tile).
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import ShapeError, constant
from .registry import Case, Dispatch, Input, need_float, register
from .rows import check_ids, check_range, id_lists


# -- top_k -----------------------------------------------------------------------------------

def top_k_shape(srcs, k):
    (x,) = srcs
    need_float(x)
    if not 1 <= int(k) <= x.shape[-1]:
        raise ShapeError(f"k {k} must be 1 .. {x.shape[-1]} (the row's length)")
    return x.shape[:-1] + (int(k),), "i32", {}


def top_k_ref(x, k):
    """Stable on -x: equal values in column order, NaN after every number."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k].astype(np.int32)


top_k = register(
    "top_k", n_srcs=1, params=("k",), shape=top_k_shape, shader="experts",
    reference=top_k_ref, f16_nmse=0.0,      # ids: exact
    dispatches=lambda n: [Dispatch("top_k", n, n.srcs, n=n.srcs[0].nelements,
                                   u=(n.params["k"],))],
    backward=lambda n, g: (None,),          # piecewise constant: no gradient
    cases=lambda: [
        Case((Input((1, 1)),), {"k": 1}, grad=False),
        Case((Input((6, 8)),), {"k": 2}, grad=False),
        Case((Input((5, 7), layout="strided"),), {"k": 7}, grad=False),        # a whole sort
        Case((Input((3, 4, 16), layout="permuted"),), {"k": 4}, grad=False),
        Case((Input((700, 128)),), {"k": 8}, grad=False),
    ],
    doc="The columns of the k largest values of each row of x (.., n), largest first, as "
        "int32 (.., k) (ggml_argsort_top_k): equal values in column order, NaN last. No "
        "gradient.")


# -- one_hot ---------------------------------------------------------------------------------

def one_hot_shape(srcs, n):
    (ids,) = srcs
    check_ids(ids)
    if int(n) < 1:
        raise ShapeError(f"n must be >= 1, got {n}")
    return ids.shape + (int(n),), "f32", {}


def one_hot_ref(ids, n):
    check_range("one_hot", ids, n)
    return (ids[..., None] == np.arange(n)).astype(np.float32)


one_hot = register(
    "one_hot", n_srcs=1, params=("n",), shape=one_hot_shape, shader="experts",
    reference=one_hot_ref, no_grad=(0,),
    backward=lambda n, g: (None,),
    cases=lambda: [
        Case((Input((1,), 0, 1, dtype="i32"),), {"n": 1}, grad=False),
        Case((Input((6, 2), 0, 5, dtype="i32"),), {"n": 5}, grad=False),
        Case((Input((3, 4), 0, 9, "permuted", "i32"),), {"n": 9}, grad=False),
        Case((Input((2, 3, 5), 0, 4, "strided", "i32"),), {"n": 4}, grad=False),
    ],
    doc="1.0 where the column is the id, else 0 (torch's one_hot, in f32): int32 ids of "
        "shape S (up to 3 dims) -> S + (n,). Ids outside [0, n) raise IndexError in the "
        "reference; the shader gives them a zero row. No gradient.")


# -- mul_mat_id ------------------------------------------------------------------------------

def check_routed(a_shape, b, ids, name):
    """The checks mul_mat_id and out_prod_id share: b [T, nb, K] rows of T tokens, ids
    [T, k] i32, nb 1 or k; a_shape's K (mul_mat_id's a [E, M, K]) matches b's."""
    check_ids(ids)
    if b.ndim != 3 or ids.ndim != 2 or b.shape[0] != ids.shape[0]:
        raise ShapeError(f"{name} takes b [T, nb, K] and ids [T, k]; got b {b.shape}, "
                         f"ids {ids.shape}")
    if b.shape[1] not in (1, ids.shape[1]):
        raise ShapeError(f"b's {b.shape[1]} rows a token must be 1 or one per expert taken "
                         f"({ids.shape[1]})")
    if a_shape is not None and (len(a_shape) != 3 or a_shape[2] != b.shape[2]):
        raise ShapeError(f"the experts a {a_shape} must be [E, M, K] with b's K {b.shape[2]}")


def slots(b: np.ndarray, k: int) -> np.ndarray:
    """b's row of each slot (T, k, K): its own, or the token's one row for all k."""
    return np.broadcast_to(b, b.shape[:1] + (k,) + b.shape[2:])


def mul_mat_id_shape(srcs):
    a, b, ids = srcs
    need_float(a, b)
    check_routed(a.shape, b, ids, "mul_mat_id")
    return ids.shape + a.shape[1:2], "f32", {}


def mul_mat_id_into(out, a, b, ids):
    """One product per expert over the slots routed to it (in slot order)."""
    check_range("mul_mat_id", ids, a.shape[0])
    rows = slots(b, ids.shape[1])
    out[...] = 0
    for e in np.unique(ids):
        taken = ids == e
        out[taken] = rows[taken] @ a[e].T


def mul_mat_id_ref(a, b, ids):
    out = np.empty(ids.shape + a.shape[1:2], np.result_type(a, b))
    mul_mat_id_into(out, a, b, ids)
    return out


def sum_slots(x, b_shape):
    """x [T, k, K], a gradient per slot, as b's [T, nb, K]: summed over the slots where b
    gives one row to all of them (a product with a row of ones: rows of k alone would be
    T * K rows for a row kernel)."""
    if x.shape == tuple(b_shape):
        return x
    ones = constant(np.ones((1, x.shape[1]), np.float32), name="ones")
    return O.reshape(O.mul_mat(ones, O.permute(x, (0, 2, 1))), b_shape)


def mul_mat_id_backward(node, g):
    a, b, ids = node.srcs
    return (O.out_prod_id(b, g, ids, a.shape[0]),
            sum_slots(O.mul_mat_id(O.transpose(a), g, ids), b.shape), None)


mul_mat_id = register(
    "mul_mat_id", n_srcs=3, shape=mul_mat_id_shape, shader="experts",
    dispatches=lambda n: [Dispatch("mul_mat_id", n, n.srcs,
                                   n=-(-n.shape[-1] // 4) * (n.nelements // n.shape[-1]))],
    reference=mul_mat_id_ref, fast=mul_mat_id_into, no_grad=(2,),
    backward=mul_mat_id_backward, frozen_variant="mul_mat_id_q",
    cases=lambda: [
        Case((Input((1, 1, 1)), Input((1, 1, 1)), Input((1, 1), 0, 1, dtype="i32"))),
        Case((Input((4, 3, 5)), Input((6, 1, 5)), Input((6, 2), 0, 4, dtype="i32"))),
        Case((Input((4, 3, 5), layout="permuted"), Input((6, 2, 5), layout="strided"),
              Input((6, 2), 0, 4, "permuted", "i32"))),                    # a row per slot
        Case((Input((8, 7, 6), layout="strided"), Input((5, 1, 6), layout="permuted"),
              Input((5, 3), 0, 8, "strided", "i32"))),                     # experts unused
        Case((Input((16, 96, 128)), Input((64, 1, 128)), Input((64, 4), 0, 16, dtype="i32")),
             grad=False),
    ],
    doc="The products of each token with the experts it took: a [E, M, K] (E matrices), b "
        "[T, nb, K], int32 ids [T, k] -> [T, k, M], out[t, j] = a[ids[t, j]] @ b[t, j % nb] "
        "(nb 1 or k; ggml_mul_mat_id). Ids out of range raise IndexError in the reference; "
        "the shader clamps them. Frozen experts in a block type: mul_mat_id_q.")


# -- out_prod_id -----------------------------------------------------------------------------

def out_prod_id_shape(srcs, n_expert):
    b, g, ids = srcs
    need_float(b, g)
    check_routed(None, b, ids, "out_prod_id")
    if g.ndim != 3 or g.shape[:2] != ids.shape:
        raise ShapeError(f"g {g.shape} must be [T, k, M] with ids' [T, k] {ids.shape}")
    if int(n_expert) < 1:
        raise ShapeError(f"n_expert must be >= 1, got {n_expert}")
    return (int(n_expert), g.shape[2], b.shape[2]), "f32", {}


def out_prod_id_into(out, b, g, ids, n_expert):
    check_range("out_prod_id", ids, n_expert)
    rows = slots(b, ids.shape[1])
    out[...] = 0
    for e in np.unique(ids):
        taken = ids == e
        out[e] = g[taken].T @ rows[taken]


def out_prod_id_ref(b, g, ids, n_expert):
    out = np.empty((n_expert, g.shape[2], b.shape[2]), np.result_type(b, g))
    out_prod_id_into(out, b, g, ids, n_expert)
    return out


def out_prod_id_dispatch(node):
    """The expert lists (rows.wgsl's two passes), then one invocation per 4 consecutive
    elements of each row of the result."""
    b, g, ids = node.srcs
    n_expert = node.shape[0]
    links, passes = id_lists(node, ids, n_expert)
    return [*passes, Dispatch("out_prod_id", node, (b, g, links),
                     n=-(-node.shape[-1] // 4) * (node.nelements // node.shape[-1]),
                     u=(n_expert,))]


def out_prod_id_backward(node, d):
    b, g, ids = node.srcs
    return (sum_slots(O.mul_mat_id(O.transpose(d), g, ids), b.shape),
            O.mul_mat_id(d, b, ids), None)


out_prod_id = register(
    "out_prod_id", n_srcs=3, params=("n_expert",), shape=out_prod_id_shape,
    shader="experts", reference=out_prod_id_ref, fast=out_prod_id_into,
    dispatches=out_prod_id_dispatch, no_grad=(2,), backward=out_prod_id_backward,
    cases=lambda: [
        Case((Input((1, 1, 1)), Input((1, 1, 1)), Input((1, 1), 0, 1, dtype="i32")),
             {"n_expert": 1}),
        Case((Input((6, 1, 5)), Input((6, 2, 3)), Input((6, 2), 0, 4, dtype="i32")),
             {"n_expert": 4}),
        Case((Input((6, 2, 5), layout="strided"), Input((6, 2, 3), layout="permuted"),
              Input((6, 2), 0, 4, "permuted", "i32")), {"n_expert": 4}),
        Case((Input((5, 1, 6), layout="permuted"), Input((5, 3, 7), layout="strided"),
              Input((5, 3), 0, 8, "strided", "i32")), {"n_expert": 8}),   # experts unused
        Case((Input((64, 1, 128)), Input((64, 4, 96)), Input((64, 4), 0, 16, dtype="i32")),
             {"n_expert": 16}, grad=False),
    ],
    doc="The gradient of mul_mat_id's experts: b [T, nb, K], g [T, k, M], int32 ids [T, k] "
        "-> [n_expert, M, K], out[e] = the sum over the slots (t, j) routed to e of "
        "outer(g[t, j], b[t, j % nb]), added in slot order (deterministic, no atomics); an "
        "expert no slot took gets zeros.")

__all__ = ["top_k", "one_hot", "mul_mat_id", "out_prod_id"]
