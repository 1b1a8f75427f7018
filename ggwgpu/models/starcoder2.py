"""starcoder2 (StarCoder2 3B, 7B, 15B; llama.cpp's src/models/starcoder2.cpp): phi2's
LayerNorm blocks with biases (models.phi2), one branch after the other: x + attention(attn_norm
x), then + ffn_down(gelu(ffn_up h)) on its own LayerNorm h = ffn_norm(x); grouped-query
attention, neox rope over the whole head, no bias on the logits, embeddings tied where the
file has no output.weight."""
from .phi2 import Phi2


class StarCoder2(Phi2):
    arch = "starcoder2"
    partial_rope = False
    parallel = False
    output_bias = False


FAMILY = StarCoder2()
