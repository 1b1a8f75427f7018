"""The `ggwgpu` command: adapter info, the op test matrix, a demo fit, training; the
benchmarks are in bench.py.

Only absolute imports of `ggwgpu` here: this package is installed as `ggwgpu_cli` (the
`ggwgpu` command and `python -m ggwgpu` run its `cli`).
"""
from __future__ import annotations

import math
import os
import shlex
import sys
import textwrap
import time

import click
import numpy as np

import ggwgpu
from ggwgpu import testing
from ggwgpu.backends import CHOICES, ENV_VAR
from ggwgpu.data import BUNDLED
from ggwgpu.generate import Sampling

from .chat import chat_answer, chat_command
from .outputs import check_outputs
from .common import chat_template as load_chat_template
from .common import (FiniteFloat, auto_pick, backend_choice, check_memory, ctx_option,
                     describe_backend, human_bytes, load_model, lora_option,
                     planned_memory, sampling_of, sampling_options, select_backend,
                     template_option, with_context, wgpu_or_reason)
from .training import (SPLITS, data_options, describe_examples, example_batches,
                       example_sets)
from .training import (across_ranks, default_checkpoint_path, device_errors,
                       existing_directory, guard_outputs, is_root, local_batch, mpi_world,
                       positive, read_text, resume_args, resumed_options, steps_of,
                       train_options, training_loop, training_options, training_samples)

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


TRACEBACK_VAR = "GGWGPU_TRACEBACK"


class Commands(click.Group):
    """The ggwgpu group. Errors a command did not turn into a message of its own end it
    with one line and exit code 1, never a traceback: ggwgpu's errors for bad input
    (GGUFError, VocabError, DataError: they name the file and the problem), the operating
    system's (OSError: a full or read-only disk, a vanished file) and MemoryError. Anything
    else is a bug in ggwgpu: one line saying so, or the traceback with $GGWGPU_TRACEBACK=1
    (the tests set it, so that such bugs fail them)."""

    def invoke(self, ctx):
        from ggwgpu.data import DataError
        from ggwgpu.generate import NonFiniteLogits
        from ggwgpu.gguf_io import GGUFError
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (GGUFError, DataError, NonFiniteLogits) as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from None
        except MemoryError:
            raise click.ClickException("out of memory: the host could not allocate what this "
                                       "command needs (a smaller model, batch or context "
                                       "needs less)") from None
        except Exception as e:
            if os.environ.get(TRACEBACK_VAR) == "1":
                raise
            raise click.ClickException(
                f"internal error, a bug in ggwgpu: {type(e).__name__}: {e} (set "
                f"{TRACEBACK_VAR}=1 for the traceback)") from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ggwgpu.__version__, prog_name="ggwgpu")
@click.option("--backend", type=click.Choice(CHOICES, case_sensitive=False), default=None,
              help=f"Where graphs run. Default: ${ENV_VAR}, else auto: wgpu on a hardware GPU, "
                   "numpy when the only adapter is a software one (lavapipe) or none; "
                   "`ggwgpu info` says which.")
@click.pass_context
def cli(ctx, backend):
    """ggwgpu: ggml's training machinery as WGSL compute shaders on any WebGPU GPU."""
    from ggwgpu.backends.numpy_backend import default_threads
    try:
        default_threads()   # a bad $GGWGPU_NUMPY_THREADS stops every command before any work
    except ValueError as e:
        raise click.UsageError(str(e)) from None
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
    if name == "auto":
        picked, reason = auto_pick()
        used = f"{picked}, picked by auto: {reason}"
    elif name == "numpy":
        used = f"numpy (asked for by {by})"
    elif backend is not None:
        used = f"{describe_backend(backend)}, asked for by {by}"
    else:
        used = f"none: wgpu asked for by {by}, but {why}"
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

@cli.group(invoke_without_command=True)
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1),
              help="Full-batch AdamW steps.")
@click.option("--lr", default=0.02, show_default=True,
              type=FiniteFloat(min=0, min_open=True), help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Data and init seed.")
@click.pass_context
def demo(ctx, steps, lr, seed):
    """Fit a tiny MLP through the autodiff graph; the loss must fall.

    A 2-layer MLP regresses a fixed nonlinear function of random inputs. The graph
    (mul_mat, bias add, silu, mul_mat, mean squared error, its backward and an AdamW update
    of every parameter) is built and planned once; every step is one submission.
    `ggwgpu demo baby-llama` is the other demo.
    """
    if ctx.invoked_subcommand is not None:
        return
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


@demo.command("baby-llama")
@click.option("--seconds", default=10.0, show_default=True,
              type=FiniteFloat(min=0, min_open=True),
              help="Training time of each optimizer (planning not counted).")
@click.option("--lr", default=0.01, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="Adam's learning rate (L-BFGS has none).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2 ** 32 - 1),
              help="Initial weights.")
@click.option("--png", type=click.Path(dir_okay=False), callback=existing_directory,
              help="Also draw the loss curves and the continuations here (needs "
                   "matplotlib: pip install 'ggwgpu[plot]').")
@click.pass_context
def baby_llama(ctx, seconds, lr, seed, png):
    """A llama of ~3k parameters learns to continue a sine wave, with Adam and with L-BFGS.

    The wave's values are binned into 16 tokens; 24 sequences of 25 tokens, one per phase,
    form one full batch. Each optimizer trains the same initial model for --seconds; the
    losses at the same wall times are printed side by side, then each model continues a
    wave from a phase it never saw (ggml's baby-llama example).
    """
    from ggwgpu import baby_llama as bl
    if png:
        check_outputs([], [("--png", png)])     # refuses a device or FIFO node, among others
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--png needs matplotlib: pip install "
                                       "'ggwgpu[plot]'") from None
    backend = select_backend(ctx)
    cfg = bl.CFG
    n_params = sum(v.size for v in bl.init_parameters(cfg, seed).values())
    click.echo(f"baby-llama on {describe_backend(backend)}: {n_params} parameters, vocab "
               f"{cfg.n_vocab}, context {cfg.n_ctx}, batch {bl.BATCH}; {seconds:g} s per "
               f"optimizer")
    runs = []
    for optimizer in ("adamw", "lbfgs"):
        try:
            runs.append(bl.train_for(backend, optimizer, seconds, seed=seed, lr=lr))
        except device_errors() as e:
            raise click.ClickException(f"the device failed ({type(e).__name__}: {e})") \
                from None
    adam, lbfgs = runs
    click.echo(f"{'seconds':>8} {'adam loss':>10} {'lbfgs loss':>11}")
    for t in np.linspace(0, seconds, 11):
        click.echo(f"{t:8.2f} {bl.loss_at(adam, t):10.4f} {bl.loss_at(lbfgs, t):11.4f}")
    for run in runs:
        click.echo(f"{run.optimizer}: {len(run.losses)} steps, {run.evaluations} loss "
                   f"evaluations, loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}")
    phase, prompt, n = 1.0, 8, cfg.n_ctx - 8
    truth = bl.wave_tokens(phase, prompt + n)
    guesses = [bl.continuation(backend, run.trainer, phase, prompt, n) for run in runs]
    for run, guess in zip(runs, guesses):
        right = int((guess == truth[prompt:]).sum())
        click.echo(f"\n{run.optimizer} continues the wave ('o' prompt, '*' model, '.' the "
                   f"wave where the model is off): {right}/{n} tokens right")
        click.echo(bl.draw(truth, guess, prompt))
    if png:
        bl.plot_png(png, runs, truth, guesses, prompt)
        click.echo(f"\nwrote {png}")


# -- plot -----------------------------------------------------------------------------------

@cli.command()
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False),
              help="The PNG to write. Default: the log's name with .png.")
def plot(log, out):
    """Plot the loss (validation loss too, and the learning rate) of a `train --log` or
    `finetune --log` JSONL file as a PNG.

    Needs matplotlib: pip install 'ggwgpu[plot]'.
    """
    import json
    from pathlib import Path
    from ggwgpu.files import read_limited
    out = out or str(Path(log).with_suffix(".png"))
    check_outputs([("LOG", log)], [("--out", out)])
    try:
        text = read_limited(log, click.ClickException).decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{log}: not valid UTF-8 at byte offset {e.start}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError) as e:
            raise click.ClickException(f"{log}, line {number}: not JSON ({e})") from None

    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
    if not records or not all(isinstance(r, dict) and number(r.get("step"))
                              and number(r.get("loss")) for r in records):
        raise click.ClickException(f"{log} has no training records (step and loss, numbers "
                                   f"on every line)")
    records = [r if number(r.get("val_loss", 0)) and number(r.get("lr", 0))
               else {"step": r["step"], "loss": r["loss"]} for r in records]
    try:          # after the log is checked: a bad log is refused without it
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("plot needs matplotlib: pip install 'ggwgpu[plot]'") from None
    out = out or str(Path(log).with_suffix(".png"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="loss")
    validated = [r for r in records if "val_loss" in r]
    if validated:           # finetune --val-every
        ax.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], "o-",
                label="validation loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if all("lr" in r for r in records):
        lr_ax = ax.twinx()
        lr_ax.plot([r["step"] for r in records], [r["lr"] for r in records], color="gray",
                   linewidth=0.8, label="learning rate")
        lr_ax.set_ylabel("learning rate")
    ax.set_title(Path(log).name)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:                    # a missing directory, a full disk
        raise click.ClickException(f"{out}: not written ({e.strerror or e})") from None
    click.echo(f"wrote {out}")


# -- train ----------------------------------------------------------------------------------

@cli.command()
@click.argument("texts", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", default="model.gguf", show_default=True, type=click.Path(dir_okay=False),
              callback=existing_directory, help="The trained model, a llama GGUF.")
@click.option("--vocab-model", type=click.Path(exists=True, dir_okay=False),
              help="Use the vocabulary of this llama GGUF (default: bytes, no file needed).")
@click.option("--n-embd", default=128, show_default=True, type=positive())
@click.option("--n-head", default=4, show_default=True, type=positive())
@click.option("--n-head-kv", type=positive(),
              help="K/V heads, fewer than --n-head for grouped-query attention (each serves "
                   "n_head / n_head_kv query heads). Default: --n-head.")
@click.option("--tie-embeddings", is_flag=True,
              help="No output matrix: the output projection reads the token embedding.")
@click.option("--n-layer", default=4, show_default=True, type=positive())
@click.option("--n-ff", default=352, show_default=True, type=positive())
@click.option("--n-ctx", default=64, show_default=True, type=positive(), help="Tokens per sample.")
@click.option("--n-rot", type=positive(),
              help="Rotated dims per head: the head dim, the only value llama.cpp loads.")
@click.option("--rope-freq-base", default=10000.0, show_default=True, type=positive(float))
@click.option("--rope-freq-scale", default=1.0, show_default=True, type=positive(float))
@click.option("--norm-eps", default=1e-5, show_default=True, type=positive(float))
@training_options(steps=300, warmup=50, seed_help="Init and sample-order seed.")
@click.option("--predict", default=0, show_default=True, type=click.IntRange(min=0),
              help="At the end, sample this many tokens from the trained model (prompt: the "
                   "text's first line; generate's default sampling, --seed).")
@click.pass_context
@across_ranks
def train(ctx, out, vocab_model, n_embd, n_head, n_head_kv, tie_embeddings, n_layer, n_ff, n_ctx,
          n_rot, rope_freq_base, rope_freq_scale, norm_eps, predict, **kw):
    """Train a llama from scratch on text files (default: the bundled Shakespeare corpus).

    The model is exported as a llama GGUF that llama.cpp loads. Defaults are a small model
    that trains in minutes on a CPU; llama.cpp's train-text-from-scratch used --n-embd 256
    --n-head 8 --n-layer 16 --n-ff 768 --n-ctx 128.

    Ctrl-C (SIGINT) or SIGTERM ends the run after the current step: it saves a checkpoint
    (--checkpoint-out, else next to --out) and prints the command that continues the run.
    """
    from ggwgpu import gguf_io, memory, tokenizer as tok
    from ggwgpu.models.llama import LlamaConfig, init_parameters
    from ggwgpu.tensor import ShapeError
    from ggwgpu.train import Trainer, unigram_entropy

    checkpoint_in, checkpoint_out = kw["checkpoint_in"], kw["checkpoint_out"]
    checkpoint_path = checkpoint_out or default_checkpoint_path(out)
    guard_outputs(ctx, [*(("TEXTS", t) for t in kw["texts"]), ("--vocab-model", vocab_model),
                        ("--checkpoint-in", checkpoint_in)], out, checkpoint_path, kw)
    if checkpoint_in:
        try:
            cfg, values, tokenizer, opt_state, state = gguf_io.load_checkpoint(checkpoint_in)
        except gguf_io.GGUFError as e:
            raise click.ClickException(str(e)) from None
        shape = dict(n_embd=cfg.n_embd, n_head=cfg.n_head, n_head_kv=cfg.kv_heads,
                     tie_embeddings=cfg.tied_embeddings, n_layer=cfg.n_layer, n_ff=cfg.n_ff,
                     n_ctx=cfg.n_ctx, n_rot=cfg.rot, rope_freq_base=cfg.rope_freq_base,
                     rope_freq_scale=cfg.rope_freq_scale, norm_eps=cfg.norm_eps,
                     vocab_model=...)
        options = resumed_options(ctx, state, checkpoint_in, shape)
        step = state["step"]
        check_memory(ctx, f"{checkpoint_in}", cfg, values, batch=options.batch,
                     trained=memory.parameter_count(cfg), flash_attn=options.flash_attn)
    else:
        try:
            tokenizer = tok.load_vocab(vocab_model) if vocab_model else tok.ByteTokenizer()
        except gguf_io.GGUFError as e:
            raise click.ClickException(str(e)) from None
        try:
            cfg = LlamaConfig(n_vocab=tokenizer.n_vocab, n_embd=n_embd, n_head=n_head,
                              n_head_kv=n_head_kv, tied_embeddings=tie_embeddings,
                              n_layer=n_layer, n_ff=n_ff, n_ctx=n_ctx, n_rot=n_rot,
                              norm_eps=norm_eps, rope_freq_base=rope_freq_base,
                              rope_freq_scale=rope_freq_scale)
        except ShapeError as e:
            raise click.UsageError(str(e)) from None
        if cfg.rot != cfg.head_dim:
            raise click.UsageError(f"--n-rot {cfg.rot} is not the head dim {cfg.head_dim} "
                                   f"(n_embd / n_head): llama.cpp refuses such a llama model")
        options = train_options(kw)
        check_memory(ctx, "this model", cfg, batch=options.batch,
                     trained=memory.parameter_count(cfg), flash_attn=options.flash_attn)
        values, opt_state, state, step = init_parameters(cfg, kw["seed"]), None, None, 0

    text, source = read_text(kw["texts"], kw["corpus"])
    tokens, digest, samples = training_samples(text, tokenizer, cfg, options,
                                               kw["samples_after_nl"], state, checkpoint_in)
    steps = steps_of(kw, samples, options)
    local_batch(options)    # under mpirun: the batch must split over the processes
    backend = select_backend(ctx)
    try:
        trainer = Trainer(cfg, values, backend, options, samples, opt_state, step,
                          world=mpi_world())
    except ShapeError as e:  # a tensor over the device's limits, among others
        raise click.ClickException(str(e)) from None
    except device_errors() as e:
        raise click.ClickException(f"the device failed while planning the train step "
                                   f"({type(e).__name__}: {e})") from None
    entropy = unigram_entropy(tokens)
    world = mpi_world()
    click.echo(f"train on {describe_backend(backend)}" +
               (f" in each of {world.size} processes (MPI)" if world else ""))
    click.echo(f"data: {source}: {len(tokens)} tokens, {samples.n_samples} samples of "
               f"{cfg.n_ctx}; unigram entropy {entropy:.3f} nats/token")
    n_params = sum(v.size for v in values.values())
    click.echo(f"model: {n_params / 1e6:.2f} M parameters, {cfg.n_layer} layers, embd "
               f"{cfg.n_embd}, {cfg.n_head} heads, ff {cfg.n_ff}; {steps} steps of "
               f"{options.batch * options.grad_accum} x {cfg.n_ctx} tokens; "
               f"{planned_memory(trainer.plan)}" +
               (f", resuming at step {step}" if step else ""))

    def save_checkpoint():
        if not is_root():
            return
        state = {**trainer.state(), "tokens_digest": digest}
        gguf_io.save_checkpoint(checkpoint_path, cfg, trainer.parameters(), tokenizer,
                                trainer.optimizer_state(), state)

    def resume_command(steps_left: int) -> str:
        args = resume_args(ctx, ["train"], kw, checkpoint_path, steps_left) + ["--out", out]
        if predict:
            args += ["--predict", str(predict), "--seed", str(kw["seed"])]
        return shlex.join(args)

    first, last, seconds = training_loop(
        trainer, steps, kw["log_path"], kw["save_every"] if checkpoint_out else 0,
        save_checkpoint, checkpoint_path, resume_command, kw["on_nan"],
        write_result=(lambda: gguf_io.save_model(out, cfg, trainer.parameters(), tokenizer))
        if is_root() else None, result_path=out)
    if not is_root():
        return
    if first is None:
        click.echo(f"model of step {trainer.step} written to {out}")
    else:
        click.echo(f"loss {first:.3f} -> {last:.3f} nats/token (unigram entropy "
                   f"{entropy:.3f}) in {seconds:.0f} s; model written to {out}")
    if predict:
        prompt = text.split("\n", 1)[0]
        click.echo(f"sample of {predict} tokens:")
        stream_sample(backend, cfg, trainer.parameters(), tokenizer, prompt, predict,
                      Sampling(), kw["seed"])


# -- generate -------------------------------------------------------------------------------

def stream_sample(backend, cfg, values, tokenizer, prompt, n, sampling, seed, adapters=()):
    """Print the prompt, then the continuation as it comes (flushed piece by piece), then a
    timing line on stderr."""
    from ggwgpu.generate import (Decoder, TextStream, context_bos, generate_tokens,
                                 prompt_tokens)
    t0 = time.perf_counter()
    try:
        ids = prompt_tokens(tokenizer, prompt)
    except ValueError as e:         # VocabError: a lone surrogate, a piece without a token
        raise click.UsageError(f"--prompt: {e}") from None
    decoder = Decoder(backend, cfg, values, adapters=adapters)
    stream = TextStream(tokenizer, ids)
    click.echo(stream.push(), nl=False)
    t1, count = time.perf_counter(), 0
    for token in generate_tokens(decoder, ids, n, sampling, seed, context_bos(tokenizer),
                                 tokenizer.eog_ids):
        count += 1
        piece = stream.push(token)
        if piece:
            click.echo(piece, nl=False)
            sys.stdout.flush()
    click.echo(stream.finish())
    t2 = time.perf_counter()
    click.echo(f"{count} tokens in {t2 - t1:.2f} s ({count / (t2 - t1):.1f} tokens/s, the prompt "
               f"pass of {len(ids)} tokens included; planning {t1 - t0:.2f} s, "
               f"{decoder.memory() / 2**20:.1f} MiB planned)", err=True)


@cli.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", "-p", default="",
              help="Text to continue (BOS is put before it if the vocabulary adds one; special "
                   "tokens such as <|im_start|> in it are recognised); with --chat, the user's "
                   "message.")
@click.option("--n-predict", "-n", default=200, show_default=True, type=click.IntRange(min=0),
              help="Tokens to generate at most (it stops earlier at an end-of-generation "
                   "token: EOS, <|im_end|>, <|eot_id|>, ...).")
@sampling_options
@lora_option
@ctx_option("Tokens the KV cache holds")
@click.option("--chat", is_flag=True,
              help="The prompt is a user message put through the model's chat template with "
                   "the generation prompt (after --system); only the answer is printed.")
@click.option("--system", help="With --chat: a system message first.")
@template_option
@click.pass_context
def generate(ctx, model, prompt, n_predict, lora_paths, n_ctx, chat, system, chat_template,
             **kw):
    """Continue a prompt with a llama GGUF model (ours or llama.cpp's f32/f16 llama files).

    The model runs with a KV cache on the chosen backend and the host samples as llama.cpp
    does: repeat penalty, top-k, top-p, min-p, temperature. When the model's context (n_ctx) is
    full, the window slides to BOS plus its last half and is recomputed. With --chat the
    prompt is answered as one chat turn (for scripts; `ggwgpu chat` goes on talking).
    """
    cfg, values, tokenizer, adapters = load_model(model, lora_paths, n_ctx)
    check_memory(ctx, f"generating with {model}", cfg, values, decoder=True)
    if (system or chat_template) and not chat:
        raise click.UsageError("--system and --chat-template go with --chat")
    if not (prompt or chat) and not (tokenizer.add_bos and tokenizer.bos_id is not None):
        raise click.UsageError(f"{model}'s vocabulary has no BOS token: give a --prompt")
    backend = select_backend(ctx)
    click.echo(f"generate on {describe_backend(backend)}: {model}, n_ctx {cfg.n_ctx}, "
               f"seed {kw['seed']}", err=True)
    if chat:
        template = load_chat_template(tokenizer, chat_template)
        chat_answer(backend, cfg, values, tokenizer, template, system, prompt, n_predict,
                    sampling_of(kw), kw["seed"], adapters)
    else:
        stream_sample(backend, cfg, values, tokenizer, prompt, n_predict, sampling_of(kw),
                      kw["seed"], adapters)


@cli.command("eval")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("texts", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--corpus", type=click.Choice(list(BUNDLED)), default="shakespeare",
              show_default=True, help="The bundled text to evaluate on when no TEXTS are given.")
@click.option("--lora", "lora_paths", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Apply this LoRA adapter (repeatable), as generate --lora does.")
@click.option("--samples", default=256, show_default=True, type=positive(),
              help="Windows of n_ctx tokens, spread evenly over the text.")
@click.option("--batch", default=8, show_default=True, type=positive(),
              help="Windows per run.")
@ctx_option("Tokens per window")
@data_options
@click.option("--split", type=click.Choice(SPLITS),
              help="The --data split to evaluate (default: test, else valid, else train).")
@click.pass_context
def evaluate(ctx, model, texts, corpus, lora_paths, samples, batch, n_ctx, split, **kw):
    """The loss (nats/token) and perplexity of MODEL (with --lora adapters) on text files
    (default: the bundled corpus): the mean cross-entropy of next-token prediction over
    n_ctx-token windows at evenly spaced positions, each starting after BOS as in training.
    The same windows every time, so two models or adapters compare on equal terms.
    With --data, over the examples of one split instead (per trained token: with
    --mask-prompt, the answers only)."""
    import math

    from ggwgpu import data, gguf_io
    from ggwgpu.lora import load_adapter
    from ggwgpu.models.llama import build_train_graph
    from ggwgpu.train import logits_bound
    try:
        cfg, values, tokenizer = gguf_io.load_model(model, keep_quantized=True)
        adapters = [load_adapter(path, cfg) for path in lora_paths]
    except gguf_io.GGUFError as e:
        raise click.ClickException(str(e)) from None
    cfg = with_context(cfg, n_ctx)
    if kw["data_path"]:
        sets = example_sets(kw, tokenizer, splits=(split,) if split else SPLITS)
        split = split or next(s for s in ("test", "valid", "train") if s in sets)
        if split not in sets:
            raise click.UsageError(f"{kw['data_path']} has no {split} split")
        examples = example_batches(sets[split], cfg, batch, kw, 0)
        examples.batch = batch = min(batch, examples.n_samples)
        packed = examples.packed
        batches = list(examples.in_order())
        what = f"{kw['data_path']} ({split}): {describe_examples('examples', examples)}"
    else:
        text, source = read_text(texts, corpus)
        try:
            windows = data.Samples(tokenizer.encode(text), cfg.n_ctx, 1, 0, tokenizer.bos_id)
        except ValueError as e:
            raise click.UsageError(f"{source}: {e}") from None
        n = min(samples, windows.n_samples)
        batch = min(batch, n)
        n -= n % batch
        starts = np.linspace(0, windows.n_samples - 1, n).round().astype(np.int64)
        batches = (windows.windows(windows.starts[starts[i:i + batch]])   # one at a time
                   for i in range(0, n, batch))
        what = f"{source}: {n} windows of {cfg.n_ctx} tokens"
        packed = False
    check_memory(ctx, f"evaluating {model}", cfg, values, batch=batch)
    backend = select_backend(ctx)
    g = build_train_graph(cfg, values, batch, adapters=adapters, frozen=True,
                          max_logits_bytes=logits_bound(backend), packed=packed)
    plan = backend.plan([g.loss])
    if not packed:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
    total, counted = 0.0, 0
    for rows in batches:         # the mean over every counted target
        plan.run(g.feeds(*rows))
        n_targets = int((rows[1] >= 0).sum())
        total += float(plan.read(g.loss)[0]) * n_targets
        counted += n_targets
    loss = total / max(counted, 1)
    with_lora = "".join(f" + {path}" for path in lora_paths)
    click.echo(f"eval on {describe_backend(backend)}: {model}{with_lora} on {what}")
    if not math.isfinite(loss):     # finite weights whose activations overflow float32
        raise click.ClickException(f"the loss of {model}{with_lora} is {loss}: its values "
                                   f"overflow float32 in the forward pass")
    perplexity = math.exp(loss) if loss < 700 else math.inf     # exp overflows past ~709
    click.echo(f"loss {loss:.4f} nats/token, perplexity {perplexity:.3f}")


from .bench import bench
from .bench_ranks import bench_ranks
from .finetune import finetune_command, merge_command
from .quantize import quantize_command

bench.add_command(bench_ranks)
cli.add_command(bench)
cli.add_command(quantize_command)
cli.add_command(finetune_command)
cli.add_command(merge_command)
cli.add_command(chat_command)

if __name__ == "__main__":
    cli()
