"""Graph building, autodiff, planning and backend choice."""
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu import backends
from ggwgpu.backends.numpy_backend import NumpyBackend


def test_topo_order_of_a_deep_chain_needs_no_recursion():
    x = gg.input_tensor((2,))
    y = x
    for _ in range(20000):
        y = gg.neg(y)
    order = gg.topo_order([y])
    assert len(order) == 20001 and order[0] is x and order[-1] is y


def test_gradients_of_a_tensor_used_several_times_accumulate():
    x = gg.param(np.array([1.5, -2.0, 3.0]), name="x")
    loss = gg.sum(gg.add(gg.mul(x, x), gg.scale(x, 3.0)))  # sum(x^2 + 3x)
    grads = gg.build_backward(loss)
    (g,) = NumpyBackend(np.float64).compute([grads[x]])
    np.testing.assert_allclose(g, 2 * x.value + 3)


def gradient_nodes(grad):
    return [n.op for n in gg.topo_order([grad]) if n.op is not None]


def test_a_gradient_sum_folds_into_the_product_that_makes_a_term(wgpu):
    """x feeds three products (one scaled): d x = w1' g1 + w2' g2 + 0.5 w3' g3 takes no add,
    each later term's product adding the sum so far as it stores; on both backends the
    same as the float64 sum of the three products."""
    rng = np.random.default_rng(0)
    x = gg.param(rng.uniform(-1, 1, (5, 8)), name="x")
    ws = [gg.constant(rng.uniform(-1, 1, (m, 8)).astype(np.float32)) for m in (3, 4, 6)]
    loss = gg.add(gg.add(gg.sum(gg.sqr(gg.mul_mat(ws[0], x))), gg.sum(gg.mul_mat(ws[1], x))),
                  gg.sum(gg.sqr(gg.mul_mat(ws[2], x, 0.5))))
    grad = gg.build_backward(loss, [x])[x]
    ops = gradient_nodes(grad)
    assert "add" not in ops and ops.count("mul_mat_acc") == 2 and grad.op == "mul_mat_acc"
    xv, (w1, w2, w3) = x.value.astype(np.float64), (w.value.astype(np.float64) for w in ws)
    want = 2 * (xv @ w1.T) @ w1 + np.ones((5, 4)) @ w2 + 2 * 0.25 * (xv @ w3.T) @ w3
    for backend in (NumpyBackend(np.float64), wgpu):
        (got,) = backend.compute([grad])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_shared_gradient_is_summed_by_an_add_not_recomputed():
    """g of add(y, y) is handed to both of its sources: y's gradient, a product, is read
    twice, so the sum takes an add and no second copy of that product."""
    x = gg.param(np.ones((2, 4)), name="x")
    w = gg.constant(np.ones((3, 4), np.float32))
    y = gg.mul_mat(w, x)
    grad = gg.build_backward(gg.sum(gg.sqr(gg.add(y, y))), [x])[x]
    assert "mul_mat_acc" not in gradient_nodes(grad)
    (got,) = NumpyBackend(np.float64).compute([grad])
    np.testing.assert_allclose(got, 8 * (np.ones((2, 4)) @ np.ones((4, 3))) @ np.ones((3, 4)))


def test_a_checkpoint_product_reads_recomputed_operands_in_the_backward():
    """A checkpoint that is a product (a llama block's output: its residual added in the
    epilogue) keeps its own value, not its operands: the weight's gradient reads the
    operand recomputed from the checkpoint below, and equals the one without checkpoints."""
    rng = np.random.default_rng(1)
    x = gg.param(rng.uniform(-1, 1, (3, 8)), name="x")
    w = gg.param(rng.uniform(-1, 1, (8, 8)), name="w")
    below = gg.silu(x)
    h = gg.silu(below)                       # recomputed from `below` in the backward
    top = gg.mul_mat_acc(w, h, below, 0.5)
    loss = gg.sum(top)
    kept = gg.build_backward(loss, [x, w], checkpoints=[below, top])
    assert h not in gg.topo_order([kept[w]])
    plain = gg.build_backward(loss, [x, w])
    got = NumpyBackend(np.float64).compute([kept[x], kept[w], plain[x], plain[w]])
    np.testing.assert_allclose(got[0], got[2], rtol=1e-12)
    np.testing.assert_allclose(got[1], got[3], rtol=1e-12)


def test_only_params_get_gradients():
    x = gg.input_tensor((3,), name="x")
    w = gg.param(np.ones(3), name="w")
    grads = gg.build_backward(gg.sum(gg.mul(w, x)))
    assert list(grads) == [w]
    (g,) = NumpyBackend().compute([grads[w]], {x: np.array([1, 2, 3])})
    np.testing.assert_array_equal(g, [1, 2, 3])


def test_a_param_the_loss_ignores_gets_zero_gradient():
    w, unused = gg.param(np.ones(2)), gg.param(np.ones(4))
    grads = gg.build_backward(gg.sum(w), [w, unused])
    (g,) = NumpyBackend().compute([grads[unused]])
    np.testing.assert_array_equal(g, np.zeros(4))


def test_loss_must_be_a_scalar():
    with pytest.raises(gg.ShapeError, match="one element"):
        gg.build_backward(gg.sqr(gg.param(np.ones(3))))


def test_second_derivative_through_a_back_op_is_refused():
    x = gg.param(np.ones(3), name="x")
    dy = gg.input_tensor((3,))
    with pytest.raises(gg.ShapeError, match="silu_back: input 0"):
        gg.build_backward(gg.sum(gg.silu_back(x, dy)))


def test_plan_runs_again_with_new_inputs_and_keeps_params(wgpu):
    x = gg.input_tensor((2, 3), name="x")
    w = gg.param(np.full((4, 3), 0.5), name="w")
    y = gg.mul_mat(w, x)
    plan = wgpu.plan([y])
    a = np.random.rand(2, 3).astype(np.float32)
    plan.run({x: a})
    np.testing.assert_allclose(plan.read(y), a @ w.value.T, rtol=1e-6)
    plan.write(w, np.ones((4, 3)))
    plan.run({x: 2 * a})
    np.testing.assert_allclose(plan.read(y), 2 * a @ np.ones((3, 4)), rtol=1e-6)
    np.testing.assert_array_equal(plan.read(w), np.ones((4, 3)))


def test_a_whole_step_is_one_pass_of_planned_dispatches(wgpu):
    x = gg.input_tensor((8, 16))
    w = gg.param(np.random.rand(5, 16))
    loss = gg.sum(gg.sqr(gg.silu(gg.mul_mat(w, x))))
    grads = gg.build_backward(loss)
    plan = wgpu.plan([loss, *grads.values()])
    ops = [n.op for n in plan.nodes]
    assert len(plan.recorded) >= len(ops) and "out_prod" in ops and "silu_back" in ops
    feeds = {x: np.random.rand(8, 16)}
    ref = NumpyBackend(np.float64).plan([loss, *grads.values()])
    ref.run(feeds)
    plan.run(feeds)
    np.testing.assert_allclose(plan.read(grads[w]), ref.read(grads[w]), rtol=1e-4)


def test_feeding_a_wrong_shape_names_the_tensor():
    x = gg.input_tensor((2, 3), name="tokens")
    plan = NumpyBackend().plan([gg.neg(x)])
    with pytest.raises(gg.ShapeError, match="tokens.*expected \\(2, 3\\)"):
        plan.run({x: np.zeros((3, 2))})


def test_backend_choice_by_argument_and_environment(monkeypatch):
    assert isinstance(gg.get_backend("numpy"), NumpyBackend)
    monkeypatch.setenv("GGWGPU_BACKEND", "numpy")
    assert isinstance(gg.get_backend(), NumpyBackend)
    monkeypatch.setenv("GGWGPU_BACKEND", "cuda")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        gg.get_backend()


def test_without_an_adapter_auto_falls_back_to_numpy_with_one_warning(adapter_as,
                                                                       monkeypatch):
    from ggwgpu.backends.wgpu_backend import NoAdapterError
    adapter_as(None)

    def no_device():
        raise NoAdapterError("no WebGPU adapter: test")
    monkeypatch.setattr(backends, "shared_wgpu_backend", no_device)
    monkeypatch.delenv("GGWGPU_BACKEND", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert isinstance(gg.get_backend(), NumpyBackend)
        assert isinstance(gg.get_backend("auto"), NumpyBackend)
    assert len([w for w in caught if "NumPy backend" in str(w.message)]) == 1
    with pytest.raises(NoAdapterError):
        gg.get_backend("wgpu")


LAVAPIPE = {"device": "llvmpipe (LLVM 15.0.6, 256 bits)", "vendor": "llvmpipe",
            "adapter_type": "CPU", "backend_type": "Vulkan"}
SOFTWARE_ADAPTERS = [
    LAVAPIPE,
    {**LAVAPIPE, "backend_type": "OpenGL"},
    {"device": "SwiftShader Device (Subzero)", "adapter_type": "CPU", "backend_type": "Vulkan"},
    {"device": "Microsoft Basic Render Driver", "adapter_type": "CPU", "backend_type": "D3D12"},
    # a GL driver that does not say CPU is still known by name
    {"device": "llvmpipe (LLVM 19.1.7, 256 bits)", "adapter_type": "Unknown",
     "backend_type": "OpenGL"},
]
HARDWARE_ADAPTERS = [
    {"device": "NVIDIA GeForce RTX 4090", "adapter_type": "DiscreteGPU", "backend_type": "Vulkan"},
    {"device": "Intel(R) UHD Graphics 620", "adapter_type": "IntegratedGPU",
     "backend_type": "Vulkan"},
    {"device": "Apple M2", "adapter_type": "IntegratedGPU", "backend_type": "Metal"},
]


@pytest.mark.parametrize("info", SOFTWARE_ADAPTERS, ids=lambda i: i["device"])
def test_auto_runs_numpy_when_the_only_adapter_is_a_software_one(adapter_as, monkeypatch, info):
    adapter_as(info)
    monkeypatch.delenv("GGWGPU_BACKEND", raising=False)
    monkeypatch.setattr(backends, "shared_wgpu_backend", lambda: pytest.fail("device made"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # the intended path: no warning
        assert isinstance(gg.get_backend(), NumpyBackend)
    name, why = backends.auto_choice()
    assert name == "numpy" and info["device"] in why and "software" in why


@pytest.mark.parametrize("info", HARDWARE_ADAPTERS, ids=lambda i: i["device"])
def test_auto_runs_wgpu_on_a_hardware_adapter(adapter_as, monkeypatch, info):
    adapter_as(info)
    monkeypatch.delenv("GGWGPU_BACKEND", raising=False)
    device = object()
    monkeypatch.setattr(backends, "shared_wgpu_backend", lambda: device)
    assert gg.get_backend() is device and gg.get_backend("numpy") is not device
    name, why = backends.auto_choice()
    assert name == "wgpu" and info["device"] in why and "hardware" in why


def test_auto_decides_by_the_adapter_this_machine_has(wgpu):
    """The wgpu tests' own adapter (lavapipe in CI) gives auto's choice; wgpu stays forced."""
    backends.auto_choice.cache_clear()
    software = backends.is_software_adapter(wgpu.info)
    assert backends.auto_choice()[0] == ("numpy" if software else "wgpu")
    assert gg.get_backend("wgpu") is wgpu


def test_intermediates_share_buffers_and_results_stay_exact(wgpu):
    x = gg.input_tensor((16, 32), name="x")
    w1, w2 = gg.param(np.random.rand(24, 32) - 0.5), gg.param(np.random.rand(8, 24) - 0.5)
    h = x
    for _ in range(6):  # a chain of same-sized intermediates: buffers can be reused
        h = gg.silu(gg.scale(h, 0.9))
    loss = gg.sum(gg.sqr(gg.mul_mat(w2, gg.gelu(gg.mul_mat(w1, h)))))
    grads = gg.build_backward(loss)
    plan = wgpu.plan([loss, *grads.values()])
    every_block = sum(plan.nbytes(r) for r in plan.roots)
    assert plan.layout.total_bytes < 0.8 * every_block
    assert plan.layout.peak_bytes <= plan.layout.total_bytes
    feeds = {x: np.random.rand(16, 32)}
    ref = NumpyBackend(np.float64).plan([loss, *grads.values()])
    ref.run(feeds)
    plan.run(feeds)
    for w in (w1, w2):
        np.testing.assert_allclose(plan.read(grads[w]), ref.read(grads[w]), rtol=1e-4, atol=1e-6)
    with pytest.raises(KeyError, match="list it among the plan's outputs"):
        plan.read(h)


def deep_mlp(n_layers, width=16, rows=512):  # activations dominate memory
    rng = np.random.default_rng(1)
    x = gg.input_tensor((rows, width), name="x")
    ws = [gg.param(rng.normal(size=(width, width)) / np.sqrt(width), name=f"w{i}")
          for i in range(n_layers)]
    h, layer_outputs = x, []
    for w in ws:
        h = gg.silu(gg.mul_mat(w, h))
        layer_outputs.append(h)
    return x, ws, gg.sum(gg.sqr(h)), layer_outputs


def test_checkpointing_gives_the_same_gradients_with_a_lower_peak(wgpu):
    x, ws, loss, outs = deep_mlp(12)
    feeds = {x: np.random.default_rng(2).normal(size=x.shape)}
    plain = gg.build_backward(loss)
    ckpt = gg.build_backward(loss, checkpoints=outs[3::4])   # every 4th layer
    results, peaks = [], []
    for grads in (plain, ckpt):
        plan = wgpu.plan([loss, *grads.values()])
        plan.run(feeds)
        results.append([plan.read(grads[w]) for w in ws])
        peaks.append(plan.layout.peak_bytes)
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert peaks[1] < 0.85 * peaks[0], peaks


def test_packed_blocks_that_share_bytes_never_live_at_once():
    from ggwgpu.alloc import Block, pack
    rng = np.random.default_rng(0)
    for trial in range(500):
        blocks = []
        for key in range(rng.integers(1, 14)):
            first = int(rng.integers(-1, 9))
            blocks.append(Block(key, int(rng.choice([4, 16, 140, 400, 1000])), first,
                                int(rng.integers(max(first, 0), 13))))
        align, cap = int(rng.choice([16, 32, 256])), int(rng.choice([1024, 2048, 10 ** 6]))
        alone = {b.key for b in blocks if b.nbytes == 1000 and trial % 2}
        layout = pack(blocks, align=align, max_buffer=cap, alone=alone)
        reused = set()
        for a in blocks:
            buf, offset, size = layout.place[a.key]
            assert size >= a.nbytes and offset % align == 0
            assert offset + size <= layout.buffer_bytes[buf]
            if a.key in alone:
                assert offset == 0 and all(layout.place[b.key][0] != buf
                                           for b in blocks if b is not a)
            else:
                assert size % align == 0 and layout.buffer_bytes[buf] <= cap
            for b in blocks:
                other, b_offset, b_size = layout.place[b.key]
                if a is not b and other == buf and offset < b_offset + b_size \
                        and b_offset < offset + size:
                    reused.add(a.key)
                    assert a.last < b.first or b.last < a.first, (a, b)
        assert layout.reused == reused
        assert layout.total_bytes >= layout.peak_bytes
    with pytest.raises(ValueError, match="distinct"):
        pack([Block(1, 4, 0, 1), Block(1, 4, 0, 1)])


def test_two_small_blocks_take_the_place_of_one_large_one():
    """A buffer per block (sized by its largest tenant) could hold only one of the two
    later blocks where the first one was; at byte offsets both fit: the peak, no more."""
    from ggwgpu.alloc import Block, pack
    blocks = [Block(0, 1024, 0, 1), Block(1, 512, 2, 3), Block(2, 500, 2, 4),
              Block(3, 64, 5, 6)]
    layout = pack(blocks)
    assert layout.peak_bytes == layout.total_bytes == 1024
    assert len(layout.buffer_bytes) == 1
    assert layout.reused == {0, 1, 2, 3}


def test_in_place_updates_wait_for_every_reader_of_the_old_value(wgpu):
    # w2's update needs only dL/dw2, but the gradient for w1 reads w2 too: it must see the
    # old w2 whatever order the outputs are listed in
    rng = np.random.default_rng(0)
    x = gg.constant(rng.normal(size=(4, 3)))
    w1, w2 = gg.param(rng.normal(size=(5, 3)), name="w1"), gg.param(rng.normal(size=(2, 5)))
    loss = gg.sum(gg.sqr(gg.mul_mat(w2, gg.mul_mat(w1, x))))
    grads = gg.build_backward(loss)
    lr = gg.constant(np.array([0.5, 0.0, 1.0, 1.0]))   # lr, weight decay, finite, factor
    updates = [gg.opt_step_sgd(w, grads[w], lr, False) for w in (w2, w1)]
    expected = {w: w.value - 0.5 * g for w, g in
                zip(grads, NumpyBackend(np.float64).compute(list(grads.values())))}
    for backend in (wgpu, NumpyBackend(np.float64)):
        plan = backend.plan([*updates, loss])
        plan.run()
        for w in (w1, w2):
            np.testing.assert_allclose(plan.read(w), expected[w], rtol=1e-5)



def test_a_reader_of_a_written_tensor_runs_before_the_write_unless_it_depends_on_it():
    buf, a = gg.input_tensor((3,), name="buf"), gg.input_tensor((3,), name="a")
    w = gg.cpy(a, buf)
    y = gg.add(buf, gg.neg(w))   # reads buf, and depends on the write through neg(w)
    r = gg.neg(buf)              # reads buf only: sees the old contents
    order = gg.topo_order([y, r])
    assert order.index(r) < order.index(w) < order.index(y)
    old, new = np.array([1.0, 2.0, 3.0]), np.array([5.0, 7.0, 9.0])
    got_y, got_r = NumpyBackend(np.float64).compute([y, r], {buf: old, a: new})
    np.testing.assert_array_equal(got_r, -old)
    np.testing.assert_array_equal(got_y, np.zeros(3))   # new buf + (-new buf)

PACKAGE = str(Path(gg.__file__).parent)


def planning_work(n_layer: int) -> int:
    """Profiler events (calls and returns of functions and builtins) inside ggwgpu while the
    training step of a tiny llama with n_layer layers is differentiated with checkpoints,
    given in-place updates, ordered and packed into buffers: the work, counted, not timed."""
    from ggwgpu.backends.base import Plan
    from ggwgpu.models import ModelConfig, build_train_graph, init_parameters
    cfg = ModelConfig(n_vocab=16, n_embd=8, n_head=2, n_layer=n_layer, n_ff=8, n_ctx=4)
    g = build_train_graph(cfg, init_parameters(cfg), batch=1)
    events = 0

    def count(frame, event, arg):
        nonlocal events
        events += frame.f_code.co_filename.startswith(PACKAGE)
    sys.setprofile(count)
    try:
        grads = gg.build_backward(g.loss, list(g.params.values()), checkpoints=g.checkpoints)
        hparams = gg.input_tensor((4,))
        updates = [gg.opt_step_sgd(p, d, hparams, True) for p, d in grads.items()]
        Plan([g.loss, *updates]).storage_layout()
    finally:
        sys.setprofile(None)
    return events


def test_planning_work_grows_linearly_with_depth():
    # 8x the layers: 8x the work. A scan of the graph per in-place update and a look at
    # every buffer per block made it 32x.
    ratio = planning_work(32) / planning_work(4)
    assert 6 < ratio < 10, ratio


def test_recompute_gives_the_same_gradients_from_a_recomputed_value():
    """y = w x, recomputed for the backward instead of kept: the same gradient, and the
    backward reads a copy of y (and of its user soft_max, whose backward needs its output),
    so the forward's y can die as soon as the forward is done with it."""
    x = gg.input_tensor((4, 3), name="x")
    w = gg.param(np.random.default_rng(0).uniform(-1, 1, (5, 3)), name="w")
    y = gg.mul_mat(w, x)
    loss = gg.sum(gg.mul(gg.soft_max(y, 1.0), gg.constant(np.arange(20.0).reshape(4, 5))))
    feeds = {x: np.random.default_rng(1).uniform(-1, 1, (4, 3))}
    kept, redone = gg.build_backward(loss, [w]), gg.build_backward(loss, [w], recompute=[y])
    backend = NumpyBackend(np.float64)
    np.testing.assert_allclose(*backend.compute([kept[w], redone[w]], feeds), rtol=1e-14)
    backward = gg.topo_order([redone[w]])
    assert [n.op for n in backward].count("mul_mat") == 1 and y not in backward
    assert y in gg.topo_order([kept[w]])
