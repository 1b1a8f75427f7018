"""lfm2moe (Liquid LFM2-8B-A1B, LFM2-24B-A2B; llama.cpp's src/models/lfm2moe.cpp): lfm2's
blocks (short convolutions and attention), each feed-forward after the first
leading_dense_block_count a mixture of experts of expert_feed_forward_length: the router's
sigmoids (expert_gating_func 2) as the experts' probabilities, the experts ranked with each
block's balancing bias exp_probs_b.bias added (which only ranks them, and which training
leaves as it is), the taken ones' weights normalized."""
from gguf import Keys

from .family import EXPERT_FF, EXPERT_KEYS
from .lfm2 import LFM2


class LFM2Moe(LFM2):
    arch = "lfm2moe"
    experts = True
    selection_bias = True
    keys = {**LFM2.keys, **EXPERT_KEYS, **EXPERT_FF,
            "expert_gating": Keys.LLM.EXPERT_GATING_FUNC,
            "n_dense_lead": Keys.LLM.LEADING_DENSE_BLOCK_COUNT}
    required = (*LFM2.required, "n_expert", "n_expert_used", "n_ff_exp", "expert_gating")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp


FAMILY = LFM2Moe()
