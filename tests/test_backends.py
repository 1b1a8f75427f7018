"""What the backends do beyond the op matrix: the wgpu encode loop and readback, device
timing, the NumPy backend's fast kernels, the planner's memory report."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends import NumpyBackend
from ggwgpu.backends.numpy_backend import FAST
from ggwgpu.ops import OPS


def small_graph():
    """A few dispatches with several pipelines, a repeated one and a strided view."""
    x, w = gg.input_tensor((6, 8), name="x"), gg.input_tensor((8,), name="w")
    h = gg.rms_norm_mul(x, w, 1e-5)
    y = gg.swiglu(h, gg.exp(gg.exp(h)))
    z = gg.transpose(gg.add(gg.scale(gg.transpose(y), 2.0), gg.input_tensor((8, 1), name="b")))
    return x, w, y, z


def test_direct_calls_and_the_wgpu_py_api_record_the_same_step(wgpu):
    x, w, y, z = small_graph()
    rng = np.random.default_rng(0)
    feeds = {t: rng.uniform(-1, 1, t.shape).astype(np.float32)
             for t in gg.graph.topo_order([z]) if t.op is None}
    results = []
    for direct in (True, False):
        plan = wgpu.plan([y, z])
        plan.direct_calls = direct and plan.direct_calls
        plan.run(feeds)
        results.append(plan.read_many([y, z]))
    assert plan.direct_calls is False
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    ref = NumpyBackend().compute([y, z], feeds)
    np.testing.assert_allclose(results[0][1], ref[1], rtol=1e-5, atol=1e-6)


def test_read_many_reads_each_span_of_shared_storage(wgpu):
    x = gg.input_tensor((4, 6))
    v = np.arange(24, dtype=np.float32).reshape(4, 6)
    views = [x, gg.transpose(x), gg.view(x, (2, 3), (6, 2), 7), gg.view(x, (1,), (1,), 23)]
    plan = wgpu.plan([gg.neg(x)])
    plan.write(x, v)
    expected = [v, v.T, v.reshape(-1)[7:19].reshape(2, 6)[:, ::2], v.reshape(-1)[23:]]
    for got, value in zip(plan.read_many(views), expected, strict=True):
        np.testing.assert_array_equal(got, value)
    assert plan.read_many([]) == []


def test_device_seconds_times_a_run_where_timestamps_exist(wgpu):
    x, w, y, z = small_graph()
    plan = wgpu.plan([y])
    feeds = {x: np.ones((6, 8), np.float32), w: np.ones(8, np.float32)}
    seconds = plan.device_seconds(feeds)
    if not wgpu.has_timestamps:
        assert seconds is None
    else:
        assert 0 < seconds < 60
    np.testing.assert_allclose(plan.read(y), NumpyBackend().compute([y], feeds)[0], rtol=1e-5)


@pytest.mark.parametrize("op,a_shape,b_shape", [
    ("mul_mat", (7, 5), (3, 4, 5)),          # a weight times a batch of rows: one BLAS call
    ("mul_mat", (1, 1, 7, 5), (6, 5)),
    ("mul_mat", (2, 7, 5), (2, 3, 5)),       # batched a: the reference
    ("out_prod", (5, 7), (5, 3)),
    ("out_prod", (2, 5, 7), (4, 5, 3))])
def test_numpy_fast_kernels_equal_the_references(op, a_shape, b_shape):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    node = getattr(gg, op)(gg.input_tensor(a_shape), gg.input_tensor(b_shape))
    fast = FAST[op](a, b).reshape(node.shape)
    np.testing.assert_allclose(fast, OPS[op].reference(a, b), rtol=1e-12, atol=1e-12)


def test_memory_report_sorts_the_planned_bytes_by_role():
    p = gg.param(np.ones((4, 8), np.float32), name="p")
    x = gg.input_tensor((3, 8), name="x")
    loss = gg.sum(gg.sqr(gg.mul_mat(p, x)))
    grad = gg.graph.build_backward(loss, [p])[p]
    m, v = (gg.constant(np.zeros((4, 8), np.float32)) for _ in range(2))
    hp = gg.input_tensor((7,), name="hparams")
    plan = NumpyBackend().plan([loss, gg.opt_step_adamw(p, grad, m, v, hp, True)])
    memory = plan.memory()
    assert memory["weights"] == memory["gradients"] == 4 * 32
    assert memory["state"] >= 2 * 4 * 32
    assert memory["inputs"] == 4 * (24 + 7)
    assert 0 < memory["peak"] <= memory["planned"]


def test_numpy_dequantizes_a_frozen_weight_once_and_again_after_a_write():
    from ggwgpu.quant import dequantize, quantize
    rng = np.random.default_rng(2)
    first, second = (quantize(rng.uniform(-1, 1, (6, 32)), "q4_1") for _ in range(2))
    w, x = gg.constant(first, name="w"), gg.input_tensor((3, 32), name="x")
    y, rows = gg.mul_mat(w, x), gg.get_rows(w, gg.input_tensor((2,), "i32", name="ids"))
    plan = NumpyBackend().plan([y, rows])
    feeds = {x: rng.uniform(-1, 1, (3, 32)).astype(np.float32),
             rows.srcs[1]: np.array([5, 0], np.int32)}
    for value in (first, second):
        if value is second:
            plan.write(w, second)
        plan.run(feeds)
        dense = dequantize(value)
        np.testing.assert_allclose(plan.read(y), feeds[x] @ dense.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(plan.read(rows), dense[[5, 0]])


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_stages_run_apart_and_give_what_one_run_gives(backend_name, request):
    """Plan.stage: the data-parallel step runs its backward, then (after the allreduce) its
    optimizer; values cross from one stage to the other only through outputs and leaves."""
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    x, w, y, z = small_graph()
    later = gg.input_tensor((6, 8), name="later")
    u = gg.mul(gg.exp(gg.neg(later)), y)            # reads y, the first stage's output
    rng = np.random.default_rng(1)
    feeds = {t: rng.uniform(-1, 1, t.shape).astype(np.float32)
             for t in gg.graph.topo_order([z, u]) if t.op is None}
    whole = backend.plan([y, z, u])
    whole.run(feeds)
    plan = backend.plan([y, z, u])
    first, second = plan.stage([y, z]), plan.stage([u])
    assert first and second and not set(first) & set(second)
    assert set(first) | set(second) == set(range(len(plan.nodes)))
    plan.run({t: v for t, v in feeds.items() if t is not later}, stage=first)
    plan.run({later: feeds[later]}, stage=second)
    for t in (y, z, u):
        np.testing.assert_array_equal(plan.read(t), whole.read(t))
    other = backend.plan([z, u])                      # y is no output there
    other.stage([z])
    with pytest.raises(ValueError, match="not a plan output"):
        other.stage([u])
