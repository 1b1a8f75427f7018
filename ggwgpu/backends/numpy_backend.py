"""The reference backend: every op runs its registry's NumPy function, in float32 or float64.
Frozen block-type weights stay raw blocks in the plan's storage; the ops that read them get
their values dequantized once per plan (and again after a write), not at every run: the
references would dequantize every weight at every step, many times the cost of the products."""
from __future__ import annotations

import time

import numpy as np

from ..ops import OPS
from ..quant import dequantize
from ..tensor import Tensor
from .base import Backend, Plan, guarded_block


def unbatched(a: np.ndarray) -> bool:
    return all(n == 1 for n in a.shape[:-2])


def mul_mat_rows(a, b):
    """mul_mat of a weight (no batch dims) and rows: one BLAS call over all of b's rows (the
    reference repeats a per batch entry). Shaped by the caller."""
    if not unbatched(a):
        return OPS["mul_mat"].reference(a, b)
    return b.reshape(-1, b.shape[-1]) @ a.reshape(a.shape[-2:]).T


def out_prod_rows(a, b):
    """out_prod of two matrices (the weight gradients) as one BLAS call."""
    if not (unbatched(a) and unbatched(b)):
        return OPS["out_prod"].reference(a, b)
    return b.reshape(b.shape[-2:]).T @ a.reshape(a.shape[-2:])


# Faster kernels than the references for the hot ops of a training step, with the same
# results up to float rounding (tests/test_backends.py). The frozen-weight products see their
# weight dequantized (NumpyPlan.dense).
FAST = {"mul_mat": mul_mat_rows, "out_prod": out_prod_rows, "mul_mat_q": mul_mat_rows,
        "mul_mat_q_back": lambda w, g: mul_mat_rows(np.swapaxes(w, -1, -2), g)}


class NumpyPlan(Plan):
    def __init__(self, backend, outputs, sentinel=0):
        super().__init__(outputs, sentinel)
        self.float_dtype = backend.float_dtype
        self.storage = {}
        self.dense = {}     # id(block-type storage) -> its values, as float arrays
        for root in self.roots:
            dtype = self.float_dtype if root.dtype == "f32" else root.storage_dtype
            self.storage[id(root)] = guarded_block(root.storage_len, self.sentinel, dtype)
            if root.value is not None:
                self.write(root, root.value)
        # storage never moves: every node's views are made once, as its kernel
        self.steps = [(FAST.get(node.op, OPS[node.op].reference),
                       [self.dense_array(s) if s.is_quantized else self.array(s)
                        for s in node.srcs], self.array(node), node.params)
                      for node in self.nodes]

    def dense_array(self, t: Tensor) -> np.ndarray:
        """The values of block-type tensor t, dequantized once into an array that `write`
        keeps up to date (the ops' references take a float array as well as blocks)."""
        key = id(t.storage)
        if key not in self.dense:
            self.dense[key] = dequantize(self.array(t)).astype(self.float_dtype)
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
                np.copyto(dst, kernel(*srcs, **params).reshape(dst.shape), casting="unsafe")

    def profile(self, feeds=None) -> list[tuple[str, float]]:
        """Run the graph once, timing each node: (op, seconds) per node."""
        for t, value in (feeds or {}).items():
            self.write(t, value)
        times = []
        for node, (kernel, srcs, dst, params) in zip(self.nodes, self.steps):
            start = time.perf_counter()
            np.copyto(dst, kernel(*srcs, **params).reshape(dst.shape), casting="unsafe")
            times.append((node.op, time.perf_counter() - start))
        return times

    def read(self, t):
        if t.is_quantized:
            return self.quantized_value(t, self.storage[id(t.storage)].copy())
        return self.array(t).copy()

    def write(self, t, value):
        value = self._check_value(t, value)
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
    """Runs graphs with the NumPy references; float64 for gradient checks."""

    def __init__(self, float_dtype=np.float32):
        self.float_dtype = np.dtype(float_dtype)
        self.name = "numpy" if self.float_dtype == np.float32 else f"numpy-{self.float_dtype}"

    def plan(self, outputs, sentinel=0):
        return NumpyPlan(self, outputs, sentinel)
