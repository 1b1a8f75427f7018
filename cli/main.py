"""The `ggwgpu` command: the group, its --backend, the error mapping that ends every command
with a message (never a traceback), and the commands, one module each (info.py, ops.py,
demo.py, plot.py, train.py, finetune.py, generate.py, chat.py, eval.py, quantize.py,
bench.py).

Only absolute imports of `ggwgpu` here: this package is installed as `ggwgpu_cli` (the
`ggwgpu` command and `python -m ggwgpu` run its `cli`).
"""
from __future__ import annotations

import os

import click

import ggwgpu
from ggwgpu.backends import CHOICES, ENV_VAR

from .bench import bench
from .bench_ranks import bench_ranks
from .chat import chat_command
from .demo import demo
from .eval import evaluate
from .finetune import finetune_command, merge_command
from .generate import generate
from .info import info
from .ops import ops
from .plot import plot
from .quantize import quantize_command
from .train import train

TRACEBACK_VAR = "GGWGPU_TRACEBACK"


class Commands(click.Group):
    """The ggwgpu group. Errors a command did not turn into a message of its own end it
    with one line and exit code 1, never a traceback: ggwgpu's errors for bad input
    (GGUFError, VocabError, DataError: they name the file and the problem; DeviceLimitError:
    a tensor over what the device binds, named with the numbers), the operating
    system's (OSError: a full or read-only disk, a vanished file) and MemoryError. Anything
    else is a bug in ggwgpu: one line saying so, or the traceback with $GGWGPU_TRACEBACK=1
    (the tests set it, so that such bugs fail them)."""

    def invoke(self, ctx):
        from ggwgpu.backends.base import DeviceLimitError
        from ggwgpu.data import DataError
        from ggwgpu.generate import NonFiniteLogits
        from ggwgpu.gguf_file import GGUFError
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (GGUFError, DataError, NonFiniteLogits, DeviceLimitError) as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from None
        except MemoryError:
            raise click.ClickException("out of memory: the host could not allocate what this "
                                       "command needs (a smaller model, batch or context "
                                       "needs less)") from None
        except Exception as e:
            if os.environ.get(TRACEBACK_VAR) == "1":
                raise
            raise click.ClickException(
                f"internal error, a bug in ggwgpu: {type(e).__name__}: {e} (set "
                f"{TRACEBACK_VAR}=1 for the traceback)") from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ggwgpu.__version__, prog_name="ggwgpu")
@click.option("--backend", type=click.Choice(CHOICES, case_sensitive=False), default=None,
              help=f"Where graphs run. Default: ${ENV_VAR}, else auto: wgpu on a hardware GPU, "
                   "numpy when the only adapter is a software one (lavapipe) or none; "
                   "`ggwgpu info` says which.")
@click.pass_context
def cli(ctx, backend):
    """ggwgpu: ggml's training machinery as WGSL compute shaders on any WebGPU GPU."""
    from ggwgpu.backends.numpy_backend import default_threads
    try:
        default_threads()   # a bad $GGWGPU_NUMPY_THREADS stops every command before any work
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    ctx.obj = {"backend": backend}


bench.add_command(bench_ranks)
for command in (info, ops, demo, plot, train, generate, evaluate, bench, quantize_command,
                finetune_command, merge_command, chat_command):
    cli.add_command(command)

if __name__ == "__main__":
    cli()
