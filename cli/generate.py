"""`ggwgpu generate MODEL`: a prompt continued (or with --chat answered) by a llama GGUF,
streamed as it is sampled. Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import click

from .common import InputPath, chat_template as load_chat_template
from .common import (MAX_DEFAULT_DECODE_CTX, check_memory, ctx_option, describe_backend,
                     load_model, load_tools, lora_option, precision_option, resolve_precision,
                     sampling_of, sampling_options, select_backend, template_option,
                     tools_option)
from .streaming import chat_answer, stream_sample


@click.command()
@click.argument("model", type=InputPath(exists=True, dir_okay=False))
@click.option("--prompt", "-p", default="",
              help="Text to continue (BOS is put before it if the vocabulary adds one; special "
                   "tokens such as <|im_start|> in it are recognised); with --chat, the user's "
                   "message.")
@click.option("--n-predict", "-n", default=200, show_default=True, type=click.IntRange(min=0),
              help="Tokens to generate at most (it stops earlier at an end-of-generation "
                   "token: EOS, <|im_end|>, <|eot_id|>, ...).")
@sampling_options
@lora_option
@ctx_option("Tokens the KV cache holds", MAX_DEFAULT_DECODE_CTX)
@click.option("--chat", is_flag=True,
              help="The prompt is a user message put through the model's chat template with "
                   "the generation prompt (after --system); only the answer is printed.")
@click.option("--system", help="With --chat: a system message first.")
@template_option()
@tools_option
@precision_option
@click.pass_context
def generate(ctx, model, prompt, n_predict, lora_paths, n_ctx, chat, system, chat_template,
             chat_template_kwargs, tools_path, **kw):
    """Continue a prompt with a GGUF model of any family ggwgpu builds (ours or llama.cpp's).

    The model runs with a KV cache on the chosen backend and the host samples as llama.cpp
    does: repeat penalty, top-k, top-p, min-p, temperature. When the model's context (n_ctx) is
    full, the window slides to BOS plus its last half and is recomputed. With --chat the
    prompt is answered as one chat turn (for scripts; `ggwgpu chat` goes on talking).
    """
    cfg, values, tokenizer, adapters = load_model(model, lora_paths, n_ctx)
    check_memory(ctx, f"generating with {model}", cfg, values, kw["precision"],
                 decoder=True)
    if (system or chat_template or chat_template_kwargs or tools_path) and not chat:
        raise click.UsageError("--system, --chat-template(-kwargs) and --tools go with --chat")
    if not (prompt or chat) and not (tokenizer.add_bos and tokenizer.bos_id is not None):
        raise click.UsageError(f"{model}'s vocabulary has no BOS token: give a --prompt")
    backend = select_backend(ctx)
    precision = resolve_precision(backend, kw["precision"])
    click.echo(f"generate on {describe_backend(backend)} in {precision}: {model}, n_ctx "
               f"{cfg.n_ctx}, seed {kw['seed']}", err=True)
    if chat:
        template = load_chat_template(tokenizer, chat_template, chat_template_kwargs)
        chat_answer(backend, cfg, values, tokenizer, template, system, prompt, n_predict,
                    sampling_of(kw), kw["seed"], adapters, precision,
                    load_tools(tools_path, template))
    else:
        stream_sample(backend, cfg, values, tokenizer, prompt, n_predict, sampling_of(kw),
                      kw["seed"], adapters, precision)
