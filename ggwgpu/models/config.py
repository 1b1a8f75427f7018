"""The hyper-parameters of a model, whatever its family: one frozen dataclass, read from and
written to a GGUF file's <arch>.* keys (each family says which keys it has: its KEYS).

The fields past `arch` are the hyper-parameters only some families have; their defaults are
neutral (no window, no softcap, scales of 1), so a family that lacks one computes as if it
were not there.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..tensor import ShapeError

# rope.scaling.type: llama.cpp's "none" is linear at scale 1; "longrope" (minicpm's files say
# so) is rope_factors_long/short.weight's
ROPE_SCALINGS = ("linear", "yarn", "longrope")
# expert_gating_func: what makes the router's logits the experts' probabilities (llama.cpp's
# llama_expert_gating_func_type; 3 and 4, DeepSeek's and others', are not computed)
GATINGS = {0: "the family's: softmax", 1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class ModelConfig:
    n_vocab: int = 256
    n_embd: int = 256
    n_head: int = 8
    n_layer: int = 16
    n_ff: int = 768
    n_ctx: int = 128
    n_rot: int | None = None        # rotated dims per head; default head_dim (llama.cpp's
                                    # llama loader requires it; the reference had min(64, .))
    norm_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    n_head_kv: int | None = None    # K/V heads (grouped-query attention); default n_head
    n_embd_head: int | None = None  # head size (attention.key_length); default n_embd / n_head
    tied_embeddings: bool = False   # no output.weight: the output projection reads token_embd
    rope_freqs: bool = False        # a rope_freqs.weight of n_rot / 2 frequency factors
                                    # (Llama 3): each rotated pair's angle divided by its own
    arch: str = "llama"             # the family: llama.cpp's general.architecture (models/)
    sliding_window: int = 0         # gemma3's local layers: a query sees the keys less than
                                    # this many positions back (0: no window)
    rope_freq_base_swa: float | None = None   # gemma3's local layers' rope base
    final_logit_softcap: float = 0.0    # logits = c * tanh(logits / c) (0: none)
    attn_logit_softcap: float = 0.0     # gemma2: attention scores (scaled) = c * tanh(s / c)
                                        # before the softmax (0: none)
    embedding_scale: float = 1.0    # granite: the input embeddings times this
    residual_scale: float = 1.0     # granite: each block's branch times this before its add
    attention_scale: float = 0.0    # the scores' scale (0: the family's own, 1/sqrt(head_dim))
    logit_scale: float = 1.0        # granite: the logits divided by this (command-r, cohere2:
                                    # times this; Family.logit_factor)
    longrope: bool = False          # phi3, minicpm: rope_factors_long/short.weight, LongRoPE's
                                    # factors
    rope_orig_ctx: int = 0          # rope.scaling.original_context_length: YaRN's original
                                    # context; phi3's long factors apply when n_ctx exceeds
                                    # it (0: never)
    rope_attn_factor: float = 1.0   # rope.scaling.attn_factor: the rotated dims of Q and K
                                    # times this (llama.cpp's attn_factor; phi3's LongRoPE)
    conv_layers: tuple = ()         # lfm2: the blocks whose mixer is a short convolution
    conv_kernel: int = 0            # lfm2: the convolution's length (shortconv.l_cache)
    n_head_kv_layers: tuple = ()    # K/V heads per layer where layers differ (gemma4's sliding
                                    # and global ones; n_head_kv then holds the most)
    n_ff_layers: tuple = ()         # feed-forward width per layer where layers differ (gemma4's
                                    # double-wide shared-KV layers; n_ff then holds the widest)
    swa_layers: tuple = ()          # gemma4: the layers with a sliding window (the file's
                                    # attention.sliding_window_pattern)
    head_dim_swa: int = 0           # gemma4: the sliding layers' head size (key_length_swa)
    n_rot_swa: int = 0              # gemma4: their rotated dims (rope.dimension_count_swa)
    shared_kv_layers: int = 0       # gemma4: the last this many layers attend to the K/V of an
                                    # earlier layer of their kind instead of their own
    n_embd_per_layer: int = 0       # gemma4: width of the per-layer embeddings (0: none)
    layer_output_scale: bool = False  # gemma4: each block's output times its
                                      # layer_output_scale.weight (one value)
    recurrent_layers: tuple = ()    # qwen35, granitehybrid: the blocks whose mixer is a gated
                                    # delta-net or a Mamba2
    ssm_state: int = 0              # qwen35: the delta-net's head size (ssm.state_size)
    ssm_heads: int = 0              # qwen35: its value heads (ssm.time_step_rank)
    ssm_groups: int = 0             # qwen35: its query/key heads (ssm.group_count)
    rope_sections: tuple = ()       # qwen35: rope.dimension_sections (imrope's t, h, w, e)
    ssm_inner: int = 0              # nemotron_h: a Mamba2 layer's d_inner (ssm.inner_size;
                                    # 0: granitehybrid's 2 n_embd)
    mlp_layers: tuple = ()          # nemotron_h: the blocks that are a feed-forward alone
    mamba_norm: bool = True         # whether the Mamba2 layers RMS-norm their output in groups
                                    # (ssm_norm.weight; falcon-h1 files may have none)
    rope_scaling: str = "linear"    # rope.scaling.type: "linear" (rope_freq_scale scales
                                    # every angle), "yarn" (YaRN: the fast pairs less, and
                                    # cos and sin times 0.1 ln(1 / rope_freq_scale) + 1) or
                                    # "longrope" (the factor tables of `longrope`)
    yarn_beta_fast: float = 32.0    # mistral3: YaRN's ramp starts at the pair that turns this
    yarn_beta_slow: float = 1.0     # many times in rope_orig_ctx, ends at this many
    yarn_log_mul: float = 0.0       # mistral3: rope.scaling.yarn_log_multiplier (transformers'
                                    # mscale_all_dim), YaRN's attn_factor over its mscale
    no_rope: bool = False           # granitehybrid: rope.scaling.finetuned false, no layer ropes
    attn_temp_scale: float = 0.0    # mistral3: Q times ln(floor(pos / rope_orig_ctx) + 1) *
                                    # this + 1 (Llama 4's attention temperature; 0: none)
    n_expert: int = 0               # mixture of experts: each block's feed-forward is this
                                    # many experts (expert_count; 0: one dense feed-forward)
    n_expert_used: int = 0          # the experts each token takes (expert_used_count)
    n_ff_exp: int = 0               # one expert's width (expert_feed_forward_length; 0: the
                                    # family's rule, Family.expert_ff)
    n_ff_shexp: int = 0             # the shared expert's width (expert_shared_feed_forward_
                                    # length; 0: qwen2moe's n_ff, granite's no shared expert)
    expert_gating: int = 0          # expert_gating_func: 2 the router's sigmoids (lfm2moe), 1
                                    # or 0 (the family's, softmax) its softmax
    n_dense_lead: int = 0           # lfm2moe: the first blocks' feed-forward is dense
                                    # (leading_dense_block_count)
    qkv_bias: bool = False          # stablelm: attn_q/k/v.bias, where the file has them (the
                                    # families that always have them say so: Family.qkv_bias)
    fused_gate_up: bool = False     # the experts' gate and up stacks are one, gate | up
                                    # (ffn_gate_up_exps: gemma4's files, the converter's
                                    # --fuse-gate-up-exps)
    expert_weights_scale: float = 0.0   # the taken experts' weights times this (0: 1)
    expert_weights_norm: bool = False   # deepseek2: the taken experts' weights divided by
                                        # their sum (other families: Family.expert_norm)
    expert_bias: bool = False       # deepseek2: exp_probs_b.bias ranks the experts, where
                                    # the file has one (lfm2moe: always)
    q_lora_rank: int = 0            # deepseek2: queries from attn_q_b of a normed attn_q_a
                                    # of this width (0: one attn_q)
    mla_key_length: int = 0         # deepseek2: a query head's width, nope + rope dims
                                    # (attention.key_length_mla)
    mla_value_length: int = 0       # deepseek2: an output head's width (value_length_mla)
    n_positions: int = 0            # gpt2: the rows of its learned position embedding (the
                                    # context it was trained at; n_ctx may be less)
    qk_norm: bool = False           # glm4moe: attn_q_norm / attn_k_norm where the file has them
                                    # (the families that always have them: Family.qk_norm)
    kv_lora_rank: int = 0           # minicpm3: the latent K and V come from (attention.
                                    # kv_lora_rank; deepseek2's is head_dim less its rope dims)
    fused_qkv: bool = False         # Q, K and V from one attn_qkv (rows q | k | v, with its
                                    # bias where the family has biases): the files of the
                                    # converter's --fuse-qkv; read from the tensors
    parallel_residual: bool = False     # gptneox: x + attention(attn_norm x) + feed-forward
                                        # (ffn_norm x), both branches on the block's input

    def __post_init__(self):
        from . import FAMILIES       # the families import this module
        if self.arch not in FAMILIES:
            raise ValueError(f"arch {self.arch!r} is not one of {', '.join(FAMILIES)}")
        if self.n_embd_head is None and self.n_embd % self.n_head:
            raise ShapeError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.kv_heads:
            raise ShapeError(f"n_head {self.n_head} is not a multiple of n_head_kv "
                             f"{self.kv_heads}")
        if self.rot % 2 or not 0 < self.rot <= self.head_dim:
            raise ShapeError(f"n_rot {self.rot} must be even and <= head_dim {self.head_dim}")
        if self.sliding_window < 0:
            raise ShapeError(f"sliding_window {self.sliding_window} must be >= 0")
        object.__setattr__(self, "conv_layers", tuple(int(i) for i in self.conv_layers))
        if any(not 0 <= i < self.n_layer for i in self.conv_layers):
            raise ShapeError(f"conv_layers {self.conv_layers} must be blocks 0 .. "
                             f"{self.n_layer - 1}")
        if self.conv_layers and self.conv_kernel < 2:
            raise ShapeError(f"conv_kernel {self.conv_kernel} must be at least 2")
        for name, per_layer, most in (("n_head_kv", self.n_head_kv_layers, self.kv_heads),
                                      ("n_ff", self.n_ff_layers, self.n_ff)):
            per_layer = tuple(int(v) for v in per_layer)
            object.__setattr__(self, f"{name}_layers", per_layer)
            if per_layer and (len(per_layer) != self.n_layer or max(per_layer) != most
                              or min(per_layer) < 1):
                raise ShapeError(f"{name}_layers {per_layer} must hold {self.n_layer} positive "
                                 f"values, the largest {name} {most}")
        if any(self.n_head % h for h in self.n_head_kv_layers):
            raise ShapeError(f"n_head {self.n_head} is not a multiple of every layer's K/V "
                             f"heads {self.n_head_kv_layers}")
        for name in ("swa_layers", "recurrent_layers", "mlp_layers"):
            layers = tuple(int(i) for i in getattr(self, name))
            object.__setattr__(self, name, layers)
            if any(not 0 <= i < self.n_layer for i in layers):
                raise ShapeError(f"{name} {layers} must be blocks 0 .. {self.n_layer - 1}")
        object.__setattr__(self, "rope_sections", tuple(int(i) for i in self.rope_sections))
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ShapeError(f"rope_scaling {self.rope_scaling!r} must be one of "
                             f"{', '.join(ROPE_SCALINGS)}")
        if (self.rope_scaling == "yarn" or self.attn_temp_scale) and self.rope_orig_ctx < 1:
            raise ShapeError("rope_scaling 'yarn' and attn_temp_scale need rope_orig_ctx, the "
                             "context the model was trained at before scaling")
        if self.n_expert and not 1 <= self.n_expert_used <= self.n_expert or \
                not self.n_expert and self.n_expert_used:
            raise ShapeError(f"n_expert_used {self.n_expert_used} must be 1 .. n_expert "
                             f"{self.n_expert} (0 without experts)")
        if self.expert_gating not in GATINGS:
            raise ShapeError(f"expert_gating {self.expert_gating} is not one of "
                             f"{', '.join(f'{k} ({v})' for k, v in GATINGS.items())}")
        if not 0 <= self.n_dense_lead <= self.n_layer:
            raise ShapeError(f"n_dense_lead {self.n_dense_lead} must be 0 .. n_layer "
                             f"{self.n_layer}")
        if self.n_expert and not self.family.experts:
            raise ShapeError(f"llama.cpp's {self.arch} has no mixture of experts (n_expert "
                             f"{self.n_expert})")
        if not 0 <= self.shared_kv_layers < max(1, self.n_layer):
            raise ShapeError(f"shared_kv_layers {self.shared_kv_layers} must be less than "
                             f"n_layer {self.n_layer}")
        if self.tied_embeddings and self.family.needs_output:
            raise ShapeError(f"llama.cpp's {self.arch} needs its own output matrix "
                             f"(tied_embeddings is not one)")
        if self.fused_qkv and not self.family.fusable_qkv:
            raise ShapeError(f"ggwgpu's {self.arch} reads no fused attn_qkv (fused_qkv)")
        self.family.check(self)

    @property
    def family(self):
        """The model family of `arch` (a models.family.Family)."""
        from . import FAMILIES
        return FAMILIES[self.arch]

    # fields added after files and finetune checkpoints were first written: at their
    # defaults they are left out of the config's JSON (`described`), so that the files of a
    # model without them, and the digest of such a base, stay as they were
    LATER_FIELDS = ("n_head_kv_layers", "n_ff_layers", "swa_layers", "head_dim_swa",
                    "n_rot_swa", "shared_kv_layers", "n_embd_per_layer", "layer_output_scale",
                    "recurrent_layers", "ssm_state", "ssm_heads", "ssm_groups",
                    "rope_sections", "attn_logit_softcap", "rope_scaling",
                    "yarn_beta_fast", "yarn_beta_slow", "yarn_log_mul", "attn_temp_scale",
                    "no_rope", "ssm_inner", "mlp_layers", "mamba_norm", "n_expert",
                    "n_expert_used", "n_ff_exp", "n_ff_shexp", "expert_gating",
                    "n_dense_lead", "fused_gate_up", "qkv_bias", "expert_weights_scale",
                    "expert_weights_norm", "expert_bias", "q_lora_rank", "mla_key_length",
                    "mla_value_length", "n_positions", "parallel_residual",
                    "fused_qkv", "kv_lora_rank", "qk_norm")

    def described(self) -> dict:
        """The config as a JSON-ready dict: every field, but LATER_FIELDS at their
        defaults."""
        defaults = {f.name: f.default for f in fields(self)}
        return {k: v for k, v in asdict(self).items()
                if k not in self.LATER_FIELDS or v != defaults[k]}

    @property
    def head_dim(self) -> int:
        return self.n_embd_head or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head_kv or self.n_head

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of attention's output): n_head * head_dim."""
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and values: n_head_kv * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def rot(self) -> int:
        return self.n_rot if self.n_rot is not None else self.head_dim

    @property
    def rope_mode(self) -> str:
        """The rope op's mode of the family: "normal" (adjacent pairs, llama) or "neox"
        (k, k + n_rot / 2), as llama.cpp ropes each arch."""
        return self.family.rope_mode
