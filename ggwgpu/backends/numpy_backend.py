"""The reference backend: every op runs its registry's NumPy function, in float32 or float64."""
from __future__ import annotations

import numpy as np

from ..ops import OPS
from ..tensor import Tensor
from .base import Backend, Plan, guarded_block


class NumpyPlan(Plan):
    def __init__(self, backend, outputs, sentinel=0):
        super().__init__(outputs, sentinel)
        self.float_dtype = backend.float_dtype
        self.storage = {}
        for root in self.roots:
            dtype = self.float_dtype if root.dtype == "f32" else root.np_dtype
            self.storage[id(root)] = guarded_block(root.nelements, self.sentinel, dtype)
            if root.value is not None:
                self.write(root, root.value)

    def array(self, t: Tensor) -> np.ndarray:
        """A writable NumPy view of t inside its storage block."""
        block = self.storage[id(t.storage)]
        return np.lib.stride_tricks.as_strided(
            block[self.sentinel + t.offset:], t.shape, [s * block.itemsize for s in t.strides])

    def run(self, feeds=None):
        for t, value in (feeds or {}).items():
            self.write(t, value)
        for node in self.nodes:
            opdef = OPS[node.op]
            out = opdef.reference(*[self.array(s) for s in node.srcs], **node.params)
            np.copyto(self.array(node), out, casting="unsafe")

    def read(self, t):
        return self.array(t).copy()

    def write(self, t, value):
        np.copyto(self.array(t), self._check_value(t, value), casting="unsafe")

    def read_raw(self, root):
        return self.storage[id(root)].copy()


class NumpyBackend(Backend):
    """Runs graphs with the NumPy references; float64 for gradient checks."""

    def __init__(self, float_dtype=np.float32):
        self.float_dtype = np.dtype(float_dtype)
        self.name = "numpy" if self.float_dtype == np.float32 else f"numpy-{self.float_dtype}"

    def plan(self, outputs, sentinel=0):
        return NumpyPlan(self, outputs, sentinel)
