"""`ggwgpu eval MODEL [TEXTS]...`: the loss and perplexity of a model (with LoRA adapters) on
text or on a --data split. Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import math

import click

from ggwgpu import evaluation
from ggwgpu.chat import SPLITS
from ggwgpu.data import BUNDLED
from ggwgpu.evaluation import perplexity_of
from ggwgpu.training.inputs import describe_examples

from .common import (InputPath, check_memory, ctx_option, describe_backend, precision_option,
                     resolve_precision, select_backend, with_context)
from .training import data_options, example_batches, example_sets, positive, read_text


@click.command("eval")
@click.argument("model", type=InputPath(exists=True, dir_okay=False))
@click.argument("texts", nargs=-1, type=InputPath(exists=True, dir_okay=False))
@click.option("--corpus", type=click.Choice(list(BUNDLED)), default="shakespeare",
              show_default=True, help="The bundled text to evaluate on when no TEXTS are given.")
@click.option("--lora", "lora_paths", multiple=True, type=InputPath(exists=True, dir_okay=False),
              help="Apply this LoRA adapter (repeatable), as generate --lora does.")
@click.option("--samples", type=positive(),
              help="Windows of n_ctx tokens, spread evenly over the text (they overlap when "
                   "the text holds fewer). Default: the text once, in consecutive windows "
                   "that do not overlap, as llama.cpp's perplexity takes it.")
@click.option("--batch", default=8, show_default=True, type=positive(),
              help="Windows per run.")
@ctx_option("Tokens per window")
@data_options
@click.option("--split", type=click.Choice(SPLITS),
              help="The --data split to evaluate (default: test, else valid, else train).")
@precision_option
@click.pass_context
def evaluate(ctx, model, texts, corpus, lora_paths, samples, batch, n_ctx, split, **kw):
    """The loss (nats/token) and perplexity of MODEL (with --lora adapters) on text files
    (default: the bundled corpus): the mean cross-entropy of next-token prediction over
    n_ctx-token windows, each starting after BOS as in training: the text once in windows
    that do not overlap, or --samples windows at evenly spaced positions. The same windows
    every time, so two models or adapters compare on equal terms. With --data, over the
    examples of one split instead (per trained token: with --mask-prompt, the answers only).
    The perplexity so far is shown on stderr after each batch of windows."""
    from ggwgpu import data
    from ggwgpu.gguf_file import GGUFError
    from ggwgpu.gguf_llama import load_model
    from ggwgpu.lora import load_adapter
    click.echo(f"loading {model}", err=True)
    try:
        cfg, values, tokenizer = load_model(model, keep_quantized=True)
        adapters = [load_adapter(path, cfg) for path in lora_paths]
    except GGUFError as e:
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
        n_batches = len(batches)
        what = f"{kw['data_path']} ({split}): {describe_examples('examples', examples)}"
    else:
        text, source = read_text(texts, corpus)
        try:
            windows = data.Samples(tokenizer.encode(text), cfg.n_ctx, 1, 0, tokenizer.bos_id)
        except ValueError as e:
            raise click.UsageError(f"{source}: {e}") from None
        spread = None
        if samples is not None:     # a whole number of batches, as --samples always took
            spread = min(samples, windows.n_samples)
            spread -= spread % min(batch, spread)
        starts = evaluation.window_starts(windows, spread)
        batch = min(batch, len(starts))
        n_batches = -(-len(starts) // batch)
        batches = evaluation.window_batches(windows, starts, batch)     # one at a time
        what = f"{source}: {len(starts)} windows of {cfg.n_ctx} tokens"
        packed = False
    check_memory(ctx, f"evaluating {model}", cfg, values, kw["precision"],
                 batch=batch)
    backend = select_backend(ctx)
    precision = resolve_precision(backend, kw["precision"])
    click.echo(f"planning {batch} x {cfg.n_ctx} tokens a run on {backend.name}", err=True)
    done = iter(range(1, n_batches + 1))

    def progress(loss_so_far):
        click.echo(f" [{next(done)}/{n_batches}]{perplexity_of(loss_so_far):.4f}", nl=False,
                   err=True)
    click.echo("perplexity so far, after each batch:", nl=False, err=True)
    loss, _ = evaluation.mean_loss(backend, cfg, values, batches, batch, adapters, precision,
                                   packed, progress)
    click.echo(err=True)
    with_lora = "".join(f" + {path}" for path in lora_paths)
    click.echo(f"eval on {describe_backend(backend)} in {precision}: {model}{with_lora} on "
               f"{what}")
    if not math.isfinite(loss):     # finite weights whose activations overflow float32
        raise click.ClickException(f"the loss of {model}{with_lora} is {loss}: its values "
                                   f"overflow {'halves' if precision == 'f16' else 'float32'} "
                                   f"in the forward pass")
    click.echo(f"loss {loss:.4f} nats/token, perplexity {perplexity_of(loss):.3f}")
