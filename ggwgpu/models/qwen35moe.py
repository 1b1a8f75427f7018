"""qwen35moe (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B; llama.cpp's src/models/qwen35moe.cpp):
qwen35's blocks (gated delta-nets and gated attention), each feed-forward a mixture of
experts of expert_feed_forward_length (else n_ff over the experts a token takes), their
weights normalized, plus a shared expert of expert_shared_feed_forward_length (else n_ff)
times the sigmoid of its gate ffn_gate_inp_shexp, as qwen2moe's."""
from .family import EXPERT_FF, EXPERT_KEYS, SHARED_FF
from .qwen35 import Qwen35
from .qwen3moe import Qwen3Moe


class Qwen35Moe(Qwen35):
    arch = "qwen35moe"
    experts = True
    shared_expert = "gated"
    keys = {**Qwen35.keys, **EXPERT_KEYS, **EXPERT_FF, **SHARED_FF}
    required = (*Qwen35.required, *Qwen3Moe.required)
    expert_ff = Qwen3Moe.expert_ff

    def check(self, cfg):
        Qwen3Moe.check(self, cfg)
        super().check(cfg)


FAMILY = Qwen35Moe()
