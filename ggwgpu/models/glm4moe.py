"""glm4moe (Z.ai GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7 and the other models llama.cpp's
converter writes as glm4moe; llama.cpp's src/models/glm4-moe.cpp): llama's pre-norm block
with Q/K/V biases and per-head QK norms where the file has them (GLM-4.5's, not the Air's),
neox rope over rope.dimension_count dims (half the head), and the feed-forward's norm named
post_attention_norm. The first leading_dense_block_count blocks are SwiGLU; the others a
mixture of experts of expert_feed_forward_length, chosen by the router's sigmoids (softmax
where expert_gating_func says 1) ranked with each block's exp_probs_b, weights normalized
where expert_weights_norm and times expert_weights_scale, plus expert_shared_count shared
experts as one SwiGLU added as it is. Multi-token-prediction blocks (nextn_predict_layers,
after the others) are read past, as llama.cpp's main graph does; M-RoPE files (GLM-4.5V's
rope.dimension_sections) are refused."""
from gguf import Keys

from ..gguf_file import GGUFError
from ..tensor import ShapeError
from .family import (EXPERT_FF, EXPERT_KEYS, Family, past_trunk, qkv_bias_of,
                     read_shared_count, read_weights_norm, shared_count_key, trunk_layers,
                     weights_norm_key)


class Glm4Moe(Family):
    arch = "glm4moe"
    rope_mode = "neox"
    partial_rope = True
    experts = True
    shared_expert = "plain"
    selection_bias = True
    ffn_norm = "post_attention_norm.weight"
    keys = {**EXPERT_KEYS, **EXPERT_FF, "n_dense_lead": Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
            "expert_gating": Keys.LLM.EXPERT_GATING_FUNC,
            "expert_weights_scale": Keys.LLM.EXPERT_WEIGHTS_SCALE}
    required = ("n_expert", "n_expert_used", "n_ff_exp")

    def check(self, cfg):
        if not (cfg.n_expert and cfg.n_ff_exp) and cfg.n_dense_lead < cfg.n_layer:
            raise ShapeError(f"llama.cpp's {self.arch} needs n_expert and n_ff_exp > 0 "
                             f"(expert_count, expert_feed_forward_length) past its "
                             f"{cfg.n_dense_lead} dense blocks")
        if cfg.n_ff_exp and cfg.n_ff_shexp % cfg.n_ff_exp:
            raise ShapeError(f"{self.arch}'s shared experts are expert_shared_count experts' "
                             f"width: n_ff_shexp {cfg.n_ff_shexp} is no multiple of n_ff_exp "
                             f"{cfg.n_ff_exp}")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp

    def normalizes(self, cfg):
        return cfg.expert_weights_norm

    def expert_gating(self, cfg):
        return "softmax" if cfg.expert_gating == 1 else "sigmoid"   # sigmoid when unset

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg):
        return {**shared_count_key(self.arch, cfg), **weights_norm_key(self.arch, cfg)}

    def read_more_keys(self, f, hp):
        sections = Keys.Rope.DIMENSION_SECTIONS.format(arch=self.arch)
        if any(f.meta.get(sections) or ()):
            raise GGUFError(f"{f.path}: {sections}: ggwgpu's {self.arch} has no M-RoPE (the "
                            f"vision models')")
        return {**read_shared_count(f, self.arch, hp), **read_weights_norm(f, self.arch),
                "qkv_bias": qkv_bias_of(f),
                "qk_norm": "blk.0.attn_q_norm.weight" in f.tensors,
                "n_layer": trunk_layers(f, self.arch, hp["n_layer"])}

    def ignored(self, cfg, name):
        return past_trunk(cfg, name)


FAMILY = Glm4Moe()
