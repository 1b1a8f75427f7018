"""Row gather (embedding lookup) and its scatter-add backward: get_rows, get_rows_back; and
the row write set_rows (a decoder's new KV-cache rows, at their positions).

Shader: shaders/rows.wgsl. ids are int32 and take no gradient.

get_rows_back is deterministic without float atomics: instead of one scatter per id it
builds, per table row, a linked list of the id positions that name it (in id order), then
every output element walks its row's list and sums. Three dispatches over a private int32
scratch `links` = [head of each table row | next position with the same id]:
    clear  (n_rows)          head[r] = -1
    link   (n_ids)           next[j] = the next k > j with ids[k] == ids[j], or -1;
                             head[ids[j]] = j where j is the first position of its id
    gather (n_rows * n_cols) out[r, c] = sum of g[j, c] over the list of row r
The link pass compares ids pairwise (O(n_ids^2) integer compares with early exit), the rest
is linear: fine for batches of some thousand tokens, whatever the vocabulary size.
The sums run in id order, as the NumPy reference (np.add.at) adds them.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import ShapeError, Tensor, zeros
from .registry import Case, Dispatch, Input, need_float, register


def check_ids(ids_t):
    if ids_t.dtype != "i32":
        raise ShapeError(f"ids must be i32, got {ids_t.dtype}")
    if ids_t.ndim > 3:
        raise ShapeError(f"ids may have at most 3 dims, has shape {ids_t.shape}")


def check_range(name, ids, n_rows):
    """The reference refuses ids outside [0, n_rows) (the shaders clamp them instead)."""
    bad = (ids < 0) | (ids >= n_rows)
    if bad.any():
        raise IndexError(f"{name}: id {int(ids[bad].reshape(-1)[0])} out of range for a table "
                         f"of {n_rows} rows")


# -- get_rows --------------------------------------------------------------------------------

def rows_shape(table, ids) -> tuple[int, ...]:
    """The shape of `ids`' rows of a 2-D `table` (get_rows, get_rows_q)."""
    if table.ndim != 2:
        raise ShapeError(f"table must be 2-D [n_rows, n_cols], has shape {table.shape}")
    check_ids(ids)
    return ids.shape + table.shape[-1:]


def get_rows_shape(srcs):
    table, ids = srcs
    need_float(table)
    return rows_shape(table, ids), "f32", {}


def get_rows_ref(table, ids):
    check_range("get_rows", ids, table.shape[0])
    return table[ids]


get_rows = register(
    "get_rows", n_srcs=2, shape=get_rows_shape, shader="rows", reference=get_rows_ref,
    f16_nmse=0.0,  # exact: copies halves
    no_grad=(1,), frozen_variant="get_rows_q",
    backward=lambda n, g: (O.get_rows_back(g, n.srcs[1], n.srcs[0].shape[0]), None),
    cases=lambda: [
        Case((Input((1, 1)), Input((1,), 0, 1, dtype="i32"))),
        Case((Input((5, 7)), Input((9,), 0, 5, dtype="i32"))),              # ids repeat
        Case((Input((3, 4)), Input((2, 13), 0, 3, dtype="i32"))),           # 26 ids, 3 rows
        Case((Input((6, 5), layout="permuted"), Input((2, 3, 4), 0, 6, dtype="i32"))),
        Case((Input((7, 9), layout="strided"), Input((5, 3), 0, 7, "permuted", "i32"))),
        Case((Input((4, 3)), Input((6,), 0, 4, "strided", "i32"))),
        Case((Input((1000, 70)), Input((4, 300), 0, 1000, dtype="i32")), grad=False),
        Case((Input((300, 1030)), Input((4100,), 0, 300, dtype="i32")), grad=False),  # 2-D grid
    ],
    doc="Embedding lookup: table [n_rows, n_cols], int32 ids of shape S (up to 3 dims) -> "
        "S + (n_cols,), out[s] = table[ids[s]] (as ggml_get_rows). Ids out of range raise "
        "IndexError in the reference; the shader clamps them to the table.")


# -- get_rows_back ---------------------------------------------------------------------------

def get_rows_back_shape(srcs, like_rows):
    g, ids = srcs
    need_float(g)
    check_ids(ids)
    if g.ndim != ids.ndim + 1 or g.shape[:-1] != ids.shape:
        raise ShapeError(f"g {g.shape} must be ids {ids.shape} + (n_cols,)")
    if int(like_rows) < 1:
        raise ShapeError(f"like_rows must be >= 1, got {like_rows}")
    return (int(like_rows), g.shape[-1]), "f32", {}


def get_rows_back_ref(g, ids, like_rows):
    check_range("get_rows_back", ids, like_rows)
    out = np.zeros((like_rows, g.shape[-1]), g.dtype)
    np.add.at(out, ids.reshape(-1), g.reshape(-1, g.shape[-1]))  # in id order
    return out


def get_rows_back_into(out, g, ids, like_rows):
    """get_rows_back_ref by sorting: the rows of g grouped by id (stable: in id order) and
    each group summed in that order by np.add.reduceat, not one np.add.at per element."""
    check_range("get_rows_back", ids, like_rows)
    flat, rows = ids.reshape(-1), g.reshape(-1, g.shape[-1])
    out[...] = 0
    if not len(flat):
        return
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    out[ordered[starts]] = np.add.reduceat(rows[order], starts, axis=0)


def id_lists(node, ids, n_rows: int):
    """(links, the two dispatches that fill it): a private int32 scratch of node's that lists,
    for each of n_rows rows, the positions of `ids` naming it, in id order (the module
    docstring's clear and link passes; out_prod_id's expert lists too)."""
    links = Tensor((n_rows + ids.nelements,), "i32", name=f"{node} links")
    return links, [Dispatch("rows_clear", links, (), n=n_rows, shader="rows"),
                   Dispatch("rows_link", links, (ids,), n=ids.nelements, u=(n_rows,),
                            shader="rows")]


def get_rows_back_dispatch(node):
    g, ids = node.srcs
    n_rows, n_cols = node.shape
    links, passes = id_lists(node, ids, n_rows)
    return [*passes, Dispatch("get_rows_back", node, (g, links), n=n_rows * n_cols,
                              u=(n_rows,))]


get_rows_back = register(
    "get_rows_back", n_srcs=2, params=("like_rows",), shape=get_rows_back_shape,
    shader="rows", reference=get_rows_back_ref, fast=get_rows_back_into,
    dispatches=get_rows_back_dispatch,
    no_grad=(1,),
    backward=lambda n, g: (O.get_rows(g, n.srcs[1]), None),
    cases=lambda: [
        Case((Input((1, 1)), Input((1,), 0, 1, dtype="i32")), {"like_rows": 1}),
        Case((Input((9, 7)), Input((9,), 0, 5, dtype="i32")), {"like_rows": 5}),
        Case((Input((2, 13, 4)), Input((2, 13), 0, 3, dtype="i32")), {"like_rows": 3}),
        Case((Input((2, 3, 4, 5), layout="permuted"), Input((2, 3, 4), 0, 6, dtype="i32")),
             {"like_rows": 6}),                                          # some rows unused
        Case((Input((5, 3, 9), layout="strided"), Input((5, 3), 0, 7, "permuted", "i32")),
             {"like_rows": 7}),
        Case((Input((4, 300, 70)), Input((4, 300), 0, 1000, dtype="i32")), {"like_rows": 1000},
             grad=False),
        Case((Input((2000, 65)), Input((2000,), 0, 50, dtype="i32")), {"like_rows": 50},
             grad=False),                                                # many repeats
    ],
    doc="The backward of get_rows: a zero [like_rows, n_cols] table with the rows of g "
        "(shape ids.shape + (n_cols,)) added at ids; repeated ids add up, in id order "
        "(deterministic, no atomics).")

# -- set_rows --------------------------------------------------------------------------------

def set_rows_shape(srcs):
    a, ids, b = srcs
    need_float(a, b)
    check_ids(ids)
    if a.ndim != 2 or b.ndim != 2 or ids.shape != a.shape[:1] or a.shape[1] != b.shape[1]:
        raise ShapeError(f"set_rows writes rows a [n, n_cols] at ids [n] into b [n_rows, "
                         f"n_cols]; got a {a.shape}, ids {ids.shape}, b {b.shape}")
    return b.shape, b.dtype, {"strides": b.strides, "offset": b.offset, "view_src": b}


def set_rows_ref(a, ids, b):
    check_range("set_rows", ids, b.shape[0])
    if len(np.unique(ids)) != ids.size:
        raise ValueError("set_rows: an id repeats (two rows for one place)")
    out = b.copy()
    out[ids] = a
    return out


def set_rows_into(out, a, ids, b):
    check_range("set_rows", ids, b.shape[0])
    if not np.shares_memory(out, b):    # in a graph `out` is b's storage; else b's value first
        np.copyto(out, b)
    out[ids] = a


set_rows = register(
    "set_rows", n_srcs=3, shape=set_rows_shape, shader="rows", reference=set_rows_ref,
    fast=set_rows_into, f16_nmse=0.0,  # exact: copies halves
    dispatches=lambda n: [Dispatch("set_rows", n, n.srcs[:2], n=n.srcs[0].nelements)],
    no_grad=(1,),
    # a's rows are read where they went; b's gradient is g but where a's rows replaced it
    backward=lambda n, g: (O.get_rows(g, n.srcs[1]), None,
                           O.set_rows(zeros(n.srcs[0].shape), n.srcs[1], O.cont(g))),
    cases=lambda: [
        Case((Input((1, 1)), Input((1,), 0, 1, dtype="i32"), Input((1, 1)))),
        Case((Input((3, 5)), Input((3,), 0, 7, dtype="i32", dist="distinct"), Input((7, 5)))),
        Case((Input((4, 3), layout="permuted"), Input((4,), 0, 9, "strided", "i32", "distinct"),
              Input((9, 3), layout="strided"))),
        Case((Input((5, 6), layout="strided"), Input((5,), 0, 5, dtype="i32", dist="distinct"),
              Input((5, 6), layout="permuted"))),                    # every row replaced
        Case((Input((300, 70)), Input((300,), 0, 1000, dtype="i32", dist="distinct"),
              Input((1000, 70))), grad=False),
    ],
    doc="b [n_rows, n_cols] with row ids[i] replaced by row i of a [n, n_cols] (ids [n] int32, "
        "distinct), written into b's storage: the result is a view of b, as ggml_set_rows. "
        "Repeated ids raise ValueError in the reference (the shader leaves either row), ids "
        "out of range IndexError (the shader clamps them).")

__all__ = ["get_rows", "get_rows_back", "set_rows"]
