"""falcon-h1 (TII Falcon-H1 0.5B .. 34B; llama.cpp's src/models/falcon-h1.cpp): every block
runs attention and a Mamba2 side by side on attn_norm(x), x + attention + Mamba2, then the
SwiGLU feed-forward with its norm stored as blk.N.ffn_norm (no .weight: the converter's name).
Attention ropes neox; the Mamba2 is granitehybrid's mixer, of the file's ssm.inner_size,
with its grouped ssm_norm where the file has one. The converter folds Falcon-H1's muP
multipliers into the weights, so the graph has none."""
from gguf import GGUFValueType

from ..tensor import ShapeError
from . import blocks as B
from .family import Family
from .granitehybrid import (INNER_SIZE, MAMBA2_KEYS, Mamba2Layers, check_mamba2,
                            inner_size, mamba2, mamba2_shapes)

_T = GGUFValueType
FFN_NORM = "ffn_norm"


class FalconH1(Mamba2Layers, Family):
    arch = "falcon-h1"
    rope_mode = "neox"
    keys = MAMBA2_KEYS
    unsupported = {"attn_output.bias": "an attention output bias",
                   "ffn_up.bias": "feed-forward biases", "ffn_down.bias": "feed-forward biases",
                   "ffn_gate.bias": "feed-forward biases"}

    def check(self, cfg):
        check_mamba2(cfg)
        if cfg.recurrent_layers != tuple(range(cfg.n_layer)):
            raise ShapeError(f"every falcon-h1 block has a Mamba2: recurrent_layers must be "
                             f"0 .. {cfg.n_layer - 1}")

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg):
        return {INNER_SIZE.format(arch=self.arch): (inner_size(cfg), _T.UINT32)}

    def read_more_keys(self, f, hp):
        return {"ssm_inner": f.int_key(INNER_SIZE.format(arch=self.arch), minimum=1),
                "recurrent_layers": tuple(range(hp["n_layer"])),
                "mamba_norm": "blk.0.ssm_norm.weight" in f.tensors}

    # -- tensors ---------------------------------------------------------------------------

    def block_shapes(self, cfg, i):
        e, f = cfg.n_embd, cfg.n_ff
        return {"attn_norm.weight": (e,), "attn_q.weight": (cfg.q_dim, e),
                "attn_k.weight": (cfg.kv_dim, e), "attn_v.weight": (cfg.kv_dim, e),
                "attn_output.weight": (e, cfg.q_dim),
                **mamba2_shapes(cfg, self.conv_widths(cfg)[i]),
                FFN_NORM: (e,), "ffn_gate.weight": (f, e), "ffn_down.weight": (e, f),
                "ffn_up.weight": (f, e)}

    # -- the graph -------------------------------------------------------------------------

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        h = B.rms_norm(cfg, x, p[b + "attn_norm.weight"])
        x = B.linear(p, b + "attn_output.weight", self.attend(cfg, p, i, h, seq), residual=x)
        x = B.linear(p, b + "ssm_out.weight", mamba2(cfg, p, b, i, h, seq), residual=x)
        gated = self.gate(p, b, B.rms_norm(cfg, x, p[b + FFN_NORM]))
        return B.linear(p, b + "ffn_down.weight", gated, residual=x)


FAMILY = FalconH1()
