"""`ggwgpu finetune BASE [TEXTS]...`: a LoRA adapter (or with --full every weight) trained on
text; `ggwgpu merge BASE ADAPTER... --out OUT`: adapters added into the base's weights.
Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import math
import re
import shlex

import click

from ggwgpu import gguf_file, gguf_llama
from ggwgpu.lora import GLOBAL_TARGETS, MERGE_TYPES, TARGETS
from ggwgpu.training import checkpoint
from ggwgpu.training.inputs import best_path, data_files, default_checkpoint_path

from .common import (FiniteFloat, InputPath, chat_template, check_memory, ctx_option,
                     describe_backend, describe_precision, planned_memory, select_backend,
                     with_context)
from .outputs import check_outputs
from .training import (ProgressBar, across_ranks, check_steps, data_options,
                       existing_directory, guard_outputs, is_root, local_batch, mpi_world,
                       resume_args, resumed_options, stage, steps_of, train_options,
                       training_options, usage_errors)


MAX_LAYER = 65535      # no llama comes near; the model's own count is checked later


def parse_layers(ctx, param, value):
    """'0-3,6' -> [0, 1, 2, 3, 6]; None (all layers) when not given. Indices above
    MAX_LAYER are refused here, before a range of a billion is spelled out."""
    if value is None:
        return None
    layers = set()
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m[2] and int(m[2]) < int(m[1])):
            raise click.BadParameter(f"{part!r} is not a layer or a range like 0-3")
        last = int(m[2] or m[1])
        if last > MAX_LAYER:
            raise click.BadParameter(f"layer {last} is beyond any llama's (at most {MAX_LAYER})")
        layers.update(range(int(m[1]), last + 1))
    return sorted(layers)


def rank_options(command):
    """--rank-wq ... --rank-tok-embd, as llama.cpp's old finetune named them."""
    for kind in reversed(list(TARGETS)):
        command = click.option(
            f"--rank-{kind.replace('_', '-')}", f"rank_{kind}", type=click.IntRange(min=0),
            help=f"LoRA rank on {TARGETS[kind]} (default --lora-r"
                 + ("; 0 when the base ties its embeddings" if kind in GLOBAL_TARGETS else "")
                 + "; 0: no pair).")(command)
    return command


@click.command("finetune")
@click.argument("base", type=InputPath(exists=True, dir_okay=False))
@click.argument("texts", nargs=-1, type=InputPath(exists=True, dir_okay=False))
@click.option("--out", default="adapter.gguf", show_default=True, type=click.Path(dir_okay=False),
              callback=existing_directory,
              help="The LoRA adapter (llama.cpp's --lora reads it), or with --full the model.")
@click.option("--full", is_flag=True,
              help="Train every weight of an f32/f16 base and write a model, not an adapter.")
@click.option("--lora-r", default=4, show_default=True, type=click.IntRange(min=0),
              help="LoRA rank of every adapted weight (see --rank-*).")
@click.option("--lora-alpha", default=4.0, show_default=True, type=FiniteFloat(min=0),
              help="LoRA alpha: a pair of rank r adds alpha / r * B A (0: B A).")
@rank_options
@click.option("--lora-layers", callback=parse_layers,
              help="Blocks whose weights get LoRA pairs, e.g. '0-3,6' (default: all).")
@ctx_option("Tokens per sample")
@data_options
@click.option("--val-split", type=FiniteFloat(0, 1, min_open=True, max_open=True),
              help="Hold out this fraction of the --data examples for validation (when the "
                   "data has no valid.jsonl).")
@click.option("--val-every", default=0, type=click.IntRange(min=0),
              help="Validation loss every N steps (default: at the end, when there is a "
                   "validation set); the best weights are kept in OUT's .best.gguf.")
@click.option("--val-batches", default=0, type=click.IntRange(min=0),
              help="Batches of the validation set per evaluation (0: all of it).")
@click.option("--early-stop", default=0, type=click.IntRange(min=0),
              help="Stop after this many evaluations without a lower validation loss.")
@training_options(steps=100, warmup=10, seed_help="Seed of the LoRA init and the sample order.",
                  command="finetune")
@click.pass_context
@across_ranks
def finetune_command(ctx, base, out, full, lora_r, lora_alpha, lora_layers, n_ctx, **kw):
    """Finetune BASE, a GGUF model of a family ggwgpu builds (docs/families.md; f32, f16,
    bf16, q4_0 .. q8_0 or q2_k .. q6_k), on text files (default: the bundled Shakespeare
    corpus), with BASE's vocabulary.

    By default this trains a LoRA adapter on the frozen base (kept in its storage type on the
    device) and writes it as a GGUF adapter for `ggwgpu generate BASE --lora OUT`,
    `ggwgpu merge` or llama.cpp's `llama-cli -m BASE --lora OUT`. Each adapted weight W gets
    A (random) and B (zero), so step 0 is the base model. --full trains every weight instead.
    """
    from ggwgpu import lora
    from ggwgpu.quant import Quantized, dequantize
    from ggwgpu.training.run import Validation, run_steps
    from ggwgpu.training.setup import FinetuneData, prepare_finetune

    ranks = {key[len("rank_"):]: kw.pop(key) for key in list(kw) if key.startswith("rank_")}
    checkpoint_in, checkpoint_out = kw["checkpoint_in"], kw["checkpoint_out"]
    samples_after_nl = kw["samples_after_nl"]
    mode = "full" if full else "lora"
    checkpoint_path = checkpoint_out or default_checkpoint_path(out)
    guard_outputs(ctx, [("BASE", base), *(("TEXTS", t) for t in kw["texts"]),
                        ("--checkpoint-in", checkpoint_in),
                        ("--chat-template", kw["chat_template"]),
                        *(("--data", path) for path in data_files(kw["data_path"]))],
                  out, checkpoint_path, kw,
                  more=[("the best weights", best_path(out))] if kw["data_path"] else [])
    try:
        cfg, values, tokenizer = gguf_llama.load_model(base, keep_quantized=True)
    except gguf_file.GGUFError as e:
        raise click.ClickException(str(e)) from None
    base_digest = lora.model_digest(cfg, values)
    model_cfg = cfg         # the base's own context length stays in what is written
    if full:
        blocks = {v.dtype for v in values.values() if isinstance(v, Quantized)} - {"f16"}
        if blocks:
            raise click.UsageError(f"--full trains f32 weights, but {base} holds "
                                   f"{', '.join(sorted(blocks))} ones: finetune it with LoRA "
                                   f"(without --full), or start from an f32/f16 model")
        values = {n: dequantize(v) if isinstance(v, Quantized) else v for n, v in values.items()}
    if kw["data_path"] and kw["texts"]:
        raise click.UsageError("give TEXTS or --data, not both")

    adapter, opt_state, state, step = None, None, None, 0
    if checkpoint_in:
        try:
            kind = gguf_file.read_metadata(checkpoint_in).get(gguf_file.K_TYPE)
            if (kind == "adapter") == full:
                raise click.UsageError(f"{checkpoint_in} is a {'LoRA' if full else 'full'} "
                                       f"finetune checkpoint: {'drop' if full else 'add'} "
                                       f"--full to resume it")
            if full:
                _, values, _, opt_state, state = checkpoint.load_checkpoint(checkpoint_in)
            else:
                adapter, opt_state, state = lora.load_adapter_checkpoint(checkpoint_in, cfg)
        except gguf_file.GGUFError as e:
            raise click.ClickException(str(e)) from None
        with usage_errors():
            checkpoint.check_finetune_state(state, base_digest, mode, checkpoint_in, base)
        n_ctx = state.n_ctx if state.n_ctx is not None else model_cfg.n_ctx
        fixed = dict(samples_after_nl=state.samples_after_nl, n_ctx=n_ctx, lora_r=...,
                     lora_layers=..., **{f"rank_{kind}": ... for kind in TARGETS})
        if not full:
            fixed["lora_alpha"] = adapter.alpha
        options, step = resumed_options(ctx, state, checkpoint_in, fixed), state.step
        samples_after_nl = state.samples_after_nl
    else:
        options = train_options(kw)
        if not full:
            try:
                pair_ranks = lora.lora_ranks(cfg, lora_r, ranks, lora_layers)
            except ValueError as e:
                raise click.UsageError(str(e)) from None
            check_memory(ctx, f"finetuning {base}", with_context(model_cfg, n_ctx), values,
                         batch=rows_of(options), trained=lora.pair_values(cfg, pair_ranks),
                         flash_attn=options.flash_attn, precision=options.precision)
            adapter = lora.init_adapter(cfg, pair_ranks, lora_alpha, kw["seed"])

    cfg = with_context(model_cfg, n_ctx)
    trained = (sum(v.size for v in adapter.tensors.values()) if adapter else
               sum(math.prod(v.shape) for v in values.values()))
    check_memory(ctx, f"finetuning {base}", cfg, values, batch=rows_of(options),
                 trained=trained, flash_attn=options.flash_attn, precision=options.precision)
    preference = options.objective != "sft"
    check_steps(kw)
    local_batch(options)    # under mpirun: the batch must split over the processes
    data = FinetuneData(kw["texts"], kw["corpus"], kw["data_path"],
                        chat_template(tokenizer, kw["chat_template"],
                                      kw["chat_template_kwargs"]) if kw["data_path"] else None,
                        kw["mask_prompt"], kw["drop_long"], not kw["no_pack"], kw["val_split"],
                        bool(kw["val_every"] or kw["early_stop"]), samples_after_nl,
                        kw["every_answer"])
    backend = select_backend(ctx)
    with usage_errors():
        run = prepare_finetune(model_cfg, cfg, tokenizer, base_digest, values, adapter, options,
                               data, backend, checkpoint_path, step=step, opt_state=opt_state,
                               state=state, checkpoint_in=checkpoint_in, world=mpi_world(),
                               stage=stage)
    trainer, files, validation_set = run.trainer, run.files, run.valid
    steps = steps_of(kw, trainer.batches, options)
    n_base = sum(math.prod(v.shape) for v in values.values())
    n_trained = sum(p.nelements for p in trainer.graph.params.values())
    world = mpi_world()
    click.echo(f"finetune on {describe_backend(backend)}" +
               (f" in each of {world.size} processes (MPI)" if world else "") +
               f"; {describe_precision(trainer)}")
    click.echo(f"base: {base}: {n_base / 1e6:.2f} M parameters, {cfg.n_layer} layers, embd "
               f"{cfg.n_embd}, ctx {cfg.n_ctx}" + (f", resuming at step {step}" if step else ""))
    for line in run.lines:
        click.echo(line)
    what = "every weight" if full else (
        f"LoRA alpha {adapter.alpha:g} on {len(adapter.weights())} weights"
        + (f", dropout {options.lora_dropout:g}" if options.lora_dropout else ""))
    if options.neftune_alpha:
        what += f", NEFTune alpha {options.neftune_alpha:g}"
    per_step = options.batch * options.grad_accum
    rows = f"{per_step} x {cfg.n_ctx} tokens"
    if preference:
        unit = "packed pairs of rows" if trainer.graph.packed else (
            "examples" if options.objective == "kto" else "pairs")
        rows = f"{per_step} {unit} ({2 * per_step} x {cfg.n_ctx} tokens, {options.objective})"
    click.echo(f"training {what}: {n_trained} parameters; {steps} steps of {rows}; "
               f"{planned_memory(trainer.plan)}")

    if adapter is not None and cfg.tied_embeddings and \
            {"token_embd.weight", "output.weight"} & set(adapter.weights()):
        click.echo("note: the base ties its output to token_embd, and llama.cpp cannot apply "
                   "a LoRA pair on either: use the adapter in ggwgpu, or `ggwgpu merge` it "
                   "into a model llama.cpp loads", err=True)

    def resume_command(steps_left: int) -> str:
        args = resume_args(ctx, ["finetune", base], checkpoint_path, steps_left)
        return shlex.join(args + ["--out", out] + (["--full"] if full else []))

    def write_to(path):
        """The trained model (--full) or adapter, written to `path` by rank 0."""
        if is_root():
            files.write(path)

    validation = None
    if validation_set is not None:
        validation = Validation(
            lambda: trainer.evaluation(validation_set.in_order(kw["val_batches"] or None)),
            kw["val_every"] or steps, kw["early_stop"], lambda: write_to(best_path(out)))

    result = run_steps(trainer, steps, log_path=kw["log_path"] if is_root() else None,
                       save_every=kw["save_every"] if checkpoint_out else 0,
                       save_checkpoint=files.save_checkpoint if is_root() else lambda: None,
                       checkpoint_path=checkpoint_path,
                       resume_command=resume_command, on_nan=kw["on_nan"],
                       validation=validation, write_result=lambda: write_to(out),
                       result_path=out, reporter=ProgressBar())
    if not is_root():
        return
    product = "model" if full else "adapter"
    first, last, seconds = result.first, result.last, result.seconds
    if first is None:
        click.echo(f"{product} of step {trainer.step} written to {out}")
    else:
        unit = f"({options.objective})" if preference else "nats/token"
        click.echo(f"loss {first:.3f} -> {last:.3f} {unit} in {seconds:.0f} s; {product} "
                   f"written to {out}")
    if validation is not None:
        click.echo(f"best validation loss {validation.best:.4f}: kept in {best_path(out)}")


def rows_of(options) -> int:
    """The rows of a step's batch: two a pair for a preference objective."""
    return options.batch * (1 if options.objective == "sft" else 2)


@click.command("merge")
@click.argument("base", type=InputPath(exists=True, dir_okay=False))
@click.argument("adapters", nargs=-1, required=True,
                type=InputPath(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="The merged model, a GGUF of BASE's family.")
@click.option("--type", "dtype", type=click.Choice(MERGE_TYPES), default="auto",
              show_default=True,
              help="auto: as llama.cpp's llama-export-lora, the weights a pair changes in f16 "
                   "(f32 where BASE holds f32), the others as BASE stores them; f32: every "
                   "weight f32; a block type: every 2-D weight whose rows are a multiple of "
                   "32 values in it, as `ggwgpu quantize` writes.")
def merge_command(base, adapters, out, dtype):
    """Add the LoRA pairs of each ADAPTER into the weights of BASE (W + alpha / r * B A, as
    llama.cpp applies them, summed over the dequantized weight) and write the result as a
    model (llama.cpp's llama-cli loads it)."""
    from ggwgpu import lora
    check_outputs([("BASE", base), *(("ADAPTER", a) for a in adapters)], [("--out", out)])
    try:
        cfg, values, tokenizer = gguf_llama.load_model(base, keep_quantized=True)
        loaded = [lora.load_adapter(path, cfg) for path in adapters]
        cfg, merged = lora.merge(cfg, values, loaded, dtype)
        gguf_llama.save_model(out, cfg, merged, tokenizer)
    except gguf_file.GGUFError as e:
        raise click.ClickException(str(e)) from None
    n = sum(len(a.weights()) for a in loaded)
    size = sum(v.nbytes for v in merged.values()) / 2 ** 20
    click.echo(f"{out}: {base} with {n} LoRA pairs of {len(loaded)} adapter(s) merged "
               f"(--type {dtype}; weights {size:.2f} MiB)")
