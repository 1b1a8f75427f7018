"""The llama model of llama.cpp's train-text-from-scratch, as a ggwgpu graph.

Token embedding, n_layer blocks of (rms_norm -> attention with rope and a causal mask ->
residual -> rms_norm -> SwiGLU feed-forward -> residual), a final rms_norm and the output
matrix. Parameter names are llama.cpp's GGUF tensor names. Shapes in NumPy order: a weight
that maps n_in features to n_out is stored (n_out, n_in), as GGUF stores it (ne0 = n_in).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops as O
from ..tensor import ShapeError, input_tensor, param


@dataclass(frozen=True)
class LlamaConfig:
    n_vocab: int = 256
    n_embd: int = 256
    n_head: int = 8
    n_layer: int = 16
    n_ff: int = 768
    n_ctx: int = 128
    n_rot: int | None = None        # rotated dims per head; default head_dim (llama.cpp's
                                    # llama loader requires it; the reference had min(64, .))
    norm_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ShapeError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.rot % 2 or self.rot > self.head_dim:
            raise ShapeError(f"n_rot {self.rot} must be even and <= head_dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rot(self) -> int:
        return self.n_rot if self.n_rot is not None else self.head_dim


def parameter_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    e, f = cfg.n_embd, cfg.n_ff
    shapes = {"token_embd.weight": (cfg.n_vocab, e)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (e,), b + "attn_q.weight": (e, e),
                       b + "attn_k.weight": (e, e), b + "attn_v.weight": (e, e),
                       b + "attn_output.weight": (e, e), b + "ffn_norm.weight": (e,),
                       b + "ffn_gate.weight": (f, e), b + "ffn_down.weight": (e, f),
                       b + "ffn_up.weight": (f, e)})
    shapes.update({"output_norm.weight": (e,), "output.weight": (cfg.n_vocab, e)})
    return shapes


def init_parameters(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """train-text-from-scratch's initialisation for matrices: normal(0, 1) clamped to
    [-1, 1], scaled by 1/sqrt(ne0 + ne1); norm weights start at 1."""
    rng = np.random.default_rng(seed)
    values = {}
    for name, shape in parameter_shapes(cfg).items():
        if len(shape) == 1:
            values[name] = np.ones(shape, np.float32)
        else:
            w = np.clip(rng.standard_normal(shape), -1.0, 1.0) / np.sqrt(sum(shape))
            values[name] = w.astype(np.float32)
    return values


@dataclass
class TrainGraph:
    tokens: object            # i32 input (batch, n_ctx)
    positions: object         # i32 input (n_ctx,)
    targets: object           # f32 input (batch * n_ctx, n_vocab): target probabilities
    logits: object            # (batch, n_ctx, n_vocab)
    loss: object              # (1,)
    params: dict              # name -> param tensor
    checkpoints: list         # each block's output, for gradient checkpointing


def attention(cfg, q, k, v, flash: bool):
    """Causal self-attention of (batch, n_ctx, n_head, head_dim) q, k, v."""
    q, k, v = (O.permute(t, (0, 2, 1, 3)) for t in (q, k, v))   # (batch, head, ctx, dim)
    scale = 1.0 / np.sqrt(cfg.head_dim)
    if flash:
        out = O.flash_attn(q, k, v, scale, True)
    else:
        kq = O.mul_mat(k, q)                                      # (batch, head, q, k)
        probs = O.soft_max(O.diag_mask_inf(O.scale(kq, scale), 0), 1.0)
        out = O.mul_mat(O.transpose(v), probs)                    # (batch, head, q, dim)
    return O.permute(out, (0, 2, 1, 3))                          # (batch, ctx, head, dim)


def build_train_graph(cfg: LlamaConfig, values: dict, batch: int, flash: bool = False):
    """The forward graph of one training batch with its cross-entropy loss."""
    p = {name: param(v, name=name) for name, v in values.items()}
    tokens = input_tensor((batch, cfg.n_ctx), "i32", name="tokens")
    positions = input_tensor((cfg.n_ctx,), "i32", name="positions")
    targets = input_tensor((batch * cfg.n_ctx, cfg.n_vocab), name="targets")
    heads = (batch, cfg.n_ctx, cfg.n_head, cfg.head_dim)
    rope_args = (cfg.rot, "normal", cfg.rope_freq_base, cfg.rope_freq_scale)

    def norm(x, weight):
        return O.mul(O.rms_norm(x, cfg.norm_eps), weight)

    x = O.get_rows(p["token_embd.weight"], tokens)                # (batch, ctx, embd)
    checkpoints = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        h = norm(x, p[b + "attn_norm.weight"])
        q = O.rope(O.reshape(O.mul_mat(p[b + "attn_q.weight"], h), heads), positions, *rope_args)
        k = O.rope(O.reshape(O.mul_mat(p[b + "attn_k.weight"], h), heads), positions, *rope_args)
        v = O.reshape(O.mul_mat(p[b + "attn_v.weight"], h), heads)
        att = O.reshape(O.cont(attention(cfg, q, k, v, flash)), (batch, cfg.n_ctx, cfg.n_embd))
        x = O.add(x, O.mul_mat(p[b + "attn_output.weight"], att))
        h = norm(x, p[b + "ffn_norm.weight"])
        gate = O.silu(O.mul_mat(p[b + "ffn_gate.weight"], h))
        x = O.add(x, O.mul_mat(p[b + "ffn_down.weight"],
                               O.mul(gate, O.mul_mat(p[b + "ffn_up.weight"], h))))
        checkpoints.append(x)
    logits = O.mul_mat(p["output.weight"], norm(x, p["output_norm.weight"]))
    flat = O.reshape(logits, (batch * cfg.n_ctx, cfg.n_vocab))
    loss = O.cross_entropy_loss(flat, targets)
    return TrainGraph(tokens, positions, targets, logits, loss, p, checkpoints)


def one_hot(ids: np.ndarray, n_vocab: int) -> np.ndarray:
    out = np.zeros((ids.size, n_vocab), np.float32)
    out[np.arange(ids.size), ids.reshape(-1)] = 1.0
    return out
