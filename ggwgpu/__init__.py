"""ggwgpu: ggml's training machinery as WGSL compute shaders, with NumPy references.

    import ggwgpu as gg
    x = gg.input_tensor((8, 3), name="x")
    w = gg.param(np.random.randn(4, 3), name="w")
    loss = gg.sum(gg.sqr(gg.mul_mat(w, x)))
    grads = gg.build_backward(loss)             # {w: dloss/dw}
    plan = gg.get_backend().plan([loss, *grads.values()])
    plan.run({x: data}); plan.read(grads[w])
"""
from .backends import get_backend  # noqa: F401
from .graph import build_backward, topo_order  # noqa: F401
from .ops import *  # noqa: F401,F403
from .ops import OPS  # noqa: F401
from .tensor import ShapeError, Tensor, constant, input_tensor, param  # noqa: F401

__version__ = "0.1.0"
