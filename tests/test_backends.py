"""What the backends do beyond the op matrix: the wgpu encode loop and readback, device
timing, the NumPy backend's fast kernels against the references, the planner's memory
report."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu import testing
from ggwgpu.backends import NumpyBackend
from ggwgpu.backends.numpy_backend import Pieces
from ggwgpu.ops import OPS


def small_graph():
    """A few dispatches with several pipelines, a repeated one and a strided view."""
    x, w = gg.input_tensor((6, 8), name="x"), gg.input_tensor((8,), name="w")
    h = gg.rms_norm_mul(x, w, 1e-5)
    y = gg.swiglu(h, gg.exp(gg.exp(h)))
    z = gg.transpose(gg.add(gg.scale(gg.transpose(y), 2.0), gg.input_tensor((8, 1), name="b")))
    return x, w, y, z


def random_feeds(outputs, seed):
    """Values in [-1, 1) for every leaf below `outputs`."""
    rng = np.random.default_rng(seed)
    return {t: rng.uniform(-1, 1, t.shape).astype(np.float32)
            for t in gg.graph.topo_order(outputs) if t.op is None}


def test_direct_calls_and_the_wgpu_py_api_record_the_same_step(wgpu):
    x, w, y, z = small_graph()
    feeds = random_feeds([z], 0)
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


def test_the_direct_calls_are_the_path_in_use_here(wgpu, monkeypatch):
    """With this wgpu-py (the pinned range) the encode loop records through wgpu-native's C
    functions: each dispatch goes through them, none through the public calls."""
    from ggwgpu.backends import wgpu_direct
    assert wgpu_direct.CALLS is not None, wgpu_direct.WHY_NOT
    x, w, y, z = small_graph()
    plan = wgpu.plan([y, z])
    (commands, handles), = plan._parts_of(None, whole=True)
    assert plan.direct_calls and len(handles) == len(plan.dispatches)
    set_pipeline, set_group, dispatch, null = wgpu_direct.CALLS
    counted = []

    def counting(*args):
        counted.append(args[1:])
        dispatch(*args)
    monkeypatch.setattr(wgpu_direct, "CALLS", (set_pipeline, set_group, counting, null))
    cls = type(wgpu.device.create_command_encoder().begin_compute_pass())
    monkeypatch.setattr(cls, "dispatch_workgroups", lambda *a: pytest.fail("public call"))
    plan.run()
    assert counted == [(gx, gy, 1) for _, _, gx, gy in commands]


@pytest.mark.parametrize("direct", [True, False])
def test_a_run_submitted_in_parts_computes_what_one_pass_does(wgpu, monkeypatch, direct):
    """run() submits the dispatches in parts on hardware adapters (the device starts while
    the host records); each part sets its pipelines anew: cut after every dispatch or two,
    the results are those of the one pass that device_seconds records."""
    from ggwgpu.backends import wgpu_backend
    assert [list(r) for r in wgpu_backend.submit_parts(600)] == [
        list(range(0, 64)), list(range(64, 320)), list(range(320, 576)),
        list(range(576, 600))]
    assert wgpu_backend.submit_parts(10) == [range(0, 10)] and wgpu_backend.submit_parts(0) == []
    x, w, y, z = small_graph()
    feeds = random_feeds([z], 1)
    whole = wgpu.plan([y, z])
    whole.device_seconds(feeds)
    monkeypatch.setattr(wgpu_backend, "SUBMIT_FIRST", 1)
    monkeypatch.setattr(wgpu_backend, "SUBMIT_EVERY", 2)
    parts = wgpu.plan([y, z])
    parts.direct_calls = direct and parts.direct_calls
    parts.run(feeds, parts=True)
    assert len(parts._parts_of(None, whole=False)) == 1 + len(parts.dispatches) // 2
    for a, b in zip(whole.read_many([y, z]), parts.read_many([y, z])):
        np.testing.assert_array_equal(a, b)


def test_without_the_private_api_the_public_calls_take_over_and_say_so_once(monkeypatch):
    """A wgpu-py whose _api lacks the functions: the capability check says why, plans
    record through the public calls, and the warning comes once."""
    import sys
    import types
    from ggwgpu.backends import wgpu_direct
    monkeypatch.setitem(sys.modules, "wgpu.backends.wgpu_native._api",
                        types.ModuleType("renamed"))
    calls, why = wgpu_direct.capability()
    assert calls is None and "ImportError" in why
    monkeypatch.setattr(wgpu_direct, "CALLS", None)
    monkeypatch.setattr(wgpu_direct, "_warned", False)
    with pytest.warns(RuntimeWarning, match="public API") as seen:
        wgpu_direct.fall_back(why)
        wgpu_direct.fall_back(why)
    assert len(seen) == 1
    assert wgpu_direct.native_handles([(None, object(), 1, 1)]) is None


def test_the_fallback_path_gives_the_same_results(wgpu, monkeypatch):
    from ggwgpu.backends import wgpu_direct
    x, w, y, z = small_graph()
    feeds = random_feeds([z], 4)
    direct = wgpu.plan([y, z])
    direct.run(feeds)
    monkeypatch.setattr(wgpu_direct, "CALLS", None)
    public = wgpu.plan([y, z])
    assert direct.direct_calls and not public.direct_calls
    public.run(feeds)
    for a, b in zip(direct.read_many([y, z]), public.read_many([y, z])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("direct", [True, False])
def test_an_invalid_dispatch_raises_on_either_path(wgpu, direct):
    """A grid past the 65535-workgroup limit is a Python error (wgpu's validation error)
    on the direct calls as on the public ones, not a silent no-op."""
    import wgpu as wgpu_py
    x = gg.input_tensor((100,))
    plan = wgpu.plan([gg.exp(x)])
    plan.direct_calls = direct and plan.direct_calls
    assert plan.direct_calls == direct
    plan.recorded = [(p, g, (70000, 1)) for p, g, _ in plan.recorded]
    plan._prepare_commands()
    with pytest.raises(wgpu_py.GPUValidationError, match="65535"):
        plan.run({x: np.ones(100, np.float32)})


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


@pytest.mark.parametrize("clock", ["device", "host"])
def test_profile_times_each_dispatch_and_computes_the_run(wgpu, monkeypatch, clock):
    """profile() runs every dispatch once, in order, as run() does: by timestamp queries in
    chunks of passes (2 here, so several submits) or by a submit and a wait each."""
    from ggwgpu.backends import wgpu_backend
    if clock == "device" and not wgpu.has_timestamps:
        pytest.skip("the adapter has no timestamp queries (the host clock is tested)")
    monkeypatch.setattr(wgpu, "has_timestamps", clock == "device")
    monkeypatch.setattr(wgpu_backend, "PROFILE_PASSES", 2)
    x, w, y, z = small_graph()
    plan = wgpu.plan([z])
    feeds = {x: np.ones((6, 8), np.float32), w: np.ones(8, np.float32)}
    times = plan.profile(feeds)
    assert plan.profile_clock == clock
    assert [k for k, _ in times] == [f"{stem}:{d.entry}" for stem, d in plan.dispatches]
    assert len(times) > 2 and all(0 <= s < 60 for _, s in times)
    assert sum(s for _, s in times) > 0
    np.testing.assert_allclose(plan.read(z), NumpyBackend().compute([z], feeds)[0], rtol=1e-5)


def test_timestamps_count_nanoseconds_by_the_queue_s_period(wgpu, monkeypatch):
    """Ticks times the queue's period: one pass's time scales with a period 1000 times
    longer (the ticks themselves differ from run to run, so only the order is checked)."""
    if not wgpu.has_timestamps:
        pytest.skip("the adapter has no timestamp queries")
    assert wgpu.timestamp_period > 0
    x, w, y, z = small_graph()
    plan = wgpu.plan([y])
    feeds = {x: np.ones((6, 8), np.float32), w: np.ones(8, np.float32)}
    plan.device_seconds(feeds)
    seconds = min(plan.device_seconds() for _ in range(3))
    monkeypatch.setattr(wgpu, "timestamp_period", wgpu.timestamp_period * 1000)
    assert min(plan.device_seconds() for _ in range(3)) > 10 * seconds


FAST = [(name, case) for name in sorted(OPS) if OPS[name].fast
        for case in testing.cases_of(name)]


@pytest.mark.parametrize("name,case", FAST,
                         ids=[f"{n}[{testing.describe(c)}]" for n, c in FAST])
def test_numpy_fast_kernels_equal_the_references(name, case):
    """Every fast kernel against its op's reference on each of the op's cases: float64 to
    rounding, float32 within the op's bound; the result and every leaf (an update's moments)
    alike, and nothing written outside them."""
    opdef = OPS[name]
    leaves, values, node = testing.build_case(opdef, case, np.random.default_rng(0))
    for dtype in (np.float64, np.float32):
        feeds = values if dtype == np.float64 else testing.as_f32(values)
        results = []
        for fast in (False, True):
            plan = NumpyBackend(dtype, fast=fast).plan([node], sentinel=testing.SENTINEL)
            plan.run(feeds)
            assert not plan.stray_writes()
            results.append([plan.read(t) for t in (node, *leaves) if not t.is_quantized])
        for ref, got in zip(*results, strict=True):
            if dtype == np.float64:
                scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=1.0))
                np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-13 * scale)
            else:
                ok, detail = testing.compare(got, ref, case.nmse or opdef.nmse)
                assert ok, detail


SPLIT = [(name, case) for name, case in FAST if OPS[name].split]


def cut_nodes(plan) -> int:
    return sum(isinstance(kernel, Pieces) for kernel, *_ in plan.steps)


@pytest.mark.parametrize("name,case", SPLIT,
                         ids=[f"{n}[{testing.describe(c)}]" for n, c in SPLIT])
def test_numpy_threads_give_the_unthreaded_result_bit_for_bit(name, case):
    """Every fast kernel its op lets cut, on each of the op's cases cut into pieces along the
    first dim (2 and 3 threads, every size cut), against the kernel run whole: the result and
    every leaf equal to the bit, nothing written outside them."""
    opdef = OPS[name]
    leaves, values, node = testing.build_case(opdef, case, np.random.default_rng(0))
    cut = opdef.split(node.shape, *(s.shape for s in node.srcs))
    for dtype in (np.float64, np.float32):
        feeds = values if dtype == np.float64 else testing.as_f32(values)
        results = []
        for threads in (1, 2, 3):
            plan = NumpyBackend(dtype, threads=threads, split_min=0).plan(
                [node], sentinel=testing.SENTINEL)
            assert cut_nodes(plan) == (threads > 1 and cut is not None and node.shape[0] > 1)
            plan.run(feeds)
            assert not plan.stray_writes()
            results.append([plan.read(t) for t in (node, *leaves) if not t.is_quantized])
        for whole, *pieces in zip(*results, strict=True):
            for got in pieces:
                np.testing.assert_array_equal(got, whole)


def test_each_op_with_a_split_rule_has_a_case_that_is_cut():
    """So that the test above proves something for every such op."""
    for name in dict(SPLIT):
        nodes = [testing.build_case(OPS[name], c, np.random.default_rng(0))[2]
                 for n, c in SPLIT if n == name]
        assert any(node.shape[0] > 1 and OPS[name].split(node.shape, *(s.shape for s in
                                                                         node.srcs))
                   for node in nodes), name


def test_split_rows_cuts_what_lines_up_and_refuses_what_does_not():
    from ggwgpu.ops.registry import split_rows
    rule = split_rows()
    assert rule((8, 4, 5), (8, 4, 5), (8, 1, 5)) == (0, 0)
    assert rule((8, 4, 5), (8, 4, 5), (4, 5)) == (0, None)      # broadcast: fewer dims
    assert rule((8, 4, 5), (8, 4, 5), (1, 4, 5)) == (0, None)   # broadcast: size 1
    assert rule((8, 4, 5), (8, 4, 5), (2, 4, 5)) is None            # tiled 4 times: no cut
    assert split_rows(keep=1)((6,), (6,)) is None                   # a single row
    assert split_rows(keep=1, rows=(1,), whole=(2,))((6, 9), (6, 9), (6,), (1,)) == (
        0, 0, None)
    assert split_rows(whole=(1,))((8,), (8,), (8,)) == (0, None)


def test_a_llama_step_on_threads_is_the_unthreaded_step_bit_for_bit():
    """Whole training steps (forward, backward, clipping, AdamW) of a small llama, every node
    that may be cut cut into pieces, give the same losses and weights as on one thread."""
    from ggwgpu import data
    from ggwgpu.models import ModelConfig, init_parameters
    from ggwgpu.training import Trainer, TrainOptions
    cfg = ModelConfig(n_vocab=64, n_embd=32, n_head=4, n_layer=2, n_ff=48, n_ctx=16)
    tokens = np.random.default_rng(0).integers(0, 64, 4000).astype(np.int32)
    results = []
    for threads in (1, 2):
        options = TrainOptions(batch=4, lr=3e-3, warmup=2)
        samples = data.Samples(tokens, cfg.n_ctx, options.batch, options.seed, 0)
        t = Trainer(cfg, init_parameters(cfg, seed=1),
                    NumpyBackend(threads=threads, split_min=0), options, samples)
        assert (cut_nodes(t.plan) > 10) == (threads > 1)
        losses = [t.train_step()["loss"] for _ in range(3)]
        results.append((losses, t.parameters()))
    (losses1, params1), (losses2, params2) = results
    assert losses1 == losses2
    for name, value in params1.items():
        np.testing.assert_array_equal(params2[name], value, err_msg=name)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_an_error_in_a_piece_is_the_error_of_the_whole_node(threads):
    """An id out of range in the last rows, which a helper thread's piece reads: the run
    raises what one thread raises, after every piece has ended."""
    x = gg.input_tensor((8, 5), name="x")
    ids, w = gg.input_tensor((8,), "i32", name="ids"), gg.input_tensor((8,), name="w")
    grad = gg.cross_entropy_ids_back(x, ids, w, gg.input_tensor((1,), name="d"))
    plan = NumpyBackend(threads=threads, split_min=0).plan([grad])
    assert cut_nodes(plan) == (threads > 1)
    bad = np.array([0, 1, 2, 3, 4, 0, 1, 9], np.int32)
    with pytest.raises(IndexError, match="id 9 out of range for a table of 5 rows"):
        plan.run({x: np.zeros((8, 5), np.float32), ids: bad, w: np.ones(8, np.float32)})


def test_numpy_threads_come_from_the_environment_or_the_cores(monkeypatch):
    from ggwgpu.backends.numpy_backend import THREADS_VAR, default_threads
    monkeypatch.setenv(THREADS_VAR, "3")
    assert default_threads() == 3 and NumpyBackend().threads == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_VAR, bad)
        with pytest.raises(ValueError, match=f"{THREADS_VAR} must be a positive"):
            NumpyBackend()
    monkeypatch.delenv(THREADS_VAR)
    assert default_threads() >= 1
    big, small = (gg.soft_max(gg.input_tensor((2, n, n)), 1.0) for n in (300, 30))
    assert cut_nodes(NumpyBackend(threads=2).plan([big, small])) == 1    # split_min
    assert cut_nodes(NumpyBackend(threads=1).plan([big, small])) == 0


def test_numpy_fast_adamw_takes_the_reference_where_a_gradient_is_not_finite():
    rng = np.random.default_rng(3)
    w, grad, m, v = (gg.param(rng.uniform(0.1, 1, (4, 6)).astype(np.float32)) for _ in range(4))
    hp = gg.input_tensor((9,), name="hparams")
    step = gg.opt_step_adamw(w, grad, m, v, hp, True)
    g = rng.normal(size=(4, 6))
    g.flat[[1, 9]] = [np.nan, np.inf]
    results = []
    for fast in (False, True):
        plan = NumpyBackend(np.float64, fast=fast).plan([step])
        plan.run({grad: g, hp: [1e-2, 0.9, 0.999, 1e-8, 0.1, 10, 1000, 1, 0.5]})
        results.append([plan.read(t) for t in (w, m, v)])
    for ref, got in zip(*results, strict=True):
        np.testing.assert_array_equal(got, ref)
        assert np.isfinite(got).all()


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_each_backend_declares_what_it_offers(backend_name, request):
    """Backend's capabilities, set by each backend with the declared types: the NumPy
    backend emulates halves and has no device limits or kernel variants; wgpu's come from
    its adapter (lavapipe has shader-f16 and a 128 MiB binding limit)."""
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    declared = gg.backends.Backend.__annotations__
    assert {"has_f16", "emulates_f16", "storage_limits", "kernel_variants", "info"} <= \
        set(declared)
    assert all(isinstance(getattr(backend, n), bool) for n in ("has_f16", "emulates_f16"))
    assert isinstance(backend.info["device"], str) and backend.info["device"]
    limits, variants = backend.storage_limits, backend.kernel_variants
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in limits.items())
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in variants.items())
    if backend_name == "numpy":
        assert (backend.has_f16, backend.emulates_f16, limits, variants) == (False, True, {}, {})
    else:
        assert not backend.emulates_f16 and backend.has_f16 == ("shader-f16" in
                                                                 backend.device.features)
        assert set(limits) == {"max-storage-buffer-binding-size", "max-buffer-size"}
        assert set(variants) == {"matmul", "quant", "norm", "softmax"}
        assert backend.info["device"] == backend.adapter.info["device"]


def test_memory_report_sorts_the_planned_bytes_by_role():
    p = gg.param(np.ones((4, 8), np.float32), name="p")
    x = gg.input_tensor((3, 8), name="x")
    loss = gg.sum(gg.sqr(gg.mul_mat(p, x)))
    grad = gg.graph.build_backward(loss, [p])[p]
    m, v = (gg.constant(np.zeros((4, 8), np.float32)) for _ in range(2))
    hp = gg.input_tensor((9,), name="hparams")
    plan = NumpyBackend().plan([loss, gg.opt_step_adamw(p, grad, m, v, hp, True)])
    memory = plan.memory()
    assert memory["weights"] == memory["gradients"] == 4 * 32
    assert memory["state"] >= 2 * 4 * 32
    assert memory["inputs"] == 4 * (24 + 9)
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
    feeds = random_feeds([z, u], 1)
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


# -- the Params uniform block: one layout, common.wgsl's struct --------------------------------

def echo_params(wgpu, uniforms: np.ndarray, n_words: int) -> np.ndarray:
    """Run a kernel that writes every Params field, by name, into dst (u32 fields as
    f32(x)): what the shader reads where the backend wrote `uniforms`."""
    import wgpu as wgpu_py
    from ggwgpu.backends.wgpu_backend import SRC0_PARTS
    from ggwgpu.wgsl import MAX_SRCS, dtype_prelude, shader_dir
    fields = (["p.n", *(f"p.off[{i}]" for i in range(4)), "p.off3.x"]
              + [f"p.{k}_{t}[{i}]" for t in "d0123" for k in ("ne", "nb") for i in range(4)]
              + [f"p.u[{i}]" for i in range(4)])
    body = "\n".join(f"    dst[{j}] = f32({x});" for j, x in enumerate(fields))
    body += "\n" + "\n".join(f"    dst[{len(fields) + i}] = p.f[{i}];" for i in range(4))
    code = (dtype_prelude() + (shader_dir() / "common.wgsl").read_text()
            + f"\n@compute @workgroup_size(1)\nfn k_echo() {{\n{body}\n}}\n")
    device = wgpu.device
    pipeline = device.create_compute_pipeline(
        layout=wgpu.pipeline_layout,
        compute={"module": device.create_shader_module(code=code), "entry_point": "k_echo"})
    uniform = device.create_buffer_with_data(data=uniforms, usage=wgpu_py.BufferUsage.UNIFORM)
    out = device.create_buffer(size=4 * n_words, usage=wgpu_py.BufferUsage.STORAGE
                               | wgpu_py.BufferUsage.COPY_SRC)
    entries = [{"binding": 0, "resource": {"buffer": uniform, "offset": 0,
                                           "size": uniforms.nbytes}},
               {"binding": 1, "resource": {"buffer": out, "offset": 0, "size": out.size}}]
    entries += [{"binding": b, "resource": {"buffer": wgpu.dummy, "offset": 0, "size": 16}}
                for b in range(2, 2 + MAX_SRCS + SRC0_PARTS - 1)]
    group = device.create_bind_group(layout=wgpu.bind_group_layout, entries=entries)
    encoder = device.create_command_encoder()
    cpass = encoder.begin_compute_pass()
    cpass.set_pipeline(pipeline)
    cpass.set_bind_group(0, group)
    cpass.dispatch_workgroups(1, 1, 1)
    cpass.end()
    device.queue.submit([encoder.finish()])
    assert len(fields) + 4 == n_words
    return np.frombuffer(device.queue.read_buffer(out), np.float32)


def test_the_params_block_is_where_the_shader_reads_it(wgpu):
    """The backend writes each dispatch's values at the words common.wgsl's struct Params
    gives its fields: a kernel that reads every field by name sees them all."""
    from ggwgpu.ops.registry import Dispatch
    base = gg.input_tensor((10, 10))
    tensors = [gg.input_tensor((2, 3, 4, 5)),
               gg.permute(gg.input_tensor((5, 4, 3, 2)), (3, 2, 1, 0)),
               gg.view(base, (3, 4), (10, 1), 7), gg.input_tensor((9,)),
               gg.view(gg.input_tensor((6, 7, 8)), (2, 7, 8), (56, 8, 1), 56)]
    d = Dispatch("echo", tensors[0], tuple(tensors[1:]), n=1234, f=(0.5, -2.0, 3.25, 1e-5),
                 u=(7, 8, 9, 10))
    plan = wgpu.plan([gg.exp(tensors[3])], sentinel=3)
    uniforms = plan._uniforms(d)
    seen = echo_params(wgpu, uniforms, 1 + 5 + 5 * 8 + 4 + 4)
    want = ([1234] + [plan.sentinel + t.offset for t in tensors]
            + [x for t in tensors for x in (*t.ne, *t.nb)] + [7, 8, 9, 10])
    np.testing.assert_array_equal(seen[:len(want)], np.float32(want))
    np.testing.assert_array_equal(seen[len(want):], np.float32(d.f))


def test_params_layout_follows_the_wgsl_struct_and_refuses_what_it_cannot_fill():
    from ggwgpu.backends.wgpu_backend import PARAMS, UNIFORM_SIZE
    from ggwgpu.wgsl import params_layout, shader_dir
    source = (shader_dir() / "common.wgsl").read_text()
    assert params_layout(source) == (PARAMS, UNIFORM_SIZE) and UNIFORM_SIZE == 240
    # reorder two fields: the words move with them
    swapped = source.replace("    f: vec4f,", "    TMP").replace("    u: vec4u,", "    f: vec4f,") \
        .replace("    TMP", "    u: vec4u,")
    words, size = params_layout(swapped)
    assert (words["u"], words["f"], size) == (PARAMS["f"], PARAMS["u"], UNIFORM_SIZE)
    with pytest.raises(ValueError, match="Params needs field off3: vec4u"):
        params_layout(source.replace("    off3: vec4u,\n", ""))
    with pytest.raises(ValueError, match="Params.f has type mat4x4f"):
        params_layout(source.replace("    f: vec4f,", "    f: mat4x4f,"))


# -- constants shared between the plans of a backend -----------------------------------------

def storage_of(plan, t):
    """The backend object that holds t's storage in `plan`: a NumPy block or a wgpu buffer."""
    if isinstance(plan, gg.backends.numpy_backend.NumpyPlan):
        return plan.storage[id(t.storage)]
    return plan.places[id(t.storage)][0]


def sharing_graph(w_value, p_value):
    """A constant weight w, a param p, an input x and a constant `cache` a node writes (cpy):
    y = w x + p x, and cache <- y."""
    w, p = gg.constant(w_value, name="w"), gg.param(p_value, name="p")
    x = gg.input_tensor((3, 4), name="x")
    cache = gg.constant(np.zeros((3, 5), np.float32), name="cache")
    y = gg.add(gg.mul_mat(w, x), gg.mul_mat(p, x))
    return w, p, x, cache, gg.cpy(y, cache)


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_plans_share_the_constants_they_never_write_and_nothing_else(backend_name, request):
    import gc
    import weakref
    from ggwgpu.backends.base import planned_bytes
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    rng = np.random.default_rng(5)
    w_value, p_value = (rng.uniform(-1, 1, (5, 4)).astype(np.float32) for _ in range(2))
    x_value = rng.uniform(-1, 1, (3, 4)).astype(np.float32)
    graphs = [sharing_graph(w_value, p_value) for _ in range(2)]   # twice from the same arrays
    plans = [backend.plan([g[-1]]) for g in graphs]
    (w1, p1, x1, c1, _), (w2, p2, x2, c2, _) = graphs
    # the weight is held once; the param, the input and the written constant are each plan's
    assert storage_of(plans[0], w1) is storage_of(plans[1], w2)
    for a, b in ((p1, p2), (x1, x2), (c1, c2)):
        assert storage_of(plans[0], a) is not storage_of(plans[1], b)
    assert [id(t) for t in (w1, p1, x1, c1) if id(t) in plans[0].constant_keys] == [id(w1)]
    shared = weakref.ref(plans[0].constants[id(w1)])
    # memory: the weight counts in each plan's planned bytes and once in the sum of both
    m = [plan.memory() for plan in plans]
    assert m[0]["shared"] == m[1]["shared"] == w_value.nbytes
    assert planned_bytes(plans) == m[0]["planned"] + m[1]["planned"] - w_value.nbytes
    expected = x_value @ (w_value + p_value).T
    for plan, g in zip(plans, graphs):
        plan.run({g[2]: x_value})
        np.testing.assert_allclose(plan.read(g[-1]), expected, rtol=1e-5)
    # a write gives the writer its own copy; the other plan keeps the shared value
    plans[0].write(w1, 2 * w_value)
    assert storage_of(plans[0], w1) is not storage_of(plans[1], w2)
    assert plans[0].memory()["shared"] == 0 and plans[1].memory()["shared"] == w_value.nbytes
    for plan, g, w in zip(plans, graphs, (2 * w_value, w_value)):
        plan.run({g[2]: x_value})
        np.testing.assert_allclose(plan.read(g[-1]), x_value @ (w + p_value).T, rtol=1e-5)
    # the shared storage lives as long as a plan uses it
    third = backend.plan([graphs[0][-1]])
    assert storage_of(third, w1) is storage_of(plans[1], w2)
    del plans[1], plan
    gc.collect()
    third.run({x1: x_value})
    np.testing.assert_allclose(third.read(graphs[0][-1]), expected, rtol=1e-5)
    assert shared() is not None
    del third
    gc.collect()
    assert shared() is None
    if backend_name == "numpy":
        assert len(backend.constants) == 0


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_the_gradients_of_chunked_views_share_one_zeros_constant(backend_name, request):
    """Each chunk's view backward scatters its gradient into zeros of the whole shape: all
    those zeros are one array, stored once and counted once; the gradient is right."""
    from ggwgpu.graph import build_backward
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    p = gg.param(np.arange(24, dtype=np.float32).reshape(6, 4), name="p")
    chunks = [gg.view(p, (2, 4), (4, 1), 8 * i) for i in range(3)]
    loss = None
    for i, c in enumerate(chunks):
        term = gg.sum(gg.scale(gg.sqr(c), float(i + 1)))
        loss = term if loss is None else gg.add(loss, term)
    grad = build_backward(loss, [p])[p]
    plan = backend.plan([loss, grad])
    zeros = [t for t in plan.roots if t.name == "zeros"]
    assert len(zeros) == 3 and len({id(t.value) for t in zeros}) == 1
    assert len({id(storage_of(plan, t)) for t in zeros}) == 1
    m = plan.memory()
    others = sum(plan.nbytes(t) for t in plan.roots
                 if id(t) in plan.constant_keys and t.name != "zeros")    # the loss's seed
    assert m["state"] == m["shared"] == 6 * 4 * 4 + others
    plan.run()
    weights = np.repeat([1, 2, 3], 2)[:, None]
    np.testing.assert_allclose(plan.read(grad), 2 * weights * p.value, rtol=1e-6)


def test_sentinels_turn_constant_sharing_off():
    backend = NumpyBackend()
    w_value = np.ones((5, 4), np.float32)
    plans = [backend.plan([sharing_graph(w_value, w_value)[-1]], sentinel=4) for _ in range(2)]
    assert not plans[0].constant_keys and len(backend.constants) == 0
    assert plans[0].memory()["shared"] == 0


def test_numpy_plans_share_a_frozen_weight_s_dequantized_values():
    from ggwgpu.quant import quantize
    backend = NumpyBackend()
    value = quantize(np.random.default_rng(3).uniform(-1, 1, (6, 32)), "q8_0")
    x = gg.input_tensor((2, 32), name="x")
    graphs = [gg.mul_mat(gg.constant(value, name="w"), x) for _ in range(2)]
    plans = [backend.plan([y]) for y in graphs]
    dense = [plan.dense[id(y.srcs[0].storage)] for plan, y in zip(plans, graphs)]
    assert dense[0] is dense[1] and len(backend.constants) == 1
