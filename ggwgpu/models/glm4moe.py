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
from .family import SharedSigmoidExperts, past_trunk, qkv_bias_of, trunk_layers


class Glm4Moe(SharedSigmoidExperts):
    arch = "glm4moe"
    rope_mode = "neox"
    partial_rope = True
    ffn_norm = "post_attention_norm.weight"

    def read_more_keys(self, f, hp):
        sections = Keys.Rope.DIMENSION_SECTIONS.format(arch=self.arch)
        if any(f.meta.get(sections) or ()):
            raise GGUFError(f"{f.path}: {sections}: ggwgpu's {self.arch} has no M-RoPE (the "
                            f"vision models')")
        return {**super().read_more_keys(f, hp), "qkv_bias": qkv_bias_of(f),
                "qk_norm": "blk.0.attn_q_norm.weight" in f.tensors,
                "n_layer": trunk_layers(f, self.arch, hp["n_layer"])}

    def ignored(self, cfg, name):
        return past_trunk(cfg, name)


FAMILY = Glm4Moe()
