"""qwen3 (Qwen3 0.6B .. 32B dense; llama.cpp's src/models/qwen3.cpp): llama's block with
each head of Q and K RMS-normed (attn_q_norm, attn_k_norm, head_dim weights) before neox
rope; no biases; heads often wider than n_embd / n_head (attention.key_length)."""
from .family import Family


class Qwen3(Family):
    arch = "qwen3"
    rope_mode = "neox"
    qk_norm = True


FAMILY = Qwen3()
