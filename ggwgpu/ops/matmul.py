"""Matrix products with ggml semantics. Shader: shaders/matmul.wgsl.

mul_mat(a, b): a [.., M, K], b [.., N, K] -> [.., N, M], result[n, m] = sum_k a[m, k] b[n, k]
(ggml: both operands share the inner dim ne0). out_prod(a, b): a [.., K, M], b [.., K, N]
-> [.., N, M], result[n, m] = sum_k a[k, m] b[k, n]. Both batch over the two outer dims; a
is broadcast over b as ggml does it: b's batch index j reads a's batch j // (nb / na).
out_prod runs the mul_mat kernel on transposed views, so no transpose is materialised.

The epilogue: every product takes a factor `alpha` (result = alpha * product), and
mul_mat_acc(a, b, c, alpha) adds c (the result's shape) after it, both in the product's
kernel as it stores (one rounding, fma): a LoRA pair's W x + B (s A x), attention's
1/sqrt(d), gradient sums need no scale or add dispatch of their own. The gradients carry
alpha into their products (d a, d b are products with the same alpha; d c = g).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np

from .. import ops as O
from .. import wgsl
from ..kernels import (MATMUL_KERNELS, QUANT_TILED, SPLIT_MIN_K, SPLIT_TARGET, SUM_ROWS_MAX,
                       TUNE_MIN_K)
from ..tensor import ShapeError, Tensor
from .registry import Case, Dispatch, Input, need_float, pad4, register

BLOCK = 4     # k_mul_mat: each invocation computes a BLOCK x BLOCK tile of the result


def product_shape(a_shape, b_shape, inner_a, inner_b, name):
    """Result shape and checks shared by mul_mat (inner dim -1) and out_prod (inner dim -2)."""
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ShapeError(f"{name} needs operands with at least 2 dims")
    if a_shape[inner_a] != b_shape[inner_b]:
        raise ShapeError(f"inner dims differ: {a_shape[inner_a]} vs {b_shape[inner_b]}")
    a4, b4 = pad4(a_shape), pad4(b_shape)
    if b4[0] % a4[0] or b4[1] % a4[1]:
        raise ShapeError(f"batch dims {a4[:2]} of a do not divide {b4[:2]} of b")
    m = a_shape[-1] if inner_a == -2 else a_shape[-2]
    n = b_shape[-1] if inner_b == -2 else b_shape[-2]
    ndim = max(len(a_shape), len(b_shape))
    return (b4[0], b4[1], n, m)[4 - ndim:]


def expand_batch(a4: np.ndarray, b4: np.ndarray) -> np.ndarray:
    """a's batch dims repeated (j // ratio) to b's, as the kernels broadcast."""
    a4 = np.repeat(a4, b4.shape[0] // a4.shape[0], axis=0)
    return np.repeat(a4, b4.shape[1] // a4.shape[1], axis=1)


def scaled(x: np.ndarray, alpha) -> np.ndarray:
    """alpha * x in x's float type (a Python float would not widen it; alpha 1: x itself)."""
    return x if alpha == 1 else x * x.dtype.type(alpha)


def mul_mat_ref(a, b, alpha=1.0):
    shape = product_shape(a.shape, b.shape, -1, -1, "mul_mat")
    a4, b4 = a.reshape(pad4(a.shape)), b.reshape(pad4(b.shape))
    return scaled(np.matmul(b4, np.swapaxes(expand_batch(a4, b4), -1, -2)).reshape(shape),
                  alpha)


def mul_mat_acc_ref(a, b, c, alpha=1.0):
    return mul_mat_ref(a, b, alpha) + c


def out_prod_ref(a, b, alpha=1.0):
    shape = product_shape(a.shape, b.shape, -2, -2, "out_prod")
    a4, b4 = a.reshape(pad4(a.shape)), b.reshape(pad4(b.shape))
    return scaled(np.matmul(np.swapaxes(b4, -1, -2), expand_batch(a4, b4)).reshape(shape),
                  alpha)


def batch_split(a, b):
    """a and b of a product as 6-D views (A0, r0, A1, r1, rows, cols) whose broadcasting is
    the kernels' j // ratio one: b's batch dims split into (a's, ratio), a's get size-1
    ratio dims. Splitting a dim is always a view: no copies (expand_batch repeats a)."""
    a4, b4 = a.reshape(pad4(a.shape)), b.reshape(pad4(b.shape))
    (a0, a1), (b0, b1) = a4.shape[:2], b4.shape[:2]
    return (a4.reshape(a0, 1, a1, 1, *a4.shape[2:]),
            b4.reshape(a0, b0 // a0, a1, b1 // a1, *b4.shape[2:]))


def unbatched(a: np.ndarray) -> bool:
    return all(n == 1 for n in a.shape[:-2])


def epilogue_into(out, alpha, c=None):
    """out = alpha * out (+ c), in place."""
    if alpha != 1:
        np.multiply(out, out.dtype.type(alpha), out=out)
    if c is not None:
        np.add(out, c, out=out)


def mul_mat_into(out, a, b, alpha=1.0):
    """mul_mat into out. A weight (no batch dims) times rows is one BLAS call over all of
    b's rows; a batched a broadcasts over b's batch through views, not repeated copies."""
    if unbatched(a):
        np.matmul(b.reshape(-1, b.shape[-1]), a.reshape(a.shape[-2:]).T,
                  out=out.reshape(-1, out.shape[-1]))
    else:
        a6, b6 = batch_split(a, b)
        # the b entries that share an entry of a (grouped-query attention's heads of one K/V
        # head) as rows of one product: a read once per group, not once per entry (b's rows
        # copied together where their strides do not merge; out is contiguous: a view)
        A0, r0, A1, r1, rows, cols = b6.shape
        b6 = b6.reshape(A0, r0, A1, 1, r1 * rows, cols)
        np.matmul(b6, np.swapaxes(a6, -1, -2),
                  out=out.reshape(b6.shape[:-1] + a6.shape[-2:-1]))
    epilogue_into(out, alpha)


def mul_mat_acc_into(out, a, b, c, alpha=1.0):
    mul_mat_into(out, a, b)
    epilogue_into(out, alpha, c)


def out_prod_into(out, a, b, alpha=1.0):
    """out_prod into out: two matrices (the weight gradients) as one BLAS call, batches
    through views as mul_mat_into."""
    if unbatched(a) and unbatched(b):
        np.matmul(b.reshape(b.shape[-2:]).T, a.reshape(a.shape[-2:]),
                  out=out.reshape(out.shape[-2:]))
    else:
        a6, b6 = batch_split(a, b)
        np.matmul(np.swapaxes(b6, -1, -2), a6,
                  out=out.reshape(b6.shape[:-2] + out.shape[-2:]))
    epilogue_into(out, alpha)


def sum_batch_to(x, shape):
    """Sum contiguous `x` over the batch entries that broadcasting mapped to one entry of
    `shape` (the adjoint of the j // ratio broadcast), then give it `shape`."""
    if x.shape == tuple(shape):
        return x
    x4, s4 = pad4(x.shape), pad4(shape)
    inner = x4[2] * x4[3]
    if x4[1] != s4[1]:  # dim 2: entry j = i * r + k  ->  sum over k
        r = x4[1] // s4[1]
        x = O.sum_rows(O.permute(O.reshape(x, (x4[0] * s4[1], r, inner)), (0, 2, 1)))
    if x4[0] != s4[0]:  # dim 3
        r = x4[0] // s4[0]
        x = O.sum_rows(O.permute(O.reshape(x, (s4[0], r, s4[1] * inner)), (0, 2, 1)))
    return O.reshape(x, shape)


def mul_mat_grad_a(a, b, g, alpha=1.0):
    """d(mul_mat(a, b, alpha))/da = sum over b's batch of out_prod(b, g, alpha). When a has
    no batch (a weight) the batch folds into the token rows: one product, nothing to sum
    after."""
    if all(n == 1 for n in pad4(a.shape)[:2]):
        k, m = b.shape[-1], g.shape[-1]
        b2 = O.reshape_any(b, (b.nelements // k, k))
        g2 = O.reshape_any(g, (g.nelements // m, m))
        return O.reshape(O.out_prod(b2, g2, alpha), a.shape)
    return sum_batch_to(O.out_prod(b, g, alpha), a.shape)


def mul_mat_backward(node, g):
    """d a, d b of alpha * mul_mat(a, b) (+ c: d c = g)."""
    a, b = node.srcs[:2]
    alpha = node.params["alpha"]
    return (mul_mat_grad_a(a, b, g, alpha), O.mul_mat(O.transpose(a), g, alpha),
            *((g,) if node.op == "mul_mat_acc" else ()))


def add_to_gradient(prev, sg, prev_fresh: bool, sg_fresh: bool):
    """The gradient sum prev + sg: one mul_mat_acc when either term is a mul_mat that a
    backward rule made for this sum alone (`*_fresh`: no other node reads it), its kernel
    adding the other term as it stores. Else an add."""
    for product, other, fresh in ((prev, sg, prev_fresh), (sg, prev, sg_fresh)):
        if fresh and product.op == "mul_mat" and product.shape == other.shape:
            summed = O.mul_mat_acc(*product.srcs, other, product.params["alpha"])
            if summed.dtype == other.dtype == product.dtype:
                return summed
    return O.add(prev, sg)


def mul_mat_shape(srcs, alpha=1.0):
    need_float(*srcs)
    return product_shape(srcs[0].shape, srcs[1].shape, -1, -1, "mul_mat"), "f32", {}


def mul_mat_acc_shape(srcs, alpha=1.0):
    need_float(*srcs)
    shape = product_shape(srcs[0].shape, srcs[1].shape, -1, -1, "mul_mat")
    if srcs[2].shape != shape:
        raise ShapeError(f"c {srcs[2].shape} must have the product's shape {shape}")
    return shape, "f32", {}


def out_prod_shape(srcs, alpha=1.0):
    need_float(*srcs)
    return product_shape(srcs[0].shape, srcs[1].shape, -2, -2, "out_prod"), "f32", {}


def vec4_ready(t) -> bool:
    """Contiguous along K with every offset and stride a multiple of 4 elements: rows can be
    read as vec4s. (The storage of a plan starts at a multiple of 4 elements too.)"""
    return (t.strides[-1] == 1 and t.offset % 4 == 0
            and all(s % 4 == 0 for s, n in zip(t.strides[:-1], t.shape[:-1]) if n > 1))


class Product(NamedTuple):
    """A product as its kernels compute it: dst [.., N, M] = alpha * b @ a.T (+ c), from
    a [.., M, K] and b [.., N, K] (views)."""
    dst: Tensor
    a: Tensor
    b: Tensor
    c: tuple
    alpha: float

    @property
    def batches(self) -> int:
        return self.dst.nelements // (self.dst.shape[-1] * self.dst.shape[-2])

    def workgroups(self, variant: str) -> int:
        """Workgroups of the variant's vec4 kernel over the product unsplit."""
        tile = MATMUL_KERNELS[variant].tile
        m, n = self.dst.shape[-1], self.dst.shape[-2]
        return -(-m // tile[0]) * -(-n // tile[1]) * self.batches


def merged_rows(t):
    """t [.., N, X] as one matrix [rows, X] (a view) where each row lies one row stride
    after the one before across its batch entries too; else None."""
    step = t.strides[-2] if t.ndim > 1 else 0
    expect = step * t.shape[-2] if t.ndim > 1 else 0
    for size, stride in zip(reversed(t.shape[:-2]), reversed(t.strides[:-2])):
        if size > 1 and stride != expect:
            return None
        expect *= size
    return t.layout((t.nelements // t.shape[-1], t.shape[-1]), (step, t.strides[-1]), t.offset)


def product_of(node) -> Product:
    """A product node as its kernels compute it: out_prod's operands transposed; a weight
    (an unbatched a) times the batch entries of b as one product over all of b's rows where
    their rows, the result's and c's lie one stride apart (a [4, 128] batch of tokens is 512
    rows: its tiles run across the entries, and split_k may cut it)."""
    a, b = node.srcs[:2]
    if node.op == "out_prod":
        a, b = transposed(a), transposed(b)
    elif node.op == "mul_mat_q_back":     # g @ w: w's transpose times g's rows
        a = transposed(a)
    product = Product(node, a, b, tuple(node.srcs[2:]), node.params.get("alpha", 1.0))
    if b.ndim > 2 and all(n == 1 for n in a.shape[:-2]):
        rows = [merged_rows(t) for t in (node, b, *product.c)]
        if None not in rows:
            a = a.layout(a.shape[-2:], a.strides[-2:], a.offset)
            product = Product(rows[0], a, rows[1], tuple(rows[2:]), product.alpha)
    return product


def kernel_dispatch(node, variant="tiled"):
    """A product node's dispatches (product_of): as timed fastest on the device where
    `variant` is a TunedMatmul that chose for this product; else cut along K into chunks
    computed side by side where the variant's kernel would leave a card idle (split_k); else
    kernel_dispatch_whole, one per SUM_ROWS_MAX of K where K is longer: each later one
    reads column views of a and b and adds to the sums before it (dst as its epilogue's c).
    One invocation's loop over a K of 262 144 (Gemma 3's vocabulary in the output product's
    backward) would pass what lavapipe runs of one (kernels.py)."""
    p = product_of(node)
    k = p.a.shape[-1]
    variant, chunks = tuned_choice(p, variant) or (variant, k_chunks(p, variant))
    if chunks > 1:
        return split_k(p, chunks, variant)
    if k <= SUM_ROWS_MAX:
        return kernel_dispatch_whole(p, variant)
    out = []
    for lo in range(0, k, SUM_ROWS_MAX):
        width = min(k, lo + SUM_ROWS_MAX) - lo
        a_part, b_part = (t.layout(t.shape[:-1] + (width,), t.strides,
                                   t.offset + lo * t.strides[-1]) for t in (p.a, p.b))
        c = p.c if lo == 0 else (p.dst,)
        out += kernel_dispatch_whole(p._replace(a=a_part, b=b_part, c=c), variant)
    return out


def tuned_choice(p: Product, variant) -> tuple[str, int] | None:
    """The (variant, chunks of K) timed fastest for the product, where `variant` is a
    TunedMatmul that timed one of its key (backends/tuning.py)."""
    return getattr(variant, "chosen", {}).get(product_key(p))


def product_key(p: Product):
    """What a product's speed depends on: its operands' shapes, element types and layouts
    (tiled_layouts); products of one key get one choice of kernel."""
    return (p.a.shape, p.b.shape, p.a.dtype, p.b.dtype, tiled_layouts(p.a, p.b))


def can_split(p: Product, chunks: int, min_k: int) -> bool:
    """Whether split_k can cut the product into `chunks` of K at least min_k deep: an
    unbatched product, K / chunks a multiple of 4 and at most SUM_ROWS_MAX, the chunks read
    as they lie."""
    k = p.a.shape[-1]
    return (p.batches == 1 and k % (4 * chunks) == 0 and min_k <= k // chunks
            <= SUM_ROWS_MAX and tiled_layouts(*chunked(p.a, p.b, chunks)) is not None)


def k_chunks(p: Product, variant) -> int:
    """How many chunks of K split_k cuts the product into (1: none): for an either_layout
    kernel, an unbatched product of fewer than SPLIT_TARGET workgroups, the most chunks (a
    power of 2) that keeps them at least SPLIT_MIN_K deep, K / chunks a multiple of 4 and
    the workgroups at most SPLIT_TARGET, where split_k can cut it so (can_split)."""
    if not MATMUL_KERNELS[variant].either_layout:
        return 1
    tiles, k, chunks = p.workgroups(variant), p.a.shape[-1], 1
    while (2 * chunks * tiles <= SPLIT_TARGET and k // (2 * chunks) >= SPLIT_MIN_K
           and k % (8 * chunks) == 0):
        chunks *= 2
    return chunks if chunks == 1 or can_split(p, chunks, SPLIT_MIN_K) else 1


def product_choices(p: Product, default: str) -> list[tuple[str, int]]:
    """The (variant, chunks of K) a TunedMatmul times for a product: the `default` variant's
    kernel whole, each either_layout kernel whole and cut into 2, 4 or 8 chunks at least
    TUNE_MIN_K deep (split_k) where that keeps its workgroups at most SPLIT_TARGET; of a
    frozen weight's product, the default and QUANT_TILED's kernels whole. None where the
    operands are laid out for no tiled kernel or K is longer than one dispatch sums."""
    if tiled_layouts(p.a, p.b) is None or p.a.shape[-1] > SUM_ROWS_MAX:
        return []
    if p.a.is_quantized:    # mul_mat_q(_back): the default kernel, or the tiled ones whole
        return [(str(default), 1)] + [(variant, 1) for variant in QUANT_TILED
                                      if variant != default]
    choices = [(str(default), 1)]
    for variant, kernel in MATMUL_KERNELS.items():
        if kernel.either_layout:
            choices += [(variant, chunks) for chunks in (1, 2, 4, 8)
                        if (variant, chunks) not in choices and (chunks == 1 or (
                            chunks * p.workgroups(variant) <= SPLIT_TARGET
                            and can_split(p, chunks, TUNE_MIN_K)))]
    return choices


def chunked(a, b, chunks):
    """a [M, K] and b [N, K] as [chunks, M, K / chunks] and [chunks, N, K / chunks]: the
    chunks of K as a batch, views of the same storage."""
    def view(t):
        width = t.shape[-1] // chunks
        return t.layout((chunks, t.shape[-2], width),
                        (width * t.strides[-1], t.strides[-2], t.strides[-1]), t.offset)
    return view(a), view(b)


def split_k(p: Product, chunks, variant):
    """The product cut into `chunks` along K: the kernel computes each chunk's product side
    by side (the chunks a batch: `chunked`) into dispatch-private sums [chunks, N, M], then
    k_mul_mat_splits adds them up and applies the epilogue (alpha, mul_mat_acc's c) as the
    whole product's kernel would."""
    m, n = p.dst.shape[-1], p.dst.shape[-2]
    kernel = MATMUL_KERNELS[variant]
    a3, b3 = chunked(p.a, p.b, chunks)
    sums = Tensor((chunks, n, m), name=f"{p.dst} sums of K's chunks")   # dispatch-private
    tiles = p.workgroups(variant) * chunks
    return [Dispatch(kernel.entry, sums, (a3, b3), n=tiles, workgroups=tiles,
                     shader=kernel.shader, f=(1.0,), u=(0, tiled_layouts(a3, b3))),
            Dispatch("mul_mat_splits", p.dst, (sums, sums, *p.c), n=n * -(-m // 4),
                     f=(p.alpha,), u=(len(p.c), chunks), shader="matmul")]


def tiled_layouts(a, b) -> int | None:
    """How an either_layout kernel reads a and b as they lie (p.u.y): bit 0 set where a is
    read K-outermost (contiguous along M), bit 1 where b is (along N); clear where it is read
    along K, which needs K % 4 == 0. None where an operand is laid out for neither."""
    flags = 0
    for bit, t in enumerate((a, b)):
        if a.shape[-1] % 4 == 0 and vec4_ready(t):
            continue
        if not vec4_ready(transposed(t)):
            return None
        flags |= 1 << bit
    return flags


def kernel_dispatch_whole(p: Product, variant):
    """The mul_mat kernel over a [.., M, K] and b [.., N, K], then its epilogue: times
    alpha (p.f.x), plus c (src2, p.u.x = 1) for mul_mat_acc. The vec4 kernel of `variant`
    reads the operands as they lie where it can: any mix of layouts (either_layout: the
    transposed views of every backward), or both stored K-outermost (entry_t: out_prod).
    Else when K % 4 == 0 it runs after copying an operand that is not laid out for it into
    dispatch-private contiguous storage: the copy moves M*K elements, the product does
    2*M*N*K flops. Otherwise the kernel that reads any strides."""
    dst, a, b, c = p.dst, p.a, p.b, p.c
    m, n = dst.shape[-1], dst.shape[-2]
    kernel = MATMUL_KERNELS[variant]
    tiles = p.workgroups(variant)
    # c: mul_mat_acc's, or the sums of the columns before (kernel_dispatch)
    epilogue = dict(f=(p.alpha,), u=(len(c),))
    layouts = tiled_layouts(a, b) if kernel.either_layout else None
    if layouts is not None:
        return [Dispatch(kernel.entry, dst, (a, b, *c), n=tiles, workgroups=tiles,
                         shader=kernel.shader, f=epilogue["f"], u=(len(c), layouts))]
    if (kernel.entry_t and not (vec4_ready(a) and vec4_ready(b))
            and vec4_ready(transposed(a)) and vec4_ready(transposed(b))):
        return [Dispatch(kernel.entry_t, dst, (a, b, *c), n=tiles, workgroups=tiles,
                         shader=kernel.shader, **epilogue)]
    if a.shape[-1] % 4:
        return [Dispatch("mul_mat", dst, (a, b, *c),
                         n=-(-m // BLOCK) * -(-n // BLOCK) * p.batches, **epilogue)]
    copies, operands = [], []
    for t in (a, b):
        if not vec4_ready(t):
            dense = Tensor(t.shape, name=f"{dst} contiguous operand")  # dispatch-private
            copies.append(Dispatch("cpy", dense, (t,), n=t.nelements, shader="layout"))
            t = dense
        operands.append(t)
    return copies + [Dispatch(kernel.entry, dst, (*operands, *c), n=tiles, workgroups=tiles,
                              shader=kernel.shader, **epilogue)]


def transposed(t):
    axes = list(range(t.ndim))
    axes[-2:] = axes[-1], axes[-2]
    return t.layout(tuple(t.shape[x] for x in axes), tuple(t.strides[x] for x in axes), t.offset)


def mm_cases():
    """mul_mat's cases (out_prod's transposed, mul_mat_acc's with a c); some scale by alpha."""
    return [Case((Input((4, 5)), Input((3, 5)))),
            Case((Input((7, 13)), Input((9, 13))), {"alpha": -0.75}),
            Case((Input((1, 1)), Input((1, 1)))),
            Case((Input((2, 3, 6, 5)), Input((2, 3, 4, 5)))),
            Case((Input((1, 2, 3, 5)), Input((3, 4, 2, 5))), {"alpha": 0.5}),  # a broadcast
            Case((Input((6, 5), layout="permuted"), Input((3, 5), layout="strided"))),
            Case((Input((2, 5, 3), layout="strided"), Input((2, 4, 3), layout="permuted"))),
            Case((Input((67, 129)), Input((65, 129))), grad=False),
            Case((Input((9, 8)), Input((3, 8))), {"alpha": 2.5}),   # vec4 kernels
            Case((Input((2, 1, 7, 12)), Input((2, 3, 10, 12)))),   # vec4 kernels, broadcast
            Case((Input((67, 128)), Input((70, 128))), {"alpha": 0.125}, grad=False),
            Case((Input((130, 20)), Input((66, 20))), grad=False),  # K not a multiple of 16
            Case((Input((131, 36)), Input((133, 36))), grad=False),  # past a 128 x 128 tile
            Case((Input((4, 12), layout="strided"), Input((5, 12)))),  # offset 1: generic
            Case((Input((3, 130, 70)), Input((3, 66, 70))), grad=False),
            # stored K-outermost, M and N not multiples of 4, beside an operand along K:
            # the backward's W^T d y (tiled: read as they lie)
            Case((Input((10, 12), layout="padded_t"), Input((7, 12)))),
            Case((Input((2, 9, 20)), Input((2, 70, 20), layout="padded_t")), {"alpha": 0.5}),
            Case((Input((66, 5), layout="padded_t"), Input((3, 5), layout="padded_t"))),
            # few tiles, a long K: tiled cuts K into 8 chunks side by side (split_k)
            Case((Input((67, 4096)), Input((65, 4096))), {"alpha": 0.5}, grad=False),
            Case((Input((10, 2048), layout="padded_t"), Input((7, 2048))), grad=False),
            # a weight times a batch: one product over all of b's rows (product_of), split
            Case((Input((9, 8)), Input((2, 3, 10, 8))), {"alpha": 1.5}),
            Case((Input((10, 12), layout="padded_t"), Input((2, 5, 12)))),
            Case((Input((67, 2048)), Input((2, 33, 2048))), grad=False),
            # K cut into dispatches that add up (kernel_dispatch): vec4 and any-strides kernels
            Case((Input((3, SUM_ROWS_MAX + 8)), Input((5, SUM_ROWS_MAX + 8))), {"alpha": 0.5},
                 grad=False),
            Case((Input((2, 2 * SUM_ROWS_MAX + 3)), Input((3, 2 * SUM_ROWS_MAX + 3))),
                 grad=False)]


def acc_cases():
    """mm_cases with a c of the result's shape, in turn contiguous, permuted and strided
    (its own strides in the epilogue), each with an alpha."""
    cases = []
    for i, c in enumerate(mm_cases()):
        a, b = c.inputs
        shape = product_shape(a.shape, b.shape, -1, -1, "mul_mat")
        layout = ("contiguous", "permuted", "strided")[i % 3]
        cases.append(Case((a, b, Input(shape, layout=layout)),
                          {"alpha": c.params.get("alpha", (1.0, -1.5, 0.25)[i % 3])},
                          grad=c.grad))
    return cases


mul_mat = register(
    "mul_mat", n_srcs=2, params=("alpha",), defaults={"alpha": 1.0}, shape=mul_mat_shape,
    shader="matmul", reference=mul_mat_ref,
    dispatches=lambda n, variant="tiled": kernel_dispatch(n, variant),
    variants=tuple(MATMUL_KERNELS), backward=mul_mat_backward,
    cases=mm_cases, frozen_variant="mul_mat_q", fast=mul_mat_into,
    doc="ggml_mul_mat: a [.., M, K], b [.., N, K] -> [.., N, M] = alpha * b @ a.T, a "
        "broadcast over b's batch dims (alpha applied as the kernel stores).")

mul_mat_acc = register(
    "mul_mat_acc", n_srcs=3, params=("alpha",), defaults={"alpha": 1.0},
    shape=mul_mat_acc_shape, shader="matmul", entry="mul_mat", reference=mul_mat_acc_ref,
    dispatches=lambda n, variant="tiled": kernel_dispatch(n, variant),
    variants=tuple(MATMUL_KERNELS), backward=mul_mat_backward,
    cases=acc_cases, fast=mul_mat_acc_into,
    doc="mul_mat with an accumulating epilogue: a [.., M, K], b [.., N, K], c [.., N, M] -> "
        "alpha * b @ a.T + c, c added as the kernel stores (a LoRA pair's W x + B (s A x), "
        "gradient sums).")

out_prod = register(
    "out_prod", n_srcs=2, params=("alpha",), defaults={"alpha": 1.0}, shape=out_prod_shape,
    shader="matmul", entry="mul_mat", reference=out_prod_ref, fast=out_prod_into,
    dispatches=lambda n, variant="tiled": kernel_dispatch(n, variant),
    variants=tuple(MATMUL_KERNELS),
    backward=lambda n, g: (
        sum_batch_to(O.mul_mat(O.transpose(g), n.srcs[1], n.params["alpha"]), n.srcs[0].shape),
        O.transpose(O.mul_mat(n.srcs[0], g, n.params["alpha"]))),
    cases=lambda: [Case((Input((c.inputs[0].shape[:-2] + c.inputs[0].shape[:-3:-1]),
                               layout=c.inputs[0].layout),
                         Input((c.inputs[1].shape[:-2] + c.inputs[1].shape[:-3:-1]),
                               layout=c.inputs[1].layout)), c.params, grad=c.grad)
                   for c in mm_cases()] + [
        # rows of a multiple of 4: read as they lie where the variant can (odd K, tiles cut)
        Case((Input((37, 68)), Input((37, 20))), {"alpha": 3.0}, grad=False),
        Case((Input((2, 1, 9, 8)), Input((2, 3, 9, 12))), {"alpha": -0.5}),
        # a weight's gradient over many tokens: K (2048) cut into 4 chunks (split_k)
        Case((Input((2048, 12)), Input((2048, 8))), {"alpha": 2.0}, grad=False)],
    doc="ggml_out_prod: a [.., K, M], b [.., K, N] -> [.., N, M] = alpha * b.T @ a, a "
        "broadcast over b's batch dims (alpha applied as the kernel stores).")

# matmul.wgsl's entry points on the tiled kernels (tiles.wgsl)
wgsl.add_part("mul_mat_tile_entries", partial(wgsl.tile_entries, "mul_mat"))

__all__ = ["mul_mat", "mul_mat_acc", "out_prod"]
