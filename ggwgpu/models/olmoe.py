"""olmoe (OLMoE-1B-7B; llama.cpp's src/models/olmoe.cpp): llama's pre-norm block with Q and
K RMS-normed over their whole width (olmo2's), neox rope, and each feed-forward a mixture of
experts of n_ff wide experts whose weights are the router's probabilities as they are (not
normalized)."""
from ..tensor import ShapeError
from .family import EXPERT_KEYS
from .olmo2 import Olmo2
from .qwen3moe import Qwen3Moe


class Olmoe(Olmo2):
    arch = "olmoe"
    pre_norms = True
    post_norms = False
    swa_pattern = 0
    experts = True
    expert_norm = False
    keys = EXPERT_KEYS
    required = Qwen3Moe.required

    def check(self, cfg):
        Qwen3Moe.check(self, cfg)
        super().check(cfg)
        if cfg.kv_heads != cfg.n_head:
            raise ShapeError(f"llama.cpp's olmoe norms K over n_embd: it takes no grouped-query "
                             f"attention (n_head_kv {cfg.kv_heads} != n_head {cfg.n_head})")


FAMILY = Olmoe()
