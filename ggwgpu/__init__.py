"""ggwgpu: ggml's training machinery as WGSL compute shaders, with NumPy references.

Training and finetuning from Python (api.py; docs/python-api.md):

    import ggwgpu
    base = ggwgpu.load("model.gguf")
    ggwgpu.finetune(base, data="chat-demo", out="adapter.gguf", steps=60)
    print(ggwgpu.generate(ggwgpu.load("model.gguf", adapters=["adapter.gguf"]), "Hi"))

The graph underneath, op by op (every op of ggwgpu.OPS is an attribute of the package):

    import ggwgpu as gg
    x = gg.input_tensor((8, 3), name="x")
    w = gg.param(np.random.randn(4, 3), name="w")
    loss = gg.sum(gg.sqr(gg.mul_mat(w, x)))
    grads = gg.build_backward(loss)             # {w: dloss/dw}
    plan = gg.get_backend().plan([loss, *grads.values()])
    plan.run({x: data}); plan.read(grads[w])
"""
from .backends import get_backend
from .graph import build_backward, topo_order
from .ops import *  # noqa: F401,F403 -- the ops as attributes (gg.mul_mat); not in __all__
from .ops import OPS
from .tensor import ShapeError, Tensor, constant, input_tensor, param
from .training import TrainOptions
from .api import (Evaluation, Model, RunResult, evaluate, finetune, generate, load, merge,
                  resume, train)

__version__ = "0.1.0"

__all__ = [
    # training and finetuning (api.py)
    "Evaluation", "Model", "RunResult", "TrainOptions", "evaluate", "finetune", "generate",
    "load", "merge", "resume", "train",
    # graphs of ops
    "OPS", "ShapeError", "Tensor", "build_backward", "constant", "get_backend", "input_tensor",
    "param", "topo_order",
]
