"""The op test harness (after ggml's test-backend-ops), shared by the pytest suite and
`ggwgpu ops test|grad`.

Every registered op carries its test cases. For each case:
- forward: the device result against the NumPy reference in float64, NaN/infinity first,
  then normalized mean squared error; sentinel elements around every storage block of the
  plan must come back untouched (WebGPU clamps stray accesses, only sentinels see them);
- gradient: the backward graph in float64 against central finite differences of the
  forward, and the device backward against the NumPy backward.
- f16 (`half=True`, for the ops with an f16 kernel): the same cases with every float input
  an f16 tensor, its values rounded to halves: the device forward against the float64
  reference on those rounded values, the device backward against the NumPy backend in
  float32 (which stores f16 tensors as float16, rounding where the device does), both
  within the op's f16_nmse.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from . import ops as O
from .backends.numpy_backend import NumpyBackend
from .graph import build_backward
from .ops.registry import Case, OpDef
from .quant import QUANT_TYPES, QUANTIZABLE, quantize, random_blocks
from .tensor import constant, input_tensor

SENTINEL = 37           # guard elements on each side of every storage block
GRAD_NMSE = 1e-6        # device backward vs NumPy backward


@dataclass
class Result:
    op: str
    case: str
    ok: bool
    detail: str


def describe(case: Case) -> str:
    parts = []
    for i in case.inputs:
        s = "x".join(map(str, i.shape)) + (f":{i.dtype}" if i.dtype in QUANT_TYPES else "")
        s += f":{i.dist}" if i.dist in (*MASKS, "nonfinite") else ""
        parts.append(s if i.layout == "contiguous" else f"{s}({i.layout})")
    params = ",".join(f"{k}={v}" for k, v in case.params.items())
    return " ".join(parts) + (f" {params}" if params else "")


MASKS = ("causal", "documents", "hidden_rows")


def attention_mask(shape, dist, rng) -> np.ndarray:
    """An additive attention mask of `shape` (.., n_q, n_kv): values in [-1, 1) where a query
    sees a key, -inf where not. Query i sits at key position i + n_kv - n_q. 'causal': it
    sees the keys up to its position; 'documents': only those of its own document (random
    cuts per matrix, as packed training rows); 'hidden_rows': documents, and every third
    query row sees nothing."""
    n_q, n_kv = shape[-2:]
    at = np.arange(n_q) + n_kv - n_q
    seen = np.empty(shape, bool)
    for m in np.ndindex(shape[:-2]):
        s = np.arange(n_kv)[None, :] <= at[:, None]
        if dist != "causal":
            doc = np.cumsum(rng.random(n_kv) < 0.3)
            s &= doc[None, :] == doc[at][:, None]
        if dist == "hidden_rows":
            s[1::3] = False
        seen[m] = s
    return np.where(seen, rng.uniform(-1, 1, shape), -np.inf)


def as_laid_out(values: np.ndarray, layout: str) -> np.ndarray:
    """The leaf values that give `values` through build_case's view of `layout`; padding
    is NaN, so a kernel that reads it fails."""
    if layout == "permuted":
        return values.T
    if layout == "strided":
        leaf = np.full(values.shape[:-1] + (values.shape[-1] + 3,), np.nan)
        leaf[..., 1:1 + values.shape[-1]] = values
        return leaf
    if layout == "padded_t":
        t = np.swapaxes(values, -1, -2)
        leaf = np.full(t.shape[:-1] + (padded_row(t.shape[-1]),), np.nan)
        leaf[..., :t.shape[-1]] = t
        return leaf
    return values


def padded_row(n: int) -> int:
    """The row length of a 'padded_t' leaf: n rounded up to a multiple of 4, plus 4."""
    return -(-n // 4) * 4 + 4


def build_case(opdef: OpDef, case: Case, rng: np.random.Generator, half: bool = False):
    """Leaves with random float64 values, the views the case asks for, and the op's node;
    with `half`, the float inputs are f16 tensors and their values rounded to halves."""
    leaves, values, srcs = [], {}, []
    for k, spec in enumerate(case.inputs):
        shape = tuple(spec.shape)
        dtype = "f16" if half and spec.dtype == "f32" else spec.dtype
        if spec.dtype in QUANT_TYPES:  # a frozen weight: a constant, quantized random values
            value = (quantize(rng.uniform(spec.lo, spec.hi, shape), spec.dtype)
                     if spec.dtype in QUANTIZABLE else random_blocks(spec.dtype, shape, rng))
            leaf = constant(value, name=f"in{k}")
            leaves.append(leaf)
            srcs.append(leaf)
            continue
        if spec.layout == "permuted" and len(shape) > 1:
            axes = tuple(reversed(range(len(shape))))
            leaf = input_tensor(tuple(shape[a] for a in axes), dtype, name=f"in{k}")
            src = O.permute(leaf, axes)
        elif spec.layout == "padded_t":
            # the transpose of a leaf's rows padded to a multiple of 4 (offset 0): a
            # backward product's operand, read K-outermost, its rows not a multiple of 4
            rows = shape[:-2] + (shape[-1], shape[-2])
            leaf = input_tensor(rows[:-1] + (padded_row(rows[-1]),), dtype, name=f"in{k}")
            src = O.transpose(O.view(leaf, rows, leaf.strides, 0))
        elif spec.layout == "strided":
            # rows padded by 3 elements and one element of offset: a view inside a bigger leaf
            leaf = input_tensor(shape[:-1] + (shape[-1] + 3,), dtype, name=f"in{k}")
            src = O.view(leaf, shape, leaf.strides, 1)
        else:
            leaf = src = input_tensor(shape, dtype, name=f"in{k}")
        leaves.append(leaf)
        if spec.dtype == "i32" and spec.dist == "distinct":     # no value twice
            values[leaf] = rng.permutation(np.arange(spec.lo, spec.hi, dtype=np.int32))[
                :int(np.prod(leaf.shape))].reshape(leaf.shape)
        elif spec.dtype == "i32":
            values[leaf] = rng.integers(spec.lo, spec.hi, leaf.shape, dtype=np.int32)
        elif spec.dist == "probs":
            v = rng.uniform(0.01, 1.0, leaf.shape)
            values[leaf] = v / v.sum(axis=-1, keepdims=True)
        elif spec.dist in MASKS:
            values[leaf] = as_laid_out(attention_mask(shape, spec.dist, rng), spec.layout)
        else:
            values[leaf] = rng.uniform(spec.lo, spec.hi, leaf.shape)
            if spec.dist == "nonfinite":  # one NaN, +inf or -inf somewhere
                values[leaf].flat[rng.integers(values[leaf].size)] = rng.choice(
                    [np.nan, np.inf, -np.inf])
        if dtype == "f16":
            values[leaf] = values[leaf].astype(np.float16).astype(np.float64)
        srcs.append(src)
    node = getattr(O, opdef.name)(*srcs, **case.params)
    return leaves, values, node


def as_f32(values: dict) -> dict:
    """The float64 test values as a float32 device gets them (integers stay as they are)."""
    return {t: v.astype(np.float32) if v.dtype.kind == "f" else v for t, v in values.items()}


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    err = float(np.sum((out.astype(np.float64) - ref) ** 2))
    norm = float(np.sum(ref.astype(np.float64) ** 2))
    return err / norm if norm > 0 else err


def compare(out, ref, bound) -> tuple[bool, str]:
    """NaN and infinity placement first, then NMSE against `bound`."""
    bad_nan = np.isnan(out) != np.isnan(ref)
    bad_inf = (np.isinf(out) != np.isinf(ref)) | (np.isinf(ref) & (np.sign(out) != np.sign(ref)))
    if bad_nan.any() or bad_inf.any():
        return False, f"NaN/inf mismatch at {np.argwhere(bad_nan | bad_inf)[:4].tolist()}"
    finite = np.isfinite(ref)
    e = nmse(out[finite], ref[finite])
    return e <= bound, f"nmse={e:.2e} (bound {bound:.0e})"


def f16_bound(opdef: OpDef, case: Case, half: bool, node) -> float:
    """The NMSE bound of a case: the op's f16 bound where inputs or result are halves (or
    the case's own bound, where looser)."""
    if half or node.dtype == "f16":
        return max(case.nmse or 0.0, opdef.f16_nmse)
    return case.nmse or opdef.nmse


def forward(opdef: OpDef, case: Case, backend, seed=0, half=False) -> Result:
    leaves, values, node = build_case(opdef, case, np.random.default_rng(seed), half)
    ref_plan = NumpyBackend(np.float64, fast=False).plan([node])   # the references alone
    ref_plan.run(values)
    ref = ref_plan.read(node)
    plan = backend.plan([node], sentinel=SENTINEL)
    plan.run(as_f32(values))
    ok, detail = compare(plan.read(node), ref, f16_bound(opdef, case, half, node))
    stray = plan.stray_writes()
    if stray:
        ok, detail = False, f"wrote outside {stray} (sentinel overwritten); {detail}"
    return Result(opdef.name, describe(case), ok, detail)


def grad_graph(opdef: OpDef, case: Case, seed=0, half=False):
    """loss = sum(op(inputs) * R) with a fixed random R, and its gradients w.r.t. every
    input the op differentiates."""
    rng = np.random.default_rng(seed)
    leaves, values, node = build_case(opdef, case, rng, half)
    if opdef.grad_head:
        node = opdef.grad_head(node)
    weights = constant(rng.uniform(-1, 1, node.shape).astype(np.float32), name="R")
    loss = O.sum(O.mul(node, weights))
    params = [leaf for k, leaf in enumerate(leaves)
              if k not in opdef.no_grad and leaf.dtype in ("f32", "f16")
              and not leaf.is_quantized]
    return loss, build_backward(loss, params), values


def finite_differences(opdef: OpDef, case: Case, seed=0) -> Result:
    loss, grads, values = grad_graph(opdef, case, seed)
    backend = NumpyBackend(np.float64)
    plan = backend.plan([loss, *grads.values()])
    plan.run(values)
    fwd = backend.plan([loss])
    eps, atol, rtol = opdef.fd
    worst = 0.0
    for leaf, g in grads.items():
        analytic = plan.read(g)
        numeric = np.zeros(leaf.shape)
        v = values[leaf].copy()
        for i in np.ndindex(leaf.shape):
            x = v[i]
            v[i] = x + eps
            fwd.run({**values, leaf: v})
            hi = fwd.read(loss)[0]
            v[i] = x - eps
            fwd.run({**values, leaf: v})
            lo = fwd.read(loss)[0]
            v[i] = x
            numeric[i] = (hi - lo) / (2 * eps)
        excess = np.abs(analytic - numeric) - (atol + rtol * np.abs(numeric))
        worst = max(worst, float(np.max(np.abs(analytic - numeric))))
        if not np.all(excess <= 0):  # NaN fails too
            excess = np.where(np.isnan(excess), np.inf, excess)
            at = np.unravel_index(np.argmax(excess), leaf.shape)
            return Result(opdef.name, describe(case), False,
                          f"d/d{leaf.name}{list(at)}: backward {analytic[at]:.6g} vs finite "
                          f"differences {numeric[at]:.6g}")
    return Result(opdef.name, describe(case), True, f"max |backward - fd| = {worst:.1e}")


def backward_on(opdef: OpDef, case: Case, backend, seed=0, half=False) -> Result:
    """The device backward against the NumPy float64 backward of the same graph (with
    `half`, f16 inputs: the NumPy float32 backward, f16 storage as float16): once with
    sentinels around every buffer, once with buffers shared by liveness as in training."""
    loss, grads, values = grad_graph(opdef, case, seed, half)
    outputs = [loss, *grads.values()]
    ref = NumpyBackend(np.float32 if half else np.float64).plan(outputs)
    ref.run(as_f32(values) if half else values)
    bound = max(GRAD_NMSE, opdef.f16_nmse if half else opdef.nmse)
    details = []
    for label, plan in (("", backend.plan(outputs, sentinel=SENTINEL)),
                        ("shared buffers: ", backend.plan(outputs))):
        plan.run(as_f32(values))
        for leaf, g in grads.items():
            ok, detail = compare(plan.read(g), ref.read(g), bound)
            if not ok:
                return Result(opdef.name, describe(case), False, f"{label}d{leaf.name}: {detail}")
            if not label:
                details.append(f"d{leaf.name}: {detail}")
        stray = plan.stray_writes()
        if stray:
            return Result(opdef.name, describe(case), False, f"wrote outside {stray}")
    return Result(opdef.name, describe(case), True, "; ".join(details))


def cases_of(name: str, grad_only=False) -> list[Case]:
    return [c for c in O.OPS[name].cases() if c.grad or not grad_only]


def f16_cases_of(name: str, grad_only=False) -> list[Case]:
    """The cases of an op with an f16 kernel that have a float input to make f16 (none for
    the ops without one: ops.registry.f32_only_ops)."""
    if not O.OPS[name].f16:
        return []
    return [c for c in cases_of(name, grad_only) if any(i.dtype == "f32" for i in c.inputs)]


def through_checkpoint(trainer, path, tokenizer) -> tuple:
    """A Trainer's model, optimizer state and training state written as a checkpoint at
    `path` and read back: checkpoint.load_checkpoint's (cfg, values, tokenizer, opt_state,
    state), what a resumed run starts from."""
    from .training.checkpoint import load_checkpoint, save_checkpoint
    save_checkpoint(path, trainer.cfg, trainer.parameters(), tokenizer,
                    trainer.optimizer_state(), trainer.state())
    return load_checkpoint(path)


def spot_check_gradients(loss, analytic: dict, feeds, samples: int = 8, seed: int = 0,
                         eps: float = 1e-6, atol: float = 1e-6, rtol: float = 1e-4):
    """A whole model's gradients ({param: array}, computed by any backend) against central
    finite differences of `loss` in float64 NumPy, at `samples` random elements of each
    param. Raises AssertionError naming the param and element that disagree."""
    fwd = NumpyBackend(np.float64).plan([loss])
    rng = np.random.default_rng(seed)
    for p, grad in analytic.items():
        base = p.value.astype(np.float64)
        for i in [tuple(rng.integers(0, n) for n in p.shape) for _ in range(samples)]:
            losses = []
            for sign in (1, -1):
                v = base.copy()
                v[i] += sign * eps
                fwd.write(p, v)
                fwd.run(feeds)
                losses.append(fwd.read(loss)[0])
            fwd.write(p, base)
            numeric = (losses[0] - losses[1]) / (2 * eps)
            assert abs(grad[i] - numeric) <= atol + rtol * abs(numeric), \
                f"{p.name}{list(i)}: backward {grad[i]} vs finite differences {numeric}"


def directional_check_gradients(loss, analytic: dict, feeds, directions: int = 2,
                                seed: int = 0, eps: float = 1e-6, atol: float = 1e-6,
                                rtol: float = 1e-4):
    """A whole model's gradients ({param: array}) against central finite differences of
    `loss` in float64 NumPy along `directions` random directions d of each param (normal
    entries): (loss(p + eps d) - loss(p - eps d)) / 2 eps against the gradient's projection
    sum(grad * d), as gradcheck's fast mode checks. Every element's error enters each
    projection: two loss evaluations a direction check what `spot_check_gradients` checks
    at one sampled element with the same two. Raises AssertionError naming the param."""
    fwd = NumpyBackend(np.float64).plan([loss])
    rng = np.random.default_rng(seed)
    for p, grad in analytic.items():
        base = p.value.astype(np.float64)
        for k in range(directions):
            d = rng.standard_normal(p.shape)
            losses = []
            for sign in (1, -1):
                fwd.write(p, base + sign * eps * d)
                fwd.run(feeds)
                losses.append(fwd.read(loss)[0])
            fwd.write(p, base)
            numeric, projected = (losses[0] - losses[1]) / (2 * eps), float(np.sum(grad * d))
            assert abs(projected - numeric) <= atol + rtol * abs(numeric), \
                f"{p.name} along direction {k}: backward {projected} vs finite differences " \
                f"{numeric}"


# -- the model families in plain NumPy ----------------------------------------------------------
# Written from llama.cpp's graphs (src/models/<arch>.cpp, src/llama-graph.cpp), not from
# ggwgpu's: an independent float64 reference for the logits of every family.

# llama_model_rope_type NEOX; others NORM
NEOX = ("qwen2", "qwen3", "gemma2", "gemma3", "phi3", "lfm2", "olmo2", "exaone4", "hunyuan-dense",
        "qwen3moe", "qwen2moe", "olmoe", "exaone")
# llama.cpp's set_swa_pattern(n) of the archs that window with a sliding_window
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "olmo2": 4}
# graphs passing rope_freqs.weight to rope
ROPE_FACTORS = ("llama", "granite", "exaone4", "mistral3", "minicpm", "arcee", "exaone")


def _longrope_factors(cfg, w):
    """LongRoPE's factor table of weights `w` (None where they have none): the long factors
    when the context exceeds rope_orig_ctx, else the short ones, as llama.cpp picks them."""
    if "rope_factors_long.weight" not in w:
        return None
    long = cfg.rope_orig_ctx and cfg.n_ctx > cfg.rope_orig_ctx
    return w["rope_factors_long.weight" if long else "rope_factors_short.weight"]


def _swa_base(cfg, local: bool) -> float:
    """A layer's rope base: rope_freq_base_swa where it is windowed and that is set."""
    return cfg.rope_freq_base_swa if local and cfg.rope_freq_base_swa else cfg.rope_freq_base


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, n_rot, neox, base, scale, factors, attn_factor=1.0, yarn=None):
    """ggml_rope_ext on x (T, heads, head_dim): pair i of the first n_rot dims turns by
    pos * scale * base^(-2i / n_rot) / factors[i], its cos and sin times attn_factor; the
    rest pass. The pairs: mode NORM takes adjacent dims (2i, 2i + 1), mode NEOX (i, i + n_rot
    / 2). With yarn = (original context, beta_fast, beta_slow), YaRN as ggml's rope_yarn
    with ext_factor 1: the pairs from the one turning beta_fast times in the original context
    to the one turning beta_slow times take a share of their unscaled angle falling from 1
    to 0 (all of it before them), and cos and sin are also times 1 + 0.1 ln(1 / scale)."""
    i = np.arange(n_rot // 2)
    unscaled = positions[:, None] * base ** (-2.0 * i / n_rot) / factors
    theta = scale * unscaled
    if yarn:
        orig_ctx, beta_fast, beta_slow = yarn

        def corr_dim(turns):
            return n_rot * np.log(orig_ctx / (turns * 2 * np.pi)) / (2 * np.log(base))
        lo = max(0, np.floor(corr_dim(beta_fast)))
        hi = min(n_rot - 1, np.ceil(corr_dim(beta_slow)))
        share = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
        theta = theta * (1 - share) + unscaled * share
        attn_factor = attn_factor * (1 + 0.1 * np.log(1 / scale))
    theta = theta[:, None, :]
    first, second = (i, i + n_rot // 2) if neox else (2 * i, 2 * i + 1)
    a, b = x[..., first], x[..., second]
    out = x.copy()
    cos, sin = attn_factor * np.cos(theta), attn_factor * np.sin(theta)
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def _context_rope(cfg) -> tuple[float, tuple | None]:
    """The attn_factor and YaRN's (original context, beta_fast, beta_slow) (None: no YaRN)
    that llama.cpp's context gives every rope of cfg (llama-context.cpp): a YaRN model's
    attn_factor is get_mscale(factor, 1) / (1 + 0.1 ln factor), with a yarn_log_multiplier
    m get_mscale(factor, 1) / get_mscale(factor, m) / (1 + 0.1 ln factor), times
    rope.scaling.attn_factor."""
    if cfg.rope_scaling != "yarn":
        return cfg.rope_attn_factor, None
    factor = 1 / cfg.rope_freq_scale

    def get_mscale(m):
        return 0.1 * m * np.log(factor) + 1 if factor > 1 else 1.0
    ratio = get_mscale(1) / get_mscale(cfg.yarn_log_mul) if cfg.yarn_log_mul else get_mscale(1)
    return (cfg.rope_attn_factor * ratio / (1 + 0.1 * np.log(factor)),
            (cfg.rope_orig_ctx, cfg.yarn_beta_fast, cfg.yarn_beta_slow))


def _attention_temperature(cfg, positions):
    """Llama 4's attention temperature of each position (llama.cpp's inp_attn_scale), Q's
    factor: ln(floor(pos / rope_orig_ctx) + 1) * attn_temp_scale + 1 (1 without a scale)."""
    if not cfg.attn_temp_scale:
        return np.ones((len(positions), 1, 1))
    return (np.log(np.floor(positions / cfg.rope_orig_ctx) + 1) * cfg.attn_temp_scale
            + 1)[:, None, None]


def _attention(q, k, v, kq_scale, window=0, softcap=0.0, sinks=None):
    """softmax(q k^T * kq_scale + mask) v, heads concatenated: q (T, n_head, d), k and v
    (T, n_kv, d), query head j reading K/V head j // (n_head / n_kv). Query p_q masks key p_k
    when p_k > p_q, and with a window when p_q - p_k >= window (is_masked_swa, STANDARD).
    With `softcap` c, the scores q k^T are c * tanh(q k^T / c) first (llama.cpp's
    attn_soft_cap). With `sinks` (n_head,), head j's softmax has one more logit, sinks[j],
    whose share goes nowhere (ggml_soft_max_add_sinks)."""
    ahead = np.arange(len(q))[:, None] - np.arange(len(k))[None, :]           # p_q - p_k
    masked = (ahead < 0) | (ahead >= window if window else False)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = np.where(masked, -np.inf, s * kq_scale)
    top = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[:, None, None] - top)
    return np.einsum("hqk,khd->qhd", p / total, v).reshape(len(q), -1)


def _causal_conv(x, w):
    """ggml_ssm_conv with a zero state: y[t, c] = sum_j x[t - (L - 1 - j), c] w[c, j], x (T, C)
    and w (C, L), rows before 0 being 0."""
    length = w.shape[1]
    padded = np.concatenate([np.zeros((length - 1, x.shape[1])), x])
    return sum(padded[j:j + len(x)] * w[:, j] for j in range(length))


def _silu(x):
    return x / (1 + np.exp(-x))


def _relu_sqr(x):
    return np.maximum(x, 0) ** 2


def _gelu(x):     # ggml's gelu: the tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))


def _glu(h, gate, up, down, act):
    """build_ffn with a parallel gate: (act(h gate^T) * h up^T) down^T; act _silu: SwiGLU,
    _gelu: GeGLU."""
    return (act(h @ gate.T) * (h @ up.T)) @ down.T


def _experts(cfg, p, h, normalize: bool, bias=0.0, act=_silu, router=None, scales=None,
             sigmoid=None, gated=True):
    """llama.cpp's build_moe_ffn (`act`-gated experts, SwiGLU by default; gate and up one
    stack where cfg.fused_gate_up; without a gate (`gated` False) down(act(up h))), token by
    token: the router (reading `router` where given, else h)'s softmax, or its sigmoids
    (`sigmoid`, by default cfg.expert_gating 2), as the probabilities; the cfg.n_expert_used
    most probable experts (ranked with `bias` added; ties: the lower index), their outputs
    times their `scales` where given, weighted by their probabilities (divided by their sum
    where `normalize`)."""
    logits = (h if router is None else router) @ p("ffn_gate_inp.weight").T
    if cfg.expert_gating == 2 if sigmoid is None else sigmoid:
        probs = 1 / (1 + np.exp(-logits))
    else:
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(len(h)):
        taken = np.argsort(-(probs[t] + bias), kind="stable")[:cfg.n_expert_used]
        weights = probs[t, taken] / (probs[t, taken].sum() if normalize else 1.0)
        for e, weight in zip(taken, weights):
            if not gated:
                y = act(h[t] @ p("ffn_up_exps.weight")[e].T) @ p("ffn_down_exps.weight")[e].T
                out[t] += weight * y
                continue
            if cfg.fused_gate_up:
                gate, up = np.split(p("ffn_gate_up_exps.weight")[e], 2)
            else:
                gate, up = p("ffn_gate_exps.weight")[e], p("ffn_up_exps.weight")[e]
            y = _glu(h[t], gate, up, p("ffn_down_exps.weight")[e], act)
            out[t] += weight * (y if scales is None else scales[e] * y)
    return out


def _shared_experts(cfg, p, h, normalize=True):
    """`_experts` plus the shared expert times the sigmoid of its gate (qwen2moe's and
    qwen35moe's)."""
    gate = 1 / (1 + np.exp(-(h @ p("ffn_gate_inp_shexp.weight"))))
    return _experts(cfg, p, h, normalize) + gate[:, None] * _glu(
        h, p("ffn_gate_shexp.weight"), p("ffn_up_shexp.weight"), p("ffn_down_shexp.weight"),
        _silu)


def split_qkv(cfg, values: dict) -> dict:
    """`values` with each fused attn_qkv.weight (and .bias) as attn_q, attn_k and attn_v."""
    split = {}
    for name, value in values.items():
        fused = re.fullmatch(r"(blk\.\d+\.)attn_qkv\.(weight|bias)", name)
        if fused is None:
            split[name] = value
            continue
        parts = np.split(value, [cfg.q_dim, cfg.q_dim + cfg.kv_dim])
        split.update({f"{fused[1]}attn_{m}.{fused[2]}": v for m, v in zip("qkv", parts)})
    return split


def reference_logits(cfg, values, tokens) -> np.ndarray:
    """The logits (T, n_vocab) of one token sequence at positions 0..T-1, in float64 and
    plain NumPy, independent of ggwgpu's ops and graphs: llama.cpp's graph of cfg.arch
    written out. All: RMS norms, grouped-query causal attention, SwiGLU, Q/K/V biases where
    given, output.weight or else token_embd.weight; with cfg.n_expert a mixture of experts
    for the feed-forward past the first cfg.n_dense_lead blocks (`_experts`; normalized
    weights but for qwen2moe and olmoe, lfm2moe's and ernie4_5-moe's ranking bias
    exp_probs_b; qwen2moe's shared expert times the sigmoid of its gate, granite's and
    ernie4_5-moe's as it is). qwen3moe: qwen3's attention.
    olmoe: Q and K normed as olmo2's, pre-norms. lfm2moe: lfm2's. granitemoe: granite's.
    llama: rope NORM with Llama 3's frequency factors. qwen2: rope NEOX. qwen3: per-head RMS
    norms of Q and K before rope.
    gemma3: inputs times sqrt(n_embd), QK norms, a norm after attention and after the feed-
    forward before each residual add, GeGLU, Q times 1/sqrt(head_dim) (1/sqrt(n_embd /
    n_head) at 62 layers) and scores times 1, and with a sliding window, five layers of six
    windowed and roped at rope_freq_base_swa (llama.cpp's 10000 when unset) with scale 1;
    logits c * tanh(logits / c). gemma2: gemma3's without QK norms, with the scores (Q times
    1/sqrt(head_dim), 1/sqrt(n_embd / n_head) at 46 layers) c * tanh(s / c), c =
    attn_logit_softcap, and a window on the even layers, roped at rope_freq_base_swa (else
    the global base) with the global scale. olmo2: no pre-norms, Q and K RMS-normed over
    their whole width, a norm after each branch, with a sliding window three layers of four
    roped at the global base with scale 1. smollm3: no rope on every
    fourth layer. ernie4_5: llama's without rope factors. exaone4: olmo2's with per-head QK
    norms and rope factors; at 64 layers three of four windowed and roped, the fourth not
    roped. granite: rope with
    frequency factors, inputs times embedding_scale, both branches times residual_scale,
    scores times attention_scale (1/sqrt(head_dim) when 0), logits divided by logit_scale;
    minicpm: granite's. arcee: llama's with
    ffn_down(relu(ffn_up h)^2), no gate. glm4: Q/K/V biases, partial rope NORM, a norm
    after each branch as well, phi3's fused gate | up.
    phi3: rope NEOX; Q, K and V from one fused attn_qkv (rows q | k | v); ffn_up's rows
    gate | up, silu(gate) * up; LongRoPE: rope_factors_long when n_ctx exceeds
    rope_orig_ctx, else rope_factors_short. lfm2: the
    blocks of cfg.conv_layers mix by a short convolution (in_proj's b | c | x, c times the
    causal depthwise convolution of b * x, out_proj), the others attend with QK norms and
    neox rope (within sliding_window where set); the final norm is token_embd_norm.
    mistral3: llama's, YaRN with the file's betas and log multiplier, Q times the attention
    temperature of its position after rope (`_attention_temperature`). hunyuan-dense: neox rope,
    per-head RMS norms of Q and K after it.
    gemma4: `gemma4_reference_logits`. qwen35: `qwen35_reference_logits`. gpt-oss:
    `gpt_oss_reference_logits`. deepseek2: `deepseek2_reference_logits`. command-r,
    cohere2: `command_r_reference_logits`. Every rope's cos
    and sin are times rope_attn_factor, and a YaRN model's are YaRN (`_context_rope`), but
    olmo2's windowed layers' (plain rope). `values` are float arrays (dequantize block types
    first). A model of one fused attn_qkv (cfg.fused_qkv) is the same model with its rows
    q | k | v (and its bias's) as attn_q, attn_k and attn_v."""
    if cfg.fused_qkv:
        return reference_logits(dataclasses.replace(cfg, fused_qkv=False),
                                split_qkv(cfg, values), tokens)
    arch, eps = cfg.arch, cfg.norm_eps
    if arch == "gemma4":
        return gemma4_reference_logits(cfg, values, tokens)
    if arch in ("granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon-h1"):
        return granitehybrid_reference_logits(cfg, values, tokens)
    if arch in ("phi2", "starcoder2", "stablelm", "gpt2", "gptneox", "nemotron"):
        return phi2_reference_logits(cfg, values, tokens)
    if arch in ("qwen35", "qwen35moe"):
        return qwen35_reference_logits(cfg, values, tokens)
    if arch == "gpt-oss":
        return gpt_oss_reference_logits(cfg, values, tokens)
    if arch in ("command-r", "cohere2"):
        return command_r_reference_logits(cfg, values, tokens)
    if arch in ("deepseek2", "mistral4"):
        return deepseek2_reference_logits(cfg, values, tokens)
    if arch == "minicpm3":
        return minicpm3_reference_logits(cfg, values, tokens)
    if arch == "phimoe":
        return phimoe_reference_logits(cfg, values, tokens)
    if arch == "afmoe":
        return afmoe_reference_logits(cfg, values, tokens)
    if arch == "smallthinker":
        return smallthinker_reference_logits(cfg, values, tokens)
    if arch in ("glm4moe", "seed_oss", "bailingmoe2"):
        return glm4moe_reference_logits(cfg, values, tokens)
    if arch not in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "smollm3", "granite", "phi3",
                    "lfm2", "olmo2", "ernie4_5", "exaone4", "mistral3", "hunyuan-dense",
                    "minicpm", "arcee", "glm4", "qwen3moe", "qwen2moe", "olmoe", "lfm2moe",
                    "granitemoe", "ernie4_5-moe", "exaone", "internlm2", "hunyuan-moe"):
        raise ValueError(f"no reference for arch {arch!r}")
    normalize = arch not in ("qwen2moe", "olmoe")       # the experts' weights (norm_w)
    arch = {"lfm2moe": "lfm2", "granitemoe": "granite", "ernie4_5-moe": "ernie4_5",
            "hunyuan-moe": "hunyuan-dense"}.get(arch, arch)                 # their blocks
    gemma, granite = arch in ("gemma2", "gemma3"), arch in ("granite", "minicpm")
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, hd = len(tokens), cfg.head_dim
    positions = np.arange(n, dtype=np.float64)
    factors = w.get("rope_freqs.weight") if arch in ROPE_FACTORS else None
    if "rope_factors_long.weight" in w:     # LongRoPE (phi3, minicpm)
        factors = _longrope_factors(cfg, w)
    attn_factor, yarn = _context_rope(cfg)
    factors = np.ones(cfg.rot // 2) if factors is None else factors
    q_scale, kq_scale = 1.0, 1 / np.sqrt(hd)
    if gemma:
        wide = cfg.n_layer == (46 if arch == "gemma2" else 62)     # the 27B models
        q_scale, kq_scale = 1 / np.sqrt(cfg.n_embd // cfg.n_head if wide else hd), 1.0
    elif granite and cfg.attention_scale:
        kq_scale = cfg.attention_scale
    branch = cfg.residual_scale if granite and cfg.residual_scale else 1.0
    x = w["token_embd.weight"][tokens]
    if gemma:
        x = x * np.sqrt(cfg.n_embd)
    elif granite and cfg.embedding_scale:
        x = x * cfg.embedding_scale
    post_only = arch in ("olmo2", "exaone4")            # no pre-norms, post-norms
    post_norms = gemma or post_only or arch == "glm4"   # a norm after each branch
    exaone_swa = arch == "exaone4" and cfg.n_layer == 64  # the 32B: windows, global NoPE
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        # the layer's window (every n-th layer global) and its rope base and scale
        pattern = 4 if exaone_swa else SWA_PATTERNS.get(arch, 0)
        local = cfg.sliding_window > 0 and pattern > 0 and il % pattern < pattern - 1
        base, scale = cfg.rope_freq_base, cfg.rope_freq_scale
        if local and arch == "gemma3":
            base, scale = cfg.rope_freq_base_swa or 10000.0, 1.0
        elif local and arch == "gemma2":
            base = cfg.rope_freq_base_swa or cfg.rope_freq_base
        rope_yarn = attn_factor, yarn
        if local and arch == "olmo2":           # OLMo 3's windowed layers: no YaRN
            scale, rope_yarn = 1.0, (1.0, None)
        local = local or arch == "lfm2" and cfg.sliding_window > 0   # its base stays global
        h = x if post_only else _rms_norm(x, p("attn_norm.weight"), eps)
        if il in cfg.conv_layers:       # lfm2's short convolution
            b, c, xx = np.split(h @ p("shortconv.in_proj.weight").T, 3, axis=1)
            y = _causal_conv(b * xx, p("shortconv.conv.weight"))
            x = x + (c * y) @ p("shortconv.out_proj.weight").T
        else:
            if arch == "phi3":
                qkv = h @ p("attn_qkv.weight").T
                q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=1)
            else:
                q, k, v = (h @ p(f"attn_{m}.weight").T + w.get(f"blk.{il}.attn_{m}.bias", 0.0)
                           for m in "qkv")
            if arch in ("olmo2", "olmoe"):
                q, k = _rms_norm(q, p("attn_q_norm.weight"), eps), _rms_norm(
                    k, p("attn_k_norm.weight"), eps)
            q, k, v = (y.reshape(n, -1, hd) for y in (q, k, v))
            if arch in ("qwen3", "gemma3", "lfm2", "exaone4", "qwen3moe"):
                q = _rms_norm(q, p("attn_q_norm.weight"), eps)
                k = _rms_norm(k, p("attn_k_norm.weight"), eps)
            if not (arch == "smollm3" and (il + 1) % 4 == 0 or exaone_swa and il % 4 == 3):
                q, k = (_rope(y, positions, cfg.rot, arch in NEOX, base, scale, factors,
                              *rope_yarn) for y in (q, k))
            if arch == "hunyuan-dense":       # its QK norms after rope
                q = _rms_norm(q, p("attn_q_norm.weight"), eps)
                k = _rms_norm(k, p("attn_k_norm.weight"), eps)
            q = q * _attention_temperature(cfg, positions)
            att = _attention(q * q_scale, k, v, kq_scale, cfg.sliding_window if local else 0,
                             cfg.attn_logit_softcap)
            att = att @ p("attn_output.weight").T
            if post_norms:
                att = _rms_norm(att, p("post_attention_norm.weight"), eps)
            x = x + branch * att
        h = x if post_only else _rms_norm(x, p("ffn_norm.weight"), eps)
        if arch in ("phi3", "glm4"):      # LLM_FFN_SWIGLU on ffn_up's halves
            gate, up = np.split(h @ p("ffn_up.weight").T, 2, axis=1)
            ffn = (_silu(gate) * up) @ p("ffn_down.weight").T
        elif cfg.n_expert and il >= cfg.n_dense_lead:
            ffn = _experts(cfg, p, h, normalize, w.get(f"blk.{il}.exp_probs_b.bias", 0.0))
            if arch == "qwen2moe":
                ffn = _shared_experts(cfg, p, h, normalize=False)
            elif arch in ("granite", "ernie4_5") and cfg.n_ff_shexp or \
                    arch == "hunyuan-dense":        # hunyuan-moe's shared expert
                ffn = ffn + _glu(h, p("ffn_gate_shexp.weight"), p("ffn_up_shexp.weight"),
                                 p("ffn_down_shexp.weight"), _silu)
        elif arch == "arcee":   # LLM_FFN_RELU_SQR, no gate
            ffn = np.maximum(h @ p("ffn_up.weight").T, 0) ** 2 @ p("ffn_down.weight").T
        else:
            ffn = _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"),
                       _gelu if gemma else _silu)
        if post_norms:
            ffn = _rms_norm(ffn, p("post_ffw_norm.weight"), eps)
        x = x + branch * ffn
    out = w.get("output.weight", w["token_embd.weight"])
    norm = w["token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"]
    logits = _rms_norm(x, norm, eps) @ out.T
    if granite:
        logits = logits / cfg.logit_scale
    if gemma and cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * np.tanh(logits / cfg.final_logit_softcap)
    return logits


def _layer_norm(x, w, b, eps):
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def phi2_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's phi2 graph: per block h = LayerNorm(x) (weight and bias), x + attention(h)
    + ffn_down(gelu(ffn_up h + b)) + b; attention with Q/K/V and output biases and partial
    neox rope; the final LayerNorm, the output matrix and its bias. starcoder2: the
    feed-forward after attention, on its own LayerNorm (ffn_norm), no logits' bias, tied
    embeddings where there is no output.weight. stablelm: starcoder2's order, SwiGLU without
    biases, no attention output bias, Q/K/V biases where given. gpt2: starcoder2's with the
    position embedding's rows added to the token embeddings, Q, K and V from one fused
    attn_qkv with its bias, and no rope. gptneox: gpt2's fused attn_qkv with phi2's partial
    rope, no position embedding, the feed-forward on its own LayerNorm of the block's input
    where parallel_residual, else starcoder2's order. nemotron: stablelm's without biases,
    the feed-forward ffn_down(relu(ffn_up h)^2)."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, hd, eps = len(tokens), cfg.head_dim, cfg.norm_eps
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    x = w["token_embd.weight"][tokens]
    gpt2 = cfg.arch == "gpt2"
    if gpt2:
        x = x + w["position_embd.weight"][:n]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        bias = lambda name: w.get(f"blk.{il}.{name}.bias", 0.0)    # noqa: E731
        h = _layer_norm(x, p("attn_norm.weight"), p("attn_norm.bias"), eps)
        if cfg.arch in ("gpt2", "gptneox"):
            qkv = np.split(h @ p("attn_qkv.weight").T + bias("attn_qkv"),
                           [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=1)
            q, k, v = (y.reshape(n, -1, hd) for y in qkv)
        else:
            q, k, v = ((h @ p(f"attn_{m}.weight").T + bias(f"attn_{m}")).reshape(n, -1, hd)
                       for m in "qkv")
        if not gpt2:
            q, k = (_rope(y, positions, cfg.rot, True, cfg.rope_freq_base,
                          cfg.rope_freq_scale, np.ones(cfg.rot // 2), attn_factor, yarn)
                    for y in (q, k))
        block_input = x
        x = x + _attention(q, k, v, 1 / np.sqrt(hd)) @ p("attn_output.weight").T + \
            bias("attn_output")
        if cfg.arch != "phi2":
            h = _layer_norm(block_input if cfg.parallel_residual else x, p("ffn_norm.weight"),
                            p("ffn_norm.bias"), eps)
        if cfg.arch == "stablelm":
            x = x + _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"),
                         _silu)
            continue
        if cfg.arch == "nemotron":
            x = x + np.maximum(h @ p("ffn_up.weight").T, 0) ** 2 @ p("ffn_down.weight").T
            continue
        up = _gelu(h @ p("ffn_up.weight").T + p("ffn_up.bias"))
        x = x + up @ p("ffn_down.weight").T + p("ffn_down.bias")
    h = _layer_norm(x, w["output_norm.weight"], w["output_norm.bias"], eps)
    return h @ w.get("output.weight", w["token_embd.weight"]).T + w.get("output.bias", 0.0)


def command_r_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's command-r graph in float64: per block h = LayerNorm(x) (weight, no bias),
    x + attention(h) (rope normal) + SwiGLU(h); the final LayerNorm; the token embedding as
    the output matrix, the logits times logit_scale. cohere2: rope and a window on the
    layers i % 4 < 3 only, the others global without rope."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, hd, eps = len(tokens), cfg.head_dim, cfg.norm_eps
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    x = w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        local = cfg.arch == "cohere2" and cfg.sliding_window > 0 and il % 4 < 3
        h = _layer_norm(x, p("attn_norm.weight"), 0.0, eps)
        q, k, v = ((h @ p(f"attn_{m}.weight").T).reshape(n, -1, hd) for m in "qkv")
        if local or cfg.arch == "command-r":
            q, k = (_rope(y, positions, cfg.rot, False, cfg.rope_freq_base,
                          cfg.rope_freq_scale, np.ones(cfg.rot // 2), attn_factor, yarn)
                    for y in (q, k))
        att = _attention(q, k, v, 1 / np.sqrt(hd), cfg.sliding_window if local else 0)
        x = x + att @ p("attn_output.weight").T + _glu(
            h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"), _silu)
    logits = _layer_norm(x, w["output_norm.weight"], 0.0, eps) @ w["token_embd.weight"].T
    return logits * cfg.logit_scale


def gemma4_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's gemma4 graph (src/models/gemma4.cpp) in float64: inputs times
    sqrt(n_embd); per-layer inputs (per_layer_token_embd rows times sqrt(width), plus
    per_layer_model_proj of the scaled input times 1/sqrt(n_embd) RMS-normed per layer by
    per_layer_proj_norm, the sum times 1/sqrt(2)); per layer: its head size, K/V heads and
    rotated dims (cfg.swa_layers: key_length_swa, rope.dimension_count_swa, rope base
    rope_freq_base_swa or 10000 with scale 1, the window; the others: rope_freqs.weight as
    factors), Q/K norms, V RMS-normed without a weight, scores times 1, the K/V of layer
    n_layer - shared - 2 (sliding) or - 1 (global) for the last shared_kv_layers layers;
    post-attention norm, GeGLU, post-feed-forward norm; then x + post_norm(proj(gelu(inp_gate
    x) * the layer's input)); times layer_output_scale; output norm, logits softcapped."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    eps, n = cfg.norm_eps, len(tokens)
    positions = np.arange(n, dtype=np.float64)
    x = w["token_embd.weight"][tokens] * np.sqrt(cfg.n_embd)
    n_pl = cfg.n_embd_per_layer
    if n_pl:
        own = w["per_layer_token_embd.weight"][tokens].reshape(n, cfg.n_layer, n_pl) * np.sqrt(n_pl)
        proj = (x @ w["per_layer_model_proj.weight"].T / np.sqrt(cfg.n_embd)).reshape(
            n, cfg.n_layer, n_pl)
        layer_inputs = (_rms_norm(proj, w["per_layer_proj_norm.weight"], eps) + own) / np.sqrt(2)
    first_shared = cfg.n_layer - cfg.shared_kv_layers
    kv, context_rope = {}, _context_rope(cfg)
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        swa = il in cfg.swa_layers
        hd = cfg.head_dim_swa if swa else cfg.head_dim
        n_rot = cfg.n_rot_swa if swa else cfg.rot
        heads_kv = cfg.n_head_kv_layers[il] if cfg.n_head_kv_layers else cfg.kv_heads
        if swa:
            base, scale, factors = cfg.rope_freq_base_swa or 10000.0, 1.0, np.ones(n_rot // 2)
        else:
            base, scale = cfg.rope_freq_base, cfg.rope_freq_scale
            factors = w.get("rope_freqs.weight", np.ones(n_rot // 2))
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        q = _rms_norm((h @ p("attn_q.weight").T).reshape(n, cfg.n_head, hd),
                      p("attn_q_norm.weight"), eps)
        q = _rope(q, positions, n_rot, True, base, scale, factors, *context_rope)
        if il < first_shared:
            k = _rms_norm((h @ p("attn_k.weight").T).reshape(n, heads_kv, hd),
                          p("attn_k_norm.weight"), eps)
            v = (h @ p("attn_v.weight").T).reshape(n, heads_kv, hd)
            v = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
            kv[il] = _rope(k, positions, n_rot, True, base, scale, factors, *context_rope), v
            k, v = kv[il]
        else:
            k, v = kv[first_shared - (2 if swa else 1)]
        att = _attention(q, k, v, 1.0, cfg.sliding_window if swa else 0)
        x = x + _rms_norm(att @ p("attn_output.weight").T, p("post_attention_norm.weight"), eps)
        ffn = _glu(_rms_norm(x, p("ffn_norm.weight"), eps), p("ffn_gate.weight"),
                   p("ffn_up.weight"), p("ffn_down.weight"), _gelu)
        if cfg.n_expert:    # the dense GeGLU and the experts side by side, each normed
            router = _rms_norm(x, 1.0, eps) / np.sqrt(cfg.n_embd) * p("ffn_gate_inp.scale")
            mixed = _experts(cfg, p, _rms_norm(x, p("pre_ffw_norm_2.weight"), eps), True,
                             act=_gelu, router=router, scales=p("ffn_down_exps.scale"))
            ffn = _rms_norm(ffn, p("post_ffw_norm_1.weight"), eps) + _rms_norm(
                mixed, p("post_ffw_norm_2.weight"), eps)
        x = x + _rms_norm(ffn, p("post_ffw_norm.weight"), eps)
        if n_pl:
            gated = _gelu(x @ p("inp_gate.weight").T) * layer_inputs[:, il]
            x = x + _rms_norm(gated @ p("proj.weight").T, p("post_norm.weight"), eps)
        if cfg.layer_output_scale:
            x = x * p("layer_output_scale.weight")
    out = w.get("output.weight", w["token_embd.weight"])
    logits = _rms_norm(x, w["output_norm.weight"], eps) @ out.T
    cap = cfg.final_logit_softcap
    return cap * np.tanh(logits / cap) if cap else logits


def gpt_oss_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's gpt-oss graph (src/models/openai-moe.cpp) in float64: per block, attention
    on attn_norm(x) with Q/K/V biases, neox rope (YaRN as the context gives it), the even
    layers within the sliding window (roped at rope_freq_base_swa where set), each head's
    sink in its softmax, attn_output with its bias; then on post_attention_norm(x) the
    experts: the router's logits plus its bias, the n_expert_used largest taken, weighted by
    the softmax of those logits; each expert down(oai(gate h + b, up h + b)) + b with
    oai(g, u) = min(g, 7) sigmoid(1.702 min(g, 7)) (clip(u, -7, 7) + 1)."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, hd, eps = len(tokens), cfg.head_dim, cfg.norm_eps
    positions = np.arange(n, dtype=np.float64)
    context_rope = _context_rope(cfg)
    x = w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        local = cfg.sliding_window > 0 and il % 2 == 0
        base = _swa_base(cfg, local)
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        q, k, v = ((h @ p(f"attn_{m}.weight").T + p(f"attn_{m}.bias")).reshape(n, -1, hd)
                   for m in "qkv")
        q, k = (_rope(y, positions, cfg.rot, True, base, cfg.rope_freq_scale,
                      np.ones(cfg.rot // 2), *context_rope) for y in (q, k))
        att = _attention(q, k, v, 1 / np.sqrt(hd), cfg.sliding_window if local else 0,
                         sinks=p("attn_sinks.weight"))
        x = x + att @ p("attn_output.weight").T + p("attn_output.bias")
        h = _rms_norm(x, p("post_attention_norm.weight"), eps)
        logits = h @ p("ffn_gate_inp.weight").T + p("ffn_gate_inp.bias")
        ffn = np.zeros_like(h)
        for t in range(n):
            taken = np.argsort(-logits[t], kind="stable")[:cfg.n_expert_used]
            weights = np.exp(logits[t, taken] - logits[t, taken].max())
            for e, weight in zip(taken, weights / weights.sum()):
                def expert(m):
                    return p(f"ffn_{m}_exps.weight")[e] @ h[t] + p(f"ffn_{m}_exps.bias")[e]
                g, u = np.minimum(expert("gate"), 7.0), np.clip(expert("up"), -7.0, 7.0)
                y = g / (1 + np.exp(-1.702 * g)) * (u + 1)
                ffn[t] += weight * (p("ffn_down_exps.weight")[e] @ y + p("ffn_down_exps.bias")[e])
        x = x + ffn
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ out.T


def deepseek2_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's deepseek2 graph in float64, with its latent attention decompressed (as
    transformers computes DeepSeek-V2, with the weights llama.cpp's converter splits): each
    head's query from attn_q, or attn_q_b of the normed attn_q_a; the latent (normed) and the
    shared rope key from attn_kv_a_mqa; a head's key without rope latent @ attn_k_b[h], its
    value attn_v_b[h] @ latent; rope (normal) on the last rope dims of queries and key; scores
    times mscale^2 / sqrt(key_length_mla), mscale from YaRN's factor and log multiplier
    (the context's attn_factor for deepseek2: 1 with a log multiplier, so only that
    multiplier's mscale remains); SwiGLU on the first n_dense_lead blocks, else the experts
    (`_experts`, weights normalized where cfg.expert_weights_norm, times
    expert_weights_scale) plus the shared experts' SwiGLU."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, eps, heads, rope = len(tokens), cfg.norm_eps, cfg.n_head, cfg.rot
    rank, nope = cfg.head_dim - rope, cfg.mla_key_length - rope
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    stretch = np.log(1 / cfg.rope_freq_scale)
    if yarn and cfg.yarn_log_mul:
        attn_factor = cfg.rope_attn_factor / (1 + 0.1 * stretch)
    mscale = attn_factor * (1 + 0.1 * stretch) * (1 + 0.1 * cfg.yarn_log_mul * stretch)
    kq_scale = mscale ** 2 / np.sqrt(cfg.mla_key_length)

    def roped(y):
        return _rope(y, positions, rope, False, cfg.rope_freq_base, cfg.rope_freq_scale,
                     np.ones(rope // 2), attn_factor, yarn)
    x = w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        if cfg.q_lora_rank:
            q = _rms_norm(h @ p("attn_q_a.weight").T, p("attn_q_a_norm.weight"), eps) @ \
                p("attn_q_b.weight").T
        else:
            q = h @ p("attn_q.weight").T
        q = q.reshape(n, heads, cfg.mla_key_length)
        q = np.concatenate([q[..., :nope], roped(q[..., nope:])], axis=-1)
        kv = h @ p("attn_kv_a_mqa.weight").T
        latent = _rms_norm(kv[:, :rank], p("attn_kv_a_norm.weight"), eps)
        k_rope = roped(kv[:, None, rank:])
        k_nope = np.einsum("tr,hrn->thn", latent, p("attn_k_b.weight"))
        k = np.concatenate([k_nope, np.repeat(k_rope, heads, axis=1)], axis=-1)
        v = np.einsum("hvr,tr->thv", p("attn_v_b.weight"), latent)
        x = x + _attention(q, k, v, kq_scale) @ p("attn_output.weight").T
        h = _rms_norm(x, p("ffn_norm.weight"), eps)
        if il < cfg.n_dense_lead:
            x = x + _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"),
                         _silu)
            continue
        routed = _experts(cfg, p, h, cfg.expert_weights_norm,
                          w.get(f"blk.{il}.exp_probs_b.bias", 0.0))
        x = x + (cfg.expert_weights_scale or 1.0) * routed + _glu(
            h, p("ffn_gate_shexp.weight"), p("ffn_up_shexp.weight"), p("ffn_down_shexp.weight"),
            _silu)
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ out.T


def glm4moe_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's glm4moe graph in float64: llama's pre-norm blocks with Q/K/V biases and
    per-head RMS norms of Q and K where given, neox rope over cfg.rot dims, the feed-forward's
    norm post_attention_norm; SwiGLU on the first n_dense_lead blocks, else the experts by
    sigmoids (softmax where expert_gating is 1) ranked with exp_probs_b, normalized where
    expert_weights_norm, times expert_weights_scale, plus the shared experts' SwiGLU.
    seed_oss: the same blocks, every one SwiGLU. bailingmoe2: glm4moe's with QK norms always,
    the feed-forward's norm ffn_norm, a ranking bias where given and a shared expert always
    (Q, K and V from one attn_qkv: `split_qkv` makes them three)."""
    bailing = cfg.arch == "bailingmoe2"
    w = {k: np.asarray(v, np.float64) for k, v in
         (split_qkv(cfg, values) if bailing else values).items()}
    n, eps, hd = len(tokens), cfg.norm_eps, cfg.head_dim
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    x = w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        q, k, v = ((h @ p(f"attn_{m}.weight").T + w.get(f"blk.{il}.attn_{m}.bias", 0.0))
                   .reshape(n, -1, hd) for m in "qkv")
        if cfg.qk_norm or bailing:
            q, k = _rms_norm(q, p("attn_q_norm.weight"), eps), _rms_norm(
                k, p("attn_k_norm.weight"), eps)
        q, k = (_rope(y, positions, cfg.rot, True, cfg.rope_freq_base, cfg.rope_freq_scale,
                      np.ones(cfg.rot // 2), attn_factor, yarn) for y in (q, k))
        x = x + _attention(q, k, v, 1 / np.sqrt(hd)) @ p("attn_output.weight").T
        h = _rms_norm(x, p("ffn_norm.weight" if bailing else "post_attention_norm.weight"), eps)
        if il < cfg.n_dense_lead or not cfg.n_expert:
            x = x + _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"),
                         _silu)
            continue
        routed = _experts(cfg, p, h, cfg.expert_weights_norm,
                          w.get(f"blk.{il}.exp_probs_b.bias", 0.0), sigmoid=cfg.expert_gating != 1)
        x = x + (cfg.expert_weights_scale or 1.0) * routed
        if f"blk.{il}.ffn_gate_shexp.weight" in w:
            x = x + _glu(h, p("ffn_gate_shexp.weight"), p("ffn_up_shexp.weight"),
                         p("ffn_down_shexp.weight"), _silu)
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ out.T


def afmoe_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's afmoe graph in float64: the inputs times sqrt(n_embd); per block
    x + post_attention_norm(attn_output(attention * sigmoid(attn_gate h))), h = attn_norm(x),
    Q and K RMS-normed per head, neox rope but on every fourth layer, three layers of four
    within sliding_window where set (at rope_freq_base_swa where set); then
    x + post_ffw_norm(ffn(ffn_norm x)): SwiGLU on the first n_dense_lead blocks, else the
    experts by sigmoids (softmax where expert_gating is 1) ranked with exp_probs_b,
    normalized where expert_weights_norm, times expert_weights_scale, plus the shared
    experts' SwiGLU."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, eps, hd = len(tokens), cfg.norm_eps, cfg.head_dim
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    x = np.sqrt(cfg.n_embd) * w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        local = cfg.sliding_window > 0 and il % 4 < 3
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        q, k, v = ((h @ p(f"attn_{m}.weight").T).reshape(n, -1, hd) for m in "qkv")
        q, k = _rms_norm(q, p("attn_q_norm.weight"), eps), _rms_norm(
            k, p("attn_k_norm.weight"), eps)
        if (il + 1) % 4:
            q, k = (_rope(y, positions, cfg.rot, True, _swa_base(cfg, local), cfg.rope_freq_scale,
                          np.ones(cfg.rot // 2), attn_factor, yarn) for y in (q, k))
        att = _attention(q, k, v, 1 / np.sqrt(hd), cfg.sliding_window if local else 0)
        att = att * (1 / (1 + np.exp(-(h @ p("attn_gate.weight").T))))
        x = x + _rms_norm(att @ p("attn_output.weight").T, p("post_attention_norm.weight"), eps)
        h = _rms_norm(x, p("ffn_norm.weight"), eps)
        if il < cfg.n_dense_lead:
            y = _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"), _silu)
        else:
            y = (cfg.expert_weights_scale or 1.0) * _experts(
                cfg, p, h, cfg.expert_weights_norm, p("exp_probs_b.bias"),
                sigmoid=cfg.expert_gating != 1)
            if cfg.n_ff_shexp:
                y = y + _glu(h, p("ffn_gate_shexp.weight"), p("ffn_up_shexp.weight"),
                             p("ffn_down_shexp.weight"), _silu)
        x = x + _rms_norm(y, p("post_ffw_norm.weight"), eps)
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ out.T


def smallthinker_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's smallthinker graph in float64: llama's pre-norm attention with neox rope,
    with a sliding_window the layers i % 4 != 0 windowed (at rope_freq_base_swa where set)
    and the others unroped; then the experts on ffn_norm of the residual, relu(gate) * up,
    routed by the block's input (softmax, or sigmoids where expert_gating is 2), weights
    normalized."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, eps, hd = len(tokens), cfg.norm_eps, cfg.head_dim
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    x = w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        local = cfg.sliding_window > 0 and il % 4 != 0
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        q, k, v = ((h @ p(f"attn_{m}.weight").T).reshape(n, -1, hd) for m in "qkv")
        if local or not cfg.sliding_window:
            q, k = (_rope(y, positions, cfg.rot, True, _swa_base(cfg, local), cfg.rope_freq_scale,
                          np.ones(cfg.rot // 2), attn_factor, yarn) for y in (q, k))
        att = _attention(q, k, v, 1 / np.sqrt(hd), cfg.sliding_window if local else 0)
        y = x + att @ p("attn_output.weight").T
        x = y + _experts(cfg, p, _rms_norm(y, p("ffn_norm.weight"), eps), True, router=x,
                         act=lambda g: np.maximum(g, 0))
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ out.T


def phimoe_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's phi3 graph of a phimoe in float64: RMS norms plus a bias; Q, K, V with
    biases where given, neox rope over cfg.rot dims with LongRoPE's factors by the context;
    attn_output with its bias; the experts by softmax, weights normalized; the final norm
    with its bias, the output matrix with its bias."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, eps, hd = len(tokens), cfg.norm_eps, cfg.head_dim
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    factors = _longrope_factors(cfg, w)
    factors = np.ones(cfg.rot // 2) if factors is None else factors

    def norm(x, name):
        return _rms_norm(x, w[name + ".weight"], eps) + w[name + ".bias"]
    x = w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        h = norm(x, f"blk.{il}.attn_norm")
        q, k, v = ((h @ p(f"attn_{m}.weight").T + w.get(f"blk.{il}.attn_{m}.bias", 0.0))
                   .reshape(n, -1, hd) for m in "qkv")
        q, k = (_rope(y, positions, cfg.rot, True, cfg.rope_freq_base, cfg.rope_freq_scale,
                      factors, attn_factor, yarn) for y in (q, k))
        x = x + _attention(q, k, v, 1 / np.sqrt(hd)) @ p("attn_output.weight").T + \
            p("attn_output.bias")
        x = x + _experts(cfg, p, norm(x, f"blk.{il}.ffn_norm"), True)
    return norm(x, "output_norm") @ w["output.weight"].T + w["output.bias"]


def minicpm3_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's minicpm3 graph in float64: the token embeddings times 12; per block x +
    b * attention(rms(x)) and x + b * SwiGLU(rms(x)), b = 1.4 / sqrt(n_layer); each head's
    query attn_q_b of the normed attn_q_a; from attn_kv_a_mqa the latent (normed) and one
    rope key; attn_kv_b of the latent each head's key without rope | value; neox rope on the
    last rope dims of queries and key (LongRoPE's factors by the context); scores times
    1/sqrt(key_length); the logits of the final norm times 256 / n_embd."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    n, eps, heads, rope, k = len(tokens), cfg.norm_eps, cfg.n_head, cfg.rot, cfg.head_dim
    rank, nope, v_dim = cfg.kv_lora_rank, k - rope, cfg.mla_value_length
    positions = np.arange(n, dtype=np.float64)
    attn_factor, yarn = _context_rope(cfg)
    factors = _longrope_factors(cfg, w)
    factors = np.ones(rope // 2) if factors is None else factors

    def roped(y):
        return _rope(y, positions, rope, True, cfg.rope_freq_base, cfg.rope_freq_scale,
                     factors, attn_factor, yarn)
    branch = 1.4 / np.sqrt(cfg.n_layer)
    x = 12.0 * w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        q = _rms_norm(h @ p("attn_q_a.weight").T, p("attn_q_a_norm.weight"), eps) @ \
            p("attn_q_b.weight").T
        q = q.reshape(n, heads, k)
        q = np.concatenate([q[..., :nope], roped(q[..., nope:])], axis=-1)
        kv = h @ p("attn_kv_a_mqa.weight").T
        latent = _rms_norm(kv[:, :rank], p("attn_kv_a_norm.weight"), eps)
        kv_b = (latent @ p("attn_kv_b.weight").T).reshape(n, heads, nope + v_dim)
        key = np.concatenate([kv_b[..., :nope], np.repeat(roped(kv[:, None, rank:]), heads,
                                                          axis=1)], axis=-1)
        att = _attention(q, key, kv_b[..., nope:], 1 / np.sqrt(k))
        x = x + branch * (att @ p("attn_output.weight").T)
        h = _rms_norm(x, p("ffn_norm.weight"), eps)
        x = x + branch * _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"),
                              _silu)
    out = w.get("output.weight", w["token_embd.weight"])
    return 256.0 / cfg.n_embd * _rms_norm(x, w["output_norm.weight"], eps) @ out.T


def delta_rule_steps(q, k, v, g, beta, state=None, delta=True, scale=None):
    """The gated delta rule token by token in float64 (llama.cpp's autoregressive form),
    independent of models.delta_net: q, k (B, T, H, S_k), v (B, T, H, S_v), g and beta
    (B, T, H), state (B, H, S_v, S_k) or zeros. Returns o (B, T, H, S_v) and the last state.
    `delta` False: S = exp(g) S + beta v k^T, Mamba2's scan (ggml_ssm_scan with dt = beta);
    q is scaled by `scale` (default 1/sqrt(S_k))."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    batch, t, heads, s_k = q.shape
    scale = 1 / np.sqrt(s_k) if scale is None else scale
    s = (np.zeros((batch, heads, v.shape[-1], s_k)) if state is None
         else np.array(state, np.float64))
    out = np.zeros(v.shape)
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None, None]
        write = v[:, i] - np.einsum("bhjk,bhk->bhj", s, k[:, i]) if delta else v[:, i]
        s = s + (write * beta[:, i][..., None])[..., :, None] * k[:, i][..., None, :]
        out[:, i] = np.einsum("bhjk,bhk->bhj", s, q[:, i]) * scale
    return out, s


def mamba2_steps(x, bs, cs, dt, a, d, groups):
    """ggml_ssm_scan of Mamba2 token by token in float64: x (T, H, P), B and C (T, G, N), dt
    (T, H) after its softplus, A and D (H,); head h reads group h // (H / G). Returns
    y (T, H, P): S = exp(dt A) S + dt x B^T, y = S C + D x, from S = 0."""
    t, heads, width = x.shape
    group = np.arange(heads) // (heads // groups)
    s = np.zeros((heads, width, bs.shape[-1]))
    y = np.zeros(x.shape)
    for i in range(t):
        s = s * np.exp(dt[i] * a)[:, None, None] + \
            (dt[i][:, None] * x[i])[:, :, None] * bs[i][group][:, None, :]
        y[i] = np.einsum("hpn,hn->hp", s, cs[i][group]) + d[:, None] * x[i]
    return y


def granitehybrid_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's granitehybrid graph (src/models/granite-hybrid.cpp, mamba-base.cpp's
    build_mamba2_layer) in float64: granite's block and scales; on cfg.recurrent_layers a
    Mamba2 mixer (ssm_in into z | xBC | dt, d_inner = 2 n_embd; xBC's causal convolution plus
    its bias, silu, into x | B | C; `mamba2_steps` with dt = softplus(dt + ssm_dt.bias);
    y * silu(z) RMS-normed in groups by ssm_norm; ssm_out), elsewhere attention, roped
    (normal) unless cfg.no_rope. nemotron_h (src/models/nemotron-h.cpp): each block x +
    one mixer of attn_norm(x): that Mamba2 (d_inner ssm_inner), ffn_down(relu(ffn_up h)^2)
    on cfg.mlp_layers (nemotron_h_moe: experts of relu(up)^2 by sigmoids ranked with
    exp_probs_b, and a shared one), else attention without rope. falcon-h1
    (src/models/falcon-h1.cpp): attention (neox rope) and the Mamba2 side by side in every
    block, then the SwiGLU feed-forward normed by ffn_norm."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    eps, n, hd = cfg.norm_eps, len(tokens), cfg.head_dim
    positions = np.arange(n, dtype=np.float64)
    nemotron = cfg.arch in ("nemotron_h", "nemotron_h_moe")
    d = cfg.ssm_inner or 2 * cfg.n_embd
    heads, groups, state = cfg.ssm_heads, cfg.ssm_groups, cfg.ssm_state
    x = w["token_embd.weight"][tokens] * cfg.embedding_scale
    falcon = cfg.arch == "falcon-h1"

    def mamba(p, h):
        z, xbc, dt = np.split(h @ p("ssm_in.weight").T, [d, 2 * d + 2 * groups * state], axis=1)
        xbc = _silu(_causal_conv(xbc, p("ssm_conv1d.weight")) + p("ssm_conv1d.bias"))
        xs, bs, cs = np.split(xbc, [d, d + groups * state], axis=1)
        dt = np.logaddexp(0, dt + p("ssm_dt.bias"))
        y = mamba2_steps(xs.reshape(n, heads, -1), bs.reshape(n, groups, state),
                         cs.reshape(n, groups, state), dt, p("ssm_a")[:, 0], p("ssm_d")[:, 0],
                         groups).reshape(n, d) * _silu(z)
        if cfg.mamba_norm:
            y = _rms_norm(y.reshape(n, groups, -1), p("ssm_norm.weight"), eps).reshape(n, d)
        return y @ p("ssm_out.weight").T

    def attention(p, h):
        q, k, v = ((h @ p(f"attn_{m}.weight").T).reshape(n, -1, hd) for m in "qkv")
        if not (cfg.no_rope or nemotron):
            q, k = (_rope(t, positions, cfg.rot, falcon, cfg.rope_freq_base,
                          cfg.rope_freq_scale, np.ones(cfg.rot // 2)) for t in (q, k))
        kq_scale = cfg.attention_scale or 1 / np.sqrt(hd)
        return _attention(q, k, v, kq_scale) @ p("attn_output.weight").T

    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        if falcon:      # attention and Mamba2 side by side
            out = attention(p, h) + mamba(p, h)
        elif il in cfg.recurrent_layers:
            out = mamba(p, h)
        elif il in cfg.mlp_layers and cfg.n_expert:     # nemotron_h_moe's: experts of
            # relu(up)^2 by sigmoids, times expert_weights_scale, and the shared expert
            out = (cfg.expert_weights_scale or 1.0) * _experts(
                cfg, p, h, cfg.expert_weights_norm, p("exp_probs_b.bias"), _relu_sqr,
                sigmoid=True, gated=False) + \
                _relu_sqr(h @ p("ffn_up_shexp.weight").T) @ p("ffn_down_shexp.weight").T
        elif il in cfg.mlp_layers:      # nemotron_h's feed-forward blocks
            out = _relu_sqr(h @ p("ffn_up.weight").T) @ p("ffn_down.weight").T
        else:
            out = attention(p, h)
        x = x + cfg.residual_scale * out
        if nemotron:        # a block is its mixer alone
            continue
        h = _rms_norm(x, p("ffn_norm" if falcon else "ffn_norm.weight"), eps)
        if cfg.n_expert:    # granite's mixture of experts, its shared expert added as it is
            ffn = _experts(cfg, p, h, True)
            if cfg.n_ff_shexp:
                ffn = ffn + _glu(h, p("ffn_gate_shexp.weight"), p("ffn_up_shexp.weight"),
                                 p("ffn_down_shexp.weight"), _silu)
        else:
            ffn = _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"), _silu)
        x = x + cfg.residual_scale * ffn
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ out.T / cfg.logit_scale


def qwen35_reference_logits(cfg, values, tokens) -> np.ndarray:
    """llama.cpp's qwen35 graph (src/models/qwen35.cpp, delta-net-base.cpp) in float64, the
    delta rule token by token (`delta_rule_steps`). Each block: x + mixer(attn_norm(x)), then
    x + SwiGLU(post_attention_norm(x)). Recurrent layers: attn_qkv, the causal convolution
    (ssm_conv1d) and silu, q | k | v split into heads of ssm_state, q and k divided by
    sqrt(sum of squares + eps), value head h reading query/key head h % groups; decay
    softplus(ssm_alpha h + ssm_dt) * ssm_a, strength sigmoid(ssm_beta h); output RMS-normed
    per head by ssm_norm times silu(attn_gate h), then ssm_out. Attention layers: attn_q's
    rows per head query | gate, Q/K norms, neox rope over n_rot dims (IMROPE with text
    positions), scores times 1/sqrt(head_dim), the output times sigmoid(gate), attn_output."""
    w = {k: np.asarray(v, np.float64) for k, v in values.items()}
    eps, n, hd, s = cfg.norm_eps, len(tokens), cfg.head_dim, cfg.ssm_state
    positions = np.arange(n, dtype=np.float64)
    sigmoid = lambda t: 1 / (1 + np.exp(-t))                       # noqa: E731
    x = w["token_embd.weight"][tokens]
    for il in range(cfg.n_layer):
        p = lambda name: w[f"blk.{il}.{name}"]                 # noqa: E731
        h = _rms_norm(x, p("attn_norm.weight"), eps)
        if il in cfg.recurrent_layers:
            mixed = _silu(_causal_conv(h @ p("attn_qkv.weight").T, p("ssm_conv1d.weight")))
            keys = cfg.ssm_groups * s
            q, k, v = np.split(mixed, [keys, 2 * keys], axis=1)
            q, k, v = (t.reshape(n, -1, s) for t in (q, k, v))
            q, k = (t / np.sqrt((t * t).sum(-1, keepdims=True) + eps) for t in (q, k))
            heads = np.arange(cfg.ssm_heads) % cfg.ssm_groups
            q, k = q[:, heads], k[:, heads]
            g = np.logaddexp(0, h @ p("ssm_alpha.weight").T + p("ssm_dt.bias")) * p("ssm_a")
            beta = sigmoid(h @ p("ssm_beta.weight").T)
            o, _ = delta_rule_steps(q[None], k[None], v[None], g[None], beta[None])
            z = (h @ p("attn_gate.weight").T).reshape(n, -1, s)
            o = _rms_norm(o[0], p("ssm_norm.weight"), eps) * _silu(z)
            x = x + o.reshape(n, -1) @ p("ssm_out.weight").T
        else:
            full = (h @ p("attn_q.weight").T).reshape(n, cfg.n_head, 2 * hd)
            q, gate = full[..., :hd], full[..., hd:]
            k, v = ((h @ p(f"attn_{m}.weight").T).reshape(n, -1, hd) for m in "kv")
            q = _rope(_rms_norm(q, p("attn_q_norm.weight"), eps), positions, cfg.rot, True,
                      cfg.rope_freq_base, cfg.rope_freq_scale, np.ones(cfg.rot // 2),
                      *_context_rope(cfg))
            k = _rope(_rms_norm(k, p("attn_k_norm.weight"), eps), positions, cfg.rot, True,
                      cfg.rope_freq_base, cfg.rope_freq_scale, np.ones(cfg.rot // 2),
                      *_context_rope(cfg))
            att = _attention(q, k, v, 1 / np.sqrt(hd)) * sigmoid(gate.reshape(n, -1))
            x = x + att @ p("attn_output.weight").T
        h = _rms_norm(x, p("post_attention_norm.weight"), eps)
        x = x + (_shared_experts(cfg, p, h) if cfg.n_expert else
                 _glu(h, p("ffn_gate.weight"), p("ffn_up.weight"), p("ffn_down.weight"), _silu))
    out = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ out.T


def example_pairs(n: int, n_vocab: int, prompt_tokens: tuple, answer_tokens: tuple,
                  seed: int) -> list:
    """n preference pairs of chat.Example sharing a random prompt of [lo, hi) tokens
    (`prompt_tokens`), each answer random of `answer_tokens` [lo, hi) tokens, only the
    answer trained."""
    from .chat import Example
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        prompt = rng.integers(0, n_vocab, rng.integers(*prompt_tokens))
        pair = []
        for _ in range(2):
            answer = rng.integers(0, n_vocab, rng.integers(*answer_tokens))
            ids = np.concatenate([prompt, answer]).astype(np.int32)
            pair.append(Example(ids, np.arange(len(ids)) >= len(prompt)))
        pairs.append(tuple(pair))
    return pairs
