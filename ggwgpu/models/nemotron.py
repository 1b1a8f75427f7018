"""nemotron (NVIDIA Minitron 4B and 8B, Nemotron-Mini-4B; llama.cpp's src/models/nemotron.cpp):
stablelm's LayerNorm pre-norm blocks (weight and bias; the converter adds layernorm1p's one
to the weights) with a feed-forward of no gate, ffn_down(relu(ffn_up h)^2); no biases on the
products, partial neox rope (rope.dimension_count of the head), the final LayerNorm with its
bias, an untied output matrix. Biases on the attention output and the feed-forward, which
llama.cpp reads where a file has them, are refused by name."""
from .arcee import relu_squared
from .stablelm import StableLM

BIASES = "biases on the attention output and the feed-forward"


class Nemotron(StableLM):
    arch = "nemotron"
    gate = staticmethod(relu_squared)
    unsupported = dict.fromkeys(("attn_output.bias", "ffn_up.bias", "ffn_down.bias"), BIASES)

    def block_shapes(self, cfg, i):
        shapes = super().block_shapes(cfg, i)
        del shapes["ffn_gate.weight"]
        return shapes


FAMILY = Nemotron()
