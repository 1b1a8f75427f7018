"""minicpm (MiniCPM 1B, 2B, MiniCPM4 0.5B, 8B; llama.cpp's src/models/minicpm.cpp, which
computes granite's graph): llama's block with granite's scales, read as llama.cpp reads them:
the input embeddings times embedding_scale (12 when the file has none), each branch times
residual_scale (1.4 / sqrt(n_layer)) and the logits divided by logit_scale (n_embd / 256);
the scores take 1/sqrt(head_dim). LongRoPE where a file has rope_factors_long/short.weight
(rope.scaling.type "longrope"): the long factors past the original context (the trained one
when absent), else the short ones; or Llama 3's rope frequency factors. Biases and
mixture-of-experts blocks are refused by name."""
import math

from gguf import GGUFValueType, Keys

from .granite import Granite

MOE = "mixture-of-experts blocks"
SCALES = {"embedding_scale": Keys.LLM.EMBEDDING_SCALE,
          "residual_scale": Keys.LLM.RESIDUAL_SCALE,
          "logit_scale": Keys.LLM.LOGIT_SCALE}


def absent_scales(n_layer: int, n_embd: int) -> dict:
    """llama.cpp's scales of a file that has none of the keys (older MiniCPM files)."""
    return {"embedding_scale": 12.0, "residual_scale": 1.4 / math.sqrt(n_layer),
            "logit_scale": n_embd / 256.0}


class MiniCPM(Granite):
    arch = "minicpm"
    reads_longrope = True
    experts = False
    # the scales' keys: read with llama.cpp's defaults, which depend on the model's size,
    # and always written (read_more_keys, more_keys), so llama.cpp never takes a default
    keys = {}
    required = ()
    unsupported = {"attn_output.bias": "an attention output bias",
                   "ffn_gate.bias": "feed-forward biases", "ffn_up.bias": "feed-forward biases",
                   "ffn_down.bias": "feed-forward biases", "ffn_gate_inp.weight": MOE,
                   "ffn_down_exps.weight": MOE}

    def more_keys(self, cfg):
        return {key.format(arch=self.arch): (float(getattr(cfg, field)), GGUFValueType.FLOAT32)
                for field, key in SCALES.items()}

    def read_more_keys(self, f, hp):
        defaults = absent_scales(hp["n_layer"], hp["n_embd"])
        return {field: f.float_key(key.format(arch=self.arch), default=defaults[field])
                for field, key in SCALES.items()}


FAMILY = MiniCPM()
