"""afmoe (Arcee Trinity Nano, Mini, Large; llama.cpp's src/models/afmoe.cpp): the inputs times
sqrt(n_embd); sandwich blocks (a norm before and after each branch: attn_norm,
post_attention_norm, ffn_norm, post_ffw_norm); per-head RMS norms of Q and K before neox
rope, which every fourth layer skips; attention's output times the sigmoid of attn_gate h
before attn_output; with attention.sliding_window, three layers of four within it (at
rope.freq_base_swa where set). The first leading_dense_block_count feed-forwards are SwiGLU,
the others experts of expert_feed_forward_length by the router's sigmoids (the softmax where
expert_gating_func says 1) ranked with exp_probs_b, weights normalized where
expert_weights_norm and times expert_weights_scale, plus expert_shared_count shared experts
as one SwiGLU added as it is."""
import math

from gguf import Keys

from .. import ops as O
from . import blocks as B
from .family import SharedSigmoidExperts, swa_base_rope

NOPE_STEP = 4       # llama.cpp's n_no_rope_layer_step: layer i ropes unless (i + 1) % 4 == 0


class AfMoe(SharedSigmoidExperts):
    arch = "afmoe"
    rope_mode = "neox"
    qk_norm = True
    post_norms = True
    swa_pattern = 4
    keys = {**SharedSigmoidExperts.keys, "sliding_window": Keys.Attention.SLIDING_WINDOW,
            "rope_freq_base_swa": "{arch}.rope.freq_base_swa"}

    def input_scale(self, cfg):
        return math.sqrt(cfg.n_embd)

    def ropes(self, cfg, i):
        return (i + 1) % NOPE_STEP != 0

    def rope_params(self, cfg, i):
        return swa_base_rope(self, cfg, i)

    # -- tensors and graph -----------------------------------------------------------------

    def block_shapes(self, cfg, i):
        return {**super().block_shapes(cfg, i), "attn_gate.weight": (cfg.q_dim, cfg.n_embd)}

    def attend(self, cfg, p, i, h, seq):
        gate = B.linear(p, f"blk.{i}.attn_gate.weight", h)
        return O.mul(super().attend(cfg, p, i, h, seq), O.sigmoid(gate))


FAMILY = AfMoe()
