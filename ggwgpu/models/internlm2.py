"""internlm2 (Shanghai AI Lab InternLM2 and InternLM2.5 1.8B .. 20B; llama.cpp's
src/models/internlm2.cpp): llama's block as it is, rope mode normal, with an output matrix of
its own (llama.cpp requires it: never tied). The converter splits the checkpoints' fused
wqkv into attn_q, attn_k and attn_v."""
from .family import Family


class InternLM2(Family):
    arch = "internlm2"
    needs_output = True


FAMILY = InternLM2()
