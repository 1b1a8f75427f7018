"""The op test harness (after ggml's test-backend-ops), shared by the pytest suite and
`ggwgpu ops test|grad`.

Every registered op carries its test cases. For each case:
- forward: the device result against the NumPy reference in float64, NaN/infinity first,
  then normalized mean squared error; sentinel elements around every storage block of the
  plan must come back untouched (WebGPU clamps stray accesses, only sentinels see them);
- gradient: the backward graph in float64 against central finite differences of the
  forward, and the device backward against the NumPy backward.
"""
from __future__ import annotations

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
        parts.append(s if i.layout == "contiguous" else f"{s}({i.layout})")
    params = ",".join(f"{k}={v}" for k, v in case.params.items())
    return " ".join(parts) + (f" {params}" if params else "")


def build_case(opdef: OpDef, case: Case, rng: np.random.Generator):
    """Leaves with random float64 values, the views the case asks for, and the op's node."""
    leaves, values, srcs = [], {}, []
    for k, spec in enumerate(case.inputs):
        shape = tuple(spec.shape)
        if spec.dtype in QUANT_TYPES:  # a frozen weight: a constant, quantized random values
            value = (quantize(rng.uniform(spec.lo, spec.hi, shape), spec.dtype)
                     if spec.dtype in QUANTIZABLE else random_blocks(spec.dtype, shape, rng))
            leaf = constant(value, name=f"in{k}")
            leaves.append(leaf)
            srcs.append(leaf)
            continue
        if spec.layout == "permuted" and len(shape) > 1:
            axes = tuple(reversed(range(len(shape))))
            leaf = input_tensor(tuple(shape[a] for a in axes), spec.dtype, name=f"in{k}")
            src = O.permute(leaf, axes)
        elif spec.layout == "strided":
            # rows padded by 3 elements and one element of offset: a view inside a bigger leaf
            leaf = input_tensor(shape[:-1] + (shape[-1] + 3,), spec.dtype, name=f"in{k}")
            src = O.view(leaf, shape, leaf.strides, 1)
        else:
            leaf = src = input_tensor(shape, spec.dtype, name=f"in{k}")
        leaves.append(leaf)
        if spec.dtype == "i32":
            values[leaf] = rng.integers(spec.lo, spec.hi, leaf.shape, dtype=np.int32)
        elif spec.dist == "probs":
            v = rng.uniform(0.01, 1.0, leaf.shape)
            values[leaf] = v / v.sum(axis=-1, keepdims=True)
        else:
            values[leaf] = rng.uniform(spec.lo, spec.hi, leaf.shape)
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


def forward(opdef: OpDef, case: Case, backend, seed=0) -> Result:
    leaves, values, node = build_case(opdef, case, np.random.default_rng(seed))
    ref_plan = NumpyBackend(np.float64).plan([node])
    ref_plan.run(values)
    ref = ref_plan.read(node)
    plan = backend.plan([node], sentinel=SENTINEL)
    plan.run(as_f32(values))
    ok, detail = compare(plan.read(node), ref, case.nmse or opdef.nmse)
    stray = plan.stray_writes()
    if stray:
        ok, detail = False, f"wrote outside {stray} (sentinel overwritten); {detail}"
    return Result(opdef.name, describe(case), ok, detail)


def grad_graph(opdef: OpDef, case: Case, seed=0):
    """loss = sum(op(inputs) * R) with a fixed random R, and its gradients w.r.t. every
    input the op differentiates."""
    rng = np.random.default_rng(seed)
    leaves, values, node = build_case(opdef, case, rng)
    if opdef.grad_head:
        node = opdef.grad_head(node)
    weights = constant(rng.uniform(-1, 1, node.shape).astype(np.float32), name="R")
    loss = O.sum(O.mul(node, weights))
    params = [leaf for k, leaf in enumerate(leaves)
              if k not in opdef.no_grad and leaf.dtype == "f32"]
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


def backward_on(opdef: OpDef, case: Case, backend, seed=0) -> Result:
    """The device backward against the NumPy float64 backward of the same graph: once with
    sentinels around every buffer, once with buffers shared by liveness as in training."""
    loss, grads, values = grad_graph(opdef, case, seed)
    outputs = [loss, *grads.values()]
    ref = NumpyBackend(np.float64).plan(outputs)
    ref.run(values)
    details = []
    for label, plan in (("", backend.plan(outputs, sentinel=SENTINEL)),
                        ("shared buffers: ", backend.plan(outputs))):
        plan.run(as_f32(values))
        for leaf, g in grads.items():
            ok, detail = compare(plan.read(g), ref.read(g), max(GRAD_NMSE, opdef.nmse))
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

