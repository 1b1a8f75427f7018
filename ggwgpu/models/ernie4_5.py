"""ernie4_5 (Baidu ERNIE 4.5 0.3B, the dense text model; llama.cpp's src/models/ernie4-5.cpp):
llama's block, rope mode normal, without Llama 3's frequency factors. Heads may be wider
than n_embd / n_head (the 0.3B's are 128 over an n_embd of 1024 with 16 heads). An
attn_output.bias, which llama.cpp loads where a file has one and never adds, is read past."""
import re

from .family import Family


class Ernie45(Family):
    arch = "ernie4_5"

    def ignored(self, cfg, name):
        return re.fullmatch(r"blk\.\d+\.attn_output\.bias", name) is not None


FAMILY = Ernie45()
