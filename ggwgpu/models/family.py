"""A model family: what llama.cpp's src/models/<arch>.cpp and its tensor and key tables say
about one general.architecture, as a short description the graph builders, files, LoRA and
the memory estimate read.

The base class is the pre-norm transformer block most families share, llama's:

    x = x + attn_output(attention(rope(q), rope(k), v))     q, k, v from attn_norm(x)
    x = x + ffn_down(gate(ffn_gate h, ffn_up h))            h = ffn_norm(x)

and a family states how it differs: Q/K/V biases, per-head Q/K norms, norms after each
branch (sandwich), a GeGLU gate, layers without rope or with a sliding window, scales.
A family whose blocks are not all attention (lfm2's short convolutions) overrides
`block_shapes` and `mix` (the token mixer of a block) for those blocks. Layers that differ in
head size, K/V heads, rotated dims or feed-forward width (gemma4) say so through `layer`, the
hyper-parameters of one layer, which every per-layer rule reads.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
from gguf import GGUFValueType, Keys

from .. import ops as O
from ..gguf_file import GGUFError
from ..tensor import ShapeError
from . import blocks as B

# The hyper-parameters of a mixture of experts (the keys of a family with `experts`)
EXPERT_KEYS = {"n_expert": Keys.LLM.EXPERT_COUNT, "n_expert_used": Keys.LLM.EXPERT_USED_COUNT}
EXPERT_FF = {"n_ff_exp": Keys.LLM.EXPERT_FEED_FORWARD_LENGTH}
SHARED_FF = {"n_ff_shexp": Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH}


NEXTN = "{arch}.nextn_predict_layers"


def weights_norm_key(arch: str, cfg) -> dict:
    """The expert_weights_norm key of cfg (a bool, as the converter writes it)."""
    return {Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=arch):
            (bool(cfg.expert_weights_norm), GGUFValueType.BOOL)}


def refuse_expert_groups(f, arch: str):
    """Raise a GGUFError where file `f` routes by groups of experts (DeepSeek-V3's
    expert_group_count > 1), which ggwgpu's top_k over all experts does not."""
    key = Keys.LLM.EXPERT_GROUP_COUNT.format(arch=arch)
    if f.int_key(key, default=0, minimum=0) > 1:
        raise GGUFError(f"{f.path}: {key}: ggwgpu's {arch} does not route by groups of "
                        f"experts")


def read_weights_norm(f, arch: str) -> dict:
    """ModelConfig.expert_weights_norm from file `f` (false where absent, as llama.cpp)."""
    key = Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=arch)
    norm = f.meta.get(key, False)
    if not isinstance(norm, bool):
        raise GGUFError(f"{f.path}: {key} must be a bool")
    return {"expert_weights_norm": norm}


def shared_count_key(arch: str, cfg) -> dict:
    """expert_shared_count: the shared experts' width n_ff_shexp in experts of n_ff_exp."""
    return {Keys.LLM.EXPERT_SHARED_COUNT.format(arch=arch):
            (cfg.n_ff_shexp // cfg.n_ff_exp, GGUFValueType.UINT32)}


def read_shared_count(f, arch: str, hp: dict) -> dict:
    """ModelConfig.n_ff_shexp from file `f`'s expert_shared_count experts of n_ff_exp."""
    shared = f.int_key(Keys.LLM.EXPERT_SHARED_COUNT.format(arch=arch), minimum=0)
    return {"n_ff_shexp": shared * hp["n_ff_exp"]}


def swa_base_rope(family, cfg, i: int) -> dict:
    """Layer i's rope parameters at rope_freq_base_swa where the layer is windowed and that
    base is set, else at the model's base; the model's scale either way."""
    base = cfg.rope_freq_base_swa if family.local(cfg, i) and cfg.rope_freq_base_swa \
        else cfg.rope_freq_base
    return B.rope_params(cfg, base, cfg.rope_freq_scale)


def qkv_bias_of(f) -> bool:
    """Whether file `f` has Q/K/V biases (ModelConfig.qkv_bias: llama.cpp reads them where a
    file has them), separate or fused."""
    return "blk.0.attn_q.bias" in f.tensors or "blk.0.attn_qkv.bias" in f.tensors


def trunk_layers(f, arch: str, blocks: int) -> int:
    """The model's blocks in file `f` of block_count `blocks`, which counts the
    multi-token-prediction blocks (nextn_predict_layers) the converter appends after them:
    llama.cpp's main graph reads past those (it runs them only to draft tokens), as ggwgpu
    does (`past_trunk`); files ggwgpu writes leave them out."""
    n_layer = blocks - f.int_key(NEXTN.format(arch=arch), default=0, minimum=0)
    if n_layer < 1:
        raise GGUFError(f"{f.path}: {NEXTN.format(arch=arch)} leaves no block of the "
                        f"{blocks} for the model")
    return n_layer


def past_trunk(cfg, name: str) -> bool:
    """Whether tensor `name` is in a block past the model's (a multi-token-prediction one)."""
    block = re.match(r"blk\.(\d+)\.", name)
    return block is not None and int(block[1]) >= cfg.n_layer


def fuse_qkv(shapes: dict) -> dict:
    """A block's tensors (name -> shape) with attn_q, attn_k and attn_v, and their biases, as
    one attn_qkv of rows q | k | v in attn_q's place."""
    fused = {}
    for name, shape in shapes.items():
        part = re.fullmatch(r"attn_([qkv])\.(weight|bias)", name)
        if part is None:
            fused[name] = shape
        elif part[1] == "q":
            rows = sum(shapes[f"attn_{m}.{part[2]}"][0] for m in "qkv")
            fused[f"attn_qkv.{part[2]}"] = (rows, *shape[1:])
    return fused


def fused_qkv_heads(cfg, p: dict, b: str, h, lead, bias: bool):
    """Block b's q, k and v of h in heads (Family.project_qkv) from its one attn_qkv of rows
    q | k | v, plus its bias where `bias`."""
    qkv = B.linear(p, b + "attn_qkv.weight", h)
    if bias:
        qkv = O.add(qkv, p[b + "attn_qkv.bias"])
    return B.columns(O.reshape(qkv, (*lead, qkv.shape[-1])),
                     (cfg.q_dim, cfg.kv_dim, cfg.kv_dim), cfg.head_dim)


class Family:
    arch = "llama"
    rope_mode = "normal"      # llama.cpp's rope type of the arch: "normal" or "neox"
    qkv_bias = False          # attn_q/k/v.bias added to the products, before rope (qwen2;
                              # ModelConfig.qkv_bias where a file may have them or not)
    qk_norm = False           # attn_q_norm / attn_k_norm: RMS norms of each head, before rope
    qk_norm_after_rope = False    # those norms after rope instead (hunyuan-dense)
    post_norms = False        # post_attention_norm / post_ffw_norm on each branch's output
    pre_norms = True          # attn_norm / ffn_norm on each branch's input (olmo2 has none)
    # llama.cpp's set_swa_pattern(n): with a sliding_window, layers i % n < n - 1 attend
    # within it, every n-th is global (0: no layer)
    swa_pattern = 0
    gate = staticmethod(B.swiglu)     # the feed-forward's gate: B.swiglu or B.geglu
    # Whether llama.cpp's graph of the family passes a rope_freqs.weight (Llama 3's
    # frequency factors, ModelConfig.rope_freqs) to its rope.
    reads_rope_freqs = False
    # Whether it reads LongRoPE's rope_factors_long/short.weight (ModelConfig.longrope): the
    # long ones when the context exceeds rope_orig_ctx, else the short ones
    reads_longrope = False
    output_norm = B.OUTPUT_NORM   # the final norm's tensor (lfm2 names it token_embd_norm)
    ffn_norm = "ffn_norm.weight"    # the feed-forward's norm in a block (glm4moe's name differs)
    partial_rope = False      # whether llama.cpp's graph allows n_rot < head_dim (it asserts not)
    # The family's own hyper-parameters: ModelConfig field -> its <arch>.* key template
    # (gguf-py's Keys), beyond those every family has (gguf_llama.ARCH_KEY_TEMPLATES).
    # A family key that is 0 or absent is unset: the field keeps its neutral default, and
    # is not written, unless the family lists it as required (llama.cpp refuses files
    # without it) or in `absent` (field -> what llama.cpp takes when the key is absent:
    # then it is always written, a 0 saying unset).
    keys: dict = {}
    required: tuple = ()
    absent: dict = {}
    # Tensors of files of the arch that ggwgpu cannot compute with: block tensor name ->
    # the feature they belong to (a file with one is refused, naming it).
    unsupported: dict = {}
    # 2-D block tensors the graph reads as values, not as a product's weight (a convolution's
    # taps): read as f32 even from a block type (an F16 file stores them so), where other
    # matrices may stay in theirs (gguf_llama.load_model's keep_quantized)
    values_only: tuple = ()
    # Whether the blocks may lack a feed-forward (nemotron_h: feed_forward_length per layer,
    # 0 where a block is a mixer alone; ModelConfig.mlp_layers the others)
    ff_free = False
    # Whether llama.cpp takes attention.layer_norm_epsilon where the RMS norm's is absent
    layer_norm_eps_fallback = False
    # Whether llama.cpp's graph of the family makes the feed-forward a mixture of experts
    # where a file has expert_count (blocks.experts); then whether it divides the taken
    # experts' weights by their sum (norm_w), whether a shared expert every token takes adds
    # to them ("gated": times the sigmoid of its gate ffn_gate_inp_shexp, qwen2moe's; "plain":
    # as it is, where n_ff_shexp is set, granite's), and whether the experts are ranked with
    # a bias added (exp_probs_b.bias, lfm2moe)
    # Whether the attention has sinks (attn_sinks.weight, gpt-oss): a logit per head in
    # every softmax (one more score-sized tensor where the scores are unfused)
    attention_sinks = False
    experts = False
    expert_norm = True
    # Whether attention is latent (deepseek2's MLA): its value_length, the latent, differs
    # from key_length
    mla = False
    # Weights llama.cpp multiplies without their LoRA pairs (an adapter on them would do
    # nothing there): ggwgpu gives them none
    unadapted: tuple = ()
    shared_expert = None
    selection_bias = False
    # Whether llama.cpp reads the family's Q, K and V from one attn_qkv where a file has it
    # (its create_tensor_qkv; the converter's --fuse-qkv writes them so): ModelConfig.fused_qkv
    fusable_qkv = True
    # Whether llama.cpp requires the model's own output.weight (no tied embeddings)
    needs_output = False

    def __repr__(self):
        return f"<family {self.arch}>"

    # -- tensors ---------------------------------------------------------------------------

    def shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        """Every tensor of the model, GGUF name -> shape (NumPy order), in file order."""
        shapes = {B.TOKEN_EMBD: (cfg.n_vocab, cfg.n_embd)}
        shapes.update({name: (cfg.rot // 2,) for name in self.rope_tables(cfg)})
        for i in range(cfg.n_layer):
            block = self.block_shapes(cfg, i)
            if cfg.fused_qkv:
                block = fuse_qkv(block)
            shapes.update({f"blk.{i}.{n}": s for n, s in block.items()})
        shapes[self.output_norm] = (cfg.n_embd,)
        if not cfg.tied_embeddings:
            shapes[B.OUTPUT] = (cfg.n_vocab, cfg.n_embd)
        return shapes

    def block_shapes(self, cfg, i: int) -> dict[str, tuple[int, ...]]:
        """The tensors of block i, name within the block ("attn_q.weight") -> shape."""
        c = self.layer(cfg, i)
        e, q, kv, hd = c.n_embd, c.q_dim, c.kv_dim, c.head_dim
        shapes = {"attn_norm.weight": (e,)} if self.pre_norms else {}
        shapes.update({"attn_q.weight": (q, e), "attn_k.weight": (kv, e),
                       "attn_v.weight": (kv, e), "attn_output.weight": (e, q)})
        if self.qkv_bias or cfg.qkv_bias:
            shapes.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if self.qk_norm or cfg.qk_norm:
            shapes.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        if self.post_norms:
            shapes["post_attention_norm.weight"] = (e,)
        if self.pre_norms:
            shapes[self.ffn_norm] = (e,)
        shapes.update(self.ffn_shapes(c))
        if self.post_norms:
            shapes["post_ffw_norm.weight"] = (e,)
        return shapes

    def ffn_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        """The feed-forward's tensors of a block with hyper-parameters cfg (a layer's): SwiGLU's
        three matrices, or a mixture of experts: the router, a stack of each matrix with one
        per expert (gate and up as one where cfg.fused_gate_up), and the shared expert and its
        gate where the family has one."""
        e, f = cfg.n_embd, cfg.n_ff
        if not cfg.n_expert:
            return {"ffn_gate.weight": (f, e), "ffn_down.weight": (e, f), "ffn_up.weight": (f, e)}
        n, x = cfg.n_expert, self.expert_ff(cfg)
        shapes = {"ffn_gate_inp.weight": (n, e), "ffn_gate_exps.weight": (n, x, e),
                  "ffn_down_exps.weight": (n, e, x), "ffn_up_exps.weight": (n, x, e)}
        if cfg.fused_gate_up:
            del shapes["ffn_gate_exps.weight"], shapes["ffn_up_exps.weight"]
            shapes["ffn_gate_up_exps.weight"] = (n, 2 * x, e)
        if self.selection_bias or cfg.expert_bias:
            shapes["exp_probs_b.bias"] = (n,)
        if self.shared_expert == "gated":
            shapes["ffn_gate_inp_shexp.weight"] = (e,)
        s = self.shared_ff(cfg)
        if s:
            shapes.update({"ffn_gate_shexp.weight": (s, e), "ffn_down_shexp.weight": (e, s),
                           "ffn_up_shexp.weight": (s, e)})
        return shapes

    def expert_gating(self, cfg) -> str | None:
        """blocks.experts' `gating` of the family (None: cfg.expert_gating's)."""
        return None

    def normalizes(self, cfg) -> bool:
        """Whether the taken experts' weights are divided by their sum (norm_w)."""
        return self.expert_norm

    def expert_ff(self, cfg) -> int:
        """One expert's feed-forward width: n_ff (llama's, olmoe's files give it there)."""
        return cfg.n_ff

    def shared_ff(self, cfg) -> int:
        """The shared expert's width (0: none): n_ff_shexp, else qwen2moe's n_ff."""
        if self.shared_expert == "gated":
            return cfg.n_ff_shexp or cfg.n_ff
        return cfg.n_ff_shexp if self.shared_expert else 0

    def rope_tables(self, cfg) -> tuple[str, ...]:
        """The rope frequency-factor tensors of the model (n_rot / 2 values each, frozen)."""
        if cfg.longrope and self.reads_longrope:
            return B.ROPE_LONG, B.ROPE_SHORT
        return (B.ROPE_FREQS,) if cfg.rope_freqs and self.reads_rope_freqs else ()

    def rope_factors(self, cfg, p: dict, i: int):
        """The factor table layer i ropes with (None: none): LongRoPE's long factors when
        the context exceeds rope_orig_ctx, else its short ones, as llama.cpp picks them
        per context."""
        tables = self.rope_tables(cfg)
        if len(tables) == 2:
            return p[tables[0] if cfg.rope_orig_ctx and cfg.n_ctx > cfg.rope_orig_ctx
                     else tables[1]]
        return p[tables[0]] if tables else None

    def more_keys(self, cfg) -> dict:
        """Keys the family writes beyond one per field of `keys`: key -> (value, GGUF type)."""
        return {}

    def read_more_keys(self, f, hp: dict) -> dict:
        """The ModelConfig fields that `more_keys` and the tensors of file `f` (a
        gguf_file.GGUFFile) give, from the fields read so far, `hp`."""
        return {}

    def ignored(self, cfg, name: str) -> bool:
        """Whether tensor `name` of a file is one llama.cpp loads but never computes with
        (reading drops it)."""
        return False

    def initial(self, name: str) -> float:
        """The value a fresh model's vector `name` (not a bias) starts at: 1, a norm's; -1
        for a recurrent layer's ssm_a (-exp(A_log), A_log = 0: a decay); 0 for a shared
        expert's gate (a sigmoid of one half)."""
        if name.endswith("ffn_gate_inp_shexp.weight"):
            return 0.0
        return -1.0 if name.endswith("ssm_a") else 1.0

    def check(self, cfg):
        """Raise a ShapeError where cfg's hyper-parameters do not make a model of the family."""

    # -- per-layer rules -------------------------------------------------------------------

    def layer(self, cfg, i: int):
        """The hyper-parameters of layer i: cfg, with its own K/V heads and feed-forward width
        where those differ per layer (ModelConfig.n_head_kv_layers, n_ff_layers), and no
        experts in the leading dense blocks (n_dense_lead)."""
        if i < cfg.n_dense_lead:        # lfm2moe's first blocks: a dense feed-forward
            cfg = dataclasses.replace(cfg, n_dense_lead=cfg.n_layer, n_expert=0,
                                      n_expert_used=0)
        if not (cfg.n_head_kv_layers or cfg.n_ff_layers):
            return cfg
        return dataclasses.replace(
            cfg, n_head_kv_layers=(), n_ff_layers=(),
            n_head_kv=cfg.n_head_kv_layers[i] if cfg.n_head_kv_layers else cfg.n_head_kv,
            n_ff=cfg.n_ff_layers[i] if cfg.n_ff_layers else cfg.n_ff)

    def conv_widths(self, cfg) -> dict:
        """{layer: the channels of its causal convolution} of the blocks that convolve."""
        return {i: cfg.n_embd for i in cfg.conv_layers}

    def state_size(self, cfg) -> int:
        """The values of one recurrent layer's state (qwen35's delta-net: heads of
        ssm_state x ssm_state)."""
        return cfg.ssm_heads * cfg.ssm_state ** 2

    def attends(self, cfg, i: int) -> bool:
        """Whether block i's mixer is attention (a KV cache's layer)."""
        return i not in cfg.conv_layers

    def kv_free_layers(self, cfg) -> tuple:
        """The blocks a file gives 0 K/V heads (attention.head_count_kv per layer): lfm2's
        convolutions."""
        return cfg.conv_layers

    def kv_free_fields(self, layers: tuple, hp: dict) -> dict:
        """The ModelConfig fields of the blocks a file gives 0 K/V heads (kv_free_layers'
        inverse), from the fields read so far, `hp`."""
        return {"conv_layers": layers}

    def kv_layer(self, cfg, i: int) -> int:
        """The layer whose keys and values layer i attends to (itself, unless it shares)."""
        return i

    def layers_alike(self, cfg) -> bool:
        """Whether every block has the same tensors (the memory estimate counts one)."""
        return not (cfg.conv_layers or cfg.n_head_kv_layers or cfg.n_ff_layers or
                    cfg.n_dense_lead)

    def ropes(self, cfg, i: int) -> bool:
        """Whether layer i ropes its Q and K."""
        return True

    def local(self, cfg, i: int) -> bool:
        """Whether layer i has a sliding window (swa_pattern's)."""
        n = self.swa_pattern
        return cfg.sliding_window > 0 and n > 0 and i % n < n - 1

    def window(self, cfg, i: int) -> int:
        """Layer i's sliding window (0: it attends to every earlier position)."""
        return cfg.sliding_window if self.local(cfg, i) else 0

    def rope_params(self, cfg, i: int) -> dict:
        """Layer i's rope: the op's parameters (blocks.rope_params), at the model's base and
        scale."""
        return B.rope_params(cfg, cfg.rope_freq_base, cfg.rope_freq_scale)

    def attention_scale(self, cfg) -> float:
        """The scale of the attention scores (llama.cpp's kq_scale)."""
        return cfg.attention_scale or 1.0 / np.sqrt(cfg.head_dim)

    def logit_factor(self, cfg) -> float:
        """What the logits are multiplied by: 1 / logit_scale (granite's division)."""
        return 1.0 / cfg.logit_scale

    def input_scale(self, cfg) -> float:
        """What the token embeddings are multiplied by before the first block."""
        return cfg.embedding_scale

    # -- the graph -------------------------------------------------------------------------

    def block(self, cfg, p: dict, i: int, x, seq: B.Sequence):
        """Block i applied to x (rows of n_embd): its mixer (attention), then the
        feed-forward, each with its residual."""
        return self.feed_forward(cfg, p, i, self.mix(cfg, p, i, x, seq))

    def feed_forward(self, cfg, p: dict, i: int, x):
        """x + block i's feed-forward of ffn_norm(x): the gate's, or a mixture of experts."""
        b = f"blk.{i}."
        h = self.pre_norm(cfg, p, b + self.ffn_norm, x)
        if self.layer(cfg, i).n_expert:
            y = self.mixture(cfg, p, b, h)
            if self.post_norms:
                y = B.rms_norm(cfg, y, p[b + "post_ffw_norm.weight"])
            return O.add(x, y if cfg.residual_scale == 1.0 else O.scale(y, cfg.residual_scale))
        return self.residual(cfg, p, b, "ffn_down.weight", self.gate(p, b, h), x,
                             "post_ffw_norm.weight")

    def mixture(self, cfg, p: dict, b: str, h):
        """Block b's mixture of experts on h (its ffn_norm), with the shared expert added
        where the model has one (times the sigmoid of its gate where it is "gated")."""
        y = B.experts(cfg, p, b, h, self.normalizes(cfg), gating=self.expert_gating(cfg),
                      scale=cfg.expert_weights_scale)
        if not self.shared_ff(cfg):
            return y
        shared = B.linear(p, b + "ffn_down_shexp.weight", O.swiglu(
            B.linear(p, b + "ffn_gate_shexp.weight", h), B.linear(p, b + "ffn_up_shexp.weight", h)))
        if self.shared_expert == "gated":
            gate = O.mul_mat(O.reshape(p[b + "ffn_gate_inp_shexp.weight"], (1, cfg.n_embd)), h)
            shared = O.mul(shared, O.sigmoid(gate))
        return O.add(y, shared)

    def mix(self, cfg, p: dict, i: int, x, seq: B.Sequence):
        """x + block i's token mixer (self-attention) of attn_norm(x)."""
        b = f"blk.{i}."
        att = self.attend(cfg, p, i, self.pre_norm(cfg, p, b + "attn_norm.weight", x), seq)
        return self.residual(cfg, p, b, "attn_output.weight", att, x, "post_attention_norm.weight")

    def final_norm(self, cfg, p: dict, x):
        """The norm after the last block (output_norm's RMS norm)."""
        return B.rms_norm(cfg, x, p[self.output_norm])

    def pre_norm(self, cfg, p: dict, name: str, x):
        """A branch's input: x through its norm `name`, or x itself without pre_norms."""
        return B.rms_norm(cfg, x, p[name]) if self.pre_norms else x

    def residual(self, cfg, p: dict, b: str, weight: str, h, x, post_norm: str):
        """x + block b's branch: its `weight` times h (times residual_scale), or with
        post_norms that product's `post_norm`."""
        if not self.post_norms:
            return B.linear(p, b + weight, h, residual=x, alpha=cfg.residual_scale)
        return O.add(x, B.rms_norm(cfg, B.linear(p, b + weight, h), p[b + post_norm]))

    def prepare(self, cfg, p: dict, tokens, x, seq: B.Sequence) -> B.Sequence:
        """`seq` with what the blocks read beside their input x (the scaled token
        embeddings of `tokens`): gemma4's per-layer embeddings."""
        return seq

    def attend(self, cfg, p: dict, i: int, h, seq: B.Sequence):
        """Self-attention of block i on h (its attn_norm): q, k, v projected and split into
        heads, q and k normed and roped as the family does, attended over `seq`."""
        b, cfg = f"blk.{i}.", self.layer(cfg, i)
        q, k, v = self.project_qkv(cfg, p, b, h, seq.lead)

        def norm(q, k):
            return tuple(B.rms_norm(cfg, t, p[b + f"attn_{n}_norm.weight"])
                         for n, t in zip("qk", (q, k)))
        qk_norm = self.qk_norm or cfg.qk_norm
        if qk_norm and not self.qk_norm_after_rope:
            q, k = norm(q, k)
        if self.ropes(cfg, i):
            q, k = (self.rope(cfg, p, i, t, seq.positions) for t in (q, k))
        if qk_norm and self.qk_norm_after_rope:
            q, k = norm(q, k)
        if seq.temperature is not None:
            q = O.mul(q, seq.temperature)
        sinks = {"sinks": p[b + "attn_sinks.weight"]} if self.attention_sinks else {}
        return seq.attend(i, q, k, v, self.attention_scale(cfg), self.window(cfg, i), **sinks)

    def project_qkv(self, cfg, p: dict, b: str, h, lead):
        """Block b's q (*lead, n_head, head_dim), k and v (*lead, n_head_kv, head_dim) of h,
        with their biases where the family has them (from one attn_qkv where cfg.fused_qkv)."""
        if cfg.fused_qkv:
            return fused_qkv_heads(cfg, p, b, h, lead, self.qkv_bias or cfg.qkv_bias)

        def project(n, heads):
            y = B.linear(p, b + f"attn_{n}.weight", h)
            if self.qkv_bias or cfg.qkv_bias:
                y = O.add(y, p[b + f"attn_{n}.bias"])
            return B.split_heads(y, lead, heads, cfg.head_dim)
        return tuple(project(n, heads)
                     for n, heads in zip("qkv", (cfg.n_head, cfg.kv_heads, cfg.kv_heads)))

    def rope(self, cfg, p: dict, i: int, x, positions):
        """Layer i's rope of x (q or k): its parameters, the model's factor table."""
        return B.rope(x, positions, self.rope_params(cfg, i), self.rope_factors(cfg, p, i))


class SharedSigmoidExperts(Family):
    """The mixtures of glm4moe and afmoe: past the first leading_dense_block_count blocks,
    experts of expert_feed_forward_length by the router's sigmoids (the softmax where
    expert_gating_func says 1; sigmoids where unset, as llama.cpp takes them) ranked with
    exp_probs_b, weights normalized where expert_weights_norm and times
    expert_weights_scale, plus expert_shared_count shared experts as one SwiGLU of their
    width added as it is."""
    experts = True
    shared_expert = "plain"
    selection_bias = True
    keys = {**EXPERT_KEYS, **EXPERT_FF, "n_dense_lead": Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
            "expert_gating": Keys.LLM.EXPERT_GATING_FUNC,
            "expert_weights_scale": Keys.LLM.EXPERT_WEIGHTS_SCALE}
    required = ("n_expert", "n_expert_used", "n_ff_exp")

    def check(self, cfg):
        if not (cfg.n_expert and cfg.n_ff_exp) and cfg.n_dense_lead < cfg.n_layer:
            raise ShapeError(f"llama.cpp's {self.arch} needs n_expert and n_ff_exp > 0 "
                             f"(expert_count, expert_feed_forward_length) past its "
                             f"{cfg.n_dense_lead} dense blocks")
        if cfg.n_ff_exp and cfg.n_ff_shexp % cfg.n_ff_exp:
            raise ShapeError(f"{self.arch}'s shared experts are expert_shared_count experts' "
                             f"width: n_ff_shexp {cfg.n_ff_shexp} is no multiple of n_ff_exp "
                             f"{cfg.n_ff_exp}")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp

    def normalizes(self, cfg):
        return cfg.expert_weights_norm

    def expert_gating(self, cfg):
        return "softmax" if cfg.expert_gating == 1 else "sigmoid"

    def more_keys(self, cfg):
        return {**shared_count_key(self.arch, cfg), **weights_norm_key(self.arch, cfg)}

    def read_more_keys(self, f, hp):
        return {**read_shared_count(f, self.arch, hp), **read_weights_norm(f, self.arch)}
