"""The WebGPU backend: WGSL compute shaders dispatched through wgpu-py.

A plan creates every buffer, uniform slot and bind group once. A run writes the inputs,
records all dispatches of the graph into one compute pass of one command encoder and submits
once; nothing is read back unless asked for.
"""
from __future__ import annotations

import math
import os
import time
import sys
import tempfile
from pathlib import Path

import numpy as np
import wgpu

from ..ops import OPS
from ..tensor import ShapeError, Tensor
from .base import Backend, Plan, guarded_block

UNIFORM_SLOT = 256          # bytes per dispatch in the uniform arena (WebGPU's max alignment)
UNIFORM_SIZE = 240          # sizeof(Params) in shaders/common.wgsl
MAX_SRCS = 4
MAX_GROUPS = 65535          # per grid dimension; bigger 1-D grids fold into 2-D


class NoAdapterError(RuntimeError):
    """No WebGPU adapter could be had on this machine."""


def shader_dir() -> Path:
    """Where the WGSL files are: inside the installed package, or the source checkout's
    top-level shaders/ folder."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here / "shaders", here.parent / "shaders"):
        if (candidate / "common.wgsl").is_file():
            return candidate
    raise FileNotFoundError(f"WGSL shaders not found next to {here}")


def shader_source(stem: str) -> str:
    """The common header followed by the op family's file."""
    d = shader_dir()
    return (d / "common.wgsl").read_text() + "\n" + (d / f"{stem}.wgsl").read_text()


def kernel_name(entry: str) -> str:
    # The k_ prefix keeps kernels such as exp or abs from shadowing WGSL's builtins.
    return f"k_{entry}"


def request_adapter():
    if sys.platform.startswith("linux") and not os.environ.get("XDG_RUNTIME_DIR"):
        # Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" on every start without
        # one (headless machines, CI); a private empty directory keeps that noise away.
        runtime = Path(tempfile.gettempdir()) / f"ggwgpu-runtime-{os.getuid()}"
        runtime.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as e:  # wgpu raises when no driver exposes an adapter
        raise NoAdapterError(f"no WebGPU adapter: {e}") from e
    if adapter is None:
        raise NoAdapterError("no WebGPU adapter")
    return adapter


def grid_2d(groups: int) -> tuple[int, int]:
    x = min(groups, MAX_GROUPS)
    return x, math.ceil(groups / x)


class WgpuBackend(Backend):
    name = "wgpu"

    def __init__(self, adapter=None):
        self.adapter = adapter or request_adapter()
        limits = self.adapter.limits
        wanted = ("max-storage-buffer-binding-size", "max-buffer-size")
        self.device = self.adapter.request_device_sync(
            required_limits={k: limits[k] for k in wanted})
        self.max_binding = self.device.limits["max-storage-buffer-binding-size"]
        storage = {"type": wgpu.BufferBindingType.storage}
        entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": wgpu.BufferBindingType.uniform}}]
        entries += [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": storage}
                    for i in range(1, 2 + MAX_SRCS)]
        self.bind_group_layout = self.device.create_bind_group_layout(entries=entries)
        self.pipeline_layout = self.device.create_pipeline_layout(
            bind_group_layouts=[self.bind_group_layout])
        self.dummy = self.device.create_buffer(
            size=16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        self.fence = self.device.create_buffer(
            size=16, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self._modules, self._pipelines = {}, {}

    @property
    def info(self) -> dict:
        return dict(self.adapter.info)

    def pipeline(self, stem: str, entry: str):
        """The compute pipeline of kernel `entry`, WGSL function k_<entry> in <stem>.wgsl."""
        key = (stem, entry)
        if key not in self._pipelines:
            if stem not in self._modules:
                self._modules[stem] = self.device.create_shader_module(
                    label=stem, code=shader_source(stem))
            self._pipelines[key] = self.device.create_compute_pipeline(
                label=f"{stem}:{entry}", layout=self.pipeline_layout,
                compute={"module": self._modules[stem], "entry_point": kernel_name(entry)})
        return self._pipelines[key]

    def plan(self, outputs, sentinel=0):
        return WgpuPlan(self, outputs, sentinel)


class WgpuPlan(Plan):
    def __init__(self, backend: WgpuBackend, outputs, sentinel=0):
        super().__init__(outputs, sentinel)
        self.backend = backend
        device = backend.device
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.dispatches, private = [], {}
        for step, node in enumerate(self.nodes):
            for d in OPS[node.op].dispatches(node):
                self.dispatches.append((d.shader or OPS[node.op].shader, d))
                private.update({id(t.storage): (t.storage, step) for t in (d.dst, *d.srcs)
                                if id(t.storage) not in self._known})
        private = list(private.values())
        for root in self.roots + [t for t, _ in private]:
            if self.nbytes(root) > backend.max_binding:
                raise ShapeError(f"{root}: {self.nbytes(root)} bytes exceed the adapter's storage"
                                 f" binding limit of {backend.max_binding}")
        self.layout = self.storage_layout(private)
        slot_buffers = [device.create_buffer(size=max(16, n), usage=usage)
                        for n in self.layout.slot_bytes]
        self.buffers = {key: slot_buffers[slot] for key, slot in self.layout.slot_of.items()}
        users = {}
        for key, slot in self.layout.slot_of.items():
            users.setdefault(slot, []).append(key)
        self._shared = {k for keys in users.values() if len(keys) > 1 for k in keys}
        for root in self.roots:
            if self.sentinel:
                device.queue.write_buffer(self.buffers[id(root)], 0,
                                          guarded_block(root.nelements, self.sentinel, root.np_dtype))
            if root.value is not None:
                self.write(root, root.value)
        arena = np.zeros((max(1, len(self.dispatches)), UNIFORM_SLOT // 4), np.uint32)
        for i, (_, d) in enumerate(self.dispatches):
            arena[i, :UNIFORM_SIZE // 4] = self._uniforms(d)
        self.arena = device.create_buffer_with_data(data=arena, usage=wgpu.BufferUsage.UNIFORM)
        self.recorded = []
        for i, (stem, d) in enumerate(self.dispatches):
            entries = [{"binding": 0, "resource": {"buffer": self.arena,
                                                   "offset": i * UNIFORM_SLOT,
                                                   "size": UNIFORM_SIZE}}]
            tensors = (d.dst,) + tuple(d.srcs)
            for b in range(1 + MAX_SRCS):
                buf = self.buffers[id(tensors[b].storage)] if b < len(tensors) else backend.dummy
                entries.append({"binding": 1 + b, "resource": {"buffer": buf, "offset": 0,
                                                               "size": buf.size}})
            group = device.create_bind_group(layout=backend.bind_group_layout, entries=entries)
            self.recorded.append((backend.pipeline(stem, d.entry), group, grid_2d(d.grid())))
        self._staging = None

    def _uniforms(self, d) -> np.ndarray:
        u = np.zeros(UNIFORM_SIZE // 4, np.uint32)
        tensors = (d.dst,) + tuple(d.srcs)
        if len(tensors) > 1 + MAX_SRCS:
            raise ValueError(f"{d.entry}: at most {MAX_SRCS} sources per dispatch")
        u[0] = d.n
        for k, t in enumerate(tensors):
            u[4 + k] = self.sentinel + t.offset       # off, then off3.x
            u[12 + 8 * k: 16 + 8 * k] = t.ne
            u[16 + 8 * k: 20 + 8 * k] = t.nb
        u[52:52 + len(d.f)] = np.asarray(d.f, np.float32).view(np.uint32)
        u[56:56 + len(d.u)] = d.u
        return u

    def run(self, feeds=None):
        for t, value in (feeds or {}).items():
            self.write(t, value)
        device = self.backend.device
        encoder = device.create_command_encoder()
        cpass = encoder.begin_compute_pass()
        for pipeline, group, (x, y) in self.recorded:
            cpass.set_pipeline(pipeline)
            cpass.set_bind_group(0, group)
            cpass.dispatch_workgroups(x, y, 1)
        cpass.end()
        device.queue.submit([encoder.finish()])

    def profile(self, feeds=None) -> list[tuple[str, float]]:
        """Run the graph once dispatch by dispatch, waiting after each: (kernel, seconds)
        per dispatch. Slower than run(); for finding the kernels that dominate a step."""
        for t, value in (feeds or {}).items():
            self.write(t, value)
        device, times = self.backend.device, []
        self.sync()
        for (stem, d), (pipeline, group, (x, y)) in zip(self.dispatches, self.recorded):
            start = time.perf_counter()
            encoder = device.create_command_encoder()
            cpass = encoder.begin_compute_pass()
            cpass.set_pipeline(pipeline)
            cpass.set_bind_group(0, group)
            cpass.dispatch_workgroups(x, y, 1)
            cpass.end()
            device.queue.submit([encoder.finish()])
            self.sync()
            times.append((f"{stem}:{d.entry}", time.perf_counter() - start))
        return times

    def write(self, t, value):
        value = self._check_value(t, value)
        root = t.storage
        if t is root or (t.is_contiguous() and t.shape == root.shape):
            data = np.ascontiguousarray(value, dtype=root.np_dtype)
            start = self.sentinel + t.offset
            self.backend.device.queue.write_buffer(
                self.buffers[id(root)], start * root.np_dtype.itemsize, data)
        else:  # a strided view: merge into the current contents of its storage
            block = self.read_raw(root)
            view = np.lib.stride_tricks.as_strided(
                block[self.sentinel + t.offset:], t.shape,
                [s * block.itemsize for s in t.strides])
            view[...] = value
            self.backend.device.queue.write_buffer(self.buffers[id(root)], 0, block)

    def read_raw(self, root) -> np.ndarray:
        buf = self.buffers[id(root.storage)]
        if self._staging is None or self._staging.size < buf.size:
            self._staging = self.backend.device.create_buffer(
                size=buf.size, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        encoder = self.backend.device.create_command_encoder()
        encoder.copy_buffer_to_buffer(buf, 0, self._staging, 0, buf.size)
        self.backend.device.queue.submit([encoder.finish()])
        self._staging.map_sync(wgpu.MapMode.READ)
        try:
            raw = np.frombuffer(self._staging.read_mapped(0, buf.size), root.storage.np_dtype)
            n = root.storage.nelements + 2 * self.sentinel
            return raw[:n].copy()
        finally:
            self._staging.unmap()

    def read(self, t: Tensor) -> np.ndarray:
        self._check_readable(t)
        block = self.read_raw(t.storage)
        return np.lib.stride_tricks.as_strided(
            block[self.sentinel + t.offset:], t.shape,
            [s * block.itemsize for s in t.strides]).copy()

    def sync(self):
        """Wait until all submitted work is done (for timing): a 16-byte copy queued behind
        it, then mapped (on_submitted_work_done_sync is broken in wgpu 0.32)."""
        backend = self.backend
        encoder = backend.device.create_command_encoder()
        encoder.copy_buffer_to_buffer(backend.dummy, 0, backend.fence, 0, 16)
        backend.device.queue.submit([encoder.finish()])
        backend.fence.map_sync(wgpu.MapMode.READ)
        backend.fence.unmap()
