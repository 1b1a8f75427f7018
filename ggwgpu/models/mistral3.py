"""mistral3 (Ministral 3 3B .. 14B, Mistral Small 3.x: the text model; llama.cpp's
src/models/mistral3.cpp): llama's block, rope mode normal, Llama 3's rope frequency factors
where a file has them. Ministral 3's files add YaRN with its own ramp (rope.scaling.
yarn_beta_fast / yarn_beta_slow) and attn_factor (rope.scaling.yarn_log_multiplier:
transformers' mscale_all_dim), and Llama 4's attention temperature
(attention.temperature_scale): Q times ln(floor(pos / original context) + 1) * scale + 1,
which is 1 below the original context (rope.scaling.original_context_length, the trained
context when absent). Heads may be wider than n_embd / n_head; all their dims are roped.
Biases and mixture-of-experts blocks (llama.cpp loads them for this arch; the published
dense models have none) are refused by name."""
from ..tensor import ShapeError
from .family import Family

MOE = "mixture-of-experts blocks"


class Mistral3(Family):
    arch = "mistral3"
    reads_rope_freqs = True
    # (gguf-py 0.17 lacks these keys)
    keys = {"yarn_beta_fast": "{arch}.rope.scaling.yarn_beta_fast",
            "yarn_beta_slow": "{arch}.rope.scaling.yarn_beta_slow",
            "yarn_log_mul": "{arch}.rope.scaling.yarn_log_multiplier",
            "attn_temp_scale": "{arch}.attention.temperature_scale"}
    unsupported = {"attn_output.bias": "an attention output bias",
                   "ffn_gate.bias": "feed-forward biases", "ffn_up.bias": "feed-forward biases",
                   "ffn_down.bias": "feed-forward biases", "ffn_gate_inp.weight": MOE,
                   "ffn_down_exps.weight": MOE}

    def check(self, cfg):
        if cfg.rot != cfg.head_dim:
            raise ShapeError(f"llama.cpp's mistral3 ropes every dim of a head: n_rot {cfg.rot} "
                             f"differs from the head size {cfg.head_dim}")

    def read_more_keys(self, f, hp):
        # llama.cpp's attention temperature counts in n_ctx_orig_yarn, the trained context
        # when the file has no original one
        if hp["attn_temp_scale"] and not hp["rope_orig_ctx"]:
            return {"rope_orig_ctx": hp["n_ctx"]}
        return {}


FAMILY = Mistral3()
