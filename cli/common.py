"""What the `ggwgpu` commands share: which backend was asked for, how to describe it, sizes.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import os
import warnings

import click

from ggwgpu.backends import (ENV_VAR, auto_choice, describe_adapter, get_backend,
                             shared_wgpu_backend)


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


def describe_backend(backend) -> str:
    if backend.name == "wgpu":
        return f"wgpu ({describe_adapter(backend.info)})"
    return f"{backend.name} (the NumPy reference backend)"


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} ({n / size:.4g} {unit})"
    return str(n)


def planned_memory(plan) -> str:
    """The device memory a plan allocates, for a command's summary line."""
    return f"device memory planned {plan.memory()['planned'] / 2**20:.1f} MiB"


MAX_DEFAULT_CTX = 512   # a published model's context (8k, 128k) is far beyond a step's budget


def ctx_option(what: str):
    """--n-ctx of the commands that run a loaded model: its window, in tokens."""
    return click.option("--n-ctx", "n_ctx", type=click.IntRange(min=2),
                        help=f"{what} (default: the model's context length, at most "
                             f"{MAX_DEFAULT_CTX}).")


def with_context(cfg, n_ctx):
    """cfg with n_ctx tokens per window: the given one, else the model's, capped at
    MAX_DEFAULT_CTX (the model file keeps its own context length)."""
    import dataclasses
    return dataclasses.replace(cfg, n_ctx=n_ctx or min(cfg.n_ctx, MAX_DEFAULT_CTX))
