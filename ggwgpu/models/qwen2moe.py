"""qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; llama.cpp's src/models/qwen2moe.cpp):
qwen2's attention (Q, K, V biases), each block's feed-forward a mixture of experts whose
weights are the router's probabilities as they are (not normalized), plus a shared expert,
a SwiGLU of expert_shared_feed_forward_length (else n_ff) every token takes, times the
sigmoid of its gate ffn_gate_inp_shexp (one value per token)."""
from .family import EXPERT_FF, EXPERT_KEYS, SHARED_FF
from .qwen2 import Qwen2
from .qwen3moe import Qwen3Moe


class Qwen2Moe(Qwen2):
    arch = "qwen2moe"
    experts = True
    expert_norm = False
    shared_expert = "gated"
    keys = {**EXPERT_KEYS, **EXPERT_FF, **SHARED_FF}
    required = Qwen3Moe.required
    check = Qwen3Moe.check
    expert_ff = Qwen3Moe.expert_ff


FAMILY = Qwen2Moe()
