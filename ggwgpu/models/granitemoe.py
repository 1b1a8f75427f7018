"""granitemoe (IBM Granite 3.0/3.1 1B-A400M and 3B-A800M; llama.cpp's
src/models/granite-moe.cpp, which builds granite's graph): granite's block and scales with a
mixture of experts for each feed-forward (models.granite)."""
from .granite import Granite


class GraniteMoe(Granite):
    arch = "granitemoe"


FAMILY = GraniteMoe()
