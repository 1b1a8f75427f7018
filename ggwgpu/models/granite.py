"""granite (IBM Granite 3.x dense; llama.cpp's src/models/granite.cpp): llama's block with
the scales of the file: the input embeddings times embedding_scale, each branch (attention,
feed-forward) times residual_scale before its residual add, the scores times
attention.scale, and the logits divided by logit_scale (which llama.cpp requires; the others
are optional, 0 meaning unset). A file with expert_count is a mixture of experts (granitemoe's
block, which llama.cpp's granite graph builds as well): n_ff wide experts, their weights
normalized, and where expert_shared_feed_forward_length is set a shared expert added as it
is, the sum times residual_scale."""
from gguf import Keys

from .family import EXPERT_KEYS, SHARED_FF, Family


class Granite(Family):
    arch = "granite"
    reads_rope_freqs = True
    experts = True
    shared_expert = "plain"
    keys = {"embedding_scale": Keys.LLM.EMBEDDING_SCALE,
            "residual_scale": Keys.LLM.RESIDUAL_SCALE,
            "attention_scale": Keys.Attention.SCALE,
            "logit_scale": Keys.LLM.LOGIT_SCALE, **EXPERT_KEYS, **SHARED_FF}
    required = ("logit_scale",)



FAMILY = Granite()
