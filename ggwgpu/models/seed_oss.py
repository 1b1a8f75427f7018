"""seed_oss (ByteDance Seed-OSS-36B; llama.cpp's src/models/seed-oss.cpp): llama's pre-norm
block with neox rope, biases on Q, K and V where the file has them, and the feed-forward's
norm named post_attention_norm (glm4moe's name); embeddings tied where the file has no
output.weight."""
from .family import Family, qkv_bias_of


class SeedOss(Family):
    arch = "seed_oss"
    rope_mode = "neox"
    ffn_norm = "post_attention_norm.weight"

    def read_more_keys(self, f, hp):
        return {"qkv_bias": qkv_bias_of(f)}


FAMILY = SeedOss()
