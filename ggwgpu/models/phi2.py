"""phi2 (Microsoft Phi-2, Phi-1.5, Phi-1; llama.cpp's src/models/phi2.cpp): LayerNorm blocks
with biases everywhere. Each block is parallel: one LayerNorm of x (attn_norm, weight and
bias) feeds both attention and the feed-forward, and x + attention + feed-forward is the
block's output. Attention: Q, K, V with biases (separate products, as the converter writes
the current Phi-2 checkpoints), partial neox rope (rope.dimension_count of the head, 32 of
80), attn_output with its bias. The feed-forward has no gate: ffn_down(gelu(ffn_up h + b)) + b
(the tanh gelu). The final LayerNorm (output_norm, weight and bias) and the output matrix
with its bias (output.bias; never tied). The norms' epsilon is attention.layer_norm_epsilon,
read and written as llama.cpp reads it."""
from gguf import GGUFValueType as _T, Keys

from .. import ops as O
from ..tensor import ShapeError
from . import blocks as B
from .family import Family


class Phi2(Family):
    arch = "phi2"
    rope_mode = "neox"
    partial_rope = True
    qkv_bias = True
    layer_norm_eps_fallback = True
    # attention and the feed-forward side by side on one norm (else one after the other,
    # the feed-forward on its own ffn_norm: starcoder2), and the logits' bias
    parallel = True
    output_bias = True

    def check(self, cfg):
        if self.output_bias and cfg.tied_embeddings:
            raise ShapeError(f"llama.cpp's {self.arch} needs its own output matrix (and bias)")

    def more_keys(self, cfg):
        return {Keys.Attention.LAYERNORM_EPS.format(arch=self.arch):
                (float(cfg.norm_eps), _T.FLOAT32)}

    def shapes(self, cfg):
        shapes = super().shapes(cfg)
        shapes[B.OUTPUT_NORM.replace(".weight", ".bias")] = (cfg.n_embd,)
        if self.output_bias:
            shapes[B.OUTPUT_BIAS] = (cfg.n_vocab,)
        return shapes

    def block_shapes(self, cfg, i):
        e, f, q, kv = cfg.n_embd, cfg.n_ff, cfg.q_dim, cfg.kv_dim
        return {"attn_norm.weight": (e,), "attn_norm.bias": (e,),
                "attn_q.weight": (q, e), "attn_q.bias": (q,), "attn_k.weight": (kv, e),
                "attn_k.bias": (kv,), "attn_v.weight": (kv, e), "attn_v.bias": (kv,),
                "attn_output.weight": (e, q), "attn_output.bias": (e,),
                **({} if self.parallel else {"ffn_norm.weight": (e,), "ffn_norm.bias": (e,)}),
                "ffn_up.weight": (f, e), "ffn_up.bias": (f,), "ffn_down.weight": (e, f),
                "ffn_down.bias": (e,)}

    def final_norm(self, cfg, p, x):
        return B.layer_norm(cfg, x, p[B.OUTPUT_NORM], p[B.OUTPUT_NORM.replace(".weight", ".bias")])

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        h = B.layer_norm(cfg, x, p[b + "attn_norm.weight"], p[b + "attn_norm.bias"])
        att = O.add(B.linear(p, b + "attn_output.weight", self.attend(cfg, p, i, h, seq)),
                    p[b + "attn_output.bias"])
        x = O.add(x, att)
        if not self.parallel:
            h = B.layer_norm(cfg, x, p[b + "ffn_norm.weight"], p[b + "ffn_norm.bias"])
        up = O.gelu(O.add(B.linear(p, b + "ffn_up.weight", h), p[b + "ffn_up.bias"]))
        return O.add(x, O.add(B.linear(p, b + "ffn_down.weight", up), p[b + "ffn_down.bias"]))


FAMILY = Phi2()
