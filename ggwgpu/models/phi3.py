"""phi3 (Phi-3/3.5-mini, Phi-4-mini; llama.cpp's src/models/phi3.cpp): llama's block with Q,
K and V as one fused product (attn_qkv, rows q | k | v) and the feed-forward's gate and up as
one (ffn_up, rows gate | up: silu(gate) * up); neox rope, partial where rope.dimension_count
is less than the head size; LongRoPE where the file has rope_factors_long/short.weight: the
long factors when the context (n_ctx) exceeds rope.scaling.original_context_length, else the
short ones, as llama.cpp picks them per context, and the rotated dims of Q and K times
rope.scaling.attn_factor (llama.cpp's attn_factor scales cos and sin, as in every family).
llama.cpp ignores a phi3 file's sliding window, and so does ggwgpu. LoRA pairs adapt the
fused matrices, as llama.cpp applies them."""

from .. import ops as O
from . import blocks as B
from .family import Family, fused_qkv_heads


def fused_gate(p: dict, b: str, h):
    """silu(gate) * up, gate and up the two halves of h times ffn_up."""
    y = B.linear(p, b + "ffn_up.weight", h)
    gate, up = B.columns(y, 2)
    return O.swiglu(gate, up)


class Phi3(Family):
    arch = "phi3"
    fusable_qkv = False     # always fused (project_qkv)
    rope_mode = "neox"
    partial_rope = True
    reads_longrope = True
    gate = staticmethod(fused_gate)

    def block_shapes(self, cfg, i):
        e, f, q, kv = cfg.n_embd, cfg.n_ff, cfg.q_dim, cfg.kv_dim
        return {"attn_norm.weight": (e,), "attn_qkv.weight": (q + 2 * kv, e),
                "attn_output.weight": (e, q), "ffn_norm.weight": (e,),
                "ffn_down.weight": (e, f), "ffn_up.weight": (2 * f, e)}

    def project_qkv(self, cfg, p, b, h, lead):
        return fused_qkv_heads(cfg, p, b, h, lead, bias=False)


FAMILY = Phi3()
