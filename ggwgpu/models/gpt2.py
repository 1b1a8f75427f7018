"""gpt2 (OpenAI GPT-2 small .. XL, and the models converted as gpt2; llama.cpp's
src/models/gpt2.cpp): the token embedding plus a learned embedding of each position
(position_embd, one row per position of the context it was trained at: context_length);
LayerNorm blocks with biases everywhere, one branch after the other: attention on
attn_norm(x) from one fused attn_qkv (rows q | k | v) and its bias, without rope, scores
times 1/sqrt(head size), attn_output with its bias; then ffn_down(gelu(ffn_up h + b)) + b on
ffn_norm(x); the final LayerNorm and the output matrix (token_embd's rows where the file has
none). A context beyond the position table is refused; the table is never quantized, as
llama.cpp leaves it."""
from gguf import GGUFValueType, Keys

from .. import ops as O
from ..tensor import ShapeError
from . import blocks as B
from .family import fused_qkv_heads
from .phi2 import Phi2

POSITIONS = "position_embd.weight"


class GPT2(Phi2):
    arch = "gpt2"
    qkv_bias = False
    parallel = False
    output_bias = False
    fusable_qkv = False     # always fused (project_qkv)

    def check(self, cfg):
        if not cfg.n_ctx <= cfg.n_positions:
            raise ShapeError(f"a gpt2 of {cfg.n_positions} learned positions (n_positions) "
                             f"cannot take a context of {cfg.n_ctx}")

    def ropes(self, cfg, i):
        return False

    def more_keys(self, cfg):
        # the trained context is the position table's, whatever context a run takes
        return {**super().more_keys(cfg),
                Keys.LLM.CONTEXT_LENGTH.format(arch=self.arch):
                    (cfg.n_positions, GGUFValueType.UINT32)}

    def read_more_keys(self, f, hp):
        return {"n_positions": hp["n_ctx"]}

    def shapes(self, cfg):
        shapes = super().shapes(cfg)
        return {B.TOKEN_EMBD: shapes.pop(B.TOKEN_EMBD),
                POSITIONS: (cfg.n_positions, cfg.n_embd), **shapes}

    def block_shapes(self, cfg, i):
        e, f, qkv = cfg.n_embd, cfg.n_ff, cfg.q_dim + 2 * cfg.kv_dim
        return {"attn_norm.weight": (e,), "attn_norm.bias": (e,),
                "attn_qkv.weight": (qkv, e), "attn_qkv.bias": (qkv,),
                "attn_output.weight": (e, cfg.q_dim), "attn_output.bias": (e,),
                "ffn_norm.weight": (e,), "ffn_norm.bias": (e,),
                "ffn_up.weight": (f, e), "ffn_up.bias": (f,), "ffn_down.weight": (e, f),
                "ffn_down.bias": (e,)}

    def project_qkv(self, cfg, p, b, h, lead):
        return fused_qkv_heads(cfg, p, b, h, lead, bias=True)

    def block(self, cfg, p, i, x, seq):
        if i == 0:      # the positions' rows added to the token embeddings
            rows = O.get_rows(p[POSITIONS], seq.positions)
            x = O.add(x, O.reshape(rows, x.shape) if rows.nelements == x.nelements else rows)
        return super().block(cfg, p, i, x, seq)


FAMILY = GPT2()
