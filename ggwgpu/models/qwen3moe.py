"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B; llama.cpp's
src/models/qwen3moe.cpp): qwen3's attention, each block's feed-forward a mixture of experts
(blocks.experts): a softmax router over expert_count experts, each token through the
expert_used_count most probable, their outputs weighted by their probabilities divided by
the sum of those. An expert's width is expert_feed_forward_length (else n_ff over the
experts a token takes, as llama.cpp falls back)."""
from ..tensor import ShapeError
from .family import EXPERT_FF, EXPERT_KEYS
from .qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    arch = "qwen3moe"
    experts = True
    keys = {**EXPERT_KEYS, **EXPERT_FF}
    required = ("n_expert", "n_expert_used")

    def check(self, cfg):
        if not cfg.n_expert:
            raise ShapeError(f"llama.cpp's {self.arch} needs n_expert > 0 (expert_count)")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp or cfg.n_ff // cfg.n_expert_used


FAMILY = Qwen3Moe()
