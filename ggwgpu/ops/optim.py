"""Optimizer updates: in-place ops that run after the backward. Shader: shaders/optim.wgsl.

opt_step_adamw(param, grad, m, v, hparams, decay) updates m and v in place and writes the new
parameter into param's storage; the result is a view of param. hparams is a 7-element f32
tensor, written before each step, as ggml's opt_step_adamw takes it:
    [alpha (lr x schedule), beta1, beta2, eps, weight decay, 1/(1-beta1^t), 1/(1-beta2^t)]
`decay` says whether this tensor takes weight decay (the reference: only tensors >= 2-D).

Both steps leave an element (and its moments) unchanged where its gradient is not finite: the
trainer makes every gradient of a step with a non-finite loss or gradient NaN, and so skips
that whole update inside the planned graph.
"""
from __future__ import annotations

import numpy as np

from ..tensor import ShapeError
from .registry import Case, Dispatch, Input, need_f32, register

ADAMW_HPARAMS = ("alpha", "beta1", "beta2", "eps", "wd", "beta1h", "beta2h")


def adamw_shape(srcs, decay):
    param, grad, m, v, hp = srcs
    need_f32(*srcs)
    for what, t in (("grad", grad), ("m", m), ("v", v)):
        if t.shape != param.shape:
            raise ShapeError(f"{what} {t.shape} differs from the parameter's {param.shape}")
    for what, t in (("param", param), ("m", m), ("v", v)):
        if not t.is_contiguous():
            raise ShapeError(f"{what} must be contiguous: it is updated in place")
    if hp.shape != (len(ADAMW_HPARAMS),):
        raise ShapeError(f"hparams must have shape ({len(ADAMW_HPARAMS)},), got {hp.shape}")
    return param.shape, "f32", {"strides": param.strides, "offset": param.offset,
                                "view_src": param}


def adamw_ref(param, grad, m, v, hp, decay):
    """The update; m and v are NumPy views of the optimizer state and change in place."""
    alpha, beta1, beta2, eps, wd, beta1h, beta2h = hp
    keep = 1 - alpha * (wd if decay else 0)
    ok = np.isfinite(grad)
    grad = np.where(ok, grad, 0)           # no NaN arithmetic (or warnings) where skipped
    m[...] = np.where(ok, m * beta1 + grad * (1 - beta1), m)
    v[...] = np.where(ok, v * beta2 + grad * grad * (1 - beta2), v)
    return np.where(ok, param * keep - alpha * (m * beta1h) / (np.sqrt(v * beta2h) + eps), param)


def adamw_into(out, param, grad, m, v, hp, decay):
    """adamw_ref in place (out is param's storage), the same operations without np.where,
    where every gradient element is finite (a sum is non-finite if any element is);
    otherwise the reference."""
    if not np.isfinite(np.sum(grad)):
        np.copyto(out, adamw_ref(param, grad, m, v, hp, decay))
        return
    alpha, beta1, beta2, eps, wd, beta1h, beta2h = hp
    keep = 1 - alpha * (wd if decay else 0)
    m *= beta1
    m += grad * (1 - beta1)
    v *= beta2
    v += grad * grad * (1 - beta2)
    step = m * beta1h
    step *= alpha
    denom = v * beta2h
    np.sqrt(denom, out=denom)
    denom += eps
    step /= denom
    np.multiply(param, keep, out=out)
    out -= step


def adamw_cases():
    def state(shape, layout="contiguous"):
        return (Input(shape), Input(shape, layout=layout), Input(shape), Input(shape, 0.0, 1.0),
                Input((7,), 0.05, 0.95))
    return [Case(state((1,)), {"decay": False}, grad=False),
            Case(state((5, 7)), {"decay": True}, grad=False),
            Case(state((3, 4, 5), "permuted"), {"decay": True}, grad=False),
            Case(state((70001,)), {"decay": False}, grad=False)]


opt_step_adamw = register(
    "opt_step_adamw", n_srcs=5, params=("decay",), shape=adamw_shape, shader="optim",
    reference=adamw_ref, fast=adamw_into, backward=None, updates=True, cases=adamw_cases,
    # dst is the parameter itself (the node is a view of it), so bind only the other four
    dispatches=lambda n: [Dispatch("opt_step_adamw", n, n.srcs[1:], n=n.nelements,
                                   u=(int(bool(n.params["decay"])),))],
    doc="AdamW step in place: (param, grad, m, v, hparams[7], decay) -> param updated "
        "(a view of param); m and v are updated too.")

SGD_HPARAMS = ("lr", "wd")


def sgd_shape(srcs, decay):
    param, grad, hp = srcs
    need_f32(*srcs)
    if grad.shape != param.shape:
        raise ShapeError(f"grad {grad.shape} differs from the parameter's {param.shape}")
    if not param.is_contiguous():
        raise ShapeError("param must be contiguous: it is updated in place")
    if hp.shape != (len(SGD_HPARAMS),):
        raise ShapeError(f"hparams must have shape ({len(SGD_HPARAMS)},), got {hp.shape}")
    return param.shape, "f32", {"strides": param.strides, "offset": param.offset,
                                "view_src": param}


def sgd_ref(param, grad, hp, decay):
    lr, wd = hp
    ok = np.isfinite(grad)
    return np.where(ok, param * (1 - lr * (wd if decay else 0)) - lr * np.where(ok, grad, 0),
                    param)


opt_step_sgd = register(
    "opt_step_sgd", n_srcs=3, params=("decay",), shape=sgd_shape, shader="optim",
    reference=sgd_ref, backward=None, updates=True,
    dispatches=lambda n: [Dispatch("opt_step_sgd", n, n.srcs[1:], n=n.nelements,
                                   u=(int(bool(n.params["decay"])),))],
    cases=lambda: [Case((Input(c.inputs[0].shape), c.inputs[1], Input((2,), 0.05, 0.95)),
                        c.params, grad=False) for c in adamw_cases()],
    doc="SGD step in place: (param, grad, hparams [lr, weight decay], decay) -> param "
        "updated (a view of param); decoupled weight decay as AdamW's.")

__all__ = ["opt_step_adamw", "opt_step_sgd", "ADAMW_HPARAMS", "SGD_HPARAMS"]
