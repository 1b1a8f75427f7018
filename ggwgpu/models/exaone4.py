"""exaone4 (LG EXAONE 4.0 1.2B, 32B; llama.cpp's src/models/exaone4.cpp): olmo2's block (no
norm before either branch, a norm after each before its residual add, SwiGLU) with per-head
Q/K norms before neox rope and Llama 3's rope frequency factors where a file has them. The
64-layer 32B alone has sliding windows (attention.sliding_window, 4096 when absent): three
layers of four attend within it, and only those are roped (the global ones use no
positions, as llama.cpp's graph has it)."""
from gguf import Keys

from ..tensor import ShapeError
from .family import Family

SWA_LAYERS = 64             # llama.cpp windows only the 64-layer model (LLM_TYPE_32B)


class Exaone4(Family):
    arch = "exaone4"
    rope_mode = "neox"
    pre_norms = False
    post_norms = True
    qk_norm = True
    reads_rope_freqs = True
    swa_pattern = 4
    keys = {"sliding_window": Keys.Attention.SLIDING_WINDOW}
    absent = {"sliding_window": 4096}

    def check(self, cfg):
        if cfg.head_dim * cfg.n_head != cfg.n_embd or cfg.rot != cfg.head_dim:
            raise ShapeError(f"llama.cpp's exaone4 takes heads of n_embd / n_head, all "
                             f"rotated: got heads of {cfg.head_dim} ({cfg.rot} rotated) for "
                             f"n_embd {cfg.n_embd} over {cfg.n_head}")

    def local(self, cfg, i: int) -> bool:
        return cfg.n_layer == SWA_LAYERS and super().local(cfg, i)

    def ropes(self, cfg, i: int) -> bool:
        n = self.swa_pattern        # llama.cpp's is_swa(i): the pattern, whatever the window
        return cfg.n_layer != SWA_LAYERS or i % n < n - 1


FAMILY = Exaone4()
