"""`ggwgpu finetune BASE [TEXTS]...`: a LoRA adapter (or with --full every weight) trained on
text; `ggwgpu merge BASE ADAPTER... --out OUT`: adapters added into the base's weights.
Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import math
import re
import shlex
import sys

import click

from ggwgpu import gguf_io
from ggwgpu.lora import TARGETS


def main_module(ctx):
    """cli/main.py as it was loaded (the script, cli.main or ggwgpu_cli.main), for the helpers
    the train command shares (select_backend, training_loop): main.py imports this module,
    so importing main.py here would load it a second time."""
    return sys.modules[ctx.find_root().command.callback.__module__]


def parse_layers(ctx, param, value):
    """'0-3,6' -> [0, 1, 2, 3, 6]; None (all layers) when not given."""
    if value is None:
        return None
    layers = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m[2] and int(m[2]) < int(m[1])):
            raise click.BadParameter(f"{part!r} is not a layer or a range like 0-3")
        layers.extend(range(int(m[1]), int(m[2] or m[1]) + 1))
    return layers


def rank_options(command):
    """--rank-wq ... --rank-tok-embd, as llama.cpp's old finetune named them."""
    for kind in reversed(list(TARGETS)):
        command = click.option(
            f"--rank-{kind.replace('_', '-')}", f"rank_{kind}", type=click.IntRange(min=0),
            help=f"LoRA rank on {TARGETS[kind]} (default --lora-r; 0: no pair).")(command)
    return command


def positive(kind=int):
    return click.IntRange(min=1) if kind is int else click.FloatRange(min=0, min_open=True)


@click.command("finetune")
@click.argument("base", type=click.Path(exists=True, dir_okay=False))
@click.argument("texts", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", default="adapter.gguf", show_default=True, type=click.Path(dir_okay=False),
              help="The LoRA adapter (llama.cpp's --lora reads it), or with --full the model.")
@click.option("--full", is_flag=True,
              help="Train every weight of an f32/f16 base and write a model, not an adapter.")
@click.option("--lora-r", default=4, show_default=True, type=click.IntRange(min=0),
              help="LoRA rank of every adapted weight (see --rank-*).")
@click.option("--lora-alpha", default=4.0, show_default=True, type=click.FloatRange(min=0),
              help="LoRA alpha: a pair of rank r adds alpha / r * B A (0: B A).")
@rank_options
@click.option("--lora-layers", callback=parse_layers,
              help="Blocks whose weights get LoRA pairs, e.g. '0-3,6' (default: all).")
@click.option("--batch", default=8, show_default=True, type=positive(),
              help="Samples per micro-batch.")
@click.option("--grad-accum", default=1, show_default=True, type=positive(),
              help="Micro-batches whose gradients add up to one optimizer step.")
@click.option("--samples-after-nl", is_flag=True, help="Start samples only after newlines.")
@click.option("--steps", default=100, show_default=True, type=positive(), help="Optimizer steps.")
@click.option("--epochs", type=positive(float), help="Train this many epochs instead of --steps.")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(["adamw", "sgd"]))
@click.option("--lr", default=1e-3, show_default=True, type=positive(float))
@click.option("--beta1", default=0.9, show_default=True,
              type=click.FloatRange(0, 1, max_open=True))
@click.option("--beta2", default=0.999, show_default=True,
              type=click.FloatRange(0, 1, max_open=True))
@click.option("--adam-eps", default=1e-8, show_default=True, type=positive(float))
@click.option("--weight-decay", default=0.1, show_default=True, type=click.FloatRange(min=0),
              help="AdamW decay, relative to the learning rate, on tensors with >= 2 dims.")
@click.option("--grad-clip", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="Clip gradients to this global norm (0: off).")
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--cos-decay-steps", default=1000, show_default=True, type=positive())
@click.option("--cos-decay-min", default=0.1, show_default=True, type=click.FloatRange(0, 1))
@click.option("--cos-decay-restart", default=1.1, show_default=True,
              type=click.FloatRange(min=1))
@click.option("--restarts/--no-restarts", default=False, show_default=True)
@click.option("--flash-attn", is_flag=True, help="Fused attention (same results, less memory).")
@click.option("--checkpointing", is_flag=True,
              help="Gradient checkpointing: recompute activations, keep block outputs only.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed of the LoRA init and the sample order.")
@click.option("--checkpoint-in", type=click.Path(exists=True, dir_okay=False),
              help="Resume from this finetune checkpoint (same base and text).")
@click.option("--checkpoint-out", type=click.Path(dir_okay=False),
              help="Write a checkpoint here (atomically) every --save-every steps and at the "
                   "end. A run stopped by SIGINT/SIGTERM or a non-finite step saves here too "
                   "(default: next to --out, adapter.gguf -> adapter.checkpoint.gguf).")
@click.option("--save-every", default=100, show_default=True, type=positive())
@click.option("--log", "log_path", type=click.Path(dir_okay=False),
              help="Append a JSON line per step here.")
@click.option("--on-nan", default="stop", show_default=True, type=click.Choice(["stop", "skip"]),
              help="A step with a non-finite loss or gradient never updates the weights; then "
                   "stop (saving a checkpoint) or skip the step and go on.")
@click.pass_context
def finetune_command(ctx, base, texts, out, full, lora_r, lora_alpha, lora_layers, batch,
                     grad_accum, samples_after_nl, steps, epochs, optimizer, lr, beta1, beta2,
                     adam_eps, weight_decay, grad_clip, warmup, cos_decay_steps, cos_decay_min,
                     cos_decay_restart, restarts, flash_attn, checkpointing, seed,
                     checkpoint_in, checkpoint_out, save_every, log_path, on_nan, **ranks):
    """Finetune BASE, a llama GGUF (f32, f16, q8_0 or q4_0), on text files (default: the
    bundled Shakespeare corpus), with BASE's vocabulary.

    By default this trains a LoRA adapter on the frozen base (kept in its storage type on the
    device) and writes it as a GGUF adapter for `ggwgpu generate BASE --lora OUT`,
    `ggwgpu merge` or llama.cpp's `llama-cli -m BASE --lora OUT`. Each adapted weight W gets
    A (random) and B (zero), so step 0 is the base model. --full trains every weight instead.
    """
    from ggwgpu import data, lora
    from ggwgpu.models.llama import build_train_graph
    from ggwgpu.quant import Quantized, dequantize
    from ggwgpu.tensor import ShapeError
    from ggwgpu.train import Trainer, TrainOptions, token_digest

    main = main_module(ctx)
    for path in (out, checkpoint_out, log_path):    # before any work, as train checks them
        main.existing_directory(ctx, None, path)
    mode = "full" if full else "lora"
    try:
        cfg, values, tokenizer = gguf_io.load_model(base, keep_quantized=True)
    except gguf_io.GGUFError as e:
        raise click.ClickException(str(e)) from None
    base_digest = lora.model_digest(cfg, values)
    if full:
        blocks = {v.dtype for v in values.values() if isinstance(v, Quantized)} - {"f16"}
        if blocks:
            raise click.UsageError(f"--full trains f32 weights, but {base} holds "
                                   f"{', '.join(sorted(blocks))} ones: finetune it with LoRA "
                                   f"(without --full), or start from an f32/f16 model")
        values = {n: dequantize(v) if isinstance(v, Quantized) else v for n, v in values.items()}
    try:
        text = data.read_texts(texts) if texts else data.bundled_corpus()
    except ValueError as e:
        raise click.UsageError(str(e)) from None

    adapter, opt_state, state, step = None, None, None, 0
    if checkpoint_in:
        try:
            kind = gguf_io.read_metadata(checkpoint_in).get(gguf_io.K_TYPE)
            if (kind == "adapter") == full:
                raise click.UsageError(f"{checkpoint_in} is a {'LoRA' if full else 'full'} "
                                       f"finetune checkpoint: {'drop' if full else 'add'} "
                                       f"--full to resume it")
            if full:
                _, values, _, opt_state, state = gguf_io.load_checkpoint(checkpoint_in)
            else:
                adapter, opt_state, state = lora.load_adapter_checkpoint(checkpoint_in, cfg)
        except gguf_io.GGUFError as e:
            raise click.ClickException(str(e)) from None
        if state.get("base") != base_digest or state.get("mode") != mode:
            raise click.UsageError(f"{checkpoint_in} finetunes another base model (digest "
                                   f"{state.get('base')}; {base} is {base_digest}): resume "
                                   f"with the base it started from")
        options, step = TrainOptions(**state["options"]), state["step"]
        samples_after_nl = state["samples_after_nl"]
    else:
        options = TrainOptions(optimizer=optimizer, batch=batch, grad_accum=grad_accum, lr=lr,
                               beta1=beta1, beta2=beta2, eps=adam_eps,
                               weight_decay=weight_decay, grad_clip=grad_clip, warmup=warmup,
                               cos_decay_steps=cos_decay_steps, cos_decay_min=cos_decay_min,
                               cos_decay_restart=cos_decay_restart, restarts=restarts,
                               flash_attn=flash_attn, checkpointing=checkpointing, seed=seed)
        if not full:
            chosen = {key[len("rank_"):]: rank for key, rank in ranks.items()}
            try:
                adapter = lora.init_adapter(cfg, lora.lora_ranks(cfg, lora_r, chosen, lora_layers),
                                            lora_alpha, seed)
            except ValueError as e:
                raise click.UsageError(str(e)) from None

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

    backend = main.select_backend(ctx)
    try:
        graph = build_train_graph(cfg, values, options.batch, options.flash_attn, lora=adapter)
        trainer = Trainer(cfg, values, backend, options, samples, opt_state, step, graph=graph)
    except (ShapeError, *main.device_errors()) as e:   # over the device's limits, among others
        raise click.ClickException(f"cannot plan the finetune step: {type(e).__name__}: "
                                   f"{e}") from None
    n_base = sum(math.prod(v.shape) for v in values.values())
    n_trained = sum(p.nelements for p in graph.params.values())
    click.echo(f"finetune on {main.describe_backend(backend)}")
    click.echo(f"base: {base}: {n_base / 1e6:.2f} M parameters, {cfg.n_layer} layers, embd "
               f"{cfg.n_embd}, ctx {cfg.n_ctx}" + (f", resuming at step {step}" if step else ""))
    what = "every weight" if full else (f"LoRA alpha {adapter.alpha:g} on "
                                        f"{len(adapter.weights())} weights")
    click.echo(f"training {what}: {n_trained} parameters; {samples.n_samples} samples of "
               f"{cfg.n_ctx} tokens, {steps} steps of {options.batch * options.grad_accum}")

    def trained_adapter():
        return lora.Adapter(adapter.alpha, trainer.parameters())

    checkpoint_path = checkpoint_out or main.default_checkpoint_path(out)

    def save_checkpoint():
        state = {**trainer.state(), "tokens_digest": digest, "base": base_digest, "mode": mode,
                 "samples_after_nl": samples_after_nl}
        if full:
            gguf_io.save_checkpoint(checkpoint_path, cfg, trainer.parameters(), tokenizer,
                                    trainer.optimizer_state(), state)
        else:
            lora.save_adapter_checkpoint(checkpoint_path, trained_adapter(), cfg,
                                         trainer.optimizer_state(), state)

    def resume_command(steps_left: int) -> str:
        """The command line that continues this run from checkpoint_path."""
        args = ["ggwgpu"] + (["--backend", ctx.obj["backend"]] if ctx.obj["backend"] else [])
        args += ["finetune", base, *texts, "--checkpoint-in", checkpoint_path, "--steps",
                 str(steps_left), "--out", out] + (["--full"] if full else [])
        if checkpoint_out:
            args += ["--checkpoint-out", checkpoint_out, "--save-every", str(save_every)]
        if log_path:
            args += ["--log", log_path]
        return shlex.join(args + ["--on-nan", on_nan])

    first, last, seconds = main.training_loop(trainer, steps, log_path,
                                              save_every if checkpoint_out else 0,
                                              save_checkpoint, checkpoint_path, resume_command,
                                              on_nan)
    try:
        if full:
            gguf_io.save_model(out, cfg, trainer.parameters(), tokenizer)
        else:
            lora.save_adapter(out, trained_adapter(), cfg, base_digest)
    except gguf_io.GGUFError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"loss {first:.3f} -> {last:.3f} nats/token in {seconds:.0f} s; "
               f"{'model' if full else 'adapter'} written to {out}")


@click.command("merge")
@click.argument("base", type=click.Path(exists=True, dir_okay=False))
@click.argument("adapters", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="The merged model, a llama GGUF (f32).")
def merge_command(base, adapters, out):
    """Add the LoRA pairs of each ADAPTER into the weights of BASE (W + alpha / r * B A, as
    llama.cpp applies them) and write the result as an f32 model; a quantized base is
    dequantized first."""
    from ggwgpu import lora
    try:
        cfg, values, tokenizer = gguf_io.load_model(base, keep_quantized=True)
        loaded = [lora.load_adapter(path, cfg) for path in adapters]
        gguf_io.save_model(out, cfg, lora.merge(values, loaded), tokenizer)
    except gguf_io.GGUFError as e:
        raise click.ClickException(str(e)) from None
    n = sum(len(a.weights()) for a in loaded)
    click.echo(f"{out}: {base} with {n} LoRA pairs of {len(loaded)} adapter(s) merged (f32)")
