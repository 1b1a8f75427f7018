"""LoRA adapters of a llama: which weights get one, initialisation, GGUF adapter files,
finetune checkpoints, and merging into the base.

An adapter is alpha and, per adapted weight, a pair of f32 matrices under llama.cpp's names
<weight>.lora_a and <weight>.lora_b. Shapes in NumPy order (GGUF's ne reversed), as
llama.cpp's adapter loader validates them:

    weight W (n_out, n_in):             lora_a (r, n_in)      lora_b (n_out, r)
    experts W (n_expert, n_out, n_in):  lora_a (n_expert, r, n_in)   lora_b (n_expert, n_out, r)
    token_embd.weight (n_vocab, n_embd): lora_a (n_vocab, r)   lora_b (n_embd, r)

The layer computes W x + scale * B (A x); the embedding of token t is E[t] + scale * B A[t]
(models/blocks.py); a stack of experts' matrices has a pair per expert, and a token's
product with expert e adds scale * B[e] (A[e] x) (llama.cpp's build_lora_mm_id).
scale = alpha / r with r the rank of that pair (llama.cpp's get_scale; alpha 0 means
scale 1), so pairs of different ranks in one adapter each have their own.

Initialisation as llama.cpp's old finetune: A normal(0, 1) clamped to [-1, 1] and scaled by
1 / sqrt(ne0 + ne1) of A, B zero, so an untrained adapter changes nothing.

Adapter file (`save_adapter` / `load_adapter`), what `llama-cli -m base.gguf --lora FILE` reads:
    general.architecture the base's ("llama" or "qwen2": llama.cpp refuses an adapter of
    another arch than its model's), general.type "adapter", adapter.type "lora",
    adapter.lora.alpha (float32), ggwgpu.lora.base (the base's `model_digest`, for people),
    and the pairs as f32 tensors.
Checkpoint of a LoRA finetune (`save_adapter_checkpoint` / `load_adapter_checkpoint`): the
adapter file plus ggwgpu.checkpoint.version, AdamW's moments as optimizer.adamw.m.<tensor> /
optimizer.adamw.v.<tensor> (or L-BFGS's history) and the training state as training.state_json,
all as ggwgpu.checkpoint writes and checks them for model checkpoints. llama.cpp refuses it as
an adapter (unknown tensors): use the adapter.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from gguf import GGUFValueType

from .training.checkpoint import (CHECKPOINT_VERSION, K_LBFGS_STATE, K_TRAIN_STATE, as_json,
                                  optimizer_tensors, read_run, train_state_json)
from .gguf_file import K_ARCH, K_NAME, K_TYPE, GGUFError, GGUFFile, checked_tensor, write_gguf
from .gguf_llama import K_CKPT_VERSION, OPTIMIZER_TENSOR_PREFIX
from .models import (FAMILIES, LORA_A, LORA_B, OUTPUT, TOKEN_EMBD, ModelConfig, arch_list,
                     matrix_shapes)
from .quant import QUANTIZABLE, Quantized, dequantize, quantize, quantize_model

K_ADAPTER_TYPE = "adapter.type"
K_ALPHA = "adapter.lora.alpha"
K_BASE = "ggwgpu.lora.base"

# llama.cpp's old finetune options (--rank-wq ...) -> the weight they name in each block.
# "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps": the experts' stacks of a mixture of
# experts (a pair per expert; "ffn_gate_up_exps" where gate and up are one stack);
# "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp": its shared expert.
# "wqkv": the fused Q/K/V matrix of families that have one (phi3); "conv_in", "conv_out":
# lfm2's short-convolution projections; "pe_gate", "pe_proj": gemma4's per-layer embedding
# gate and projection; "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out": qwen35's delta-net
# output gate, decay and strength projections and output (its "wqkv" feeds the
# convolution); "ssm_in", "ssm_out": a Mamba2 layer's input (z | x B C | dt) and output
# projections (granitehybrid). A model gets the targets its blocks have.
TARGETS = {"tok_embd": TOKEN_EMBD, "out": OUTPUT,
           "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
           "wqkv": "attn_qkv.weight", "wo": "attn_output.weight", "ffn_gate": "ffn_gate.weight",
           "ffn_down": "ffn_down.weight", "ffn_up": "ffn_up.weight",
           "conv_in": "shortconv.in_proj.weight", "conv_out": "shortconv.out_proj.weight",
           "pe_gate": "inp_gate.weight", "pe_proj": "proj.weight",
           "attn_gate": "attn_gate.weight", "ssm_alpha": "ssm_alpha.weight",
           "ssm_beta": "ssm_beta.weight", "ssm_out": "ssm_out.weight",
           "ssm_in": "ssm_in.weight",
           "ffn_gate_exps": "ffn_gate_exps.weight", "ffn_up_exps": "ffn_up_exps.weight",
           "ffn_down_exps": "ffn_down_exps.weight", "ffn_gate_up_exps": "ffn_gate_up_exps.weight",
           "ffn_gate_shexp": "ffn_gate_shexp.weight",
           "ffn_up_shexp": "ffn_up_shexp.weight", "ffn_down_shexp": "ffn_down_shexp.weight"}
GLOBAL_TARGETS = ("tok_embd", "out")      # not in a block: adapted whatever the layers
_T = GGUFValueType


@dataclass
class Adapter:
    """A LoRA adapter: alpha and its tensors, <weight>.lora_a / <weight>.lora_b -> f32 array."""
    alpha: float
    tensors: dict

    def weights(self) -> list[str]:
        """The names of the weights it adapts."""
        return [n[:-len(LORA_A)] for n in self.tensors if n.endswith(LORA_A)]

    def rank(self, weight: str) -> int:
        return self.tensors[weight + LORA_B].shape[-1]      # lora_b: (.., n_out, r)

    def scale(self, weight: str) -> float:
        """llama.cpp's scale of a pair: alpha / rank, or 1 when alpha is 0."""
        return self.alpha / self.rank(weight) if self.alpha else 1.0


def pair_shapes(cfg: ModelConfig, weight: str, rank: int) -> tuple[tuple, tuple]:
    """(lora_a shape, lora_b shape) of a rank-`rank` pair on `weight` (module docstring)."""
    *experts, n_out, n_in = matrix_shapes(cfg)[weight]
    if weight == TOKEN_EMBD:
        return (n_out, rank), (n_in, rank)
    return (*experts, rank, n_in), (*experts, n_out, rank)


def lora_ranks(cfg: ModelConfig, r: int = 4, ranks: dict | None = None,
               layers=None) -> dict[str, int]:
    """{weight name: rank} of a LoRA finetune: every weight of TARGETS with rank r unless
    `ranks` (TARGETS key -> rank) says otherwise; rank 0 leaves a weight alone. `layers`
    (block indices; default all) limits the block weights; tok_embd and out are not in a block.

    With tied embeddings llama.cpp reads token_embd.weight as the output matrix too and
    cannot apply a pair on either (it has no output.weight to adapt, and would apply the
    token_embd pair to the output as well), so tok_embd and out get no pair unless `ranks`
    asks for one; such an adapter works in ggwgpu and in a merged model only. A target the
    family lacks (wq of a phi3, whose Q, K and V are one fused wqkv) gets no pair, and
    asking for it is an error. A rank above what a matrix can use (its smaller side) is an
    error, but for a matrix narrower than the model (qwen35's ssm_alpha and ssm_beta have a
    row per head) under the common rank r: its pair then takes the rank it can use."""
    shapes = matrix_shapes(cfg)
    blocks = {name.split(".", 2)[2] for name in shapes if name.startswith("blk.")}
    present = {kind for kind, weight in TARGETS.items()
               if (weight in shapes or weight in blocks or cfg.n_layer == 0)
               and weight not in cfg.family.unadapted}
    defaults = {kind: 0 if (cfg.tied_embeddings and kind in GLOBAL_TARGETS)
                or kind not in present else r for kind in TARGETS}
    asked = {k: v for k, v in (ranks or {}).items() if v is not None}
    unknown = set(asked) - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    absent = [k for k, v in asked.items() if v and k not in present]
    if absent and TARGETS[absent[0]] in cfg.family.unadapted:
        raise ValueError(f"llama.cpp's {cfg.arch} applies no LoRA pair to "
                         f"{TARGETS[absent[0]]} ({absent[0]}); its targets: "
                         f"{', '.join(sorted(present))}")
    if absent:
        raise ValueError(f"a {cfg.arch} has no {TARGETS[absent[0]]} for a LoRA pair "
                         f"({absent[0]}); its targets: {', '.join(sorted(present))}")
    ranks = defaults | asked
    layers = range(cfg.n_layer) if layers is None else sorted(set(layers))
    bad = [i for i in layers if not 0 <= i < cfg.n_layer]
    if bad:
        raise ValueError(f"layer {bad[0]} does not exist: the model has layers 0 .. "
                         f"{cfg.n_layer - 1}")
    out = {}
    for kind, rank in ranks.items():
        if rank < 0:
            raise ValueError(f"rank of {kind} must be >= 0, got {rank}")
        if rank == 0:
            continue
        names = [TARGETS[kind]] if kind in GLOBAL_TARGETS else \
            [n for n in (f"blk.{i}.{TARGETS[kind]}" for i in layers) if n in shapes]
        for name in names:  # a rank above the matrix's smaller side adds nothing but memory
            *_, n_out, n_in = shapes[name]
            if rank > min(n_out, n_in) and (kind in asked or min(n_out, n_in) >= cfg.n_embd):
                raise ValueError(f"rank {rank} of {kind} is more than {name} "
                                 f"({n_out} x {n_in}) can use: at most {min(n_out, n_in)}")
            out[name] = min(rank, n_out, n_in)  # the default r: as much as a small one takes
    if not out:
        raise ValueError("no weight gets a LoRA pair: every rank is 0 or no layer is chosen")
    return out


def pair_values(cfg: ModelConfig, ranks: dict[str, int]) -> int:
    """Values of the LoRA pairs `ranks` asks for (A and B together), before making them."""
    return sum(math.prod(a) + math.prod(b) for a, b in
               (pair_shapes(cfg, weight, rank) for weight, rank in ranks.items()))


def init_adapter(cfg: ModelConfig, ranks: dict[str, int], alpha: float,
                 seed: int = 0) -> Adapter:
    """A fresh adapter with pairs of the given ranks: A random (old finetune's init), B 0."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for weight in matrix_shapes(cfg):             # model order: stable files and draws
        if weight not in ranks:
            continue
        a_shape, b_shape = pair_shapes(cfg, weight, ranks[weight])
        a = np.clip(rng.standard_normal(a_shape), -1.0, 1.0) / np.sqrt(sum(a_shape[-2:]))
        tensors[weight + LORA_A] = a.astype(np.float32)
        tensors[weight + LORA_B] = np.zeros(b_shape, np.float32)
    return Adapter(float(alpha), tensors)


def check_adapter(adapter: Adapter, cfg: ModelConfig, where) -> None:
    """Raise GGUFError (naming `where` and the tensor) unless every tensor of `adapter` is
    half of a complete pair on a matrix of `cfg` with llama.cpp's shapes."""
    shapes = matrix_shapes(cfg)
    for name in adapter.tensors:
        if not name.endswith((LORA_A, LORA_B)):
            raise GGUFError(f"{where}: LoRA tensor {name} has an unexpected suffix (expected "
                            f"{LORA_A} or {LORA_B})")
        weight, other = ((name[:-len(LORA_A)], LORA_B) if name.endswith(LORA_A)
                         else (name[:-len(LORA_B)], LORA_A))
        if weight + other not in adapter.tensors:
            raise GGUFError(f"{where}: LoRA tensor {name} has no {weight + other}")
        if weight not in shapes:
            raise GGUFError(f"{where}: LoRA tensor {name} adapts {weight}, which is not a "
                            f"matrix of this base model (wrong base?)")
    for weight in adapter.weights():
        a, b = adapter.tensors[weight + LORA_A], adapter.tensors[weight + LORA_B]
        rank = b.shape[-1] if b.ndim >= 2 else 0
        if (a.shape, b.shape) != pair_shapes(cfg, weight, rank) or rank < 1:
            want_a, want_b = pair_shapes(cfg, weight, max(rank, 1))
            raise GGUFError(f"{where}: LoRA pair of {weight} has shapes {a.shape} and "
                            f"{b.shape}, the base needs {want_a} and {want_b} with the same "
                            f"rank r in place of {max(rank, 1)} (wrong base?)")


# -- files ------------------------------------------------------------------------------------

def _adapter_metadata(adapter: Adapter, cfg: ModelConfig, base_digest: str | None) -> dict:
    meta = {K_ARCH: (cfg.arch, _T.STRING), K_NAME: ("ggwgpu LoRA adapter", _T.STRING),
            K_TYPE: ("adapter", _T.STRING), K_ADAPTER_TYPE: ("lora", _T.STRING),
            K_ALPHA: (float(adapter.alpha), _T.FLOAT32)}
    if base_digest:
        meta[K_BASE] = (base_digest, _T.STRING)
    return meta


def _checked_tensors(path, tensors: dict, what: str) -> dict:
    return {name: checked_tensor(path, name, value, np.shape(value), what)
            for name, value in tensors.items()}


def save_adapter(path, adapter: Adapter, cfg: ModelConfig, base_digest: str | None = None):
    """Write `adapter` (checked against `cfg`) as a llama.cpp LoRA adapter GGUF, atomically."""
    check_adapter(adapter, cfg, path)
    write_gguf(path, _adapter_metadata(adapter, cfg, base_digest),
                _checked_tensors(path, adapter.tensors, "adapter"))


def save_adapter_checkpoint(path, adapter: Adapter, cfg: ModelConfig, opt_state: dict,
                            train_state):
    """Write a LoRA finetune checkpoint: the adapter, AdamW's (m, v) per adapter tensor and
    the training state (a RunState whose base is the base's digest; or, to forge a file, a
    dict). Atomic."""
    check_adapter(adapter, cfg, path)
    state_json = train_state_json(path, train_state)
    state = as_json(train_state)
    meta = _adapter_metadata(adapter, cfg, state.get("base") if isinstance(state, dict) else None)
    meta[K_CKPT_VERSION] = (CHECKPOINT_VERSION, _T.UINT32)
    meta[K_TRAIN_STATE] = (state_json, _T.STRING)
    tensors = _checked_tensors(path, adapter.tensors, "checkpoint")
    optimizer, lbfgs_json = optimizer_tensors(path, opt_state, _shapes(adapter),
                                              "a tensor of the adapter")
    if lbfgs_json is not None:
        meta[K_LBFGS_STATE] = (lbfgs_json, _T.STRING)
    write_gguf(path, meta, {**tensors, **optimizer})


def _shapes(adapter: Adapter) -> dict[str, tuple]:
    """Name -> shape of the adapter's tensors: the ones a finetune trains."""
    return {name: value.shape for name, value in adapter.tensors.items()}


def _read_adapter(f: GGUFFile, cfg: ModelConfig | None, checkpoint: bool) -> Adapter:
    for key, want in ((K_TYPE, "adapter"), (K_ADAPTER_TYPE, "lora")):
        if f.meta.get(key) != want:
            raise GGUFError(f"{f.path}: {key} is {f.meta.get(key)!r}, a LoRA adapter of a "
                            f"llama has {want!r}")
    arch = f.str_key(K_ARCH, None)
    if cfg is not None and arch != cfg.arch:    # llama.cpp refuses it as well
        raise GGUFError(f"{f.path}: {K_ARCH} is {arch!r}, but the base model is a "
                        f"{cfg.arch!r}: an adapter of another model")
    if arch not in FAMILIES:
        raise GGUFError(f"{f.path}: {K_ARCH} is {arch!r}; ggwgpu reads adapters of "
                        f"{arch_list()} models only")
    alpha = f.float_key(K_ALPHA, default=0.0, allow_zero=True)   # llama.cpp: missing is 0
    tensors = {}
    for name in f.tensors:
        if checkpoint and name.startswith(OPTIMIZER_TENSOR_PREFIX):
            continue
        if name.endswith("_norm.weight"):     # llama.cpp skips norm adapters too
            continue
        tensors[name] = f.tensor_value(name, f.numpy_shape(name))
    if not tensors:
        raise GGUFError(f"{f.path}: the adapter has no LoRA tensors")
    adapter = Adapter(alpha, tensors)
    if cfg is not None:
        check_adapter(adapter, cfg, f.path)
    return adapter


def load_adapter(path, cfg: ModelConfig | None = None) -> Adapter:
    """Read a LoRA adapter GGUF (ours or llama.cpp's: f32, f16 or q8_0 tensors, read as f32),
    validated as llama.cpp does and, given `cfg`, against the base's shapes. Raises GGUFError
    naming the file and the key or tensor."""
    f = GGUFFile(path)
    if K_CKPT_VERSION in f.meta:
        raise GGUFError(f"{f.path}: is a finetune checkpoint, not an adapter (resume from it "
                        f"with --checkpoint-in)")
    return _read_adapter(f, cfg, checkpoint=False)


def load_adapter_checkpoint(path, cfg: ModelConfig):
    """Read `save_adapter_checkpoint`'s file: (adapter, opt_state, RunState)."""
    f = GGUFFile(path)
    if f.meta.get(K_CKPT_VERSION) != CHECKPOINT_VERSION:
        raise GGUFError(f"{f.path}: is not a LoRA finetune checkpoint of this ggwgpu "
                        f"({K_CKPT_VERSION} is {f.meta.get(K_CKPT_VERSION)!r})")
    adapter = _read_adapter(f, cfg, checkpoint=True)
    return (adapter, *read_run(f, _shapes(adapter)))


# -- merging and identity ---------------------------------------------------------------------

# How a merge stores its weights: "auto" as llama.cpp's llama-export-lora does (the weights
# no pair changes keep their stored type, bytes unchanged; the changed ones f16, or f32 where
# the base held f32), "f32" every weight f32, or a block type for every weight
# quant.quantize_model would put in it (those already in it and unchanged kept as they are)
MERGE_TYPES = ("auto", "f32") + QUANTIZABLE


def merge(cfg: ModelConfig, values: dict, adapters, dtype: str = "auto"
          ) -> tuple[ModelConfig, dict]:
    """(cfg, values) of the base with every adapter's pairs added: W + scale * B A (per
    expert for a stack of experts, over its per-expert output scale where it has one), and
    E + scale * A B^T for the token embedding (sums in float64 over the dequantized
    weight), stored as `dtype` (one of MERGE_TYPES) says. A pair on either side of tied
    embeddings unties them: the merged model gets its own output.weight (the base's
    token_embd plus the output's pairs)."""
    if dtype not in MERGE_TYPES:
        raise ValueError(f"cannot store a merged model as {dtype!r}; one of "
                         f"{', '.join(MERGE_TYPES)}")
    stored, changed = dict(values), {}
    if cfg.tied_embeddings and any(w in (TOKEN_EMBD, OUTPUT) for a in adapters
                                   for w in a.weights()):
        cfg = dataclasses.replace(cfg, tied_embeddings=False)
        stored[OUTPUT] = stored[TOKEN_EMBD]
    for adapter in adapters:
        for weight in adapter.weights():
            a = adapter.tensors[weight + LORA_A].astype(np.float64)
            b = adapter.tensors[weight + LORA_B].astype(np.float64)
            delta = a @ b.T if weight == TOKEN_EMBD else b @ a
            delta = unscaled(stored, weight, delta)
            before = changed.get(weight, stored[weight])
            before = dequantize(before) if isinstance(before, Quantized) else before
            changed[weight] = (np.asarray(before, np.float32) + adapter.scale(weight) * delta
                               ).astype(np.float32)
    if dtype == "auto":
        return cfg, {**stored, **{n: v if not isinstance(stored[n], Quantized)
                                  else quantize(v, "f16") for n, v in changed.items()}}
    kept = {n: v for n, v in stored.items() if n not in changed and isinstance(v, Quantized)
            and v.dtype == dtype}
    merged = {n: (dequantize(v) if isinstance(v, Quantized) else np.asarray(v, np.float32))
              for n, v in {**stored, **changed}.items() if n not in kept}
    return cfg, merged if dtype == "f32" else {**quantize_model(merged, dtype), **kept}


def unscaled(values: dict, weight: str, delta: np.ndarray) -> np.ndarray:
    """A stack of experts' change `delta` over the per-expert scales the stack's output is
    multiplied by (gemma4's ffn_down_exps.scale), which a pair's term escapes at run time
    (llama.cpp's build_lora_mm_id scales before it adds the pairs): merged, the change then
    gives the pair's term."""
    name = weight.removesuffix(".weight") + ".scale"
    if delta.ndim != 3 or name not in values:
        return delta
    scales = np.asarray(values[name], np.float64)
    if np.any(scales == 0):
        raise ValueError(f"cannot merge the pairs on {weight}: {name} is 0 for expert "
                         f"{int(np.flatnonzero(scales == 0)[0])}, whose output it zeroes")
    return delta / scales[:, None, None]


def model_digest(cfg: ModelConfig, values: dict) -> str:
    """Identifies a base model (its config and every weight's bytes): a finetune checkpoint
    records it so that resuming onto another base is refused."""
    h = hashlib.sha256(json.dumps(cfg.described(), sort_keys=True).encode())
    for name in sorted(values):
        v = values[name]
        data = v.data if isinstance(v, Quantized) else np.ascontiguousarray(v, np.float32)
        h.update(name.encode() + b"\0" + (v.dtype if isinstance(v, Quantized) else "f32").encode())
        h.update(data.tobytes())
    return h.hexdigest()[:16]
