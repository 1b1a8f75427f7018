"""`ggwgpu train [TEXTS]...`: a llama trained from scratch and written as a llama GGUF.
Registered on the `ggwgpu` group by main.py; what it shares with finetune is in training.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import shlex

import click

from ggwgpu.generate import Sampling

from .common import (InputPath, check_memory, describe_backend, describe_precision,
                     planned_memory, select_backend)
from .streaming import stream_sample
from ggwgpu.training.inputs import default_checkpoint_path

from .training import (ProgressBar, across_ranks, existing_directory, guard_outputs, is_root,
                       local_batch, mpi_world, planning, positive, read_text, resume_args,
                       resumed_options, steps_of, train_options, training_options,
                       training_samples)


@click.command()
@click.argument("texts", nargs=-1, type=InputPath(exists=True, dir_okay=False))
@click.option("--out", default="model.gguf", show_default=True, type=click.Path(dir_okay=False),
              callback=existing_directory, help="The trained model, a llama GGUF.")
@click.option("--vocab-model", type=InputPath(exists=True, dir_okay=False),
              help="Use the vocabulary of this llama GGUF (default: bytes, no file needed).")
@click.option("--n-embd", default=128, show_default=True, type=positive())
@click.option("--n-head", default=4, show_default=True, type=positive())
@click.option("--n-head-kv", type=positive(),
              help="K/V heads, fewer than --n-head for grouped-query attention (each serves "
                   "n_head / n_head_kv query heads). Default: --n-head.")
@click.option("--tie-embeddings", is_flag=True,
              help="No output matrix: the output projection reads the token embedding.")
@click.option("--n-layer", default=4, show_default=True, type=positive())
@click.option("--n-ff", default=352, show_default=True, type=positive(),
              help="The feed-forward's width; with --n-expert, each expert's.")
@click.option("--n-expert", default=0, show_default=True, type=click.IntRange(min=0),
              help="A mixture of experts: each block's feed-forward is this many experts "
                   "(Mixtral's llama; 0: one dense feed-forward).")
@click.option("--n-expert-used", default=2, show_default=True, type=positive(),
              help="With --n-expert: the experts each token takes.")
@click.option("--n-ctx", default=64, show_default=True, type=positive(), help="Tokens per sample.")
@click.option("--n-rot", type=positive(),
              help="Rotated dims per head: the head dim, the only value llama.cpp loads.")
@click.option("--rope-freq-base", default=10000.0, show_default=True, type=positive(float))
@click.option("--rope-freq-scale", default=1.0, show_default=True, type=positive(float))
@click.option("--norm-eps", default=1e-5, show_default=True, type=positive(float))
@training_options(steps=300, warmup=50, seed_help="Init and sample-order seed.", command="train")
@click.option("--predict", default=0, show_default=True, type=click.IntRange(min=0),
              help="At the end, sample this many tokens from the trained model (prompt: the "
                   "text's first line; generate's default sampling, --seed).")
@click.pass_context
@across_ranks
def train(ctx, out, vocab_model, n_embd, n_head, n_head_kv, tie_embeddings, n_layer, n_ff,
          n_expert, n_expert_used, n_ctx, n_rot, rope_freq_base, rope_freq_scale, norm_eps,
          predict, **kw):
    """Train a llama from scratch on text files (default: the bundled Shakespeare corpus).

    The model is exported as a llama GGUF that llama.cpp loads. Defaults are a small model
    that trains in minutes on a CPU; llama.cpp's train-text-from-scratch used --n-embd 256
    --n-head 8 --n-layer 16 --n-ff 768 --n-ctx 128.

    Ctrl-C (SIGINT) or SIGTERM ends the run after the current step: it saves a checkpoint
    (--checkpoint-out, else next to --out) and prints the command that continues the run.
    """
    from ggwgpu import memory, tokenizer as tok
    from ggwgpu.training import checkpoint
    from ggwgpu.gguf_file import GGUFError
    from ggwgpu.models import ModelConfig, init_parameters
    from ggwgpu.tensor import ShapeError
    from ggwgpu.training import Trainer, unigram_entropy
    from ggwgpu.training.run import device_errors, run_steps

    checkpoint_in, checkpoint_out = kw["checkpoint_in"], kw["checkpoint_out"]
    checkpoint_path = checkpoint_out or default_checkpoint_path(out)
    guard_outputs(ctx, [*(("TEXTS", t) for t in kw["texts"]), ("--vocab-model", vocab_model),
                        ("--checkpoint-in", checkpoint_in)], out, checkpoint_path, kw)
    if checkpoint_in:
        try:
            cfg, values, tokenizer, opt_state, state = checkpoint.load_checkpoint(checkpoint_in)
        except GGUFError as e:
            raise click.ClickException(str(e)) from None
        shape = dict(n_embd=cfg.n_embd, n_head=cfg.n_head, n_head_kv=cfg.kv_heads,
                     tie_embeddings=cfg.tied_embeddings, n_layer=cfg.n_layer, n_ff=cfg.n_ff,
                     n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used or ...,
                     n_ctx=cfg.n_ctx, n_rot=cfg.rot, rope_freq_base=cfg.rope_freq_base,
                     rope_freq_scale=cfg.rope_freq_scale, norm_eps=cfg.norm_eps,
                     vocab_model=...)
        options = resumed_options(ctx, state, checkpoint_in, shape)
        step = state.step
        check_memory(ctx, f"{checkpoint_in}", cfg, values, batch=options.batch,
                     trained=memory.parameter_count(cfg), flash_attn=options.flash_attn,
                     precision=options.precision)
    else:
        try:
            tokenizer = tok.load_vocab(vocab_model) if vocab_model else tok.ByteTokenizer()
        except GGUFError as e:
            raise click.ClickException(str(e)) from None
        try:
            cfg = ModelConfig(n_vocab=tokenizer.n_vocab, n_embd=n_embd, n_head=n_head,
                              n_head_kv=n_head_kv, tied_embeddings=tie_embeddings,
                              n_layer=n_layer, n_ff=n_ff, n_ctx=n_ctx, n_rot=n_rot,
                              n_expert=n_expert, n_expert_used=n_expert_used if n_expert else 0,
                              norm_eps=norm_eps, rope_freq_base=rope_freq_base,
                              rope_freq_scale=rope_freq_scale)
        except ShapeError as e:
            raise click.UsageError(str(e)) from None
        if cfg.rot != cfg.head_dim:
            raise click.UsageError(f"--n-rot {cfg.rot} is not the head dim {cfg.head_dim} "
                                   f"(n_embd / n_head): llama.cpp refuses such a llama model")
        options = train_options(kw)
        check_memory(ctx, "this model", cfg, batch=options.batch,
                     trained=memory.parameter_count(cfg), flash_attn=options.flash_attn,
                     precision=options.precision)
        values, opt_state, state, step = init_parameters(cfg, kw["seed"]), None, None, 0

    if predict and cfg.n_ctx < 2:    # known now, not after the run
        raise click.UsageError(f"--predict needs a context of at least 2 tokens to sample "
                               f"in; the model's is {cfg.n_ctx}")
    text, source = read_text(kw["texts"], kw["corpus"])
    tokens, digest, samples = training_samples(text, tokenizer, cfg, options,
                                               kw["samples_after_nl"], state, checkpoint_in)
    steps = steps_of(kw, samples, options)
    local_batch(options)    # under mpirun: the batch must split over the processes
    backend = select_backend(ctx)
    planning(values)
    try:
        trainer = Trainer(cfg, values, backend, options, samples, opt_state, step,
                          world=mpi_world(), loss_scaler=state and state.loss_scaler)
    except ShapeError as e:  # a tensor over the device's limits, among others
        raise click.ClickException(str(e)) from None
    except device_errors() as e:
        raise click.ClickException(f"the device failed while planning the train step "
                                   f"({type(e).__name__}: {e})") from None
    entropy = unigram_entropy(tokens)
    world = mpi_world()
    click.echo(f"train on {describe_backend(backend)}" +
               (f" in each of {world.size} processes (MPI)" if world else "") +
               f"; {describe_precision(trainer)}")
    click.echo(f"data: {source}: {len(tokens)} tokens, {samples.n_samples} samples of "
               f"{cfg.n_ctx}; unigram entropy {entropy:.3f} nats/token")
    n_params = sum(v.size for v in values.values())
    click.echo(f"model: {n_params / 1e6:.2f} M parameters, {cfg.n_layer} layers, embd "
               f"{cfg.n_embd}, {cfg.n_head} heads, ff {cfg.n_ff}" +
               (f" in {cfg.n_expert} experts, {cfg.n_expert_used} a token" if cfg.n_expert
                else "") + f"; {steps} steps of "
               f"{options.batch * options.grad_accum} x {cfg.n_ctx} tokens; "
               f"{planned_memory(trainer.plan)}" +
               (f", resuming at step {step}" if step else ""))

    files = checkpoint.RunFiles(trainer, tokenizer, checkpoint_path, {"tokens_digest": digest})

    def resume_command(steps_left: int) -> str:
        args = resume_args(ctx, ["train"], checkpoint_path, steps_left) + ["--out", out]
        if predict:
            args += ["--predict", str(predict), "--seed", str(options.seed)]
        return shlex.join(args)

    result = run_steps(
        trainer, steps, log_path=kw["log_path"] if is_root() else None,
        save_every=kw["save_every"] if checkpoint_out else 0,
        save_checkpoint=files.save_checkpoint if is_root() else lambda: None,
        checkpoint_path=checkpoint_path, resume_command=resume_command, on_nan=kw["on_nan"],
        write_result=(lambda: files.write(out)) if is_root() else None, result_path=out,
        reporter=ProgressBar())
    if not is_root():
        return
    first, last, seconds = result.first, result.last, result.seconds
    if first is None:
        click.echo(f"model of step {trainer.step} written to {out}")
    else:
        click.echo(f"loss {first:.3f} -> {last:.3f} nats/token (unigram entropy "
                   f"{entropy:.3f}) in {seconds:.0f} s; model written to {out}")
    if predict:
        prompt = text.split("\n", 1)[0]
        click.echo(f"sample of {predict} tokens:")
        stream_sample(backend, cfg, trainer.parameters(), tokenizer, prompt, predict,
                      Sampling(), options.seed, precision=trainer.precision)
