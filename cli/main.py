"""The `ggwgpu` command: adapter info, the op test matrix, a demo fit, training; the
benchmarks are in bench.py.

Only absolute imports of `ggwgpu` here: this module runs as `ggwgpu_cli.main` when installed
and as `cli.main` from a source checkout.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import textwrap
import threading
import time
import warnings

import click
import numpy as np

import ggwgpu
from ggwgpu import testing
from ggwgpu.backends import CHOICES, ENV_VAR, get_backend
from ggwgpu.generate import Sampling

try:
    from .common import backend_choice, describe_backend, human_bytes, wgpu_or_reason
except ImportError:  # run as a script: python cli/main.py
    from common import backend_choice, describe_backend, human_bytes, wgpu_or_reason

# (adapter limit, label, is a size in bytes)
LIMITS = (
    ("max-storage-buffer-binding-size", "max storage buffer binding size", True),
    ("max-buffer-size", "max buffer size", True),
    ("max-compute-workgroups-per-dimension", "max compute workgroups per dimension", False),
    ("max-compute-invocations-per-workgroup", "max invocations per workgroup", False),
    ("max-compute-workgroup-storage-size", "max workgroup storage size", True),
    ("min-storage-buffer-offset-alignment", "min storage buffer offset alignment", True),
    ("max-storage-buffers-per-shader-stage", "max storage buffers per shader stage", False),
)


def select_backend(ctx):
    """The backend get_backend() picks for the --backend choice, as a click error if none."""
    from ggwgpu.backends.wgpu_backend import NoAdapterError
    name, by = backend_choice(ctx)
    try:
        # get_backend warns when auto falls back to NumPy: one plain line, not file:line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend = get_backend(name)
        for w in caught:
            click.echo(f"warning: {w.message}", err=True)
        return backend
    except NoAdapterError as e:
        raise click.ClickException(f"backend wgpu asked for by {by}, but {e}") from None
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ggwgpu.__version__, prog_name="ggwgpu")
@click.option("--backend", type=click.Choice(CHOICES, case_sensitive=False), default=None,
              help=f"Where graphs run. Default: ${ENV_VAR}, else auto (wgpu when an adapter "
                   "exists, else numpy).")
@click.pass_context
def cli(ctx, backend):
    """ggwgpu: ggml's training machinery as WGSL compute shaders on any WebGPU GPU."""
    ctx.obj = {"backend": backend}


# -- info -----------------------------------------------------------------------------------

@cli.command()
@click.pass_context
def info(ctx):
    """Show the WebGPU adapter and the backend ggwgpu will use.

    Adapter name, type and vendor, its key limits and features, where the WGSL shaders
    were found, and which backend graphs run on.
    """
    from ggwgpu.backends.wgpu_backend import shader_dir
    click.echo(f"ggwgpu {ggwgpu.__version__}")
    backend, why = wgpu_or_reason()
    if backend is None:
        click.echo(f"adapter: none ({why})")
    else:
        adapter, ai = backend.adapter, backend.info
        click.echo("adapter:")
        for label, value in (("device", ai.get("device")),
                             ("adapter type", ai.get("adapter_type")),
                             ("backend type", ai.get("backend_type")),
                             ("vendor", f"{ai.get('vendor') or '?'} "
                                        f"(id {ai.get('vendor_id', 0):#06x})"),
                             ("description", ai.get("description"))):
            click.echo(f"  {label:<14}{value}")
        click.echo("limits:")
        for key, label, is_bytes in LIMITS:
            value = adapter.limits.get(key)
            shown = human_bytes(value) if is_bytes and value is not None else value
            click.echo(f"  {label:<38}{shown}")
        features = sorted(str(f) for f in adapter.features)
        click.echo(f"features ({len(features)}):")
        click.echo(textwrap.fill(", ".join(features), width=88, initial_indent="  ",
                                 subsequent_indent="  ", break_on_hyphens=False))
    try:
        click.echo(f"shaders: {shader_dir()}")
    except FileNotFoundError as e:
        click.echo(f"shaders: not found ({e})")

    name, by = backend_choice(ctx)
    if name == "numpy":
        used = f"numpy (asked for by {by})"
    elif backend is not None:
        used = describe_backend(backend) + (f", asked for by {by}" if name == "wgpu" else "")
    elif name == "wgpu":
        used = f"none: wgpu asked for by {by}, but {why}"
    else:
        used = "numpy: no WebGPU adapter, so graphs run on the NumPy reference backend"
    click.echo(f"backend: {used}")


# -- ops test | grad ------------------------------------------------------------------------

def op_names(ctx, param, values) -> list[str]:
    names = []
    for value in values:
        name = value.lower()
        if name not in ggwgpu.OPS:
            raise click.BadParameter(f"unknown op {value!r}; valid ops: "
                                     f"{', '.join(sorted(ggwgpu.OPS))}")
        names.append(name)
    return names or list(ggwgpu.OPS)


op_option = click.option("--op", "names", multiple=True, callback=op_names, metavar="NAME",
                          help="Only this op (repeatable; RMS_NORM style accepted). "
                               "Default: every registered op.")


def run_cases(title: str, work) -> None:
    """Run `work` [(opdef, case, check)], print one line per case and a summary; exit 1 on
    any failure. A case that raises is a failure, not the end of the run."""
    descs = [testing.describe(case) for _, case, _ in work]
    op_w = max([len(opdef.name) for opdef, _, _ in work] + [2])
    case_w = min(36, max([len(d) for d in descs] + [4]))
    passed = failed = 0
    t0 = time.perf_counter()
    for (opdef, case, check), desc in zip(work, descs):
        try:
            result = check(opdef, case)
        except Exception as e:  # a broken kernel must not hide the other cases' results
            result = testing.Result(opdef.name, desc, False, f"{type(e).__name__}: {e}")
        passed, failed = passed + result.ok, failed + (not result.ok)
        status = "OK" if result.ok else click.style("FAIL", fg="red")
        click.echo(f"{result.op:<{op_w}}  {result.case:<{case_w}}  {status:<4}  {result.detail}")
    click.echo(f"{title}: {passed} passed, {failed} failed "
               f"({time.perf_counter() - t0:.1f} s)")
    if failed:
        raise SystemExit(1)


@cli.group()
def ops():
    """Check ops against their NumPy references.

    The op matrix of the test suite, as ggml's test-backend-ops: `ops test` for forward
    results, `ops grad` for gradients, optionally only for some ops (--op NAME).
    """


@ops.command("test")
@op_option
@click.pass_context
def ops_test(ctx, names):
    """Forward results of every case against the NumPy reference.

    Each case runs on the backend and is compared with the float64 NumPy reference: NaN and
    infinity placement, then normalized MSE; sentinels around every buffer catch stray writes.
    """
    backend = select_backend(ctx)
    work = [(ggwgpu.OPS[name], case, lambda o, c: testing.forward(o, c, backend))
            for name in names for case in testing.cases_of(name)]
    title = f"ops test on {describe_backend(backend)}"
    if backend.name != "wgpu":
        title += ": float32 references against float64 ones, no shader ran"
    run_cases(title, work)


def grad_check(backend):
    def check(opdef, case):
        fd = testing.finite_differences(opdef, case)
        if backend.name == "numpy":
            return fd
        dev = testing.backward_on(opdef, case, backend)
        return testing.Result(opdef.name, fd.case, fd.ok and dev.ok,
                              f"fd: {fd.detail}; {backend.name}: {dev.detail}")
    return check


@ops.command("grad")
@op_option
@click.pass_context
def ops_grad(ctx, names):
    """Backward of every gradient case against finite differences.

    The backward graph in float64 against central finite differences of the NumPy forward
    and, on a device backend, the device backward against the NumPy backward.
    """
    backend = select_backend(ctx)
    check = grad_check(backend)
    work = [(ggwgpu.OPS[name], case, check)
            for name in names for case in testing.cases_of(name, grad_only=True)]
    if backend.name == "numpy":
        title = "ops grad: finite differences only (numpy backend, no device backward)"
    else:
        title = f"ops grad: finite differences and backward on {describe_backend(backend)}"
    run_cases(title, work)


# -- demo -----------------------------------------------------------------------------------

@cli.command()
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1),
              help="Full-batch AdamW steps.")
@click.option("--lr", default=0.02, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True, type=int, help="Data and init seed.")
@click.pass_context
def demo(ctx, steps, lr, seed):
    """Fit a tiny MLP through the autodiff graph; the loss must fall.

    A 2-layer MLP regresses a fixed nonlinear function of random inputs. The graph
    (mul_mat, bias add, silu, mul_mat, mean squared error, its backward and an AdamW update
    of every parameter) is built and planned once; every step is one submission.
    """
    from ggwgpu.demo import fit_demo
    backend = select_backend(ctx)
    click.echo(f"demo on {describe_backend(backend)}: {steps} steps, lr {lr}, seed {seed}")
    t0 = time.perf_counter()
    history = fit_demo(backend, steps=steps, lr=lr, seed=seed, log=click.echo)
    first, last = history[0], history[-1]
    if not (np.isfinite(last) and last < first):
        raise click.ClickException(f"loss did not fall: {first:.6g} -> {last:.6g} "
                                   f"(try a smaller --lr)")
    click.echo(f"loss fell from {first:.6f} to {last:.6f} ({first / last:.0f}x) in {steps} "
               f"steps, {time.perf_counter() - t0:.1f} s")


# -- plot -----------------------------------------------------------------------------------

@cli.command()
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False),
              help="The PNG to write. Default: the log's name with .png.")
def plot(log, out):
    """Plot the loss (and learning rate) of a `train --log` JSONL file as a PNG.

    Needs matplotlib: pip install 'ggwgpu[plot]'.
    """
    import json
    from pathlib import Path
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("plot needs matplotlib: pip install 'ggwgpu[plot]'") from None
    records = []
    for number, line in enumerate(Path(log).read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise click.ClickException(f"{log}, line {number}: not JSON ({e})") from None
    if not records or not all("step" in r and "loss" in r for r in records):
        raise click.ClickException(f"{log} has no training records (step and loss)")
    out = out or str(Path(log).with_suffix(".png"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if all("lr" in r for r in records):
        lr_ax = ax.twinx()
        lr_ax.plot([r["step"] for r in records], [r["lr"] for r in records], color="gray",
                   linewidth=0.8, label="learning rate")
        lr_ax.set_ylabel("learning rate")
    ax.set_title(Path(log).name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    click.echo(f"wrote {out}")


# -- train ----------------------------------------------------------------------------------

def positive(kind=int):
    return click.IntRange(min=1) if kind is int else click.FloatRange(min=0, min_open=True)


def default_checkpoint_path(out: str) -> str:
    """Where a stopped run saves when no --checkpoint-out was given: next to the output,
    model.gguf -> model.checkpoint.gguf."""
    root, ext = os.path.splitext(out)
    return f"{root}.checkpoint{ext or '.gguf'}"


def existing_directory(ctx, param, value):
    """Option callback for output files: their directory must exist before training starts,
    not only when the result is written."""
    if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
        raise click.BadParameter(f"the directory of {value} does not exist")
    return value


def device_errors() -> tuple:
    """What a failing device raises: wgpu's errors (lost device, out of memory, validation,
    internal) and MemoryError (the host's, and wgpu's out-of-memory error is one too)."""
    try:
        import wgpu
    except ImportError:
        return (MemoryError,)
    return (wgpu.GPUError, MemoryError)


class StopSignals:
    """SIGINT and SIGTERM during training. The first asks for a stop at the next step
    boundary; a second one during a step stops at once (KeyboardInterrupt) without saving;
    any that arrive while a checkpoint is written (`saving()`) wait until it is complete.
    Python lets only the main thread install handlers; elsewhere nothing changes."""

    def __init__(self):
        self.signum, self._saving, self._previous = None, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum, frame):
        if self.signum is not None and not self._saving:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def saving(self):
        self._saving = True
        try:
            yield
        finally:
            self._saving = False


def training_loop(trainer, steps: int, log_path, save_every: int, save_checkpoint,
                  checkpoint_path=None, resume_command=None, on_nan: str = "stop"):
    """Run `steps` optimizer steps under a progress bar: a JSON line per step to `log_path`,
    `save_checkpoint()` every `save_every` steps (0: never) and once at the end. Returns the
    first and last loss and the seconds taken. The train and finetune commands share it.

    Nothing is lost when a run stops early. `save_checkpoint()` writes `checkpoint_path`
    (atomically: the previous file stays whole until the new one is complete) and
    `resume_command(steps_left)` is the command line that continues from it.
    - SIGINT, SIGTERM: the step under way finishes, a checkpoint is saved, the command that
      continues is printed and the process exits with 128 + the signal number.
    - A step whose loss or gradients are not finite changes nothing (Trainer skips its
      update); with on_nan "stop" the run then saves and ends with an error, with "skip" it
      goes on.
    - The device failing (lost, out of memory) ends the run with an error; nothing of the
      failed step is saved and the last checkpoint stays.
    - A checkpoint that cannot be written (a non-finite value, a full disk) ends the run; the
      previous one stays.
    """
    import json
    from ggwgpu.gguf_io import GGUFError
    start = trainer.step
    first = last = saved = None         # saved: the step of this run's last checkpoint
    t0, shown, signals = time.perf_counter(), {}, StopSignals()

    def kept() -> str:
        if saved is not None:
            return f"{checkpoint_path} holds the checkpoint of step {saved}"
        return "this run wrote no checkpoint"

    def save():
        nonlocal saved
        if saved == trainer.step:
            return
        with signals.saving():
            try:
                save_checkpoint()
            except (GGUFError, *device_errors()) as e:
                raise click.ClickException(f"step {trainer.step}: the checkpoint was not "
                                           f"written ({e}); {kept()}") from None
        saved = trainer.step

    def save_and_resume_hint() -> str:
        if checkpoint_path is None:
            return "no checkpoint path was given: nothing was saved"
        save()
        hint = f"checkpoint of step {trainer.step} saved to {checkpoint_path}"
        if resume_command is not None:
            hint += f"; continue with:\n  {resume_command(steps - (trainer.step - start))}"
        return hint

    log = open(log_path, "a") if log_path else None
    try:
        with signals, click.progressbar(length=steps, label="training", show_eta=True,
                                        item_show_func=lambda _: shown.get("text")) as bar:
            for _ in range(steps):
                try:
                    record = trainer.train_step()
                except device_errors() as e:
                    raise click.ClickException(
                        f"the device failed in step {trainer.step + 1} ({type(e).__name__}: "
                        f"{e}); nothing of that step was saved; {kept()}") from None
                elapsed = time.perf_counter() - t0
                record["tokens_per_s"] = trainer.step_tokens * (record["step"] - start) / elapsed
                first = record["loss"] if first is None else first
                last = record["loss"]
                shown["text"] = (f"step {record['step']} loss {last:.3f} "
                                 f"{record['tokens_per_s']:.0f} tok/s lr {record['lr']:.2e}")
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                if record["skipped"]:
                    what = (f"step {record['step']}: loss {record['loss']:.4g}, gradient "
                            f"norm {record['grad_norm']:.4g}: not finite, so its update was "
                            f"skipped")
                    if on_nan == "stop":
                        try:
                            hint = save_and_resume_hint()
                        except click.ClickException as e:
                            hint = e.message
                        raise click.ClickException(
                            f"{what} and training stops (--on-nan stop; --on-nan skip goes "
                            f"on without such steps). A learning rate that is too high is "
                            f"the usual cause. {hint}")
                    click.echo(f"\n{what} (--on-nan skip)", err=True)
                if save_every and record["step"] % save_every == 0:
                    save()
                bar.update(1)
                if signals.signum:
                    break
            if signals.signum and trainer.step - start < steps:
                name = signal.Signals(signals.signum).name
                click.echo(f"\n{name}: stopped after step {trainer.step}; "
                           f"{save_and_resume_hint()}", err=True)
                raise SystemExit(128 + signals.signum)
            if save_every:
                save()
    except KeyboardInterrupt:
        click.echo(f"\nstopped at once by a second signal in step {trainer.step + 1}, which "
                   f"was not saved; {kept()}", err=True)
        raise SystemExit(128 + (signals.signum or signal.SIGINT)) from None
    finally:
        if log:
            log.close()
    return first, last, time.perf_counter() - t0


@cli.command()
@click.argument("texts", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", default="model.gguf", show_default=True, type=click.Path(dir_okay=False),
              callback=existing_directory, help="The trained model, a llama GGUF.")
@click.option("--vocab-model", type=click.Path(exists=True, dir_okay=False),
              help="Use the vocabulary of this llama GGUF (default: bytes, no file needed).")
@click.option("--n-embd", default=128, show_default=True, type=positive())
@click.option("--n-head", default=4, show_default=True, type=positive())
@click.option("--n-layer", default=4, show_default=True, type=positive())
@click.option("--n-ff", default=352, show_default=True, type=positive())
@click.option("--n-ctx", default=64, show_default=True, type=positive(), help="Tokens per sample.")
@click.option("--n-rot", type=positive(), help="Rotated dims per head. Default: the head dim (llama.cpp requires that).")
@click.option("--rope-freq-base", default=10000.0, show_default=True, type=positive(float))
@click.option("--rope-freq-scale", default=1.0, show_default=True, type=positive(float))
@click.option("--norm-eps", default=1e-5, show_default=True, type=positive(float))
@click.option("--batch", default=8, show_default=True, type=positive(),
              help="Samples per micro-batch.")
@click.option("--grad-accum", default=1, show_default=True, type=positive(),
              help="Micro-batches whose gradients add up to one optimizer step.")
@click.option("--samples-after-nl", is_flag=True, help="Start samples only after newlines.")
@click.option("--steps", default=300, show_default=True, type=positive(), help="Optimizer steps.")
@click.option("--epochs", type=positive(float), help="Train this many epochs instead of --steps.")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(["adamw", "sgd"]))
@click.option("--lr", default=1e-3, show_default=True, type=positive(float))
@click.option("--beta1", default=0.9, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--beta2", default=0.999, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--adam-eps", default=1e-8, show_default=True, type=positive(float))
@click.option("--weight-decay", default=0.1, show_default=True, type=click.FloatRange(min=0),
              help="AdamW decay, relative to the learning rate, on tensors with >= 2 dims.")
@click.option("--grad-clip", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="Clip gradients to this global norm (0: off).")
@click.option("--warmup", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--cos-decay-steps", default=1000, show_default=True, type=positive())
@click.option("--cos-decay-min", default=0.1, show_default=True, type=click.FloatRange(0, 1))
@click.option("--cos-decay-restart", default=1.1, show_default=True, type=click.FloatRange(min=1))
@click.option("--restarts/--no-restarts", default=False, show_default=True)
@click.option("--flash-attn", is_flag=True, help="Fused attention (same results, less memory).")
@click.option("--checkpointing", is_flag=True,
              help="Gradient checkpointing: recompute activations, keep block outputs only.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--checkpoint-in", type=click.Path(exists=True, dir_okay=False),
              help="Resume from this checkpoint (model, optimizer, data order, options).")
@click.option("--checkpoint-out", type=click.Path(dir_okay=False), callback=existing_directory,
              help="Write a checkpoint here (atomically) every --save-every steps and at the "
                   "end. A run stopped by SIGINT/SIGTERM or a non-finite step saves here too "
                   "(default: next to --out, model.gguf -> model.checkpoint.gguf).")
@click.option("--save-every", default=100, show_default=True, type=positive())
@click.option("--log", "log_path", type=click.Path(dir_okay=False), callback=existing_directory,
              help="Append a JSON line per step here.")
@click.option("--on-nan", default="stop", show_default=True, type=click.Choice(["stop", "skip"]),
              help="A step with a non-finite loss or gradient never updates the model; then "
                   "stop (saving a checkpoint) or skip the step and go on.")
@click.option("--predict", default=0, show_default=True, type=click.IntRange(min=0),
              help="At the end, sample this many tokens from the trained model (prompt: the "
                   "text's first line; generate's default sampling, --seed).")
@click.pass_context
def train(ctx, texts, out, vocab_model, n_embd, n_head, n_layer, n_ff, n_ctx, n_rot,
          rope_freq_base, rope_freq_scale, norm_eps, batch, grad_accum, samples_after_nl, steps,
          epochs, optimizer, lr, beta1, beta2, adam_eps, weight_decay, grad_clip, warmup,
          cos_decay_steps, cos_decay_min, cos_decay_restart, restarts, flash_attn,
          checkpointing, seed, checkpoint_in, checkpoint_out, save_every, log_path, on_nan,
          predict):
    """Train a llama from scratch on text files (default: the bundled Shakespeare corpus).

    The model is exported as a llama GGUF that llama.cpp loads. Defaults are a small model
    that trains in minutes on a CPU; llama.cpp's train-text-from-scratch used --n-embd 256
    --n-head 8 --n-layer 16 --n-ff 768 --n-ctx 128.

    Ctrl-C (SIGINT) or SIGTERM ends the run after the current step: it saves a checkpoint
    (--checkpoint-out, else next to --out) and prints the command that continues the run.
    """
    from ggwgpu import data, gguf_io, tokenizer as tok
    from ggwgpu.models.llama import LlamaConfig, init_parameters
    from ggwgpu.tensor import ShapeError
    from ggwgpu.train import Trainer, TrainOptions, token_digest, unigram_entropy

    if checkpoint_in:
        try:
            cfg, values, tokenizer, opt_state, state = gguf_io.load_checkpoint(checkpoint_in)
        except gguf_io.GGUFError as e:
            raise click.ClickException(str(e)) from None
        options = TrainOptions(**state["options"])
        step = state["step"]
    else:
        tokenizer = tok.load_vocab(vocab_model) if vocab_model else tok.ByteTokenizer()
        try:
            cfg = LlamaConfig(n_vocab=tokenizer.n_vocab, n_embd=n_embd, n_head=n_head,
                              n_layer=n_layer, n_ff=n_ff, n_ctx=n_ctx, n_rot=n_rot,
                              norm_eps=norm_eps, rope_freq_base=rope_freq_base,
                              rope_freq_scale=rope_freq_scale)
        except ShapeError as e:
            raise click.UsageError(str(e)) from None
        options = TrainOptions(optimizer=optimizer, batch=batch, grad_accum=grad_accum, lr=lr,
                               beta1=beta1,
                               beta2=beta2, eps=adam_eps,
                               weight_decay=weight_decay, grad_clip=grad_clip, warmup=warmup,
                               cos_decay_steps=cos_decay_steps, cos_decay_min=cos_decay_min,
                               cos_decay_restart=cos_decay_restart, restarts=restarts,
                               flash_attn=flash_attn, checkpointing=checkpointing, seed=seed)
        values, opt_state, state, step = init_parameters(cfg, seed), None, None, 0

    try:
        text = data.read_texts(texts) if texts else data.bundled_corpus()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    source = ", ".join(texts) if texts else "the bundled corpus (Shakespeare)"
    tokens = tokenizer.encode(text)
    digest = token_digest(tokens)
    if state is not None and state.get("tokens_digest") != digest:
        raise click.UsageError(f"{checkpoint_in} was trained on other text (tokens "
                               f"{state.get('tokens_digest')}, these are {digest}): pass "
                               "the same text files to resume")
    try:
        samples = data.Samples(tokens, cfg.n_ctx, options.batch, options.seed, tokenizer.bos_id,
                               after_newline=samples_after_nl,
                               newline_ids=tokenizer.newline_ids)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if state is not None:
        samples.load_state(state["data"])
    if epochs:
        steps = max(1, round(epochs * samples.n_samples / (options.batch * options.grad_accum)))

    backend = select_backend(ctx)
    try:
        trainer = Trainer(cfg, values, backend, options, samples, opt_state, step)
    except ShapeError as e:  # a tensor over the device's limits, among others
        raise click.ClickException(str(e)) from None
    except device_errors() as e:
        raise click.ClickException(f"the device failed while planning the train step "
                                   f"({type(e).__name__}: {e})") from None
    entropy = unigram_entropy(tokens)
    click.echo(f"train on {describe_backend(backend)}")
    click.echo(f"data: {source}: {len(tokens)} tokens, {samples.n_samples} samples of "
               f"{cfg.n_ctx}; unigram entropy {entropy:.3f} nats/token")
    n_params = sum(v.size for v in values.values())
    click.echo(f"model: {n_params / 1e6:.2f} M parameters, {cfg.n_layer} layers, embd "
               f"{cfg.n_embd}, {cfg.n_head} heads, ff {cfg.n_ff}; {steps} steps of "
               f"{options.batch * options.grad_accum} x {cfg.n_ctx} tokens" +
               (f", resuming at step {step}" if step else ""))

    checkpoint_path = checkpoint_out or default_checkpoint_path(out)

    def save_checkpoint():
        state = {**trainer.state(), "tokens_digest": digest}
        gguf_io.save_checkpoint(checkpoint_path, cfg, trainer.parameters(), tokenizer,
                                trainer.optimizer_state(), state)

    def resume_command(steps_left: int) -> str:
        """The command line that continues this run from checkpoint_path."""
        args = ["ggwgpu"] + (["--backend", ctx.obj["backend"]] if ctx.obj["backend"] else [])
        args += ["train", *texts, "--checkpoint-in", checkpoint_path, "--steps",
                 str(steps_left), "--out", out]
        if checkpoint_out:
            args += ["--checkpoint-out", checkpoint_out, "--save-every", str(save_every)]
        if samples_after_nl:
            args.append("--samples-after-nl")
        if log_path:
            args += ["--log", log_path]
        if on_nan != "stop":
            args += ["--on-nan", on_nan]
        if predict:
            args += ["--predict", str(predict), "--seed", str(seed)]
        return shlex.join(args)

    first, last, seconds = training_loop(trainer, steps, log_path,
                                         save_every if checkpoint_out else 0,
                                         save_checkpoint, checkpoint_path, resume_command,
                                         on_nan)
    try:
        gguf_io.save_model(out, cfg, trainer.parameters(), tokenizer)
    except (gguf_io.GGUFError, *device_errors()) as e:
        raise click.ClickException(f"the model was not written: {e}") from None
    click.echo(f"loss {first:.3f} -> {last:.3f} nats/token (unigram entropy {entropy:.3f}) "
               f"in {seconds:.0f} s; model written to {out}")
    if predict:
        prompt = text.split("\n", 1)[0]
        click.echo(f"sample of {predict} tokens:")
        stream_sample(backend, cfg, trainer.parameters(), tokenizer, prompt, predict,
                      Sampling(), seed)


# -- generate -------------------------------------------------------------------------------

def stream_sample(backend, cfg, values, tokenizer, prompt, n, sampling, seed, adapters=()):
    """Print the prompt, then the continuation as it comes (flushed piece by piece), then a
    timing line on stderr."""
    from ggwgpu.generate import Decoder, TextStream, generate_tokens, prompt_tokens
    t0 = time.perf_counter()
    decoder = Decoder(backend, cfg, values, adapters=adapters)
    ids = prompt_tokens(tokenizer, prompt)
    stream = TextStream(tokenizer, ids)
    click.echo(stream.push(), nl=False)
    t1, count = time.perf_counter(), 0
    for token in generate_tokens(decoder, ids, n, sampling, seed, tokenizer.bos_id,
                                 tokenizer.eos_id):
        count += 1
        piece = stream.push(token)
        if piece:
            click.echo(piece, nl=False)
            sys.stdout.flush()
    click.echo(stream.finish())
    t2 = time.perf_counter()
    click.echo(f"{count} tokens in {t2 - t1:.2f} s ({count / (t2 - t1):.1f} tokens/s, the prompt "
               f"pass of {len(ids)} tokens included; planning {t1 - t0:.2f} s)", err=True)


@cli.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", "-p", default="", help="Text to continue (BOS is put before it).")
@click.option("--n-predict", "-n", default=200, show_default=True, type=click.IntRange(min=0),
              help="Tokens to generate at most (it stops earlier at EOS).")
@click.option("--temp", default=Sampling.temperature, show_default=True,
              type=click.FloatRange(min=0), help="Temperature; 0 is greedy (the most likely "
                                                 "token, whatever the seed).")
@click.option("--top-k", default=Sampling.top_k, show_default=True, type=int,
              help="Keep the k most likely tokens (<= 0: all).")
@click.option("--top-p", default=Sampling.top_p, show_default=True,
              type=click.FloatRange(0, 1, min_open=True),
              help="Then keep the most likely tokens up to this probability mass (1: all).")
@click.option("--repeat-penalty", default=Sampling.repeat_penalty, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Make the tokens of the last --repeat-last-n less likely (1: off).")
@click.option("--repeat-last-n", default=Sampling.repeat_last_n, show_default=True,
              type=click.IntRange(min=0), help="Context tokens the repeat penalty looks at.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed.")
@click.option("--lora", "lora_paths", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Apply this LoRA adapter GGUF (scale alpha / r, as llama.cpp); repeatable.")
@click.pass_context
def generate(ctx, model, prompt, n_predict, temp, top_k, top_p, repeat_penalty, repeat_last_n,
             seed, lora_paths):
    """Continue a prompt with a llama GGUF model (ours or llama.cpp's f32/f16 llama files).

    The model runs with a KV cache on the chosen backend and the host samples as llama.cpp
    does: repeat penalty, top-k, top-p, temperature. When the model's context (n_ctx) is
    full, the window slides to BOS plus its last half and is recomputed.
    """
    from ggwgpu import gguf_io
    from ggwgpu.lora import load_adapter
    try:
        cfg, values, tokenizer = gguf_io.load_model(model)
        adapters = [load_adapter(path, cfg) for path in lora_paths]
    except gguf_io.GGUFError as e:
        raise click.ClickException(str(e)) from None
    if not prompt and tokenizer.bos_id is None:
        raise click.UsageError(f"{model}'s vocabulary has no BOS token: give a --prompt")
    backend = select_backend(ctx)
    click.echo(f"generate on {describe_backend(backend)}: {model}, n_ctx {cfg.n_ctx}, "
               f"seed {seed}", err=True)
    sampling = Sampling(temp, top_k, top_p, repeat_penalty, repeat_last_n)
    stream_sample(backend, cfg, values, tokenizer, prompt, n_predict, sampling, seed, adapters)


try:
    from .bench import bench
    from .finetune import finetune_command, merge_command
    from .quantize import quantize_command
except ImportError:  # run as a script: python cli/main.py
    from bench import bench
    from finetune import finetune_command, merge_command
    from quantize import quantize_command

cli.add_command(bench)
cli.add_command(quantize_command)
cli.add_command(finetune_command)
cli.add_command(merge_command)

if __name__ == "__main__":
    cli()
