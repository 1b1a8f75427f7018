"""Training: the schedule, the loss falling on both backends, the backends agreeing, exact
resume from a checkpoint, and the `ggwgpu train` command."""
import json
import math
import threading
import types

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from ggwgpu import data, gguf_llama
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.models import ModelConfig, init_parameters
from ggwgpu.testing import through_checkpoint
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.training import Trainer, TrainOptions, schedule
from ggwgpu_cli.main import cli

TINY = dict(n_embd=16, n_head=2, n_layer=2, n_ff=32, n_ctx=16)
TEXT = data.bundled_corpus()[:20000]


def trainer(backend, steps=0, options=None, **state):
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    options = options or TrainOptions(batch=4, lr=3e-3, warmup=5)
    samples = data.Samples(tok.encode(TEXT), cfg.n_ctx, options.batch, options.seed, tok.bos_id)
    if "data" in state:
        samples.load_state(state["data"])
    t = Trainer(cfg, state.get("values", init_parameters(cfg, seed=1)), backend, options,
                samples, state.get("opt_state"), state.get("step", 0))
    losses = [t.train_step()["loss"] for _ in range(steps)]
    return t, losses


def test_schedule_warms_up_decays_and_restarts():
    o = TrainOptions(warmup=10, cos_decay_steps=100, cos_decay_min=0.1)
    assert schedule(0, o) == pytest.approx(0.1) and schedule(9, o) == pytest.approx(1.0)
    assert schedule(10, o) == pytest.approx(1.0)
    assert schedule(60, o) == pytest.approx(0.55)
    assert schedule(110, o) == pytest.approx(0.1) and schedule(5000, o) == pytest.approx(0.1)
    r = TrainOptions(warmup=0, cos_decay_steps=100, cos_decay_min=0.0, restarts=True,
                     cos_decay_restart=1.5)
    assert schedule(100, r) == pytest.approx(1.0)          # first restart
    assert schedule(175, r) == pytest.approx(0.5)          # middle of the 150-step period
    assert schedule(250, r) == pytest.approx(1.0)          # second restart, not truncated


def test_linear_and_constant_schedules_follow_trl_and_mlx():
    """linear: warmup, then a straight line to cos_decay_min over cos_decay_steps (TRL's
    get_linear_schedule_with_warmup with the floor at 0: 1 - t / period); constant: 1."""
    o = TrainOptions(warmup=10, cos_decay_steps=100, cos_decay_min=0.0, lr_schedule="linear")
    assert schedule(9, o) == pytest.approx(1.0) and schedule(10, o) == pytest.approx(1.0)
    assert schedule(35, o) == pytest.approx(0.75) and schedule(109, o) == pytest.approx(0.01)
    assert schedule(110, o) == 0.0 and schedule(10 ** 6, o) == 0.0
    floor = TrainOptions(warmup=0, cos_decay_steps=4, cos_decay_min=0.2, lr_schedule="linear")
    assert [schedule(s, floor) for s in range(6)] == pytest.approx([1, 0.8, 0.6, 0.4, 0.2, 0.2])
    c = TrainOptions(warmup=4, lr_schedule="constant")
    assert [schedule(s, c) for s in (0, 3, 4, 10 ** 6)] == pytest.approx([0.25, 1, 1, 1])
    with pytest.raises(ValueError, match="restarts restarts a cosine schedule, not a linear"):
        TrainOptions(lr_schedule="linear", restarts=True)
    with pytest.raises(ValueError, match="lr_schedule must be one of cosine, linear"):
        TrainOptions(lr_schedule="cos")


def looped_schedule(step, o):
    """The schedule as a loop over restarts (what schedule() was): the reference."""
    t, period = step - o.warmup, float(o.cos_decay_steps)
    if t < 0:
        return (step + 1) / o.warmup
    while o.restarts and t >= period:
        t, period = t - period, period * o.cos_decay_restart
    if t >= period:
        return o.cos_decay_min
    return o.cos_decay_min + (1 - o.cos_decay_min) * 0.5 * (1 + math.cos(math.pi * t / period))


@pytest.mark.parametrize("growth", [1.0, 1.01, 1.5, 2.0, 3.7])
@pytest.mark.parametrize("period", [1, 3, 100])
def test_the_closed_form_schedule_equals_the_loop_over_restarts(growth, period):
    o = TrainOptions(warmup=4, cos_decay_steps=period, cos_decay_min=0.05, restarts=True,
                     cos_decay_restart=growth)
    for step in range(0, 3000, 7):
        # the loop's sums drift at a period's end, where both are at 1 or at the minimum
        assert schedule(step, o) == pytest.approx(looped_schedule(step, o), abs=1e-6), step


def test_no_schedule_input_loops():
    """A forged checkpoint's {restarts: true, cos_decay_steps: 0} looped forever (Ctrl-C did
    not stop it): no options are accepted that way now, and schedule() has no loop anyway,
    whatever its input (checked in a thread: a loop would outlive the join)."""
    with pytest.raises(ValueError, match="option cos_decay_steps must be in"):
        TrainOptions(restarts=True, cos_decay_steps=0)
    results = []

    def work():
        for growth in (1.0, 1 + 2 ** -52, 1.0001, 2.0, 1000.0):
            o = TrainOptions(warmup=0, cos_decay_steps=1, restarts=True,
                             cos_decay_restart=growth)
            results.extend(schedule(step, o) for step in (0, 10 ** 6, 2 ** 62, 2 ** 63 - 1))
        forged = types.SimpleNamespace(warmup=0, cos_decay_steps=0, restarts=True,
                                       cos_decay_restart=1.0, cos_decay_min=0.1,
                                       lr_schedule="cosine")
        for bad in ({}, {"cos_decay_steps": float("nan")}, {"cos_decay_restart": 1e300},
                    {"cos_decay_restart": float("nan"), "cos_decay_steps": 5}):
            with pytest.raises(ValueError):
                schedule(10 ** 9, types.SimpleNamespace(**{**vars(forged), **bad}))
        results.append("done")
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and results[-1] == "done"
    assert all(0.1 <= r <= 1.0 for r in results[:-1])


@pytest.mark.parametrize("field,value,message", [
    ("grad_accum", 10 ** 9, "option grad_accum must be in [1, 65536]"),
    ("batch", 0, "option batch must be in [1, 65536]"),
    ("optimizer", "adam", "option optimizer must be one of adamw, sgd"),
    ("lr", float("inf"), "option lr must be a finite number"),
    ("lr", "1e-3", "option lr must be a number"),
    ("beta2", 1.0, "option beta2 must be in [0, 1)"),
    ("restarts", 1, "option restarts must be true or false"),
    ("seed", -1, "option seed must be in [0, 4.29497e+09]"),
    ("warmup", True, "option warmup must be an integer"),
])
def test_train_options_refuse_what_their_bounds_do_not_hold(field, value, message):
    with pytest.raises(ValueError) as e:
        TrainOptions(**{field: value})
    assert message in str(e.value)


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_the_cli_takes_its_training_option_ranges_from_the_same_bounds(command):
    """One declaration: each TrainOptions bound is the range of the command's option."""
    params = {p.name: p for p in cli.commands[command].params}
    for name, bound in TrainOptions.bounds().items():
        if TrainOptions.declared()[name]["cli"] not in (True, command):  # Python only, or
            assert name not in params                                     # the other's
            continue
        param = params[{"eps": "adam_eps"}.get(name, name)]
        if bound.kind is bool:
            continue
        if bound.kind is str:
            assert tuple(param.type.choices) == bound.choices
            continue
        assert (param.type.min, param.type.max) == (bound.low, bound.high), name
        assert (param.type.min_open, param.type.max_open) == (bound.low_open,
                                                              bound.high_open), name


def other_value(bound, default):
    """A value within `bound` that is not `default`."""
    if bound.kind is bool:
        return not default
    if bound.kind is str:
        return next(c for c in bound.choices if c != default)
    if default is None:                         # an optional value: any in the bound
        return bound.kind(bound.low + 1)
    middle = (bound.low + bound.high) / 2 if None not in (bound.low, bound.high) else default
    return next(v for v in (default + 1, default - 1, default / 2, default * 2, middle)
                if bound.kind(v) != default and bound.problem(bound.kind(v)) is None)


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_each_training_option_given_reaches_its_train_options_field(command):
    """One declaration: the command line gets an option for each TrainOptions field from its
    declaration, and the TrainOptions the command makes holds each value given."""
    from ggwgpu_cli.training import flag_of, train_options
    declared = {name: d for name, d in TrainOptions.declared().items()
                if d["cli"] in (True, command)}
    wanted = {name: other_value(d["bound"], d["default"]) for name, d in declared.items()}
    if command == "finetune":   # (neftune_alpha takes no objective with a reference model,
        wanted["objective"] = "simpo"   # cpo_alpha only cpo's and simpo's)
    del wanted["lr_schedule"]   # restarts (given: on) go with cosine only: checked alone below
    args = [__file__] if command == "finetune" else []      # BASE: any file parses
    for name, value in wanted.items():
        if isinstance(value, bool):
            on_off = (declared[name]["flag"] or flag_of(name)).split("/")
            assert value or len(on_off) == 2, f"{name}: no flag turns it off"
            args.append(on_off[0] if value else on_off[1])
        else:
            args += [flag_of(name), str(value)]
    ctx = cli.commands[command].make_context(command, args)
    options = train_options(ctx.params)
    for name, value in wanted.items():
        assert getattr(options, name) == pytest.approx(value) if isinstance(value, float) \
            else getattr(options, name) == value, name
    ctx = cli.commands[command].make_context(
        command, ([__file__] if command == "finetune" else []) + ["--lr-schedule", "linear"])
    assert train_options(ctx.params).lr_schedule == "linear"


def test_the_resume_command_repeats_the_run_options_given_and_no_training_option(tmp_path):
    """What a checkpoint does not hold (text, corpus, saving, logging) is repeated when not
    at its default; the training options and the model's shape, which it fixes, are not."""
    from ggwgpu_cli.training import resume_args
    text, log, ckpt = str(tmp_path / "t.txt"), str(tmp_path / "l.jsonl"), str(tmp_path / "c.gguf")
    (tmp_path / "t.txt").write_text("abc\n")
    args = [text, "--corpus", "macbeth", "--samples-after-nl", "--lr", "0.01", "--n-layer",
            "2", "--checkpoint-out", ckpt, "--save-every", "100", "--log", log, "--on-nan",
            "skip", "--flash-attn", "--out", str(tmp_path / "m.gguf")]
    ctx = cli.commands["train"].make_context("train", args, obj={"backend": "numpy"})
    assert resume_args(ctx, ["train"], ckpt, 7) == [
        "ggwgpu", "--backend", "numpy", "train", text, "--checkpoint-in", ckpt, "--steps", "7",
        "--corpus", "macbeth", "--samples-after-nl", "--checkpoint-out", ckpt, "--log", log,
        "--on-nan", "skip"]


def test_loss_falls_on_numpy():
    _, losses = trainer(NumpyBackend(), steps=40)
    assert np.mean(losses[-5:]) < 0.7 * losses[0]


def test_loss_falls_on_wgpu(wgpu):
    _, losses = trainer(wgpu, steps=40)
    assert np.mean(losses[-5:]) < 0.7 * losses[0]


def test_sgd_lowers_the_loss_and_keeps_no_moments(wgpu):
    options = TrainOptions(optimizer="sgd", batch=4, lr=0.5, warmup=5)
    t, losses = trainer(wgpu, steps=40, options=options)
    assert np.mean(losses[-5:]) < 0.8 * losses[0] and t.optimizer_state() == {}
    _, ref = trainer(NumpyBackend(), steps=3, options=options)
    np.testing.assert_allclose(losses[:3], ref, rtol=1e-4)


def test_wgpu_and_numpy_training_agree(wgpu):
    (_, a), (_, b) = trainer(wgpu, steps=5), trainer(NumpyBackend(), steps=5)
    np.testing.assert_allclose(a, b, rtol=1e-4)


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_resuming_from_a_checkpoint_continues_exactly(tmp_path, backend_name, request):
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    straight, losses = trainer(backend, steps=6)
    first, _ = trainer(backend, steps=3)
    cfg, values, _, opt_state, state = through_checkpoint(first, tmp_path / "ckpt.gguf",
                                                         ByteTokenizer())
    resumed, tail = trainer(backend, steps=3, options=state.options,
                            values=values, opt_state=opt_state, step=state.step,
                            data=state.data)
    # bit-exact on NumPy; on a device the same kernels run, so equal up to float tolerance
    np.testing.assert_allclose(tail, losses[3:], rtol=0 if backend_name == "numpy" else 1e-6)
    for name, value in straight.parameters().items():
        np.testing.assert_allclose(resumed.parameters()[name], value,
                                   rtol=0 if backend_name == "numpy" else 1e-5, atol=0)


def train_cli(tmp_path, *args):
    size = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    return CliRunner().invoke(cli, ["--backend", "numpy", "train", *size, "--batch", "4",
                                    "--warmup", "5", "--lr", "3e-3", *args])


def test_train_command_trains_logs_and_exports(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out, log = tmp_path / "model.gguf", tmp_path / "log.jsonl"
    r = train_cli(tmp_path, str(text), "--steps", "30", "--out", str(out), "--log", str(log))
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(1, 31))
    assert records[-1]["loss"] < records[0]["loss"]
    cfg, values, tok, = gguf_llama.load_model(out)
    assert cfg.n_layer == 2 and isinstance(tok, ByteTokenizer)
    assert "unigram entropy" in r.output


def test_train_command_resumes_from_its_checkpoint(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    ckpt, log = tmp_path / "ckpt.gguf", tmp_path / "log.jsonl"
    straight = tmp_path / "straight.jsonl"
    assert train_cli(tmp_path, str(text), "--steps", "6", "--log", str(straight),
                     "--out", str(tmp_path / "a.gguf")).exit_code == 0
    r = train_cli(tmp_path, str(text), "--steps", "3", "--checkpoint-out", str(ckpt),
                  "--log", str(log), "--out", str(tmp_path / "b.gguf"))
    assert r.exit_code == 0, r.output
    r = train_cli(tmp_path, str(text), "--steps", "3", "--checkpoint-in", str(ckpt),
                  "--log", str(log), "--out", str(tmp_path / "b.gguf"))
    assert r.exit_code == 0, r.output
    assert "resuming at step 3" in r.output
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert losses == [json.loads(line)["loss"] for line in straight.read_text().splitlines()]
    other = tmp_path / "other.txt"
    other.write_text(TEXT[::-1])
    r = train_cli(tmp_path, str(other), "--steps", "1", "--checkpoint-in", str(ckpt))
    assert r.exit_code == 2 and "other text" in r.output


def test_train_command_trains_a_mixture_of_experts_and_resumes_it(tmp_path):
    """--n-expert makes each feed-forward that many experts of --n-ff (Mixtral's llama, as
    llama.cpp loads it); a resumed run keeps them, and refuses another count."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    ckpt, out = tmp_path / "ckpt.gguf", tmp_path / "moe.gguf"
    r = train_cli(tmp_path, str(text), "--n-expert", "4", "--n-expert-used", "2", "--steps", "8",
                  "--checkpoint-out", str(ckpt), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "in 4 experts, 2 a token" in r.output
    cfg, values, _ = gguf_llama.load_model(out)
    assert cfg.arch == "llama" and (cfg.n_expert, cfg.n_expert_used) == (4, 2)
    assert values["blk.0.ffn_up_exps.weight"].shape == (4, TINY["n_ff"], TINY["n_embd"])
    assert GGUFReader(out).fields["llama.expert_count"].contents() == 4
    r = train_cli(tmp_path, str(text), "--steps", "2", "--checkpoint-in", str(ckpt),
                  "--out", str(tmp_path / "more.gguf"))
    assert r.exit_code == 0, r.output
    r = train_cli(tmp_path, str(text), "--n-expert", "8", "--steps", "2", "--checkpoint-in",
                  str(ckpt))
    assert r.exit_code == 2 and "--n-expert 4 (given: 8)" in r.output
    r = train_cli(tmp_path, str(text), "--n-expert", "2", "--n-expert-used", "3")
    assert r.exit_code == 2 and "n_expert_used 3 must be 1 .. n_expert 2" in r.output


def test_train_command_takes_the_vocabulary_of_a_gguf(tmp_path):
    first = tmp_path / "first.gguf"
    assert train_cli(tmp_path, "--steps", "1", "--out", str(first)).exit_code == 0
    r = train_cli(tmp_path, "--steps", "2", "--vocab-model", str(first),
                  "--out", str(tmp_path / "second.gguf"))
    assert r.exit_code == 0, r.output
    _, _, tok = gguf_llama.load_model(tmp_path / "second.gguf")
    assert tok.gguf_metadata() == ByteTokenizer().gguf_metadata()


def test_train_command_refuses_bad_options(tmp_path):
    r = train_cli(tmp_path, "--n-embd", "15")
    assert r.exit_code == 2 and "not divisible" in r.output
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = train_cli(tmp_path, str(empty))
    assert r.exit_code == 2 and "empty" in r.output


def test_plot_writes_a_png_or_says_what_it_needs(tmp_path, monkeypatch):
    """matplotlib is in the test extra: the PNG is always checked, never skipped."""
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": i, "loss": 5 - i / 10, "lr": 1e-3}) + "\n"
                           for i in range(1, 20)))
    r = CliRunner().invoke(cli, ["plot", str(log)])
    assert r.exit_code == 0, r.output
    png = (tmp_path / "log.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000   # a drawn figure
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    r = CliRunner().invoke(cli, ["plot", str(log)])
    assert r.exit_code == 1 and "pip install 'ggwgpu[plot]'" in r.output


def test_the_log_is_strict_json_a_nan_loss_null_and_plot_draws_the_finite_steps(tmp_path):
    from ggwgpu.training.run import Reporter, RunLog
    log = tmp_path / "log.jsonl"
    steps = RunLog(log, Reporter())
    for i, loss in enumerate([5.0, float("nan"), 4.5, float("inf"), 4.0], 1):
        steps.write({"step": i, "loss": loss, "grad_norm": [loss, 1.0]})
    steps.close()
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the log"))
              for line in log.read_text().splitlines()]
    assert [r["loss"] for r in strict] == [5.0, None, 4.5, None, 4.0]
    assert strict[1]["grad_norm"] == [None, 1.0]
    r = CliRunner().invoke(cli, ["plot", str(log)])
    assert r.exit_code == 0, r.output
    log.write_text(json.dumps({"step": 1, "loss": None}) + "\n")
    r = CliRunner().invoke(cli, ["plot", str(log)])
    assert r.exit_code == 1 and "no training records with a finite loss" in r.output
    log.write_text(json.dumps({"step": 1, "loss": 1e308}) + "\n" +
                   json.dumps({"step": 2, "loss": -1e308}) + "\n")
    r = CliRunner().invoke(cli, ["plot", str(log)])
    assert r.exit_code == 1 and "span -1e+308 to 1e+308, too wide to draw" in r.output


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_accumulating_two_micro_batches_equals_one_double_batch(optimizer):
    lr = 3e-3 if optimizer == "adamw" else 0.3
    whole, a = trainer(NumpyBackend(np.float64), steps=3,
                       options=TrainOptions(optimizer=optimizer, batch=4, lr=lr, warmup=2))
    parts, b = trainer(NumpyBackend(np.float64), steps=3,
                       options=TrainOptions(optimizer=optimizer, batch=2, grad_accum=2, lr=lr,
                                            warmup=2))
    np.testing.assert_allclose(a, b, rtol=1e-6)
    for name, value in whole.parameters().items():
        np.testing.assert_allclose(parts.parameters()[name], value, rtol=1e-5, atol=1e-7)
    assert parts.state().samples == whole.state().samples == 12


@pytest.mark.parametrize("options", [
    dict(), dict(checkpointing=True, flash_attn=True, grad_accum=2),
    dict(optimizer="sgd", precision="f16"), dict(optimizer="lbfgs", batch=2)])
def test_numpy_storage_reuse_reads_nothing_a_kernel_did_not_write(monkeypatch, options):
    """The NumPy plan keeps its blocks in one array, sharing bytes by liveness: a block's
    first tenant finds what the array held, later ones what the last tenant left. With the
    array filled with NaN bytes, every loss and weight is the same to the bit as with every
    block on bytes of its own, zeroed: no kernel reads what it did not write. And the shared
    blocks take much less than their sum."""
    from ggwgpu import alloc
    from ggwgpu.backends import base
    from ggwgpu.backends.numpy_backend import NumpyPlan
    options = TrainOptions(batch=options.pop("batch", 4), lr=3e-3, warmup=5, **options)
    runs = []
    for reuse, fill in ((False, 0), (True, 0xFF)):
        monkeypatch.setattr(NumpyPlan, "_arena", staticmethod(
            lambda n, fill=fill: np.full(n, fill, np.uint8)))
        monkeypatch.setattr(base, "pack", alloc.pack if reuse else lambda blocks, **kw: (
            alloc.pack([alloc.Block(b.key, b.nbytes, -1, 2 ** 40) for b in blocks], **kw)))
        t, losses = trainer(NumpyBackend(), steps=3, options=options)
        runs.append((losses, t.parameters(), t.plan))
    (losses, weights, apart), (reused_losses, reused_weights, plan) = runs
    assert losses == reused_losses and all(np.isfinite(losses))
    for name, w in weights.items():
        np.testing.assert_array_equal(w, reused_weights[name], err_msg=name)
    assert not apart.layout.reused and plan.layout.reused
    # (apart sums every block: with the products' epilogues, and the causal mask inside the
    # softmax, there are fewer temporaries to sum, the shared bytes the same as with an add
    # or scale node each and a masked copy of the scores: 0.563 of the sum, 0.540 with the
    # masked copy, 0.495 with those nodes too)
    assert plan.layout.total_bytes < 0.6 * apart.layout.total_bytes


def test_a_large_text_and_a_large_model_say_what_takes_a_while(tmp_path, monkeypatch):
    """Tokenizing a large corpus and planning a large model's step take seconds: a line on
    stderr says which stage is under way (the thresholds are lowered for this test)."""
    from click.testing import CliRunner

    from ggwgpu.training import inputs
    from ggwgpu_cli.main import cli
    monkeypatch.setattr(inputs, "LARGE_TEXT", 1000)
    monkeypatch.setattr(inputs, "LARGE_MODEL", 1000)
    (tmp_path / "t.txt").write_text(TEXT)
    r = CliRunner().invoke(cli, ["--backend", "numpy", "train", str(tmp_path / "t.txt"),
                                 "--steps", "1", "--n-layer", "1", "--batch", "2",
                                 "--out", str(tmp_path / "m.gguf")])
    assert r.exit_code == 0, r.output
    assert f"tokenizing {len(TEXT) / 1e6:.1f} M characters ..." in r.stderr
    assert "planning the train step of 0 M parameters ..." in r.stderr
