"""gemma3 (Gemma 3 270M .. 27B text; llama.cpp's src/models/gemma3.cpp): the input embedding
times sqrt(n_embd); per-head Q/K norms before neox rope; a norm after each branch
(post_attention_norm, post_ffw_norm) before its residual add; GeGLU with the tanh gelu; the
scores scaled by 1/sqrt(head_dim) (1/sqrt(n_embd / n_head) for the 62-layer 27B); with
attention.sliding_window, five of every six layers (i % 6 < 5) attend only to the last
`sliding_window` positions and rope at rope.freq_base_swa (llama.cpp's default 10000) with
frequency scale 1; logits soft-capped where final_logit_softcapping is set. The converter
stores Gemma's norm weights as 1 + w, so they multiply as they are."""
import math

from gguf import Keys

from . import blocks as B
from .family import Family

SWA_FREQ_BASE = 10000.0     # llama.cpp's rope_freq_base_train_swa when the file has none


class Gemma3(Family):
    arch = "gemma3"
    rope_mode = "neox"
    partial_rope = True
    qk_norm = True
    post_norms = True
    gate = staticmethod(B.geglu)
    swa_pattern = 6           # llama.cpp's default for gemma3: the sixth layer is global
    keys = {"sliding_window": Keys.Attention.SLIDING_WINDOW,
            "rope_freq_base_swa": "{arch}.rope.freq_base_swa",   # (gguf-py 0.17 lacks it)
            "final_logit_softcap": Keys.LLM.FINAL_LOGIT_SOFTCAPPING}

    def rope_params(self, cfg, i):
        if self.local(cfg, i):
            return B.rope_params(cfg, cfg.rope_freq_base_swa or SWA_FREQ_BASE, 1.0)
        return super().rope_params(cfg, i)

    def attention_scale(self, cfg):
        if cfg.n_layer == 62:       # llama.cpp's LLM_TYPE_27B
            return 1.0 / math.sqrt(cfg.n_embd // cfg.n_head)
        return 1.0 / math.sqrt(cfg.head_dim)

    def input_scale(self, cfg):
        return math.sqrt(cfg.n_embd)


FAMILY = Gemma3()
