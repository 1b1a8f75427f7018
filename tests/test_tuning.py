"""Products timed on the device (backends/tuning.py): the choices each product gets, the
fastest kept per product key and used by every plan after, timed products of the same key
as the step's products, and when tuning is on (kernels.tunes_products)."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends import tuning
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.kernels import TunedMatmul, tunes_products
from ggwgpu.ops.matmul import product_choices, product_key, product_of

from test_backends import random_feeds


def products():
    """A weight stored K-outermost (a backward's W^T) times a batch of rows, and a short wide
    product: both with choices of kernel and of chunks of K."""
    w = gg.input_tensor((1024, 36), name="w")
    x = gg.input_tensor((2, 20, 1024), name="x")
    a, b = gg.input_tensor((72, 512), name="a"), gg.input_tensor((40, 512), name="b")
    return [gg.mul_mat(gg.transpose(w), x), gg.mul_mat_acc(a, b, gg.input_tensor((40, 72)), 0.5)]


def test_a_product_s_choices_are_each_kernel_whole_and_split_where_it_can_be():
    weight, short = products()
    assert product_choices(product_of(weight), "tiled") == [
        (kernel, chunks) for kernel in ("tiled", "wide", "small") for chunks in (1, 2, 4, 8)]
    # K of 512: chunks at least TUNE_MIN_K (128) deep; lavapipe's kernel whole first
    assert product_choices(product_of(short), "subgroup") == [("subgroup", 1)] + [
        (kernel, chunks) for kernel in ("tiled", "wide", "small") for chunks in (1, 2, 4)]
    # batched (attention's heads): whole kernels only; rows of 6 read by no vec4 kernel
    heads = gg.mul_mat(gg.input_tensor((2, 3, 16, 64)), gg.input_tensor((2, 3, 8, 64)))
    assert product_choices(product_of(heads), "tiled") == [("tiled", 1), ("wide", 1),
                                                           ("small", 1)]
    odd = gg.mul_mat(gg.transpose(gg.input_tensor((6, 8))), gg.input_tensor((5, 6)))
    assert product_choices(product_of(odd), "tiled") == []


def test_the_fastest_choice_is_kept_per_key_and_runs_in_every_plan(wgpu, monkeypatch):
    """Times from a stand-in that favours ('wide', 2) for the weight's product and
    ('tiled', 4) for the other: those run, the results are right, and a second plan with
    the same keys times nothing again."""
    tuned = TunedMatmul("tiled")
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", tuned)
    timed = []

    def seconds(backend, node, choice, plan_type):
        timed.append(choice)
        return 1.0 if choice == (("wide", 2) if node.op == "mul_mat" else ("tiled", 4)) else 2.0
    monkeypatch.setattr(tuning, "choice_seconds", seconds)
    outs = products()
    plan = wgpu.plan(outs)
    assert len(timed) == 12 + 9 and sorted(tuned.chosen.values()) == [("tiled", 4), ("wide", 2)]
    assert [(d.entry, d.n) for _, d in plan.dispatches] == [
        ("mul_mat_wide", 2), ("mul_mat_splits", 40 * 9),       # 36 x 40 rows: one tile
        ("mul_mat_tiled", 8), ("mul_mat_splits", 40 * 18)]     # 72 x 40: two tiles
    feeds = random_feeds(outs, 0)
    plan.run(feeds)
    w, x, a, b, c = (feeds[t] for t in (outs[0].srcs[0].srcs[0], outs[0].srcs[1],
                                        *outs[1].srcs))
    np.testing.assert_allclose(plan.read(outs[0]), x @ w, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(plan.read(outs[1]), 0.5 * b @ a.T + c, rtol=1e-5, atol=1e-4)
    wgpu.plan(products())
    assert len(timed) == 21


def test_timing_on_the_device_keeps_the_least_time_of_each_product(wgpu, monkeypatch):
    tuned = TunedMatmul("tiled")
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", tuned)
    node = products()[1]
    plan = wgpu.plan([node])
    key = product_key(product_of(node))
    seconds = tuned.seconds[key]
    assert list(seconds) == product_choices(product_of(node), "tiled")
    assert all(0 < s < 10 for s in seconds.values())
    assert tuned.chosen == {key: min(seconds, key=seconds.get)}
    feeds = random_feeds([node], 1)
    a, b, c = (feeds[t] for t in node.srcs)
    plan.run(feeds)
    np.testing.assert_allclose(plan.read(node), 0.5 * b @ a.T + c, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("config", ["tiny", "smollm-135m-lora-f32", "smollm-135m"])
def test_every_product_of_a_training_step_is_timed_as_it_lies(config):
    """The timed stand-in of each product of a step (the 135M shape: its weights K-outermost
    in the backward, [4, 128] token batches merged into 512 rows; on a q4_0 base, the frozen
    weights' products forward and back) has the product's key."""
    from ggwgpu import bench
    counter = bench.DispatchCounter(NumpyBackend())
    counter.kernel_variants = {"matmul": "tiled", "quant": "portable"}
    cfg, options = bench.bench_model(config)
    cfg, options = bench.bench_model(config, **{**cfg.__dict__, "n_layer": 1})
    plan = bench.bench_trainer(config, counter, cfg, options,
                               bench.bench_weights(config, cfg)).plan
    nodes = [n for n in plan.nodes if n.op in tuning.PRODUCT_FAMILIES]
    assert len(nodes) > 20
    if config == "smollm-135m":
        assert {"mul_mat_q", "mul_mat_q_back"} <= {n.op for n in nodes}
    for node in nodes:
        assert product_key(product_of(tuning.timed_product(node))) == \
            product_key(product_of(node))


class Adapter:
    def __init__(self, adapter_type):
        self.info = {"adapter_type": adapter_type}


@pytest.mark.parametrize("tune, matmul, kind, expected", [
    (None, None, "DiscreteGPU", True), (None, None, "CPU", False),
    (None, "wide", "DiscreteGPU", False), ("1", None, "CPU", True),
    ("0", None, "IntegratedGPU", False), ("1", "wide", "DiscreteGPU", True)])
def test_products_are_timed_on_hardware_adapters_unless_a_kernel_is_forced(
        monkeypatch, tune, matmul, kind, expected):
    for var, value in (("GGWGPU_TUNE", tune), ("GGWGPU_MATMUL", matmul)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert tunes_products(Adapter(kind)) is expected


def test_an_unknown_tuning_setting_is_refused(monkeypatch):
    monkeypatch.setenv("GGWGPU_TUNE", "yes")
    with pytest.raises(ValueError, match=r"GGWGPU_TUNE='yes': choose 1"):
        tunes_products(Adapter("DiscreteGPU"))


def test_a_training_step_of_products_cut_and_retiled_trains_as_numpy_does(wgpu, monkeypatch):
    """A stand-in that times the most chunks of K fastest, then 'small', then 'wide': every
    product of a training step that can be cut is, the rest on another kernel than the
    default; a tiny model's first two training steps give NumPy's losses."""
    from ggwgpu import bench
    tuned = TunedMatmul("tiled")
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", tuned)
    order = {"small": 0.0, "wide": 0.1, "tiled": 0.2}
    monkeypatch.setattr(tuning, "choice_seconds", lambda backend, node, choice, plan_type:
                        1 / choice[1] + order.get(choice[0], 1.0))
    cfg, options = bench.bench_model("tiny", n_layer=1)
    weights = bench.bench_weights("tiny", cfg)
    losses = [[trainer.train_step()["loss"] for _ in range(2)] for trainer in (
        bench.bench_trainer("tiny", be, cfg, options, weights) for be in (NumpyBackend(), wgpu))]
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-6)
    kept = set(tuned.chosen.values())
    assert {k for k, _ in kept} == {"small"} and max(c for _, c in kept) > 1


def test_a_frozen_weight_s_product_is_timed_on_the_tiled_kernels_too(wgpu, monkeypatch):
    """A q4_0 weight times a batch of rows, and its gradient's product: 'portable' and the
    three tiled kernels (dequantizing as they stage) timed; the products right on each."""
    from ggwgpu.quant import dequantize, quantize
    tuned = TunedMatmul("portable")
    monkeypatch.setitem(wgpu.kernel_variants, "quant", tuned)
    rng = np.random.default_rng(2)
    blocks = quantize(rng.uniform(-1, 1, (40, 64)), "q4_0")
    w, x = gg.constant(blocks), gg.input_tensor((2, 9, 64))
    y = gg.mul_mat(w, x)
    dx = gg.build_backward(gg.sum(y), [x])[x]
    plan = wgpu.plan([y, dx])
    assert {n.op for n in plan.nodes} >= {"mul_mat_q", "mul_mat_q_back"}
    assert [list(s) for s in tuned.seconds.values()] == [
        [("portable", 1), ("tiled", 1), ("small", 1), ("wide", 1)]] * 2
    xv = rng.uniform(-1, 1, x.shape).astype(np.float32)
    plan.run({x: xv})
    wv = dequantize(blocks)
    np.testing.assert_allclose(plan.read(y), xv @ wv.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plan.read(dx), np.ones((2, 9, 40)) @ wv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["tiled", "small", "wide"])
def test_a_lora_step_on_a_q4_0_base_on_the_tiled_kernels_trains_as_numpy_does(
        wgpu, monkeypatch, kernel):
    """Every frozen weight's product of a LoRA step, forward and back, on one tiled kernel
    (a stand-in times it fastest): the first two steps' losses are NumPy's."""
    from ggwgpu import bench
    from ggwgpu.quant import quantize_model
    from ggwgpu.training import Trainer
    tuned = TunedMatmul("portable")
    monkeypatch.setitem(wgpu.kernel_variants, "quant", tuned)
    monkeypatch.setattr(tuning, "choice_seconds", lambda backend, node, choice, plan_type:
                        0.0 if choice == (kernel, 1) else 1.0)
    cfg, options = bench.bench_model("tiny", n_layer=2)
    values = quantize_model(bench.bench_weights("tiny", cfg)[0], "q4_0")
    losses = []
    for backend in (NumpyBackend(), wgpu):
        trainer = Trainer(cfg, values, backend, options,
                          bench.RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch),
                          lora=bench.bench_adapter(cfg, 4))
        losses.append([trainer.train_step()["loss"] for _ in range(2)])
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-6)
    assert set(tuned.chosen.values()) == {(kernel, 1)} and len(tuned.chosen) >= 4


def test_a_product_too_big_to_time_or_a_choice_past_the_limits_is_left_out(wgpu, monkeypatch):
    """A product whose operands and result pass TIMED_BYTES runs as the rules say, untimed;
    a choice the adapter's limits or the adapter itself refuse is left out of the timing."""
    import wgpu as webgpu
    from ggwgpu.backends.base import DeviceLimitError
    tuned = TunedMatmul("tiled")
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", tuned)
    weight, short = products()
    monkeypatch.setattr(tuning, "TIMED_BYTES", 4 * (72 * 512 + 40 * 512 + 40 * 72))
    real = tuning.choice_seconds

    def seconds(backend, node, choice, plan_type):
        if choice[1] > 1:
            raise DeviceLimitError("the sums of K's chunks: past the limit")
        if choice[0] == "wide":
            raise webgpu.GPUValidationError("the adapter refused the kernel")
        return real(backend, node, choice, plan_type)
    monkeypatch.setattr(tuning, "choice_seconds", seconds)
    wgpu.plan([weight, short])
    assert [list(s) for s in tuned.seconds.values()] == [[("tiled", 1), ("small", 1)]]
    assert list(tuned.chosen) == [product_key(product_of(short))]


def test_the_choices_are_kept_for_the_next_process_on_the_adapter(wgpu, monkeypatch, tmp_path):
    """A backend with a choices file writes what it timed there; a fresh TunedMatmul reads
    them back and a plan with it times nothing; a malformed file gives no choices."""
    tuned = TunedMatmul("tiled")
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", tuned)
    monkeypatch.setattr(wgpu, "tuning_file", tmp_path / "cache" / "products.json")
    timed = []

    def seconds(backend, node, choice, plan_type):
        timed.append(choice)
        return 1.0 / choice[1]
    monkeypatch.setattr(tuning, "choice_seconds", seconds)
    wgpu.plan(products())
    assert len(timed) == 21 and sorted(tuned.chosen.values()) == [("tiled", 4), ("tiled", 8)]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["products.json"]
    again = TunedMatmul("tiled")
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", again)
    assert tuning.load_choices(wgpu.kernel_variants, wgpu.tuning_file) == 2
    assert again.chosen == tuned.chosen and again.seconds == tuned.seconds
    plan = wgpu.plan(products())
    assert len(timed) == 21 and {d.entry for _, d in plan.dispatches} == {
        "mul_mat_tiled", "mul_mat_splits"}
    # a report of one plan's products leaves the others out
    assert len(tuning.tuning_report(wgpu)) == 2
    (row,) = tuning.tuning_report(wgpu, wgpu.plan(products()[:1]).nodes)
    assert (row["a"], row["b"], row["layouts"], row["chosen"]) == (
        [36, 1024], [40, 1024], 1, "tiled in 8 chunks")
    entry = '{"key": [[4, 8], [2, 8], "f32", "f32", 0], "seconds": [[["%s", 1], 1.0]], ' \
            '"chosen": ["%s", 1]}'
    for text in ("{", "[]", '{"format": 2, "families": {}}',
                 '{"format": 1, "families": {"matmul": [{"key": [1]}]}}',
                 '{"format": 1, "families": {"matmul": [%s]}}' % (entry % ("tiled", "wide")),
                 '{"format": 1, "families": {"matmul": [%s]}}' % (entry % ("huge", "huge"))):
        wgpu.tuning_file.write_text(text)
        assert tuning.load_choices({"matmul": TunedMatmul("tiled")}, wgpu.tuning_file) == 0
    wgpu.tuning_file.write_text('{"format": 1, "families": {"matmul": [%s]}}'
                                % (entry % ("wide", "wide")))
    assert tuning.load_choices({"matmul": TunedMatmul("tiled")}, wgpu.tuning_file) == 1


def test_a_choices_file_belongs_to_one_adapter_driver_and_kernel_source(monkeypatch, tmp_path):
    from ggwgpu import wgsl
    monkeypatch.setenv("GGWGPU_CACHE_DIR", str(tmp_path))
    card = {"vendor": "nvidia", "device": "H100", "description": "570.1", "backend_type": "Vulkan"}
    path = tuning.choices_file(card)
    assert path.parent == tmp_path and path.name.startswith("products-")
    assert path == tuning.choices_file(dict(card))
    assert path != tuning.choices_file({**card, "description": "575.2"})
    source = wgsl.shader_source
    monkeypatch.setattr(wgsl, "shader_source", lambda stem: source(stem) + "// changed\n")
    assert path != tuning.choices_file(card)


def test_timing_that_fails_warns_and_leaves_the_products_to_the_rules(wgpu, monkeypatch):
    """An unexpected error while timing does not stop the plan: one warning, the products on
    the rules' kernels, and no timing for the rest of the process."""
    tuned = TunedMatmul("tiled")
    monkeypatch.setitem(wgpu.kernel_variants, "matmul", tuned)
    monkeypatch.setattr(wgpu, "tuning_failed", False, raising=False)
    calls = []

    def seconds(backend, node, choice, plan_type):
        calls.append(choice)
        raise RuntimeError("timestamps unreadable")
    monkeypatch.setattr(tuning, "choice_seconds", seconds)
    with pytest.warns(UserWarning, match=r"timing products on the device failed "
                                         r"\(RuntimeError: timestamps unreadable\)"):
        plan = wgpu.plan(products())
    assert len(calls) == 1 and tuned.chosen == {} and wgpu.tuning_failed
    assert [d.entry for _, d in plan.dispatches] == [      # the weight's K: 2 chunks
        "mul_mat_tiled", "mul_mat_splits", "mul_mat_tiled"]
    wgpu.plan(products())
    assert len(calls) == 1
