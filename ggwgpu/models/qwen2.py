"""qwen2 (Qwen2, Qwen2.5; llama.cpp's src/models/qwen2.cpp): llama's block with biases on the
Q, K and V products (added before rope) and neox rope."""
from .family import Family


class Qwen2(Family):
    arch = "qwen2"
    rope_mode = "neox"
    qkv_bias = True


FAMILY = Qwen2()
