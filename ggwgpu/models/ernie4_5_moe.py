"""ernie4_5-moe (Baidu ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B text; llama.cpp's
src/models/ernie4-5-moe.cpp): ernie4_5's blocks (rope mode normal, an attn_output.bias read
past), each feed-forward after the first leading_dense_block_count a mixture of experts of
expert_feed_forward_length: the router's softmax, the taken experts' weights normalized, a
ranking bias exp_probs_b where the file has one, plus a shared expert
(expert_shared_feed_forward_length, where set) added as it is. llama.cpp's graph puts
experts on every interleave_moe_layer_step-th block, and loads experts on every block past
the dense ones: only a step of 1, as the published models have, makes a model of both."""
from gguf import GGUFValueType, Keys

from ..gguf_file import GGUFError
from .ernie4_5 import Ernie45
from .family import EXPERT_FF, EXPERT_KEYS, SHARED_FF

MOE_STEP = Keys.LLM.INTERLEAVE_MOE_LAYER_STEP


class Ernie45Moe(Ernie45):
    arch = "ernie4_5-moe"
    fusable_qkv = False     # llama.cpp's ernie4_5-moe reads attn_q, attn_k, attn_v only
    experts = True
    shared_expert = "plain"
    keys = {**EXPERT_KEYS, **EXPERT_FF, **SHARED_FF,
            "n_dense_lead": Keys.LLM.LEADING_DENSE_BLOCK_COUNT}
    required = ("n_expert", "n_expert_used", "n_ff_exp")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp

    def more_keys(self, cfg):
        return {MOE_STEP.format(arch=self.arch): (1, GGUFValueType.UINT32)}

    def read_more_keys(self, f, hp):
        key = MOE_STEP.format(arch=self.arch)
        if f.int_key(key) != 1:
            raise GGUFError(f"{f.path}: {key} = {f.meta[key]}: ggwgpu's {self.arch} takes "
                            f"experts on every block past the dense ones (a step of 1)")
        return {"expert_bias": any(n.endswith(".exp_probs_b.bias") for n in f.tensors)}


FAMILY = Ernie45Moe()
