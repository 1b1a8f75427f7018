"""lfm2 (Liquid LFM2 350M .. 2.6B; llama.cpp's src/models/lfm2.cpp): blocks of two kinds, as
the file's attention.head_count_kv says per layer (0: a convolution). A short-convolution
block: in_proj of attn_norm(x) into three parts b | c | x', then c * conv(b * x') through
out_proj, where conv is a causal depthwise convolution over the last shortconv.l_cache
positions of each channel (ggml's SSM_CONV; zeros before the sequence's start: the op
ssm_conv in training, the decoder's cached inputs when generating). An
attention block: grouped-query attention with per-head Q/K norms and neox rope. Both then
have llama's SwiGLU feed-forward. The final norm is stored as token_embd_norm.weight. With
attention.sliding_window, every attention block attends to that many positions back (at the
model's rope base, as llama.cpp's lfm2 graph ropes them)."""
from gguf import Keys

from .. import ops as O
from . import blocks as B
from .family import Family


class LFM2(Family):
    arch = "lfm2"
    rope_mode = "neox"
    qk_norm = True
    output_norm = "token_embd_norm.weight"
    keys = {"conv_kernel": "{arch}.shortconv.l_cache",     # (gguf-py 0.17 lacks it)
            "sliding_window": Keys.Attention.SLIDING_WINDOW}
    required = ("conv_kernel",)
    values_only = ("shortconv.conv.weight",)

    def window(self, cfg, i):
        return 0 if i in cfg.conv_layers else cfg.sliding_window

    def block_shapes(self, cfg, i):
        if i not in cfg.conv_layers:
            return super().block_shapes(cfg, i)
        e = cfg.n_embd
        return {"attn_norm.weight": (e,), "shortconv.conv.weight": (e, cfg.conv_kernel),
                "shortconv.in_proj.weight": (3 * e, e), "shortconv.out_proj.weight": (e, e),
                "ffn_norm.weight": (e,), **self.ffn_shapes(self.layer(cfg, i))}

    def mix(self, cfg, p, i, x, seq):
        if i not in cfg.conv_layers:
            return super().mix(cfg, p, i, x, seq)
        b = f"blk.{i}.shortconv."
        h = B.rms_norm(cfg, x, p[f"blk.{i}.attn_norm.weight"])
        gate_in, gate_out, inputs = B.columns(B.linear(p, b + "in_proj.weight", h), 3)
        y = seq.convolve(i, O.mul(gate_in, inputs), p[b + "conv.weight"])
        return B.linear(p, b + "out_proj.weight", O.mul(gate_out, y), residual=x)


FAMILY = LFM2()
