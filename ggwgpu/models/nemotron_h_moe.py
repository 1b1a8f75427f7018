"""nemotron_h_moe (NVIDIA Nemotron 3 Nano 30B-A3B; llama.cpp's src/models/nemotron-h.cpp, the
graph nemotron_h shares): nemotron_h's single-mixer blocks, each feed-forward block a
mixture of experts without gates: the router's sigmoids (always, whatever the file's
expert_gating_func), ranked with exp_probs_b, take expert_used_count experts of
ffn_down_exps(relu(ffn_up_exps h)^2), weighted (normalized where expert_weights_norm, times
expert_weights_scale), plus one shared expert of the same form
(expert_shared_feed_forward_length). Nemotron 3 Super's latent experts (moe_latent_size),
grouped routing and multi-token-prediction blocks are refused by name."""
from gguf import Keys

from .. import ops as O
from ..gguf_file import GGUFError
from . import blocks as B
from .arcee import squared_relu
from .family import (EXPERT_FF, EXPERT_KEYS, NEXTN, SHARED_FF, read_weights_norm,
                     refuse_expert_groups, weights_norm_key)
from .nemotron_h import NemotronH

LATENT = "latent experts (Nemotron 3 Super's moe_latent_size)"
LATENT_SIZE = "{arch}.moe_latent_size"


class NemotronHMoe(NemotronH):
    arch = "nemotron_h_moe"
    fusable_qkv = False     # llama.cpp's nemotron_h_moe reads attn_q, attn_k, attn_v only
    experts = True
    selection_bias = True
    shared_expert = "plain"
    keys = {**NemotronH.keys, **EXPERT_KEYS, **EXPERT_FF, **SHARED_FF,
            "expert_weights_scale": Keys.LLM.EXPERT_WEIGHTS_SCALE}
    required = ("n_expert", "n_expert_used", "n_ff_shexp")
    unsupported = {"attn_output.bias": "an attention output bias",
                   "ffn_up.bias": "feed-forward biases", "ffn_down.bias": "feed-forward biases",
                   "ffn_latent_down.weight": LATENT, "ffn_latent_up.weight": LATENT}

    def expert_ff(self, cfg):
        return cfg.n_ff_exp or cfg.n_ff // cfg.n_expert_used

    def normalizes(self, cfg):
        return cfg.expert_weights_norm

    def more_keys(self, cfg):
        return {**super().more_keys(cfg), **weights_norm_key(self.arch, cfg)}

    def read_more_keys(self, f, hp):
        def key(template):
            return template.format(arch=self.arch)
        refuse_expert_groups(f, self.arch)
        if f.int_key(key(NEXTN), default=0, minimum=0):
            raise GGUFError(f"{f.path}: {key(NEXTN)}: ggwgpu's {self.arch} does not read "
                            f"multi-token-prediction blocks")
        if f.int_key(key(LATENT_SIZE), default=0, minimum=0):
            raise GGUFError(f"{f.path}: {key(LATENT_SIZE)}: ggwgpu's {self.arch} has no "
                            f"{LATENT}")
        return {**super().read_more_keys(f, hp), **read_weights_norm(f, self.arch)}

    def block_shapes(self, cfg, i):
        if i not in cfg.mlp_layers:
            return super().block_shapes(cfg, i)
        e, n, x, s = cfg.n_embd, cfg.n_expert, self.expert_ff(cfg), cfg.n_ff_shexp
        return {"attn_norm.weight": (e,), "ffn_gate_inp.weight": (n, e),
                "exp_probs_b.bias": (n,), "ffn_down_exps.weight": (n, e, x),
                "ffn_up_exps.weight": (n, x, e), "ffn_down_shexp.weight": (e, s),
                "ffn_up_shexp.weight": (s, e)}

    def block(self, cfg, p, i, x, seq):
        if i not in cfg.mlp_layers:
            return super().block(cfg, p, i, x, seq)
        b = f"blk.{i}."
        h = B.rms_norm(cfg, x, p[b + "attn_norm.weight"])
        routed = B.experts(cfg, p, b, h, self.normalizes(cfg), act=squared_relu,
                           gating="sigmoid", scale=cfg.expert_weights_scale)
        shared = squared_relu(B.linear(p, b + "ffn_up_shexp.weight", h))
        return B.linear(p, b + "ffn_down_shexp.weight", shared, residual=O.add(x, routed))


FAMILY = NemotronHMoe()
