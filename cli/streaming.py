"""Text streamed to the terminal as a model samples it: a continuation (`generate`, `train
--predict`) and chat answers (`chat`, `generate --chat`), with a timing line on stderr.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import sys
import time

import click

from ggwgpu.tokenizer import Tokenizer, VocabError


def stream_sample(backend, cfg, values, tokenizer: Tokenizer, prompt, n, sampling, seed,
                  adapters=(), precision="f32"):
    """Print the prompt, then the continuation as it comes (flushed piece by piece), then a
    timing line on stderr."""
    from ggwgpu.generate import (Decoder, TextStream, context_bos, generate_tokens,
                                 prompt_tokens)
    t0 = time.perf_counter()
    try:
        ids = prompt_tokens(tokenizer, prompt)
    except ValueError as e:         # VocabError: a lone surrogate, a piece without a token
        raise click.UsageError(f"--prompt: {e}") from None
    decoder = Decoder(backend, cfg, values, adapters=adapters, precision=precision)
    stream = TextStream(tokenizer, ids)
    click.echo(stream.push(), nl=False)
    t1, count = time.perf_counter(), 0
    first = None        # when the first token came: the prompt pass and its sample
    for token in generate_tokens(decoder, ids, n, sampling, seed, context_bos(tokenizer),
                                 tokenizer.eog_ids):
        count += 1
        first = first or time.perf_counter()
        piece = stream.push(token)
        if piece:
            click.echo(piece, nl=False)
            sys.stdout.flush()
    click.echo(stream.finish())
    t2 = time.perf_counter()
    first = first or t2
    # as llama.cpp reports them: the prompt pass, then the tokens after the first
    after = f"{(count - 1) / (t2 - first):.1f} tokens/s" if count > 1 else "-"
    click.echo(f"prompt: {len(ids)} tokens in {first - t1:.2f} s "
               f"({len(ids) / (first - t1):.1f} tokens/s); generation: {count} tokens in "
               f"{t2 - t1:.2f} s ({after} after the first); planning {t1 - t0:.2f} s, "
               f"{decoder.memory() / 2**20:.1f} MiB planned", err=True)


def stream_reply(session, text: str, n: int, role: str = "user") -> int:
    """Print the answer to `text` (a `role` message) piece by piece as it is sampled; the
    number of tokens."""
    from ggwgpu.generate import TextStream
    stream, count = TextStream(session.tokenizer), 0
    reply = session.reply(text, n, role)
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
                adapters, precision="f32", tools=None):
    from ggwgpu.generate import ChatSession, Decoder
    decoder = Decoder(backend, cfg, values, adapters=adapters, precision=precision)
    return ChatSession(decoder, tokenizer, template, system, sampling, seed, tools)


def chat_answer(backend, cfg, values, tokenizer: Tokenizer, template, system, prompt, n, sampling,
                seed, adapters=(), precision="f32", tools=None):
    """generate --chat: the answer to one user message, then a timing line on stderr."""
    t0 = time.perf_counter()
    session = new_session(backend, cfg, values, tokenizer, template, system, sampling, seed,
                          adapters, precision, tools)
    t1 = time.perf_counter()
    try:
        count = stream_reply(session, prompt, n)
    except VocabError as e:         # before any token: a lone surrogate, say
        raise click.UsageError(f"--prompt: {e}") from None
    t2 = time.perf_counter()
    click.echo(f"{count} tokens in {t2 - t1:.2f} s ({count / (t2 - t1):.1f} tokens/s, the prompt "
               f"pass included; planning {t1 - t0:.2f} s)", err=True)
