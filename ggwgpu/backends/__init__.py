"""Backend choice: wgpu when an adapter exists, else NumPy with one clear warning.

Override with get_backend("numpy" | "wgpu") or the environment variable GGWGPU_BACKEND.
"""
from __future__ import annotations

import functools
import os
import warnings

from .base import Backend, Plan  # noqa: F401
from .numpy_backend import NumpyBackend

ENV_VAR = "GGWGPU_BACKEND"
CHOICES = ("auto", "wgpu", "numpy")


@functools.cache
def shared_wgpu_backend():
    """The process-wide wgpu backend (one device; raises NoAdapterError without adapter)."""
    from .wgpu_backend import WgpuBackend
    return WgpuBackend()


@functools.cache
def _warn_no_adapter(reason: str):
    warnings.warn(f"ggwgpu: no WebGPU adapter ({reason}); using the NumPy backend", stacklevel=3)


def get_backend(name: str | None = None) -> Backend:
    """The backend named by `name`, else by $GGWGPU_BACKEND, else chosen automatically."""
    name = (name or os.environ.get(ENV_VAR) or "auto").lower()
    if name not in CHOICES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(CHOICES)} "
                         f"(argument or ${ENV_VAR})")
    if name == "numpy":
        return NumpyBackend()
    if name == "wgpu":
        return shared_wgpu_backend()
    from .wgpu_backend import NoAdapterError
    try:
        return shared_wgpu_backend()
    except NoAdapterError as e:
        _warn_no_adapter(str(e))
        return NumpyBackend()
