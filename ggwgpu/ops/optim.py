"""Optimizer updates: in-place ops that run after the backward. Shader: shaders/optim.wgsl.

opt_step_adamw(param, grad, m, v, hparams, decay) updates m and v in place and writes the new
parameter into param's storage; the result is a view of param. hparams is a 9-element f32
tensor, ggml's opt_step_adamw hyper-parameters followed by a finite flag and a gradient
factor:
    [alpha (lr x schedule), beta1, beta2, eps, weight decay, 1/(1-beta1^t), 1/(1-beta2^t),
     finite, grad_factor]
`decay` says whether this tensor takes weight decay (the reference: only tensors >= 2-D).
The step reads the gradient times grad_factor (an f32 product, as a mul op before it would
give): the trainer's clipping factor and 1/loss scale, computed on the device, reach every
update through the hyper-parameters instead of a mul per gradient.

A step changes nothing where its flag is 0: the trainer writes the first hyper-parameters,
and append_finite_flag sets the flag on the device from the loss and the gradients' sum of
squares, testing exponent bits (WGSL lets compilers assume floats are finite, so no NaN
arithmetic may decide a skip), and appends the factor. Each step also leaves an element (and
its moments) unchanged where its own (scaled) gradient is not finite.
"""
from __future__ import annotations

import numpy as np

from .. import ops as O
from ..tensor import ShapeError, contiguous_strides
from .registry import Case, Dispatch, Input, need_float, register

ADAMW_HPARAMS = ("alpha", "beta1", "beta2", "eps", "wd", "beta1h", "beta2h", "finite",
                 "grad_factor")
# the slots append_finite_flag appends on the device, after those the host writes
DEVICE_HPARAMS = ("finite", "grad_factor")


def adamw_hparams(lr, beta1, beta2, eps, weight_decay, t) -> np.ndarray:
    """The hyper-parameters of AdamW step t (1-based) as the host writes them: all but the
    finite flag and the gradient factor (DEVICE_HPARAMS). The bias corrections come from the
    float32 betas the kernel sees (its 1 - beta2 is 1 - float32(0.999) = 9.99987e-4); from the
    exact betas every step would be about 6e-6 (relative) larger than the AdamW the kernel
    computes."""
    b1, b2 = (float(np.float32(b)) for b in (beta1, beta2))
    return np.array([lr, b1, b2, eps, weight_decay, 1 / (1 - b1 ** t), 1 / (1 - b2 ** t)],
                    np.float32)


def append_finite_flag_shape(srcs):
    hp, a, b, factor = srcs
    need_float(*srcs)
    if hp.ndim != 1:
        raise ShapeError(f"hparams must be 1-D, got {hp.shape}")
    if factor.nelements != 1:
        raise ShapeError(f"the gradient factor must have one element, has shape {factor.shape}")
    return (hp.shape[0] + 2,), "f32", {}


def append_finite_flag_ref(hp, a, b, factor):
    flag = np.isfinite(a).all() and np.isfinite(b).all()
    return np.concatenate([hp, [1.0 if flag else 0.0], factor.reshape(1)]).astype(hp.dtype)


def append_finite_flag_backward(n, g):
    hp, factor = n.srcs[0], n.srcs[3]
    return (O.view(g, hp.shape, g.strides, 0), None, None,
            O.view(g, factor.shape, contiguous_strides(factor.shape), hp.shape[0] + 1))


def append_finite_flag_cases():
    hp, factor = Input((7,), 0.05, 0.95), Input((1,), 0.05, 0.95)
    return [Case((hp, Input((1,)), Input((1,)), factor), grad=True),
            Case((Input((2,)), Input((1,), dist="nonfinite"), Input((1,)), Input((1, 1))),
                 grad=False),
            Case((hp, Input((1,)), Input((1,), dist="nonfinite"), factor), grad=False),
            Case((hp, Input((5, 7), layout="permuted"), Input((70001,)), factor), grad=False),
            Case((hp, Input((3, 4, 5), layout="strided"), Input((70001,), dist="nonfinite"),
                  Input((1,), 2.0 ** 10, 2.0 ** 11)), grad=False)]


append_finite_flag = register(
    "append_finite_flag", n_srcs=4, shape=append_finite_flag_shape, shader="optim", result="f32",
    f16_nmse=0.0,  # exact: a flag from exponent bits and copies
    reference=append_finite_flag_ref, no_grad=(1, 2), cases=append_finite_flag_cases,
    backward=append_finite_flag_backward,
    doc="(hparams, a, b, factor) -> hparams, then 1 when every element of a and b is finite, "
        "else 0 (from the exponent bits), then factor (one element): the optimizer steps' "
        "finite flag and gradient factor (DEVICE_HPARAMS).")


def adamw_shape(srcs, decay):
    param, grad, m, v, hp = srcs
    need_float(*srcs)
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
    alpha, beta1, beta2, eps, wd, beta1h, beta2h, finite, factor = hp
    if finite == 0:                        # the whole step is skipped
        return param.copy()
    keep = 1 - alpha * (wd if decay else 0)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and overflow: skipped below
        grad = grad * factor
    ok = np.isfinite(grad)
    grad = np.where(ok, grad, 0)           # no NaN arithmetic (or warnings) where skipped
    m[...] = np.where(ok, m * beta1 + grad * (1 - beta1), m)
    v[...] = np.where(ok, v * beta2 + grad * grad * (1 - beta2), v)
    return np.where(ok, param * keep - alpha * (m * beta1h) / (np.sqrt(v * beta2h) + eps), param)


def adamw_into(out, param, grad, m, v, hp, decay):
    """adamw_ref in place (out is param's storage), the same operations without np.where,
    where every scaled gradient element is finite (a sum is non-finite if any element is);
    otherwise the reference."""
    alpha, beta1, beta2, eps, wd, beta1h, beta2h, finite, factor = hp
    if finite == 0:                        # the whole step is skipped: param stays as it is
        return
    with np.errstate(invalid="ignore", over="ignore"):
        g = np.multiply(grad, factor)      # three scratch arrays for all the temporaries
    if not np.isfinite(np.sum(g)):
        np.copyto(out, adamw_ref(param, grad, m, v, hp, decay))
        return
    keep = 1 - alpha * (wd if decay else 0)
    step = np.multiply(g, 1 - beta1)
    m *= beta1
    m += step
    np.multiply(g, g, out=step)
    step *= 1 - beta2
    v *= beta2
    v += step
    np.multiply(m, beta1h, out=step)
    step *= alpha
    denom = np.multiply(v, beta2h)
    np.sqrt(denom, out=denom)
    denom += eps
    step /= denom
    np.multiply(param, keep, out=out)
    out -= step


def adamw_cases():
    def state(shape, layout="contiguous"):
        return (Input(shape), Input(shape, layout=layout), Input(shape), Input(shape, 0.0, 1.0),
                Input((9,), 0.05, 0.95))
    return [Case(state((1,)), {"decay": False}, grad=False),
            Case(state((5, 7)), {"decay": True}, grad=False),
            Case(state((3, 4, 5), "permuted"), {"decay": True}, grad=False),
            Case(state((70001,)), {"decay": False}, grad=False),
            Case(state((4, 3))[:4] + (Input((9,), 0.0, 0.0),), {"decay": True},
                 grad=False)]                                    # flag 0: nothing changes


opt_step_adamw = register(
    "opt_step_adamw", n_srcs=5, params=("decay",), shape=adamw_shape, shader="optim",
    f16=False,  # trainable weights and moments are f32 masters
    reference=adamw_ref, fast=adamw_into, backward=None, updates=True, cases=adamw_cases,
    # dst is the parameter itself (the node is a view of it), so bind only the other four
    dispatches=lambda n: [Dispatch("opt_step_adamw", n, n.srcs[1:], n=n.nelements,
                                   u=(int(bool(n.params["decay"])),))],
    doc="AdamW step in place: (param, grad, m, v, hparams[9], decay) -> param updated "
        "(a view of param) from grad times hparams[8] (the gradient factor); m and v are "
        "updated too; nothing changes where hparams[7] (the finite flag) is 0.")

SGD_HPARAMS = ("lr", "wd", "finite", "grad_factor")


def sgd_shape(srcs, decay):
    param, grad, hp = srcs
    need_float(*srcs)
    if grad.shape != param.shape:
        raise ShapeError(f"grad {grad.shape} differs from the parameter's {param.shape}")
    if not param.is_contiguous():
        raise ShapeError("param must be contiguous: it is updated in place")
    if hp.shape != (len(SGD_HPARAMS),):
        raise ShapeError(f"hparams must have shape ({len(SGD_HPARAMS)},), got {hp.shape}")
    return param.shape, "f32", {"strides": param.strides, "offset": param.offset,
                                "view_src": param}


def sgd_ref(param, grad, hp, decay):
    lr, wd, finite, factor = hp
    if finite == 0:
        return param.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        grad = grad * factor
    ok = np.isfinite(grad)
    return np.where(ok, param * (1 - lr * (wd if decay else 0)) - lr * np.where(ok, grad, 0),
                    param)


opt_step_sgd = register(
    "opt_step_sgd", n_srcs=3, params=("decay",), shape=sgd_shape, shader="optim",
    f16=False,  # trainable weights are f32 masters
    reference=sgd_ref, backward=None, updates=True,
    dispatches=lambda n: [Dispatch("opt_step_sgd", n, n.srcs[1:], n=n.nelements,
                                   u=(int(bool(n.params["decay"])),))],
    cases=lambda: [Case((Input(c.inputs[0].shape), c.inputs[1],
                         Input((4,), c.inputs[4].lo, c.inputs[4].hi)), c.params, grad=False)
                   for c in adamw_cases()],
    doc="SGD step in place: (param, grad, hparams [lr, weight decay, finite, gradient "
        "factor], decay) -> param updated (a view of param) from grad times the factor; "
        "decoupled weight decay as AdamW's; nothing changes where the finite flag is 0.")

__all__ = ["adamw_hparams", "append_finite_flag", "opt_step_adamw", "opt_step_sgd", "ADAMW_HPARAMS",
           "DEVICE_HPARAMS", "SGD_HPARAMS"]
