"""The WebGPU backend: WGSL compute shaders dispatched through wgpu-py.

A plan creates every buffer, uniform slot and bind group once. A run writes the inputs,
records all dispatches of the graph into one compute pass of one command encoder and submits
once; nothing is read back unless asked for, and what is (read_many) comes back through one
copy and one map of a persistent staging buffer.

Element types: each dispatch's module is its family's WGSL behind a prelude that names the
element type of every binding (wgsl.module_source: TD, T0 .. T3 = f32 or f16, `enable f16;`
when one is f16), so pipelines are cached per (family, entry, binding dtypes); f32
dispatches compile exactly the kernels they always did. f16 needs the adapter's `shader-f16`
feature.
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

from ..kernels import TunedMatmul, choose_variants
from ..ops import OPS
from ..tensor import ShapeError, Tensor
from ..wgsl import (F32_BINDINGS, MAX_SRCS, PART_WORDS, TENSOR_TAGS, binding_dtypes,
                    kernel_name, module_source, reads_src0_in_parts, uniform_layout)
from . import wgpu_direct
from .base import Backend, DeviceLimitError, Plan, SharedConstants, guarded_block
from .tuning import choices_file, load_choices, tune_products

UNIFORM_SLOT = 256          # bytes per dispatch in the uniform arena (WebGPU's max alignment)
# A storage block larger than one binding is bound as up to SRC0_PARTS ranges, as source 0
# of a kernel that reads it through quant_blocks.wgsl's src0_word: its own binding and
# bindings 6 .. 8, so dst, 4 sources and the parts stay within WebGPU's 8 storage buffers.
SRC0_PARTS = 4
PART_BINDINGS = tuple(range(2 + MAX_SRCS, 1 + MAX_SRCS + SRC0_PARTS))
MAX_GROUPS = 65535          # per grid dimension; bigger 1-D grids fold into 2-D
STORAGE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
PARAMS, UNIFORM_SIZE = uniform_layout()     # {Params field: first word}, bytes


class NoAdapterError(RuntimeError):
    """No WebGPU adapter could be had on this machine."""


BINDING_LIMIT = "max-storage-buffer-binding-size"


def check_storage_limits(tensors, nbytes, limits: dict, in_parts=frozenset(), part_bytes=0):
    """Refuse the first of `tensors` whose storage (nbytes(t) bytes) exceeds one of `limits`
    ({adapter limit name: bytes}): every block lies whole in one buffer and is bound whole,
    except those in `in_parts` (ids), which may be bound as up to SRC0_PARTS ranges of
    `part_bytes`."""
    for t in tensors:
        for key, limit in limits.items():
            if nbytes(t) <= limit or (key == BINDING_LIMIT and id(t) in in_parts
                                      and nbytes(t) <= SRC0_PARTS * part_bytes):
                continue
            how = (f"; only a frozen block-type weight (mul_mat, get_rows) is split across "
                   f"bindings, into at most {SRC0_PARTS}" if key == BINDING_LIMIT else "")
            raise DeviceLimitError(
                f"tensor {t.name or t.op} {t.shape} needs {nbytes(t)} bytes, more than the "
                f"device's {key.replace('-', ' ')} ({key}) of {limit} bytes{how}: make the "
                f"model, the vocabulary, the batch or the context (--n-ctx) smaller")


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


def whole_words(block: np.ndarray) -> np.ndarray:
    """`block`'s bytes padded with zeros to whole 4-byte words (write_buffer's unit)."""
    if block.nbytes % 4 == 0:
        return block
    data = np.zeros(-(-block.nbytes // 4) * 4, np.uint8)
    data[:block.nbytes] = block.view(np.uint8)
    return data


# dispatches timed per submit by WgpuPlan.profile: WebGPU allows 4096 queries in a set
PROFILE_PASSES = 2048
# WgpuPlan.run submits a graph in parts on a hardware adapter: the device starts on the
# first SUBMIT_FIRST dispatches while the host records the rest, SUBMIT_EVERY at a time
# (recording and finishing take about 2.5 µs a dispatch on a 2-core x86 host: 8 ms for the
# 135M LoRA step's 3 340, which one submit at the end would add to the step)
SUBMIT_FIRST, SUBMIT_EVERY = 64, 256


def submit_parts(n: int) -> list[range]:
    """The ranges of n dispatches that WgpuPlan.run submits one after the other."""
    cuts = [0, *range(min(n, SUBMIT_FIRST), n, SUBMIT_EVERY), n]
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def grid_2d(groups: int) -> tuple[int, int]:
    x = min(groups, MAX_GROUPS)
    return x, math.ceil(groups / x)


class WgpuBackend(Backend):
    name = "wgpu"

    def __init__(self, adapter=None):
        self.adapter = adapter or request_adapter()
        limits = self.adapter.limits
        wanted = (BINDING_LIMIT, "max-buffer-size")
        # timestamp queries time a whole step on the device (WgpuPlan.device_seconds);
        # subgroups run the CPU matmul kernel
        # shader-f16 runs the kernels of f16 tensors
        features = [f for f in ("timestamp-query", "subgroup", "shader-f16")
                    if f in self.adapter.features]
        self.device = self.adapter.request_device_sync(
            required_features=features, required_limits={k: limits[k] for k in wanted})
        # nanoseconds per timestamp tick; no timestamps where the period cannot be read
        self.timestamp_period = (wgpu_direct.timestamp_period(self.device.queue)
                                 if "timestamp-query" in self.device.features else None)
        self.has_timestamps = self.timestamp_period is not None
        self.has_f16 = "shader-f16" in self.device.features
        self.emulates_f16 = False
        self.kernel_variants = choose_variants(self.adapter, self.device)
        # products timed on the device: the choices kept by earlier processes (tuning.py)
        self.tuning_file, self.tuning_failed = None, False
        if any(isinstance(v, TunedMatmul) for v in self.kernel_variants.values()):
            self.tuning_file = choices_file(dict(self.adapter.info))
            load_choices(self.kernel_variants, self.tuning_file)
        # WgpuPlan.run submits in parts where the device works beside the host; lavapipe's
        # device is the host's cores, and each of its submits waits for the one before
        self.submits_in_parts = self.adapter.info.get("adapter_type") != "CPU"
        self.storage_limits = {k: self.device.limits[k] for k in wanted}
        storage = {"type": wgpu.BufferBindingType.storage}
        entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": wgpu.BufferBindingType.uniform}}]
        entries += [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": storage}
                    for i in (*range(1, 2 + MAX_SRCS), *PART_BINDINGS)]
        self.bind_group_layout = self.device.create_bind_group_layout(entries=entries)
        self.pipeline_layout = self.device.create_pipeline_layout(
            bind_group_layouts=[self.bind_group_layout])
        self.part_alignment = self.device.limits["min-storage-buffer-offset-alignment"]
        self.dummy = self.device.create_buffer(
            size=16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        self.fence = self.device.create_buffer(
            size=16, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self._modules, self._pipelines, self._src0_in_parts = {}, {}, {}
        self.constants = SharedConstants()

    @property
    def info(self) -> dict:
        """The adapter's info (device, adapter_type, backend_type, vendor, ...)."""
        return dict(self.adapter.info)

    def _module(self, stem: str, dtypes=F32_BINDINGS):
        key = (stem, dtypes)
        if key not in self._modules:
            self._modules[key] = self.device.create_shader_module(
                label=stem, code=module_source(stem, dtypes))
        return self._modules[key]

    def reads_src0_in_parts(self, stem: str) -> bool:
        """wgsl.reads_src0_in_parts, once per module."""
        if stem not in self._src0_in_parts:
            self._src0_in_parts[stem] = reads_src0_in_parts(stem)
        return self._src0_in_parts[stem]

    def pipeline(self, stem: str, entry: str, part_words: int = 0, dtypes=F32_BINDINGS):
        """The compute pipeline of kernel `entry`, WGSL function k_<entry> in <stem>.wgsl;
        with `part_words`, the one that reads source 0 bound as ranges of that many words;
        `dtypes`: the element types of the bindings dst, src0 .. src3 (binding_dtypes)."""
        key = (stem, entry, part_words, dtypes)
        if key not in self._pipelines:
            compute = {"module": self._module(stem, dtypes), "entry_point": kernel_name(entry)}
            if part_words:
                compute["constants"] = {PART_WORDS: part_words}
            self._pipelines[key] = self.device.create_compute_pipeline(
                label=f"{stem}:{entry}", layout=self.pipeline_layout, compute=compute)
        return self._pipelines[key]

    def plan(self, outputs, sentinel=0, shared=()):
        return WgpuPlan(self, outputs, sentinel, shared)


class WgpuPlan(Plan):
    def __init__(self, backend: WgpuBackend, outputs, sentinel=0, shared=(), variants=None):
        """`variants`: the kernel variants of this plan's dispatches, if not the backend's
        (whose TunedMatmul first times the products it has not chosen for: tuning.py)."""
        super().__init__(outputs, sentinel, shared)
        self.backend = backend
        device = backend.device
        if variants is None:
            variants = backend.kernel_variants
            if any(isinstance(v, TunedMatmul) for v in variants.values()):
                tune_products(backend, self.nodes, WgpuPlan)
        self.dispatches, self.dispatch_ops, private = [], [], {}
        self.node_dispatches = []    # per node: the range of its dispatches
        for step, node in enumerate(self.nodes):
            first = len(self.dispatches)
            for d in OPS[node.op].dispatches_on(node, variants):
                if not backend.has_f16 and "f16" in binding_dtypes((d.dst, *d.srcs)):
                    raise ShapeError(f"{node.op} ({node.name or node.op}) has f16 tensors, and "
                                     f"this adapter lacks the WebGPU feature 'shader-f16': "
                                     f"use f32 tensors or another adapter")
                self.dispatches.append((d.shader or OPS[node.op].shader, d))
                self.dispatch_ops.append(node.op)
                private.update({id(t.storage): (t.storage, step) for t in (d.dst, *d.srcs)
                                if id(t.storage) not in self._known})
            self.node_dispatches.append(range(first, len(self.dispatches)))
        private = list(private.values())
        self.scratch = [t for t, _ in private]
        limits = backend.storage_limits
        binding = limits.get(BINDING_LIMIT, 0)
        self.part_bytes = binding // backend.part_alignment * backend.part_alignment
        # a block may be bound in ranges when every dispatch that binds it reads it so
        may_split = {}
        for stem, d in self.dispatches:
            for b, t in enumerate((d.dst, *d.srcs)):
                in_parts = b == 1 and backend.reads_src0_in_parts(stem)
                may_split[id(t.storage)] = may_split.get(id(t.storage), True) and in_parts
        check_storage_limits(self.roots + self.scratch, self.nbytes, limits,
                             {k for k, ok in may_split.items() if ok}, self.part_bytes)
        # the blocks bound in ranges (each its own buffer)
        self.in_parts = {id(t) for t in self.roots + self.scratch
                         if binding and self.nbytes(t) > binding}
        self.layout = self.storage_layout(
            private, align=max(16, backend.part_alignment),
            max_buffer=limits.get("max-buffer-size"), alone=self.in_parts)
        buffers = [device.create_buffer(size=max(16, n), usage=STORAGE_USAGE)
                   for n in self.layout.buffer_bytes]
        # storage key -> (buffer, byte offset, bytes bound): where each block lies
        self.places = {key: (buffers[b], offset, max(16, size))
                       for key, (b, offset, size) in self.layout.place.items()}
        self._shared = set(self.layout.reused)
        self._staging = None    # (before the writes: an f16 value of an odd count reads back)
        for root in self.roots:
            if id(root) in self.constant_keys:
                shared = backend.constants.get(root, self.nbytes(root), self._upload)
                self.constants[id(root)] = shared
                self.places[id(root)] = (shared.storage, 0, shared.storage.size)
                continue
            if self.sentinel:
                buf, offset, _ = self.places[id(root)]
                device.queue.write_buffer(buf, offset, whole_words(guarded_block(
                    root.storage_len, self.sentinel, root.storage_dtype)))
            if root.value is not None:
                self.write(root, root.value)
        arena = np.zeros((max(1, len(self.dispatches)), UNIFORM_SLOT // 4), np.uint32)
        for i, (_, d) in enumerate(self.dispatches):
            arena[i, :UNIFORM_SIZE // 4] = self._uniforms(d)
        self.arena = device.create_buffer_with_data(data=arena, usage=wgpu.BufferUsage.UNIFORM)
        self.recorded = [self._record(i) for i in range(len(self.dispatches))]
        self._prepare_commands()
        self.direct_calls = self._parts_of(None, whole=True)[0][1] is not None
        self._timer = None          # (timestamp query set, resolve buffer), made when asked
        self.profile_clock = None   # how the last profile() timed: "device" or "host"
        # host time of the last run(): (all of it, recording and submitting the dispatches)
        self.host_seconds = None

    def _record(self, i: int) -> tuple:
        """(pipeline, bind group, grid) of dispatch i, on the buffer ranges of self.places."""
        backend, (stem, d) = self.backend, self.dispatches[i]
        entries = [{"binding": 0, "resource": {"buffer": self.arena,
                                               "offset": i * UNIFORM_SLOT,
                                               "size": UNIFORM_SIZE}}]
        tensors = (d.dst,) + tuple(d.srcs)
        ranges = [(backend.dummy, 0, backend.dummy.size)] * (MAX_SRCS + SRC0_PARTS)
        for b, t in enumerate(tensors):
            ranges[b] = self.places[id(t.storage)]
        split = len(tensors) > 1 and id(tensors[1].storage) in self.in_parts
        if split:  # source 0 in its binding and bindings 6 ..: ranges of part_bytes
            size = self.nbytes(tensors[1].storage)
            buf, offset, _ = ranges[1]
            parts = [(buf, offset + at, min(self.part_bytes, size - at))
                     for at in range(0, size, self.part_bytes)]
            ranges[1] = parts[0]
            ranges[1 + MAX_SRCS:len(parts) + MAX_SRCS] = parts[1:]
        for b, (buf, offset, size) in enumerate(ranges):
            entries.append({"binding": 1 + b, "resource": {"buffer": buf, "offset": offset,
                                                           "size": size}})
        group = backend.device.create_bind_group(layout=backend.bind_group_layout,
                                                 entries=entries)
        pipeline = backend.pipeline(stem, d.entry, self.part_bytes // 4 if split else 0,
                                    binding_dtypes(tensors))
        return pipeline, group, grid_2d(d.grid())

    def _upload(self, root: Tensor):
        """A new buffer holding constant `root`'s value, to share (SharedConstants)."""
        buf = self.backend.device.create_buffer(size=max(16, self.nbytes(root)),
                                                usage=STORAGE_USAGE)
        self.places[id(root)] = (buf, 0, buf.size)
        self.write(root, root.value)
        return buf

    def _unshare(self, key: int):
        """Give this plan its own copy of a shared constant's buffer (before a write), and
        bind the copy where the shared one was bound."""
        device, shared = self.backend.device, self.constants.pop(key).storage
        own = device.create_buffer(size=shared.size, usage=STORAGE_USAGE)
        self.places[key] = (own, 0, own.size)
        encoder = device.create_command_encoder()
        encoder.copy_buffer_to_buffer(shared, 0, own, 0, shared.size)
        device.queue.submit([encoder.finish()])
        for i, (_, d) in enumerate(self.dispatches):
            if any(id(t.storage) == key for t in (d.dst, *d.srcs)):
                self.recorded[i] = self._record(i)
        self._prepare_commands()

    def _prepare_commands(self):
        """Forget the encode loop's work (_parts_of), to prepare it anew from
        self.recorded."""
        self._parts = {}    # (stage or None, whole) -> [_commands_of each part]

    def _parts_of(self, stage, whole: bool) -> list:
        """The encode loop's work, prepared once: the _commands_of the graph's (or a
        stage's) dispatches, in one part where `whole`, else in run's submit parts."""
        key = (stage, whole)
        if key not in self._parts:
            if stage is None:
                indices = range(len(self.recorded))
            else:
                indices = [i for node in stage for i in self.node_dispatches[node]]
            parts = [range(len(indices))] if whole else submit_parts(len(indices))
            self._parts[key] = [self._commands_of([indices[i] for i in part])
                                for part in parts]
        return self._parts[key]

    def _commands_of(self, dispatches):
        """(commands, native handles or None) of these dispatches for the encode loop: the
        pipeline only where it changes (None else); the handles when the direct calls are
        there (wgpu_direct.py)."""
        commands, last = [], None
        for pipeline, group, (x, y) in (self.recorded[i] for i in dispatches):
            commands.append((None if pipeline is last else pipeline, group, x, y))
            last = pipeline
        return commands, wgpu_direct.native_handles(commands)

    def memory(self) -> dict:
        """Plan.memory of this plan's buffers, scratch included."""
        return super().memory(scratch=self.scratch)

    def _uniforms(self, d) -> np.ndarray:
        """The Params block of dispatch `d`, as 32-bit words at PARAMS' field positions."""
        u = np.zeros(UNIFORM_SIZE // 4, np.uint32)
        tensors = (d.dst,) + tuple(d.srcs)
        if len(tensors) > 1 + MAX_SRCS:
            raise ValueError(f"{d.entry}: at most {MAX_SRCS} sources per dispatch")
        u[PARAMS["n"]] = d.n
        # element offsets: off.xyzw of dst and src0..src2, off3.x of src3
        offset_words = [PARAMS["off"] + k for k in range(4)] + [PARAMS["off3"]]
        for k, (t, tag) in enumerate(zip(tensors, TENSOR_TAGS)):
            u[offset_words[k]] = self.sentinel + t.offset
            u[PARAMS[f"ne_{tag}"]:][:4] = t.ne
            u[PARAMS[f"nb_{tag}"]:][:4] = t.nb
        u[PARAMS["f"]:][:len(d.f)] = np.asarray(d.f, np.float32).view(np.uint32)
        u[PARAMS["u"]:][:len(d.u)] = d.u
        return u

    def run(self, feeds=None, stage=None, parts=None):
        """Plan.run: the dispatches submitted in parts (submit_parts) or in one submit, as
        `parts` says (bench ops compares the two); by default as the backend's
        submits_in_parts says."""
        if parts is None:
            parts = self.backend.submits_in_parts
        start = time.perf_counter()
        for t, value in (feeds or {}).items():
            self.write(t, value)
        written = time.perf_counter()
        device = self.backend.device
        for part in self._parts_of(stage, whole=not parts):   # the device starts on each
            encoder = device.create_command_encoder()
            self._record_pass(encoder, part)
            device.queue.submit([encoder.finish()])
        done = time.perf_counter()
        self.host_seconds = (done - start, done - written)

    def encode(self, encoder, timestamp_writes=None, stage=None):
        """Record every dispatch of the graph (or of `stage`'s nodes) into one compute pass
        of `encoder`."""
        (part,) = self._parts_of(stage, whole=True)
        self._record_pass(encoder, part, timestamp_writes)

    def _record_pass(self, encoder, part, timestamp_writes=None):
        """One compute pass of `encoder` with the dispatches of `part` (_commands_of)."""
        commands, handles = part
        cpass = encoder.begin_compute_pass(timestamp_writes=timestamp_writes)
        wgpu_direct.record(cpass, commands, handles if self.direct_calls else None)
        cpass.end()

    def device_seconds(self, feeds=None) -> float | None:
        """Run the graph once and return the device time of its compute pass, from timestamp
        queries written at the pass's beginning and end; None (after running) where the
        adapter has no 'timestamp-query'."""
        for t, value in (feeds or {}).items():
            self.write(t, value)
        device = self.backend.device
        encoder = device.create_command_encoder()
        if not self.backend.has_timestamps:
            self.encode(encoder)
            device.queue.submit([encoder.finish()])
            return None
        queries, resolved = self._timestamps(2)
        self.encode(encoder, {"query_set": queries, "beginning_of_pass_write_index": 0,
                              "end_of_pass_write_index": 1})
        return float(self._resolve(encoder, queries, resolved, 1)[0])

    def _timestamps(self, count: int):
        """(a timestamp query set of at least `count` queries, a buffer to resolve it into),
        made once and grown when asked for more."""
        if self._timer is None or self._timer[0].count < count:
            device = self.backend.device
            usage = wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
            self._timer = (device.create_query_set(type=wgpu.QueryType.timestamp, count=count),
                           device.create_buffer(size=8 * count, usage=usage))
        return self._timer

    def _resolve(self, encoder, queries, resolved, pairs: int) -> np.ndarray:
        """Submit `encoder` with the first `pairs` (begin, end) timestamp pairs of `queries`
        resolved and read back: the seconds between each pair."""
        encoder.resolve_query_set(queries, 0, 2 * pairs, resolved, 0)
        ticks = np.frombuffer(self._copy_back(encoder, [(resolved, 0, 16 * pairs)]), np.uint64)
        ticks = ticks.reshape(pairs, 2).astype(np.int64)
        return (ticks[:, 1] - ticks[:, 0]) * (self.backend.timestamp_period * 1e-9)

    def profile(self, feeds=None) -> list[tuple[str, float]]:
        """Run the graph once dispatch by dispatch: (kernel, seconds) per dispatch. Where the
        adapter has timestamp queries, each dispatch is a compute pass of its own timed on
        the device (all of them in a few submits; self.profile_clock = "device"); else each
        is submitted and waited on alone, its time the host's ("host": a submit and a wait
        each). For finding the kernels that dominate a step."""
        for t, value in (feeds or {}).items():
            self.write(t, value)
        device, times = self.backend.device, []
        names = [f"{stem}:{d.entry}" for stem, d in self.dispatches]
        self.sync()
        if self.backend.has_timestamps:
            self.profile_clock = "device"
            for first in range(0, len(self.recorded), PROFILE_PASSES):
                chunk = self.recorded[first:first + PROFILE_PASSES]
                queries, resolved = self._timestamps(2 * PROFILE_PASSES)
                encoder = device.create_command_encoder()
                for j, command in enumerate(chunk):
                    self._dispatch_alone(encoder, command, {
                        "query_set": queries, "beginning_of_pass_write_index": 2 * j,
                        "end_of_pass_write_index": 2 * j + 1})
                times.extend(self._resolve(encoder, queries, resolved, len(chunk)))
            return list(zip(names, map(float, times)))
        self.profile_clock = "host"
        for command in self.recorded:
            start = time.perf_counter()
            encoder = device.create_command_encoder()
            self._dispatch_alone(encoder, command)
            device.queue.submit([encoder.finish()])
            self.sync()
            times.append(time.perf_counter() - start)
        return list(zip(names, times))

    @staticmethod
    def _dispatch_alone(encoder, command, timestamp_writes=None):
        """Record one recorded dispatch (pipeline, bind group, grid) as a compute pass."""
        pipeline, group, (x, y) = command
        cpass = encoder.begin_compute_pass(timestamp_writes=timestamp_writes)
        cpass.set_pipeline(pipeline)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(x, y, 1)
        cpass.end()

    def write(self, t, value, everywhere=False):
        value = self._check_value(t, value)
        root = t.storage
        if id(root) in self.constants and not everywhere:   # other plans keep the shared value
            self._unshare(id(root))
        buf, at, _ = self.places[id(root)]
        if t.is_quantized:  # raw blocks, padded to whole u32 words
            words = np.zeros(root.storage_len, root.storage_dtype)
            words.view(np.uint8)[:value.nbytes] = value.data
            self.backend.device.queue.write_buffer(buf, at + self.sentinel * words.itemsize,
                                                   words)
        elif (t is root or (t.is_contiguous() and t.shape == root.shape)) and (
                (self.sentinel + t.offset) * root.np_dtype.itemsize % 4 == 0
                and t.nelements * root.np_dtype.itemsize % 4 == 0):
            data = np.ascontiguousarray(value, dtype=root.np_dtype)
            start = self.sentinel + t.offset
            self.backend.device.queue.write_buffer(buf, at + start * root.np_dtype.itemsize,
                                                   data)
        else:  # a strided view (or f16 bytes off 4-byte words): merge into its storage
            block = self.read_raw(root)
            view = np.lib.stride_tricks.as_strided(
                block[self.sentinel + t.offset:], t.shape,
                [s * block.itemsize for s in t.strides])
            view[...] = value
            self.backend.device.queue.write_buffer(buf, at, whole_words(block))

    def _copy_back(self, encoder, copies) -> memoryview:
        """Queue `copies` ((buffer, byte offset, byte count), multiples of 4) one after
        another into the persistent staging buffer, submit `encoder` and map once: their
        bytes, concatenated."""
        device = self.backend.device
        total = sum(n for _, _, n in copies)
        if self._staging is None or self._staging.size < total:
            self._staging = device.create_buffer(
                size=max(total, 256), usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        at = 0
        for buf, offset, n in copies:
            encoder.copy_buffer_to_buffer(buf, offset, self._staging, at, n)
            at += n
        device.queue.submit([encoder.finish()])
        self._staging.map_sync(wgpu.MapMode.READ, 0, total)
        try:
            return self._staging.read_mapped(0, total)
        finally:
            self._staging.unmap()

    def _span(self, t: Tensor) -> tuple[int, int]:
        """(first element, element count) of the part of t's storage block that t reads;
        the whole block, guards included, for block types."""
        if t.is_quantized:
            return 0, t.storage.storage_len + 2 * self.sentinel
        return self.sentinel + t.offset, 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides))

    def read_raw(self, root) -> np.ndarray:
        root = root.storage
        size = (root.storage_len + 2 * self.sentinel) * root.storage_dtype.itemsize
        buf, at, _ = self.places[id(root)]
        data = self._copy_back(self.backend.device.create_command_encoder(),
                               [(buf, at, -(-size // 4) * 4)])
        return np.frombuffer(data, root.storage_dtype, root.storage_len + 2 * self.sentinel).copy()

    def read(self, t: Tensor) -> np.ndarray:
        return self.read_many([t])[0]

    def read_many(self, tensors) -> list[np.ndarray]:
        """The values of `tensors` (copies), each copied from its own span of storage, all
        through one submit and one map of the staging buffer."""
        copies, where = [], []
        for t in tensors:
            self._check_readable(t)
            size = t.storage.storage_dtype.itemsize
            first, count = self._span(t)
            lo, hi = first * size // 4 * 4, -(-(first + count) * size // 4) * 4
            where.append((sum(n for _, _, n in copies) + first * size - lo, count))
            buf, at, _ = self.places[id(t.storage)]
            copies.append((buf, at + lo, hi - lo))
        if not copies:
            return []
        data = self._copy_back(self.backend.device.create_command_encoder(), copies)
        values = []
        for t, (at, count) in zip(tensors, where):
            dtype = t.storage.storage_dtype
            block = np.frombuffer(data, dtype, count, at)
            if t.is_quantized:
                values.append(self.quantized_value(t, block.copy()))
            else:
                values.append(np.lib.stride_tricks.as_strided(
                    block, t.shape, [s * block.itemsize for s in t.strides]).copy())
        return values

    def sync(self):
        """Wait until all submitted work is done (for timing): a 16-byte copy queued behind
        it, then mapped (on_submitted_work_done_sync is broken in wgpu 0.32)."""
        backend = self.backend
        encoder = backend.device.create_command_encoder()
        encoder.copy_buffer_to_buffer(backend.dummy, 0, backend.fence, 0, 16)
        backend.device.queue.submit([encoder.finish()])
        backend.fence.map_sync(wgpu.MapMode.READ)
        backend.fence.unmap()
