"""`ggwgpu chat`: talking to a model in the terminal through its chat template.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import contextlib
import sys

import click

from ggwgpu.tokenizer import VocabError

from .common import (MAX_DEFAULT_DECODE_CTX, InputPath, chat_template, check_memory, ctx_option,
                     describe_backend, load_model, lora_option, precision_option, resolve_precision,
                     load_tools, sampling_of, sampling_options, select_backend,
                     template_option, tools_option)
from .streaming import new_session, stream_reply


TOOL_RESULT = "/tool "     # with --tools: the line is a tool call's result


@click.command("chat")
@click.argument("model", type=InputPath(exists=True, dir_okay=False))
@click.option("--system", help="A system message that starts the conversation.")
@click.option("--n-predict", "-n", default=-1, show_default=True,
              type=click.IntRange(min=-1),
              help="Tokens per answer at most (-1: until an end-of-generation token).")
@sampling_options
@lora_option
@ctx_option("Tokens the KV cache holds", MAX_DEFAULT_DECODE_CTX)
@template_option()
@tools_option
@precision_option
@click.pass_context
def chat_command(ctx, model, system, n_predict, lora_paths, n_ctx, tools_path, **kw):
    """Talk with a chat model (its own template, else ChatML) in the terminal.

    Each line you type is a user message; the answer streams as it is sampled and ends at
    the model's end-of-generation token. The KV cache is kept across turns, so a turn costs
    only its new tokens; when the conversation outgrows the context (--n-ctx), the model
    sees the system message and the latest turns that fit. Ctrl-C stops an answer, Ctrl-D
    (or Ctrl-C at the prompt) ends the session. With --tools, a line that starts with
    "/tool " gives the result of the call the model made (a tool message), and the model
    answers it.
    """
    cfg, values, tokenizer, adapters = load_model(model, lora_paths, n_ctx)
    check_memory(ctx, f"chatting with {model}", cfg, values, kw["precision"],
                 decoder=True)
    template = chat_template(tokenizer, kw.pop("chat_template"), kw.pop("chat_template_kwargs"))
    tools = load_tools(tools_path, template)
    backend = select_backend(ctx)
    precision = resolve_precision(backend, kw["precision"])
    if sys.stdin is None or sys.stdin.closed:     # e.g. started with 0<&-
        raise click.ClickException("chat reads your messages from standard input, which is "
                                   "closed: run it in a terminal, or `ggwgpu generate MODEL "
                                   "--chat -p TEXT` for one answer")
    click.echo(f"chat on {describe_backend(backend)} in {precision}: {model}, n_ctx "
               f"{cfg.n_ctx}, seed {kw['seed']}; Ctrl-C stops an answer, Ctrl-D ends", err=True)
    session = new_session(backend, cfg, values, tokenizer, template, system, sampling_of(kw),
                          kw["seed"], adapters, precision, tools)
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
        role = "user"
        if tools and text.startswith(TOOL_RESULT):
            text, role = text[len(TOOL_RESULT):], "tool"
        try:
            stream_reply(session, text, n_predict, role)
        except KeyboardInterrupt:
            click.echo("(answer stopped)", err=True)
        except VocabError as e:     # the message cannot be tokenized: say so, talk on
            click.echo(f"that message was not sent: {e}", err=True)
