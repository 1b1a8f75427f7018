"""`ggwgpu chat`: talking to a model in the terminal through its chat template, and the
one-turn answer of `ggwgpu generate --chat`.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import contextlib
import sys
import time

import click

from ggwgpu.tokenizer import Tokenizer, VocabError

from .common import (InputPath, chat_template, check_memory, ctx_option, describe_backend,
                     load_model, lora_option, precision_option, resolve_precision,
                     sampling_of, sampling_options, select_backend, template_option)


def stream_reply(session, text: str, n: int) -> int:
    """Print the answer to `text` piece by piece as it is sampled; the number of tokens."""
    from ggwgpu.generate import TextStream
    stream, count = TextStream(session.tokenizer), 0
    reply = session.reply(text, n)
    try:
        for token in reply:
            count += 1
            piece = stream.push(token)
            if piece:
                click.echo(piece, nl=False)
                sys.stdout.flush()
    finally:
        reply.close()       # an interrupted reply still joins the conversation
        click.echo(stream.finish())
    return count


def new_session(backend, cfg, values, tokenizer: Tokenizer, template, system, sampling, seed,
                adapters, precision="f32"):
    from ggwgpu.generate import ChatSession, Decoder
    decoder = Decoder(backend, cfg, values, adapters=adapters, precision=precision)
    return ChatSession(decoder, tokenizer, template, system, sampling, seed)


def chat_answer(backend, cfg, values, tokenizer: Tokenizer, template, system, prompt, n, sampling,
                seed, adapters=(), precision="f32"):
    """generate --chat: the answer to one user message, then a timing line on stderr."""
    t0 = time.perf_counter()
    session = new_session(backend, cfg, values, tokenizer, template, system, sampling, seed,
                          adapters, precision)
    t1 = time.perf_counter()
    try:
        count = stream_reply(session, prompt, n)
    except VocabError as e:         # before any token: a lone surrogate, say
        raise click.UsageError(f"--prompt: {e}") from None
    t2 = time.perf_counter()
    click.echo(f"{count} tokens in {t2 - t1:.2f} s ({count / (t2 - t1):.1f} tokens/s, the prompt "
               f"pass included; planning {t1 - t0:.2f} s)", err=True)


@click.command("chat")
@click.argument("model", type=InputPath(exists=True, dir_okay=False))
@click.option("--system", help="A system message that starts the conversation.")
@click.option("--n-predict", "-n", default=-1, show_default=True,
              type=click.IntRange(min=-1),
              help="Tokens per answer at most (-1: until an end-of-generation token).")
@sampling_options
@lora_option
@ctx_option("Tokens the KV cache holds")
@template_option()
@precision_option
@click.pass_context
def chat_command(ctx, model, system, n_predict, lora_paths, n_ctx, **kw):
    """Talk with a chat model (its own template, else ChatML) in the terminal.

    Each line you type is a user message; the answer streams as it is sampled and ends at
    the model's end-of-generation token. The KV cache is kept across turns, so a turn costs
    only its new tokens; when the conversation outgrows the context (--n-ctx), the model
    sees the system message and the latest turns that fit. Ctrl-C stops an answer, Ctrl-D
    (or Ctrl-C at the prompt) ends the session.
    """
    cfg, values, tokenizer, adapters = load_model(model, lora_paths, n_ctx)
    check_memory(ctx, f"chatting with {model}", cfg, values, kw["precision"],
                 decoder=True)
    template = chat_template(tokenizer, kw.pop("chat_template"))
    backend = select_backend(ctx)
    precision = resolve_precision(backend, kw["precision"])
    if sys.stdin is None or sys.stdin.closed:     # e.g. started with 0<&-
        raise click.ClickException("chat reads your messages from standard input, which is "
                                   "closed: run it in a terminal, or `ggwgpu generate MODEL "
                                   "--chat -p TEXT` for one answer")
    click.echo(f"chat on {describe_backend(backend)} in {precision}: {model}, n_ctx "
               f"{cfg.n_ctx}, seed {kw['seed']}; Ctrl-C stops an answer, Ctrl-D ends", err=True)
    session = new_session(backend, cfg, values, tokenizer, template, system, sampling_of(kw),
                          kw["seed"], adapters, precision)
    try:
        import readline  # noqa: F401  (line editing and history for the prompt)
    except ImportError:
        pass
    with contextlib.suppress(AttributeError, ValueError):
        # a line that is not UTF-8 reaches the tokenizer, which refuses it: not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            text = click.prompt("", prompt_suffix="> ")
        except click.Abort:     # Ctrl-D, or Ctrl-C at the prompt
            click.echo()
            return
        try:
            stream_reply(session, text, n_predict)
        except KeyboardInterrupt:
            click.echo("(answer stopped)", err=True)
        except VocabError as e:     # the message cannot be tokenized: say so, talk on
            click.echo(f"that message was not sent: {e}", err=True)
