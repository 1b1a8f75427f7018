"""stablelm (StableLM 2 1.6B and Zephyr, StableLM 3B 4E1T; llama.cpp's src/models/stablelm.cpp):
llama's pre-norm block with LayerNorms (weight and bias, attention.layer_norm_epsilon)
before attention and the feed-forward and after the last block, biases on Q, K and V where
the file has them (StableLM 2; qkv_bias), partial neox rope (a quarter of the head), SwiGLU,
an untied output matrix. StableLM 2 12B's per-head QK LayerNorms and parallel blocks are
refused by name."""
from . import blocks as B
from .family import Family, qkv_bias_of
from .phi2 import Phi2


class StableLM(Phi2):
    arch = "stablelm"
    qkv_bias = False
    parallel = False
    output_bias = False
    needs_output = True
    unsupported = {"attn_q_norm.weight": "per-head LayerNorms of Q and K (StableLM 2 12B)"}

    def read_more_keys(self, f, hp):
        return {"qkv_bias": qkv_bias_of(f)}

    def block_shapes(self, cfg, i):
        e = cfg.n_embd
        return {"attn_norm.weight": (e,), "attn_norm.bias": (e,),
                **{n: s for n, s in Family.block_shapes(self, cfg, i).items()
                   if not n.endswith("_norm.weight")},
                "ffn_norm.weight": (e,), "ffn_norm.bias": (e,)}

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        h = B.layer_norm(cfg, x, p[b + "attn_norm.weight"], p[b + "attn_norm.bias"])
        x = B.linear(p, b + "attn_output.weight", self.attend(cfg, p, i, h, seq), residual=x)
        h = B.layer_norm(cfg, x, p[b + "ffn_norm.weight"], p[b + "ffn_norm.bias"])
        return B.linear(p, b + "ffn_down.weight", self.gate(p, b, h), residual=x)


FAMILY = StableLM()
