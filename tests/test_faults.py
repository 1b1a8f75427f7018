"""Training faults lose nothing (issue 8): SIGINT and SIGTERM save a checkpoint and print how
to go on; SIGKILL at random moments always leaves a checkpoint that loads and resumes the
same trajectory; a step with a non-finite loss or gradient changes nothing and stops the run
(or is skipped); a failing device, or a tensor over its limits, is a clear error that keeps
the last checkpoint."""
import errno
import json
import os
import shlex
import stat
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ggwgpu import data, gguf_file, gguf_llama
from ggwgpu.training import checkpoint
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.backends.wgpu_backend import DeviceLimitError, WgpuBackend
from ggwgpu.models import ModelConfig, TrainGraph, init_parameters
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.training import Trainer, TrainOptions
from ggwgpu.training.run import PrintReporter, TrainingError, run_steps
from ggwgpu_cli import main as cli_main

TINY = dict(n_embd=16, n_head=2, n_layer=2, n_ff=32, n_ctx=16)
TINY_ARGS = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
TEXT = data.bundled_corpus()[:20000]
KILL_POINTS = 8          # SIGKILLs of one training run, each resumed from its checkpoint
WAIT_S = 120             # only a hung subprocess takes this long: the test then fails


# -- helpers --------------------------------------------------------------------------------

def train_args(tmp_path, *args) -> list[str]:
    """`ggwgpu train` of the tiny llama on the numpy backend (bit-exact on resume)."""
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text(TEXT)
    return ["--backend", "numpy", "train", str(text), *TINY_ARGS, "--batch", "4",
            "--warmup", "5", "--lr", "3e-3", *args]


def run_cli(args):
    return CliRunner().invoke(cli_main.cli, args)


def spawn(args) -> subprocess.Popen:
    """The CLI in a subprocess of its own, as a user runs it (`python -m ggwgpu`: the
    installed package, as the tests import it)."""
    return subprocess.Popen([sys.executable, "-m", "ggwgpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(log: Path) -> list[dict]:
    """The log's complete lines (a line being written has no newline yet)."""
    lines = log.read_text().split("\n")[:-1] if log.exists() else []
    return [json.loads(line) for line in lines]


def wait_for_step(proc, log: Path, skip: int, step: int):
    """Wait until `proc` has logged a step >= `step` in the lines after the first `skip`."""
    deadline = time.monotonic() + WAIT_S
    while not any(r["step"] >= step for r in records(log)[skip:]):
        if proc.poll() is not None:
            pytest.fail(f"training ended (status {proc.returncode}) before step {step}: "
                        f"{proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no step {step} after {WAIT_S} s")
        time.sleep(0.005)


def checkpoint_step(path) -> int:
    """Load the checkpoint completely (it must be whole) and return its step."""
    _, values, _, opt_state, state = checkpoint.load_checkpoint(path)
    assert all(np.isfinite(v).all() for v in values.values())
    return state.step


def tiny_trainer(backend, options, values=None):
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    samples = data.Samples(tok.encode(TEXT), cfg.n_ctx, options.batch, options.seed, tok.bos_id)
    return Trainer(cfg, values or init_parameters(cfg, seed=1), backend, options, samples)


def poison_targets(monkeypatch, calls):
    """Make a target weight of the given micro-batches (0-based count of TrainGraph.feeds
    calls) infinite: a bad batch, as far as the loss can tell."""
    real, count = TrainGraph.feeds, iter(range(10**9))

    def feeds(graph, *args, **kwargs):
        out = real(graph, *args, **kwargs)
        if next(count) in calls:
            out[graph.weights][0, 0] = np.inf
        return out
    monkeypatch.setattr(TrainGraph, "feeds", feeds)


# -- SIGINT, SIGTERM ------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_at_the_step_boundary_and_prints_how_to_go_on(tmp_path, signum):
    log, out = tmp_path / "log.jsonl", tmp_path / "model.gguf"
    proc = spawn(train_args(tmp_path, "--steps", "5000", "--log", str(log), "--out", str(out)))
    wait_for_step(proc, log, 0, 3)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + signum, stderr
    done = records(log)[-1]["step"]
    name = signal.Signals(signum).name
    assert f"{name}: stopped after step {done}" in stderr
    default = tmp_path / "model.checkpoint.gguf"      # no --checkpoint-out: next to --out
    assert f"saved to {default}" in stderr and checkpoint_step(default) == done
    assert not out.exists()                            # the run did not finish
    if signum != signal.SIGINT:
        return
    # the printed command continues the run (here for two steps instead of the rest)
    command = shlex.split(stderr.split("continue with:\n", 1)[1].strip().splitlines()[0])
    assert command[0] == "ggwgpu" and command[command.index("--checkpoint-in") + 1] == str(default)
    assert command[command.index("--steps") + 1] == str(5000 - done)
    resumed = spawn(command[1:] + ["--steps", "2"])
    stdout, stderr = resumed.communicate(timeout=WAIT_S)
    assert resumed.returncode == 0, stderr
    assert f"resuming at step {done}" in stdout
    assert [r["step"] for r in records(log)] == list(range(1, done + 3))
    assert out.exists()


def test_signals_while_a_checkpoint_is_written_wait_for_it(tmp_path, monkeypatch):
    """The first SIGINT comes during step 3; a second one while the checkpoint of step 3 is
    being written must neither abort nor spoil it."""
    real_step, real_save = Trainer.train_step, checkpoint.save_checkpoint

    def train_step(self):
        record = real_step(self)
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    def save_checkpoint(*args):
        if args[-1].step == 3:                        # the train state
            os.kill(os.getpid(), signal.SIGINT)       # handled right here, mid-save
        real_save(*args)
    before = signal.getsignal(signal.SIGINT)    # SIG_IGN in a background job, else Python's
    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(checkpoint, "save_checkpoint", save_checkpoint)
    ckpt = tmp_path / "ckpt.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "50", "--checkpoint-out", str(ckpt),
                           "--save-every", "2", "--out", str(tmp_path / "m.gguf")))
    assert r.exit_code == 130, r.output
    assert "SIGINT: stopped after step 3" in r.output
    assert checkpoint_step(ckpt) == 3
    assert signal.getsignal(signal.SIGINT) is before      # restored


# -- SIGKILL --------------------------------------------------------------------------------

def test_sigkill_at_random_moments_keeps_a_checkpoint_that_resumes_exactly(tmp_path):
    """One 48-step run, killed KILL_POINTS times (after a seeded random step plus a random
    part of a step) while it writes a checkpoint every step, and resumed each time from the
    checkpoint it left. Each checkpoint loads whole and is at most one step behind the log;
    the losses of every step (replayed ones included) and the final weights are bit-exact
    those of a run that was never interrupted."""
    steps = 48
    ref_log, ref_out = tmp_path / "ref.jsonl", tmp_path / "ref.gguf"
    straight = spawn(train_args(tmp_path, "--steps", str(steps), "--log", str(ref_log),
                                "--out", str(ref_out)))
    _, stderr = straight.communicate(timeout=WAIT_S)
    assert straight.returncode == 0, stderr
    reference = {rec["step"]: rec["loss"] for rec in records(ref_log)}

    rng = np.random.default_rng(8)
    targets = sorted(rng.choice(np.arange(2, 37), KILL_POINTS, replace=False))
    ckpt, log, out = tmp_path / "ckpt.gguf", tmp_path / "log.jsonl", tmp_path / "model.gguf"
    kills = mid_write = 0
    while True:
        done = checkpoint_step(ckpt) if ckpt.exists() else 0
        resume = ["--checkpoint-in", str(ckpt)] if ckpt.exists() else []
        skip = len(records(log))
        proc = spawn(train_args(tmp_path, "--steps", str(steps - done), "--save-every", "1",
                                "--checkpoint-out", str(ckpt), "--log", str(log),
                                "--out", str(out), *resume))
        if kills == KILL_POINTS:
            _, stderr = proc.communicate(timeout=WAIT_S)
            assert proc.returncode == 0, stderr
            break
        wait_for_step(proc, log, skip, targets[kills])
        time.sleep(rng.uniform(0, 0.03))
        proc.kill()
        proc.communicate(timeout=WAIT_S)
        assert proc.returncode == -signal.SIGKILL      # killed before it was done
        kills += 1
        logged = records(log)[-1]["step"]
        assert checkpoint_step(ckpt) in (logged - 1, logged)
        mid_write += len(list(tmp_path.glob(f".{ckpt.name}.*.tmp")))   # a write cut short
    assert kills == KILL_POINTS
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    print(f"SIGKILL: {kills} kill points tried, {mid_write} during a checkpoint write; "
          f"every checkpoint loaded and resumed bit-exact")
    logged = records(log)
    assert {rec["step"] for rec in logged} == set(range(1, steps + 1))
    for rec in logged:
        assert rec["loss"] == reference[rec["step"]], rec
    _, want, _ = gguf_llama.load_model(ref_out)
    _, got, _ = gguf_llama.load_model(out)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


# -- non-finite steps -----------------------------------------------------------------------

@pytest.mark.parametrize("backend_name,accum,clip", [("numpy", 1, 1.0), ("numpy", 2, 0.0),
                                                     ("wgpu", 2, 0.0)])
def test_a_non_finite_step_is_skipped_without_a_trace(backend_name, accum, clip, monkeypatch,
                                                      request):
    """Step 2's first micro-batch has an infinite target: its record says skipped, nothing
    changed, and step 3 is exactly the step 3 of a run that never saw step 2's batches (the
    NaN did not stay in the gradient sums). Without clipping only the gate makes the finite
    gradients (the embedding rows of tokens not in the batch) skip too."""
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    options = TrainOptions(batch=4 // accum, grad_accum=accum, lr=3e-3, warmup=2,
                           grad_clip=clip)
    clean, hit = tiny_trainer(backend, options), tiny_trainer(backend, options)
    for t in (clean, hit):
        assert not t.train_step()["skipped"]
    before = hit.parameters(), hit.optimizer_state()
    poison_targets(monkeypatch, {0})       # counted from here: step 2's first micro-batch
    record = hit.train_step()
    assert record["skipped"] and not np.isfinite(record["loss"])
    for name, value in before[0].items():
        assert np.array_equal(hit.parameters()[name], value), name
    for name, (m, v) in before[1].items():
        assert np.array_equal(hit.optimizer_state()[name][0], m)
        assert np.array_equal(hit.optimizer_state()[name][1], v)
    for _ in range(accum):                 # the clean run leaves step 2 out by hand
        clean.batches.next_batch()
    clean.step += 1
    a, b = clean.train_step(), hit.train_step()
    assert not b["skipped"] and np.isfinite(b["grad_norm"])
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for name, value in clean.parameters().items():
        assert np.array_equal(hit.parameters()[name], value), name


@pytest.mark.parametrize("backend_name,optimizer", [("numpy", "adamw"), ("wgpu", "adamw"),
                                                    ("wgpu", "sgd")])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
def test_a_non_finite_gradient_skips_the_whole_step(backend_name, optimizer, bad, monkeypatch,
                                                    request):
    """The loss is finite but one gradient element is NaN, +inf or -inf: the step counts as
    skipped and no weight or moment changes, not even where the gradients are finite. No
    clipping, so only the finite flag (append_finite_flag) can make those skip."""
    import ggwgpu as gg
    from ggwgpu.training import trainer as train
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    poison, real = gg.input_tensor((1,), name="poison"), train.build_backward

    def poisoned(*args, **kwargs):  # the first gradient gets `poison` added to every element
        grads = real(*args, **kwargs)
        first = next(iter(grads))
        grads[first] = gg.add(grads[first], poison)
        return grads
    monkeypatch.setattr(train, "build_backward", poisoned)
    t = tiny_trainer(backend, TrainOptions(optimizer=optimizer, batch=4, lr=3e-3, warmup=2,
                                           grad_clip=0.0))
    t.plan.write(poison, [0.0])
    assert not t.train_step()["skipped"]
    before = t.parameters(), t.optimizer_state()
    t.plan.write(poison, [bad])
    record = t.train_step()
    assert record["skipped"] and np.isfinite(record["loss"]) and t.step == 2
    assert not np.isfinite(record["grad_norm"])
    for name, value in before[0].items():
        assert np.array_equal(t.parameters()[name], value), name
    for name, (m, v) in before[1].items():
        assert np.array_equal(t.optimizer_state()[name][0], m), name
        assert np.array_equal(t.optimizer_state()[name][1], v), name
    assert (optimizer == "sgd") == (before[1] == {})
    t.plan.write(poison, [0.0])            # and the next clean step updates every weight
    assert not t.train_step()["skipped"]
    assert all(not np.array_equal(t.parameters()[n], v) for n, v in before[0].items())


def test_a_non_finite_step_stops_the_run_and_saves_the_state_before_it(tmp_path, monkeypatch):
    before = tmp_path / "two.gguf"
    assert run_cli(train_args(tmp_path, "--steps", "2", "--out", str(before))).exit_code == 0
    poison_targets(monkeypatch, {2})       # step 3
    out = tmp_path / "model.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "10", "--out", str(out)))
    assert r.exit_code == 1
    assert "step 3: loss inf" in r.output and "training stops (--on-nan stop" in r.output
    default = tmp_path / "model.checkpoint.gguf"
    assert checkpoint_step(default) == 3 and "--checkpoint-in" in r.output
    assert not out.exists()
    _, want, _ = gguf_llama.load_model(before)
    _, got, _ = gguf_llama.load_model(default)    # step 3 changed nothing
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


def test_on_nan_skip_goes_on_past_a_non_finite_step(tmp_path, monkeypatch):
    poison_targets(monkeypatch, {2, 3})    # steps 3 and 4 (two micro-batches each: step 2)
    log, out = tmp_path / "log.jsonl", tmp_path / "model.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "4", "--grad-accum", "2", "--batch", "2",
                           "--on-nan", "skip", "--log", str(log), "--out", str(out)))
    assert r.exit_code == 0, r.output
    assert [rec["skipped"] for rec in records(log)] == [False, True, False, False]
    assert "step 2: loss inf" in r.output and "(--on-nan skip)" in r.output
    _, values, _ = gguf_llama.load_model(out)
    assert all(np.isfinite(v).all() for v in values.values())


def test_a_diverging_run_never_writes_a_non_finite_value(tmp_path):
    """lr 1e38: the first update makes the weights huge, the next gradients overflow."""
    ckpt, out = tmp_path / "ckpt.gguf", tmp_path / "model.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "6", "--lr", "1e38", "--warmup", "1",
                           "--checkpoint-out", str(ckpt), "--save-every", "1",
                           "--out", str(out)))
    assert r.exit_code == 1 and "not finite" in r.output
    assert not out.exists()
    checkpoint_step(ckpt)                  # whole and finite


# -- device failures ------------------------------------------------------------------------

def test_a_tensor_over_the_device_limits_is_refused_when_planning(wgpu, monkeypatch):
    options = TrainOptions(batch=4, lr=3e-3, warmup=2)
    limits = dict(wgpu.storage_limits)
    # token_embd (256 x 16 floats, 16 KiB) is one of the largest tensors of the tiny llama
    monkeypatch.setattr(wgpu, "storage_limits", {**limits, "max-buffer-size": 8192})
    with pytest.raises(DeviceLimitError, match=r"needs \d+ bytes, more than the device's "
                                               r"max buffer size \(max-buffer-size\) of 8192"):
        tiny_trainer(wgpu, options)
    monkeypatch.setattr(wgpu, "storage_limits",
                        {**limits, "max-storage-buffer-binding-size": 4096})
    with pytest.raises(DeviceLimitError, match="max-storage-buffer-binding-size") as e:
        tiny_trainer(wgpu, options)
    assert "tensor " in str(e.value)


@pytest.mark.parametrize("command", [["eval", "--corpus", "tempest", "--samples", "2"],
                                     ["generate", "-p", "To be", "-n", "2"]])
def test_eval_and_generate_over_the_device_limits_say_so_in_one_line(wgpu, monkeypatch,
                                                                     tmp_path, command):
    """DeviceLimitError is the user's message in every command (train and finetune mapped
    it; eval, generate and chat said "internal error")."""
    from test_families import FAMILIES, family_file
    model = family_file(tmp_path / "m.gguf", FAMILIES["qwen3"])
    monkeypatch.setattr(wgpu, "storage_limits",
                        {**wgpu.storage_limits, "max-storage-buffer-binding-size": 4096})
    monkeypatch.setenv(cli_main.TRACEBACK_VAR, "0")
    r = CliRunner().invoke(cli_main.cli, ["--backend", "wgpu", command[0], str(model),
                                          *command[1:], "--n-ctx", "8"])
    assert r.exit_code == 1 and "internal error" not in r.output, r.output
    assert "max-storage-buffer-binding-size" in r.output and "tensor " in r.output, r.output


def test_logits_over_the_binding_limit_train_in_row_chunks_that_fit(wgpu, monkeypatch):
    """4 x 16 rows of 259 logits are 66 KiB; under a 32 KiB binding limit the step splits
    them into 3 chunks and trains as the unsplit step does (to float32 noise)."""
    options = TrainOptions(batch=4, lr=3e-3, warmup=2)
    whole = tiny_trainer(wgpu, options)
    monkeypatch.setattr(wgpu, "storage_limits",
                        {**wgpu.storage_limits, "max-storage-buffer-binding-size": 32768})
    split = tiny_trainer(wgpu, options)
    assert len(whole.graph.logits) == 1 and len(split.graph.logits) == 3
    for _ in range(3):
        a, b = whole.train_step(), split.train_step()
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]


def test_the_train_command_refuses_a_model_over_the_device_limits(tmp_path, wgpu, monkeypatch):
    monkeypatch.setattr(wgpu, "storage_limits", {"max-buffer-size": 4096})
    args = train_args(tmp_path, "--steps", "1", "--out", str(tmp_path / "m.gguf"))
    r = run_cli(["--backend", "wgpu", *args[2:]])
    assert r.exit_code == 1
    assert "more than the device's max buffer size" in r.output and "Traceback" not in r.output


def test_a_lost_device_is_a_clear_error_and_the_last_checkpoint_stays(tmp_path, wgpu):
    backend = WgpuBackend()                # a device of its own, to lose
    trainer = tiny_trainer(backend, TrainOptions(batch=4, lr=3e-3, warmup=2))
    ckpt = tmp_path / "ckpt.gguf"

    def save_checkpoint():
        checkpoint.save_checkpoint(ckpt, trainer.cfg, trainer.parameters(), ByteTokenizer(),
                                trainer.optimizer_state(), trainer.state())
        if trainer.step == 2:
            backend.device.destroy()       # as a driver reset or a lost GPU would
    with pytest.raises(TrainingError) as e:
        run_steps(trainer, 5, save_every=1, save_checkpoint=save_checkpoint,
                  checkpoint_path=str(ckpt))
    assert "the device failed in step 3" in str(e.value)
    assert f"{ckpt} holds the checkpoint of step 2" in str(e.value)
    assert checkpoint_step(ckpt) == 2


# -- nothing the user has is destroyed ------------------------------------------------------

def base_model(path):
    """A tiny byte-vocabulary llama GGUF (a finetune's BASE)."""
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    gguf_llama.save_model(path, cfg, init_parameters(cfg, seed=1), tok)
    return path


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def command_line(message: str) -> list[str]:
    """The command a message prints on the line after 'with:'."""
    return shlex.split(message.split("with:\n", 1)[1].strip().splitlines()[0])


OVERWRITES = {   # a command whose output is one of its inputs -> words of the refusal
    "train --out TEXT": (["train", "{t}", "--out", "{t}"], "--out {t} is the input TEXTS {t}"),
    "finetune --out BASE": (["finetune", "{b}", "{t}", "--out", "{b}"],
                            "--out {b} is the input BASE {b}"),
    "finetune --checkpoint-out BASE": (["finetune", "{b}", "{t}", "--checkpoint-out", "{b}"],
                                       "--checkpoint-out {b} is the input BASE {b}"),
    "finetune --data D --out D": (["finetune", "{b}", "--data", "{d}", "--out", "{d}"],
                                  "--out {d} is the input --data {d}"),
    "finetune --out X --checkpoint-out X": (
        ["finetune", "{b}", "{t}", "--out", "{x}", "--checkpoint-out", "{x}"], "are one file"),
    "train --log MODEL": (["train", "{t}", "--out", "{x}", "--log", "{b}"],
                          "--log {b} is a GGUF file, not a JSONL log"),
    "train --log TEXT": (["train", "{t}", "--out", "{x}", "--log", "{t}"], "--log {t}"),
    "merge --out (a hard link of BASE)": (["merge", "{b}", "{t}", "--out", "{h}"],
                                          "--out {h} is the input BASE {b}"),
    "quantize TARGET (a symlink to SOURCE)": (["quantize", "{b}", "{s}"],
                                              "TARGET {s} is the input SOURCE {b}"),
    "plot --out LOG": (["plot", "{l}", "--out", "{l}"], "--out {l} is the input LOG {l}"),
}


@pytest.mark.parametrize("case", list(OVERWRITES))
def test_no_command_writes_over_its_input(tmp_path, case):
    """An output that is an input of the same command (by device and inode: a hard link or a
    symlink is caught too), or another output, or a --log that is no log, is refused before
    any work, and every file stays as it was."""
    files = dict(t=tmp_path / "text.txt", b=tmp_path / "base.gguf", x=tmp_path / "x.gguf",
                 d=tmp_path / "d.jsonl", h=tmp_path / "hard.gguf", s=tmp_path / "soft.gguf",
                 l=tmp_path / "log.jsonl")
    files["t"].write_text(TEXT)
    base_model(files["b"])
    files["d"].write_text('{"text": "To be, or not to be"}\n' * 8)
    files["l"].write_text('{"step": 1, "loss": 5.0}\n')
    os.link(files["b"], files["h"])
    files["s"].symlink_to(files["b"].name)
    before = snapshot(tmp_path)
    args, words = OVERWRITES[case]
    args = [a.format(**files) for a in args]
    if args[0] in ("train", "finetune"):     # should the check fail, a short run follows
        args += ["--steps", "1", "--batch", "2"] + (TINY_ARGS if args[0] == "train" else [])
    r = run_cli(["--backend", "numpy", *args])
    assert r.exit_code == 2, r.output
    assert words.format(**files) in r.output and "Traceback" not in r.output
    assert " on numpy" not in r.output            # refused before any work
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args", [
    ["train", "{t}", "--out", "{f}"],
    ["finetune", "{b}", "{t}", "--checkpoint-out", "{f}"],
    ["quantize", "{b}", "{f}"],
    ["demo", "baby-llama", "--png", "{f}"],
])
def test_no_output_replaces_a_device_or_fifo_node(tmp_path, args):
    """Outputs are new files renamed into place: onto a device node (as root, /dev/null or
    /dev/zero) that would replace the device. A FIFO stands in for one here."""
    files = dict(t=tmp_path / "text.txt", b=tmp_path / "base.gguf", f=tmp_path / "fifo")
    files["t"].write_text(TEXT)
    base_model(files["b"])
    os.mkfifo(files["f"])
    args = [a.format(**files) for a in args]
    if args[0] in ("train", "finetune"):
        args += ["--steps", "1", "--batch", "2"] + (TINY_ARGS if args[0] == "train" else [])
    r = run_cli(["--backend", "numpy", *args])
    assert r.exit_code == 2, r.output
    assert f"{files['f']} exists and is not a regular file" in r.output
    assert stat.S_ISFIFO(os.lstat(files["f"]).st_mode)
    with pytest.raises(gguf_file.GGUFError, match="exists and is not a regular file"):
        gguf_llama.save_model(files["f"], *gguf_llama.load_model(files["b"])[:2], ByteTokenizer())
    assert stat.S_ISFIFO(os.lstat(files["f"]).st_mode)


def test_an_output_directory_that_cannot_be_written_fails_before_training(tmp_path,
                                                                          monkeypatch):
    """(As root a chmod does not stop writing: the probe itself is made to fail.)"""
    from ggwgpu_cli import outputs

    def refuse(path):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(outputs, "create_and_remove", refuse)
    r = run_cli(train_args(tmp_path, "--steps", "2", "--out", str(tmp_path / "m.gguf")))
    assert r.exit_code == 2
    assert f"--out {tmp_path / 'm.gguf'}: cannot write in {tmp_path} (Permission denied)" \
        in r.output
    assert "train on" not in r.output


def test_a_signal_during_the_final_write_waits_for_it(tmp_path, monkeypatch):
    """Two SIGINTs while the model is written: the handlers are still there, so the write
    completes and the run ends well (before, the first one killed it: the run was lost)."""
    real = gguf_llama.save_model

    def save_model(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        real(*args, **kwargs)
    before = signal.getsignal(signal.SIGINT)    # SIG_IGN in a background job, else Python's
    monkeypatch.setattr(gguf_llama, "save_model", save_model)
    out = tmp_path / "m.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "3", "--out", str(out)))
    assert r.exit_code == 0, r.output
    assert f"model written to {out}" in r.output
    gguf_llama.load_model(out)
    assert signal.getsignal(signal.SIGINT) is before      # restored


def test_a_final_write_on_a_full_disk_keeps_the_weights_in_a_checkpoint(tmp_path,
                                                                         monkeypatch):
    """The model's write fails with ENOSPC: the run says the disk is full, saves the
    checkpoint next to it and prints the command that writes the model from it, which
    does (the same weights)."""
    from gguf import GGUFWriter
    real = GGUFWriter.write_tensors_to_file

    def full_disk(self, *args, **kwargs):
        if self.path.name.startswith(".m.gguf."):      # the model's temporary file only
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", full_disk)
    out = tmp_path / "m.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "3", "--out", str(out)))
    assert r.exit_code == 1
    assert f"{out} was not written" in r.output
    assert f"the disk holding {tmp_path} is full (no space left on device)" in r.output
    ckpt = tmp_path / "m.checkpoint.gguf"
    assert checkpoint_step(ckpt) == 3 and not out.exists()
    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", real)
    command = command_line(r.output)
    assert command[command.index("--steps") + 1] == "0"
    r = run_cli(command[1:])
    assert r.exit_code == 0, r.output
    _, want, _, _, _ = checkpoint.load_checkpoint(ckpt)
    _, got, _ = gguf_llama.load_model(out)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


def test_a_best_weights_write_on_a_full_disk_keeps_the_run_in_a_checkpoint(tmp_path,
                                                                          monkeypatch):
    """OUT.best.gguf's write fails with ENOSPC: as --out's, the run saves its checkpoint
    (that disk has room) and prints the command that continues it."""
    from gguf import GGUFWriter
    from test_cli import tiny_base
    real = GGUFWriter.write_tensors_to_file

    def full_disk(self, *args, **kwargs):
        if self.path.name.startswith(".a.best.gguf."):     # the best adapter's only
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", full_disk)
    base = tiny_base(tmp_path / "base.gguf")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                            for i in range(20)))
    r = run_cli(["--backend", "numpy", "finetune", str(base), "--data", str(data), "--n-ctx",
                 "16", "--batch", "2", "--steps", "4", "--val-split", "0.25", "--val-every",
                 "2", "--out", str(tmp_path / "a.gguf")])
    assert r.exit_code == 1
    assert "step 2: the best weights were not written" in r.output, r.output
    ckpt = tmp_path / "a.checkpoint.gguf"
    assert f"checkpoint of step 2 saved to {ckpt}" in r.output and ckpt.exists()
    command = command_line(r.output)
    assert command[command.index("--steps") + 1] == "2"


def test_the_command_after_a_stop_on_the_last_step_is_valid(tmp_path, monkeypatch):
    """A non-finite last step stops the run with 0 steps left: the printed command (once
    --steps 0, which was refused) writes the model from the checkpoint."""
    poison_targets(monkeypatch, {2})       # step 3 of 3
    out = tmp_path / "m.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "3", "--out", str(out)))
    assert r.exit_code == 1 and "step 3: loss inf" in r.output
    command = command_line(r.output)
    assert command[command.index("--steps") + 1] == "0"
    monkeypatch.undo()
    r = run_cli(command[1:])
    assert r.exit_code == 0, r.output
    assert f"model of step 3 written to {out}" in r.output
    gguf_llama.load_model(out)


def test_two_runs_cannot_write_one_checkpoint(tmp_path):
    ckpt, log = tmp_path / "ckpt.gguf", tmp_path / "log.jsonl"
    first = spawn(train_args(tmp_path, "--steps", "5000", "--checkpoint-out", str(ckpt),
                             "--log", str(log), "--out", str(tmp_path / "a.gguf")))
    try:
        wait_for_step(first, log, 0, 1)
        r = run_cli(train_args(tmp_path, "--steps", "2", "--checkpoint-out", str(ckpt),
                               "--out", str(tmp_path / "b.gguf")))
        assert r.exit_code == 2
        assert f"another run (process {first.pid}) is writing --checkpoint-out {ckpt}" \
            in r.output
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=WAIT_S)
    assert first.returncode == 128 + signal.SIGTERM
    assert not Path(f"{ckpt}.lock").exists()           # released (and removed) at the end
    r = run_cli(train_args(tmp_path, "--steps", "1", "--checkpoint-in", str(ckpt),
                           "--checkpoint-out", str(ckpt), "--out", str(tmp_path / "b.gguf")))
    assert r.exit_code == 0, r.output


def test_a_resumed_run_refuses_contradicting_options_and_says_what_it_changes(tmp_path):
    ckpt, out = tmp_path / "ckpt.gguf", tmp_path / "m.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "2", "--checkpoint-out", str(ckpt),
                           "--out", str(out)))
    assert r.exit_code == 0, r.output
    resume = ["--backend", "numpy", "train", str(tmp_path / "text.txt"), "--checkpoint-in",
              str(ckpt), "--checkpoint-out", str(ckpt), "--out", str(out), "--steps", "1"]
    for given, fixed in ((["--batch", "2"], "--batch 4 (given: 2)"),
                         (["--n-layer", "3"], "--n-layer 2 (given: 3)"),
                         (["--warmup", "9", "--optimizer", "sgd"],
                          "--optimizer adamw (given: sgd), --warmup 5 (given: 9)")):
        r = run_cli(resume + given)
        assert r.exit_code == 2 and f"{ckpt} fixes the model" in r.output
        assert f"contradict it: {fixed}" in r.output
    r = run_cli(resume + TINY_ARGS + ["--batch", "4", "--lr", "1e-3"])   # the same: fine
    assert r.exit_code == 0, r.output
    assert "resuming with --lr 0.001 instead of the checkpoint's 0.003" in r.output
    assert checkpoint.load_checkpoint(ckpt)[4].options.lr == 1e-3


def test_temp_files_of_killed_writes_are_removed_by_the_next_write_of_that_file(tmp_path):
    """Only .NAME.ggwgpu-PID-HEX.tmp of this target and of a process that is gone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    names = {f".ckpt.gguf.ggwgpu-{gone.pid}-0123abcd.tmp": False,     # removed
             f".ckpt.gguf.ggwgpu-{os.getpid()}-0123abcd.tmp": True,    # a live writer's
             f".other.gguf.ggwgpu-{gone.pid}-0123abcd.tmp": True,     # another target's
             f".ckpt.gguf.ggwgpu-{gone.pid}-notours.tmp": True,
             f".ckpt.gguf.{gone.pid}.0123abcd.tmp": True, "ckpt.gguf.tmp": True}
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    gguf_llama.save_model(tmp_path / "ckpt.gguf", cfg, init_parameters(cfg), tok)
    for name, kept in names.items():
        assert (tmp_path / name).exists() == kept, name


@pytest.mark.parametrize("change, code, words", [
    (lambda s: s["options"].update(restarts=True, cos_decay_steps=0), 1,
     "key training.state_json: options.cos_decay_steps must be in [1, 1e+09], got 0"),
    (lambda s: s["options"].update(grad_accum=10 ** 9), 1, "options.grad_accum"),
    (lambda s: s["options"].update(optimizer="lion"), 1, "options.optimizer must be one of"),
    (lambda s: s.pop("options"), 1, "options is missing"),
    (lambda s: s["data"].update(position=10 ** 9), 2, "sample-order state out of range"),
])
def test_resuming_from_a_forged_state_is_a_clear_error(tmp_path, change, code, words):
    """What an adversarial tester put into training.state_json: a hang, a traceback or a
    silent acceptance before; an error naming the checkpoint and the key now."""
    ckpt = tmp_path / "ckpt.gguf"
    r = run_cli(train_args(tmp_path, "--steps", "1", "--checkpoint-out", str(ckpt),
                           "--out", str(tmp_path / "m.gguf")))
    assert r.exit_code == 0, r.output
    cfg, values, tok, opt_state, state = checkpoint.load_checkpoint(ckpt)
    state = state.to_json()
    change(state)
    checkpoint.save_checkpoint(ckpt, cfg, values, tok, opt_state, state)
    r = run_cli(train_args(tmp_path, "--steps", "1", "--checkpoint-in", str(ckpt),
                           "--out", str(tmp_path / "m.gguf")))
    assert r.exit_code == code and isinstance(r.exception, SystemExit)   # no traceback
    assert str(ckpt) in r.output and words in r.output, r.output


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_log_on_a_full_disk_is_reported_once_and_the_run_goes_on(tmp_path, capsys):
    """Every write to /dev/full fails with ENOSPC: the log is what is given up, not the run."""
    trainer = tiny_trainer(NumpyBackend(), TrainOptions(batch=4, lr=3e-3, warmup=2))
    ckpt = tmp_path / "ckpt.gguf"

    def save_checkpoint():
        checkpoint.save_checkpoint(ckpt, trainer.cfg, trainer.parameters(), ByteTokenizer(),
                                trainer.optimizer_state(), trainer.state())
    run_steps(trainer, 5, log_path="/dev/full", save_checkpoint=save_checkpoint,
              checkpoint_path=str(ckpt), reporter=PrintReporter())
    assert trainer.step == 5
    err = capsys.readouterr().err
    assert err.count("--log /dev/full: writing failed (the disk holding /dev/full is full "
                     "(no space left on device)); the run goes on without its log") == 1, err


def test_a_resumed_finetune_refuses_another_adapter_shape(tmp_path):
    base, ckpt, out = base_model(tmp_path / "base.gguf"), tmp_path / "c.gguf", tmp_path / "a.gguf"
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = ["--backend", "numpy", "finetune", str(base), str(text), "--batch", "2",
            "--checkpoint-out", str(ckpt), "--out", str(out), "--steps", "1"]
    r = run_cli(args + ["--lora-r", "2", "--lora-alpha", "3"])
    assert r.exit_code == 0, r.output
    resume = args + ["--checkpoint-in", str(ckpt)]
    r = run_cli(resume + ["--lora-r", "4", "--lora-alpha", "5"])
    assert r.exit_code == 2
    assert "contradict it: --lora-r, --lora-alpha 3.0 (given: 5.0)" in r.output
    r = run_cli(resume + ["--lora-alpha", "3", "--flash-attn"])     # the same alpha: fine
    assert r.exit_code == 0, r.output
    assert "resuming with --flash-attn True instead of the checkpoint's False" in r.output
