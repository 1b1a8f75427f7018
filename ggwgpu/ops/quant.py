"""Ops that read frozen weights stored in a block type (f16, bf16, q4_0 .. q8_0, q2_k ..
q6_k: ggwgpu/quant.py's TYPES), dequantizing inside the kernel. Shaders: shaders/quant.wgsl,
quant_subgroup.wgsl and quant_tiled.wgsl (mul_mat's tiled kernels, the weight's quads
dequantized as a workgroup stages them: on GPUs, timed against the others), all dequantizing
through shaders/quant_blocks.wgsl.

    mul_mat_q(w, x)       w [.., M, K] frozen, x [.., N, K] f32/f16 -> [.., N, M] = x @ w.T
    mul_mat_q_back(w, g)  w [.., M, K] frozen, g [.., N, M] f32/f16 -> [.., N, K] = g @ w
    get_rows_q(table, ids)  rows of a frozen [n_rows, n_cols] table -> f32

(the activations' dtype decides the result's: the frozen weight does not count, whatever its
type; ops/registry.py's result_dtype)

mul_mat and get_rows hand over to these when their first operand is frozen (the registry's
`frozen_variant`), so a model's code works unchanged with quantized constants in place of
params. The weight never takes a gradient. The gradient w.r.t. x, g @ w, is a second kernel
over the same blocks (mul_mat_q_back), not a dequantize into f32 scratch followed by an f32
product: no f32 copy of any weight ever exists, and the blocks are read as often as the
forward reads them. The two are each other's backward.

The kernels read 4 values at a time (a "quad"), so f16 and bf16 rows must hold a multiple
of 4 values (block types' rows are multiples of 32 or 256 anyway). Frozen operands must be
whole, contiguous tensors (a constant or a reshape of one).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .. import ops as O
from .. import wgsl
from ..kernels import QUANT_KERNELS, QUANT_TILED, SUM_ROWS_MAX, TYPE_CODE
from ..quant import QUANT_TYPES, TYPES, dequantize
from ..tensor import ShapeError, Tensor
from .matmul import (mul_mat_into, mul_mat_ref, product_of, product_shape, tiled_layouts,
                     tuned_choice, vec4_ready)
from .registry import Case, Dispatch, Input, need_float, register
from .experts import check_routed, mul_mat_id_into, mul_mat_id_ref, sum_slots
from .rows import check_ids, get_rows_ref, rows_shape



def check_frozen(w):
    if not w.is_quantized:
        raise ShapeError(f"needs a weight in one of {', '.join(QUANT_TYPES)}, got {w.dtype}")
    if w.offset or not w.is_contiguous():
        raise ShapeError(f"a {w.dtype} weight must be whole and contiguous (a constant or a "
                         f"reshape of one)")
    quad = max(4, TYPES[w.dtype].block)
    if w.shape[-1] % quad:
        raise ShapeError(f"{w.dtype} rows must hold a multiple of {quad} values, got "
                         f"{w.shape[-1]}")


def values(w) -> np.ndarray:
    """A frozen weight's values: its blocks dequantized, or the float array the NumPy
    backend already dequantized them into."""
    return w if isinstance(w, np.ndarray) else dequantize(w)


def tiles(n: int, size: int) -> int:
    return -(-n // size)


# -- mul_mat_q -------------------------------------------------------------------------------

def mul_mat_q_shape(srcs):
    w, x = srcs
    check_frozen(w)
    need_float(x)
    return product_shape(w.shape, x.shape, -1, -1, "mul_mat"), "f32", {}


def tiled_q_dispatch(p, variant) -> list[Dispatch] | None:
    """Product p (matmul.product_of: a weight times a batch of rows as one product) on
    quant_tiled.wgsl's kernel of `variant` (QUANT_TILED); None where the f32 operand is laid
    out for neither of its layouts or the contraction is longer than one dispatch sums (the
    caller runs 'portable' then)."""
    layouts = tiled_layouts(p.a, p.b)
    if layouts is None or p.a.shape[-1] > SUM_ROWS_MAX:
        return None
    groups = p.workgroups(variant)
    return [Dispatch(f"mul_mat_q_{variant}", p.dst, (p.a, p.b), n=groups, workgroups=groups,
                     shader="quant_tiled", f=(1.0,),
                     u=(0, layouts, TYPE_CODE[p.a.dtype]))]


def chosen_variant(node, variant) -> tuple[str, list | None]:
    """(the variant a product runs, its dispatches where that is a QUANT_TILED one): the
    variant timed fastest where `variant` is a TunedMatmul that timed the product's key;
    'portable' where a QUANT_TILED kernel cannot run it (tiled_q_dispatch)."""
    p = product_of(node)
    variant = (tuned_choice(p, variant) or (variant,))[0]
    if variant not in QUANT_TILED:
        return variant, None
    tiled = tiled_q_dispatch(p, variant)
    return ("portable", None) if tiled is None else (variant, tiled)


def mul_mat_q_dispatch(node, variant="portable"):
    """The kernel reads x as vec4s (K is a multiple of 4): an x not laid out for that is
    first copied into dispatch-private contiguous storage, as mul_mat does."""
    variant, tiled = chosen_variant(node, variant)
    if tiled:
        return tiled
    w, x = node.srcs
    shader, (tile_m, tile_n), _ = QUANT_KERNELS[variant]
    m, n = node.shape[-1], node.shape[-2]
    batches = node.nelements // (m * n)
    copy = []
    if not vec4_ready(x):
        dense = Tensor(x.shape, name=f"{node} contiguous x")  # dispatch-private
        copy, x = [Dispatch("cpy", dense, (x,), n=x.nelements, shader="layout")], dense
    groups = tiles(m, tile_m) * tiles(n, tile_n) * batches
    if variant == "portable":  # one invocation per tile
        return copy + [Dispatch("mul_mat_q", node, (w, x), u=(TYPE_CODE[w.dtype],), n=groups)]
    return copy + [Dispatch(f"mul_mat_q_subgroup_{w.dtype}", node, (w, x), n=groups,
                            workgroups=groups, shader=shader)]


# The gradient rule and the f32 operand's strided and permuted layouts do not depend on the
# weight's type: their cases run for one type of each kind, the rest for every type.
SAMPLE_TYPES = ("f16", "q4_0", "q8_0", "q4_k")


def frozen_cases(shapes, grad_limit=400):
    """One case per block type for each (weight shape, other operand) pair whose rows fit the
    type: rows of 12 and 44 for f16 and bf16 only, rows of 256 and 512 for every type (the
    k-quants' only cases); finite differences only where the f32 operand is small."""
    cases = []
    for dtype in QUANT_TYPES:
        for w_shape, other in shapes:
            if w_shape[-1] % max(4, TYPES[dtype].block) or (
                    other.layout != "contiguous" and dtype not in SAMPLE_TYPES):
                continue
            cases.append(Case((Input(w_shape, dtype=dtype), other),
                              grad=dtype in SAMPLE_TYPES
                              and int(np.prod(other.shape)) <= grad_limit))
    return cases


mul_mat_q = register(
    "mul_mat_q", n_srcs=2, shape=mul_mat_q_shape, shader="quant",
    reference=lambda w, x: mul_mat_ref(values(w).astype(x.dtype), x),
    fast=mul_mat_into,   # the NumPy backend passes w dequantized
    dispatches=mul_mat_q_dispatch, variants=tuple(QUANT_KERNELS), no_grad=(0,),
    backward=lambda n, g: (None, O.mul_mat_q_back(n.srcs[0], g)),
    cases=lambda: frozen_cases([
        ((5, 32), Input((3, 32))),
        ((9, 64), Input((2, 3, 7, 64))),                      # a weight over 6 batches
        ((3, 32), Input((2, 1, 5, 32))),                      # 2 batches, small enough for fd
        ((2, 1, 3, 32), Input((2, 2, 3, 32))),               # batched weights, broadcast
        ((6, 32), Input((4, 32), layout="strided")),
        ((6, 32), Input((5, 32), layout="permuted")),
        ((7, 12), Input((5, 12))),                            # f16 only: rows of 12
        ((36, 44), Input((5, 44))),                           # f16 only: a block and 12
        ((67, 128), Input((2, 37, 128))),
        ((70, 96), Input((2, 19, 96))),                       # tiles of 32 x 16 cut
        ((3, 256), Input((1, 256))),                          # k-quants: small enough for fd
        ((33, 512), Input((2, 17, 512)))]),                   # k-quants: tiles cut, batches
    doc="ggml_mul_mat with a frozen weight: w [.., M, K] in a block type, x [.., N, K] "
        "f32 -> [.., N, M] = x @ w.T, dequantized inside the kernel; w broadcast over x's "
        "batch dims. mul_mat(w, x) becomes this when w is frozen.")


# -- mul_mat_q_back ---------------------------------------------------------------------------

def mul_mat_q_back_shape(srcs):
    w, g = srcs
    check_frozen(w)
    need_float(g)
    return product_shape(w.shape, g.shape, -2, -1, "mul_mat_q_back"), "f32", {}


def mul_mat_q_back_dispatch(node, variant="portable"):
    """One dispatch per SUM_ROWS_MAX rows of the weight, each after the first adding to the
    sums before it (u.y .. u.z: its rows, u.w: 1 to add): an invocation's loop over a
    vocabulary of 262 144 rows would pass what lavapipe runs of one (kernels.py). The
    QUANT_TILED kernels read w's transpose, as mul_mat's read a backward's operands."""
    variant, tiled = chosen_variant(node, variant)
    if tiled:
        return tiled
    w, g = node.srcs
    k, n, m = node.shape[-1], node.shape[-2], w.shape[-2]
    batches = node.nelements // (k * n)
    shader, _, (tile_k, tile_n) = QUANT_KERNELS[variant]
    groups = tiles(k, tile_k) * tiles(n, tile_n) * batches
    parts = [(lo, min(m, lo + SUM_ROWS_MAX), int(lo > 0)) for lo in range(0, m, SUM_ROWS_MAX)]
    if variant == "portable":  # one invocation per tile
        return [Dispatch("mul_mat_q_back", node, (w, g), n=groups, u=(TYPE_CODE[w.dtype], *u))
                for u in parts]
    # u.x = 1: g can be read as vec4s along M
    return [Dispatch(f"mul_mat_q_back_subgroup_{w.dtype}", node, (w, g), n=groups,
                     workgroups=groups, u=(int(vec4_ready(g)), *u), shader=shader)
            for u in parts]


mul_mat_q_back = register(
    "mul_mat_q_back", n_srcs=2, shape=mul_mat_q_back_shape, shader="quant",
    reference=lambda w, g: mul_mat_ref(np.swapaxes(values(w), -1, -2).astype(g.dtype), g),
    fast=lambda out, w, g: mul_mat_into(out, np.swapaxes(w, -1, -2), g),   # w dequantized
    dispatches=mul_mat_q_back_dispatch, variants=tuple(QUANT_KERNELS), no_grad=(0,),
    backward=lambda n, g: (None, O.mul_mat_q(n.srcs[0], g)),
    cases=lambda: frozen_cases([
        ((5, 32), Input((3, 5))),
        ((9, 64), Input((2, 3, 7, 9))),
        ((3, 32), Input((2, 1, 5, 3))),
        ((2, 1, 3, 32), Input((2, 2, 3, 3))),
        ((6, 32), Input((4, 6), layout="strided")),
        ((6, 32), Input((5, 6), layout="permuted")),
        ((7, 12), Input((5, 7))),
        ((36, 44), Input((5, 36))),                           # f16 only: a block and 12
        ((67, 128), Input((2, 37, 67))),
        ((68, 96), Input((2, 19, 68))),                       # g read as vec4s
        ((3, 256), Input((1, 3))),                            # k-quants
        ((36, 512), Input((2, 17, 36))),
        ((2 * SUM_ROWS_MAX + 6, 32), Input((3, 2 * SUM_ROWS_MAX + 6))),   # 3 dispatches
        ((SUM_ROWS_MAX + 4, 32), Input((2, SUM_ROWS_MAX + 4), layout="strided"))]),
    doc="The gradient of mul_mat_q w.r.t. x: w [.., M, K] frozen, g [.., N, M] f32 -> "
        "[.., N, K] = g @ w, dequantized inside the kernel; w broadcast over g's batch dims.")


# -- get_rows_q -------------------------------------------------------------------------------

def get_rows_q_shape(srcs):
    table, ids = srcs
    check_frozen(table)
    return rows_shape(table, ids), "f32", {}


get_rows_q = register(
    "get_rows_q", n_srcs=2, shape=get_rows_q_shape, shader="quant",
    reference=lambda table, ids: get_rows_ref(values(table), ids),
    uniforms=lambda n: {"u": (TYPE_CODE[n.srcs[0].dtype],)},
    no_grad=(0, 1),   # a frozen table and ids: nothing here takes a gradient
    backward=lambda n, g: (None, None),
    cases=lambda: [Case((Input(t, dtype=dtype), ids), grad=False)
                   for dtype in QUANT_TYPES
                   for t, ids in [((5, 32), Input((9,), 0, 5, dtype="i32")),
                                  ((3, 64), Input((2, 13), 0, 3, dtype="i32")),
                                  ((6, 32), Input((5, 3), 0, 6, "permuted", "i32")),
                                  ((300, 96), Input((4, 70), 0, 300, dtype="i32")),
                                  ((7, 256), Input((2, 5), 0, 7, dtype="i32"))]
                   if t[-1] % max(4, TYPES[dtype].block) == 0],
    doc="get_rows from a frozen table: table [n_rows, n_cols] in a block type, int32 "
        "ids of shape S -> S + (n_cols,) f32, dequantized in the kernel (token embeddings "
        "of a quantized base). get_rows(table, ids) becomes this when the table is frozen.")

# -- mul_mat_id_q, mul_mat_id_q_back ---------------------------------------------------------

def mul_mat_id_q_shape(srcs):
    w, x, ids = srcs
    need_float(x)
    check_frozen(w)
    check_routed(w.shape, x, ids, "mul_mat_id")
    return ids.shape + w.shape[1:2], "f32", {}


def mul_mat_id_q_back_shape(srcs):
    w, g, ids = srcs
    need_float(g)
    check_frozen(w)
    check_ids(ids)
    if w.ndim != 3 or ids.ndim != 2 or g.ndim != 3 or g.shape[:2] != ids.shape \
            or g.shape[2] != w.shape[1]:
        raise ShapeError(f"takes experts w [E, M, K], g [T, k, M] and ids [T, k]; got w "
                         f"{w.shape}, g {g.shape}, ids {ids.shape}")
    return ids.shape + w.shape[2:], "f32", {}


def expert_cases(grad_limit=200):
    """One case per block type for each (experts, other operand, ids) triple whose rows fit
    the type; finite differences for the sample types where the operand is small."""
    triples = [((4, 5, 32), (6, 1, 32), (6, 2), 4),        # a token's row for every slot
               ((3, 2, 32), (5, 3, 32), (5, 3), 3),        # a row per slot
               ((3, 6, 256), (4, 1, 256), (4, 2), 3)]      # k-quants
    return [Case((Input(w, dtype=dtype), Input(other), Input(ids, 0, n, dtype="i32")),
                 grad=dtype in SAMPLE_TYPES and int(np.prod(other)) <= grad_limit)
            for dtype in QUANT_TYPES for w, other, ids, n in triples
            if w[-1] % max(4, TYPES[dtype].block) == 0]


mul_mat_id_q = register(
    "mul_mat_id_q", n_srcs=3, shape=mul_mat_id_q_shape, shader="quant",
    reference=lambda w, x, ids: mul_mat_id_ref(values(w).astype(x.dtype), x, ids),
    fast=mul_mat_id_into,   # the NumPy backend passes w dequantized
    uniforms=lambda n: {"u": (TYPE_CODE[n.srcs[0].dtype],)}, no_grad=(0, 2),
    backward=lambda n, g: (None, sum_slots(O.mul_mat_id_q_back(n.srcs[0], g, n.srcs[2]),
                                           n.srcs[1].shape), None),
    cases=expert_cases,
    doc="mul_mat_id with frozen experts: w [E, M, K] in a block type, x [T, nb, K], int32 "
        "ids [T, k] -> [T, k, M], dequantized inside the kernel. mul_mat_id(w, x, ids) "
        "becomes this when w is frozen.")


mul_mat_id_q_back = register(
    "mul_mat_id_q_back", n_srcs=3, shape=mul_mat_id_q_back_shape, shader="quant",
    reference=lambda w, g, ids: mul_mat_id_ref(np.swapaxes(values(w), -1, -2).astype(g.dtype),
                                               g, ids),
    fast=lambda out, w, g, ids: mul_mat_id_into(out, np.swapaxes(w, -1, -2), g, ids),
    dispatches=lambda n: [Dispatch("mul_mat_id_q_back", n, n.srcs, n=n.nelements // 4,
                                   u=(TYPE_CODE[n.srcs[0].dtype],))],
    no_grad=(0, 2),
    backward=lambda n, g: (None, O.mul_mat_id_q(n.srcs[0], g, n.srcs[2]), None),
    cases=lambda: [Case((c.inputs[0], Input(c.inputs[2].shape + c.inputs[0].shape[1:2]),
                         c.inputs[2]), grad=c.grad) for c in expert_cases()],
    doc="The gradient of mul_mat_id_q w.r.t. x, one row per slot: w [E, M, K] frozen, g "
        "[T, k, M] -> [T, k, K], out[t, j] = g[t, j] @ w[ids[t, j]], dequantized inside "
        "the kernel.")

# The WGSL the quantized shaders include: the type codes, and quant_subgroup.wgsl's entry
# points, one per kernel and type (the type a constant the compiler folds away).
wgsl.add_part("quant_type_codes", wgsl.type_codes)
wgsl.add_part("mul_mat_q_tile_entries", partial(wgsl.tile_entries, "mul_mat_q"))
for _kernel in ("mul_mat_q_subgroup", "mul_mat_q_back_subgroup"):
    wgsl.add_part(f"{_kernel}_entries", partial(wgsl.subgroup_entries, _kernel))

__all__ = ["mul_mat_q", "mul_mat_q_back", "get_rows_q", "mul_mat_id_q", "mul_mat_id_q_back"]
