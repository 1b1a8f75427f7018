"""Fused attention: flash_attn against the unfused ggml composition (mul_mat, scale,
diag_mask_inf, soft_max, mul_mat) on both backends, forward and gradients, and against the
NumPy reference on the device."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends.numpy_backend import NumpyBackend

# (q shape, kv shape, causal): GQA, n_q < n_kv, batch broadcast, d not a multiple of 4
CONFIGS = [((1, 2, 3, 4), (1, 2, 5, 4), True),
           ((2, 4, 7, 5), (2, 2, 7, 5), True),
           ((2, 4, 6, 3), (1, 2, 9, 3), False),
           ((1, 8, 33, 16), (1, 2, 40, 16), True)]


def unfused(q, k, v, scale, causal):
    """The attention a llama graph builds without fusion (ggml's llama train example)."""
    kq = gg.scale(gg.mul_mat(k, q), scale)                      # [.., n_q, n_kv]
    if causal:
        kq = gg.diag_mask_inf(kq, k.shape[-2] - q.shape[-2])
    return gg.mul_mat(gg.transpose(v), gg.soft_max(kq, 1.0))     # [.., n_q, d]


def graphs(q_shape, kv_shape, causal, permuted=False):
    """Leaves, fused and unfused outputs, and the gradients of sum(out * R) for both."""
    rng = np.random.default_rng(1)
    shapes = (q_shape, kv_shape, kv_shape)
    if permuted:  # q, k, v as views with the head and row dims swapped
        leaves = [gg.input_tensor(s[:-3] + (s[-2], s[-3], s[-1])) for s in shapes]
        srcs = [gg.permute(t, (0, 2, 1, 3)) for t in leaves]
    else:
        leaves = srcs = [gg.input_tensor(s) for s in shapes]
    feeds = {t: rng.uniform(-1, 1, t.shape) for t in leaves}
    scale = 1 / np.sqrt(q_shape[-1])
    weights = gg.constant(rng.uniform(-1, 1, q_shape), name="R")
    out = {}
    for name, fn in (("fused", gg.flash_attn), ("unfused", unfused)):
        y = fn(*srcs, scale, causal)
        grads = gg.build_backward(gg.sum(gg.mul(y, weights)), leaves)
        out[name] = [y, *grads.values()]
    return feeds, out


def run(backend, outputs, feeds):
    plan = backend.plan(outputs)
    plan.run({t: v.astype(np.float32) for t, v in feeds.items()})
    return [plan.read(t) for t in outputs]


@pytest.mark.parametrize("q_shape,kv_shape,causal", CONFIGS)
@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_fused_matches_unfused(request, backend, q_shape, kv_shape, causal):
    be = request.getfixturevalue("wgpu") if backend == "wgpu" else NumpyBackend()
    feeds, g = graphs(q_shape, kv_shape, causal, permuted=backend == "wgpu")
    fused = run(be, g["fused"], feeds)
    ref = run(be, g["unfused"], feeds)
    for what, a, b in zip(("out", "dq", "dk", "dv"), fused, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=what)


def test_forward_and_gradients_match_reference_on_device(wgpu):
    """A llama-sized head layout (8 query heads over 2 kv heads, n_ctx 64, d 32) on the
    device against the float64 NumPy reference of the same graph."""
    feeds, g = graphs((2, 8, 64, 32), (2, 2, 64, 32), True)
    ref = NumpyBackend(np.float64).plan(g["fused"])
    ref.run(feeds)
    for what, out, t in zip(("out", "dq", "dk", "dv"), run(wgpu, g["fused"], feeds), g["fused"]):
        want = ref.read(t)
        assert np.sum((out - want) ** 2) <= 1e-10 * np.sum(want ** 2), what


def test_large_logits_stay_finite(wgpu):
    """Scores far beyond f32 exp's range: the online softmax subtracts the running max."""
    q, k, v = (gg.input_tensor(s) for s in ((1, 2, 5, 4), (1, 2, 7, 4), (1, 2, 7, 4)))
    rng = np.random.default_rng(2)
    feeds = {t: rng.uniform(-1, 1, t.shape) * 10 for t in (q, k, v)}
    for causal in (False, True):
        fused, ref = gg.flash_attn(q, k, v, 30.0, causal), unfused(q, k, v, 30.0, causal)
        a, b = run(wgpu, [fused, ref], feeds)
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_backward_is_deterministic(wgpu):
    """Deterministic by construction, not just on a deterministic device: the attention
    kernels use no atomics, and a batch entry's gradients are bit-identical whether it is
    computed alone or next to another (its sums do not depend on the grid or on the order
    in which workgroups run)."""
    from ggwgpu.backends.wgpu_backend import shader_dir
    assert "atomic" not in (shader_dir() / "attention.wgsl").read_text()
    feeds, g = graphs((1, 4, 20, 8), (1, 2, 24, 8), True)
    alone = run(wgpu, g["fused"], feeds)
    rng = np.random.default_rng(5)   # entry 0 as before, entry 1 new values
    feeds2, g2 = graphs((2, 4, 20, 8), (2, 2, 24, 8), True)
    for (t, v), (t2, _) in zip(feeds.items(), feeds2.items()):
        feeds2[t2] = np.concatenate([v, rng.uniform(-1, 1, v.shape)])
    # the loss weights R differ per entry, so compare the forward and, with entry 1's
    # weights irrelevant to entry 0, the gradients of entry 0 only
    weights = [t for t in gg.graph.topo_order(g["fused"]) if t.name == "R"][0]
    weights2 = [t for t in gg.graph.topo_order(g2["fused"]) if t.name == "R"][0]
    weights2.value[:1] = weights.value
    together = run(wgpu, g2["fused"], feeds2)
    for what, a, b in zip(("out", "dq", "dk", "dv"), alone, together):
        np.testing.assert_array_equal(a, b[:1], err_msg=what)


def test_flash_attn_back_packs_dq_dk_dv():
    q, k, v, do = (gg.input_tensor(s) for s in ((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 4),
                                                 (1, 2, 3, 4)))
    both = gg.flash_attn_back(q, k, v, do, 0.5, True)
    assert both.shape == (24 + 20 + 20,)


def test_shape_rules():
    t = gg.input_tensor
    with pytest.raises(gg.ShapeError, match="n_kv >= n_q"):
        gg.flash_attn(t((1, 1, 5, 4)), t((1, 1, 3, 4)), t((1, 1, 3, 4)), 0.5, True)
    gg.flash_attn(t((1, 1, 5, 4)), t((1, 1, 3, 4)), t((1, 1, 3, 4)), 0.5, False)  # fine
    with pytest.raises(gg.ShapeError, match="do not divide"):
        gg.flash_attn(t((1, 3, 5, 4)), t((1, 2, 5, 4)), t((1, 2, 5, 4)), 0.5, False)
    with pytest.raises(gg.ShapeError, match="head dims differ"):
        gg.flash_attn(t((1, 2, 5, 4)), t((1, 2, 5, 3)), t((1, 2, 5, 3)), 0.5, False)
    with pytest.raises(gg.ShapeError, match="exceeds"):
        gg.flash_attn(t((1, 1, 2, 257)), t((1, 1, 2, 257)), t((1, 1, 2, 257)), 0.5, False)
    with pytest.raises(gg.ShapeError, match="dout"):
        gg.flash_attn_back(t((1, 2, 3, 4)), t((1, 2, 5, 4)), t((1, 2, 5, 4)), t((1, 2, 3, 5)),
                           0.5, False)
