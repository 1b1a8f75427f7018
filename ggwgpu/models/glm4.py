"""glm4 (GLM-4-9B-0414, GLM-Z1-9B, GLM-4-32B-0414; llama.cpp's src/models/glm4.cpp): llama's
block with biases on the Q, K and V products, a norm after each branch as well as before
(post_attention_norm, post_ffw_norm), the feed-forward's gate and up as one product (ffn_up,
rows gate | up: silu(gate) * up), and rope mode normal over the first rope.dimension_count
dims of each head (half of them in the published models). Files with M-RoPE sections
(GLM-4.1V) or multi-token-prediction blocks are refused."""
from ..gguf_file import GGUFError
from .family import NEXTN, Family
from .phi3 import fused_gate

SECTIONS = "{arch}.rope.dimension_sections"


class Glm4(Family):
    arch = "glm4"
    qkv_bias = True
    post_norms = True
    partial_rope = True
    gate = staticmethod(fused_gate)

    def block_shapes(self, cfg, i):
        shapes = super().block_shapes(cfg, i)
        del shapes["ffn_gate.weight"]
        shapes["ffn_up.weight"] = (2 * cfg.n_ff, cfg.n_embd)
        return shapes

    def read_more_keys(self, f, hp):
        sections = f.meta.get(SECTIONS.format(arch=self.arch))
        if isinstance(sections, list) and any(sections):
            raise GGUFError(f"{f.path}: {SECTIONS.format(arch=self.arch)} = {sections}: "
                            f"ggwgpu's glm4 has no M-RoPE (the vision models' rope)")
        if f.int_key(NEXTN.format(arch=self.arch), default=0, minimum=0):
            raise GGUFError(f"{f.path}: {NEXTN.format(arch=self.arch)}: ggwgpu's glm4 does not "
                            f"read multi-token-prediction blocks")
        return {}


FAMILY = Glm4()
