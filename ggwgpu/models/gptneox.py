"""gptneox (EleutherAI Pythia 14M .. 12B, GPT-NeoX-20B, and the models converted as gptneox;
llama.cpp's src/models/gptneox.cpp): LayerNorm blocks with biases everywhere. Q, K and V come
from one fused attn_qkv and its bias (rows q | k | v: the converter undoes the checkpoints'
per-head interleaving), partial neox rope (rope.dimension_count of the head: Pythia's
rotary_pct 0.25), attn_output with its bias; the feed-forward ffn_down(gelu(ffn_up h + b)) + b
(the tanh gelu). With use_parallel_residual (every Pythia) both branches read the block's
input, each through its own LayerNorm: x + attention(attn_norm x) + feed-forward(ffn_norm x);
without it one follows the other, as starcoder2's. The final LayerNorm (weight and bias) and
an output matrix of its own, without a bias (llama.cpp requires it: never tied)."""
from gguf import GGUFValueType, Keys

from .. import ops as O
from ..gguf_file import GGUFError
from . import blocks as B
from .gpt2 import GPT2
from .phi2 import Phi2

PARALLEL = Keys.LLM.USE_PARALLEL_RESIDUAL


class GPTNeoX(Phi2):
    arch = "gptneox"
    qkv_bias = False        # the fused attn_qkv's bias (project_qkv)
    output_bias = False
    fusable_qkv = False     # always fused (project_qkv)
    needs_output = True
    block_shapes = GPT2.block_shapes
    project_qkv = GPT2.project_qkv

    def more_keys(self, cfg):
        return {**super().more_keys(cfg),
                PARALLEL.format(arch=self.arch): (cfg.parallel_residual, GGUFValueType.BOOL)}

    def read_more_keys(self, f, hp):
        key = PARALLEL.format(arch=self.arch)
        if not isinstance(f.meta.get(key), bool):      # llama.cpp requires it
            raise GGUFError(f"{f.path}: required key {key} is missing or not a bool")
        return {"parallel_residual": f.meta[key]}

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        h = B.layer_norm(cfg, x, p[b + "attn_norm.weight"], p[b + "attn_norm.bias"])
        att = O.add(B.linear(p, b + "attn_output.weight", self.attend(cfg, p, i, h, seq)),
                    p[b + "attn_output.bias"])
        y = x if cfg.parallel_residual else O.add(x, att)
        h = B.layer_norm(cfg, y, p[b + "ffn_norm.weight"], p[b + "ffn_norm.bias"])
        up = O.gelu(O.add(B.linear(p, b + "ffn_up.weight", h), p[b + "ffn_up.bias"]))
        ff = O.add(B.linear(p, b + "ffn_down.weight", up), p[b + "ffn_down.bias"])
        return O.add(O.add(ff, x), att) if cfg.parallel_residual else O.add(y, ff)


FAMILY = GPTNeoX()
