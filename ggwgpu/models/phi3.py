"""phi3 (Phi-3/3.5-mini, Phi-4-mini; llama.cpp's src/models/phi3.cpp): llama's block with Q,
K and V as one fused product (attn_qkv, rows q | k | v) and the feed-forward's gate and up as
one (ffn_up, rows gate | up: silu(gate) * up); neox rope, partial where rope.dimension_count
is less than the head size; LongRoPE where the file has rope_factors_long/short.weight: the
long factors when the context (n_ctx) exceeds rope.scaling.original_context_length, else the
short ones, as llama.cpp picks them per context, and the rotated dims of Q and K times
rope.scaling.attn_factor (llama.cpp's attn_factor scales cos and sin). llama.cpp ignores a
phi3 file's sliding window, and so does ggwgpu. LoRA pairs adapt the fused matrices, as
llama.cpp applies them."""
import numpy as np
from gguf import Keys

from .. import ops as O
from ..tensor import constant
from . import blocks as B
from .family import Family

LONG, SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


def fused_gate(p: dict, b: str, h):
    """silu(gate) * up, gate and up the two halves of h times ffn_up."""
    y = B.linear(p, b + "ffn_up.weight", h)
    gate, up = B.columns(y, 2)
    return O.swiglu(gate, up)


class Phi3(Family):
    arch = "phi3"
    rope_mode = "neox"
    partial_rope = True
    gate = staticmethod(fused_gate)
    keys = {"rope_orig_ctx": Keys.Rope.SCALING_ORIG_CTX_LEN,
            "rope_attn_factor": Keys.Rope.SCALING_ATTN_FACTOR}

    def block_shapes(self, cfg, i):
        e, f, q, kv = cfg.n_embd, cfg.n_ff, cfg.q_dim, cfg.kv_dim
        return {"attn_norm.weight": (e,), "attn_qkv.weight": (q + 2 * kv, e),
                "attn_output.weight": (e, q), "ffn_norm.weight": (e,),
                "ffn_down.weight": (e, f), "ffn_up.weight": (2 * f, e)}

    def rope_tables(self, cfg):
        return (LONG, SHORT) if cfg.longrope else ()

    def project_qkv(self, cfg, p, b, h, lead):
        qkv = B.linear(p, b + "attn_qkv.weight", h)
        qkv = O.reshape(qkv, (*lead, qkv.shape[-1]))              # (*lead, q | k | v)
        return B.columns(qkv, (cfg.q_dim, cfg.kv_dim, cfg.kv_dim), cfg.head_dim)

    def rope(self, cfg, p, i, x, positions):
        factors = None
        if cfg.longrope:
            factors = p[LONG if cfg.rope_orig_ctx and cfg.n_ctx > cfg.rope_orig_ctx else SHORT]
        y = B.rope(cfg, x, positions, cfg.rope_freq_base, cfg.rope_freq_scale, factors)
        m = cfg.rope_attn_factor
        if m == 1.0:
            return y
        if cfg.rot == cfg.head_dim:
            return O.scale(y, m)
        dims = np.where(np.arange(cfg.head_dim) < cfg.rot, m, 1.0).astype(np.float32)
        return O.mul(y, constant(dims, y.dtype, name="rope attn_factor"))


FAMILY = Phi3()
