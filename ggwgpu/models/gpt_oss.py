"""gpt-oss (OpenAI gpt-oss-20b, gpt-oss-120b; llama.cpp's src/models/openai-moe.cpp): llama's
pre-norm blocks with Q/K/V and output biases, neox rope (YaRN in the published files), every
other layer (the even ones) within attention.sliding_window, and attention sinks: each head's
learned logit attn_sinks takes its share of every softmax and passes on nothing. The
feed-forward, on the block's post_attention_norm (llama.cpp's attn_post_norm, the norm
before it), is a mixture of experts with biases everywhere: the router's (ffn_gate_inp.bias)
logits pick the expert_used_count largest, whose weights are the softmax of those logits
alone (llama.cpp's SOFTMAX_WEIGHT); each expert is ffn_down(swiglu_oai(ffn_gate x + b,
ffn_up x + b)) + b, the gate clipped at 7 (ggml_swiglu_oai). The published files keep the
experts in MXFP4."""
from gguf import Keys

from .. import ops as O
from ..tensor import ShapeError
from . import blocks as B
from .family import EXPERT_FF, EXPERT_KEYS, Family, swa_base_rope

SINKS = "attn_sinks.weight"


class GptOss(Family):
    arch = "gpt-oss"
    rope_mode = "neox"
    qkv_bias = True
    swa_pattern = 2           # llama.cpp's load_swa_pattern(ml, 2): even layers windowed
    attention_sinks = True
    experts = True
    expert_norm = False
    keys = {**EXPERT_KEYS, **EXPERT_FF, "sliding_window": Keys.Attention.SLIDING_WINDOW,
            "rope_freq_base_swa": "{arch}.rope.freq_base_swa"}
    required = ("n_expert", "n_expert_used", "n_ff_exp", "sliding_window")

    def check(self, cfg):
        if not cfg.n_expert:
            raise ShapeError(f"llama.cpp's {self.arch} needs n_expert > 0 (expert_count)")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp or cfg.n_ff

    def block_shapes(self, cfg, i):
        e, q, kv, n, x = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_expert, self.expert_ff(cfg)
        return {"attn_norm.weight": (e,), "attn_q.weight": (q, e), "attn_q.bias": (q,),
                "attn_k.weight": (kv, e), "attn_k.bias": (kv,), "attn_v.weight": (kv, e),
                "attn_v.bias": (kv,), "attn_output.weight": (e, q), "attn_output.bias": (e,),
                SINKS: (cfg.n_head,), "post_attention_norm.weight": (e,),
                "ffn_gate_inp.weight": (n, e), "ffn_gate_inp.bias": (n,),
                "ffn_gate_exps.weight": (n, x, e), "ffn_gate_exps.bias": (n, x),
                "ffn_down_exps.weight": (n, e, x), "ffn_down_exps.bias": (n, e),
                "ffn_up_exps.weight": (n, x, e), "ffn_up_exps.bias": (n, x)}

    def initial(self, name):
        return 0.0 if name.endswith(SINKS) else super().initial(name)

    def rope_params(self, cfg, i):
        return swa_base_rope(self, cfg, i)

    def mix(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        att = self.attend(cfg, p, i, B.rms_norm(cfg, x, p[b + "attn_norm.weight"]), seq)
        return O.add(B.linear(p, b + "attn_output.weight", att, residual=x),
                     p[b + "attn_output.bias"])

    def feed_forward(self, cfg, p, i, x):
        b = f"blk.{i}."
        h = B.rms_norm(cfg, x, p[b + "post_attention_norm.weight"])
        return O.add(x, B.experts(cfg, p, b, h, False, act=O.swiglu_oai, gating="softmax_taken"))


FAMILY = GptOss()
