"""`ggwgpu quantize IN.gguf OUT.gguf --type q4_0`: a llama GGUF with its matrices in a
block type, e.g. the frozen base of a finetune. Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import sys

import click

from ggwgpu.gguf_file import GGUFError
from ggwgpu.gguf_llama import load_model, save_model
from ggwgpu.quant import QUANTIZABLE, Quantized, quantize_model

from .outputs import check_outputs


@click.command("quantize")
@click.argument("source", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("--type", "dtype", type=click.Choice(QUANTIZABLE), default="q4_0", show_default=True,
              help="Storage type of the 2-D weights whose rows are a multiple of 32 values; "
                   "norms stay f32.")
def quantize_command(source, target, dtype):
    """Write SOURCE (a llama GGUF: f32 or any block type ggwgpu reads) to TARGET with its
    weights in --type (the types gguf-py quantizes; k-quant files come from llama.cpp's
    llama-quantize). Weights already quantized are dequantized first."""
    check_outputs([("SOURCE", source)], [("TARGET", target)])
    click.echo(f"loading {source}", err=True)
    try:
        cfg, values, tokenizer = load_model(source)
        quantized = {}
        with click.progressbar(values.items(), label=f"quantizing to {dtype}",
                               file=sys.stderr) as tensors:
            for name, value in tensors:     # a tensor at a time, for the progress bar
                quantized.update(quantize_model({name: value}, dtype))
        click.echo(f"writing {target}", err=True)
        save_model(target, cfg, quantized, tokenizer)
    except GGUFError as e:
        raise click.ClickException(str(e)) from None
    before = sum(v.nbytes for v in values.values())
    after = sum(v.nbytes for v in quantized.values())
    n = sum(isinstance(v, Quantized) for v in quantized.values())
    click.echo(f"{target}: {n} of {len(quantized)} tensors in {dtype}; weights "
               f"{before / 2**20:.2f} MiB f32 -> {after / 2**20:.2f} MiB")
