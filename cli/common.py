"""What the `ggwgpu` commands share: which backend was asked for, how to describe it, sizes.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import math
import errno
import os
import warnings

import click

from ggwgpu.backends import (ENV_VAR, auto_choice, describe_adapter, get_backend,
                             shared_wgpu_backend)
from ggwgpu.files import read_limited
from ggwgpu.tokenizer import Tokenizer


FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


class FiniteFloat(click.FloatRange):
    """click's FloatRange, refusing NaN and infinities (NaN passes every comparison, so
    `--lr nan` would train with a rate that changes no weight) and numbers float32 cannot
    hold: ggwgpu computes and stores in float32, so 1e308 would be infinity and 1e-50 zero
    (in a step, or in the GGUF file, which then does not load)."""
    name = "finite float range"

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        if abs(value) > FLOAT32_MAX or 0 < abs(value) < FLOAT32_TINY:
            self.fail(f"{value} is outside float32's range (magnitudes {FLOAT32_TINY:.3g} .. "
                      f"{FLOAT32_MAX:.3g}, or 0)", param, ctx)
        return value


class InputPath(click.Path):
    """click.Path, saying why a path that cannot be looked at is refused: a name over the
    system's limits (PATH_MAX, NAME_MAX) is "too long", not "does not exist"."""

    def convert(self, value, param, ctx):
        try:
            os.stat(value)
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                self.fail(f"{os.fsdecode(value)[:60]}... ({len(os.fsencode(value))} bytes): "
                          f"the name is too long for the file system", param, ctx)
        except ValueError:      # a NUL byte: click says it
            pass
        return super().convert(value, param, ctx)

def wgpu_or_reason():
    """(the shared wgpu backend, None), or (None, why there is none)."""
    from ggwgpu.backends.wgpu_backend import NoAdapterError
    try:
        return shared_wgpu_backend(), None
    except NoAdapterError as e:
        return None, str(e)
    except Exception as e:  # an adapter but no device: report it, info must not crash
        return None, f"the WebGPU device failed to start: {type(e).__name__}: {e}"


def backend_choice(ctx) -> tuple[str, str]:
    """The backend name asked for (--backend, else $GGWGPU_BACKEND, else auto) and by whom."""
    if ctx.obj["backend"]:
        return ctx.obj["backend"].lower(), "--backend"
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR].lower(), f"${ENV_VAR}"
    return "auto", "default"


def select_backend(ctx):
    """The backend get_backend() picks for the --backend choice, as a click error if none."""
    from ggwgpu.backends.wgpu_backend import NoAdapterError
    name, by = backend_choice(ctx)
    if name == "auto":
        picked, why = auto_pick()
        # stderr: a command's stdout may be its product (generate prints the text there)
        click.echo(f"backend: {picked}, picked by auto: {why}", err=True)
    try:
        return get_backend(name)
    except NoAdapterError as e:
        raise click.ClickException(f"backend wgpu asked for by {by}, but {e}") from None
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def auto_pick() -> tuple[str, str]:
    """What auto picks and why (ggwgpu.backends.auto_choice), without its warning: the
    commands say it in a line of their own instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto_choice()


def check_memory(ctx, what: str, cfg, values=None, precision: str = "f32", **estimate):
    """Refuse, before it allocates, a run whose memory estimate (ggwgpu.memory: from the
    config; `values`: loaded weights, counted as stored, and on NumPy block types again as
    the f32 values its products read; --precision f16: activations and
    cache in halves, auto counted as f32) exceeds the host's memory, with the numbers: every
    command that builds a graph asks here first."""
    from ggwgpu import memory
    from ggwgpu.quant import Quantized
    estimate["value_bytes"] = memory.F16 if precision == "f16" else memory.F32
    name, _ = backend_choice(ctx)
    device_is_host = name == "numpy" or (name == "auto" and auto_pick()[0] == "numpy")
    if values is not None:
        estimate["weight_bytes"] = sum(v.data.nbytes if isinstance(v, Quantized) else v.nbytes
                                       for v in values.values())
        if device_is_host:  # NumPy's products read block-type weights dequantized, kept
            estimate["dequantized"] = sum(math.prod(v.shape) for v in values.values()
                                          if isinstance(v, Quantized))
    try:
        memory.check(memory.estimate(cfg, **estimate), what, device_is_host)
    except memory.MemoryLimitError as e:
        raise click.UsageError(str(e)) from None


def describe_backend(backend) -> str:
    if backend.name == "wgpu":
        return f"wgpu ({describe_adapter(backend.info)})"
    return f"{backend.name} (the NumPy reference backend)"


def describe_precision(trainer) -> str:
    """The element type a Trainer's graph computes in, and its loss scaling."""
    if trainer.precision == "f32":
        return "f32"
    scaling = (f"dynamic loss scale from 2^{math.log2(trainer.scaler.scale):g}"
               if trainer.scaler else "no loss scaling")
    return f"f16 activations, f32 master weights, {scaling}"


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} ({n / size:.4g} {unit})"
    return str(n)


def planned_memory(plan) -> str:
    """The device memory a plan allocates, for a command's summary line."""
    return f"device memory planned {plan.memory()['planned'] / 2**20:.1f} MiB"


MAX_DEFAULT_CTX = 512   # a published model's context (8k, 128k) is far beyond a step's budget
# generate and chat: a KV cache costs its memory, and a run only the cache rows it reads
# (generate.Decoder), so their window is llama.cpp's default
MAX_DEFAULT_DECODE_CTX = 4096


def positive_ints(example: str):
    """A click callback reading a comma-separated list of positive integers (`example`
    shows one in the error)."""
    def parse(ctx, param, value):
        try:
            values = [int(part) for part in value.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of positive "
                                     f"integers such as {example}")
        return values
    return parse


def ctx_option(what: str, cap: int = MAX_DEFAULT_CTX):
    """--n-ctx of the commands that run a loaded model: its window, in tokens."""
    return click.option("--n-ctx", "n_ctx", type=click.IntRange(min=2),
                        help=f"{what} (default: the model's context length, at most {cap}).")


def with_context(cfg, n_ctx, cap: int = MAX_DEFAULT_CTX):
    """cfg with n_ctx tokens per window: the given one, else the model's, capped at `cap`
    (the model file keeps its own context length)."""
    import dataclasses
    return dataclasses.replace(cfg, n_ctx=n_ctx or min(cfg.n_ctx, cap))


# -- what generate and chat share -------------------------------------------------------------

def sampling_options(command):
    """llama.cpp's sampling options (its defaults) and --seed; `sampling_of(kwargs)` makes
    them a Sampling."""
    from ggwgpu.generate import Sampling
    options = [
        click.option("--temp", default=Sampling.temperature, show_default=True,
                     type=FiniteFloat(min=0),
                     help="Temperature; 0 is greedy (the most likely token, whatever the "
                          "seed)."),
        click.option("--top-k", default=Sampling.top_k, show_default=True, type=int,
                     help="Keep the k most likely tokens (<= 0: all)."),
        click.option("--top-p", default=Sampling.top_p, show_default=True,
                     type=FiniteFloat(0, 1, min_open=True),
                     help="Then keep the most likely tokens up to this probability mass "
                          "(1: all)."),
        click.option("--min-p", default=Sampling.min_p, show_default=True,
                     type=FiniteFloat(0, 1),
                     help="Then keep the tokens at least this fraction as likely as the most "
                          "likely one (0: all)."),
        click.option("--repeat-penalty", default=Sampling.repeat_penalty, show_default=True,
                     type=FiniteFloat(min=0, min_open=True),
                     help="Make the tokens of the last --repeat-last-n less likely (1: off)."),
        click.option("--repeat-last-n", default=Sampling.repeat_last_n, show_default=True,
                     type=click.IntRange(min=0), help="Context tokens the repeat penalty "
                                                      "looks at."),
        click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
                     help="Sampling seed."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def sampling_of(kw: dict):
    from ggwgpu.generate import Sampling
    return Sampling(kw["temp"], kw["top_k"], kw["top_p"], kw["repeat_penalty"],
                    kw["repeat_last_n"], kw["min_p"])


lora_option = click.option(
    "--lora", "lora_paths", multiple=True, type=InputPath(exists=True, dir_okay=False),
    help="Apply this LoRA adapter GGUF (scale alpha / r, as llama.cpp); repeatable.")


def load_model(path, lora_paths=(), n_ctx=None):
    """(cfg with the --n-ctx window, values, tokenizer, adapters) of a model file, for
    generating: a window of at least 2 tokens (the prompt's and the next)."""
    from ggwgpu import gguf_llama
    from ggwgpu.gguf_file import GGUFError
    from ggwgpu.lora import load_adapter
    click.echo(f"loading {path}", err=True)
    try:
        cfg, values, tokenizer = gguf_llama.load_model(path, keep_quantized=True)
        adapters = [load_adapter(p, cfg) for p in lora_paths]
    except GGUFError as e:
        raise click.ClickException(str(e)) from None
    if n_ctx is None and cfg.n_ctx < 2:      # --n-ctx itself is at least 2
        raise click.UsageError(f"{path}: its context length "
                               f"({gguf_llama.arch_keys(cfg.arch).ctx}) is {cfg.n_ctx}, "
                               f"but generating needs at least 2 tokens: give --n-ctx 2 or "
                               f"more")
    return with_context(cfg, n_ctx, MAX_DEFAULT_DECODE_CTX), values, tokenizer, adapters


def template_option(cls=click.Option):
    """--chat-template and --chat-template-kwargs; `cls` marks them for the training
    commands (training.Repeated)."""
    def decorate(command):
        command = click.option(
            "--chat-template-kwargs", cls=cls, metavar="JSON",
            help="Variables for the chat template, a JSON object, as transformers' "
                 "chat_template_kwargs and llama.cpp's option of this name: "
                 "'{\"enable_thinking\": false}' turns Qwen3's reasoning off.")(command)
        return click.option(
            "--chat-template", cls=cls, type=InputPath(exists=True, dir_okay=False),
            help="A Jinja chat template file (default: the model's own, else "
                 "ChatML).")(command)
    return decorate


precision_option = click.option(
    "--precision", type=click.Choice(("auto", "f32", "f16")), default="f32", show_default=True,
    help="Element type of activations, float weights and the KV cache on the device: f16, "
         "f32, or auto (f16 where the adapter has shader-f16, f32 elsewhere and on numpy).")


def resolve_precision(backend, choice: str) -> str:
    """--precision on `backend` (ggwgpu.backends.precision_for), refused as a usage error
    where the device cannot run it."""
    from ggwgpu.backends import precision_for
    from ggwgpu.tensor import ShapeError
    try:
        return precision_for(backend, choice)
    except ShapeError as e:
        raise click.UsageError(f"--precision {choice}: {e}") from None


tools_option = click.option(
    "--tools", "tools_path", type=InputPath(exists=True, dir_okay=False),
    help="Function schemas the model may call: a JSON list, as a tool-calling example's "
         "\"tools\" (docs/chat-data.md), which the chat template renders.")


def load_tools(path, template):
    """The function schemas of --tools's JSON file (None without one), refused where
    `template` (a ChatTemplate) leaves them out of a conversation's rendering."""
    import json

    from ggwgpu.chat import check_tools, check_tools_rendered
    if not path:
        return None
    try:
        tools = json.loads(read_limited(path, ValueError).decode("utf-8"))
        check_tools(tools)
        probe = [{"role": "user", "content": "?"}]
        check_tools_rendered({"tools": tools}, template.render(probe, True, tools), template,
                             probe)
    except (ValueError, OSError, RecursionError) as e:   # DataError, JSON: ValueErrors
        raise click.UsageError(f"--tools {path}: {e}") from None
    return tools


def chat_template(tokenizer: Tokenizer, path=None, variables_json=None):
    """The ChatTemplate of --chat-template's file, else the model's, else ChatML, with
    --chat-template-kwargs's variables."""
    import json

    from ggwgpu.chat import ChatTemplate
    try:
        variables = json.loads(variables_json) if variables_json else None
    except (ValueError, RecursionError) as e:
        raise click.UsageError(f"--chat-template-kwargs: not JSON ({e})") from None
    if variables is not None and not isinstance(variables, dict):
        raise click.UsageError("--chat-template-kwargs: a JSON object of variables, as "
                               "'{\"enable_thinking\": false}'")
    try:
        source = None
        if path:            # UnicodeDecodeError is a ValueError too
            source = read_limited(path, ValueError).decode("utf-8")
        return ChatTemplate.of(tokenizer, source, path and f"--chat-template {path}", variables)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None
