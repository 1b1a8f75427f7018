"""The AdamW update op: state updated in place, the same on both backends, and it trains."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends.numpy_backend import NumpyBackend


def hparams(step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, finite=1.0, factor=1.0):
    return np.array([lr, beta1, beta2, eps, wd, 1 / (1 - beta1 ** step), 1 / (1 - beta2 ** step),
                     finite, factor])


def adamw_graph(decay):
    """loss = sum((w x - y)^2) and one AdamW step of w, all in one graph."""
    rng = np.random.default_rng(0)
    w = gg.param(rng.normal(size=(3, 4)), name="w")
    x, y = gg.input_tensor((6, 4), name="x"), gg.input_tensor((6, 3), name="y")
    m, v = gg.constant(np.zeros((3, 4))), gg.constant(np.zeros((3, 4)))
    hp = gg.input_tensor((9,), name="hparams")
    loss = gg.sum(gg.sqr(gg.sub(gg.mul_mat(w, x), y)))
    step = gg.opt_step_adamw(w, gg.build_backward(loss)[w], m, v, hp, decay)
    feeds = {x: rng.normal(size=(6, 4)), y: rng.normal(size=(6, 3))}
    return loss, step, (w, m, v, hp), feeds


@pytest.mark.parametrize("decay", [False, True])
def test_adamw_steps_match_across_backends_and_the_formula(wgpu, decay):
    loss, step, (w, m, v, hp), feeds = adamw_graph(decay)
    plans = [wgpu.plan([loss, step]), NumpyBackend(np.float64).plan([loss, step])]
    # the update by hand, in float64
    wv, mv, vv = w.value.astype(np.float64), np.zeros((3, 4)), np.zeros((3, 4))
    xv, yv = feeds.values()
    for t in range(1, 4):
        for plan in plans:
            plan.run({**feeds, hp: hparams(t)})
        g = 2 * ((xv @ wv.T - yv).T @ xv)
        mv = 0.9 * mv + 0.1 * g
        vv = 0.999 * vv + 0.001 * g * g
        keep = 1 - 1e-2 * (0.1 if decay else 0)
        wv = wv * keep - 1e-2 * (mv * hparams(t)[5]) / (np.sqrt(vv * hparams(t)[6]) + 1e-8)
    for plan in plans:
        np.testing.assert_allclose(plan.read(w), wv, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(plan.read(m), mv, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(plan.read(v), vv, rtol=1e-4, atol=1e-9)


def test_adamw_lowers_the_loss(wgpu):
    loss, step, (w, m, v, hp), feeds = adamw_graph(False)
    plan = wgpu.plan([loss, step])
    losses = []
    for t in range(1, 201):
        plan.run({**feeds, hp: hparams(t, lr=0.05)})
        losses.append(plan.read(loss)[0])
    assert losses[-1] < 0.2 * losses[0]


def test_adamw_cannot_be_differentiated():
    loss, step, (w, m, v, hp), feeds = adamw_graph(False)
    with pytest.raises(gg.ShapeError, match="optimizer update"):
        gg.build_backward(gg.sum(step), [w])


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_updates_skip_elements_whose_gradient_is_not_finite(wgpu, optimizer):
    """Where the gradient is NaN or +-inf the parameter and its moments stay exactly as they
    were; every other element takes the ordinary step. Shader and reference agree."""
    rng = np.random.default_rng(1)
    shape = (5, 7)
    w = gg.param(rng.normal(size=shape).astype(np.float32), name="w")
    grad = gg.input_tensor(shape, name="grad")
    g = rng.normal(size=shape).astype(np.float32)
    bad = np.zeros(shape, bool)
    bad.flat[[0, 3, 17, 34]] = True
    g.flat[[0, 3, 17, 34]] = [np.nan, np.inf, -np.inf, np.nan]
    m0, v0 = rng.normal(size=shape), rng.uniform(0.1, 1, size=shape)
    if optimizer == "adamw":
        m, v = gg.constant(m0.astype(np.float32)), gg.constant(v0.astype(np.float32))
        hp = gg.input_tensor((9,), name="hparams")
        step, hp_value = gg.opt_step_adamw(w, grad, m, v, hp, True), hparams(3)
    else:
        m = v = None
        hp = gg.input_tensor((4,), name="hparams")
        step, hp_value = gg.opt_step_sgd(w, grad, hp, True), np.array([0.1, 0.1, 1.0, 1.0])
    results = []
    for backend in (wgpu, NumpyBackend()):
        plan = backend.plan([step])
        plan.run({grad: g, hp: hp_value})
        results.append([plan.read(t) for t in (w, m, v) if t is not None])
    for dev, ref in zip(*results):
        np.testing.assert_allclose(dev, ref, rtol=1e-6, atol=1e-7)
        assert np.isfinite(dev).all()
    before = [w.value] + ([m.value, v.value] if m is not None else [])
    for after, old in zip(results[0], before):
        assert np.array_equal(after[bad], old[bad])        # untouched where not finite
        assert not np.any(after[~bad] == old[~bad])         # updated everywhere else


@pytest.mark.parametrize("backend_name", ["numpy64", "wgpu"])
def test_adamw_hparams_give_adamw_with_the_float32_betas_the_kernel_sees(backend_name,
                                                                           request):
    """Ten steps from zero weights against AdamW (PyTorch's formula) in float64 with betas
    rounded to float32 as the kernel holds them: the bias corrections must come from those
    betas too (from the exact 0.999 every update is 6.4e-6 larger, relative)."""
    from ggwgpu.ops import adamw_hparams
    backend = (NumpyBackend(np.float64) if backend_name == "numpy64"
               else request.getfixturevalue("wgpu"))
    rng = np.random.default_rng(3)
    shape, lr, eps, wd, beta1, beta2 = (4, 33), 2.0 ** -7, 1e-8, 0.1, 0.9, 0.999
    w, grad = gg.param(np.zeros(shape, np.float32), name="w"), gg.input_tensor(shape, name="g")
    m, v = gg.constant(np.zeros(shape, np.float32)), gg.constant(np.zeros(shape, np.float32))
    hp = gg.input_tensor((9,), name="hparams")
    plan = backend.plan([gg.opt_step_adamw(w, grad, m, v, hp, True)])
    b1, b2 = float(np.float32(beta1)), float(np.float32(beta2))
    wv, mv, vv = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for t in range(1, 11):
        g = rng.normal(size=shape).astype(np.float32).astype(np.float64)
        plan.run({grad: g, hp: [*adamw_hparams(lr, beta1, beta2, eps, wd, t), 1.0, 1.0]})
        mv = b1 * mv + (1 - b1) * g
        vv = b2 * vv + (1 - b2) * g * g
        wv = wv * (1 - lr * wd) - lr * (mv / (1 - b1 ** t)) / (np.sqrt(vv / (1 - b2 ** t)) + eps)
    # in units of the learning rate (the size of one step): float32 rounding stays near
    # 2e-6 of it (measured 1.3e-7 float64, 2e-6 lavapipe), exact-beta bias corrections drift
    # by 5e-5 in ten steps
    drift = np.abs(plan.read(w) - wv).max() / lr
    print(f"AdamW drift after 10 steps: {drift:.2e} lr")
    assert drift < 1e-5
    np.testing.assert_allclose(plan.read(v), vv, rtol=1e-6)



@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("backend_name", ["numpy", "numpy-reference", "wgpu"])
def test_the_gradient_factor_is_a_mul_before_the_update(backend_name, optimizer, request):
    """A step with gradient factor f (the trainer's clipping factor and 1/loss scale) gives
    bit for bit the step with factor 1 on float32(grad * f), the product a mul op before it
    made; a product that overflows is a non-finite gradient element, left as it was."""
    backend = (request.getfixturevalue("wgpu") if backend_name == "wgpu"
               else NumpyBackend(fast=backend_name == "numpy"))
    rng = np.random.default_rng(4)
    shape = (6, 67)
    w0, m0 = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    v0 = rng.uniform(0.1, 1, size=shape).astype(np.float32)
    g = rng.normal(size=shape).astype(np.float32)
    g[0, :3] = [3e38, -3e38, 1e-30]           # overflow to +-inf; a tiny one stays finite
    factor = np.float32(np.pi * 1e3)
    with np.errstate(over="ignore"):
        multiplied = g * factor
    results = []
    for grad_value, f in ((g, factor), (multiplied, np.float32(1))):
        w, grad = gg.param(w0, name="w"), gg.input_tensor(shape, name="grad")
        if optimizer == "adamw":
            m, v = gg.constant(m0), gg.constant(v0)
            hp, hp_value = gg.input_tensor((9,), name="hparams"), hparams(3, factor=f)
            step, state = gg.opt_step_adamw(w, grad, m, v, hp, True), (w, m, v)
        else:
            hp, hp_value = gg.input_tensor((4,), name="hparams"), [0.1, 0.1, 1, f]
            step, state = gg.opt_step_sgd(w, grad, hp, True), (w,)
        plan = backend.plan([step])
        plan.run({grad: grad_value, hp: hp_value})
        results.append([plan.read(t) for t in state])
    for scaled, by_mul in zip(*results, strict=True):
        assert np.array_equal(scaled, by_mul)
        assert np.isfinite(scaled).all()
    assert np.array_equal(results[0][0][0, :2], w0[0, :2])     # the overflowed ones
    assert not np.array_equal(results[0][0][1:], w0[1:])
