"""L-BFGS: faster than Adam on a convex problem, its direction the two-loop recursion of a
float64 reference, a failed line search reported and undone, and exact resume."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

import ggwgpu as gg
from ggwgpu import ops as O
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.graph import build_backward
from ggwgpu import data, gguf_file
from ggwgpu.training import checkpoint
from ggwgpu.training.lbfgs import Lbfgs, LbfgsOptions, two_loop_reference
from ggwgpu.models import ModelConfig, init_parameters
from ggwgpu.testing import through_checkpoint
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.training import Trainer, TrainOptions
from ggwgpu_cli.main import cli

TINY = dict(n_embd=8, n_head=2, n_layer=1, n_ff=16, n_ctx=8)
TEXT = data.bundled_corpus()[:5000]


def least_squares(seed=0, rows=40, cols=12):
    """A least-squares loss of w [1, cols], ill-conditioned (condition number ~1e3) along
    axes that are not the coordinate axes, which Adam's per-element scaling cannot undo."""
    rng = np.random.default_rng(seed)
    rotation = np.linalg.qr(rng.normal(size=(cols, cols)))[0]
    a = (rng.normal(size=(rows, cols)) * np.logspace(0, 1.5, cols)) @ rotation
    b = rng.normal(size=(rows, 1))
    w = gg.param(np.zeros((1, cols)), name="w")
    loss = O.scale(O.sum(O.sqr(O.sub(O.mul_mat(w, gg.constant(a)), gg.constant(b)))),
                   1 / rows)
    best = np.linalg.lstsq(a, b, rcond=None)[0]
    return w, loss, float(((a @ best - b) ** 2).sum() / rows)


def lbfgs_plan(backend, w, loss, **options):
    lb = Lbfgs([w], build_backward(loss, [w]), loss, LbfgsOptions(**options))
    lb.attach(backend.plan([loss, *lb.outputs]))
    return lb


def test_lbfgs_needs_fewer_evaluations_than_adam_on_a_convex_problem(wgpu):
    w, loss, optimum = least_squares()
    lb = lbfgs_plan(wgpu, w, loss)
    record = lb.iterate()
    target = optimum + 1e-3 * (record["loss"] - optimum)
    while record["new_loss"] > target and lb.evaluations < 500:
        record = lb.iterate()
        assert record["status"].kind != "failed", record
    assert record["new_loss"] <= target
    lbfgs_evals = lb.evaluations

    def adam_evaluations(lr):
        w, loss, _ = least_squares()
        hp = gg.input_tensor((9,))
        step = O.opt_step_adamw(w, build_backward(loss, [w])[w], gg.constant(np.zeros(w.shape)),
                                gg.constant(np.zeros(w.shape)), hp, False)
        plan = wgpu.plan([loss, step])
        for t in range(1, 2001):   # each run evaluates the loss before its update
            plan.run({hp: [*O.adamw_hparams(lr, 0.9, 0.999, 1e-8, 0.0, t), 1.0, 1.0]})
            if plan.read(loss)[0] <= target:
                return t
        return 2001
    adam = min(adam_evaluations(lr) for lr in (0.01, 0.03, 0.1, 0.3))
    assert lbfgs_evals < adam / 2, (lbfgs_evals, adam)   # measured: 46 against 127


@pytest.mark.parametrize("linesearch", ["armijo", "wolfe", "strong-wolfe"])
def test_every_line_search_converges_and_the_stopping_tests_say_why(linesearch):
    w, loss, optimum = least_squares()
    lb = lbfgs_plan(NumpyBackend(np.float64), w, loss, linesearch=linesearch, past=3,
                    delta=1e-6)
    for _ in range(200):
        record = lb.iterate()
        if record["status"].kind != "ok":
            break
    assert str(record["status"]).startswith("converged: the loss fell by less than 1e-06")
    assert record["new_loss"] - optimum < 1e-5
    lb = lbfgs_plan(NumpyBackend(np.float64), *least_squares()[:2], max_no_improvement=1)
    lb.iterate()
    lb.best = 0.0      # as if a lower loss had been seen
    assert str(lb.iterate()["status"]) == "converged: 1 iterations without a lower loss"


def test_a_failed_line_search_says_why_and_puts_x_back():
    w, loss, _ = least_squares()
    # the first trial (a unit-length step) overshoots: one evaluation allowed is not enough
    lb = lbfgs_plan(NumpyBackend(np.float64), w, loss, max_linesearch=1)
    record = lb.iterate()
    assert str(record["status"]).startswith("failed: no step met the strong-wolfe conditions")
    np.testing.assert_array_equal(lb.plan.read(w), np.zeros((1, 12)))
    assert record["new_loss"] == record["loss"] and lb.k == 0


def test_on_fail_reset_drops_the_history_and_retries_along_the_gradient():
    w, loss, _ = least_squares()
    lb = lbfgs_plan(NumpyBackend(np.float64), w, loss, on_fail="reset")
    for _ in range(3):
        assert str(lb.iterate()["status"]) == "ok"
    before = lb.plan.read(w)
    lb.options.ftol, lb.options.max_linesearch = 0.99, 2    # now no step can pass Armijo
    record = lb.iterate()
    assert "after dropping the history: no step met" in record["status"].why
    assert record["evaluations"] == 5 and not lb.rho.any()
    np.testing.assert_array_equal(lb.plan.read(w), before)


def llama_trainer(backend, steps=0, opt_state=None, **state):
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    options = TrainOptions(optimizer="lbfgs", batch=2, lbfgs_m=3)
    samples = data.Samples(tok.encode(TEXT), cfg.n_ctx, options.batch, options.seed, tok.bos_id)
    if "data" in state:
        samples.load_state(state["data"])
    t = Trainer(cfg, state.get("values", init_parameters(cfg, seed=1)), backend, options,
                samples, opt_state, state.get("step", 0))
    return t, [t.train_step() for _ in range(steps)]


def test_the_llama_direction_is_the_two_loop_recursion_in_float64(wgpu):
    t, records = llama_trainer(wgpu, steps=5)   # 5 iterations fill the 3 slots
    assert all(str(r["status"]) == "ok" for r in records), records
    lb, plan = t.regime.lbfgs, t.plan
    assert lb.rho.all() and lb.n == sum(p.nelements for p in t.graph.params.values())
    plan.run({lb.coef: lb.coefficients()}, stage=lb.stages["direction"])
    g = plan.read(lb.G).astype(np.float64)
    s, y = (np.stack(plan.read_many(h)).astype(np.float64) for h in (lb.S, lb.Y))
    np.testing.assert_allclose(lb.rho, 1 / np.einsum("jn,jn->j", s, y), rtol=1e-4)
    ref = two_loop_reference(g, s, y, lb.rho, lb.gamma)
    d = plan.read(lb.D)
    assert np.linalg.norm(d - ref) < 1e-4 * np.linalg.norm(ref)
    assert np.abs(ref + g).max() > 1e-3 * np.abs(g).max()   # the history mattered


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_lbfgs_resumes_exactly_from_a_checkpoint(tmp_path, backend_name, request):
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    straight, records = llama_trainer(backend, steps=6)
    first, _ = llama_trainer(backend, steps=3)
    cfg, values, _, opt_state, state = through_checkpoint(first, tmp_path / "ckpt.gguf",
                                                         ByteTokenizer())
    resumed, tail = llama_trainer(backend, steps=3, opt_state=opt_state, values=values,
                                  step=state.step, data=state.data)
    exact = 0 if backend_name == "numpy" else 1e-6
    np.testing.assert_allclose([r["loss"] for r in tail], [r["loss"] for r in records[3:]],
                               rtol=exact)
    assert [r["evaluations"] for r in tail] == [r["evaluations"] for r in records[3:]]
    for name, value in straight.parameters().items():
        np.testing.assert_allclose(resumed.parameters()[name], value, rtol=exact * 10,
                                   atol=0)


def test_train_command_stops_on_a_failed_line_search_with_a_checkpoint(tmp_path):
    size = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    out = tmp_path / "m.gguf"
    # Armijo with ftol 0.85 and one evaluation: the first step cannot pass
    result = CliRunner().invoke(cli, ["--backend", "numpy", "train", *size, "--batch", "2",
                                      "--steps", "3", "--optimizer", "lbfgs",
                                      "--lbfgs-max-linesearch", "1", "--lbfgs-ftol", "0.85",
                                      "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "step 1: the L-BFGS line search failed (no step met" in result.output
    assert (tmp_path / "m.checkpoint.gguf").exists() and not out.exists()
    _, values, _, opt_state, state = checkpoint.load_checkpoint(tmp_path / "m.checkpoint.gguf")
    cfg = ModelConfig(n_vocab=ByteTokenizer().n_vocab, **TINY)
    for name, value in init_parameters(cfg, 0).items():
        np.testing.assert_array_equal(values[name], value)    # the weights went back
    assert not np.any(opt_state["lbfgs"]["memory_s"])        # and no pair was added


def test_train_command_refuses_lbfgs_options_that_cannot_work(tmp_path):
    run = lambda *a: CliRunner().invoke(cli, ["--backend", "numpy", "train", "--optimizer",
                                              "lbfgs", "--out", str(tmp_path / "m.gguf"), *a])
    assert "ftol (0.95) < wolfe (0.9)" in run("--lbfgs-ftol", "0.95").output
    assert "no --grad-accum" in run("--grad-accum", "2").output


def test_baby_llama_demo_trains_both_and_draws_the_wave(tmp_path):
    png = tmp_path / "wave.png"
    result = CliRunner().invoke(cli, ["--backend", "numpy", "demo", "baby-llama",
                                      "--seconds", "0.5", "--png", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "--png needs matplotlib" in result.output
        return
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    table = lines[lines.index(next(l for l in lines if "adam loss" in l)) + 1:][:11]
    first, last = [float(v) for v in table[0].split()], [float(v) for v in table[-1].split()]
    assert first[1] == first[2] and last[1] < first[1] and last[2] < first[2]
    assert "lbfgs continues the wave" in result.output and png.stat().st_size > 1000


def test_a_checkpoint_refuses_an_lbfgs_history_that_does_not_fit(tmp_path):
    t, _ = llama_trainer(NumpyBackend(), steps=1)
    state = t.optimizer_state()["lbfgs"]
    save = lambda lbfgs: checkpoint.save_checkpoint(tmp_path / "c.gguf", t.cfg, t.parameters(),
                                                 ByteTokenizer(), {"lbfgs": lbfgs}, t.state())
    with pytest.raises(gguf_file.GGUFError, match="optimizer.lbfgs.memory_s has shape"):
        save({**state, "memory_s": state["memory_s"][:, 1:]})
    with pytest.raises(gguf_file.GGUFError, match="lbfgs rho must be 3 numbers"):
        save({**state, "scalars": {**state["scalars"], "rho": [1.0]}})
    with pytest.raises(ValueError, match=r"history memory_s: shape \(2, \d+\), expected \(3, "):
        t.regime.lbfgs.load_state({**state, "memory_s": state["memory_s"][1:]})
    state["memory_y"][0, 0] = np.nan
    with pytest.raises(gguf_file.GGUFError, match="memory_y holds non-finite"):
        save(state)


def test_a_checkpoint_whose_state_contradicts_itself_is_refused(tmp_path, monkeypatch):
    """Well-typed but inconsistent: the options name another optimizer than the state the
    file holds (an AdamW checkpoint relabelled lbfgs resumed without its moments), ftol
    above wolfe, a NaN best."""
    t, _ = llama_trainer(NumpyBackend(), steps=1)
    history = t.optimizer_state()
    path = tmp_path / "c.gguf"

    def refused(opt_state, match, **options):
        state = t.state().to_json()
        state["options"] = {**state["options"], **options}
        checkpoint.save_checkpoint(path, t.cfg, t.parameters(), ByteTokenizer(), opt_state,
                                   state)
        with pytest.raises(gguf_file.GGUFError, match=match):
            checkpoint.load_checkpoint(path)
    moments = {n: (np.zeros_like(v), np.zeros_like(v)) for n, v in t.parameters().items()}
    refused(history, "optimizer is adamw but the file holds L-BFGS history", optimizer="adamw")
    refused(moments, "optimizer is lbfgs but the file holds AdamW moments")
    refused(moments, "optimizer is sgd but the file holds AdamW moments", optimizer="sgd")
    refused({}, "optimizer is lbfgs but the file holds no optimizer state")
    refused(history, "lbfgs_ftol 0.95 must be below options.lbfgs_wolfe 0.9", lbfgs_ftol=0.95)
    # a NaN best, as a forged file holds it (the writer refuses one)
    nan_best = {**history["lbfgs"], "scalars": {**history["lbfgs"]["scalars"],
                                                 "best": float("nan")}}
    with monkeypatch.context() as forge:
        forge.setattr(checkpoint, "check_scalars", lambda sc, m: sc)
        forge.setattr(checkpoint.json, "dumps", lambda v, **kw: json.JSONEncoder().encode(v))
        checkpoint.save_checkpoint(path, t.cfg, t.parameters(), ByteTokenizer(),
                                   {"lbfgs": nan_best}, t.state())
    with pytest.raises(gguf_file.GGUFError, match="best must be finite"):
        checkpoint.load_checkpoint(path)


def test_a_checkpoint_from_before_lbfgs_resumes_with_its_defaults():
    from ggwgpu.training import check_state
    t, _ = llama_trainer(NumpyBackend())
    state = t.state().to_json()
    state["options"] = {k: v for k, v in state["options"].items()
                        if not k.startswith(("lbfgs_", "opt_"))}
    state["options"]["optimizer"] = "adamw"
    assert TrainOptions(**check_state(state)["options"]).lbfgs_m == 6
    del state["options"]["lr"]
    with pytest.raises(ValueError, match="options.lr is missing"):
        check_state(state)


def test_baby_llama_png_never_replaces_a_device_or_a_directory(tmp_path):
    import os
    os.mkfifo(tmp_path / "fifo.png")
    for target, why in ((tmp_path / "fifo.png", "exists and is not a regular file"),
                        (tmp_path, "is a directory")):
        result = CliRunner().invoke(cli, ["--backend", "numpy", "demo", "baby-llama",
                                          "--seconds", "0.1", "--png", str(target)])
        assert result.exit_code == 2 and why in result.output, result.output
    assert os.path.exists(tmp_path / "fifo.png") and not os.path.isfile(tmp_path / "fifo.png")


def test_a_non_finite_direction_leaves_the_weights_as_before_the_step():
    """The line search fails on a direction of NaN (a history whose scalars overflowed):
    the weights are copied back, not moved by NaN * 0, and stay as the message says."""
    w, loss, _ = least_squares()
    lb = lbfgs_plan(NumpyBackend(), w, loss)
    for _ in range(3):
        assert str(lb.iterate()["status"]) == "ok"
    before = lb.plan.read(w).copy()
    lb.rho[-1] = np.inf                                   # a NaN direction
    record = lb.iterate()
    assert str(record["status"]).startswith("failed: not a descent direction"), record
    np.testing.assert_array_equal(lb.plan.read(w), before)
