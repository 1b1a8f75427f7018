"""The gated delta rule's chunked form (models.delta_net) against the rule token by token in
float64 (testing.delta_rule_steps): outputs and states for chunks that divide the sequence
or pad it, from zero and from a given state, rows that pack several sequences; its
gradients (the autodiff of the chunked form) against finite differences; the device against
NumPy."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.models.delta_net import delta_rule, segment_masks
from ggwgpu.tensor import constant, param
from ggwgpu.testing import delta_rule_steps, nmse, spot_check_gradients


def rule_inputs(batch, t, heads, size, seed=0):
    """q, k (L2-normed, as the model's), v, g <= 0 and beta in (0, 1), float64."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((batch, t, heads, size)) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -rng.uniform(0.02, 1.5, (batch, t, heads))
    beta = rng.uniform(0.05, 0.95, (batch, t, heads))
    return q, k, v, g, beta


def check_gradients(o, params):
    """The gradients of a random weighted sum of o against finite differences."""
    weights = np.random.default_rng(6).uniform(-1, 1, o.shape)
    loss = gg.ops.sum(gg.ops.mul(o, constant(weights.astype(np.float32))))
    grads = gg.build_backward(loss, params)
    plan = NumpyBackend(np.float64).plan([loss, *grads.values()])
    plan.run({})
    spot_check_gradients(loss, {p: plan.read(d) for p, d in grads.items()}, {}, samples=10,
                         atol=1e-7, rtol=1e-5)


def run(outputs, backend=None, feeds=None):
    plan = (backend or NumpyBackend(np.float64)).plan(outputs)
    plan.run(feeds or {})
    return [plan.read(t) for t in outputs]


@pytest.mark.parametrize("t,chunk", [(8, 4), (8, 8), (7, 4), (5, 16), (13, 3), (6, 1)])
def test_the_chunked_rule_is_the_rule_token_by_token(t, chunk):
    """From a given state, with the state after the last token; and from zeros."""
    batch, heads, size = 2, 3, 4
    inputs = rule_inputs(batch, t, heads, size)
    state = np.random.default_rng(1).standard_normal((heads, batch, size, size))
    want, want_state = delta_rule_steps(*inputs, state.transpose(1, 0, 2, 3))
    leaves = [constant(x) for x in inputs]
    o, end = delta_rule(*leaves, constant(state.reshape(heads * batch, size, size)),
                        chunk=chunk, final_state=True)
    got, got_state = run([o, end])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_state.reshape(heads, batch, size, size),
                               want_state.transpose(1, 0, 2, 3), rtol=0, atol=1e-6)
    (zero,) = run([delta_rule(*leaves, chunk=chunk)])
    np.testing.assert_allclose(zero, delta_rule_steps(*inputs)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("t,chunk", [(8, 4), (7, 3), (5, 16)])
def test_without_the_delta_correction_it_is_mamba2_s_scan_token_by_token(t, chunk):
    """delta=False, q unscaled, keys narrower than values (Mamba2: B and C of d_state, x of
    the head size): from a state and from zeros, and its gradients."""
    batch, heads, s_k, s_v = 2, 3, 3, 5
    q, k, v, g, beta = rule_inputs(batch, t, heads, s_v)
    q, k = q[..., :s_k], k[..., :s_k] * 2
    inputs = q, k, v, g, beta
    state = np.random.default_rng(2).standard_normal((heads, batch, s_v, s_k))
    rule = {"delta": False, "scale": 1.0}
    want, want_state = delta_rule_steps(*inputs, state.transpose(1, 0, 2, 3), **rule)
    leaves = [constant(x) for x in inputs]
    o, end = delta_rule(*leaves, constant(state.reshape(heads * batch, s_v, s_k)),
                        chunk=chunk, final_state=True, **rule)
    got, got_state = run([o, end])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_state.reshape(heads, batch, s_v, s_k),
                               want_state.transpose(1, 0, 2, 3), rtol=0, atol=1e-6)
    (zero,) = run([delta_rule(*leaves, chunk=chunk, **rule)])
    np.testing.assert_allclose(zero, delta_rule_steps(*inputs, **rule)[0], rtol=0, atol=1e-6)
    params = [param(x.astype(np.float32), name=n) for x, n in zip(inputs, "qkvgb")]
    o = delta_rule(*params, chunk=chunk, **rule)
    check_gradients(o, params)


def test_segment_masks_keep_sequences_apart_within_and_across_chunks():
    same, carry = segment_masks([[0, 0, 0, 1, 1, 1, 1, 1, 1, 2]], chunk=4)
    assert same.shape == (1, 3, 4, 4) and carry.shape == (1, 3, 4, 1)
    np.testing.assert_array_equal(same[0, 0], [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0],
                                               [0, 0, 0, 1]])
    np.testing.assert_array_equal(same[0, 2], [[1, 0, 0, 0], [0, 1, 1, 1], [0, 1, 1, 1],
                                               [0, 1, 1, 1]])          # padding: sequence 2
    np.testing.assert_array_equal(carry[0, :, :, 0], [[0, 0, 0, 0], [1, 1, 1, 1],
                                                      [1, 0, 0, 0]])


@pytest.mark.parametrize("chunk", [4, 16])
def test_packed_rows_give_each_sequence_the_rule_from_zero(chunk):
    """Sequences of 3, 6, 1 and 6 tokens in two rows of 8: each sequence's outputs are the
    rule's on it alone, whichever chunks it spans."""
    lengths = [[3, 5], [1, 7]]
    segments = np.array([np.repeat(np.arange(2), row) for row in lengths])
    inputs = rule_inputs(2, 8, 2, 3, seed=3)
    masks = tuple(constant(m) for m in segment_masks(segments, chunk))
    (got,) = run([delta_rule(*(constant(x) for x in inputs), chunk=chunk, segments=masks)])
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            part = tuple(x[row:row + 1, start:start + n] for x in inputs)
            np.testing.assert_allclose(got[row, start:start + n], delta_rule_steps(*part)[0][0],
                                       rtol=0, atol=1e-6)
            start += n


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_chunked_rule_s_gradients_are_its_finite_differences(packed):
    """Every input's gradient, across padded chunks (7 tokens in chunks of 3), through the
    WY inverse and the state's products, and with packed rows."""
    inputs = rule_inputs(2, 7, 2, 3, seed=5)
    leaves = [param(x.astype(np.float32), name=n) for x, n in zip(inputs, "qkvgb")]
    masks = None
    if packed:
        masks = tuple(constant(m) for m in segment_masks([[0] * 4 + [1] * 3, [0] * 7], 3))
    o = delta_rule(*leaves, chunk=3, segments=masks)
    check_gradients(o, leaves)


def test_the_chunked_rule_and_its_gradients_on_the_device_equal_numpy(wgpu):
    inputs = rule_inputs(2, 70, 3, 8, seed=7)      # two chunks of 64, the second padded
    state = np.random.default_rng(8).standard_normal((6, 8, 8)).astype(np.float32)
    leaves = [param(x.astype(np.float32), name=n) for x, n in zip(inputs, "qkvgb")]
    o, end = delta_rule(*leaves, constant(state), final_state=True)
    loss = gg.ops.add(gg.ops.sum(gg.ops.sqr(o)), gg.ops.sum(end))
    grads = gg.build_backward(loss, leaves)
    outputs = [o, end, *grads.values()]
    for got, want in zip(run(outputs, wgpu), run(outputs, NumpyBackend())):
        assert nmse(got, want) < 1e-10
