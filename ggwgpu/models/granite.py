"""granite (IBM Granite 3.x dense; llama.cpp's src/models/granite.cpp): llama's block with
the scales of the file: the input embeddings times embedding_scale, each branch (attention,
feed-forward) times residual_scale before its residual add, the scores times
attention.scale, and the logits divided by logit_scale (which llama.cpp requires; the others
are optional, 0 meaning unset)."""
from gguf import Keys

from .family import Family


class Granite(Family):
    arch = "granite"
    reads_rope_freqs = True
    keys = {"embedding_scale": Keys.LLM.EMBEDDING_SCALE,
            "residual_scale": Keys.LLM.RESIDUAL_SCALE,
            "attention_scale": Keys.Attention.SCALE,
            "logit_scale": Keys.LLM.LOGIT_SCALE}
    required = ("logit_scale",)


FAMILY = Granite()
