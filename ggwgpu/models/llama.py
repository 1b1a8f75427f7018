"""llama (llama.cpp's src/models/llama.cpp): the base block of models.family as it is, with
grouped-query attention, tied embeddings and Llama 3's rope frequency factors where a file
has them; rope mode normal (adjacent pairs), as llama.cpp's converter stores Q and K. Also
the model of train-text-from-scratch and of `ggwgpu train`. A file with expert_count is a
mixture of experts (Mixtral's: blocks.experts, the taken experts' weights normalized), as
llama.cpp's llama graph reads it."""
from .family import EXPERT_KEYS, Family


class Llama(Family):
    arch = "llama"
    reads_rope_freqs = True
    experts = True
    keys = EXPERT_KEYS


FAMILY = Llama()
