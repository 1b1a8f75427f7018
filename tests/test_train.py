"""Training: the schedule, the loss falling on both backends, the backends agreeing, exact
resume from a checkpoint, and the `ggwgpu train` command."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggwgpu import data, gguf_io
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.models.llama import LlamaConfig, init_parameters
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.train import Trainer, TrainOptions, schedule
from ggwgpu_cli.main import cli

TINY = dict(n_embd=16, n_head=2, n_layer=2, n_ff=32, n_ctx=16)
TEXT = data.bundled_corpus()[:20000]


def trainer(backend, steps=0, options=None, **state):
    tok = ByteTokenizer()
    cfg = LlamaConfig(n_vocab=tok.n_vocab, **TINY)
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
    path = tmp_path / "ckpt.gguf"
    gguf_io.save_checkpoint(path, first.cfg, first.parameters(), ByteTokenizer(),
                            first.optimizer_state(), first.state())
    cfg, values, _, opt_state, state = gguf_io.load_checkpoint(path)
    resumed, tail = trainer(backend, steps=3, options=TrainOptions(**state["options"]),
                            values=values, opt_state=opt_state, step=state["step"],
                            data=state["data"])
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
    cfg, values, tok, = gguf_io.load_model(out)
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


def test_train_command_takes_the_vocabulary_of_a_gguf(tmp_path):
    first = tmp_path / "first.gguf"
    assert train_cli(tmp_path, "--steps", "1", "--out", str(first)).exit_code == 0
    r = train_cli(tmp_path, "--steps", "2", "--vocab-model", str(first),
                  "--out", str(tmp_path / "second.gguf"))
    assert r.exit_code == 0, r.output
    _, _, tok = gguf_io.load_model(tmp_path / "second.gguf")
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
    assert parts.state()["samples"] == whole.state()["samples"] == 12
