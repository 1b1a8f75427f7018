"""deepseek2 (DeepSeek-V2-Lite, DeepSeek-V2, Moonlight, GLM-4.7-Flash and the other models
llama.cpp's converter writes as deepseek2; llama.cpp's src/models/deepseek2.cpp): multi-head
latent attention (MLA) before a mixture of experts.

Attention, as llama.cpp computes it with the absorption: each head's query, of
attention.key_length_mla = nope + rope dims, comes from attn_q (the Lite models) or from
attn_q_b of the RMS-normed attn_q_a (attention.q_lora_rank); attn_kv_a_mqa gives one latent
row of attention.kv_lora_rank, RMS-normed (attn_kv_a_norm), and one key of rope dims for all
heads. The last rope dims of every query and that key are roped (mode normal, YaRN in the
published files). A head's query without rope is taken into the latent space by its
attn_k_b; the scores are then multi-query attention of [latent query | roped query] over
[latent | roped key] (key_length = kv_lora_rank + rope dims, one K/V head), the values are
the latents, and each head's output leaves the latent space by its attn_v_b
(attention.value_length_mla) before attn_output. The scores' scale is mscale^2 /
sqrt(key_length_mla), YaRN's mscale (rope.scaling.yarn_log_multiplier, which the converter
stores times 0.1).

Feed-forward: the first leading_dense_block_count blocks are SwiGLU; the others a mixture of
experts (softmax or sigmoid gating, expert_gating_func; a ranking bias exp_probs_b where the
file has one; weights normalized where expert_weights_norm, times expert_weights_scale) plus
expert_shared_count shared experts as one SwiGLU added as it is. A file's
multi-token-prediction blocks (nextn_predict_layers, after the others: GLM-4.7-Flash's) are
left unread, as llama.cpp leaves them. llama.cpp's graph adapts none of the attention's
products but attn_output, and not the output matrix, with a LoRA adapter; ggwgpu puts no
pair on them either (attn_q and output have none; the others are no LoRA target)."""
import math

import numpy as np
from gguf import GGUFValueType as _T, Keys

from .. import ops as O
from ..gguf_file import GGUFError
from ..tensor import ShapeError
from . import blocks as B
from .family import (EXPERT_FF, EXPERT_KEYS, Family, past_trunk, read_shared_count,
                     read_weights_norm, refuse_expert_groups, shared_count_key, trunk_layers,
                     weights_norm_key)

GLM47_VOCAB = 154880    # llama.cpp tells GLM-4.7-Flash's files (sigmoid gating) by it


class Deepseek2(Family):
    arch = "deepseek2"
    fusable_qkv = False     # latent attention: no attn_q, attn_k, attn_v to fuse
    rope_mode = "normal"
    experts = True
    shared_expert = "plain"
    mla = True
    partial_rope = True
    unadapted = ("attn_q.weight", "output.weight")
    keys = {**EXPERT_KEYS, **EXPERT_FF,
            "n_dense_lead": Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
            "expert_gating": Keys.LLM.EXPERT_GATING_FUNC,
            "expert_weights_scale": Keys.LLM.EXPERT_WEIGHTS_SCALE,
            "q_lora_rank": Keys.Attention.Q_LORA_RANK,
            "mla_key_length": Keys.Attention.KEY_LENGTH_MLA,
            "mla_value_length": Keys.Attention.VALUE_LENGTH_MLA}
    required = ("n_expert", "n_expert_used", "n_ff_exp", "q_lora_rank", "mla_key_length",
                "mla_value_length")

    def check(self, cfg):
        if not cfg.n_expert and cfg.n_dense_lead < cfg.n_layer:
            raise ShapeError(f"llama.cpp's {self.arch} needs n_expert > 0 (expert_count) "
                             f"past its {cfg.n_dense_lead} dense blocks")
        if cfg.kv_heads != 1:
            raise ShapeError(f"{self.arch}'s latent attention has one K/V head, not "
                             f"{cfg.kv_heads}")
        if not cfg.rot < cfg.mla_key_length or not cfg.rot < cfg.head_dim or \
                cfg.mla_value_length < 1:
            raise ShapeError(f"{self.arch} needs mla_key_length ({cfg.mla_key_length}) and "
                             f"head_dim (kv_lora_rank + rope dims, {cfg.head_dim}) above its "
                             f"rope dims {cfg.rot}, and an mla_value_length")
        if cfg.n_expert and (not cfg.n_ff_shexp or cfg.n_ff_shexp % self.expert_ff(cfg)):
            raise ShapeError(f"{self.arch}'s shared experts are expert_shared_count >= 1 "
                             f"experts' width: n_ff_shexp {cfg.n_ff_shexp} is no multiple of "
                             f"n_ff_exp {self.expert_ff(cfg)}")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp

    def normalizes(self, cfg):
        return cfg.expert_weights_norm

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg):
        keys = {Keys.Attention.KV_LORA_RANK.format(arch=self.arch): (kv_lora_rank(cfg), _T.UINT32),
                Keys.Attention.VALUE_LENGTH.format(arch=self.arch): (kv_lora_rank(cfg), _T.UINT32),
                **shared_count_key(self.arch, cfg), **weights_norm_key(self.arch, cfg)}
        if cfg.yarn_log_mul:    # the converter's 0.1 * mscale_all_dim
            keys[Keys.Rope.SCALING_YARN_LOG_MUL.format(arch=self.arch)] = \
                (0.1 * cfg.yarn_log_mul, _T.FLOAT32)
        return keys

    def read_more_keys(self, f, hp):
        def key(template):
            return template.format(arch=self.arch)
        refuse_expert_groups(f, self.arch)
        rope = hp["n_rot"]
        lora_rank = f.int_key(key(Keys.Attention.KV_LORA_RANK))
        if lora_rank + rope != (hp.get("n_embd_head") or hp["n_embd"] // hp["n_head"]) or \
                f.int_key(key(Keys.Attention.VALUE_LENGTH)) != lora_rank:
            raise GGUFError(f"{f.path}: {key(Keys.Attention.KEY_LENGTH)} must be "
                            f"{key(Keys.Attention.KV_LORA_RANK)} ({lora_rank}) + "
                            f"{key(Keys.Rope.DIMENSION_COUNT)} ({rope}), and "
                            f"{key(Keys.Attention.VALUE_LENGTH)} the former")
        more = {**read_shared_count(f, self.arch, hp), **read_weights_norm(f, self.arch),
                "expert_bias": any(n.endswith(".exp_probs_b.bias") for n in f.tensors),
                "yarn_log_mul": f.float_key(key(Keys.Rope.SCALING_YARN_LOG_MUL), default=0.0,
                                            allow_zero=True) / 0.1}
        if not hp["expert_gating"] and hp["n_layer"] in (47, 48) and \
                len(f.meta.get("tokenizer.ggml.tokens", ())) == GLM47_VOCAB:
            more["expert_gating"] = 2       # llama.cpp's rule for GLM-4.7-Flash's files
        more["n_layer"] = trunk_layers(f, self.arch, hp["n_layer"])
        return more

    def ignored(self, cfg, name):
        return past_trunk(cfg, name)

    # -- tensors ---------------------------------------------------------------------------

    def block_shapes(self, cfg, i):
        e, heads, rope, r = cfg.n_embd, cfg.n_head, cfg.rot, kv_lora_rank(cfg)
        k, v, q_rank = cfg.mla_key_length, cfg.mla_value_length, cfg.q_lora_rank
        shapes = {"attn_norm.weight": (e,)}
        if q_rank:
            shapes.update({"attn_q_a_norm.weight": (q_rank,), "attn_q_a.weight": (q_rank, e),
                           "attn_q_b.weight": (heads * k, q_rank)})
        else:
            shapes["attn_q.weight"] = (heads * k, e)
        shapes.update({"attn_kv_a_norm.weight": (r,), "attn_kv_a_mqa.weight": (r + rope, e),
                       "attn_k_b.weight": (heads, r, k - rope),
                       "attn_v_b.weight": (heads, v, r), "attn_output.weight": (e, heads * v),
                       "ffn_norm.weight": (e,)})
        shapes.update(self.ffn_shapes(self.layer(cfg, i)))
        return shapes

    # -- the graph -------------------------------------------------------------------------

    def rope_params(self, cfg, i):
        params = B.rope_params(cfg, cfg.rope_freq_base, cfg.rope_freq_scale)
        if cfg.rope_scaling == "yarn" and cfg.yarn_log_mul:
            # llama.cpp's context for deepseek2: mscale = mscale_all_dim, so the factor is 1
            # before the op's own, which it cancels
            params["attn_factor"] = cfg.rope_attn_factor / (1 + 0.1 * math.log(
                1 / cfg.rope_freq_scale))
        return params

    def attention_scale(self, cfg):
        """llama.cpp's kq_scale: mscale^2 / sqrt(key_length_mla), mscale the context's
        attn_factor with YaRN's adjustment undone, times 0.1 ln(factor) * log mul + 1."""
        stretch = math.log(1 / cfg.rope_freq_scale)
        mscale = self.rope_params(cfg, 0)["attn_factor"] * (1 + 0.1 * stretch) * \
            (1 + 0.1 * cfg.yarn_log_mul * stretch)
        return mscale * mscale / math.sqrt(cfg.mla_key_length)

    def attend(self, cfg, p, i, h, seq):
        b, lead, heads, rope = f"blk.{i}.", seq.lead, cfg.n_head, cfg.rot
        rank, k, rows = kv_lora_rank(cfg), cfg.mla_key_length, int(np.prod(seq.lead))
        if cfg.q_lora_rank:
            q = B.rms_norm(cfg, B.linear(p, b + "attn_q_a.weight", h),
                           p[b + "attn_q_a_norm.weight"])
            q = B.linear(p, b + "attn_q_b.weight", q)
        else:
            q = B.linear(p, b + "attn_q.weight", h)
        q = O.reshape(q, (rows, heads, k))
        q_nope, q_rope = (O.view(q, (rows, heads, n), (heads * k, k, 1), at)
                          for n, at in ((k - rope, 0), (rope, k - rope)))
        # each head's query without rope in the latent space: attn_k_b[head] q_nope
        latent_q = O.permute(O.mul_mat(p[b + "attn_k_b.weight"], O.permute(q_nope, (1, 0, 2))),
                             (1, 0, 2))                                  # (rows, heads, rank)
        q = O.concat(O.cont(latent_q), self.rope_rows(cfg, p, i, O.cont(q_rope), seq), 2)
        kv = B.linear(p, b + "attn_kv_a_mqa.weight", h)                 # (*lead, rank + rope)
        latent, k_rope = B.columns(kv, (rank, rope))
        latent = B.rms_norm(cfg, O.cont(latent), p[b + "attn_kv_a_norm.weight"])
        key = O.concat(O.reshape(latent, (rows, 1, rank)),
                       self.rope_rows(cfg, p, i, O.reshape(O.cont(k_rope), (rows, 1, rope)),
                                      seq), 2)                   # (rows, 1, rank + rope)
        # the latents are the values: the key's first `rank` elements (its last, roped,
        # ones give output elements that are dropped)
        out = seq.attend(i, O.reshape(q, (*lead, heads, rank + rope)),
                         O.reshape(key, (*lead, 1, rank + rope)),
                         O.reshape(key, (*lead, 1, rank + rope)), self.attention_scale(cfg), 0)
        out = O.view(O.reshape(out, (rows, heads, rank + rope)), (heads, rows, rank),
                     (rank + rope, heads * (rank + rope), 1), 0)
        out = O.permute(O.mul_mat(p[b + "attn_v_b.weight"], out), (1, 0, 2))   # (rows, h, v)
        return O.reshape(O.cont(out), h.shape[:-1] + (heads * cfg.mla_value_length,))

    def rope_rows(self, cfg, p, i, x, seq):
        """Layer i's rope of x (rows, heads, rope dims), the rows those of seq's lead."""
        rows, heads, dims = x.shape
        x = self.rope(cfg, p, i, O.reshape(x, (*seq.lead, heads, dims)), seq.positions)
        return O.reshape(x, (rows, heads, dims))


def kv_lora_rank(cfg) -> int:
    """The latent's width: the absorbed head (key_length) less its rope dims."""
    return cfg.head_dim - cfg.rot


FAMILY = Deepseek2()
