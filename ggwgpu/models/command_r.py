"""command-r (Cohere Command-R 35B, Aya 23 8B and 35B, Aya Expanse 8B and 32B; llama.cpp's
src/models/command-r.cpp): parallel blocks on one LayerNorm without a bias (attn_norm):
x + attention(h) + SwiGLU(h); rope mode normal; the final LayerNorm without a bias; the
output matrix is always the token embedding, and the logits are times logit_scale (where
set). The norms' epsilon is attention.layer_norm_epsilon, read and written as llama.cpp
reads it. Command R+'s per-head Q/K LayerNorms are refused by name."""
from gguf import GGUFValueType as _T, Keys

from .. import ops as O
from ..tensor import ShapeError
from . import blocks as B
from .family import Family

QK_NORMS = "Command R+'s per-head Q/K LayerNorms"


def norm(cfg, x, weight):
    """llama.cpp's LLM_NORM with a weight and no bias."""
    return O.mul(O.norm(x, cfg.norm_eps), weight)


class CommandR(Family):
    arch = "command-r"
    layer_norm_eps_fallback = True
    keys = {"logit_scale": Keys.LLM.LOGIT_SCALE}
    unsupported = {"attn_q_norm.weight": QK_NORMS, "attn_k_norm.weight": QK_NORMS}

    def check(self, cfg):
        if not cfg.tied_embeddings:
            raise ShapeError(f"llama.cpp's {self.arch} reads the token embedding as its output "
                             f"matrix: it needs tied_embeddings")

    def logit_factor(self, cfg):
        return cfg.logit_scale

    def more_keys(self, cfg):
        return {Keys.Attention.LAYERNORM_EPS.format(arch=self.arch):
                (float(cfg.norm_eps), _T.FLOAT32)}

    def block_shapes(self, cfg, i):
        e, f, q, kv = cfg.n_embd, cfg.n_ff, cfg.q_dim, cfg.kv_dim
        return {"attn_norm.weight": (e,), "attn_q.weight": (q, e), "attn_k.weight": (kv, e),
                "attn_v.weight": (kv, e), "attn_output.weight": (e, q),
                "ffn_gate.weight": (f, e), "ffn_down.weight": (e, f), "ffn_up.weight": (f, e)}

    def final_norm(self, cfg, p, x):
        return norm(cfg, x, p[B.OUTPUT_NORM])

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        h = norm(cfg, x, p[b + "attn_norm.weight"])
        x = B.linear(p, b + "attn_output.weight", self.attend(cfg, p, i, h, seq), residual=x)
        return B.linear(p, b + "ffn_down.weight", self.gate(p, b, h), residual=x)


FAMILY = CommandR()
