"""`ggwgpu demo`: a tiny MLP fit through the autodiff graph; `ggwgpu demo baby-llama`: Adam
and L-BFGS train a tiny llama on a sine wave. Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import time

import click
import numpy as np

from ggwgpu.training.run import device_errors

from .common import FiniteFloat, describe_backend, select_backend
from .outputs import check_outputs
from .training import existing_directory

@click.group(invoke_without_command=True)
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
