"""Dynamic loss scaling (train.LossScaler, PyTorch's GradScaler rules): scaling by a power of
two changes no bit of training, an overflow skips the step and halves the scale, finite steps
grow it, its state survives a checkpoint, and it works with gradient accumulation and over
MPI ranks."""
import json
import math

import numpy as np
import pytest

from ggwgpu import data
from ggwgpu.training import checkpoint
from ggwgpu.gguf_file import GGUFError
from ggwgpu.lora import init_adapter, lora_ranks
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.models import ModelConfig, init_parameters
from ggwgpu.testing import through_checkpoint
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.training import MAX_SCALE, Trainer, TrainOptions, check_state

from test_distributed import make_trainer, mpiexec, run_worker  # noqa: F401 (a fixture)

TINY = dict(n_embd=16, n_head=2, n_layer=2, n_ff=32, n_ctx=16)
TEXT = data.bundled_corpus()[:20000]
# a constant learning rate: a run that skips steps and one that never sees their batches
# then make the same updates
CONSTANT_LR = dict(batch=4, lr=3e-3, warmup=0, cos_decay_min=1.0)


def make(backend, loss_scaler=None, lora=False, **options):
    """A tiny llama's trainer (with lora: a LoRA finetune of it)."""
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    o = TrainOptions(**{**CONSTANT_LR, **options})
    samples = data.Samples(tok.encode(TEXT), cfg.n_ctx, o.batch, o.seed, tok.bos_id)
    adapter = init_adapter(cfg, lora_ranks(cfg, r=2), 4.0, seed=2) if lora else None
    return Trainer(cfg, init_parameters(cfg, seed=1), backend, o, samples, lora=adapter,
                   loss_scaler=loss_scaler)


def dynamic(**options):
    return dict(loss_scale="dynamic", **options)


def backend_of(name, request):
    return NumpyBackend() if name == "numpy" else request.getfixturevalue("wgpu")


def assert_same_state(a: Trainer, b: Trainer):
    """Weights and AdamW moments bit for bit."""
    for name, value in a.parameters().items():
        assert np.array_equal(b.parameters()[name], value), name
    for name, (m, v) in a.optimizer_state().items():
        assert np.array_equal(b.optimizer_state()[name][0], m), name
        assert np.array_equal(b.optimizer_state()[name][1], v), name


def overflow_next_step(t: Trainer):
    """Make the next step's scaled gradients overflow, whatever they are."""
    t.scaler.scale = MAX_SCALE
    t.write_scale()


@pytest.mark.parametrize("backend_name, optimizer, clip, accum, variant", [
    ("numpy", "adamw", 1.0, 1, ""), ("numpy", "sgd", 0.0, 2, ""), ("numpy", "adamw", 0.5, 2, ""),
    ("numpy", "adamw", 1.0, 1, "lora"), ("numpy", "adamw", 0.0, 1, "checkpointing"),
    ("wgpu", "adamw", 1.0, 1, ""), ("wgpu", "sgd", 0.0, 1, ""), ("wgpu", "adamw", 1.0, 2, "lora"),
    ("wgpu", "adamw", 1.0, 1, "checkpointing")])
def test_a_scale_that_never_overflows_changes_no_bit(backend_name, optimizer, clip, accum,
                                                     variant, request):
    """Gradients times 2^16, then times 2^-16 in the clip factor (or alone without
    clipping): the same losses, gradient norms, weights and moments as without scaling.
    Also for a LoRA finetune, and with gradient checkpointing and flash attention."""
    backend = backend_of(backend_name, request)
    o = dict(optimizer=optimizer, grad_clip=clip, grad_accum=accum, warmup=3,
             cos_decay_min=0.1, lr=3e-3 if optimizer == "adamw" else 0.3)
    if variant == "checkpointing":
        o.update(checkpointing=True, flash_attn=True)
    lora = variant == "lora"
    plain, scaled = make(backend, lora=lora, **o), make(backend, lora=lora, **dynamic(**o))
    for _ in range(4):
        a, b = plain.train_step(), scaled.train_step()
        assert b["loss_scale"] == 2.0 ** 16 and not b["skipped"] and "loss_scale" not in a
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert_same_state(plain, scaled)


def old_formulation(t: Trainer):
    """The step `t` makes, built by hand as the trainer built it before its optimizer steps
    took the gradient factor: the same graph (a second copy), clip_scale's factor applied by a
    mul op per gradient, and steps whose own factor is 1. Returns (the graph, the loss scale
    and 1 / scale inputs (None unscaled), the hparams input, the sum of squares, the factor,
    the updates, the moments by name)."""
    import ggwgpu as gg
    from ggwgpu import ops as O
    from ggwgpu.models import build_train_graph
    from ggwgpu.training import clip_scale
    g = build_train_graph(t.cfg, init_parameters(t.cfg, seed=1), t.options.batch)
    seed, inv = ((gg.input_tensor(g.loss.shape), gg.input_tensor((1,))) if t.scaler
                 else (None, None))
    grads = gg.build_backward(g.loss, list(g.params.values()), seed=seed)
    sumsq, factor = clip_scale(grads, t.options.grad_clip, inv)
    hp = gg.input_tensor(t.regime.hparams.shape)
    flagged = O.append_finite_flag(hp, sumsq, g.loss, gg.constant(np.ones(1, np.float32)))
    updates, moments = [], {}
    for p, grad in grads.items():
        grad = O.mul(grad, factor)
        if t.options.optimizer == "sgd":
            updates.append(O.opt_step_sgd(p, grad, flagged, p.ndim >= 2))
            continue
        m, v = (gg.constant(np.zeros(p.shape, np.float32)) for _ in "mv")
        moments[p.name] = m, v
        updates.append(O.opt_step_adamw(p, grad, m, v, flagged, p.ndim >= 2))
    return g, seed, inv, hp, sumsq, factor, updates, moments


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
@pytest.mark.parametrize("optimizer, scaling, clip", [
    ("adamw", "dynamic", 0.05), ("adamw", "none", 0.05), ("sgd", "dynamic", 0.0)])
def test_the_steps_take_the_gradient_factor_as_a_mul_before_them_gave_it(
        backend_name, optimizer, scaling, clip, request):
    """The optimizer steps multiply each gradient by the clip factor (times 1 / S) in their
    kernels: losses, gradient norms, weights and moments stay bit for bit those of the
    formulation before, a mul op per gradient ahead of the step."""
    backend = backend_of(backend_name, request)
    t = make(backend, optimizer=optimizer, loss_scale=scaling, grad_clip=clip,
             lr=3e-3 if optimizer == "adamw" else 0.3)
    g, seed, inv, hp, sumsq, factor, updates, moments = old_formulation(t)
    plan = backend.plan([g.loss, sumsq, factor, *updates])
    plan.write(g.positions, np.arange(t.cfg.n_ctx, dtype=np.int32))
    if t.scaler:
        plan.write(seed, np.full(seed.shape, t.scaler.scale, np.float32))
        plan.write(inv, np.array([1 / t.scaler.scale], np.float32))
    batches, feeds = [], t.feeds
    t.feeds = lambda *batch: batches.append(batch) or feeds(*batch)
    factors = []
    for _ in range(3):
        hp_value = t.regime.step_hparams()[0]
        record = t.train_step()
        plan.run({**g.feeds(*batches[-1]), hp: hp_value})
        loss, ss, f = plan.read_many([g.loss, sumsq, factor])
        assert not record["skipped"]
        assert (record["loss"], record["grad_norm"]) == (float(loss[0]), math.sqrt(float(ss[0])))
        factors.append(float(f[0]) * (t.scaler.scale if t.scaler else 1))
    for name, p in g.params.items():
        assert np.array_equal(t.parameters()[name], plan.read(p)), name
    for name, (m, v) in moments.items():
        assert np.array_equal(t.optimizer_state()[name][0], plan.read(m)), name
        assert np.array_equal(t.optimizer_state()[name][1], plan.read(v)), name
    assert all(f < 1 for f in factors) if clip else factors == [1.0] * 3   # clipping acts


@pytest.mark.parametrize("backend_name, accum", [("numpy", 1), ("numpy", 2), ("wgpu", 1)])
def test_an_overflowing_scale_skips_steps_halving_until_it_fits(backend_name, accum, request):
    """The first steps' scaled gradients overflow: each is skipped (no weight or moment
    changes, no AdamW step counted) and halves the scale; from the first finite step on the
    run makes the updates of an unscaled run that never saw the skipped steps' batches."""
    backend = backend_of(backend_name, request)
    norm = make(backend, grad_accum=accum).train_step()["grad_norm"]
    # the sum of squares overflows float32 (2^128) when scale * norm passes 2^64
    init = 2.0 ** (math.ceil(math.log2(2.0 ** 64 / norm)) + 2)
    scaled = make(backend, **dynamic(grad_accum=accum, loss_scale_init=init))
    start = scaled.parameters()
    records = [scaled.train_step() for _ in range(10)]
    skipped = [r["skipped"] for r in records]
    first = skipped.index(False)
    assert first >= 2 and not any(skipped[first:]), skipped
    assert all(r["overflow"] and math.isinf(r["grad_norm"]) and math.isfinite(r["loss"])
               for r in records[:first])
    assert [r["loss_scale"] for r in records] == [init / 2 ** min(i, first) for i in range(10)]
    assert scaled.step == 10 and scaled.scaler.skipped_steps == first

    plain = make(backend, grad_accum=accum)
    for _ in range(first * accum):         # the batches the scaled run skipped
        plain.batches.next_batch()
    for r in records[first:]:
        assert plain.train_step()["loss"] == r["loss"]
    assert_same_state(plain, scaled)
    assert any(not np.array_equal(start[n], v) for n, v in scaled.parameters().items())

    before = scaled.parameters(), scaled.optimizer_state()   # a skip in mid-run
    overflow_next_step(scaled)
    r = scaled.train_step()
    assert r["skipped"] and r["overflow"] and r["loss_scale"] == MAX_SCALE
    assert scaled.scaler.scale == MAX_SCALE / 2 and scaled.scaler.growth_tracker == 0
    for name, value in before[0].items():
        assert np.array_equal(scaled.parameters()[name], value), name
    for name, (m, v) in before[1].items():
        assert np.array_equal(scaled.optimizer_state()[name][0], m), name
        assert np.array_equal(scaled.optimizer_state()[name][1], v), name


def test_the_scale_grows_after_growth_interval_finite_steps_and_a_skip_restarts_the_count():
    t = make(NumpyBackend(), **dynamic(loss_scale_init=16.0, loss_scale_growth_interval=3))
    scales = [t.train_step()["loss_scale"] for _ in range(7)]
    assert scales == [16, 16, 16, 32, 32, 32, 64] and t.scaler.growth_tracker == 1
    overflow_next_step(t)
    assert t.train_step()["overflow"]
    assert (t.scaler.scale, t.scaler.growth_tracker) == (MAX_SCALE / 2, 0)
    # halving until it fits (near 2^63, the gradient norm being near 1); there growth and
    # overflow take turns: the scale of each step follows from the skips before it
    records = [t.train_step() for _ in range(75)]
    scale, finite_in_a_row, grown_after_a_skip = MAX_SCALE / 2, 0, 0
    for r in records:
        assert r["loss_scale"] == scale
        finite_in_a_row = 0 if r["skipped"] else finite_in_a_row + 1
        scale = scale / 2 if r["skipped"] else scale * 2 if finite_in_a_row == 3 else scale
        if finite_in_a_row == 3:
            finite_in_a_row, grown_after_a_skip = 0, grown_after_a_skip + 1
    assert grown_after_a_skip >= 2 and not records[-1]["skipped"] or records[-2]["skipped"]


def test_the_scale_stays_within_its_bounds():
    from ggwgpu.training import MIN_SCALE, LossScaler
    s = LossScaler(MAX_SCALE, 1)
    s.update(True)
    assert s.scale == MAX_SCALE
    s = LossScaler(MIN_SCALE, 1)
    s.update(False)
    assert (s.scale, s.skipped_steps) == (MIN_SCALE, 1)


def poisonable(monkeypatch):
    """Trainers made from now on add the returned input (written 0) to one gradient: inf
    there makes one step's gradients overflow whatever the scale."""
    import ggwgpu as gg
    from ggwgpu.training import trainer as train
    poison, real = gg.input_tensor((1,), name="poison"), train.build_backward

    def poisoned(*args, **kwargs):
        grads = real(*args, **kwargs)
        first = next(iter(grads))
        grads[first] = gg.add(grads[first], poison)
        return grads
    monkeypatch.setattr(train, "build_backward", poisoned)
    return poison


def run(t: Trainer, steps: int, poison=None, overflow_at=()) -> list[dict]:
    records = []
    for _ in range(steps):
        t.plan.write(poison, [np.inf if t.step in overflow_at else 0.0])
        records.append(t.train_step())
    return records


def loss_poisonable(monkeypatch, calls):
    """Trainers made from now on add an input to their loss: NaN in the micro-batches
    `calls` (0-based count of TrainGraph.feeds calls), 0 elsewhere. Their loss is then not
    finite while every gradient is (the add passes the backward's seed on as it is). No batch
    does that by itself: an infinite or NaN target weight, logit or weight that makes the
    loss non-finite makes gradients non-finite too (or overflows their sum of squares)."""
    import dataclasses
    import ggwgpu as gg
    from ggwgpu.training import trainer as train
    from ggwgpu.models import TrainGraph
    poison, build, feeds = gg.input_tensor((1,), name="loss poison"), train.build_train_graph, \
        TrainGraph.feeds
    count = iter(range(10 ** 9))

    def poisoned_graph(*args, **kwargs):
        g = build(*args, **kwargs)
        return dataclasses.replace(g, loss=gg.add(g.loss, poison))

    def poisoned_feeds(graph, *args, **kwargs):
        out = feeds(graph, *args, **kwargs)
        if poison in graph.loss.srcs:      # not a graph made before
            out[poison] = np.array([np.nan if next(count) in calls else 0.0], np.float32)
        return out
    monkeypatch.setattr(train, "build_train_graph", poisoned_graph)
    monkeypatch.setattr(TrainGraph, "feeds", poisoned_feeds)


@pytest.mark.parametrize("micro_batch", [0, 1])
@pytest.mark.parametrize("backend_name, scaling", [("numpy", "dynamic"), ("numpy", "none"),
                                                   ("wgpu", "dynamic")])
def test_a_micro_batch_whose_loss_alone_is_not_finite_skips_on_device_and_host_alike(
        backend_name, scaling, micro_batch, monkeypatch, request):
    """Two micro-batches a step; in step 2 one of them has a NaN loss and finite gradients.
    The device's finite flag tests the loss of every micro-batch, as the host does: the step
    is skipped by both (no weight or moment changes; with scaling the scale backs off), and
    step 3 is the step 3 of a run that never saw step 2's batches (no NaN stayed in a sum)."""
    backend = backend_of(backend_name, request)
    o = dict(batch=2, grad_accum=2, loss_scale=scaling)
    clean = make(backend, **o)
    loss_poisonable(monkeypatch, {2 + micro_batch})     # from here: hit's feeds calls
    hit = make(backend, **o)
    for t in (clean, hit):
        assert not t.train_step()["skipped"]
    before = hit.parameters(), hit.optimizer_state()
    record = hit.train_step()
    assert record["skipped"] and math.isnan(record["loss"]), record
    assert math.isfinite(record["grad_norm"])
    for name, value in before[0].items():
        assert np.array_equal(hit.parameters()[name], value), name
    for name, (m, v) in before[1].items():
        assert np.array_equal(hit.optimizer_state()[name][0], m), name
        assert np.array_equal(hit.optimizer_state()[name][1], v), name
    for _ in range(2):                     # the clean run leaves step 2 out by hand
        clean.batches.next_batch()
    clean.step += 1
    if clean.scaler is not None:
        assert hit.scaler.state() == {"scale": 2.0 ** 15, "growth_tracker": 0,
                                      "skipped_steps": 1}
        clean.scaler.update(False)
        clean.write_scale()
    a, b = clean.train_step(), hit.train_step()
    assert not b["skipped"] and (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert_same_state(clean, hit)


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_resuming_a_checkpoint_continues_the_scaler_exactly(tmp_path, backend_name, request,
                                                           monkeypatch):
    """Scale, growth tracker and skipped steps travel in the checkpoint's training state; the
    resumed run equals the uninterrupted one (a skip before the checkpoint moves AdamW's
    step count, growth after it needs the saved tracker)."""
    backend = backend_of(backend_name, request)
    o = dynamic(loss_scale_init=64.0, loss_scale_growth_interval=3)
    poison = poisonable(monkeypatch)
    straight = make(backend, **o)
    want = run(straight, 7, poison, overflow_at={1})
    assert [r["loss_scale"] for r in want] == [64, 64, 32, 32, 32, 64, 64]
    first = make(backend, **o)
    run(first, 4, poison, overflow_at={1})
    cfg, values, _, opt_state, state = through_checkpoint(first, tmp_path / "ckpt.gguf",
                                                         ByteTokenizer())
    assert state.loss_scaler == {"scale": 32.0, "growth_tracker": 2, "skipped_steps": 1}
    options = state.options
    samples = data.Samples(ByteTokenizer().encode(TEXT), cfg.n_ctx, options.batch,
                           options.seed, ByteTokenizer().bos_id)
    samples.load_state(state.data)
    resumed = Trainer(cfg, values, backend, options, samples, opt_state, state.step,
                      loss_scaler=state.loss_scaler)
    got = run(resumed, 3, poison)
    assert [(r["loss"], r["loss_scale"]) for r in got] == \
        [(r["loss"], r["loss_scale"]) for r in want[4:]]
    assert resumed.scaler.state() == straight.scaler.state()
    assert_same_state(straight, resumed)


def good_state(**scaler):
    t = make(NumpyBackend(), **dynamic(loss_scale_growth_interval=10))
    state = json.loads(json.dumps(t.state().to_json()))
    state["step"] = 5
    state["loss_scaler"].update(scaler)
    return state


@pytest.mark.parametrize("scaler, message", [
    ({"scale": -1.0}, "loss_scaler.scale must be in [1.17549e-38, 8.50706e+37]"),
    ({"scale": float("nan")}, "loss_scaler.scale must be a finite number"),
    ({"scale": 3.0}, "loss_scaler.scale must be a power of two, got 3.0"),
    ({"scale": "65536"}, "loss_scaler.scale must be a number"),
    ({"growth_tracker": 10}, "loss_scaler.growth_tracker must be below "
                             "options.loss_scale_growth_interval 10"),
    ({"growth_tracker": 1.5}, "loss_scaler.growth_tracker must be an integer"),
    ({"skipped_steps": 6}, "loss_scaler.skipped_steps must be at most step 5"),
    ({"found_inf": 1}, "loss_scaler.found_inf is not part of"),
])
def test_a_bad_scaler_state_is_refused_naming_the_key(scaler, message):
    with pytest.raises(ValueError) as e:
        check_state(good_state(**scaler))
    assert message in str(e.value)


def test_a_scaler_state_must_be_whole_and_belong_to_dynamic_scaling():
    state = good_state()
    check_state(state)
    del state["loss_scaler"]["growth_tracker"]
    with pytest.raises(ValueError, match="loss_scaler.growth_tracker is missing"):
        check_state(state)
    state = good_state()
    state["options"]["loss_scale"] = "none"
    with pytest.raises(ValueError, match="loss_scaler is present, but options.loss_scale"):
        check_state(state)


def test_a_checkpoint_with_a_bad_scale_is_refused_naming_the_file_and_key(tmp_path):
    t = make(NumpyBackend(), **dynamic())
    path = tmp_path / "bad.gguf"
    checkpoint.save_checkpoint(path, t.cfg, t.parameters(), ByteTokenizer(),
                            t.optimizer_state(), {**t.state().to_json(), "loss_scaler": {
                                "scale": -4.0, "growth_tracker": 0, "skipped_steps": 0}})
    with pytest.raises(GGUFError) as e:
        checkpoint.load_checkpoint(path)
    assert str(path) in str(e.value) and "loss_scaler.scale must be in" in str(e.value)


def test_a_state_written_before_loss_scaling_loads_with_its_defaults():
    state = good_state()
    for key in ("loss_scale", "loss_scale_init", "loss_scale_growth_interval"):
        del state["options"][key]
    del state["loss_scaler"]
    check_state(state)
    options = TrainOptions(**state["options"])
    assert options.loss_scale == "auto" and options.precision == "f32"
    assert make(NumpyBackend(), loss_scaler=None).scaler is None    # auto: none on f32
    t = make(NumpyBackend(), loss_scaler=None, **dynamic(loss_scale_init=8.0))
    assert t.scaler.state() == {"scale": 8.0, "growth_tracker": 0, "skipped_steps": 0}


@pytest.mark.parametrize("options, message", [
    (dict(loss_scale="static"), "option loss_scale must be one of auto, none, dynamic"),
    (dict(loss_scale_init=1000.0), "option loss_scale_init must be a power of two"),
    (dict(loss_scale_init=2.0 ** 127), "option loss_scale_init must be in"),
    (dict(loss_scale_growth_interval=0), "option loss_scale_growth_interval must be in"),
    (dict(optimizer="lbfgs", loss_scale="dynamic"),
     "option loss_scale dynamic does not work with optimizer lbfgs"),
])
def test_loss_scale_options_refuse_what_they_cannot_do(options, message):
    with pytest.raises(ValueError) as e:
        TrainOptions(**options)
    assert message in str(e.value)


def test_the_training_loop_goes_on_past_overflows_and_logs_the_scale(tmp_path):
    """--on-nan stop is for a loss that is not finite: the scaler's skips are routine."""
    from ggwgpu.training.run import run_steps
    t = make(NumpyBackend(), **dynamic(loss_scale_init=2.0 ** 126))
    log = tmp_path / "log.jsonl"
    run_steps(t, 3, log_path=str(log), save_checkpoint=lambda: None, on_nan="stop")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["skipped"], r["overflow"], r["loss_scale"]) for r in records] == \
        [(True, True, 2.0 ** (126 - i)) for i in range(3)]


def test_two_ranks_reach_the_same_scale_decisions_as_one_process(tmp_path, mpiexec):
    """The finite flag comes from the summed gradients, so every rank skips the same steps
    and keeps the same scale: the same weights on both, and the scales of one process."""
    ranks = run_worker(mpiexec, tmp_path, "numpy", 4, 2, 6, loss_scale=2.0 ** 66)
    assert list(ranks[0]["digests"]) == list(ranks[1]["digests"])
    assert list(ranks[0]["scales"]) == list(ranks[1]["scales"])
    one = make_trainer(NumpyBackend(), 4, 2, None, loss_scale=2.0 ** 66)
    records = [one.train_step() for _ in range(6)]
    assert list(ranks[0]["scales"]) == [r["loss_scale"] for r in records]
    assert records[0]["skipped"] and not all(r["skipped"] for r in records)
    np.testing.assert_allclose(ranks[0]["losses"], [r["loss"] for r in records], rtol=1e-6)
    for name, value in one.parameters().items():
        np.testing.assert_allclose(ranks[0][name], value, rtol=0, atol=2e-5, err_msg=name)


def test_the_train_command_resumes_a_scaled_checkpoint_with_its_scaler(tmp_path):
    """No option turns scaling on yet; a checkpoint whose options do is resumed with its
    scale and growth tracker, and the log shows the scale of every step."""
    from click.testing import CliRunner
    from ggwgpu_cli.main import cli
    text, ckpt, log = tmp_path / "text.txt", tmp_path / "ckpt.gguf", tmp_path / "log.jsonl"
    text.write_text(TEXT)
    args = ["--backend", "numpy", "train", str(text),
            *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()), "--batch", "4",
            "--out", str(tmp_path / "out.gguf")]
    r = CliRunner().invoke(cli, [*args, "--steps", "1", "--checkpoint-out", str(ckpt)])
    assert r.exit_code == 0, r.output
    cfg, values, tok, opt_state, state = checkpoint.load_checkpoint(ckpt)
    state = state.to_json()
    state["options"].update(dynamic(loss_scale_growth_interval=3))
    state["loss_scaler"] = {"scale": 2.0 ** 10, "growth_tracker": 2, "skipped_steps": 0}
    checkpoint.save_checkpoint(ckpt, cfg, values, tok, opt_state, state)
    r = CliRunner().invoke(cli, [*args, "--steps", "4", "--checkpoint-in", str(ckpt),
                                 "--checkpoint-out", str(ckpt), "--log", str(log)])
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["loss_scale"] for r in records] == [2.0 ** 10] + [2.0 ** 11] * 3
    assert checkpoint.load_checkpoint(ckpt)[4].loss_scaler == {
        "scale": 2.0 ** 12, "growth_tracker": 0, "skipped_steps": 0}   # grown after step 5
