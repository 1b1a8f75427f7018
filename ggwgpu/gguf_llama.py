"""The llama schema of GGUF files: a ModelConfig's hyper-parameters as <arch>.* keys and back,
the parameters as tensors under llama.cpp's names, general.file_type, and the model files
that llama.cpp loads (`save_model` / `load_model`). Every family (ModelConfig.arch, one of
models.FAMILIES: llama, qwen2, qwen3, gemma2, gemma3, smollm3, phi3, granite, lfm2, gemma4,
qwen35, olmo2, ernie4_5, exaone4, mistral3, hunyuan-dense, minicpm, arcee, glm4,
granitehybrid, nemotron_h, falcon-h1) shares it: the keys are the same under the prefix
"<arch>.", and each family's module adds its own keys and tensors (docs/families.md). Built
on the container, ggwgpu.gguf_file; checkpoints (ggwgpu.checkpoint) and adapters
(ggwgpu.lora) are model files with more.

Model file
    general.architecture, the family (<arch> below), general.name, general.type "model",
    general.file_type 0
    (0: all f32, else the block type holding most values: ggwgpu.quant's TYPES, e.g.
    1 MOSTLY_F16, 2 MOSTLY_Q4_0, 3 MOSTLY_Q4_1, 7 MOSTLY_Q8_0); <arch>.context_length,
    .embedding_length, .block_count, .feed_forward_length (an array of one per layer where
    layers differ), .attention.head_count, .attention.head_count_kv (fewer than head_count:
    grouped-query attention; an array where layers differ),
    .attention.key_length and .value_length (only when the head size is not
    embedding_length / head_count), .rope.dimension_count, .rope.freq_base,
    .attention.layer_norm_rms_epsilon, .vocab_size, and, when
    rope_freq_scale != 1 or YaRN or LongRoPE, .rope.scaling.type ("linear", "yarn" or
    "longrope") with .rope.scaling.factor = 1 / rope_freq_scale (llama.cpp reads
    freq_scale = 1 / factor), .rope.scaling.original_context_length and
    .rope.scaling.attn_factor where set; the tokenizer's tokenizer.ggml.* keys;
    ggwgpu.config_json, the ModelConfig as JSON, so that float hyper-parameters come back
    exactly rather than rounded to float32. Tensors: the
    parameters under llama.cpp's names (`parameter_shapes`: no output.weight when the
    embeddings are tied, rope_freqs.weight for Llama 3's frequency factors, the Q/K/V biases
    of qwen2), shapes in NumPy order (gguf-py writes them reversed, as ggml's ne); f32, or a
    block type (F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K) for `Quantized` values (frozen
    weights, ggwgpu.quant), written as their raw blocks. Reading takes F32 and those block types.

Reading checks the keys, tensor types and shapes against the hyper-parameters after the
container's layout check; every problem is a `GGUFError` naming the file and the key or
tensor (the tokenizer's `VocabError` is one too).
"""
from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGUFValueType, Keys, LlamaFileType, RopeScalingType

from .gguf_file import (K_ARCH, K_FILE_TYPE, K_NAME, K_TYPE, GGUFError, GGUFFile,
                        checked_tensor, typed_metadata, write_gguf)
from .models import (FAMILIES, MISSING, OUTPUT, ROPE_FREQS, ROPE_TABLES, ModelConfig,
                     arch_list, parameter_shapes)
from .models.blocks import ROPE_LONG, ROPE_SHORT
from .quant import TYPES, Quantized
from .tensor import ShapeError
from .tokenizer import Tokenizer, tokenizer_from_metadata


# The <arch>.* hyper-parameter keys, in llama.cpp's spelling (gguf-py's Keys templates)
ARCH_KEY_TEMPLATES = dict(
    ctx=Keys.LLM.CONTEXT_LENGTH, embd=Keys.LLM.EMBEDDING_LENGTH, layers=Keys.LLM.BLOCK_COUNT,
    ff=Keys.LLM.FEED_FORWARD_LENGTH, vocab=Keys.LLM.VOCAB_SIZE,
    heads=Keys.Attention.HEAD_COUNT, heads_kv=Keys.Attention.HEAD_COUNT_KV,
    key_length=Keys.Attention.KEY_LENGTH, value_length=Keys.Attention.VALUE_LENGTH,
    eps=Keys.Attention.LAYERNORM_RMS_EPS, layer_norm_eps=Keys.Attention.LAYERNORM_EPS,
    rot=Keys.Rope.DIMENSION_COUNT,
    freq_base=Keys.Rope.FREQ_BASE, scaling_type=Keys.Rope.SCALING_TYPE,
    scaling_factor=Keys.Rope.SCALING_FACTOR, orig_ctx=Keys.Rope.SCALING_ORIG_CTX_LEN,
    attn_factor=Keys.Rope.SCALING_ATTN_FACTOR,
    scale_linear_old="{arch}.rope.scale_linear")   # llama.cpp's older name, read only


def arch_keys(arch: str) -> SimpleNamespace:
    """The hyper-parameter keys of `arch` (one of models.FAMILIES), by the names of
    ARCH_KEY_TEMPLATES: `arch_keys("qwen2").ctx` is "qwen2.context_length"."""
    return SimpleNamespace(**{name: t.format(arch=arch)
                              for name, t in ARCH_KEY_TEMPLATES.items()})


K_TOKENS = Keys.Tokenizer.LIST
TOKENIZER_PREFIX = "tokenizer."

# ggwgpu's own key: the exact ModelConfig.
K_CONFIG_JSON = "ggwgpu.config_json"
# A checkpoint (ggwgpu.checkpoint) is a model file marked by this key, with optimizer.*
# tensors beside the parameters: `load_model` reads it as the model it holds.
K_CKPT_VERSION = "ggwgpu.checkpoint.version"
OPTIMIZER_TENSOR_PREFIX = "optimizer."

MIN_ROPE_FACTOR, MAX_ROPE_FACTOR = 1e-3, 1e4   # published files use 2 .. 64
# rope.scaling.type values read ("none": linear at factor 1); YaRN's own keys
# (rope.scaling.yarn_*) are read by mistral3 alone, as llama.cpp reads them
ROPE_SCALING_TYPES = ("linear", "none", "yarn", "longrope")
MIN_BLOCK_TENSORS = 6       # no family's block has fewer (phi3's, fused)
FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
_T = GGUFValueType


# -- writing ----------------------------------------------------------------------------------

def save_model(path, cfg: ModelConfig, params: dict, tokenizer: Tokenizer,
               extra: dict | None = None):
    """Write a GGUF of cfg.arch that llama.cpp loads: the keys and tensors of the module
    docstring.

    `params` maps every name of `parameter_shapes(cfg)` to a float array of that shape (any
    float dtype; written as f32) or a `Quantized` value (written as its GGUF type, bytes
    unchanged). `tokenizer.gguf_metadata()` gives the tokenizer.ggml.* keys.
    `extra` adds metadata keys, typed like the tokenizer's (str, bool, int -> uint32, float
    -> float32, lists of str/int/float); it may replace general.name but no other key.
    Raises GGUFError before anything is written if a name, shape or value is wrong; the write
    itself is atomic.
    """
    path = Path(path)
    tensors = checked_params(path, cfg, params)
    if cfg.rot != cfg.head_dim and not cfg.family.partial_rope:
        warnings.warn(f"{path}: n_rot {cfg.rot} != head_dim {cfg.head_dim}: llama.cpp refuses "
                      f"{cfg.arch} models whose rope dimension count is not the head size",
                      stacklevel=2)
    metadata = model_metadata(path, cfg, tokenizer, extra)
    metadata[K_FILE_TYPE] = (int(_file_type(tensors)), _T.UINT32)
    write_gguf(path, metadata, tensors)


def _file_type(tensors) -> int:
    """llama.cpp's general.file_type: the block type that holds most values, else all f32."""
    counts = {}
    for t in tensors.values():
        if isinstance(t, Quantized):
            counts[t.dtype] = counts.get(t.dtype, 0) + int(np.prod(t.shape))
    return TYPES[max(counts, key=counts.get)].file_type if counts else LlamaFileType.ALL_F32


def checked_params(path, cfg, params) -> dict[str, np.ndarray]:
    """The parameters as contiguous f32 arrays in `parameter_shapes` order, each checked."""
    if not isinstance(cfg, ModelConfig):
        raise GGUFError(f"{path}: cannot write: cfg must be a ModelConfig, got "
                        f"{type(cfg).__name__}")
    shapes = parameter_shapes(cfg)
    missing = [n for n in shapes if n not in params]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GGUFError(f"{path}: cannot write: parameter {missing[0]} is missing{more}")
    unknown = [n for n in params if n not in shapes]
    if unknown:
        raise GGUFError(f"{path}: cannot write: {unknown[0]!r} is not a parameter of a "
                        f"{cfg.arch} with n_layer {cfg.n_layer}")
    return {n: checked_tensor(path, n, params[n], shape, "model") for n, shape in shapes.items()}


def _hparams(cfg: ModelConfig) -> dict[str, tuple[object, GGUFValueType]]:
    """The <arch>.* keys of `cfg`, as written (and compared when reading back)."""
    k = arch_keys(cfg.arch)
    keys = {
        k.ctx: (cfg.n_ctx, _T.UINT32), k.embd: (cfg.n_embd, _T.UINT32),
        k.layers: (cfg.n_layer, _T.UINT32), k.ff: (cfg.n_ff, _T.UINT32),
        k.heads: (cfg.n_head, _T.UINT32), k.heads_kv: (cfg.kv_heads, _T.UINT32),
        k.rot: (cfg.rot, _T.UINT32), k.freq_base: (float(cfg.rope_freq_base), _T.FLOAT32),
        k.eps: (float(cfg.norm_eps), _T.FLOAT32), k.vocab: (cfg.n_vocab, _T.UINT32),
    }
    kv_free = cfg.family.kv_free_layers(cfg)
    if kv_free:     # K/V heads per layer, 0 for lfm2's convolutions, granitehybrid's Mamba2
        keys[k.heads_kv] = ([0 if i in kv_free else cfg.kv_heads
                             for i in range(cfg.n_layer)], _T.ARRAY)
    if cfg.n_head_kv_layers:    # per layer where layers differ (gemma4)
        keys[k.heads_kv] = (list(cfg.n_head_kv_layers), _T.ARRAY)
    if cfg.n_ff_layers:
        keys[k.ff] = (list(cfg.n_ff_layers), _T.ARRAY)
    if cfg.family.ff_free:
        keys[k.ff] = ([cfg.n_ff if i in cfg.mlp_layers else 0 for i in range(cfg.n_layer)],
                      _T.ARRAY)
    if cfg.n_embd_head is not None:
        keys[k.key_length] = keys[k.value_length] = (cfg.head_dim, _T.UINT32)
    if cfg.rope_freq_scale != 1.0 or cfg.rope_scaling != "linear":
        keys[k.scaling_type] = (cfg.rope_scaling, _T.STRING)
        keys[k.scaling_factor] = (1.0 / cfg.rope_freq_scale, _T.FLOAT32)
    if cfg.rope_orig_ctx:
        keys[k.orig_ctx] = (cfg.rope_orig_ctx, _T.UINT32)
    if cfg.rope_attn_factor != 1.0:
        keys[k.attn_factor] = (float(cfg.rope_attn_factor), _T.FLOAT32)
    for field, template in cfg.family.keys.items():     # where set (models.family)
        value = getattr(cfg, field)
        if value != FIELD_DEFAULTS[field] or field in cfg.family.required or \
                field in cfg.family.absent:
            keys[template.format(arch=cfg.arch)] = \
                (value, _T.UINT32 if isinstance(value, int) else _T.FLOAT32)
    keys.update(cfg.family.more_keys(cfg))
    return keys


def model_metadata(path, cfg: ModelConfig, tokenizer: Tokenizer,
                   extra) -> dict[str, tuple[object, GGUFValueType]]:
    """Every key of a model file, in writing order, as key -> (value, GGUF type)."""
    meta = {K_ARCH: (cfg.arch, _T.STRING),
            K_NAME: (f"ggwgpu {cfg.arch} {cfg.n_layer}x{cfg.n_embd}", _T.STRING),
            K_TYPE: ("model", _T.STRING),
            K_FILE_TYPE: (int(LlamaFileType.ALL_F32), _T.UINT32)}
    meta.update(_hparams(cfg))
    meta[K_CONFIG_JSON] = (json.dumps(cfg.described()), _T.STRING)
    vocabulary = tokenizer.gguf_metadata()
    for key in vocabulary:
        if not key.startswith(TOKENIZER_PREFIX):
            raise GGUFError(f"{path}: cannot write: the tokenizer gave key {key!r}, which is "
                            f"not a {TOKENIZER_PREFIX}* key")
    meta.update(typed_metadata(path, vocabulary))
    extra = extra or {}
    for key in extra:
        if key in meta and key != K_NAME:
            raise GGUFError(f"{path}: cannot write: extra key {key!r} would replace a key "
                            f"the model itself defines")
    meta.update(typed_metadata(path, extra))
    return meta


# -- reading ----------------------------------------------------------------------------------

def load_model(path, keep_quantized: bool = False) -> tuple[ModelConfig, dict, Tokenizer]:
    """Read a GGUF of a family ggwgpu builds (ours, a checkpoint, or llama.cpp's files in F32
    and the block types of ggwgpu.quant's TYPES) and return (cfg, params, tokenizer): params as float32
    arrays that own their memory (block types dequantized), tokenizer from
    `tokenizer.tokenizer_from_metadata`. With keep_quantized, 2-D tensors and stacks of
    experts' matrices (3-D) stored in a block type (F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K)
    come back as `Quantized`
    values in their storage type instead (frozen weights for `constant()`; 1-D ones, the
    norms, and the family's values_only, convolution taps, are still converted). A file without output.weight has tied embeddings
    (cfg.tied_embeddings: the output projection reads token_embd.weight, as in llama.cpp).
    Other tensor types raise a GGUFError naming tensor and type."""
    f = GGUFFile(path)
    cfg, tokenizer = read_model(f)
    params = read_params(f, cfg, K_CKPT_VERSION in f.meta, keep_quantized)
    return cfg, params, tokenizer


def read_model(f: GGUFFile) -> tuple[ModelConfig, Tokenizer]:
    """(cfg, tokenizer) from a file's general.*, <arch>.* and tokenizer.* keys."""
    arch = f.str_key(K_ARCH)
    if arch not in FAMILIES:
        lacks = f" (ggwgpu does not compute its {MISSING[arch]} yet)" if arch in MISSING else ""
        raise GGUFError(f"{f.path}: {K_ARCH} is {arch!r}{lacks}; ggwgpu reads "
                        f"{arch_list()} models only")
    k = arch_keys(arch)
    n_embd, n_head = f.int_key(k.embd), f.int_key(k.heads)
    n_layer = f.int_key(k.layers, minimum=0)
    # nemotron_h's files may hold only the layer norm's epsilon, which llama.cpp then takes
    eps = k.eps if k.eps in f.meta or not FAMILIES[arch].layer_norm_eps_fallback \
        else k.layer_norm_eps
    hp = dict(arch=arch, n_embd=n_embd, n_head=n_head, n_layer=n_layer,
              n_ctx=f.int_key(k.ctx), norm_eps=f.float_key(eps),
              rope_freq_base=f.float_key(k.freq_base, default=10000.0))
    n_ff = f.meta.get(k.ff)
    if isinstance(n_ff, list) and FAMILIES[arch].ff_free:   # nemotron_h: 0 where no feed-forward
        n_ff = per_layer(f, k.ff, n_ff, n_layer, 0)
        hp["n_ff"] = max(n_ff)
        hp["mlp_layers"] = tuple(i for i, v in enumerate(n_ff) if v)
        if len(set(n_ff) - {0}) > 1:
            raise GGUFError(f"{f.path}: {k.ff} must hold 0 or one other value per layer, got "
                            f"{n_ff[:8]}")
    elif isinstance(n_ff, list):      # per layer (gemma4's double-wide layers)
        n_ff = per_layer(f, k.ff, n_ff, n_layer, 1)
        hp["n_ff"] = max(n_ff)
        hp["n_ff_layers"] = n_ff if len(set(n_ff)) > 1 else ()
    else:
        hp["n_ff"] = f.int_key(k.ff)
    n_head_kv = f.meta.get(k.heads_kv, n_head)
    if isinstance(n_head_kv, list) and 0 in n_head_kv:   # 0 where a block does not attend
        kinds = set(per_layer(f, k.heads_kv, n_head_kv, n_layer, 0)) - {0}
        if len(kinds) > 1:
            raise GGUFError(f"{f.path}: {k.heads_kv} must hold 0 or one other value per "
                            f"layer, got {n_head_kv[:8]}")
        hp.update(FAMILIES[arch].kv_free_fields(
            tuple(i for i, v in enumerate(n_head_kv) if v == 0), hp))
        n_head_kv = kinds.pop() if kinds else n_head    # no layer attends: the family says
    elif isinstance(n_head_kv, list):   # per layer (gemma4's sliding and global layers)
        n_head_kv = per_layer(f, k.heads_kv, n_head_kv, n_layer, 1)
        if any(n_head % h for h in n_head_kv):
            raise GGUFError(f"{f.path}: {k.heads} = {n_head} is not a multiple of every "
                            f"layer's {k.heads_kv} {list(n_head_kv)[:8]}")
        hp["n_head_kv_layers"] = n_head_kv if len(set(n_head_kv)) > 1 else ()
        n_head_kv = max(n_head_kv)
    else:
        n_head_kv = f.int_key(k.heads_kv, default=n_head)
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: {k.heads} = {n_head} is not a multiple of {k.heads_kv} = "
                        f"{n_head_kv}")
    hp["n_head_kv"] = n_head_kv if n_head_kv != n_head else None
    head_dim = f.int_key(k.key_length, default=None)
    if head_dim is None:
        if n_embd % n_head:
            raise GGUFError(f"{f.path}: {k.embd} = {n_embd} is not divisible by {k.heads} = "
                            f"{n_head}")
        head_dim = n_embd // n_head
    elif head_dim != n_embd // n_head or n_embd % n_head:
        hp["n_embd_head"] = head_dim
    if f.int_key(k.value_length, default=head_dim) != head_dim and not FAMILIES[arch].mla:
        raise GGUFError(f"{f.path}: {k.value_length} = {f.meta[k.value_length]} differs from "
                        f"{k.key_length} = {head_dim}: ggwgpu's llama needs one head size")
    hp["n_rot"] = f.int_key(k.rot, default=head_dim)
    if hp["n_rot"] % 2 or hp["n_rot"] > head_dim:
        raise GGUFError(f"{f.path}: {k.rot} = {hp['n_rot']} must be even and at most the head "
                        f"size {head_dim}")
    hp["tied_embeddings"] = OUTPUT not in f.tensors
    hp["fused_gate_up"] = any(name.endswith(".ffn_gate_up_exps.weight") for name in f.tensors)
    hp["fused_qkv"] = FAMILIES[arch].fusable_qkv and \
        any(name.endswith(".attn_qkv.weight") for name in f.tensors)
    hp["rope_freqs"] = ROPE_FREQS in f.tensors
    hp["longrope"] = ROPE_LONG in f.tensors or ROPE_SHORT in f.tensors
    scaling = f.meta.get(k.scaling_type, RopeScalingType.LINEAR.value)
    if scaling not in ROPE_SCALING_TYPES:
        raise GGUFError(f"{f.path}: {k.scaling_type} {scaling!r} is not supported (only "
                        f"{', '.join(map(repr, ROPE_SCALING_TYPES))})")
    hp["rope_scaling"] = scaling if scaling in ("yarn", "longrope") else "linear"
    factor = f.float_key(k.scaling_factor, default=None, allow_zero=True)
    if factor is None:
        factor = f.float_key(k.scale_linear_old, default=None, allow_zero=True)
    # llama.cpp: freq_scale = 1 / factor, a missing or zero factor meaning 1.
    hp["rope_freq_scale"] = 1.0 if scaling == "none" or not factor else 1.0 / factor
    if not MIN_ROPE_FACTOR <= 1.0 / hp["rope_freq_scale"] <= MAX_ROPE_FACTOR:
        raise GGUFError(f"{f.path}: {k.scaling_factor} = {factor!r} is not a plausible rope "
                        f"scaling factor ({MIN_ROPE_FACTOR:g} .. {MAX_ROPE_FACTOR:g}): the "
                        f"rotation angles would overflow or vanish")
    # llama.cpp's n_ctx_orig_yarn: the key, else the trained context
    hp["rope_orig_ctx"] = f.int_key(k.orig_ctx, default=0, minimum=0)
    if scaling in ("yarn", "longrope"):
        hp["rope_orig_ctx"] = hp["rope_orig_ctx"] or hp["n_ctx"]
    hp["rope_attn_factor"] = f.float_key(k.attn_factor, default=1.0, allow_zero=True) or 1.0

    family = FAMILIES[arch]
    for field, template in family.keys.items():     # 0 or absent: unset (models.family)
        key = template.format(arch=arch)
        default = ... if field in family.required else \
            family.absent.get(field, FIELD_DEFAULTS[field])
        if isinstance(FIELD_DEFAULTS[field], int):
            value = f.int_key(key, default=default, minimum=0)
        else:
            value = f.float_key(key, default=default, allow_zero=True)
        hp[field] = value or FIELD_DEFAULTS[field]
    hp.update(family.read_more_keys(f, hp))

    meta = {key: v for key, v in f.meta.items() if key.startswith(TOKENIZER_PREFIX)}
    if K_TOKENS not in meta:
        raise GGUFError(f"{f.path}: required key {K_TOKENS} is missing (the file has no "
                        f"vocabulary)")
    tokens = meta[K_TOKENS]
    if not isinstance(tokens, list):
        raise GGUFError(f"{f.path}: key {K_TOKENS} must be an array of strings")
    n_vocab = len(tokens)
    if k.vocab in f.meta and f.int_key(k.vocab) != n_vocab:
        raise GGUFError(f"{f.path}: vocabulary size mismatch: {k.vocab} = {f.meta[k.vocab]} "
                        f"but {K_TOKENS} has {n_vocab} tokens")
    try:
        tokenizer = tokenizer_from_metadata(meta)
    except GGUFError as e:
        raise GGUFError(f"{f.path}: bad vocabulary: {e}") from None

    # A forged block count must not make us enumerate billions of tensor names.
    least = MIN_BLOCK_TENSORS * n_layer
    if least > len(f.tensors):
        raise GGUFError(f"{f.path}: {k.layers} = {n_layer} needs at least {least} "
                        f"tensors, the file has {len(f.tensors)}")
    try:
        cfg = ModelConfig(n_vocab=n_vocab, **hp)
    except ShapeError as e:
        raise GGUFError(f"{f.path}: the {arch}.* hyper-parameters are inconsistent: {e}") from None
    return _exact_config(f, cfg), tokenizer


def per_layer(f: GGUFFile, key: str, values, n_layer: int, minimum: int) -> tuple:
    """The array key `key` of one integer per layer, each at least `minimum`."""
    if len(values) != n_layer or \
            not all(isinstance(v, int) and minimum <= v < 2 ** 31 for v in values):
        raise GGUFError(f"{f.path}: {key} must hold {n_layer} integers of at least {minimum}, "
                        f"one per layer, got {values[:8]}")
    return tuple(values)


def _exact_config(f: GGUFFile, cfg: ModelConfig) -> ModelConfig:
    """The ModelConfig of ggwgpu.config_json when it agrees with every <arch>.* key (which hold
    floats as float32): it keeps the exact float64 hyper-parameters that resuming needs. A JSON
    from before ModelConfig.arch has none: it is a llama's, as its keys are."""
    raw = f.meta.get(K_CONFIG_JSON)
    if not isinstance(raw, str):
        return cfg
    try:
        exact = ModelConfig(**json.loads(raw))
        written = _hparams(exact)
    except Exception:  # noqa: BLE001 - a stale, foreign or forged hint: the <arch>.* keys rule
        return cfg
    for key, (value, vtype) in written.items():
        stored = f.meta.get(key)
        if stored is None:
            return cfg
        if vtype == _T.FLOAT32:
            if np.float32(value) != np.float32(stored):
                return cfg
        elif value != stored:
            return cfg
    if exact.rope_freq_scale == 1.0 and cfg.rope_freq_scale != 1.0:
        return cfg
    # the file's arch, what the tensors say (tied embeddings, rope factors), the head size rule
    told = ("arch", "tied_embeddings", "fused_gate_up", "fused_qkv", "qkv_bias", "rope_freqs",
            "longrope", "head_dim", "swa_layers", "layer_output_scale", "n_head_kv_layers",
            "n_ff_layers", "rope_scaling", "rope_orig_ctx")
    if any(getattr(exact, n) != getattr(cfg, n) for n in told):
        return cfg
    if any(np.float32(getattr(exact, n) or 0) != np.float32(getattr(cfg, n) or 0)
           for n in (*cfg.family.keys, "rope_attn_factor")):    # neutral ones not written
        return cfg
    return exact


def read_params(f: GGUFFile, cfg: ModelConfig, checkpoint: bool,
                keep_quantized: bool = False) -> dict[str, np.ndarray | Quantized]:
    """The parameters of `cfg` from `f` (`load_model` says in what form), each checked; any
    other tensor is refused, but for a checkpoint's optimizer.* tensors."""
    shapes = parameter_shapes(cfg)
    family = cfg.family
    for name in f.tensors:
        if name not in shapes and not (checkpoint and name.startswith(OPTIMIZER_TENSOR_PREFIX)) \
                and not family.ignored(cfg, name):
            block = re.fullmatch(r"blk\.(\d+)\.(.*)", name)
            if block and block[2] in family.unsupported:
                raise GGUFError(f"{f.path}: tensor {name}: ggwgpu's {cfg.arch} does not "
                                f"support {family.unsupported[block[2]]}")
            if block and block[2] == "attn_qkv.weight" and not family.fusable_qkv:
                raise GGUFError(f"{f.path}: tensor {name}: ggwgpu's {cfg.arch} reads no fused "
                                f"attn_qkv, as llama.cpp's reads none")
            why = (f"{arch_keys(cfg.arch).layers} = {cfg.n_layer} has no block {block[1]}"
                   if block and int(block[1]) >= cfg.n_layer
                   else f"a {cfg.arch} with these hyper-parameters has no such parameter")
            raise GGUFError(f"{f.path}: unexpected tensor {name}: {why}")
    params = {}
    for name, shape in shapes.items():
        if name not in f.tensors:
            raise GGUFError(f"{f.path}: tensor {name} is missing")
        got = f.numpy_shape(name)
        if name in ("token_embd.weight", "output.weight") and len(got) == 2 \
                and got[0] != cfg.n_vocab:
            raise GGUFError(f"{f.path}: vocabulary size mismatch: tensor {name} has {got[0]} "
                            f"rows but the vocabulary ({K_TOKENS}) has {cfg.n_vocab} tokens")
        block = re.fullmatch(r"blk\.\d+\.(.*)", name)
        matrix = len(shape) in (2, 3) and not (block and block[1] in family.values_only)
        params[name] = f.tensor_value(name, shape, keep_quantized and matrix)
    for name in ROPE_TABLES:     # the rope frequency factors
        if name in params and not np.all(params[name] > 0):    # they divide angles
            raise GGUFError(f"{f.path}: tensor {name} must hold positive frequency factors")
    return params
