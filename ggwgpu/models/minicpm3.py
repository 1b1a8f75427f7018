"""minicpm3 (OpenBMB MiniCPM3-4B; llama.cpp's src/models/minicpm3.cpp): llama's block with
multi-head latent attention, as llama.cpp computes it (not absorbed), and minicpm's scales
fixed by the model's size: the input embeddings times 12, each branch times 1.4 /
sqrt(n_layer), the logits times 256 / n_embd (llama.cpp reads no key for them).

Attention: each head's query, of attention.key_length = nope + rope dims, is attn_q_b of the
RMS-normed attn_q_a (attention.q_lora_rank); attn_kv_a_mqa gives a latent of
attention.kv_lora_rank, RMS-normed (attn_kv_a_norm), and one key of rope dims for all heads;
attn_kv_b takes the latent to each head's key without rope and its value (of
attention.value_length, n_embd / n_head where absent). The last rope dims of each query and
the shared key are roped (neox, LongRoPE's factors where the file has them); each head's key
is its own nope part and the shared roped part. The scores take 1/sqrt(key_length). The
values are narrower than the keys: attention reads them zero-padded to the keys' width and
the padding's output columns are dropped. llama.cpp's graph puts no LoRA pair on the
latent products (they are no target of ggwgpu's either)."""
import math

import numpy as np
from gguf import GGUFValueType as _T, Keys

from .. import ops as O
from ..tensor import ShapeError, constant
from . import blocks as B
from .deepseek2 import Deepseek2
from .family import Family


class MiniCPM3(Family):
    arch = "minicpm3"
    rope_mode = "neox"
    reads_longrope = True
    partial_rope = True
    mla = True
    fusable_qkv = False     # latent attention: no attn_q, attn_k, attn_v to fuse
    keys = {"q_lora_rank": Keys.Attention.Q_LORA_RANK,
            "kv_lora_rank": Keys.Attention.KV_LORA_RANK}
    required = ("q_lora_rank", "kv_lora_rank")
    rope_rows = Deepseek2.rope_rows

    def check(self, cfg):
        if not 0 < cfg.rot < cfg.head_dim or not 0 < cfg.mla_value_length <= cfg.head_dim:
            raise ShapeError(f"a minicpm3 needs key_length {cfg.head_dim} above its rope dims "
                             f"{cfg.rot} and at least its mla_value_length (value_length) "
                             f"{cfg.mla_value_length}")
        if min(cfg.q_lora_rank, cfg.kv_lora_rank) < 1:
            raise ShapeError(f"a minicpm3 needs q_lora_rank and kv_lora_rank, got "
                             f"{cfg.q_lora_rank} and {cfg.kv_lora_rank}")
        if cfg.kv_heads != cfg.n_head:
            raise ShapeError(f"minicpm3's latent attention gives every head its K/V: n_head_kv "
                             f"{cfg.kv_heads} must be n_head {cfg.n_head}")

    def input_scale(self, cfg):
        return 12.0

    def logit_factor(self, cfg):
        return 256.0 / cfg.n_embd

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg):
        return {Keys.Attention.VALUE_LENGTH.format(arch=self.arch):
                (cfg.mla_value_length, _T.UINT32)}

    def read_more_keys(self, f, hp):
        return {"mla_value_length": f.int_key(Keys.Attention.VALUE_LENGTH.format(arch=self.arch),
                                              default=hp["n_embd"] // hp["n_head"])}

    # -- tensors ---------------------------------------------------------------------------

    def block_shapes(self, cfg, i):
        e, heads, rope, k, v = cfg.n_embd, cfg.n_head, cfg.rot, cfg.head_dim, cfg.mla_value_length
        q_rank, rank, f = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.n_ff
        return {"attn_norm.weight": (e,), "attn_q_a_norm.weight": (q_rank,),
                "attn_kv_a_norm.weight": (rank,), "attn_q_a.weight": (q_rank, e),
                "attn_q_b.weight": (heads * k, q_rank), "attn_kv_a_mqa.weight": (rank + rope, e),
                "attn_kv_b.weight": (heads * (k - rope + v), rank),
                "attn_output.weight": (e, heads * v), "ffn_norm.weight": (e,),
                "ffn_gate.weight": (f, e), "ffn_down.weight": (e, f), "ffn_up.weight": (f, e)}

    # -- the graph -------------------------------------------------------------------------

    def block(self, cfg, p, i, x, seq):
        b, branch = f"blk.{i}.", 1.4 / math.sqrt(cfg.n_layer)
        h = B.rms_norm(cfg, x, p[b + "attn_norm.weight"])
        x = B.linear(p, b + "attn_output.weight", self.attend(cfg, p, i, h, seq), residual=x,
                     alpha=branch)
        h = B.rms_norm(cfg, x, p[b + "ffn_norm.weight"])
        return B.linear(p, b + "ffn_down.weight", self.gate(p, b, h), residual=x, alpha=branch)

    def attend(self, cfg, p, i, h, seq):
        b, heads, rope, k = f"blk.{i}.", cfg.n_head, cfg.rot, cfg.head_dim
        rank, v, rows = cfg.kv_lora_rank, cfg.mla_value_length, int(np.prod(seq.lead))
        nope = k - rope
        q = B.rms_norm(cfg, B.linear(p, b + "attn_q_a.weight", h), p[b + "attn_q_a_norm.weight"])
        q = O.reshape(B.linear(p, b + "attn_q_b.weight", q), (rows, heads, k))
        q_nope, q_rope = (O.view(q, (rows, heads, n), (heads * k, k, 1), at)
                          for n, at in ((nope, 0), (rope, nope)))
        q = O.concat(O.cont(q_nope), self.rope_rows(cfg, p, i, O.cont(q_rope), seq), 2)
        latent, k_rope = B.columns(B.linear(p, b + "attn_kv_a_mqa.weight", h), (rank, rope))
        latent = B.rms_norm(cfg, O.cont(latent), p[b + "attn_kv_a_norm.weight"])
        kv = O.reshape(B.linear(p, b + "attn_kv_b.weight", latent), (rows, heads, nope + v))
        k_nope, value = (O.view(kv, (rows, heads, n), (heads * (nope + v), nope + v, 1), at)
                         for n, at in ((nope, 0), (v, nope)))
        k_rope = self.rope_rows(cfg, p, i, O.reshape(O.cont(k_rope), (rows, 1, rope)), seq)
        key = O.concat(O.cont(k_nope), O.repeat(k_rope, (rows, heads, rope)), 2)
        value = O.cont(value)
        if v < k:   # zero columns up to the keys' width, whose outputs are dropped
            value = O.concat(value, constant(np.zeros((rows, heads, k - v)), value.dtype,
                                             name="value padding"), 2)
        out = seq.attend(i, *(O.reshape(t, (*seq.lead, heads, k)) for t in (q, key, value)),
                         1.0 / math.sqrt(k), 0)
        out = O.view(O.reshape(out, (rows, heads, k)), (rows, heads, v), (heads * k, k, 1), 0)
        return O.reshape(O.cont(out), h.shape[:-1] + (heads * v,))


FAMILY = MiniCPM3()
