"""The one place ggwgpu reaches past wgpu-py's public API: the encode loop's three commands
(set pipeline, set bind group, dispatch) called as wgpu-native's C functions on the objects'
native handles, and the queue's timestamp period, which wgpu-py does not expose.

wgpu-py wraps each call in Python error capture and builds a cffi array of dynamic offsets per
set_bind_group: about 2.5 µs of a step's ~4 µs of host time per dispatch on lavapipe. Calling
the functions directly skips that; errors still surface, because wgpu-native validates a
compute pass when it ends and reports through the (wrapped) end/finish.

Those names (wgpu.backends.wgpu_native._api, the objects' `_internal` handles) are private:
a wgpu-py release may rename them. So they are checked at import, and where they are missing
the encode loop takes the public calls instead and says so once (a RuntimeWarning).
"""
from __future__ import annotations

import warnings

_warned = False


def capability():
    """(set_pipeline, set_bind_group, dispatch, NULL) of wgpu-native, and None; or None and
    why they cannot be had from this wgpu-py."""
    try:
        from wgpu.backends.wgpu_native._api import ffi, lib
        return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL), None
    except (ImportError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"


def fall_back(why: str) -> None:
    """Say once per process that the encode loop takes wgpu-py's public calls."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"ggwgpu: wgpu-native's compute pass functions are not reachable in this "
                      f"wgpu-py ({why}); recording through the public API instead (correct, "
                      f"a few µs slower per dispatch)", RuntimeWarning, stacklevel=2)


CALLS, WHY_NOT = capability()
if CALLS is None:
    fall_back(WHY_NOT)


def native_handles(commands):
    """[(pipeline handle or None, bind group handle, x, y)] for `commands` ((pipeline or
    None, bind group, x, y): the pipeline only where it changes), or None where the direct
    calls cannot be used."""
    if CALLS is None:
        return None
    try:
        return [(p and p._internal, g._internal, x, y) for p, g, x, y in commands]
    except AttributeError as e:
        fall_back(f"no native handle: {e}")
        return None


def record(cpass, commands, handles=None) -> None:
    """Record `commands` into the compute pass `cpass`: through the C functions on `handles`
    (native_handles(commands)) where given, else through wgpu-py's public calls."""
    native = getattr(cpass, "_internal", None) if handles is not None else None
    if handles is not None and native is None:
        fall_back("the compute pass has no native handle")
    if native is not None and CALLS is not None:
        set_pipeline, set_group, dispatch, null = CALLS
        for pipeline, group, x, y in handles:
            if pipeline is not None:
                set_pipeline(native, pipeline)
            set_group(native, 0, group, 0, null)
            dispatch(native, x, y, 1)
        return
    for pipeline, group, x, y in commands:
        if pipeline is not None:
            cpass.set_pipeline(pipeline)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(x, y, 1)


def timestamp_period(queue) -> float | None:
    """Nanoseconds per tick of `queue`'s timestamp queries (wgpu-native resolves raw ticks:
    1 on NVIDIA and lavapipe, 10 or more on some AMD cards), or None where it cannot be read
    from this wgpu-py."""
    try:
        from wgpu.backends.wgpu_native._api import lib
        return float(lib.wgpuQueueGetTimestampPeriod(queue._internal))
    except (ImportError, AttributeError):
        return None
