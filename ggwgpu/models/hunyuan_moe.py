"""hunyuan-moe (Tencent Hunyuan-A13B; llama.cpp's src/models/hunyuan-moe.cpp): hunyuan-dense's
attention (neox rope, per-head RMS norms of Q and K after it), then a mixture of n_ff wide
experts by the router's softmax, weights normalized, plus a shared expert of
expert_shared_feed_forward_length (else n_ff) added as it is. llama.cpp requires
expert_feed_forward_length and sizes the experts by n_ff; it reads no rope.scaling.alpha
for the arch (the converter folds it into the base), and neither does ggwgpu."""
from ..tensor import ShapeError
from .family import EXPERT_FF, EXPERT_KEYS, SHARED_FF
from .hunyuan_dense import HunyuanDense


class HunyuanMoe(HunyuanDense):
    arch = "hunyuan-moe"
    fusable_qkv = True
    experts = True
    shared_expert = "plain"
    keys = {**EXPERT_KEYS, **EXPERT_FF, **SHARED_FF}
    required = (*EXPERT_KEYS, *EXPERT_FF)

    def check(self, cfg):
        if not cfg.n_expert:
            raise ShapeError("llama.cpp's hunyuan-moe needs n_expert > 0 (expert_count)")
        super().check(cfg)

    def shared_ff(self, cfg):
        return cfg.n_ff_shexp or cfg.n_ff

    def read_more_keys(self, f, hp):
        return {}


FAMILY = HunyuanMoe()
