"""gemma2 (Gemma 2 2B, 9B, 27B; llama.cpp's src/models/gemma2.cpp): Gemma 3's block (input
embedding times sqrt(n_embd), a norm after each branch, GeGLU with the tanh gelu, neox
rope) without Q/K norms, with the attention scores soft-capped, c * tanh(s / c) before the
softmax (attn_logit_softcapping, llama.cpp's 50 when the file has none), the logits
likewise (final_logit_softcapping, 30), and every other layer (the even ones, llama.cpp's
pattern 2) attending only to the last `sliding_window` positions (4096 when the file has
none), roped at rope.freq_base_swa (default: the global base) with the global scale. The
scores are scaled by 1/sqrt(head_dim) (1/sqrt(n_embd / n_head) for the 46-layer 27B)."""
import math

from gguf import Keys

from . import blocks as B
from .gemma3 import Gemma3


class Gemma2(Gemma3):
    arch = "gemma2"
    qk_norm = False
    swa_pattern = 2           # llama.cpp's for gemma2: the odd layers are global
    keys = {"sliding_window": Keys.Attention.SLIDING_WINDOW,
            "rope_freq_base_swa": "{arch}.rope.freq_base_swa",
            "attn_logit_softcap": Keys.LLM.ATTN_LOGIT_SOFTCAPPING,
            "final_logit_softcap": Keys.LLM.FINAL_LOGIT_SOFTCAPPING}
    # llama.cpp's values when a file has no such key (a 0 is written as unset)
    absent = {"sliding_window": 4096, "attn_logit_softcap": 50.0, "final_logit_softcap": 30.0}

    def rope_params(self, cfg, i):
        if self.local(cfg, i):
            return B.rope_params(cfg, cfg.rope_freq_base_swa or cfg.rope_freq_base,
                                 cfg.rope_freq_scale)
        return super().rope_params(cfg, i)

    def attention_scale(self, cfg):
        if cfg.n_layer == 46:       # llama.cpp's LLM_TYPE_27B
            return 1.0 / math.sqrt(cfg.n_embd // cfg.n_head)
        return 1.0 / math.sqrt(cfg.head_dim)


FAMILY = Gemma2()
