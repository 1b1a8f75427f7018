"""The hyper-parameters of a model, whatever its family: one frozen dataclass, read from and
written to a GGUF file's <arch>.* keys (each family says which keys it has: its KEYS).

The fields past `arch` are the hyper-parameters only some families have; their defaults are
neutral (no window, no softcap, scales of 1), so a family that lacks one computes as if it
were not there.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..tensor import ShapeError


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
    embedding_scale: float = 1.0    # granite: the input embeddings times this
    residual_scale: float = 1.0     # granite: each block's branch times this before its add
    attention_scale: float = 0.0    # the scores' scale (0: the family's own, 1/sqrt(head_dim))
    logit_scale: float = 1.0        # granite: the logits divided by this
    longrope: bool = False          # phi3: rope_factors_long/short.weight, LongRoPE's factors
    rope_orig_ctx: int = 0          # phi3: the long factors apply when n_ctx exceeds this (0:
                                    # never)
    rope_attn_factor: float = 1.0   # phi3: the rotated dims of Q and K times this (LongRoPE)
    conv_layers: tuple = ()         # lfm2: the blocks whose mixer is a short convolution
    conv_kernel: int = 0            # lfm2: the convolution's length (shortconv.l_cache)

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

    @property
    def family(self):
        """The model family of `arch` (a models.family.Family)."""
        from . import FAMILIES
        return FAMILIES[self.arch]

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
