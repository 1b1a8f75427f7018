"""cohere2 (Cohere Command R7B 12-2024 and its Arabic model; llama.cpp's
src/models/cohere2.cpp): command-r's parallel blocks, three of every four layers (i % 4 < 3)
within attention.sliding_window and roped, the fourth global without rope (NoPE);
logit_scale is required."""
from gguf import Keys

from .command_r import CommandR


class Cohere2(CommandR):
    arch = "cohere2"
    swa_pattern = 4
    keys = {**CommandR.keys, "sliding_window": Keys.Attention.SLIDING_WINDOW}
    required = ("logit_scale", "sliding_window")
    unsupported = {}

    def ropes(self, cfg, i):
        return self.local(cfg, i)


FAMILY = Cohere2()
