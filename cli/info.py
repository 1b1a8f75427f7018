"""`ggwgpu info`: the WebGPU adapter (name, limits, features), where the shaders are and
which backend graphs run on. Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import textwrap

import click

import ggwgpu

from .common import auto_pick, backend_choice, describe_backend, human_bytes, wgpu_or_reason

# (adapter limit, label, is a size in bytes)
LIMITS = (
    ("max-storage-buffer-binding-size", "max storage buffer binding size", True),
    ("max-buffer-size", "max buffer size", True),
    ("max-compute-workgroups-per-dimension", "max compute workgroups per dimension", False),
    ("max-compute-invocations-per-workgroup", "max invocations per workgroup", False),
    ("max-compute-workgroup-storage-size", "max workgroup storage size", True),
    ("min-storage-buffer-offset-alignment", "min storage buffer offset alignment", True),
    ("max-storage-buffers-per-shader-stage", "max storage buffers per shader stage", False),
)


def describe_kernels(variants: dict) -> str:
    """The kernel variant of each shader family, and whether products are timed."""
    from ggwgpu.kernels import MATMUL_ENV, TUNE_ENV, TunedMatmul
    timed = (f"; each product's kernel and cut of K timed on the device as plans meet it "
             f"({TUNE_ENV}=0: off)" if isinstance(variants.get("matmul"), TunedMatmul) else
             f"; products not timed ({TUNE_ENV}=1: timed, {MATMUL_ENV} forces a kernel)")
    return ", ".join(f"{family} {variant}" for family, variant in variants.items()) + timed


@click.command()
@click.pass_context
def info(ctx):
    """Show the WebGPU adapter and the backend ggwgpu will use.

    Adapter name, type and vendor, its key limits and features, where the WGSL shaders
    were found, and which backend graphs run on.
    """
    from ggwgpu.wgsl import shader_dir
    click.echo(f"ggwgpu {ggwgpu.__version__}")
    backend, why = wgpu_or_reason()
    if backend is None:
        click.echo(f"adapter: none ({why})")
    else:
        adapter, ai = backend.adapter, backend.info
        click.echo("adapter:")
        for label, value in (("device", ai.get("device")),
                             ("adapter type", ai.get("adapter_type")),
                             ("backend type", ai.get("backend_type")),
                             ("vendor", f"{ai.get('vendor') or '?'} "
                                        f"(id {ai.get('vendor_id', 0):#06x})"),
                             ("description", ai.get("description"))):
            click.echo(f"  {label:<14}{value}")
        click.echo("limits:")
        for key, label, is_bytes in LIMITS:
            value = adapter.limits.get(key)
            shown = human_bytes(value) if is_bytes and value is not None else value
            click.echo(f"  {label:<38}{shown}")
        features = sorted(str(f) for f in adapter.features)
        click.echo(f"features ({len(features)}):")
        click.echo(textwrap.fill(", ".join(features), width=88, initial_indent="  ",
                                 subsequent_indent="  ", break_on_hyphens=False))
        click.echo("kernels on it: " + describe_kernels(backend.kernel_variants))
    try:
        click.echo(f"shaders: {shader_dir()}")
    except FileNotFoundError as e:
        click.echo(f"shaders: not found ({e})")

    name, by = backend_choice(ctx)
    if name == "auto":
        picked, reason = auto_pick()
        used = f"{picked}, picked by auto: {reason}"
    elif name == "numpy":
        used = f"numpy (asked for by {by})"
    elif backend is not None:
        used = f"{describe_backend(backend)}, asked for by {by}"
    else:
        used = f"none: wgpu asked for by {by}, but {why}"
    click.echo(f"backend: {used}")
