"""smollm3 (SmolLM3-3B; llama.cpp's src/models/smollm3.cpp): llama's block, but every fourth
layer ((i + 1) % 4 == 0, a step llama.cpp fixes at 4) has no rope (NoPE)."""
from .family import Family

NO_ROPE_STEP = 4


class SmolLM3(Family):
    arch = "smollm3"

    def ropes(self, cfg, i):
        return (i + 1) % NO_ROPE_STEP != 0


FAMILY = SmolLM3()
