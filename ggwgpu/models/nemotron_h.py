"""nemotron_h (NVIDIA Nemotron-H 4B, 8B, Nemotron Nano 9B v2, 12B v2; llama.cpp's
src/models/nemotron-h.cpp): a stack of single-mixer blocks, each x + mixer(attn_norm(x)):
a Mamba2 (granitehybrid's mixer, of the file's ssm.inner_size) where attention.head_count_kv
and feed_forward_length are both 0, attention without rope (scores times attention.scale,
1/sqrt(head size) when unset) where only feed_forward_length is 0, else a feed-forward of no
gate, ffn_down(relu(ffn_up h)^2). The files may give only the layer norm's epsilon
(attention.layer_norm_epsilon, which llama.cpp requires: written beside the RMS one).
Experts in a nemotron_h file (they are nemotron_h_moe's: nemotron_h_moe.py) and biases are
refused by name."""
from gguf import GGUFValueType, Keys

from ..tensor import ShapeError
from . import blocks as B
from .arcee import relu_squared
from .family import Family
from .granitehybrid import (INNER_SIZE, MAMBA2_KEYS, Mamba2Layers, check_mamba2,
                            inner_size, mamba2, mamba2_shapes)

_T = GGUFValueType
MOE = "mixture-of-experts blocks"


class NemotronH(Mamba2Layers, Family):
    arch = "nemotron_h"
    ff_free = True
    layer_norm_eps_fallback = True
    keys = {**MAMBA2_KEYS, "attention_scale": Keys.Attention.SCALE}
    unsupported = {"ffn_gate_inp.weight": MOE, "ffn_down_exps.weight": MOE,
                   "ffn_up_exps.weight": MOE, "attn_output.bias": "an attention output bias",
                   "ffn_up.bias": "feed-forward biases", "ffn_down.bias": "feed-forward biases"}

    def check(self, cfg):
        check_mamba2(cfg)
        both = sorted(set(cfg.recurrent_layers) & set(cfg.mlp_layers))
        if both:
            raise ShapeError(f"layers {both} cannot be both Mamba2 and feed-forward blocks")
        attention = cfg.n_layer - len(cfg.recurrent_layers) - len(cfg.mlp_layers)
        if not cfg.recurrent_layers or attention < 1:   # as every published one; llama.cpp
            raise ShapeError("a nemotron_h needs Mamba2 and attention blocks")  # needs both

    def attends(self, cfg, i):
        return i not in cfg.recurrent_layers and i not in cfg.mlp_layers

    def ropes(self, cfg, i):
        return False

    def layers_alike(self, cfg):
        return False

    def kv_free_layers(self, cfg):
        return tuple(sorted(cfg.recurrent_layers + cfg.mlp_layers))

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg):
        return {INNER_SIZE.format(arch=self.arch): (inner_size(cfg), _T.UINT32),
                Keys.Attention.LAYERNORM_EPS.format(arch=self.arch): (float(cfg.norm_eps),
                                                                      _T.FLOAT32)}

    def kv_free_fields(self, layers, hp):
        # the blocks of no K/V heads but the feed-forward ones are the Mamba2 blocks
        mlp = hp.get("mlp_layers", ())
        return {"recurrent_layers": tuple(i for i in layers if i not in mlp)}

    def read_more_keys(self, f, hp):
        return {"ssm_inner": f.int_key(INNER_SIZE.format(arch=self.arch), minimum=1)}

    # -- tensors ---------------------------------------------------------------------------

    def block_shapes(self, cfg, i):
        e = cfg.n_embd
        if i in cfg.recurrent_layers:
            return {"attn_norm.weight": (e,), **mamba2_shapes(cfg, self.conv_widths(cfg)[i])}
        if i in cfg.mlp_layers:
            return {"attn_norm.weight": (e,), "ffn_down.weight": (e, cfg.n_ff),
                    "ffn_up.weight": (cfg.n_ff, e)}
        return {"attn_norm.weight": (e,), "attn_q.weight": (cfg.q_dim, e),
                "attn_k.weight": (cfg.kv_dim, e), "attn_v.weight": (cfg.kv_dim, e),
                "attn_output.weight": (e, cfg.q_dim)}

    # -- the graph -------------------------------------------------------------------------

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        h = B.rms_norm(cfg, x, p[b + "attn_norm.weight"])
        if i in cfg.recurrent_layers:
            return B.linear(p, b + "ssm_out.weight", mamba2(cfg, p, b, i, h, seq), residual=x)
        if i in cfg.mlp_layers:
            return B.linear(p, b + "ffn_down.weight", relu_squared(p, b, h), residual=x)
        return B.linear(p, b + "attn_output.weight", self.attend(cfg, p, i, h, seq), residual=x)


FAMILY = NemotronH()
