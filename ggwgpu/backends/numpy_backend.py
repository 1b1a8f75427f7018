"""The reference backend: every op runs its registry's NumPy function, in float32 or float64:
the op's fast kernel where it has one (the reference's result written into the node's
storage without its temporaries; NumpyBackend(fast=False) runs the references alone).

Frozen block-type weights stay raw blocks in the plan's storage; the ops that read them get
their values dequantized once (and again after a write), not at every run: the references
would dequantize every weight at every step, many times the cost of the products. Constants
that plans share (base.SharedConstants) share their dequantized values too.

Storage is planned as on a device: one zeroed array (base.Plan.storage_layout, alloc.pack)
holds every block of the plan but the shared constants, each at its byte offset, so blocks
never live at once share bytes and the host holds the step's peak of live bytes, not the sum
of every block the step makes (a checkpointed 135M LoRA step: 0.3 GB, not 5 GB). A block's
first tenant finds zeros, later ones what the last left: kernels write all of their result.

f16 element tensors are stored as float16 when the plan computes in float32, so that every
store rounds to halves as the device's does (the two backends then agree); in float64 (the
gradient checks) they are stored as float64, unrounded. Ops read them converted to float32.

Threads: NumPy runs its products on every core (BLAS) but everything else on one. A big node
whose fast kernel its op lets cut (OpDef.split) runs as pieces along the result's first dim,
on several threads at once: ufuncs and reductions release the GIL. Only ops whose pieces
were measured to pay have a split rule: those dear per element (exp, row reductions:
softmax, swiglu and their backward, the loss's backward); one or two passes over memory
(add, scale, rms_norm, AdamW, rope) ran slower cut than whole, the hand-off costing more
than a second core gave, and BLAS's own threads, which spin a while after each product,
take that core. Each piece computes its rows as the whole kernel would, so the result is
the same bit for bit; $GGWGPU_NUMPY_THREADS sets the number of threads (1: none), else the
cores this process may run on. Products run alone, never beside pieces: BLAS already keeps
every core busy. A node that reads or writes halves runs its reference, whole."""
from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..files import positive_env
from ..ops import OPS
from ..quant import dequantize
from ..tensor import Tensor
from .base import Backend, Plan, SharedConstants, guarded_block


THREADS_VAR = "GGWGPU_NUMPY_THREADS"
# Results smaller than this (elements) run whole: handing a piece to a thread costs some
# tens of microseconds, what a few passes over this many floats take.
SPLIT_MIN = 1 << 16


def default_threads() -> int:
    """$GGWGPU_NUMPY_THREADS (a positive integer), else the cores this process may use."""
    value = positive_env(THREADS_VAR, "threads")
    if value is not None:
        return value
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity on this OS
        return os.cpu_count() or 1


@functools.cache
def worker_pool(workers: int) -> ThreadPoolExecutor:
    """The process's threads that run pieces beside the calling one (made once per size)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="ggwgpu-numpy")


class Pieces:
    """A kernel over a node cut along its first dim: each piece's views of the result and
    sources, made once. Called as a kernel (the whole arrays are ignored), it runs pieces on
    the calling thread and on `helpers` threads of the pool, each taking the next piece not
    taken, and returns when all are done. Two pieces a thread: where another process holds
    a core, the threads that run do the pieces of the one that does not (a helper that has
    not started is called off), rather than waiting for it."""

    def __init__(self, kernel, pieces: list, pool: ThreadPoolExecutor, helpers: int):
        self.kernel, self.pieces, self.pool, self.helpers = kernel, pieces, pool, helpers

    def take(self, todo, params):
        with np.errstate(all="ignore"):   # error state is per thread: as NumpyPlan.run's
            for dst, srcs in todo:        # next() on a list iterator is atomic (the GIL)
                self.kernel(dst, *srcs, **params)

    def __call__(self, dst, *srcs, **params):
        todo = iter(self.pieces)
        helpers = [self.pool.submit(self.take, todo, params) for _ in range(self.helpers)]
        try:
            self.take(todo, params)
        finally:   # never leave a piece running into the next node
            errors = [None if f.cancel() else f.exception() for f in helpers]
        for e in errors:
            if e is not None:
                raise e


def reference_kernel(reference):
    """An op's reference as a kernel writing into the node's storage."""
    def kernel(out, *srcs, **params):
        np.copyto(out, reference(*srcs, **params).reshape(out.shape), casting="unsafe")
    return kernel


class NumpyPlan(Plan):
    def __init__(self, backend, outputs, sentinel=0, shared=()):
        super().__init__(outputs, sentinel, shared)
        self.float_dtype = backend.float_dtype
        self.fast = backend.fast
        self.threads, self.split_min = backend.threads, backend.split_min
        self.storage = {}
        self.dense = {}     # id(block-type storage) -> its values, as float arrays
        self.layout = self.storage_layout()
        self._shared = set(self.layout.reused)
        arenas = [self._arena(n) for n in self.layout.buffer_bytes]
        for root in self.roots:
            if id(root) in self.constant_keys:
                shared = backend.constants.get(root, self.nbytes(root), self._upload)
                self.constants[id(root)] = shared
                self.storage[id(root)] = shared.storage
                continue
            buffer, offset, _ = self.layout.place[id(root)]
            n = root.storage_len + 2 * self.sentinel
            block = arenas[buffer][offset:offset + self.nbytes(root)].view(
                self.storage_dtype(root))[:n]
            if self.sentinel:
                block[...] = guarded_block(root.storage_len, self.sentinel, block.dtype)
            self.storage[id(root)] = block
            if root.value is not None:
                self.write(root, root.value)
        self.steps = self._kernels()

    @staticmethod
    def _arena(nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)   # pages the OS hands out zeroed, on first touch

    def storage_dtype(self, root: Tensor) -> np.dtype:
        """The NumPy type of root's storage: the plan's float type for f32 (and for f16 in
        float64), float16 for f16 in float32, the words of block types."""
        if root.dtype == "f32" or (root.dtype == "f16" and not root.is_quantized
                                   and self.float_dtype != np.float32):
            return self.float_dtype
        return np.dtype(root.storage_dtype)

    def nbytes(self, root: Tensor) -> int:
        return -(-(root.storage_len + 2 * self.sentinel) * self.storage_dtype(root).itemsize
                 // 4) * 4

    def _upload(self, root: Tensor) -> np.ndarray:
        """A storage block of its own for constant `root`, holding its value (to share)."""
        block = self.storage[id(root)] = guarded_block(root.storage_len, self.sentinel,
                                                       self.storage_dtype(root))
        self.write(root, root.value)
        return block

    def _kernels(self) -> list:
        """Per node: its kernel, its sources' arrays, its own array and its params. Storage
        stays where it is (but for a shared constant that a write() copies): every node's
        views are made once."""
        steps = []
        for node in self.nodes:
            halves = self.reads_halves(node)
            srcs = [self.dense_array(s) if s.is_quantized else self.array(s) for s in node.srcs]
            dst = self.array(node)
            kernel = (None if halves else self.pieces(node, dst, srcs)) or self.kernel(
                node.op, halves)
            steps.append((kernel, srcs, dst, node.params))
        return steps

    def pieces(self, node: Tensor, dst: np.ndarray, srcs: list) -> Pieces | None:
        """node's fast kernel cut into two pieces per thread (its op's split rule), or None
        where it runs whole: one thread, a small result, or an op or node that may not be
        cut."""
        opdef = OPS[node.op]
        if (self.threads < 2 or not self.fast or opdef.fast is None or opdef.split is None
                or node.nelements < self.split_min or dst.ndim == 0):
            return None
        cut = opdef.split(dst.shape, *(s.shape for s in srcs))
        n = min(2 * self.threads, dst.shape[0])
        if cut is None or n < 2:
            return None
        ends = [dst.shape[0] * i // n for i in range(n + 1)]
        pieces = [(dst[lo:hi], [s if dim is None else s[(slice(None),) * dim + (slice(lo, hi),)]
                                for s, dim in zip(srcs, cut, strict=True)])
                  for lo, hi in zip(ends, ends[1:])]
        helpers = min(self.threads, n) - 1
        return Pieces(opdef.fast, pieces, worker_pool(self.threads - 1), helpers)

    def kernel(self, op: str, halves: bool = False):
        """(out, *srcs, **params) -> None for op: its fast kernel, else its reference.
        The fast kernels of the frozen-weight ops see their weight dequantized (dense).
        With `halves` (a node that reads or writes float16 storage) the reference runs on
        its sources converted to float32, and the store into `out` rounds."""
        opdef = OPS[op]
        if halves:
            reference = reference_kernel(opdef.reference)
            return lambda out, *srcs, **params: reference(
                out, *(s.astype(np.float32) if s.dtype == np.float16 else s for s in srcs),
                **params)
        if self.fast and opdef.fast is not None:
            return opdef.fast
        return reference_kernel(opdef.reference)

    def reads_halves(self, node: Tensor) -> bool:
        """Whether the node reads or writes storage held as float16."""
        return any(self.storage[id(t.storage)].dtype == np.float16 and not t.is_quantized
                   for t in (node, *node.srcs))

    def dense_array(self, t: Tensor) -> np.ndarray:
        """The values of block-type tensor t, dequantized once into an array that `write`
        keeps up to date (the ops' references take a float array as well as blocks)."""
        key = id(t.storage)
        if key not in self.dense:
            shared = self.constants.get(key)
            dense = shared.dense if shared else None
            if dense is None:
                dense = dequantize(self.array(t)).astype(self.float_dtype)
                if shared:
                    shared.dense = dense
            self.dense[key] = dense
        return self.dense[key].reshape(t.shape)

    def array(self, t: Tensor):
        """A writable NumPy view of t inside its storage block (a Quantized view of the
        blocks for a block-type tensor)."""
        block = self.storage[id(t.storage)]
        if t.is_quantized:
            return self.quantized_value(t, block)
        return np.lib.stride_tricks.as_strided(
            block[self.sentinel + t.offset:], t.shape, [s * block.itemsize for s in t.strides])

    def run(self, feeds=None, stage=None):
        for t, value in (feeds or {}).items():
            self.write(t, value)
        steps = self.steps if stage is None else [self.steps[i] for i in stage]
        # inf and NaN propagate as on the device (the trainer checks them), silently
        with np.errstate(all="ignore"):
            for kernel, srcs, dst, params in steps:
                kernel(dst, *srcs, **params)

    def profile(self, feeds=None) -> list[tuple[str, float]]:
        """Run the graph once, timing each node: (op, seconds) per node."""
        for t, value in (feeds or {}).items():
            self.write(t, value)
        times = []
        with np.errstate(all="ignore"):
            for node, (kernel, srcs, dst, params) in zip(self.nodes, self.steps):
                start = time.perf_counter()
                kernel(dst, *srcs, **params)
                times.append((node.op, time.perf_counter() - start))
        return times

    def read(self, t):
        self._check_readable(t)
        if t.is_quantized:
            return self.quantized_value(t, self.storage[id(t.storage)].copy())
        return self.array(t).copy()

    def write(self, t, value, everywhere=False):
        value = self._check_value(t, value)
        key = id(t.storage)
        if key in self.constants and not everywhere:    # other plans keep the shared value
            del self.constants[key]
            self.storage[key] = self.storage[key].copy()
            if key in self.dense:
                self.dense[key] = self.dense[key].copy()
            self.steps = self._kernels()
        if t.is_quantized:
            self.array(t).data[...] = value.data
            dense = self.dense.get(id(t.storage))
            if dense is not None:
                dense[...] = dequantize(value).reshape(dense.shape)
        else:
            np.copyto(self.array(t), value, casting="unsafe")

    def read_raw(self, root):
        return self.storage[id(root)].copy()


class NumpyBackend(Backend):
    """Runs graphs with the NumPy references (and the ops' fast kernels, unless fast=False);
    float64 for gradient checks. `threads`: how many run the pieces of a big node (None:
    default_threads(); 1: every node whole); `split_min`: the fewest result elements a node
    is cut at."""

    def __init__(self, float_dtype=np.float32, fast: bool = True, threads: int | None = None,
                 split_min: int = SPLIT_MIN):
        self.float_dtype = np.dtype(float_dtype)
        self.fast = fast
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.split_min = split_min
        self.name = "numpy" if self.float_dtype == np.float32 else f"numpy-{self.float_dtype}"
        self.constants = SharedConstants()
        self.has_f16 = False
        self.emulates_f16 = True        # stores halves, computes in float32
        self.storage_limits = {}        # the host's memory only
        self.kernel_variants = {}       # no shaders
        self.info = {"device": "host CPU", "backend_type": "NumPy"}

    def plan(self, outputs, sentinel=0, shared=()):
        return NumpyPlan(self, outputs, sentinel, shared)
