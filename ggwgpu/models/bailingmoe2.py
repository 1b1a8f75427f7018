"""bailingmoe2 (inclusionAI Ling-mini-2.0, Ling-flash-2.0, Ring-2.0; llama.cpp's
src/models/bailingmoe2.cpp): llama's pre-norm block with Q, K and V from one fused attn_qkv
(no bias), per-head RMS norms of Q and K before neox rope over rope.dimension_count dims
(half the head); the first leading_dense_block_count blocks SwiGLU, the others a mixture of
experts of expert_feed_forward_length gated as expert_gating_func says (the sigmoids in the
published files) and ranked with exp_probs_b where the file has it, weights normalized where
expert_weights_norm and times expert_weights_scale, plus the shared experts' SwiGLU of
(expert_shared_feed_forward_length, else expert_feed_forward_length) x expert_shared_count
rows, as llama.cpp sizes it (written back as one shared expert of that width); an output
matrix of its own. Multi-token-prediction blocks (nextn_predict_layers) are read past."""
from gguf import GGUFValueType as _T, Keys

from ..tensor import ShapeError
from .family import (EXPERT_FF, EXPERT_KEYS, SHARED_FF, Family, fuse_qkv, fused_qkv_heads,
                     past_trunk, read_weights_norm, trunk_layers, weights_norm_key)


class BailingMoe2(Family):
    arch = "bailingmoe2"
    rope_mode = "neox"
    partial_rope = True
    qk_norm = True
    fusable_qkv = False     # always fused (project_qkv)
    needs_output = True
    experts = True
    shared_expert = "plain"
    keys = {**EXPERT_KEYS, **EXPERT_FF, **SHARED_FF,
            "n_dense_lead": Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
            "expert_gating": Keys.LLM.EXPERT_GATING_FUNC,
            "expert_weights_scale": Keys.LLM.EXPERT_WEIGHTS_SCALE}
    required = ("n_expert", "n_expert_used", "n_ff_exp", "expert_gating")

    def check(self, cfg):
        if not (cfg.n_expert and cfg.n_ff_exp) and cfg.n_dense_lead < cfg.n_layer:
            raise ShapeError(f"llama.cpp's {self.arch} needs n_expert and n_ff_exp > 0 "
                             f"(expert_count, expert_feed_forward_length)")
        if cfg.expert_gating not in (1, 2) and cfg.n_dense_lead < cfg.n_layer:
            raise ShapeError(f"llama.cpp's {self.arch} needs its expert_gating_func: 1 "
                             f"(softmax) or 2 (sigmoid), not {cfg.expert_gating}")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp

    def shared_ff(self, cfg):
        return cfg.n_ff_shexp or cfg.n_ff_exp

    def normalizes(self, cfg):
        return cfg.expert_weights_norm

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg):
        return {Keys.LLM.EXPERT_SHARED_COUNT.format(arch=self.arch): (1, _T.UINT32),
                **weights_norm_key(self.arch, cfg)}

    def read_more_keys(self, f, hp):
        shared = f.int_key(Keys.LLM.EXPERT_SHARED_COUNT.format(arch=self.arch), minimum=1)
        return {"n_ff_shexp": (hp["n_ff_shexp"] or hp["n_ff_exp"]) * shared,
                "expert_bias": any(n.endswith(".exp_probs_b.bias") for n in f.tensors),
                **read_weights_norm(f, self.arch),
                "n_layer": trunk_layers(f, self.arch, hp["n_layer"])}

    def ignored(self, cfg, name):
        return past_trunk(cfg, name)

    # -- tensors and graph -----------------------------------------------------------------

    def block_shapes(self, cfg, i):
        return fuse_qkv(super().block_shapes(cfg, i))

    def project_qkv(self, cfg, p, b, h, lead):
        return fused_qkv_heads(cfg, p, b, h, lead, bias=False)


FAMILY = BailingMoe2()
