"""gemma4 (Gemma 4 E2B, E4B, 31B dense text; llama.cpp's src/models/gemma4.cpp): Gemma 3's
block (inputs times sqrt(n_embd), QK norms, a norm after each branch, GeGLU with the tanh
gelu, neox rope, a final softcap: final_logit_softcapping, 30 where the file has none, as
llama.cpp reads it, 0 for none) with these differences:
- which layers have a sliding window is the file's attention.sliding_window_pattern (one
  bool per layer); sliding layers have their own head size (attention.key_length_swa), K/V
  heads (attention.head_count_kv per layer) and rotated dims (rope.dimension_count_swa),
  and rope at rope.freq_base_swa (llama.cpp's default 10000) with scale 1; global layers
  rope at rope.freq_base with the frequency factors of rope_freqs.weight (the converter's
  "proportional" rope: 1 on the rotated pairs, 1e30 on the others, which then stay still);
- the scores are not scaled (attention scale 1); V is RMS-normed per head without a weight;
- the last attention.shared_kv_layers layers have no K/V of their own: a sliding one attends
  to the keys and values of layer n_layer - shared - 2, a global one to those of layer
  n_layer - shared - 1 (llama.cpp's KV-cache reuse), which must be of the same kind;
- per-layer embeddings (embedding_length_per_layer_input > 0): per_layer_token_embd gives
  each token a row of n_layer parts, times sqrt(width); per_layer_model_proj maps the
  scaled input embedding to n_layer parts, times 1/sqrt(n_embd), RMS-normed per part by
  per_layer_proj_norm; their sum times 1/sqrt(2) is the per-layer input. After its
  feed-forward, block i adds post_norm(proj(gelu(inp_gate x) * its part));
- layer_output_scale.weight, where the file has it, multiplies each block's output (frozen:
  a buffer, not a parameter, in the model's own code).
The feed-forward width may differ per layer (feed_forward_length per layer: the double-wide
shared-KV layers). Norm weights are stored as they multiply (the converter adds no 1).
With expert_count (26B-A4B) each block's feed-forward is two side by side on its input x:
the dense GeGLU on ffn_norm(x), normed by post_ffw_norm_1, plus a mixture of GeGLU experts
(blocks.experts; gate and up one stack, ffn_gate_up_exps, as the converter writes them) on
pre_ffw_norm_2(x), normed by post_ffw_norm_2, whose router reads x RMS-normed without a
weight, times 1/sqrt(n_embd) and ffn_gate_inp.scale, and whose experts' outputs are times
ffn_down_exps.scale (the per-expert scale); their sum through post_ffw_norm.
Not supported, and refused by name: a fused attn_qkv, and layers without attn_v
(attention_k_eq_v: V taken from K)."""
import dataclasses
import math
import re

from gguf import GGUFValueType as _T, Keys

from .. import ops as O
from ..gguf_file import GGUFError
from ..tensor import ShapeError
from . import blocks as B
from .family import EXPERT_FF, EXPERT_KEYS, Family

SWA_FREQ_BASE = 10000.0     # llama.cpp's rope_freq_base_train_swa when the file has none
PER_LAYER_TOKEN_EMBD = "per_layer_token_embd.weight"
PER_LAYER_MODEL_PROJ = "per_layer_model_proj.weight"
PER_LAYER_PROJ_NORM = "per_layer_proj_norm.weight"
OUT_SCALE = "layer_output_scale.weight"


# Gemma 4's keys, as llama.cpp's converter writes them (gguf.Keys names them only in gguf
# releases newer than the oldest this package supports)
KEY_LENGTH_SWA = "{arch}.attention.key_length_swa"
VALUE_LENGTH_SWA = "{arch}.attention.value_length_swa"
SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"
DIMENSION_COUNT_SWA = "{arch}.rope.dimension_count_swa"
FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"
SHARED_KV_LAYERS = "{arch}.attention.shared_kv_layers"
EMBD_LENGTH_PER_LAYER_INP = "{arch}.embedding_length_per_layer_input"


class Gemma4(Family):
    arch = "gemma4"
    rope_mode = "neox"
    partial_rope = True
    qk_norm = True
    post_norms = True
    reads_rope_freqs = True
    gate = staticmethod(B.geglu)
    experts = True
    keys = {**EXPERT_KEYS, **EXPERT_FF, "sliding_window": Keys.Attention.SLIDING_WINDOW,
            "head_dim_swa": KEY_LENGTH_SWA,
            "n_rot_swa": DIMENSION_COUNT_SWA,
            "rope_freq_base_swa": FREQ_BASE_SWA,
            "shared_kv_layers": SHARED_KV_LAYERS,
            "n_embd_per_layer": EMBD_LENGTH_PER_LAYER_INP,
            "final_logit_softcap": Keys.LLM.FINAL_LOGIT_SOFTCAPPING}
    required = ("sliding_window", "head_dim_swa", "n_rot_swa", "n_embd_per_layer")
    absent = {"final_logit_softcap": 30.0}     # llama.cpp's default: no key, a softcap of 30
    unsupported = {"attn_qkv.weight": "a fused attn_qkv"}
    fusable_qkv = False     # llama.cpp's gemma4 reads attn_q, attn_k, attn_v only

    def check(self, cfg):
        if cfg.head_dim_swa < 1 or cfg.n_rot_swa < 1:
            raise ShapeError(f"a gemma4 needs head_dim_swa and n_rot_swa, got "
                             f"{cfg.head_dim_swa} and {cfg.n_rot_swa}")
        if cfg.n_rot_swa % 2 or cfg.n_rot_swa > cfg.head_dim_swa:
            raise ShapeError(f"n_rot_swa {cfg.n_rot_swa} must be even and <= head_dim_swa "
                             f"{cfg.head_dim_swa}")
        if cfg.n_expert and not cfg.n_ff_exp:
            raise ShapeError("a gemma4 with experts needs n_ff_exp "
                             "(expert_feed_forward_length)")
        first = cfg.n_layer - cfg.shared_kv_layers
        if cfg.shared_kv_layers and first < 2:
            raise ShapeError(f"shared_kv_layers {cfg.shared_kv_layers} leaves {first} layers "
                             f"with K/V of their own; llama.cpp needs at least 2")
        for i in range(first, cfg.n_layer):
            j = self.kv_layer(cfg, i)
            if self.local(cfg, j) != self.local(cfg, i):
                raise ShapeError(f"layer {i} would attend to the K/V of layer {j}, which is "
                                 f"not {'a sliding' if self.local(cfg, i) else 'a global'} one")

    def more_keys(self, cfg):
        arch = cfg.arch
        return {VALUE_LENGTH_SWA.format(arch=arch): (cfg.head_dim_swa, _T.UINT32),
                SLIDING_WINDOW_PATTERN.format(arch=arch):
                    ([i in cfg.swa_layers for i in range(cfg.n_layer)], _T.ARRAY)}

    def read_more_keys(self, f, hp):
        arch, n_layer = hp["arch"], hp["n_layer"]
        key = SLIDING_WINDOW_PATTERN.format(arch=arch)
        pattern = f.meta.get(key)
        if not isinstance(pattern, list) or len(pattern) != n_layer or \
                not all(isinstance(v, (bool, int)) for v in pattern):
            raise GGUFError(f"{f.path}: key {key} must be an array of {n_layer} bools, one "
                            f"per layer (true: a sliding-window layer), got {pattern!r:.80}")
        key_length = KEY_LENGTH_SWA.format(arch=arch)
        value_length = VALUE_LENGTH_SWA.format(arch=arch)
        if f.int_key(value_length) != hp["head_dim_swa"]:
            raise GGUFError(f"{f.path}: {value_length} = {f.meta[value_length]} differs from "
                            f"{key_length} = {hp['head_dim_swa']}: llama.cpp's gemma4 needs "
                            f"one head size per layer")
        return {"swa_layers": tuple(i for i, swa in enumerate(pattern) if swa),
                "layer_output_scale": f"blk.0.{OUT_SCALE}" in f.tensors}

    def local(self, cfg, i: int) -> bool:
        """Whether layer i has a sliding window."""
        return i in cfg.swa_layers

    # -- tensors ---------------------------------------------------------------------------

    def shapes(self, cfg):
        shapes = super().shapes(cfg)
        if not cfg.n_embd_per_layer:
            return shapes
        width = cfg.n_embd_per_layer * cfg.n_layer
        first = {B.TOKEN_EMBD: shapes.pop(B.TOKEN_EMBD), PER_LAYER_TOKEN_EMBD: (cfg.n_vocab, width),
                 PER_LAYER_MODEL_PROJ: (width, cfg.n_embd),
                 PER_LAYER_PROJ_NORM: (cfg.n_embd_per_layer,)}
        return first | shapes

    def block_shapes(self, cfg, i):
        shapes = super().block_shapes(cfg, i)
        if self.kv_layer(cfg, i) != i:
            for name in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight"):
                del shapes[name]
        if cfg.n_embd_per_layer:
            shapes.update({"inp_gate.weight": (cfg.n_embd_per_layer, cfg.n_embd),
                           "proj.weight": (cfg.n_embd, cfg.n_embd_per_layer),
                           "post_norm.weight": (cfg.n_embd,)})
        if cfg.layer_output_scale:
            shapes[OUT_SCALE] = (1,)
        return shapes

    def ffn_shapes(self, cfg):
        """The dense GeGLU's matrices, and with experts the mixture's tensors beside them."""
        e, f = cfg.n_embd, cfg.n_ff
        dense = {"ffn_gate.weight": (f, e), "ffn_down.weight": (e, f), "ffn_up.weight": (f, e)}
        if not cfg.n_expert:
            return dense
        return {**dense, "pre_ffw_norm_2.weight": (e,), "post_ffw_norm_1.weight": (e,),
                "post_ffw_norm_2.weight": (e,), "ffn_gate_inp.scale": (e,),
                **super().ffn_shapes(cfg), "ffn_down_exps.scale": (cfg.n_expert,)}

    def expert_ff(self, cfg):
        return cfg.n_ff_exp

    def ignored(self, cfg, name):
        """A shared-KV layer's own K/V weights: llama.cpp loads them where a file has them
        and never reads them."""
        block = re.fullmatch(r"blk\.(\d+)\.(attn_k|attn_v|attn_k_norm)\.weight", name)
        return block is not None and int(block[1]) < cfg.n_layer and \
            self.kv_layer(cfg, int(block[1])) != int(block[1])

    # -- per-layer rules -------------------------------------------------------------------

    def layer(self, cfg, i):
        cfg = super().layer(cfg, i)
        if not self.local(cfg, i):
            return cfg
        return dataclasses.replace(cfg, n_embd_head=cfg.head_dim_swa, n_rot=cfg.n_rot_swa)

    def layers_alike(self, cfg):
        return False

    def kv_layer(self, cfg, i):
        first = cfg.n_layer - cfg.shared_kv_layers
        if i < first:
            return i
        return first - (2 if self.local(cfg, i) else 1)

    def attention_scale(self, cfg):
        return 1.0

    def input_scale(self, cfg):
        return math.sqrt(cfg.n_embd)

    def rope_params(self, cfg, i):
        if self.local(cfg, i):
            return B.rope_params(cfg, cfg.rope_freq_base_swa or SWA_FREQ_BASE, 1.0)
        return super().rope_params(cfg, i)

    def rope(self, cfg, p, i, x, positions):
        factors = p[B.ROPE_FREQS] if cfg.rope_freqs and not self.local(cfg, i) else None
        return B.rope(x, positions, self.rope_params(cfg, i), factors)

    # -- the graph -------------------------------------------------------------------------

    def prepare(self, cfg, p, tokens, x, seq):
        """The per-layer inputs (module docstring), one (*lead, n_embd_per_layer) part per
        block in seq.layer_inputs."""
        if not cfg.n_embd_per_layer:
            return seq
        n, lead = cfg.n_embd_per_layer, x.shape[:-1]
        rows = O.get_rows(p[PER_LAYER_TOKEN_EMBD], tokens)
        rows = rows if rows.dtype == x.dtype else O.cast(rows, x.dtype)
        own = O.reshape(O.scale(rows, math.sqrt(n)), (*lead, cfg.n_layer, n))
        projected = B.linear(p, PER_LAYER_MODEL_PROJ, x, alpha=1.0 / math.sqrt(cfg.n_embd))
        projected = B.rms_norm(cfg, O.reshape(projected, (*lead, cfg.n_layer, n)),
                               p[PER_LAYER_PROJ_NORM])
        inputs = O.scale(O.add(projected, own), 1.0 / math.sqrt(2.0))
        # layer-major, so that each layer's part is a contiguous view
        order = (len(lead),) + tuple(range(len(lead))) + (len(lead) + 1,)
        inputs = O.cont(O.permute(inputs, order))          # (n_layer, *lead, n)
        size = math.prod(lead) * n
        strides = tuple(math.prod(lead[d + 1:]) * n for d in range(len(lead))) + (1,)
        parts = [O.view(inputs, (*lead, n), strides, i * size) for i in range(cfg.n_layer)]
        return dataclasses.replace(seq, layer_inputs=parts)

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        x = super().block(cfg, p, i, x, seq)
        if cfg.n_embd_per_layer:
            gated = O.mul(O.gelu(B.linear(p, b + "inp_gate.weight", x)), seq.layer_inputs[i])
            y = B.rms_norm(cfg, B.linear(p, b + "proj.weight", gated), p[b + "post_norm.weight"])
            x = O.add(x, y)
        if cfg.layer_output_scale:
            x = O.mul(x, p[b + OUT_SCALE])
        return x

    def feed_forward(self, cfg, p, i, x):
        if not cfg.n_expert:
            return super().feed_forward(cfg, p, i, x)
        b, c = f"blk.{i}.", self.layer(cfg, i)
        dense = B.linear(p, b + "ffn_down.weight",
                         self.gate(p, b, B.rms_norm(c, x, p[b + "ffn_norm.weight"])))
        router = O.mul(O.scale(O.rms_norm(x, c.norm_eps), 1.0 / math.sqrt(c.n_embd)),
                       p[b + "ffn_gate_inp.scale"])
        mixed = B.experts(c, p, b, B.rms_norm(c, x, p[b + "pre_ffw_norm_2.weight"]), True,
                          router_input=router, act=O.geglu)
        y = O.add(B.rms_norm(c, dense, p[b + "post_ffw_norm_1.weight"]),
                  B.rms_norm(c, mixed, p[b + "post_ffw_norm_2.weight"]))
        return O.add(x, B.rms_norm(c, y, p[b + "post_ffw_norm.weight"]))

    def attend(self, cfg, p, i, h, seq):
        b, c = f"blk.{i}.", self.layer(cfg, i)
        q = B.split_heads(B.linear(p, b + "attn_q.weight", h), seq.lead, c.n_head, c.head_dim)
        q = self.rope(c, p, i, B.rms_norm(c, q, p[b + "attn_q_norm.weight"]), seq.positions)
        window = self.window(cfg, i)
        if self.kv_layer(cfg, i) != i:
            return seq.attend(self.kv_layer(cfg, i), q, None, None, 1.0, window)
        k, v = (B.split_heads(B.linear(p, b + f"attn_{n}.weight", h), seq.lead, c.kv_heads,
                              c.head_dim) for n in "kv")
        k = self.rope(c, p, i, B.rms_norm(c, k, p[b + "attn_k_norm.weight"]), seq.positions)
        v = O.rms_norm(v, cfg.norm_eps)
        return seq.attend(i, q, k, v, 1.0, window)


FAMILY = Gemma4()
