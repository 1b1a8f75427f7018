"""arcee (Arcee's AFM-4.5B; llama.cpp's src/models/arcee.cpp): llama's block with a
feed-forward of no gate, ffn_down(relu(ffn_up h)^2), Llama 3's rope frequency factors where a
file has them; rope mode normal (the converter stores Q and K as llama's)."""
from .. import ops as O
from . import blocks as B
from .family import Family


def squared_relu(x):
    """relu(x)^2 (llama.cpp's LLM_FFN_RELU_SQR)."""
    return O.sqr(O.relu(x))


def relu_squared(p: dict, b: str, h):
    """AFM's feed-forward before ffn_down: relu(ffn_up h)^2."""
    return squared_relu(B.linear(p, b + "ffn_up.weight", h))


class Arcee(Family):
    arch = "arcee"
    reads_rope_freqs = True
    gate = staticmethod(relu_squared)

    def block_shapes(self, cfg, i):
        shapes = super().block_shapes(cfg, i)
        del shapes["ffn_gate.weight"]
        return shapes


FAMILY = Arcee()
