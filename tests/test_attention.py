"""Fused attention: flash_attn against the unfused ggml composition (mul_mat, scale,
diag_mask_inf, soft_max, mul_mat) on both backends, forward and gradients, and against the
NumPy reference on the device; flash_attn_ext (additive mask) against flash_attn with a
causal mask and against mul_mat, soft_max_ext, mul_mat with a document mask."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.testing import attention_mask

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
    from ggwgpu.wgsl import shader_dir
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


# -- flash_attn_ext --------------------------------------------------------------------------

def with_gradients(out, leaves, rng):
    """out and the gradients of sum(out * R) w.r.t. `leaves`."""
    weights = gg.constant(rng.uniform(-1, 1, out.shape), name="R")
    grads = gg.build_backward(gg.sum(gg.mul(out, weights)), leaves)
    return [out, *grads.values()]


def qkv(q_shape, kv_shape, permuted, rng):
    """Leaves, the q, k, v built from them (permuted: views with head and row dims swapped)
    and random feeds."""
    shapes = (q_shape, kv_shape, kv_shape)
    if permuted:
        leaves = [gg.input_tensor(s[:-3] + (s[-2], s[-3], s[-1])) for s in shapes]
        srcs = [gg.permute(t, (0, 2, 1, 3)) for t in leaves]
    else:
        leaves = srcs = [gg.input_tensor(s) for s in shapes]
    return leaves, srcs, {t: rng.uniform(-1, 1, t.shape) for t in leaves}


def backend_named(request, name):
    return request.getfixturevalue("wgpu") if name == "wgpu" else NumpyBackend()


@pytest.mark.parametrize("q_shape,kv_shape", [((1, 2, 3, 4), (1, 2, 5, 4)),
                                              ((2, 4, 7, 5), (2, 2, 7, 5)),
                                              ((2, 4, 6, 3), (1, 2, 9, 3))])
@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_causal_mask_matches_flash_attn_causal(request, backend, q_shape, kv_shape):
    """A [n_q, n_kv] mask of 0 and -inf above the diagonal (shifted by n_kv - n_q) is
    flash_attn's causal rule: same output, same gradients."""
    be = backend_named(request, backend)
    rng = np.random.default_rng(3)
    leaves, (q, k, v), feeds = qkv(q_shape, kv_shape, backend == "wgpu", rng)
    mask = gg.input_tensor(q_shape[-2:-1] + kv_shape[-2:-1])
    feeds[mask] = np.where(np.isinf(attention_mask(mask.shape, "causal", rng)), -np.inf, 0.0)
    scale = 1 / np.sqrt(q_shape[-1])
    ext = with_gradients(gg.flash_attn_ext(q, k, v, mask, scale), leaves, np.random.default_rng(4))
    causal = with_gradients(gg.flash_attn(q, k, v, scale, True), leaves, np.random.default_rng(4))
    without_mask = {t: x for t, x in feeds.items() if t is not mask}
    for what, a, b in zip(("out", "dq", "dk", "dv"), run(be, ext, feeds),
                          run(be, causal, without_mask)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what)


@pytest.mark.parametrize("q_shape,kv_shape,mask_shape", [
    ((1, 2, 9, 4), (1, 2, 9, 4), (9, 9)),
    ((2, 4, 10, 5), (2, 2, 10, 5), (2, 1, 10, 10)),       # GQA, one mask per batch row
    ((2, 4, 6, 3), (1, 2, 9, 3), (2, 1, 6, 9))])          # n_q < n_kv, kv batch broadcast
@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_document_mask_matches_soft_max_ext_path(request, backend, q_shape, kv_shape,
                                                 mask_shape):
    """Packed rows (block-diagonal causal document masks): flash_attn_ext against
    mul_mat, soft_max_ext, mul_mat, forward and gradients of q, k, v."""
    be = backend_named(request, backend)
    rng = np.random.default_rng(5)
    leaves, (q, k, v), feeds = qkv(q_shape, kv_shape, backend == "wgpu", rng)
    mask = gg.input_tensor(mask_shape)
    feeds[mask] = attention_mask(mask_shape, "documents", rng)
    assert np.isinf(feeds[mask]).sum() > np.prod(mask_shape) // 2   # real blocks hidden
    scale = 1 / np.sqrt(q_shape[-1])
    probs = gg.soft_max_ext(gg.mul_mat(k, q), mask, scale)            # [.., n_q, n_kv]
    unfused = gg.mul_mat(gg.transpose(v), probs)
    fused = gg.flash_attn_ext(q, k, v, mask, scale)
    a = run(be, with_gradients(fused, leaves, np.random.default_rng(6)), feeds)
    b = run(be, with_gradients(unfused, leaves, np.random.default_rng(6)), feeds)
    for what, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_query_that_sees_no_key_gives_zero_and_takes_no_gradient(request, backend):
    """ggml's flash_attn_ext writes 0 for a row whose mask is -inf everywhere; its dq is 0
    and its output gradient reaches no dk, dv."""
    be = backend_named(request, backend)
    rng = np.random.default_rng(7)
    leaves, (q, k, v), feeds = qkv((1, 2, 6, 4), (1, 1, 6, 4), False, rng)
    mask = gg.input_tensor((6, 6))
    feeds[mask] = attention_mask((6, 6), "hidden_rows", rng)
    hidden = np.isinf(feeds[mask]).all(axis=-1)
    assert hidden.tolist() == [False, True, False, False, True, False]
    out = gg.flash_attn_ext(q, k, v, mask, 0.5)
    weights = gg.input_tensor(out.shape)
    grads = gg.build_backward(gg.sum(gg.mul(out, weights)), leaves)
    plan = be.plan([out, *grads.values()])
    results = []
    for seed in (8, 9):  # the weights of the hidden rows differ between the two runs
        w = rng.uniform(-1, 1, out.shape)
        w[..., ~hidden, :] = np.random.default_rng(10).uniform(-1, 1, w[..., ~hidden, :].shape)
        plan.run({**{t: x.astype(np.float32) for t, x in feeds.items()},
                  weights: w.astype(np.float32)})
        results.append([plan.read(t) for t in plan.outputs])
    (o, dq, dk, dv), again = results
    assert np.all(o[..., hidden, :] == 0) and np.all(dq[..., hidden, :] == 0)
    assert np.all(o[..., ~hidden, :] != 0) and np.all(np.isfinite(dq))
    for a, b in zip((dq, dk, dv), again[1:]):
        np.testing.assert_array_equal(a, b)


def test_flash_attn_ext_shape_rules_and_mask_without_gradient():
    t = gg.input_tensor
    q, kv = t((2, 4, 5, 3)), t((2, 2, 7, 3))
    for shape in ((5, 7), (1, 7), (2, 1, 5, 7), (2, 4, 5, 7), (1, 4, 1, 7)):
        assert gg.flash_attn_ext(q, kv, kv, t(shape), 0.5).shape == q.shape
    for shape in ((7, 5), (3, 1, 5, 7), (5, 6), (4, 2, 5, 7)):
        with pytest.raises(gg.ShapeError, match=r"flash_attn_ext\(.*mask .* does not tile "
                                                r"the scores \(2, 4, 5, 7\)"):
            gg.flash_attn_ext(q, kv, kv, t(shape), 0.5)
    with pytest.raises(gg.ShapeError, match="needs f32"):
        gg.flash_attn_ext(q, kv, kv, t((5, 7), "i32"), 0.5)
    with pytest.raises(gg.ShapeError, match="do not divide"):
        gg.flash_attn_ext(t((1, 3, 5, 3)), kv, kv, t((5, 7)), 0.5)
    with pytest.raises(gg.ShapeError, match="dout"):
        gg.flash_attn_ext_back(q, kv, kv, t((5, 7)), t((2, 4, 5, 4)), 0.5)
    mask = gg.param(np.zeros((5, 7)), name="mask")
    loss = gg.sum(gg.flash_attn_ext(q, kv, kv, mask, 0.5))
    with pytest.raises(gg.ShapeError, match="flash_attn_ext: input 3 .* takes no gradient"):
        gg.build_backward(loss, [mask])


def test_llama_attention_takes_a_mask_on_both_paths():
    """models.attention(mask=...): flash_attn_ext on the flash path, soft_max_ext
    otherwise; a causal mask gives the unmasked causal result, a document mask the same on
    both paths."""
    from types import SimpleNamespace
    from ggwgpu.models import attention
    rng = np.random.default_rng(11)
    cfg = SimpleNamespace(head_dim=4, attn_logit_softcap=0.0)
    q, k, v = (gg.input_tensor(s) for s in ((2, 6, 4, 4), (2, 6, 2, 4), (2, 6, 2, 4)))
    causal, docs = gg.input_tensor((6, 6)), gg.input_tensor((2, 1, 6, 6))
    feeds = {t: rng.uniform(-1, 1, t.shape) for t in (q, k, v)}
    feeds[causal] = np.where(np.isinf(attention_mask((6, 6), "causal", rng)), -np.inf, 0.0)
    feeds[docs] = np.where(np.isinf(attention_mask((2, 1, 6, 6), "documents", rng)), -np.inf, 0.)
    outs = [attention(cfg, q, k, v, flash, mask) for flash in (True, False)
            for mask in (None, causal, docs)]
    assert [o.srcs[0].op for o in outs] == ["flash_attn", "flash_attn_ext", "flash_attn_ext",
                                            "mul_mat", "mul_mat", "mul_mat"]
    flash, flash_causal, flash_docs, plain, plain_causal, plain_docs = \
        NumpyBackend(np.float64).compute(outs, feeds)
    for a in (flash_causal, plain, plain_causal):
        np.testing.assert_allclose(a, flash, atol=1e-12)
    np.testing.assert_allclose(flash_docs, plain_docs, atol=1e-12)
    assert np.abs(flash_docs - flash).max() > 1e-3   # the documents do hide keys
    # gemma2's capped scores, c * tanh(s / c): the unfused path on both (no fused kernel
    # caps); a cap far above the scores changes nothing, a small one does
    capped = [attention(SimpleNamespace(head_dim=4, attn_logit_softcap=c), q, k, v, f, m)
              for c in (1e6, 0.3) for f in (True, False) for m in (None, docs)]
    assert {o.srcs[0].op for o in capped} == {"mul_mat"}
    wide, wide_docs, _, _, small, small_docs, small_plain, small_plain_docs = \
        NumpyBackend(np.float64).compute(capped, {t: feeds[t] for t in (q, k, v, docs)})
    np.testing.assert_allclose(wide, plain, atol=1e-9)
    np.testing.assert_allclose(wide_docs, plain_docs, atol=1e-9)
    np.testing.assert_allclose(small, small_plain, atol=1e-12)
    np.testing.assert_allclose(small_docs, small_plain_docs, atol=1e-12)
    assert np.abs(small - plain).max() > 1e-3
