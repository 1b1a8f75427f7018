"""phimoe (Microsoft Phi-3.5-MoE; llama.cpp's src/models/phi3.cpp, which builds it): phi3's
block with biases, as llama.cpp computes it: RMS norms plus a bias (attn_norm, ffn_norm and
the final norm each have weight and bias), Q, K and V as three products with biases where the
file has them, attn_output with its bias, neox rope with LongRoPE's factors where the file has
them; the feed-forward a mixture of n_ff wide experts chosen by the router's softmax, their
weights normalized (llama.cpp's build_moe_ffn, not the checkpoint's sparsemixer); an output
matrix of its own with its bias."""
from .. import ops as O
from ..tensor import ShapeError
from . import blocks as B
from .family import EXPERT_KEYS, Family, qkv_bias_of

NORMS = ("attn_norm", "ffn_norm")


def biased_rms_norm(cfg, p: dict, name: str, x):
    """llama.cpp's LLM_NORM_RMS with a bias: rms_norm(x) * name.weight + name.bias."""
    return O.add(B.rms_norm(cfg, x, p[name + ".weight"]), p[name + ".bias"])


class PhiMoe(Family):
    arch = "phimoe"
    rope_mode = "neox"
    partial_rope = True
    reads_longrope = True
    experts = True
    needs_output = True
    keys = EXPERT_KEYS
    required = tuple(EXPERT_KEYS)

    def check(self, cfg):
        if not cfg.n_expert:
            raise ShapeError("llama.cpp's phimoe needs n_expert > 0 (expert_count)")

    def read_more_keys(self, f, hp):
        return {"qkv_bias": qkv_bias_of(f)}

    def shapes(self, cfg):
        shapes = super().shapes(cfg)
        return {**shapes, "output_norm.bias": (cfg.n_embd,), B.OUTPUT_BIAS: (cfg.n_vocab,)}

    def block_shapes(self, cfg, i):
        e = cfg.n_embd
        shapes = super().block_shapes(cfg, i)
        shapes.update({f"{n}.bias": (e,) for n in NORMS})
        shapes["attn_output.bias"] = (e,)
        return shapes

    def final_norm(self, cfg, p, x):
        return biased_rms_norm(cfg, p, "output_norm", x)

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        att = self.attend(cfg, p, i, biased_rms_norm(cfg, p, b + "attn_norm", x), seq)
        x = O.add(B.linear(p, b + "attn_output.weight", att, residual=x),
                  p[b + "attn_output.bias"])
        return O.add(x, self.mixture(cfg, p, b, biased_rms_norm(cfg, p, b + "ffn_norm", x)))


FAMILY = PhiMoe()
