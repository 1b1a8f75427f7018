"""The op matrix, generated from the registry: every op x its cases, on the device against
the NumPy reference, and every backward against finite differences and across backends."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu import testing
from ggwgpu.kernels import (MATMUL_ENV, ROW_FAMILIES, ROW_VARIANTS, ROWWISE_MAX,
                            matmul_variant, row_module, row_variant)
from ggwgpu.ops import OPS
from ggwgpu.ops.registry import f32_only_ops
from ggwgpu.ops.reduce import SUM_SPAN
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.graph import build_backward
from ggwgpu.wgsl import kernel_name, shader_source

# The ops whose every kernel variant runs below in f32 and f16 (the matmuls, the row ops),
# and the quantized products, whose variants tests/test_quant.py runs (in f32): the plain
# forward matrices leave them to those, which run the adapter's own variant among the others.
ALL_VARIANTS = {"mul_mat", "mul_mat_acc", "out_prod",
                *(name for name in OPS if OPS[name].variants == ROW_VARIANTS)}
QUANT_VARIANTS = {"mul_mat_q", "mul_mat_q_back"}
FORWARD = [(name, case) for name in sorted(OPS) if name not in ALL_VARIANTS | QUANT_VARIANTS
           for case in testing.cases_of(name)]
GRAD = [(name, case) for name in sorted(OPS) for case in testing.cases_of(name, grad_only=True)]


def case_id(item):
    name, case = item
    return f"{name}[{testing.describe(case)}]"


@pytest.mark.parametrize("name,case", FORWARD, ids=[case_id(c) for c in FORWARD])
def test_forward_matches_reference(wgpu, name, case):
    result = testing.forward(OPS[name], case, wgpu)
    assert result.ok, result.detail


@pytest.mark.parametrize("name,case", GRAD, ids=[case_id(c) for c in GRAD])
def test_backward_matches_finite_differences(name, case):
    result = testing.finite_differences(OPS[name], case)
    assert result.ok, result.detail


@pytest.mark.parametrize("name,case", GRAD, ids=[case_id(c) for c in GRAD])
def test_device_backward_matches_numpy(wgpu, name, case):
    result = testing.backward_on(OPS[name], case, wgpu)
    assert result.ok, result.detail


F16_FORWARD = [(name, case) for name in sorted(OPS) if name not in ALL_VARIANTS
               for case in testing.f16_cases_of(name)]
F16_GRAD = [(name, case) for name in sorted(OPS)
            for case in testing.f16_cases_of(name, grad_only=True)]
# The ops without an f16 kernel, as declared in the registry (register(..., f16=False)).
F32_ONLY = ["opt_step_adamw", "opt_step_sgd"]


@pytest.mark.parametrize("name,case", F16_FORWARD, ids=[case_id(c) for c in F16_FORWARD])
def test_f16_forward_matches_reference(wgpu, name, case):
    """Every float input an f16 tensor: against the float64 reference on the rounded inputs."""
    result = testing.forward(OPS[name], case, wgpu, half=True)
    assert result.ok, result.detail


@pytest.mark.parametrize("name,case", F16_GRAD, ids=[case_id(c) for c in F16_GRAD])
def test_f16_device_backward_matches_numpy(wgpu, name, case):
    result = testing.backward_on(OPS[name], case, wgpu, half=True)
    assert result.ok, result.detail


def test_the_ops_without_an_f16_kernel_are_the_declared_ones():
    assert f32_only_ops() == F32_ONLY
    assert all(testing.f16_cases_of(name) for name in OPS if name not in F32_ONLY
               and any(i.dtype == "f32" for c in OPS[name].cases() for i in c.inputs))
    h = gg.input_tensor((4,), "f16")
    with pytest.raises(gg.ShapeError, match="opt_step_sgd.*no f16 kernel"):
        gg.opt_step_sgd(h, h, gg.input_tensor((4,)), 0.0)


def test_float_results_are_f16_only_when_every_float_source_is():
    h, f = gg.input_tensor((2, 8), "f16"), gg.input_tensor((2, 8))
    ids = gg.input_tensor((2,), "i32")
    assert gg.add(h, h).dtype == "f16" and gg.add(h, f).dtype == "f32"
    assert gg.mul_mat(h, h).dtype == "f16" and gg.mul_mat(h, f).dtype == "f32"
    assert gg.get_rows(h, ids).dtype == "f16"          # ids do not count
    assert gg.rope(gg.reshape(h, (2, 2, 4)), ids, 4, "normal", 10000.0, 1.0).dtype == "f16"
    assert gg.sum(h).dtype == "f32"                     # losses are f32
    assert gg.cross_entropy_loss(h, h).dtype == "f32"
    assert gg.reshape(h, (16,)).dtype == "f16" and gg.cpy(f, h).dtype == "f16"
    assert gg.cast(f, "f16").dtype == "f16" and gg.cast(h, "f32").dtype == "f32"
    with pytest.raises(gg.ShapeError, match="cast.*casts to one of f32, f16"):
        gg.cast(f, "i32")


@pytest.mark.parametrize("n", [7, SUM_SPAN + 5], ids=["one span", "two spans"])
def test_a_sum_of_squares_is_not_finite_when_an_element_or_its_square_is_not(wgpu, n):
    """The trainer's finite flag reads the clip's sum of squares: an element of 1e20 (finite,
    its square beyond f32), an infinity or a NaN, or a non-finite accumulator, must make it
    inf or NaN on the device and on both NumPy kernels, in one dispatch and in two (and in
    add_sum_sqr3's, the bad element in its second tensor)."""
    a, acc = gg.input_tensor((n,)), gg.input_tensor((1,))
    nodes = [gg.sum_sqr(a), gg.add_sum_sqr(acc, a)]
    if n <= SUM_SPAN:
        zeros = gg.constant(np.zeros(3, np.float32))
        nodes.append(gg.add_sum_sqr3(acc, zeros, a, zeros))
    backends = (wgpu, NumpyBackend(), NumpyBackend(fast=False))
    plans = [backend.plan(nodes) for backend in backends]
    for bad, start, want in ((1e20, 1.0, np.inf), (-1e20, 1.0, np.inf), (-np.inf, 1.0, np.inf),
                             (np.nan, 1.0, np.nan), (0.5, np.inf, None), (0.5, np.nan, None)):
        values = np.full(n, 0.5, np.float32)
        values[n // 2] = bad
        for backend, plan in zip(backends, plans):
            plan.run({a: values, acc: np.array([start], np.float32)})
            got = [plan.read(node)[0] for node in nodes]
            expected = [want if want is not None else n * 0.25] + [
                want if want is not None else start] * (len(nodes) - 1)
            for node, g, e in zip(nodes, got, expected):
                label = f"{backend.name} {node.op} of {bad} with acc {start}"
                if np.isnan(e):
                    assert np.isnan(g), label
                elif np.isinf(e):
                    assert g == np.inf, label
                else:
                    assert g == pytest.approx(e, rel=1e-6), label


def test_cast_to_f16_rounds_to_nearest_even_and_overflows_to_inf(wgpu):
    """As NumPy's float16 (IEEE): ties to even, subnormals, 65519 -> 65504, 65520 -> inf."""
    values = np.array([65504, 65519, 65520, 1e5, -65520, -1e30, 3.4e38, 1 + 2 ** -11,
                       1 + 3 * 2 ** -11, -(1 + 2 ** -11), 2 ** -24, 2 ** -25, 1.5 * 2 ** -25,
                       np.inf, -np.inf, 0.1, -7.3e-5, 0.0], np.float32)
    x = gg.input_tensor(values.shape)
    half = gg.cast(x, "f16")
    back = gg.cast(half, "f32")
    with np.errstate(over="ignore"):
        want = values.astype(np.float16)
    for backend in (wgpu, NumpyBackend()):
        plan = backend.plan([half, back])
        plan.run({x: values})
        assert plan.read(half).dtype == np.float16
        np.testing.assert_array_equal(plan.read(half), want, err_msg=backend.name)
        np.testing.assert_array_equal(plan.read(back), want.astype(np.float32))


def test_f16_storage_takes_two_bytes_an_element(wgpu):
    x = gg.input_tensor((1000,), "f16")
    y = gg.scale(x, 2.0)
    for backend in (wgpu, NumpyBackend()):
        memory = backend.plan([y]).memory()
        assert memory["inputs"] == 2000 and memory["activations"] == 2000, backend.name


def test_an_f16_dispatch_without_shader_f16_names_the_op_and_feature(wgpu, monkeypatch):
    monkeypatch.setattr(wgpu, "has_f16", False)
    x = gg.input_tensor((3,), "f16")
    with pytest.raises(gg.ShapeError, match="exp .*'shader-f16'"):
        wgpu.plan([gg.exp(x)])


# ops whose backward is zero by definition, which finite differences contradict
ZERO_BACKWARD = {"detach", "top_k"}


def test_detach_passes_its_value_and_no_gradient():
    x = gg.input_tensor((3,), name="x")
    y = gg.sum(gg.add(gg.mul(x, x), gg.detach(gg.mul(x, x))))
    (grad,) = build_backward(y, [x]).values()
    plan = NumpyBackend(np.float64).plan([y, grad])
    plan.run({x: np.array([1.0, 2.0, 3.0])})
    assert plan.read(y)[0] == 28.0
    np.testing.assert_array_equal(plan.read(grad), [2.0, 4.0, 6.0])   # of x * x alone


def test_top_k_breaks_ties_by_column_and_puts_nan_last_as_the_reference(wgpu):
    x = gg.input_tensor((4, 6), name="x")
    values = np.array([[1, 3, 3, 0, 3, -1], [0, 0, 0, 0, 0, 0],
                       [2, np.nan, 5, np.nan, -np.inf, 5], [-0.0, 0.0, 1, -0.0, 7, 7]],
                      np.float32)
    for k in (1, 3, 6):
        node = gg.top_k(x, k)
        plan = wgpu.plan([node])
        plan.run({x: values})
        expected = OPS["top_k"].reference(values, k)
        np.testing.assert_array_equal(plan.read(node), expected)
    assert OPS["top_k"].reference(values, 6)[2].tolist() == [2, 5, 0, 4, 1, 3]


def test_a_router_learns_through_the_probabilities_of_the_experts_it_took():
    """Routing as a mixture of experts does it: ids from top_k (an integer tensor: no
    gradient, though computed from the loss's inputs), the weights they pick as a product
    with one_hot, against finite differences of the whole routed sum."""
    logits = gg.input_tensor((5, 4), name="logits")
    experts = gg.input_tensor((4, 3, 2), name="experts")
    x = gg.input_tensor((5, 1, 2), name="x")
    probs = gg.soft_max(logits, 1.0)
    ids = gg.top_k(probs, 2)
    weights = gg.mul_mat(gg.reshape(probs, (5, 1, 4)), gg.one_hot(ids, 4))      # (5, 2, 1)
    routed = gg.mul_mat_id(experts, x, ids)                                      # (5, 2, 3)
    mixed = gg.mul_mat(gg.transpose(routed), gg.reshape(weights, (5, 1, 2)))     # (5, 1, 3)
    loss = gg.sum(gg.mul(mixed, mixed))
    params = [logits, experts, x]
    grads = build_backward(loss, params)
    rng = np.random.default_rng(0)
    feeds = {t: rng.uniform(-1, 1, t.shape) for t in params}
    plan = NumpyBackend(np.float64).plan([loss, *grads.values()])
    plan.run(feeds)
    forward = NumpyBackend(np.float64).plan([loss])
    for t in params:
        numeric = np.zeros(t.shape)
        for i in np.ndindex(t.shape):
            ends = []
            for step in (1e-6, -1e-6):
                moved = feeds[t].copy()
                moved[i] += step
                forward.run({**feeds, t: moved})
                ends.append(forward.read(loss)[0])
            numeric[i] = (ends[0] - ends[1]) / 2e-6
        np.testing.assert_allclose(plan.read(grads[t]), numeric, atol=1e-6)
        assert np.abs(numeric).max() > 1e-3         # every input moves the loss


@pytest.mark.parametrize("name", sorted(OPS))
def test_registry_entry_is_complete(name):
    """An op without reference, shader entry point, backward or test cases fails here."""
    opdef = OPS[name]
    assert callable(opdef.reference) and callable(opdef.shape)
    assert getattr(gg, name).__doc__, f"{name} has no docstring"
    cases = opdef.cases()
    assert cases, f"{name} has no test cases"
    if opdef.updates:  # optimizer steps are never differentiated (tests/test_optim.py)
        assert opdef.backward is None and not any(c.grad for c in cases)
    else:
        assert callable(opdef.backward)
        differentiable = [i for i in range(opdef.n_srcs) if i not in opdef.no_grad]
        if all(i.dtype != "f32" for c in cases for i in c.inputs):
            # reads only frozen weights and ids (get_rows_q): nothing to differentiate
            assert not differentiable and not any(c.grad for c in cases)
        elif name in ZERO_BACKWARD:
            assert not any(c.grad for c in cases)
        else:
            assert any(c.grad for c in cases), f"{name} has no gradient test case"
            assert differentiable, f"{name} differentiates none of its inputs"
    if opdef.is_view:
        assert opdef.dispatches is None
        return
    home = (row_module(opdef.shader, "workgroup") if opdef.shader in ROW_FAMILIES
            else opdef.shader)   # a row family's file is compiled once per variant
    kernels = {(home, opdef.entry)} | {(d.shader or opdef.shader, d.entry)
                                       for c in cases for d in dispatches_of(opdef, c)}
    for stem, entry in kernels:
        source = shader_source(stem)    # includes resolved, generated kernels in place
        assert re.search(rf"\bfn {kernel_name(entry)}\(", source), \
            f"{name}: no entry point {kernel_name(entry)} in shaders/{stem}.wgsl"


def dispatches_of(opdef, case):
    _, _, node = testing.build_case(opdef, case, np.random.default_rng(0))
    return [d for variant in opdef.variants or (None,)
            for d in opdef.dispatches_on(node, {opdef.shader: variant})]


MATMUL = [(name, case) for name in ("mul_mat", "mul_mat_acc", "out_prod")
          for case in testing.cases_of(name)]


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("variant", OPS["mul_mat"].variants)
@pytest.mark.parametrize("name,case", MATMUL, ids=[case_id(c) for c in MATMUL])
def test_every_matmul_kernel_variant_matches_reference(wgpu, monkeypatch, variant, name, case,
                                                       half):
    """Each adapter runs one vec4 matmul kernel; lavapipe tests them all, on f32 and f16."""
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", variant)
    result = testing.forward(OPS[name], case, wgpu, half=half)
    assert result.ok, result.detail


def test_matmul_variant_follows_the_adapter(monkeypatch):
    monkeypatch.delenv(MATMUL_ENV, raising=False)
    lavapipe = SimpleNamespace(info={"adapter_type": "CPU", "vendor": "llvmpipe"})
    gpu = SimpleNamespace(info={"adapter_type": "DiscreteGPU", "vendor": "nvidia"})
    subgroups, none = SimpleNamespace(features={"subgroup"}), SimpleNamespace(features=set())
    assert matmul_variant(lavapipe, subgroups) == "subgroup"
    assert matmul_variant(lavapipe, none) == "tiled"
    assert matmul_variant(gpu, subgroups) == "tiled"
    monkeypatch.setenv(MATMUL_ENV, "tiled")
    assert matmul_variant(lavapipe, subgroups) == "tiled"
    monkeypatch.setenv(MATMUL_ENV, "fast")
    with pytest.raises(ValueError, match="choose one of tiled, subgroup"):
        matmul_variant(lavapipe, subgroups)


ROW_OPS = [(name, case) for name in sorted(OPS) if OPS[name].variants == ROW_VARIANTS
           for case in testing.cases_of(name)]


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("variant", ROW_VARIANTS)
@pytest.mark.parametrize("name,case", ROW_OPS, ids=[case_id(c) for c in ROW_OPS])
def test_every_row_kernel_variant_matches_reference(wgpu, monkeypatch, variant, name, case,
                                                    half):
    """Each adapter runs one kernel per row op (GPUs 'workgroup', CPUs 'rowwise'); lavapipe
    tests both, on f32 and f16 inputs."""
    monkeypatch.setitem(wgpu.kernel_variants, OPS[name].shader, variant)
    result = testing.forward(OPS[name], case, wgpu, half=half)
    assert result.ok, result.detail


def test_row_variant_follows_the_adapter():
    assert row_variant(SimpleNamespace(info={"adapter_type": "CPU"})) == "rowwise"
    assert row_variant(SimpleNamespace(info={"adapter_type": "DiscreteGPU"})) == "workgroup"
    assert {name for name, _ in ROW_OPS} >= {"soft_max", "soft_max_ext", "soft_max_back",
                                             "rms_norm_mul", "rms_norm_mul_back"}


def test_rows_too_long_for_one_invocation_take_the_workgroup_kernel():
    """lavapipe ends an invocation's loops after about 65534 iterations: rows longer than
    ROWWISE_MAX run the workgroup kernel even where the adapter wants 'rowwise'."""
    def entries(node):
        opdef = OPS[node.op]
        return [d.entry for d in opdef.dispatches_on(node, {opdef.shader: "rowwise"})]
    short, long = (gg.input_tensor((2, n)) for n in (ROWWISE_MAX, ROWWISE_MAX + 1))
    ids, w, ones = gg.input_tensor((2,), "i32"), gg.input_tensor((2,)), gg.input_tensor((1,))
    assert entries(gg.soft_max(short, 1.0)) == ["soft_max_rowwise"]
    assert entries(gg.soft_max(long, 1.0)) == ["soft_max"]
    assert entries(gg.rms_norm_mul(long, gg.input_tensor((ROWWISE_MAX + 1,)), 1e-5)) \
        == ["rms_norm_mul"]
    assert entries(gg.cross_entropy_ids(short, ids, w))[0] == "cross_entropy_ids_rowwise"
    assert entries(gg.cross_entropy_ids(long, ids, w))[0] == "cross_entropy_ids"
    assert entries(gg.cross_entropy_ids_back(long, ids, w, ones)) == ["cross_entropy_ids_back"]
    assert entries(gg.cross_entropy_loss(long, long))[0] == "cross_entropy_loss"


def test_mul_mat_reads_vec4s_when_k_allows():
    def entries(a, b):
        return [d.entry for d in OPS["mul_mat"].dispatches(gg.mul_mat(a, b))]
    a, b = gg.input_tensor((6, 8)), gg.input_tensor((5, 8))
    assert entries(a, b) == ["mul_mat_tiled"]
    node = gg.mul_mat(a, b)
    assert [d.entry for d in OPS["mul_mat"].dispatches_on(node, {"matmul": "subgroup"})] \
        == ["mul_mat_subgroup"]
    assert entries(gg.input_tensor((6, 7)), gg.input_tensor((5, 7))) == ["mul_mat"]  # K % 4
    # a strided K or an unaligned offset: copied into contiguous scratch first
    assert entries(gg.transpose(gg.input_tensor((8, 6))), b) == ["cpy", "mul_mat_tiled"]
    assert entries(gg.view(gg.input_tensor((50,)), (5, 8), (8, 1), 2), a) == ["cpy", "mul_mat_tiled"]


def test_out_prod_reads_its_operands_as_they_lie_where_the_variant_can():
    a, b = gg.input_tensor((9, 8)), gg.input_tensor((9, 12))   # [K, M], [K, N]
    node = gg.out_prod(a, b)
    def dispatches(node, variant, op="out_prod"):
        return [(d.entry, d.u[1:]) for d in OPS[op].dispatches_on(node, {"matmul": variant})]
    assert dispatches(node, "subgroup") == [("mul_mat_subgroup_t", ())]
    # the tiled kernel too, K = 9 included: both operands along their rows (flags 0b11)
    assert dispatches(node, "tiled") == [("mul_mat_tiled", (3,))]
    # rows of 7 cannot be read as vec4s: copied as before
    odd = gg.out_prod(gg.input_tensor((8, 7)), gg.input_tensor((8, 12)))
    assert [e for e, _ in dispatches(odd, "subgroup")] == ["cpy", "cpy", "mul_mat_subgroup"]
    assert [e for e, _ in dispatches(odd, "tiled")] == ["cpy", "cpy", "mul_mat_tiled"]


def test_the_tiled_kernel_reads_a_backward_products_mixed_layouts_as_they_lie():
    """d x = W^T d y (a weight's transposed view, a gradient along K) and its mirror: one
    dispatch, no copy; the flags say which operand is read K-outermost."""
    w, dy = gg.input_tensor((12, 8)), gg.input_tensor((5, 12))    # W [out, in], d y [n, out]
    for a, b, flags in ((gg.transpose(w), dy, 1), (dy, gg.transpose(w), 2)):
        node = gg.mul_mat(a, b)
        (d,) = OPS["mul_mat"].dispatches_on(node, {"matmul": "tiled"})
        assert (d.entry, d.u) == ("mul_mat_tiled", (0, flags))
    # read along K needs K % 4 == 0: rows of 6 (d y's) are laid out for neither layout
    w6, dy6 = gg.input_tensor((6, 8)), gg.input_tensor((5, 6))
    node = gg.mul_mat(gg.transpose(w6), dy6)
    assert [d.entry for d in OPS["mul_mat"].dispatches_on(node, {"matmul": "tiled"})] \
        == ["mul_mat"]


def test_the_tiled_kernel_cuts_a_long_k_of_few_tiles_into_chunks_side_by_side():
    """The output head's d x (576 x 512 over a 49 152 vocabulary): 72 tiles, cut into 4
    chunks (288 workgroups, at most SPLIT_TARGET) that k_mul_mat_splits adds up with the
    epilogue; not where K is short, the product batched, or on lavapipe's kernel."""
    from ggwgpu.kernels import SPLIT_TARGET
    from ggwgpu.ops.matmul import k_chunks, product_of
    w, dy = gg.input_tensor((49152, 576)), gg.input_tensor((512, 49152))
    node = gg.mul_mat_acc(gg.transpose(w), dy, gg.input_tensor((512, 576)), 0.5)
    product, total = OPS["mul_mat_acc"].dispatches_on(node, {"matmul": "tiled"})
    assert (product.entry, product.n, product.u) == ("mul_mat_tiled", 288, (0, 1))
    assert product.dst.shape == (4, 512, 576) and product.srcs[0].shape == (4, 576, 12288)
    assert (total.entry, total.f, total.u, total.srcs[2]) == (
        "mul_mat_splits", (0.5,), (1, 4), node.srcs[2])
    assert 288 <= SPLIT_TARGET < 2 * 288
    short = gg.mul_mat(gg.input_tensor((576, 576)), gg.input_tensor((512, 576)))
    batched = gg.mul_mat(gg.input_tensor((2, 64, 4096)), gg.input_tensor((2, 8, 4096)))
    for n in (short, batched):
        assert k_chunks(product_of(n), "tiled") == 1
    assert k_chunks(product_of(node), "subgroup") == 1


def test_a_weight_times_a_batch_of_rows_is_one_product_over_all_rows():
    """A weight times [4, 128] tokens (a contiguous batch) runs as one [512, K] product: its
    tiles cross the batch entries and split_k may cut it (the 135M model's down projection,
    576 x 512 over 1 536: 72 tiles, 2 chunks); a c or a b whose rows do not lie one stride
    apart keeps the batch."""
    from ggwgpu.ops.matmul import product_of
    w, x = gg.input_tensor((576, 1536)), gg.input_tensor((4, 128, 1536))
    node = gg.mul_mat(w, x)
    p = product_of(node)
    assert (p.a.shape, p.b.shape, p.dst.shape, p.batches) == (
        (576, 1536), (512, 1536), (512, 576), 1)
    product, total = OPS["mul_mat"].dispatches_on(node, {"matmul": "tiled"})
    assert (product.n, product.srcs[1].shape, total.entry, total.dst.shape) == (
        144, (2, 512, 768), "mul_mat_splits", (512, 576))
    permuted = gg.permute(gg.input_tensor((128, 4, 1536)), (1, 0, 2))
    c = gg.permute(gg.input_tensor((128, 4, 576)), (1, 0, 2))
    for n in (gg.mul_mat(w, permuted), gg.mul_mat_acc(w, x, c)):
        assert product_of(n).batches == 4 and product_of(n).dst is n


def test_large_inputs_fold_the_grid_past_65535_workgroups(wgpu):
    x = gg.input_tensor((testing.O.elementwise.LARGE,))
    plan = wgpu.plan([gg.exp(x)])
    (_, _, (groups_x, groups_y)), = plan.recorded
    assert groups_x <= 65535 and groups_y > 1


def test_sentinels_catch_writes_outside_a_tensor(wgpu):
    x = gg.input_tensor((5,))
    y = gg.neg(x)
    plan = wgpu.plan([y], sentinel=8)
    plan.run({x: np.ones(5, np.float32)})
    assert plan.stray_writes() == []
    root = y.storage
    buf, offset, _ = plan.places[id(root)]
    wgpu.device.queue.write_buffer(buf, offset + 4 * 13, np.zeros(1, np.float32))
    assert plan.stray_writes() == [root]


def test_one_buffer_bound_twice_in_a_dispatch(wgpu):
    x = gg.input_tensor((3, 4))
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    (out,) = wgpu.compute([gg.mul(x, x)], {x: v})
    np.testing.assert_array_equal(out, v * v)


def test_views_are_zero_copy(wgpu):
    x = gg.input_tensor((2, 3, 4))
    t = gg.transpose(gg.permute(gg.reshape(x, (6, 4)), (1, 0)))
    plan = wgpu.plan([t])
    assert plan.roots == [x] and plan.recorded == []
    v = np.random.rand(2, 3, 4).astype(np.float32)
    plan.run({x: v})
    np.testing.assert_array_equal(plan.read(t), v.reshape(6, 4))


def test_shape_mismatch_names_op_and_shapes():
    with pytest.raises(gg.ShapeError, match=r"mul_mat\(\(3, 5\), \(4, 6\)\).*inner dims"):
        gg.mul_mat(gg.input_tensor((3, 5)), gg.input_tensor((4, 6)))
    with pytest.raises(gg.ShapeError, match=r"add\(\(3, 5\), \(2, 5\)\)"):
        gg.add(gg.input_tensor((3, 5)), gg.input_tensor((2, 5)))
    with pytest.raises(gg.ShapeError, match="reshape needs a contiguous"):
        gg.reshape(gg.transpose(gg.input_tensor((3, 5))), (15,))
    with pytest.raises(gg.ShapeError, match="reaches element"):
        gg.view(gg.input_tensor((4,)), (3,), (2,), 0)


@pytest.mark.parametrize("mode,frozen_dims", [("normal", [4, 5]), ("neox", [2, 6])])
def test_rope_ff_divides_the_angle_of_pair_k_by_factor_k(wgpu, mode, frozen_dims):
    # Checked against rope, not against rope_ff's own reference: factors of 1 change
    # nothing; a huge factor on pair 2 stops its turn (the dims of pair 2 keep their
    # values); with one pair, a factor f is freq_scale / f.
    from ggwgpu.backends.numpy_backend import NumpyBackend
    rng = np.random.default_rng(0)
    x, pos, ff = gg.input_tensor((2, 5, 3, 12)), gg.input_tensor((5,), "i32"), gg.input_tensor((4,))
    args = (8, mode, 500.0, 0.5)
    feeds = {x: rng.uniform(-1, 1, x.shape), pos: rng.integers(0, 300, 5).astype(np.int32)}
    frozen = np.array([1, 1, 1e30, 1])
    expected = NumpyBackend(np.float64).compute([gg.rope(x, pos, *args)], feeds)[0]
    still = expected.copy()
    still[..., frozen_dims] = feeds[x][..., frozen_dims]
    one = gg.input_tensor((1,))
    single = (gg.rope_ff(x, pos, one, 2, mode, 500.0, 0.5), gg.rope(x, pos, 2, mode, 500.0, 0.125))
    for backend in (NumpyBackend(np.float64), wgpu):
        plan = backend.plan([gg.rope_ff(x, pos, ff, *args), *single])
        for factors, want in ((np.ones(4), expected), (frozen, still)):
            plan.run({**feeds, ff: factors, one: [4.0]})
            np.testing.assert_allclose(plan.read(plan.outputs[0]), want, atol=2e-5)
        np.testing.assert_allclose(plan.read(single[0]), plan.read(single[1]), atol=2e-5)
    with pytest.raises(gg.ShapeError, match=r"factors must be f32 of shape \(4,\)"):
        gg.rope_ff(x, pos, gg.input_tensor((6,)), *args)



def hf_yarn(dim, base, factor, n_ctx_orig, beta_fast=32.0, beta_slow=1.0):
    """inv_freq and attention_factor as transformers computes them for rope_type "yarn"
    (modeling_rope_utils: _compute_yarn_parameters, truncating the correction range)."""
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations):
        return dim * np.log(n_ctx_orig / (rotations * 2 * np.pi)) / (2 * np.log(base))
    low = max(np.floor(correction_dim(beta_fast)), 0)
    high = min(np.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
    keep = 1 - ramp       # the share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, 0.1 * np.log(factor) + 1


@pytest.mark.parametrize("factor,n_ctx_orig,betas", [(4.0, 256, (32.0, 1.0)),
                                                     (8.0, 8192, (32.0, 1.0)),
                                                     (2.5, 1024, (16.0, 2.0))])
def test_rope_with_ext_factor_1_is_yarn_as_transformers_computes_it(wgpu, factor, n_ctx_orig,
                                                                    betas):
    """rope with ext_factor 1 and attn_factor 1 is YaRN: transformers' frequencies and its
    attention factor 0.1 ln(factor) + 1 on cos and sin (neox pairs: rotate_half)."""
    from ggwgpu.backends.numpy_backend import NumpyBackend
    rng = np.random.default_rng(1)
    dim, base = 32, 1e4
    x, pos = gg.input_tensor((1, 40, 3, dim)), gg.input_tensor((40,), "i32")
    feeds = {x: rng.uniform(-1, 1, x.shape), pos: rng.integers(0, 4096, 40)}   # f32 angles
    inv_freq, attention_factor = hf_yarn(dim, base, factor, n_ctx_orig, *betas)
    angles = feeds[pos][:, None].astype(np.float64) * inv_freq
    cos = np.cos(np.concatenate([angles] * 2, -1))[:, None] * attention_factor
    sin = np.sin(np.concatenate([angles] * 2, -1))[:, None] * attention_factor
    half = feeds[x][..., :dim // 2], feeds[x][..., dim // 2:]
    want = feeds[x] * cos + np.concatenate([-half[1], half[0]], -1) * sin
    y = gg.rope(x, pos, dim, "neox", base, 1 / factor, ext_factor=1.0, beta_fast=betas[0],
                beta_slow=betas[1], n_ctx_orig=n_ctx_orig)
    feeds[pos] = feeds[pos].astype(np.int32)
    np.testing.assert_allclose(NumpyBackend(np.float64).compute([y], feeds)[0], want,
                               atol=1e-12)
    # f32 angles of thousands of radians are good to ~1e-4 (as ggml's)
    np.testing.assert_allclose(wgpu.compute([y], feeds)[0], want, atol=1e-3)


def test_rope_refuses_yarn_without_its_original_context():
    x, pos = gg.input_tensor((1, 2, 1, 8)), gg.input_tensor((2,), "i32")
    with pytest.raises(gg.ShapeError, match="YaRN .* needs a positive n_ctx_orig"):
        gg.rope(x, pos, 8, "neox", 1e4, 0.25, ext_factor=1.0)
    with pytest.raises(gg.ShapeError, match="attn_factor -1 must make"):
        gg.rope(x, pos, 8, "neox", attn_factor=-1)

def test_the_package_exports_every_op_and_no_family_module():
    """`ggwgpu.quant` is the block-type module, not ops/quant.py: star imports carry op
    constructors, not the modules that define them."""
    import ggwgpu
    import ggwgpu.ops as ops
    assert set(OPS) <= set(ops.__all__) and all(callable(getattr(ggwgpu, n)) for n in OPS)
    assert ggwgpu.quant.__name__ == "ggwgpu.quant" and hasattr(ggwgpu.quant, "quantize")


def test_an_entry_takes_opdefs_defaults_and_refuses_unknown_fields():
    """Entries are built by keyword; what is not given comes from OpDef's one declaration
    of each default, and what follows from the shader (entry, dispatches) is filled there."""
    from ggwgpu.ops.registry import OpDef, elementwise_dispatch, register
    required = dict(n_srcs=1, shape=lambda srcs: (srcs[0].shape, "f32", {}),
                    reference=np.negative, backward=lambda n, g: (g,), cases=lambda: [])
    kernel = OpDef(name="twice", shader="elementwise", no_grad=[0], fd=[1e-3, 1e-4, 1e-2],
                   **required)
    assert (kernel.entry, kernel.dispatches) == ("twice", elementwise_dispatch)
    assert (kernel.no_grad, kernel.fd, kernel.param_names, kernel.defaults) == \
        ((0,), (1e-3, 1e-4, 1e-2), (), {})
    assert (kernel.nmse, kernel.f16, kernel.result, kernel.updates) == (1e-7, True, "float", False)
    view = OpDef(name="seen", entry="ignored", **required)
    assert (view.entry, view.dispatches, view.is_view) == (None, None, True)
    with pytest.raises(ValueError, match="op seen: result must be"):
        OpDef(name="seen", result="f64", **required)
    with pytest.raises(TypeError, match="op nowhere: .*'tolerance'"):
        register("nowhere", tolerance=1e-3, **required)
    assert "nowhere" not in OPS


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_signature_is_its_declaration(name):
    """help() and editors see each op's sources and params, not (*args, **kwargs): sources
    positional only (named as its reference names them), then the declared params with
    their defaults, and a call bound by that signature builds the node."""
    import inspect
    opdef, P = OPS[name], inspect.Parameter
    params = list(inspect.signature(getattr(gg, name)).parameters.values())
    assert [p.kind for p in params] == ([P.POSITIONAL_ONLY] * opdef.n_srcs
                                        + [P.POSITIONAL_OR_KEYWORD] * len(opdef.param_names))
    assert tuple(p.name for p in params[opdef.n_srcs:]) == opdef.param_names
    assert tuple(p.name for p in params[:opdef.n_srcs]) == opdef.src_names
    assert not any(re.fullmatch(r"src\d+", n) for n in opdef.src_names), f"{name}: unnamed"
    for p in params[opdef.n_srcs:]:
        want = opdef.defaults.get(p.name, P.empty)
        assert p.default == want or p.default is want, (name, p.name)


def test_op_signature_shows_defaults():
    import inspect
    sig = inspect.signature(gg.rope)
    assert str(sig).startswith("(x: ggwgpu.tensor.Tensor, pos: ggwgpu.tensor.Tensor, /, n_dims,")
    assert sig.parameters["mode"].default == gg.OPS["rope"].defaults["mode"]
