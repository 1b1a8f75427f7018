"""The WebGPU backend: WGSL compute shaders dispatched through wgpu-py.

A plan creates every buffer, uniform slot and bind group once. A run writes the inputs,
records all dispatches of the graph into one compute pass of one command encoder and submits
once; nothing is read back unless asked for, and what is (read_many) comes back through one
copy and one map of a persistent staging buffer.
"""
from __future__ import annotations

import math
import os
import re
import time
import sys
import tempfile
from pathlib import Path

import numpy as np
import wgpu

from ..ops import OPS
from ..tensor import ShapeError, Tensor
from . import wgpu_direct
from .base import Backend, Plan, guarded_block

UNIFORM_SLOT = 256          # bytes per dispatch in the uniform arena (WebGPU's max alignment)
MAX_SRCS = 4
# A storage block larger than one binding is bound as up to SRC0_PARTS ranges, as source 0
# of a kernel that reads it through quant_blocks.wgsl's src0_word: its own binding and
# bindings 6 .. 8, so dst, 4 sources and the parts stay within WebGPU's 8 storage buffers.
SRC0_PARTS = 4
PART_BINDINGS = tuple(range(2 + MAX_SRCS, 1 + MAX_SRCS + SRC0_PARTS))
MAX_GROUPS = 65535          # per grid dimension; bigger 1-D grids fold into 2-D


class NoAdapterError(RuntimeError):
    """No WebGPU adapter could be had on this machine."""


class DeviceLimitError(ShapeError):
    """A tensor is larger than the device allows; raised while planning, before any buffer
    is made or anything dispatched."""


BINDING_LIMIT = "max-storage-buffer-binding-size"


def check_storage_limits(tensors, nbytes, limits: dict, in_parts=frozenset(), part_bytes=0):
    """Refuse the first of `tensors` whose storage (nbytes(t) bytes) exceeds one of `limits`
    ({adapter limit name: bytes}): a buffer is as large as the largest block it holds, and
    every block is bound whole, except those in `in_parts` (ids), which may be bound as up to
    SRC0_PARTS ranges of `part_bytes`."""
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
                f"model, the vocabulary or the batch smaller")


def shader_dir() -> Path:
    """Where the WGSL files are: inside the installed package, or the source checkout's
    top-level shaders/ folder."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here / "shaders", here.parent / "shaders"):
        if (candidate / "common.wgsl").is_file():
            return candidate
    raise FileNotFoundError(f"WGSL shaders not found next to {here}")


def shader_source(stem: str) -> str:
    """The common header followed by the op family's file, in which a line
    `//#include NAME.wgsl` stands for that file's text (code two files share)."""
    d = shader_dir()
    text = re.sub(r"^//#include (\w+\.wgsl)$", lambda m: (d / m[1]).read_text(),
                  (d / f"{stem}.wgsl").read_text(), flags=re.M)
    return (d / "common.wgsl").read_text() + "\n" + text


# Words of the WGSL types a Params field may have, and their alignment in words (WGSL's
# uniform layout rules).
PARAM_TYPES = {"u32": (1, 1), "i32": (1, 1), "f32": (1, 1),
               "vec4u": (4, 4), "vec4i": (4, 4), "vec4f": (4, 4)}
TENSOR_TAGS = ("d", "0", "1", "2", "3")   # dst, then the sources: ne_<tag>, nb_<tag>


def params_layout(source: str) -> tuple[dict[str, int], int]:
    """The uniform block's layout, read from the `struct Params` of `source` (common.wgsl):
    ({field: first 32-bit word}, size in bytes). The one description of the block is the
    WGSL struct; _uniforms writes each value at its field's word. Raises ValueError naming
    what does not fit what _uniforms writes."""
    found = re.search(r"struct\s+Params\s*\{(.*?)\}", source, re.S)
    if not found:
        raise ValueError("common.wgsl: no `struct Params { ... }`")
    body = re.sub(r"//[^\n]*", "", found[1])
    words, at, align_max = {}, 0, 1
    for name, kind in re.findall(r"(\w+)\s*:\s*([\w<>]+)", body):
        if kind not in PARAM_TYPES:
            raise ValueError(f"common.wgsl: Params.{name} has type {kind}, not one of "
                             f"{', '.join(PARAM_TYPES)}")
        size, align = PARAM_TYPES[kind]
        at = -(-at // align) * align
        words[name] = at
        at += size
        align_max = max(align_max, align)
    want = {"n": "u32", "off": "vec4u", "off3": "vec4u", "f": "vec4f", "u": "vec4u",
            **{f"{k}_{t}": "vec4u" for t in TENSOR_TAGS for k in ("ne", "nb")}}
    kinds = dict(re.findall(r"(\w+)\s*:\s*([\w<>]+)", body))
    for name, kind in want.items():
        if kinds.get(name) != kind:
            raise ValueError(f"common.wgsl: Params needs field {name}: {kind} "
                             f"(found {kinds.get(name)})")
    return words, -(-at // align_max) * align_max * 4


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


PARAMS, UNIFORM_SIZE = params_layout((shader_dir() / "common.wgsl").read_text())


MATMUL_ENV = "GGWGPU_MATMUL"


def matmul_variant(adapter, device) -> str:
    """The vec4 matmul kernel for this adapter (ops/matmul.py VEC4_KERNELS), or the one
    $GGWGPU_MATMUL names. 'subgroup' where it was measured fastest: lavapipe, whose
    subgroups are its SIMD lanes (8 or 16, as the kernel needs); 'tiled' everywhere else."""
    forced = os.environ.get(MATMUL_ENV)
    if forced:
        if forced not in OPS["mul_mat"].variants:
            raise ValueError(f"${MATMUL_ENV}={forced!r}: choose one of "
                             f"{', '.join(OPS['mul_mat'].variants)}")
        return forced
    info = adapter.info
    lanes = (info.get("adapter_type") == "CPU" and info.get("vendor") == "llvmpipe"
             and "subgroup" in device.features)
    return "subgroup" if lanes else "tiled"


def row_variant(adapter) -> str:
    """The kernels of the row ops (ops/norm.py ROW_VARIANTS): 'rowwise', one invocation per
    row, on CPU adapters, where workgroup barriers cost more than a row of work (lavapipe,
    `bench ops` tiny: soft_max 15x, rms_norm_mul 5x faster); 'workgroup' everywhere else."""
    return "rowwise" if adapter.info.get("adapter_type") == "CPU" else "workgroup"


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
        features = [f for f in ("timestamp-query", "subgroup") if f in self.adapter.features]
        self.device = self.adapter.request_device_sync(
            required_features=features, required_limits={k: limits[k] for k in wanted})
        self.has_timestamps = "timestamp-query" in self.device.features
        matmul = matmul_variant(self.adapter, self.device)
        rows = row_variant(self.adapter)
        # the quantized products follow matmul: their subgroup kernels want the same adapters
        self.kernel_variants = {"matmul": matmul,
                                "quant": "subgroup" if matmul == "subgroup" else "portable",
                                "norm": rows, "softmax": rows}
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

    @property
    def info(self) -> dict:
        return dict(self.adapter.info)

    def _module(self, stem: str):
        if stem not in self._modules:
            self._modules[stem] = self.device.create_shader_module(
                label=stem, code=shader_source(stem))
        return self._modules[stem]

    def reads_src0_in_parts(self, stem: str) -> bool:
        """Whether <stem>.wgsl reads source 0 through src0_word (quant_blocks.wgsl), and can
        therefore take it bound as several ranges."""
        if stem not in self._src0_in_parts:
            self._src0_in_parts[stem] = "override SRC0_PART_WORDS" in shader_source(stem)
        return self._src0_in_parts[stem]

    def pipeline(self, stem: str, entry: str, part_words: int = 0):
        """The compute pipeline of kernel `entry`, WGSL function k_<entry> in <stem>.wgsl;
        with `part_words`, the one that reads source 0 bound as ranges of that many words."""
        key = (stem, entry, part_words)
        if key not in self._pipelines:
            compute = {"module": self._module(stem), "entry_point": kernel_name(entry)}
            if part_words:
                compute["constants"] = {"SRC0_PART_WORDS": part_words}
            self._pipelines[key] = self.device.create_compute_pipeline(
                label=f"{stem}:{entry}", layout=self.pipeline_layout, compute=compute)
        return self._pipelines[key]

    def plan(self, outputs, sentinel=0):
        return WgpuPlan(self, outputs, sentinel)


class WgpuPlan(Plan):
    def __init__(self, backend: WgpuBackend, outputs, sentinel=0):
        super().__init__(outputs, sentinel)
        self.backend = backend
        device = backend.device
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.dispatches, self.dispatch_ops, private = [], [], {}
        self.node_dispatches = []    # per node: the range of its dispatches
        for step, node in enumerate(self.nodes):
            first = len(self.dispatches)
            for d in OPS[node.op].dispatches_on(node, backend.kernel_variants):
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
        # the blocks bound in ranges (each its own buffer: leaves share none)
        self.in_parts = {id(t) for t in self.roots + self.scratch
                         if binding and self.nbytes(t) > binding}
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
                device.queue.write_buffer(self.buffers[id(root)], 0, guarded_block(
                    root.storage_len, self.sentinel, root.storage_dtype))
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
            ranges = [(backend.dummy, 0, backend.dummy.size)] * (MAX_SRCS + SRC0_PARTS)
            for b, t in enumerate(tensors):
                buf = self.buffers[id(t.storage)]
                ranges[b] = (buf, 0, buf.size)
            split = len(tensors) > 1 and id(tensors[1].storage) in self.in_parts
            if split:  # source 0 in its binding and bindings 6 ..: ranges of part_bytes
                size = self.nbytes(tensors[1].storage)
                parts = [(ranges[1][0], at, min(self.part_bytes, size - at))
                         for at in range(0, size, self.part_bytes)]
                ranges[1] = parts[0]
                ranges[1 + MAX_SRCS:len(parts) + MAX_SRCS] = parts[1:]
            for b, (buf, offset, size) in enumerate(ranges):
                entries.append({"binding": 1 + b, "resource": {"buffer": buf, "offset": offset,
                                                               "size": size}})
            group = device.create_bind_group(layout=backend.bind_group_layout, entries=entries)
            pipeline = backend.pipeline(stem, d.entry, self.part_bytes // 4 if split else 0)
            self.recorded.append((pipeline, group, grid_2d(d.grid())))
        # The encode loop's work, prepared once: the whole graph's, and a stage's when asked
        self._commands, self._handles = self._commands_of(range(len(self.recorded)))
        self.direct_calls = self._handles is not None
        self._stage_commands = {}     # stage -> _commands_of its dispatches
        self._staging = None
        self._timer = None

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
        return super().memory(self.layout, self.scratch)

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

    def run(self, feeds=None, stage=None):
        for t, value in (feeds or {}).items():
            self.write(t, value)
        device = self.backend.device
        encoder = device.create_command_encoder()
        self.encode(encoder, stage=stage)
        device.queue.submit([encoder.finish()])

    def encode(self, encoder, timestamp_writes=None, stage=None):
        """Record every dispatch of the graph (or of `stage`'s nodes) into one compute pass
        of `encoder`."""
        if stage is None:
            commands, handles = self._commands, self._handles
        else:
            if stage not in self._stage_commands:
                self._stage_commands[stage] = self._commands_of(
                    [i for node in stage for i in self.node_dispatches[node]])
            commands, handles = self._stage_commands[stage]
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
        if self._timer is None:
            self._timer = (device.create_query_set(type=wgpu.QueryType.timestamp, count=2),
                           device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE
                                                | wgpu.BufferUsage.COPY_SRC))
        queries, resolved = self._timer
        self.encode(encoder, {"query_set": queries, "beginning_of_pass_write_index": 0,
                              "end_of_pass_write_index": 1})
        encoder.resolve_query_set(queries, 0, 2, resolved, 0)
        start, end = np.frombuffer(self._copy_back(encoder, [(resolved, 0, 16)]), np.uint64)
        return (int(end) - int(start)) * 1e-9   # WebGPU timestamps count nanoseconds

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
        if t.is_quantized:  # raw blocks, padded to whole u32 words
            words = np.zeros(root.storage_len, root.storage_dtype)
            words.view(np.uint8)[:value.nbytes] = value.data
            self.backend.device.queue.write_buffer(
                self.buffers[id(root)], self.sentinel * words.itemsize, words)
        elif t is root or (t.is_contiguous() and t.shape == root.shape):
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
        data = self._copy_back(self.backend.device.create_command_encoder(),
                               [(self.buffers[id(root)], 0, -(-size // 4) * 4)])
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
            copies.append((self.buffers[id(t.storage)], lo, hi - lo))
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
