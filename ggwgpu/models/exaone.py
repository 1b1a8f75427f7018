"""exaone (LG EXAONE 3.0 7.8B, EXAONE 3.5 2.4B .. 32B, EXAONE Deep; llama.cpp's
src/models/exaone.cpp): llama's block with neox rope over the whole head and Llama 3's
rope_freqs where a file has them; embeddings tied where the file has no output.weight."""
from .family import Family


class Exaone(Family):
    arch = "exaone"
    rope_mode = "neox"
    reads_rope_freqs = True


FAMILY = Exaone()
