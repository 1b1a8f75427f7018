"""A tiny end-to-end fit through the autodiff graph (like ggml's first optimizer test).

A 2-layer MLP regresses a fixed nonlinear function of random inputs:

    x [B, IN] -> mul_mat(w1) + b1 -> silu -> mul_mat(w2) + b2 -> pred [B, OUT]
    loss = sum((pred - y)^2) / (B * OUT)

The graph — forward, backward and an in-place AdamW update of every parameter — is built
and planned once; each step is one submission of the whole plan, and the loss is read back
only on the steps that print it.
"""
from __future__ import annotations

import numpy as np

from . import ops as O
from .graph import build_backward
from .tensor import constant, input_tensor, param

BATCH, IN, HIDDEN, OUT = 64, 4, 32, 2
BETA1, BETA2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 0.0


def target(x: np.ndarray) -> np.ndarray:
    """The function to learn: smooth, nonlinear, and mixing the inputs."""
    return np.stack([np.sin(2.0 * x[:, 0]) * x[:, 1],
                     x[:, 2] ** 2 - 0.5 * x[:, 3]], axis=1).astype(np.float32)


def fit_demo(backend, steps: int = 300, lr: float = 0.02, seed: int = 0,
             log=print) -> list[float]:
    """Fit the MLP for `steps` full-batch AdamW steps on `backend`; returns the losses it
    printed (each the loss before that step's update), the first and the last included."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rng = np.random.default_rng(seed)
    x_val = rng.uniform(-1.0, 1.0, (BATCH, IN)).astype(np.float32)
    y_val = target(x_val)

    # mul_mat(w [out features, in features], x [B, in features]) -> [B, out features]
    x = input_tensor((BATCH, IN), name="x")
    y = input_tensor((BATCH, OUT), name="y")
    w1 = param(rng.normal(0.0, 1.0 / np.sqrt(IN), (HIDDEN, IN)), name="w1")
    b1 = param(np.zeros(HIDDEN), name="b1")
    w2 = param(rng.normal(0.0, 1.0 / np.sqrt(HIDDEN), (OUT, HIDDEN)), name="w2")
    b2 = param(np.zeros(OUT), name="b2")
    hidden = O.silu(O.add(O.mul_mat(w1, x), b1))        # b1 [HIDDEN] tiles over the rows
    pred = O.add(O.mul_mat(w2, hidden), b2)
    loss = O.scale(O.sum(O.sqr(O.sub(pred, y))), 1.0 / (BATCH * OUT))

    grads = build_backward(loss)
    hparams = input_tensor((len(O.ADAMW_HPARAMS),), name="adamw hparams")
    updates = [O.opt_step_adamw(p, g, constant(np.zeros(p.shape)), constant(np.zeros(p.shape)),
                                hparams, p.ndim >= 2)
               for p, g in grads.items()]
    plan = backend.plan([loss, *updates])
    plan.write(x, x_val)    # the data never changes: it stays in the plan's storage
    plan.write(y, y_val)

    history = []
    for step in range(steps):
        t = step + 1
        # the trainer sets these two on the device (append_finite_flag): finite, no clipping
        finite, grad_factor = 1.0, 1.0
        plan.run({hparams: [*O.adamw_hparams(lr, BETA1, BETA2, EPS, WEIGHT_DECAY, t), finite,
                            grad_factor]})
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            history.append(float(plan.read(loss)[0]))
            log(f"step {step:4d}  loss {history[-1]:.6f}")
    return history
