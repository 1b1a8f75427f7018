"""The gated delta rule (Yang et al., Gated Delta Networks; llama.cpp's delta-net-base.cpp), a
block piece of Qwen3.5's linear-attention layers, in its chunked form: built from ops
(products, exp, masks, concat), so its backward is the autodiff of those ops.

Per head, with a state S (S_v, S_k) that starts at zero (or at `state`), token t turns it into

    S_t = a_t S_{t-1} + b_t (v_t - a_t S_{t-1} k_t) k_t^T,   o_t = S_t q_t / sqrt(S_k)

with a_t = exp(g_t) the decay (g <= 0) and b_t the write strength. The chunked form takes C
tokens at once: within a chunk, with G the cumulative sums of g and D[i, j] =
exp(G_i - G_j) for j <= i (0 above the diagonal), the strictly lower L[i, j] = b_i (k_i . k_j)
D[i, j] gives W = (I + L)^-1 (the WY form of the chunk's writes; here the product
(I - L)(I + L^2)(I + L^4)... of the nilpotent L's powers, so no solve op is needed), and

    U = W (b v),  Kc = W (b exp(G) k)                 the writes, before the state's share
    V = U - Kc S^T                                    what the chunk writes, given S
    O = (exp(G) q) S^T + ((q k^T) * D) V              the outputs
    S <- exp(G_last) S + V^T (exp(G_last - G) k)      the state after the chunk

Every product is batched over the chunks and heads; only the state's three products run
chunk after chunk, and the chunks' outputs are joined in pairs. A sequence whose length is not a multiple of C is padded with tokens
that change nothing (b = 0, g = 0) and cut back after.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import ops as O
from ..tensor import constant, zeros

# Tokens per chunk. llama.cpp takes 64; 16 gives the same result (to float32 rounding). On
# the NumPy backend a step of a Qwen3.5-0.8B-shaped layer (2 x 256 tokens) takes about as long
# either way on a quiet machine (0.50 s, 0.56 s), but 22 s against 1.7 s where other processes
# hold the cores: OpenBLAS runs each 64 x 64 product of a batch on its threads, which then
# wait on each other; 16 x 16 products stay on one thread.
CHUNK = 16


def matmul(x, y):
    """x @ y over the two innermost dims (mul_mat computes b @ a^T)."""
    return O.mul_mat(O.cont(O.transpose(y)), x)


@functools.cache
def mask_values(c: int) -> tuple:
    """(c, c) arrays: the lower triangle with its diagonal, the strict one, the identity;
    made once, so every layer's constants share one storage (base.SharedConstants)."""
    lower = np.tril(np.ones((c, c), np.float32))
    identity = np.eye(c, dtype=np.float32)
    values = lower, lower - identity, identity
    for v in values:
        v.flags.writeable = False
    return values


def masks(c: int) -> tuple:
    """Constants of mask_values(c)."""
    return tuple(constant(v, name=f"delta rule {kind} {c}")
                 for v, kind in zip(mask_values(c), ("lower", "strict", "identity")))


def unit_lower_inverse(lo, identity, c: int):
    """(I + lo)^-1 for strictly lower lo (.., c, c): lo is nilpotent (lo^c = 0), so the
    inverse is sum_k (-lo)^k = (I - lo)(I + lo^2)(I + lo^4)... up to the power c - 1."""
    inverse, power, reach = O.add(O.neg(lo), identity), lo, 2
    while reach < c:
        power = matmul(power, power)
        inverse = O.add(inverse, matmul(inverse, power))
        reach *= 2
    return inverse


def chunking(t: int, chunk: int = CHUNK) -> tuple[int, int]:
    """(chunk size, chunks) of a sequence of t tokens."""
    c = min(chunk, t)
    return c, -(-t // c)


def segment_masks(segments, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """For rows that hold several sequences (`segments` (B, T): each position's sequence, a
    run of equal values; models.transformer.packed_inputs), what the chunked rule needs to
    keep them apart: `same` (B, chunks, c, c), 1 where tokens i and j of a chunk are of one
    sequence, and `carry` (B, chunks, c, 1), 1 where a token's sequence began before its
    chunk (so the state entering the chunk is its own). Padding joins the last sequence."""
    segments = np.asarray(segments)
    batch, t = segments.shape
    c, n = chunking(t, chunk)
    runs = np.cumsum(np.concatenate([np.ones((batch, 1), bool),
                                     segments[:, 1:] != segments[:, :-1]], axis=1), axis=1)
    runs = np.concatenate([runs, np.repeat(runs[:, -1:], n * c - t, axis=1)], axis=1)
    runs = runs.reshape(batch, n, c)
    same = (runs[..., :, None] == runs[..., None, :]).astype(np.float32)
    carry = (runs == np.concatenate([np.zeros((batch, 1, 1), runs.dtype),
                                     runs[:, :-1, -1:]], axis=1)).astype(np.float32)
    return same, carry[..., None]


def heads_first(x, padded: int):
    """(B, T, H, ...) -> (H * B, padded, ...) contiguous, zeros past T: heads outermost, so
    that a per-row (B, ...) tensor tiles every head's rows."""
    b, t, h = x.shape[:3]
    rest = x.shape[3:]
    y = O.cont(O.permute(x, (2, 0, 1, 3) if rest else (2, 0, 1)))
    y = O.reshape(y, (b * h, t) + rest)
    if padded == t:
        return y
    shape = (b * h, padded) + rest
    strides = tuple(int(np.prod(shape[d + 1:])) for d in range(len(shape)))
    return O.acc(zeros(shape), y, strides, 0)


def delta_rule(q, k, v, g, beta, state=None, chunk: int = CHUNK, final_state: bool = False,
               segments=None, delta: bool = True, scale: float | None = None):
    """The gated delta rule over a batch of sequences: q, k (B, T, H, S_k), v (B, T, H, S_v),
    g (log decay, <= 0) and beta (B, T, H); `state` (H * B, S_v, S_k) or None for zeros.
    Returns o (B, T, H, S_v) (q times `scale`, default 1/sqrt(S_k), inside), and with
    `final_state` the state after the last token, (H * B, S_v, S_k). Rows that hold several
    sequences, each from a zero state, take `segments`: the (same, carry) of
    `segment_masks`, as f32 tensors. The rule runs in f32 whatever the activations (its
    cumulative decays, its state): f16 inputs are cast, and o comes back in v's type.
    `delta` False drops the delta rule's correction: S_t = a_t S_{t-1} + b_t v_t k_t^T, the
    gated linear attention of Mamba2's state-space duality (W = I, V = U)."""
    dtype = v.dtype
    q, k, v, g, beta = (O.cast(t, "f32") if t.dtype == "f16" else t for t in (q, k, v, g, beta))
    batch, t, heads, s_k = q.shape
    s_v = v.shape[-1]
    c, n = chunking(t, chunk)
    bh, padded = batch * heads, n * c
    q = O.scale(q, 1.0 / np.sqrt(s_k) if scale is None else scale)
    q, k, v = (O.reshape(heads_first(x, padded), (bh, n, c, x.shape[-1])) for x in (q, k, v))
    g, beta = (heads_first(x, padded) for x in (g, beta))
    lower, strict, identity = masks(c)
    # G: cumulative sums of g within each chunk, as a row (bh, n, 1, c) and a column
    cums = O.mul_mat(lower, O.reshape(g, (bh, n, 1, c)))
    column = O.reshape(cums, (bh, n, c, 1))
    diff = O.sub(O.repeat(column, (bh, n, c, c)), cums)                  # G_i - G_j
    decay = O.mul(O.exp(O.mul(diff, lower)), lower)                      # 0 above the diagonal
    grown = O.exp(column)                                                 # exp(G_i)
    if segments is not None:    # nothing passes between sequences
        same, carry = segments
        decay, grown = O.mul(decay, same), O.mul(grown, carry)
    b = O.reshape(beta, (bh, n, c, 1))
    w = None
    if delta and c > 1:
        kk = O.mul(O.mul(O.mul_mat(k, k), decay), b)                      # b_i (k_i . k_j) D_ij
        w = unit_lower_inverse(O.mul(kk, strict), identity, c)
    writes = O.mul(v, b)
    decayed_keys = O.mul(k, O.mul(b, grown)) if delta else None
    if w is not None:
        writes, decayed_keys = matmul(w, writes), matmul(w, decayed_keys)
    queries = O.mul(q, grown)
    scores = O.mul(O.mul_mat(k, q), decay)                                # (q_i . k_j) D_ij
    last = O.view(cums, (bh, n, 1, 1), (n * c, c, 1, 1), c - 1)           # G of each chunk's end
    to_end = O.exp(O.sub(O.repeat(last, (bh, n, c, 1)), column))
    end_decay = O.exp(last)
    if segments is not None:    # the state leaving a chunk is its last sequence's
        to_end = O.mul(to_end, O.reshape(O.cont(O.view(
            same, (batch, n, 1, c), (n * c * c, c * c, c, 1), (c - 1) * c)), (batch, n, c, 1)))
        end_decay = O.mul(end_decay, O.view(carry, (batch, n, 1, 1), (n * c, c, 1, 1), c - 1))
    to_end = O.mul(k, to_end)

    def part(x, i):     # chunk i of (bh, n, c or 1, d)
        rows, width = x.shape[2:]
        return O.view(x, (bh, rows, width), (n * rows * width, width, 1), i * rows * width)

    outs = []
    for i in range(n):
        new = part(writes, i)
        if state is not None and delta:
            new = O.sub(new, O.mul_mat(state, part(decayed_keys, i)))
        o = matmul(part(scores, i), new)
        if state is not None:
            o = O.add(O.mul_mat(state, part(queries, i)), o)
        outs.append(o)
        if i < n - 1 or final_state:
            written = O.out_prod(part(to_end, i), new)                    # (bh, s_v, s_k)
            state = written if state is None else O.add(
                O.mul(state, part(end_decay, i)), written)
    while len(outs) > 1:    # joined in pairs: each output is copied log2(n) times
        outs = [O.concat(*outs[j:j + 2], 1) if j + 1 < len(outs) else outs[j]
                for j in range(0, len(outs), 2)]
    out = O.view(outs[0], (heads, batch, t, s_v), (batch * padded * s_v, padded * s_v, s_v, 1),
                 0)
    out = O.permute(out, (1, 2, 0, 3))
    out = O.cast(out, dtype) if dtype != out.dtype else out
    return (out, state) if final_state else out


def l2_norm(x, eps: float):
    """x / sqrt(sum(x^2) + eps) over the last dim, as llama.cpp's build_gdn_l2_norm computes
    it: rms_norm with eps / n, times 1 / sqrt(n)."""
    n = x.shape[-1]
    return O.scale(O.rms_norm(x, eps / n), 1.0 / np.sqrt(n))
