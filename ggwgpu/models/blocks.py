"""The pieces model families are built from, as llama.cpp builds its graphs (build_norm,
build_lora_mm, build_attn, build_ffn): weights with their LoRA pairs, norms, rope,
attention over a `Sequence` (a training batch or a decoder's run), gated feed-forwards, the
token embedding and the output projection.

Parameter names are llama.cpp's GGUF tensor names; `p` maps each to its leaf (models.weights).
Shapes in NumPy order: a weight that maps n_in features to n_out is stored (n_out, n_in), as
GGUF stores it (ne0 = n_in).

LoRA (llama.cpp's build_lora_mm and token-embedding LoRA): an adapter adds to a weight W
(n_out, n_in) a pair lora_a (r, n_in), lora_b (n_out, r), and the layer computes
W x + scale * B (A x), scale = alpha / r. The token embedding E (n_vocab, n_embd) is the
exception: lora_a (n_vocab, r) is a table read with get_rows and lora_b is (n_embd, r), so its
rows become E[t] + scale * B A[t]. p[name + LORA] lists the pairs (a, b, scale) on `name`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import ops as O
from ..ops.attention import MAX_D
from ..tensor import constant

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_BIAS = "output.bias"
OUTPUT_NORM = "output_norm.weight"
ROPE_FREQS = "rope_freqs.weight"
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"   # LongRoPE
LORA_A, LORA_B = ".lora_a", ".lora_b"   # adapter tensors: <weight name> + suffix (llama.cpp)
LORA = ".lora"      # p[name + LORA]: the LoRA pairs (a, b, scale) the adapters add to weight `name`
# A training graph's random draws (ops/draws.py; absent: none), each (control, its size), the
# control an i32 input [seed, on]: p[LORA_DROPOUT] the rate of the dropout on the LoRA pairs'
# inputs, p[EMBEDDING_NOISE] the magnitude of the noise on the token embeddings (NEFTune)
LORA_DROPOUT = ".lora_dropout"
EMBEDDING_NOISE = ".embedding_noise"


def linear(p: dict, name: str, x, residual=None, alpha: float = 1.0):
    """`residual` + alpha * (x times weight `name` (mul_mat), plus scale * B (A x) for each
    LoRA pair on it), as llama.cpp sums it; no residual: just the scaled product. The sums
    are the products' epilogues (mul_mat_acc): B's product scales and adds; a float weight's
    product adds the residual (a frozen block-type weight's kernel has no epilogue: a scale
    and an add do)."""
    w = p[name]
    pairs = p.get(name + LORA, ())
    if w.is_quantized:
        y = O.mul_mat(w, x)
        for k, (a, b, scale) in enumerate(pairs):
            y = O.mul_mat_acc(b, O.mul_mat(a, lora_input(p, name, k, x)), y, scale)
        y = y if alpha == 1.0 else O.scale(y, alpha)
        return y if residual is None else O.add(residual, y)
    fused = residual is not None and residual.shape == x.shape[:-1] + w.shape[:1]
    y = O.mul_mat_acc(w, x, residual, alpha) if fused else O.mul_mat(w, x, alpha)
    for k, (a, b, scale) in enumerate(pairs):
        y = O.mul_mat_acc(b, O.mul_mat(a, lora_input(p, name, k, x)), y, scale * alpha)
    return y if residual is None or fused else O.add(residual, y)


def routed(p: dict, name: str, x, taken, scales=None):
    """x (tokens, 1 or k, n_in) times the experts `taken` (tokens, k) of the stack `name`
    (mul_mat_id), times `scales` (tokens, k, 1) where given, plus scale * B[e] (A[e] x)
    for each LoRA pair on it (llama.cpp's build_lora_mm_id), plus each expert's row of the
    stack's bias (n_expert, n_out) where the model has one (ggml_add_id): (tokens, k,
    n_out)."""
    y = O.mul_mat_id(p[name], x, taken)
    if scales is not None:
        y = O.mul(y, scales)
    for k, (a, b, scale) in enumerate(p.get(name + LORA, ())):
        ax = O.mul_mat_id(a, lora_input(p, name, k, x), taken)
        y = O.add(y, O.scale(O.mul_mat_id(b, ax, taken), scale))
    bias = p.get(name.removesuffix(".weight") + ".bias")
    if bias is not None:
        y = O.add(y, O.get_rows(bias, taken))
    return y


def lora_input(p: dict, name: str, k: int, x):
    """What pair k on weight `name` reads: x, or in a training graph with LoRA dropout
    (p[LORA_DROPOUT]) x dropped as PEFT's lora_dropout drops it, by draws of the pair's own
    stream (the weight name's CRC-32 plus k), so that no two pairs drop alike."""
    if LORA_DROPOUT not in p:
        return x
    control, rate = p[LORA_DROPOUT]
    return O.dropout(x, control, rate, (zlib.crc32(name.encode()) + k) & 0xFFFFFFFF)


def rms_norm(cfg, x, weight):
    """rms_norm(x) * weight over x's last dim (one fused op): llama.cpp's LLM_NORM_RMS."""
    return O.rms_norm_mul(x, weight, cfg.norm_eps)


def layer_norm(cfg, x, weight, bias):
    """(x - mean) / sqrt(var + eps) * weight + bias over x's last dim: llama.cpp's
    LLM_NORM (ggml_norm) with its weight and bias."""
    return O.add(O.mul(O.norm(x, cfg.norm_eps), weight), bias)


def embed(p: dict, tokens, precision: str = "f32", scale: float = 1.0):
    """The token embeddings of `tokens`, plus scale * B A[t] for each LoRA pair on them (and
    in a training graph with NEFTune, p[EMBEDDING_NOISE], uniform noise), in `precision`
    (rows of a block-type table come out f32: an f16 graph casts them), times `scale`
    (gemma3's sqrt(n_embd), granite's embedding_scale)."""
    x = O.get_rows(p[TOKEN_EMBD], tokens)
    if x.dtype != precision:
        x = O.cast(x, precision)
    for a, b, s in p.get(TOKEN_EMBD + LORA, ()):
        x = O.mul_mat_acc(b, O.get_rows(a, tokens), x, s)
    if EMBEDDING_NOISE in p:    # NEFTune's, on the embedding's output (as TRL hooks it)
        control, magnitude = p[EMBEDDING_NOISE]
        x = O.noise(x, control, magnitude, zlib.crc32(TOKEN_EMBD.encode()))
    return x if scale == 1.0 else O.scale(x, scale)


def output(cfg, p: dict, x):
    """The logits of x (after the final norm): the output matrix, or with tied embeddings
    the token embedding (as llama.cpp does; LoRA pairs on output.weight apply either way),
    plus output.bias where the model has one (phi2), times the family's logit factor
    (granite's 1 / logit_scale, command-r's logit_scale) and soft-capped
    (final_logit_softcap, gemma)."""
    leaves = p if OUTPUT in p else {**p, OUTPUT: p[TOKEN_EMBD]}
    cap = cfg.final_logit_softcap
    y = linear(leaves, OUTPUT, x, alpha=cfg.family.logit_factor(cfg) / (cap or 1.0))
    if OUTPUT_BIAS in p:
        y = O.add(y, p[OUTPUT_BIAS])
    return O.scale(O.tanh(y), cap) if cap else y


def rope_params(cfg, freq_base: float, freq_scale: float, scaled: bool = True) -> dict:
    """The rope op's parameters at `freq_base` and `freq_scale` (the layer's:
    models.family), as llama.cpp's context sets them for the model: YaRN's for a "yarn"
    model (ext_factor 1, its original context; attn_factor over 0.1 ln(factor) + 1, which
    the op's own factor cancels at the model's scale), times rope_attn_factor. `scaled`
    False: neither (olmo2's windowed layers)."""
    params = {"n_dims": cfg.rot, "mode": cfg.rope_mode, "freq_base": freq_base,
              "freq_scale": freq_scale}
    if not scaled:
        return params
    attn_factor = cfg.rope_attn_factor
    if cfg.rope_scaling == "yarn":
        factor = 1.0 / cfg.rope_freq_scale

        def mscale(m):      # transformers' get_mscale
            return 0.1 * m * math.log(factor) + 1 if factor > 1 else 1.0
        # with a yarn_log_multiplier: mscale(1) / mscale(it) (llama.cpp's, mscale 1)
        attn_factor *= (mscale(1) / mscale(cfg.yarn_log_mul) if cfg.yarn_log_mul
                        else mscale(1)) / (1 + 0.1 * math.log(factor))
        params.update(ext_factor=1.0, n_ctx_orig=cfg.rope_orig_ctx,
                      beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow)
    return {**params, "attn_factor": attn_factor}


def attention_temperature(cfg, positions, n_positions: int, dtype: str):
    """What Q is multiplied by at each of `positions` (below n_positions), (tokens, 1, 1):
    Llama 4's attention temperature ln(floor(pos / rope_orig_ctx) + 1) * attn_temp_scale + 1
    (llama.cpp's inp_attn_scale), read from a table of every position; None where it is 1 at
    all of them (below rope_orig_ctx)."""
    if not cfg.attn_temp_scale or n_positions <= cfg.rope_orig_ctx:
        return None
    table = temperature_table(n_positions, cfg.rope_orig_ctx, cfg.attn_temp_scale)
    scales = O.get_rows(constant(table, dtype, name="attention temperature"), positions)
    return O.reshape(scales, (scales.shape[0], 1, 1))


@functools.cache
def temperature_table(n_positions: int, orig_ctx: int, scale: float) -> np.ndarray:
    """attention_temperature's table (n_positions, 1), made once: the decoder's graphs of one
    context share one upload of it (base.SharedConstants keys on the array)."""
    pos = np.arange(n_positions)
    table = (np.log(np.floor(pos / orig_ctx) + 1) * scale + 1)[:, None]
    table.flags.writeable = False
    return table


def rope(x, positions, params: dict, factors=None):
    """llama.cpp's rope (mode normal: adjacent pairs, as its converter stores a llama's Q and
    K; neox: pairs (k, k + n_rot / 2)) with `params` (rope_params'), with per-pair frequency
    `factors` (Llama 3's rope_freqs, Phi-3's LongRoPE) when given."""
    if factors is not None:
        return O.rope_ff(x, positions, factors, **params)
    return O.rope(x, positions, **params)


@dataclass
class Sequence:
    """The tokens a block's mixer sees: a training batch or one run of a decoder.
    q, k and v are made with leading shape `lead` (the rows rope takes, one `positions`
    entry each); `attend(layer, q, k, v, scale, window, sinks=None)` gives attention's
    output (with `sinks`: `sink_probs`'), one row of q's heads * head size per token,
    shaped as the block's input rows; with k and v None,
    q attends to the keys and values that `layer` attended with in this run (gemma4's
    shared KV: an earlier layer's). `convolve(layer, x, weight)` gives
    the causal depthwise convolution of x (rows of C channels, one per token) with weight
    (C, L) (ggml's SSM_CONV from a zero state: y[t, c] = sum_j x[t - (L - 1 - j), c]
    weight[c, j] over the earlier tokens of t's sequence); None where no block convolves.
    `layer_inputs[i]`: what block i reads beside its input (gemma4's per-layer embeddings,
    Family.prepare), rows shaped as the block's input; empty where the family has none.
    `recur(layer, q, k, v, g, beta, **rule)` gives the gated delta rule's output
    (models.delta_net; `rule`: its `delta` and `scale`) over the tokens, from the state the
    layer's sequence had before them: q, k (*rows, heads, key size), v (*rows, heads, value
    size), g and beta (*rows, heads), rows as the block's input rows.
    `temperature`: what q is multiplied by after rope, one value per position
    (attention_temperature), None for 1."""
    lead: tuple
    positions: object
    attend: Callable
    convolve: Callable | None = None
    recur: Callable | None = None
    layer_inputs: list = dataclasses.field(default_factory=list)
    temperature: object = None


def attention(cfg, q, k, v, flash: bool, mask=None, scale: float | None = None, sinks=None):
    """Causal self-attention of q (batch, n_ctx, n_head, head_dim) over k, v (batch, n_ctx,
    n_head_kv, head_dim): query head h reads K/V head h // (n_head / n_head_kv), which is how
    mul_mat and flash_attn broadcast the narrower operand (grouped-query attention). A
    `mask` (f32, 0 or -inf; (n_ctx, n_ctx) or (batch, 1, n_ctx, n_ctx)) replaces the
    causal rule and is added to the scores (document masks of packed rows, sliding
    windows). The scores are scaled by `scale` (default 1/sqrt(head_dim)), and soft-capped
    where cfg.attn_logit_softcap is set (`attention_scores`); with `sinks` (n_head,) each
    head's softmax has one more logit no value reads (`sink_probs`; fused: `sink_key`).
    Where the fused kernels cannot (`fuses`), the scores take the unfused path even with
    `flash`."""
    q, k, v = (O.permute(t, (0, 2, 1, 3)) for t in (q, k, v))   # (batch, head, ctx, dim)
    scale = 1.0 / np.sqrt(cfg.head_dim) if scale is None else scale
    if flash and fuses(cfg, q.shape[-1] + (sinks is not None)):
        if sinks is not None:
            (q, k, v), mask, dim = sink_key(q, k, v, mask, scale, sinks), first_open(mask), \
                q.shape[-1]
        out = (O.flash_attn(q, k, v, scale, True) if mask is None
               else O.flash_attn_ext(q, k, v, mask, scale))
        if sinks is not None:
            out = columns(out, (dim, 1))[0]
    else:   # causal without a mask: the scale in the product's epilogue, n_past 0
        if sinks is not None:
            probs = sink_probs(*attention_scores(cfg, k, q, scale, folded=True), mask, sinks)
        else:
            kq, scale = attention_scores(cfg, k, q, scale, folded=mask is None)  # (b, h, q, k)
            probs = O.soft_max(kq, scale, 0) if mask is None else O.soft_max_ext(kq, mask,
                                                                                 scale)
        out = O.mul_mat(O.transpose(v), probs)                    # (batch, head, q, dim)
    return O.permute(out, (0, 2, 1, 3))                          # (batch, ctx, head, dim)


def fuses(cfg, head_dim: int) -> bool:
    """Whether flash attention computes heads of `head_dim` of cfg: the fused kernels have no
    soft cap, and keep a head in private memory (up to ops.attention.MAX_D: deepseek2's
    latent heads of 576 are beyond)."""
    return not cfg.attn_logit_softcap and head_dim <= MAX_D


def sink_key(q, k, v, mask, scale: float, sinks):
    """q, k, v (batch, head, ctx, dim) made one longer in dim, with one key and value more
    at the start, so that fused attention over them is attention with `sinks`: each query
    head's extra element is its sink / scale, the extra key is (0, .., 0, 1) for every K/V
    head, so its score is the sink, and its value is zeros; the other keys' and values'
    extra element is 0. With the causal rule the extra key is seen by every query (n_kv is
    one more than n_q); a mask needs `first_open`. The output's last element is 0: drop
    it."""
    def widened(t, extra):
        return O.concat(t, extra, 3)

    def zeros(shape, dtype):
        return constant(np.zeros(shape), dtype, name="sink zeros")
    q = widened(q, sink_column(sinks, q, scale))
    bk, kv_heads, n_kv, d = k.shape
    key = np.zeros((bk, kv_heads, 1, d + 1))
    key[..., d] = 1.0
    k = O.concat(constant(key, k.dtype, name="sink key"),
                 widened(k, zeros((bk, kv_heads, n_kv, 1), k.dtype)), 2)
    v = O.concat(zeros((bk, kv_heads, 1, d + 1), v.dtype),
                 widened(v, zeros((bk, kv_heads, n_kv, 1), v.dtype)), 2)
    return q, k, v


def sink_column(sinks, t, scale: float):
    """Each head's sink / scale as a column beside t (batch, head, rows, ..), in t's dtype."""
    b, heads, rows = t.shape[:3]
    column = O.reshape(sinks if scale == 1.0 else O.scale(sinks, 1.0 / scale), (1, heads, 1, 1))
    column = O.repeat(column, (b, heads, rows, 1))
    return column if column.dtype == t.dtype else O.cast(column, t.dtype)


def first_open(mask):
    """`mask` (.., n_q, n_kv) with a first column of zeros: a key every query sees (the
    sinks'); None stays None."""
    if mask is None:
        return None
    return O.concat(constant(np.zeros(mask.shape[:-1] + (1,)), mask.dtype, name="sink mask"),
                    mask, -1)


def sink_probs(kq, scale: float, mask, sinks):
    """softmax(kq * scale + mask) with attention sinks (gpt-oss; ggml_soft_max_add_sinks):
    each head's sink, a logit (not scaled) in every row of the head's scores (b, head, q,
    k), takes its share of the row's softmax and passes on nothing. The sinks are a first
    column of the scores, which no mask hides (without a mask: the causal rule one column
    further on); the probabilities of the keys are the other columns, a view."""
    scores = O.concat(sink_column(sinks, kq, scale), kq, 3)
    probs = (O.soft_max(scores, scale, 1) if mask is None
             else O.soft_max_ext(scores, first_open(mask), scale))
    return columns(probs, (1, kq.shape[-1]))[1]


def attention_scores(cfg, k, q, scale: float, folded: bool = False):
    """(the scores of q over k, the scale their softmax still applies): q.k with `scale`
    left to the softmax, or with `folded` applied in the product's epilogue; where
    cfg.attn_logit_softcap is set, scaled and soft-capped as llama.cpp's gemma2 graph does,
    c * tanh(scale * q.k / c), c the cap."""
    cap = cfg.attn_logit_softcap
    if cap:
        return O.scale(O.tanh(O.mul_mat(k, q, scale / cap)), cap), 1.0
    return (O.mul_mat(k, q, scale), 1.0) if folded else (O.mul_mat(k, q), scale)


def columns(t, widths, head_dim: int | None = None):
    """Views of consecutive column ranges of contiguous t's last dim, of the given `widths`
    (or an int: that many equal parts), each split into heads of `head_dim` when given
    (*lead, width / head_dim, head_dim): a fused product's parts (phi3's q | k | v,
    gate | up)."""
    if isinstance(widths, int):
        widths = (t.shape[-1] // widths,) * widths
    strides = tuple(int(np.prod(t.shape[d + 1:])) for d in range(t.ndim))
    starts = np.cumsum((0,) + tuple(widths[:-1]))
    if head_dim is None:
        return tuple(O.view(t, t.shape[:-1] + (w,), strides, int(s))
                     for s, w in zip(starts, widths))
    return tuple(O.view(t, t.shape[:-1] + (w // head_dim, head_dim), strides[:-1] +
                        (head_dim, 1), int(s)) for s, w in zip(starts, widths))


def split_heads(t, lead, heads: int, head_dim: int):
    """Rows of heads * head_dim features -> (*lead, heads, head_dim)."""
    return O.reshape(t, (*lead, heads, head_dim))


def swiglu(p: dict, b: str, h):
    """llama's feed-forward of block `b` on h: ffn_down(silu(ffn_gate h) * ffn_up h)."""
    return O.swiglu(linear(p, b + "ffn_gate.weight", h), linear(p, b + "ffn_up.weight", h))


def geglu(p: dict, b: str, h):
    """Gemma's feed-forward gate on h: gelu(ffn_gate h) * ffn_up h (gelu with tanh)."""
    return O.geglu(linear(p, b + "ffn_gate.weight", h), linear(p, b + "ffn_up.weight", h))


def experts(cfg, p: dict, b: str, h, normalize: bool, router_input=None, act=O.swiglu,
            gating: str | None = None, scale: float = 0.0):
    """Block b's mixture of experts on h (llama.cpp's build_moe_ffn, SwiGLU experts): the
    router ffn_gate_inp (plus its bias where the block has one) gives each token a
    probability per expert (its softmax, or with cfg.expert_gating 2 each logit's sigmoid),
    the token takes the cfg.n_expert_used most probable (top_k; ranked with exp_probs_b.bias
    added where the block has one, DeepSeek V3's balancing bias), and its output is the sum
    of their feed-forwards (ffn_{gate,up,down}_exps, one matrix per expert, each with its
    row of the stack's bias where there is one; gate and up as one ffn_gate_up_exps where
    cfg.fused_gate_up; `act` of gate and up, SwiGLU, gemma4's GeGLU or gpt-oss's
    swiglu_oai; without ffn_gate_exps `act` of up alone, nemotron_h_moe's relu^2) weighted
    by their probabilities, divided by the sum of those where `normalize` (llama.cpp's
    norm_w). `gating` "sigmoid" or "softmax" takes those whatever cfg says
    (nemotron_h_moe's graph; glm4moe's and afmoe's, Family.expert_gating); "softmax_taken"
    (gpt-oss's SOFTMAX_WEIGHT) takes the largest logits, their weights the softmax of those
    alone. The weights are times `scale` where it is neither 0
    nor 1 (llama.cpp's expert_weights_scale). The router reads `router_input` where given
    (gemma4's), else h. Where the block has ffn_down_exps.scale, each expert's output is
    times its value (before its LoRA pairs' terms, as llama.cpp scales it)."""
    rows, e = h.shape[:-1], h.shape[-1]
    n, k = cfg.n_expert, cfg.n_expert_used
    t = int(np.prod(rows))
    x = O.reshape(h, (t, e))
    # the router in f32 whatever the graph's precision: halves would tie experts, and pick
    # by their rounding
    router_input = x if router_input is None else O.reshape(router_input, (t, e))
    if router_input.dtype != "f32":
        router_input = O.cast(router_input, "f32")
    logits = linear(p, b + "ffn_gate_inp.weight", router_input)              # (t, n)
    if b + "ffn_gate_inp.bias" in p:
        logits = O.add(logits, p[b + "ffn_gate_inp.bias"])
    if gating == "softmax_taken":
        probs = logits
    elif gating == "sigmoid" or gating is None and cfg.expert_gating == 2:
        probs = O.sigmoid(logits)
    else:
        probs = O.soft_max(logits, 1.0)
    bias = p.get(b + "exp_probs_b.bias")
    taken = O.top_k(probs if bias is None else O.add(probs, bias), k)        # (t, k) ids
    picks = O.one_hot(taken, n)                                              # (t, k, n)
    weights = O.reshape(O.mul_mat(O.reshape(probs, (t, 1, n)), picks),
                        (t, 1, k))                    # each taken expert's probability
    if gating == "softmax_taken":
        weights = O.soft_max(weights, 1.0)
    if normalize:
        weights = O.div(weights, O.sum_rows(weights))
    if scale not in (0.0, 1.0):
        weights = O.scale(weights, scale)
    x = O.reshape(x, (t, 1, e))
    if b + "ffn_gate_exps.weight" not in p and not cfg.fused_gate_up:   # no gate: act(up)
        gated = act(routed(p, b + "ffn_up_exps.weight", x, taken))
    elif cfg.fused_gate_up:
        gated = act(*columns(routed(p, b + "ffn_gate_up_exps.weight", x, taken), 2))
    else:
        gated = act(routed(p, b + "ffn_gate_exps.weight", x, taken),
                    routed(p, b + "ffn_up_exps.weight", x, taken))            # (t, k, ff)
    scales = p.get(b + "ffn_down_exps.scale")
    if scales is not None:      # each slot's expert's scale, (t, k, 1)
        scales = O.mul_mat(O.reshape(scales, (1, n)), picks)
    out = routed(p, b + "ffn_down_exps.weight", gated, taken, scales)        # (t, k, e)
    y = O.reshape(O.mul_mat(O.transpose(out), weights), rows + (e,))
    return y if y.dtype == h.dtype else O.cast(y, h.dtype)

