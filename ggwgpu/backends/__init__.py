"""Backend choice. `auto` (the default) runs graphs on wgpu when the adapter is a hardware
GPU (discrete, integrated) and on NumPy when the only adapter is a software rasterizer
(lavapipe/llvmpipe, SwiftShader, WARP: its shaders run on the CPU, several times slower than
NumPy's BLAS on the same cores) or when there is none, the latter with one warning.

Override with get_backend("numpy" | "wgpu") or the environment variable GGWGPU_BACKEND;
"wgpu" uses whatever adapter there is, software ones included.
"""
from __future__ import annotations

import functools
import os
import warnings

from .base import Backend, Plan  # noqa: F401
from .numpy_backend import NumpyBackend

ENV_VAR = "GGWGPU_BACKEND"
CHOICES = ("auto", "wgpu", "numpy")

# Software rasterizers by name, for drivers that report another adapter type than CPU.
SOFTWARE_NAMES = ("llvmpipe", "lavapipe", "softpipe", "swiftshader", "basic render driver")


def is_software_adapter(info: dict) -> bool:
    """Whether a WebGPU adapter (its `info`) runs its shaders on the CPU."""
    names = f"{info.get('device', '')} {info.get('vendor', '')} {info.get('description', '')}"
    return info.get("adapter_type") == "CPU" or any(s in names.lower() for s in SOFTWARE_NAMES)


def describe_adapter(info: dict) -> str:
    return f"{info.get('device')}, {info.get('adapter_type')}, {info.get('backend_type')}"


def adapter_for_rank(adapters, local_rank: int):
    """The adapter of the `local_rank`-th process on a machine (data-parallel training under
    mpirun): its local_rank-th hardware adapter, modulo their number; None where the machine
    has fewer than two (then every process takes the default one)."""
    hardware = [a for a in adapters if not is_software_adapter(dict(a.info))]
    return hardware[local_rank % len(hardware)] if len(hardware) > 1 else None


@functools.cache
def shared_adapter():
    """The process-wide WebGPU adapter (raises NoAdapterError without one). wgpu asked for
    high performance prefers discrete, integrated, other, virtual, then CPU adapters, so a
    software adapter here means there is no hardware one. Under an MPI launcher, processes
    on a machine with several GPUs take one each (adapter_for_rank)."""
    from ..distributed import launched_size, local_rank
    from .wgpu_backend import request_adapter
    if launched_size() > 1:
        import wgpu
        picked = adapter_for_rank(wgpu.gpu.enumerate_adapters_sync(), local_rank())
        if picked is not None:
            return picked
    return request_adapter()


@functools.cache
def shared_wgpu_backend():
    """The process-wide wgpu backend (one device; raises NoAdapterError without adapter)."""
    from .wgpu_backend import WgpuBackend
    return WgpuBackend(shared_adapter())


@functools.cache
def auto_choice() -> tuple[str, str]:
    """What `auto` picks, "wgpu" or "numpy", and why, in words. Decided once per process;
    without any adapter it warns, once."""
    from .wgpu_backend import NoAdapterError
    try:
        info = dict(shared_adapter().info)
    except NoAdapterError as e:
        warnings.warn(f"ggwgpu: {e}; using the NumPy backend", stacklevel=3)
        return "numpy", str(e)
    if is_software_adapter(info):
        return "numpy", (f"the only WebGPU adapter is a software one ({describe_adapter(info)}): "
                         f"NumPy is faster on the same CPU; --backend wgpu or {ENV_VAR}=wgpu "
                         "uses it anyway")
    return "wgpu", f"a hardware WebGPU adapter ({describe_adapter(info)})"


def get_backend(name: str | None = None) -> Backend:
    """The backend named by `name`, else by $GGWGPU_BACKEND, else chosen by auto_choice()."""
    name = (name or os.environ.get(ENV_VAR) or "auto").lower()
    if name not in CHOICES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(CHOICES)} "
                         f"(argument or ${ENV_VAR})")
    if name == "auto":
        name, _ = auto_choice()
    return NumpyBackend() if name == "numpy" else shared_wgpu_backend()


def precision_for(backend: Backend, choice: str = "auto") -> str:
    """The element type of a graph's activations on `backend` (models/transformer.py
    model_weights): "f32" or "f16" as asked, or for "auto" f16 where the device runs f16
    kernels (a wgpu adapter with shader-f16) and f32 elsewhere; the NumPy backend stores f16
    tensors as halves too, so f16 there is for comparing with a device, never chosen by auto.
    An f16 graph on a device without shader-f16 is refused here, naming the feature."""
    if choice not in ("auto", "f32", "f16"):
        raise ValueError(f"precision must be auto, f32 or f16, got {choice!r}")
    if choice == "auto":
        return "f16" if backend.has_f16 else "f32"
    if choice == "f16" and not (backend.has_f16 or backend.emulates_f16):
        from ..tensor import ShapeError
        raise ShapeError(f"precision f16 needs the WebGPU feature shader-f16, which the "
                         f"adapter {backend.info['device']} lacks: use f32")
    return choice
