"""GGUF files: llama models that llama.cpp loads, and training checkpoints that resume exactly.

Model file (`save_model` / `load_model`)
    general.architecture "llama", general.name, general.type "model", general.file_type 0
    (0: all f32, else the block type holding most values: ggwgpu.quant's TYPES, e.g.
    1 MOSTLY_F16, 2 MOSTLY_Q4_0, 3 MOSTLY_Q4_1, 7 MOSTLY_Q8_0); llama.context_length,
    .embedding_length, .block_count, .feed_forward_length, .attention.head_count,
    .attention.head_count_kv (fewer than head_count: grouped-query attention),
    .attention.key_length and .value_length (only when the head size is not
    embedding_length / head_count), .rope.dimension_count, .rope.freq_base,
    .attention.layer_norm_rms_epsilon, .vocab_size, and, when
    rope_freq_scale != 1, .rope.scaling.type "linear" with .rope.scaling.factor =
    1 / rope_freq_scale (llama.cpp reads freq_scale = 1 / factor); the tokenizer's
    tokenizer.ggml.* keys; ggwgpu.config_json, the LlamaConfig as JSON, so that float
    hyper-parameters come back exactly rather than rounded to float32. Tensors: the
    parameters under llama.cpp's names (`parameter_shapes`: no output.weight when the
    embeddings are tied, rope_freqs.weight for Llama 3's frequency factors), shapes in NumPy
    order (gguf-py writes them reversed, as ggml's ne); f32, or a block type (F16, BF16,
    Q4_0 .. Q8_0, Q2_K .. Q6_K) for `Quantized` values (frozen weights, ggwgpu.quant),
    written as their raw blocks. Reading takes F32 and those block types.

Checkpoint (`save_checkpoint` / `load_checkpoint`): the model file above plus
    ggwgpu.checkpoint.version        uint32, CHECKPOINT_VERSION; marks the file as a checkpoint
    optimizer.type                   "adamw" when it holds moments, else "none"
    optimizer.parameter_count        uint64, elements that have moments
    optimizer.iteration_count        uint64, train_state["step"]        (if present)
    optimizer.just_initialized       bool, step == 0                     (if step present)
    training.type                    "train_model"
    training.iteration_count         uint64, train_state["step"]        (if present)
    training.sample_count            uint64, train_state["samples"]     (if present)
    training.token_count             uint64, train_state["tokens"]      (if present)
    training.epoch_count             uint64, train_state["epoch"]       (if present)
    training.state_json              string: the whole train_state as JSON, the one source
                                     that `load_checkpoint` reads back (the counts above are
                                     for people and other tools)
    tensors optimizer.adamw.m.<param name> and optimizer.adamw.v.<param name>: AdamW's first
    and second moments, f32, shaped as their parameter.

Writing is atomic: a temporary file in the target's directory (.NAME.ggwgpu-PID-HEX.tmp),
flushed and fsynced, then renamed over the target, so the previous file stays whole until the
new one is complete, and a failure leaves it untouched and removes the temporary file; those
that a killed process left are removed by the next write of the same target. A full disk is
said as such. Nothing non-finite is written.

Reading (`_read_layout`, ggwgpu's own: gguf-py's reader does per-item work that a hostile
file turns into minutes) walks the memory-mapped file once, checking every count, length and
offset against the file size and the metadata against bounds on array items and string
bytes before reading it, then the keys, tensor types and shapes against the
hyper-parameters. Only regular files are read (not FIFOs or devices). Every problem is a
`GGUFError` naming the file and the key or tensor (the tokenizer's `VocabError` is one too),
never another exception, a hang or an allocation sized by a forged count:
tests/test_gguf_fuzz.py holds the loaders to that on mutated files and hostile metadata.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import secrets
import struct
import warnings
from pathlib import Path

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType,
                  GGUFValueType, GGUFWriter, Keys, LlamaFileType, RopeScalingType)

from .files import regular_file_problem
from .models.llama import OUTPUT, ROPE_FREQS, LlamaConfig, parameter_shapes
from .quant import TYPES, Quantized, dequantize, is_finite, type_of_ggml
from .tensor import ShapeError

ARCH = "llama"
CHECKPOINT_VERSION = 1

# llama.* keys, in llama.cpp's spelling (gguf-py's Keys with arch = llama).
K_ARCH = Keys.General.ARCHITECTURE
K_NAME = Keys.General.NAME
K_TYPE = Keys.General.TYPE
K_FILE_TYPE = Keys.General.FILE_TYPE
K_ALIGNMENT = Keys.General.ALIGNMENT
K_CTX = Keys.LLM.CONTEXT_LENGTH.format(arch=ARCH)
K_EMBD = Keys.LLM.EMBEDDING_LENGTH.format(arch=ARCH)
K_LAYERS = Keys.LLM.BLOCK_COUNT.format(arch=ARCH)
K_FF = Keys.LLM.FEED_FORWARD_LENGTH.format(arch=ARCH)
K_VOCAB = Keys.LLM.VOCAB_SIZE.format(arch=ARCH)
K_HEADS = Keys.Attention.HEAD_COUNT.format(arch=ARCH)
K_HEADS_KV = Keys.Attention.HEAD_COUNT_KV.format(arch=ARCH)
K_KEY_LENGTH = Keys.Attention.KEY_LENGTH.format(arch=ARCH)
K_VALUE_LENGTH = Keys.Attention.VALUE_LENGTH.format(arch=ARCH)
K_EPS = Keys.Attention.LAYERNORM_RMS_EPS.format(arch=ARCH)
K_ROT = Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)
K_FREQ_BASE = Keys.Rope.FREQ_BASE.format(arch=ARCH)
K_SCALING_TYPE = Keys.Rope.SCALING_TYPE.format(arch=ARCH)
K_SCALING_FACTOR = Keys.Rope.SCALING_FACTOR.format(arch=ARCH)
K_SCALE_LINEAR_OLD = f"{ARCH}.rope.scale_linear"        # llama.cpp's older name, read only
K_TOKENS = Keys.Tokenizer.LIST
TOKENIZER_PREFIX = "tokenizer."

# ggwgpu's own keys and tensors.
K_CONFIG_JSON = "ggwgpu.config_json"
K_CKPT_VERSION = "ggwgpu.checkpoint.version"
K_OPT_TYPE = "optimizer.type"
K_OPT_PARAM_COUNT = "optimizer.parameter_count"
K_OPT_ITERATION = "optimizer.iteration_count"
K_OPT_JUST_INIT = "optimizer.just_initialized"
K_TRAIN_TYPE = "training.type"
K_TRAIN_STATE = "training.state_json"
TRAIN_COUNTS = {"step": "training.iteration_count", "samples": "training.sample_count",
                "tokens": "training.token_count", "epoch": "training.epoch_count"}
MOMENT_PREFIX = {"m": "optimizer.adamw.m.", "v": "optimizer.adamw.v."}
OPTIMIZER_TENSOR_PREFIX = "optimizer."

MIN_ROPE_FACTOR, MAX_ROPE_FACTOR = 1e-3, 1e4   # published files use 2 .. 64
MAX_TENSOR_NAME = 63          # ggml's GGML_MAX_NAME (64) less the terminating NUL
MAX_DIMS = 4                  # ggml's GGML_MAX_DIMS
_T = GGUFValueType
_INT_TYPES = {_T.UINT8, _T.INT8, _T.UINT16, _T.INT16, _T.UINT32, _T.INT32, _T.UINT64, _T.INT64}
_FLOAT_TYPES = {_T.FLOAT32, _T.FLOAT64}




class GGUFError(ValueError):
    """A GGUF file cannot be written or read: the message names the file, the key or tensor,
    and the problem."""


# -- writing ----------------------------------------------------------------------------------

def save_model(path, cfg: LlamaConfig, params: dict, tokenizer, extra: dict | None = None):
    """Write a llama GGUF that llama.cpp loads: the keys and tensors of the module docstring.

    `params` maps every name of `parameter_shapes(cfg)` to a float array of that shape (any
    float dtype; written as f32) or a `Quantized` value (written as its GGUF type, bytes
    unchanged). `tokenizer.gguf_metadata()` gives the tokenizer.ggml.* keys.
    `extra` adds metadata keys, typed like the tokenizer's (str, bool, int -> uint32, float
    -> float32, lists of str/int/float); it may replace general.name but no other key.
    Raises GGUFError before anything is written if a name, shape or value is wrong; the write
    itself is atomic.
    """
    path = Path(path)
    tensors = _checked_params(path, cfg, params)
    if cfg.rot != cfg.head_dim:
        warnings.warn(f"{path}: n_rot {cfg.rot} != head_dim {cfg.head_dim}: llama.cpp refuses "
                      f"llama models whose rope dimension count is not the head size",
                      stacklevel=2)
    metadata = _model_metadata(path, cfg, tokenizer, extra)
    metadata[K_FILE_TYPE] = (int(_file_type(tensors)), _T.UINT32)
    _write_gguf(path, metadata, tensors)


def _file_type(tensors) -> LlamaFileType:
    """llama.cpp's general.file_type: the block type that holds most values, else all f32."""
    counts = {}
    for t in tensors.values():
        if isinstance(t, Quantized):
            counts[t.dtype] = counts.get(t.dtype, 0) + int(np.prod(t.shape))
    return TYPES[max(counts, key=counts.get)].file_type if counts else LlamaFileType.ALL_F32


def save_checkpoint(path, cfg: LlamaConfig, params: dict, tokenizer, opt_state: dict,
                    train_state: dict):
    """Write a training checkpoint: the model (as `save_model`), AdamW's moments and the
    training state (module docstring). `opt_state` maps parameter names to (m, v) arrays of
    the parameter's shape (empty for an optimizer without moments); `train_state` is any
    JSON-serialisable dict and comes back from `load_checkpoint` equal (tuples as lists).
    Atomic: the previous checkpoint at `path` stays whole until the new one is complete.
    """
    path = Path(path)
    tensors = _checked_params(path, cfg, params)
    shapes = parameter_shapes(cfg)
    moments = {}
    n_with_moments = 0         # parameter elements that have moments
    for name, pair in opt_state.items():
        if name not in shapes:
            raise GGUFError(f"{path}: cannot write checkpoint: optimizer state for {name!r}, "
                            f"which is not a parameter of this llama")
        try:
            m, v = pair
        except (TypeError, ValueError):
            raise GGUFError(f"{path}: cannot write checkpoint: optimizer state of {name} must "
                            f"be a pair (m, v)") from None
        for kind, value in (("m", m), ("v", v)):
            moments[MOMENT_PREFIX[kind] + name] = _checked_array(
                path, MOMENT_PREFIX[kind] + name, value, shapes[name], "checkpoint")
        n_with_moments += math.prod(shapes[name])
    # Parameter order, m then v: a stable layout that does not depend on dict order.
    ordered = {MOMENT_PREFIX[k] + n: moments[MOMENT_PREFIX[k] + n]
               for n in shapes if n in opt_state for k in ("m", "v")}
    if not isinstance(train_state, dict):
        raise GGUFError(f"{path}: cannot write checkpoint: train_state must be a dict, got "
                        f"{type(train_state).__name__}")
    try:
        state_json = json.dumps(train_state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{path}: cannot write checkpoint: train_state is not "
                        f"JSON-serialisable ({e})") from None

    metadata = _model_metadata(path, cfg, tokenizer, None)
    metadata[K_CKPT_VERSION] = (CHECKPOINT_VERSION, _T.UINT32)
    metadata[K_OPT_TYPE] = ("adamw" if ordered else "none", _T.STRING)
    metadata[K_OPT_PARAM_COUNT] = (n_with_moments, _T.UINT64)
    step = _count(train_state.get("step"))
    if step is not None:
        metadata[K_OPT_ITERATION] = (step, _T.UINT64)
        metadata[K_OPT_JUST_INIT] = (step == 0, _T.BOOL)
    metadata[K_TRAIN_TYPE] = ("train_model", _T.STRING)
    for state_key, key in TRAIN_COUNTS.items():
        value = _count(train_state.get(state_key))
        if value is not None:
            metadata[key] = (value, _T.UINT64)
    metadata[K_TRAIN_STATE] = (state_json, _T.STRING)
    _write_gguf(path, metadata, {**tensors, **ordered})


def _count(value):
    """A non-negative int that fits uint64, else None (not written as a plain key)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = int(value)
        if 0 <= value < 2 ** 64:
            return value
    return None


def _checked_array(path, name, value, shape, what) -> np.ndarray:
    if isinstance(value, Quantized):
        if value.shape != tuple(shape):
            raise GGUFError(f"{path}: cannot write {what}: tensor {name} has shape "
                            f"{value.shape}, the config needs {tuple(shape)}")
        if not np.isfinite(dequantize(value)).all():
            raise GGUFError(f"{path}: cannot write {what}: tensor {name} holds non-finite "
                            f"values (NaN or infinity)")
        return value
    array = np.asarray(value)
    if array.shape != tuple(shape):
        raise GGUFError(f"{path}: cannot write {what}: tensor {name} has shape {array.shape}, "
                        f"the config needs {tuple(shape)}")
    if array.dtype.kind != "f":
        raise GGUFError(f"{path}: cannot write {what}: tensor {name} has dtype {array.dtype}, "
                        f"expected a float type")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        raise GGUFError(f"{path}: cannot write {what}: tensor {name} holds non-finite values "
                        f"(NaN or infinity)")
    if len(name.encode("utf-8")) > MAX_TENSOR_NAME:
        raise GGUFError(f"{path}: cannot write {what}: tensor name {name!r} is longer than "
                        f"ggml's {MAX_TENSOR_NAME} bytes")
    return array


def _checked_params(path, cfg, params) -> dict[str, np.ndarray]:
    """The parameters as contiguous f32 arrays in `parameter_shapes` order, each checked."""
    if not isinstance(cfg, LlamaConfig):
        raise GGUFError(f"{path}: cannot write: cfg must be a LlamaConfig, got "
                        f"{type(cfg).__name__}")
    shapes = parameter_shapes(cfg)
    missing = [n for n in shapes if n not in params]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GGUFError(f"{path}: cannot write: parameter {missing[0]} is missing{more}")
    unknown = [n for n in params if n not in shapes]
    if unknown:
        raise GGUFError(f"{path}: cannot write: {unknown[0]!r} is not a parameter of a llama "
                        f"with n_layer {cfg.n_layer}")
    return {n: _checked_array(path, n, params[n], shape, "model") for n, shape in shapes.items()}


def _hparams(cfg: LlamaConfig) -> dict[str, tuple[object, GGUFValueType]]:
    """The llama.* keys of `cfg`, as written (and compared when reading back)."""
    keys = {
        K_CTX: (cfg.n_ctx, _T.UINT32), K_EMBD: (cfg.n_embd, _T.UINT32),
        K_LAYERS: (cfg.n_layer, _T.UINT32), K_FF: (cfg.n_ff, _T.UINT32),
        K_HEADS: (cfg.n_head, _T.UINT32), K_HEADS_KV: (cfg.kv_heads, _T.UINT32),
        K_ROT: (cfg.rot, _T.UINT32), K_FREQ_BASE: (float(cfg.rope_freq_base), _T.FLOAT32),
        K_EPS: (float(cfg.norm_eps), _T.FLOAT32), K_VOCAB: (cfg.n_vocab, _T.UINT32),
    }
    if cfg.n_embd_head is not None:
        keys[K_KEY_LENGTH] = keys[K_VALUE_LENGTH] = (cfg.head_dim, _T.UINT32)
    if cfg.rope_freq_scale != 1.0:
        keys[K_SCALING_TYPE] = (RopeScalingType.LINEAR.value, _T.STRING)
        keys[K_SCALING_FACTOR] = (1.0 / cfg.rope_freq_scale, _T.FLOAT32)
    return keys


def _model_metadata(path, cfg, tokenizer, extra) -> dict[str, tuple[object, GGUFValueType]]:
    """Every key of a model file, in writing order, as key -> (value, GGUF type)."""
    meta = {K_ARCH: (ARCH, _T.STRING),
            K_NAME: (f"ggwgpu llama {cfg.n_layer}x{cfg.n_embd}", _T.STRING),
            K_TYPE: ("model", _T.STRING),
            K_FILE_TYPE: (int(LlamaFileType.ALL_F32), _T.UINT32)}
    meta.update(_hparams(cfg))
    meta[K_CONFIG_JSON] = (json.dumps(dataclasses.asdict(cfg)), _T.STRING)
    for key, value in tokenizer.gguf_metadata().items():
        if not key.startswith(TOKENIZER_PREFIX):
            raise GGUFError(f"{path}: cannot write: the tokenizer gave key {key!r}, which is "
                            f"not a {TOKENIZER_PREFIX}* key")
        typed = _typed(path, key, value)
        if typed is not None:
            meta[key] = typed
    for key, value in (extra or {}).items():
        if key in meta and key != K_NAME:
            raise GGUFError(f"{path}: cannot write: extra key {key!r} would replace a key "
                            f"the model itself defines")
        typed = _typed(path, key, value)
        if typed is not None:
            meta[key] = typed
    return meta


def _typed(path, key, value):
    """(value, GGUF type) of a Python value: str -> string, bool -> bool, int -> uint32
    (int64 outside its range), float -> float32, list of str/bool/int/float -> array of
    string/bool/int32/float32. An empty list gives None: GGUF cannot hold empty arrays."""
    def bad(why):
        return GGUFError(f"{path}: cannot write key {key!r}: {why}")

    if isinstance(value, (bool, np.bool_)):
        return bool(value), _T.BOOL
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if 0 <= value < 2 ** 32:
            return value, _T.UINT32
        if -2 ** 63 <= value < 2 ** 63:
            return value, _T.INT64
        raise bad(f"{value} does not fit 64 bits")
    if isinstance(value, (float, np.floating)):
        return float(value), _T.FLOAT32
    if isinstance(value, str):
        return value, _T.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        items = value.tolist() if isinstance(value, np.ndarray) else list(value)
        if not items:
            return None
        # gguf-py picks the array's element type from the Python type of its items.
        if all(isinstance(v, str) for v in items):
            return items, _T.ARRAY
        if all(isinstance(v, (bool, np.bool_)) for v in items):
            return [bool(v) for v in items], _T.ARRAY
        numbers = all(isinstance(v, (int, float, np.integer, np.floating))
                      and not isinstance(v, (bool, np.bool_)) for v in items)
        if numbers and all(isinstance(v, (int, np.integer)) for v in items):
            ints = [int(v) for v in items]
            if not all(-2 ** 31 <= v < 2 ** 31 for v in ints):
                raise bad("an integer array value does not fit int32")
            return ints, _T.ARRAY
        if numbers:
            return [float(v) for v in items], _T.ARRAY
        raise bad("array items must be all str, all bool, or all numbers")
    raise bad(f"values of type {type(value).__name__} cannot be stored")


def write_metadata(path, meta: dict, arch: str = ARCH):
    """A GGUF file holding only metadata (a vocabulary, say): `meta`'s Python values typed as
    `_typed` says (general.architecture from `meta`, else `arch`); written atomically."""
    typed = {K_ARCH: (meta.get(K_ARCH, arch), _T.STRING)}
    for key, value in meta.items():
        if key != K_ARCH and (kind := _typed(path, key, value)) is not None:
            typed[key] = kind
    _write_gguf(path, typed, {})


def _write_gguf(path, metadata: dict, tensors: dict[str, np.ndarray]):
    """Write `metadata` (key -> (value, GGUF type); general.architecture first) and
    `tensors` (name -> array, written with its dtype) to `path` atomically: a temporary file
    in the same directory, flushed and fsynced, then os.replace onto `path`. On any failure
    (or interrupt) the temporary file is removed and the old `path` is untouched."""
    path = Path(path)
    directory = path.parent
    if path.is_dir():
        raise GGUFError(f"{path}: cannot write: is a directory")
    if not directory.is_dir():
        raise GGUFError(f"{path}: cannot write: directory {directory} does not exist")
    remove_stale_temps(path)
    tmp = directory / f".{path.name}.{TEMP_MARK}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        # O_EXCL: never clobber another file; mode 0o666 less the umask, like open().
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise GGUFError(f"{path}: cannot create a temporary file in {directory}: "
                        f"{os_problem(e, directory)}") from None
    try:
        arch, _ = metadata[K_ARCH]
        writer = GGUFWriter(tmp, arch)      # adds general.architecture itself
        try:
            for key, (value, vtype) in metadata.items():
                if key != K_ARCH:
                    writer.add_key_value(key, value, vtype)
            for name, array in tensors.items():
                if isinstance(array, Quantized):     # raw blocks, one row of bytes per row
                    rows = array.data.reshape(array.shape[:-1] + (-1,))
                    writer.add_tensor(name, rows, raw_dtype=TYPES[array.dtype].ggml)
                else:
                    writer.add_tensor(name, array)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        with open(tmp, "rb+") as f:          # the data reaches the disk before the rename
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, (OverflowError, struct.error)):     # a float beyond float32, say
            raise GGUFError(f"{path}: cannot write: a value does not fit its GGUF type "
                            f"({e})") from None
        if isinstance(e, OSError):
            raise GGUFError(f"{path}: writing failed, the previous file is unchanged: "
                            f"{os_problem(e, directory)}") from e
        raise
    _fsync_directory(directory)


TEMP_MARK = "ggwgpu"      # in every temporary file's name: .NAME.ggwgpu-PID-HEX.tmp


def remove_stale_temps(path):
    """Remove the temporary files that writes of `path` left when their process was killed
    (SIGKILL, a crash): only names of the pattern above for this very target, and only those
    of processes that no longer run (a live one may be writing right now). POSIX only:
    elsewhere nothing is removed."""
    path = Path(path)
    if os.name != "posix" or not path.parent.is_dir():
        return
    pattern = re.compile(re.escape(f".{path.name}.{TEMP_MARK}-") + r"(\d+)-[0-9a-f]{8}\.tmp")
    for entry in os.scandir(path.parent):
        m = pattern.fullmatch(entry.name)
        if m and entry.is_file(follow_symlinks=False) and not _running(int(m[1])):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)          # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True              # someone else's process (or a forged number): leave it
    return True


def os_problem(e: OSError, where) -> str:
    """What an OSError of writing in `where` means, in words: a full disk is said as such."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk holding {where} is full (no space left on device)"
    return e.strerror or str(e)


def _fsync_directory(directory: Path):
    """Make the rename itself durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- reading ----------------------------------------------------------------------------------

def load_model(path, keep_quantized: bool = False):
    """Read a llama GGUF (ours, a checkpoint, or llama.cpp's llama files in F32 and the block
    types of ggwgpu.quant's TYPES) and return (cfg, params, tokenizer): params as float32
    arrays that own their memory (block types dequantized), tokenizer from
    `tokenizer.tokenizer_from_metadata`. With keep_quantized, 2-D tensors stored in a block
    type (F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K) come back as `Quantized`
    values in their storage type instead (frozen weights for `constant()`; 1-D ones, the
    norms, are still converted). A file without output.weight has tied embeddings
    (cfg.tied_embeddings: the output projection reads token_embd.weight, as in llama.cpp).
    Other tensor types raise a GGUFError naming tensor and type."""
    f = _GGUFFile(path)
    cfg, tokenizer = _read_model(f)
    params = _read_params(f, cfg, K_CKPT_VERSION in f.meta, keep_quantized)
    return cfg, params, tokenizer


def load_checkpoint(path):
    """Read a checkpoint written by `save_checkpoint`: (cfg, params, tokenizer, opt_state,
    train_state), validated as `load_model` does plus the moments' names and shapes. A model
    file is refused with a GGUFError saying so."""
    f = _GGUFFile(path)
    version = f.meta.get(K_CKPT_VERSION)
    if version is None:
        if f.meta.get(K_ARCH) == ARCH:
            raise GGUFError(f"{f.path}: is a model, not a training checkpoint (it has no "
                            f"{K_CKPT_VERSION} key); load it as a model instead")
        raise GGUFError(f"{f.path}: is not a ggwgpu training checkpoint (it has no "
                        f"{K_CKPT_VERSION} key)")
    if f.kind(K_CKPT_VERSION) not in _INT_TYPES or version != CHECKPOINT_VERSION:
        raise GGUFError(f"{f.path}: {K_CKPT_VERSION} is {version!r}; this ggwgpu reads "
                        f"checkpoint version {CHECKPOINT_VERSION}")
    cfg, tokenizer = _read_model(f)
    params = _read_params(f, cfg, checkpoint=True)

    shapes = parameter_shapes(cfg)
    found: dict[str, dict[str, np.ndarray]] = {}
    for name in f.tensors:
        if not name.startswith(OPTIMIZER_TENSOR_PREFIX):
            continue
        kind = next((k for k, p in MOMENT_PREFIX.items() if name.startswith(p)), None)
        param_name = name[len(MOMENT_PREFIX[kind]):] if kind else None
        if param_name not in shapes:
            raise GGUFError(f"{f.path}: unknown optimizer tensor {name}: expected "
                            f"{MOMENT_PREFIX['m']}<parameter> or {MOMENT_PREFIX['v']}<parameter>")
        found.setdefault(param_name, {})[kind] = f.tensor_f32(name, shapes[param_name])
    opt_state = {name: moment_pair(f, name, found[name]) for name in shapes if name in found}
    return cfg, params, tokenizer, opt_state, read_train_state(f)


def moment_pair(f: "_GGUFFile", name: str, pair: dict) -> tuple[np.ndarray, np.ndarray]:
    """(m, v) of parameter `name` from a checkpoint's {"m": .., "v": ..}: both present, and v
    (a mean of squared gradients, under a square root in the update) not negative."""
    for kind in ("m", "v"):
        if kind not in pair:
            raise GGUFError(f"{f.path}: tensor {MOMENT_PREFIX[kind] + name} is missing "
                            f"(the checkpoint has the other moment of {name})")
    if (pair["v"] < 0).any():
        raise GGUFError(f"{f.path}: tensor {MOMENT_PREFIX['v'] + name} holds negative values "
                        f"(a second moment is a mean of squares)")
    return pair["m"], pair["v"]


def read_train_state(f: "_GGUFFile") -> dict:
    """The checkpoint's training.state_json, parsed and checked against the training state's
    one schema (ggwgpu.train.check_state): every defect a GGUFError naming the key."""
    from .train import check_state      # train builds graphs; reading files does not need it
    if K_TRAIN_STATE not in f.meta:
        raise GGUFError(f"{f.path}: required key {K_TRAIN_STATE} is missing")
    raw = f.meta[K_TRAIN_STATE]
    if not isinstance(raw, str):
        raise GGUFError(f"{f.path}: key {K_TRAIN_STATE} must be a string")
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError) as e:       # RecursionError: forged deep nesting
        raise GGUFError(f"{f.path}: key {K_TRAIN_STATE} is not valid JSON ({e})") from None
    try:
        return check_state(state)
    except ValueError as e:
        raise GGUFError(f"{f.path}: key {K_TRAIN_STATE}: {e}") from None


def read_metadata(path) -> dict[str, object]:
    """Every metadata key of a GGUF file (key -> Python value), after the layout check.
    Raises GGUFError."""
    return _GGUFFile(path).meta


def _read_model(f: "_GGUFFile"):
    """(cfg, tokenizer) from a file's general.*, llama.* and tokenizer.* keys."""
    arch = f.meta.get(K_ARCH)
    if arch is None:
        raise GGUFError(f"{f.path}: required key {K_ARCH} is missing")
    if arch != ARCH:
        raise GGUFError(f"{f.path}: {K_ARCH} is {arch!r}; ggwgpu reads {ARCH!r} models only")
    n_embd, n_head = f.int_key(K_EMBD), f.int_key(K_HEADS)
    n_layer = f.int_key(K_LAYERS, minimum=0)
    hp = dict(n_embd=n_embd, n_head=n_head, n_layer=n_layer,
              n_ctx=f.int_key(K_CTX), n_ff=f.int_key(K_FF),
              norm_eps=f.float_key(K_EPS),
              rope_freq_base=f.float_key(K_FREQ_BASE, default=10000.0))
    n_head_kv = f.int_key(K_HEADS_KV, default=n_head)
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: {K_HEADS} = {n_head} is not a multiple of {K_HEADS_KV} = "
                        f"{n_head_kv}")
    hp["n_head_kv"] = n_head_kv if n_head_kv != n_head else None
    head_dim = f.int_key(K_KEY_LENGTH, default=None)
    if head_dim is None:
        if n_embd % n_head:
            raise GGUFError(f"{f.path}: {K_EMBD} = {n_embd} is not divisible by {K_HEADS} = "
                            f"{n_head}")
        head_dim = n_embd // n_head
    elif head_dim != n_embd // n_head or n_embd % n_head:
        hp["n_embd_head"] = head_dim
    if f.int_key(K_VALUE_LENGTH, default=head_dim) != head_dim:
        raise GGUFError(f"{f.path}: {K_VALUE_LENGTH} = {f.meta[K_VALUE_LENGTH]} differs from "
                        f"{K_KEY_LENGTH} = {head_dim}: ggwgpu's llama needs one head size")
    hp["n_rot"] = f.int_key(K_ROT, default=head_dim)
    if hp["n_rot"] % 2 or hp["n_rot"] > head_dim:
        raise GGUFError(f"{f.path}: {K_ROT} = {hp['n_rot']} must be even and at most the head "
                        f"size {head_dim}")
    hp["tied_embeddings"] = OUTPUT not in f.tensors
    hp["rope_freqs"] = ROPE_FREQS in f.tensors
    scaling = f.meta.get(K_SCALING_TYPE, RopeScalingType.LINEAR.value)
    if scaling not in (RopeScalingType.LINEAR.value, RopeScalingType.NONE.value):
        raise GGUFError(f"{f.path}: {K_SCALING_TYPE} {scaling!r} is not supported (only "
                        f"'linear' and 'none')")
    factor = f.float_key(K_SCALING_FACTOR, default=None, allow_zero=True)
    if factor is None:
        factor = f.float_key(K_SCALE_LINEAR_OLD, default=None, allow_zero=True)
    # llama.cpp: freq_scale = 1 / factor, a missing or zero factor meaning 1.
    hp["rope_freq_scale"] = 1.0 if scaling == "none" or not factor else 1.0 / factor
    if not MIN_ROPE_FACTOR <= 1.0 / hp["rope_freq_scale"] <= MAX_ROPE_FACTOR:
        raise GGUFError(f"{f.path}: {K_SCALING_FACTOR} = {factor!r} is not a plausible rope "
                        f"scaling factor ({MIN_ROPE_FACTOR:g} .. {MAX_ROPE_FACTOR:g}): the "
                        f"rotation angles would overflow or vanish")

    meta = {k: v for k, v in f.meta.items() if k.startswith(TOKENIZER_PREFIX)}
    if K_TOKENS not in meta:
        raise GGUFError(f"{f.path}: required key {K_TOKENS} is missing (the file has no "
                        f"vocabulary)")
    tokens = meta[K_TOKENS]
    if not isinstance(tokens, list):
        raise GGUFError(f"{f.path}: key {K_TOKENS} must be an array of strings")
    n_vocab = len(tokens)
    if K_VOCAB in f.meta and f.int_key(K_VOCAB) != n_vocab:
        raise GGUFError(f"{f.path}: vocabulary size mismatch: {K_VOCAB} = {f.meta[K_VOCAB]} "
                        f"but {K_TOKENS} has {n_vocab} tokens")
    from .tokenizer import tokenizer_from_metadata
    try:
        tokenizer = tokenizer_from_metadata(meta)
    except GGUFError as e:
        raise GGUFError(f"{f.path}: bad vocabulary: {e}") from None

    # A forged block count must not make us enumerate billions of tensor names.
    if 9 * n_layer + 2 > len(f.tensors):
        raise GGUFError(f"{f.path}: {K_LAYERS} = {n_layer} needs at least {9 * n_layer + 2} tensors, "
                        f"the file has {len(f.tensors)}")
    try:
        cfg = LlamaConfig(n_vocab=n_vocab, **hp)
    except ShapeError as e:
        raise GGUFError(f"{f.path}: the llama.* hyper-parameters are inconsistent: {e}") from None
    return _exact_config(f, cfg), tokenizer


def _exact_config(f: "_GGUFFile", cfg: LlamaConfig) -> LlamaConfig:
    """The LlamaConfig of ggwgpu.config_json when it agrees with every llama.* key (which hold
    floats as float32): it keeps the exact float64 hyper-parameters that resuming needs."""
    raw = f.meta.get(K_CONFIG_JSON)
    if not isinstance(raw, str):
        return cfg
    try:
        exact = LlamaConfig(**json.loads(raw))
        written = _hparams(exact)
    except Exception:  # noqa: BLE001 - a stale, foreign or forged hint: the llama.* keys rule
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
    # what the tensors say (tied embeddings, rope factors) and the head size rule too
    if (exact.tied_embeddings, exact.rope_freqs, exact.head_dim) != \
            (cfg.tied_embeddings, cfg.rope_freqs, cfg.head_dim):
        return cfg
    return exact


def _read_params(f: "_GGUFFile", cfg: LlamaConfig, checkpoint: bool,
                 keep_quantized: bool = False) -> dict[str, np.ndarray | Quantized]:
    shapes = parameter_shapes(cfg)
    for name in f.tensors:
        if name not in shapes and not (checkpoint and name.startswith(OPTIMIZER_TENSOR_PREFIX)):
            block = re.fullmatch(r"blk\.(\d+)\..*", name)
            why = (f"{K_LAYERS} = {cfg.n_layer} has no block {block[1]}"
                   if block and int(block[1]) >= cfg.n_layer
                   else "a llama with these hyper-parameters has no such parameter")
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
        params[name] = f.tensor_value(name, shape, keep_quantized and len(shape) == 2)
    if ROPE_FREQS in params and not np.all(params[ROPE_FREQS] > 0):    # they divide angles
        raise GGUFError(f"{f.path}: tensor {ROPE_FREQS} must hold positive frequency factors")
    return params


class _GGUFFile:
    """A GGUF file, layout-checked and parsed by `_read_layout`: `meta` (key -> Python value),
    `tensors` (name -> `_Tensor`, memory-mapped; `tensor_value` copies one out)."""

    def __init__(self, path):
        self.path = path = Path(path)
        problem = regular_file_problem(path)
        if problem:
            raise GGUFError(f"{path}: {problem}")
        self.meta, self._kinds, self.tensors = _read_layout(path)

    def kind(self, key):
        return self._kinds.get(key)

    def int_key(self, key, default=..., minimum=1) -> int:
        if key not in self.meta:
            if default is ...:
                raise GGUFError(f"{self.path}: required key {key} is missing")
            return default
        value = self.meta[key]
        if self.kind(key) not in _INT_TYPES or not minimum <= value < 2 ** 31:
            raise GGUFError(f"{self.path}: key {key} must be an integer in [{minimum}, 2^31), "
                            f"got {value!r}")
        return int(value)

    def float_key(self, key, default=..., allow_zero=False):
        if key not in self.meta:
            if default is ...:
                raise GGUFError(f"{self.path}: required key {key} is missing")
            return default
        value = self.meta[key]
        if (self.kind(key) not in _FLOAT_TYPES | _INT_TYPES or not math.isfinite(value)
                or value < 0 or (value == 0 and not allow_zero)):
            raise GGUFError(f"{self.path}: key {key} must be a positive finite number, "
                            f"got {value!r}")
        return float(value)

    def numpy_shape(self, name) -> tuple[int, ...]:
        return self.tensors[name].shape

    def tensor_f32(self, name, shape) -> np.ndarray:
        """Tensor `name` as a float32 array of `shape` that owns its memory."""
        return self.tensor_value(name, shape)

    def tensor_value(self, name, shape, keep_quantized=False):
        """Tensor `name` of `shape`, owning its memory: a float32 array, or with
        keep_quantized a `Quantized` value when it is stored in a block type of
        ggwgpu.quant's TYPES (F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K)."""
        t = self.tensors[name]
        dtype = type_of_ggml(t.tensor_type)
        if t.tensor_type != GGMLQuantizationType.F32 and dtype is None:
            raise GGUFError(f"{self.path}: tensor {name} has type {t.tensor_type.name}; ggwgpu "
                            f"reads F32, {', '.join(v.ggml.name for v in TYPES.values())} "
                            f"tensors only")
        got = self.numpy_shape(name)
        if got != tuple(shape):
            raise GGUFError(f"{self.path}: tensor {name} has shape {got} (NumPy order) but the "
                            f"hyper-parameters need {tuple(shape)}")
        if dtype is None:
            value = np.array(t.data).view(np.float32).reshape(shape)
            finite = np.isfinite(value).all()
        else:
            value = Quantized(dtype, shape, np.array(t.data))
            finite = is_finite(value)
        if not finite:    # it would only surface later, as a NaN loss or sampling error
            raise GGUFError(f"{self.path}: tensor {name} holds non-finite values (NaN or "
                            f"infinity)")
        return value if keep_quantized or dtype is None else dequantize(value)


def field_value(field):
    """A gguf-py ReaderField as a Python value (the tests compare what gguf-py reads with
    what ggwgpu writes): `parts` holds the field's raw pieces and `data` the indices of the
    parts that are its value (one per array element)."""
    kind = field.types[0] if field.types else None
    if kind == _T.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == _T.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        if sub == _T.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if sub == _T.ARRAY:
            return None                       # nested arrays: no key ggwgpu reads has them
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if kind is None:
        return None
    return field.parts[field.data[0]].tolist()[0]


# -- reading the layout -----------------------------------------------------------------------
#
# ggwgpu reads a GGUF's header itself rather than through gguf-py's GGUFReader: that one makes
# NumPy views for every array item and tensor info, so a 4 MB file holding a nested array of
# 300k items took 26 s and 760 MB, and a 300k-token vocabulary seconds. Here every key is read
# once, scalar arrays in one go, and the work and memory are bounded before a value is read:
# array items of all keys together at most MAX_METADATA_ITEMS (a 300k-token vocabulary with
# scores, types and merges holds about 1.2 million), string bytes at most MAX_METADATA_BYTES,
# tensors at most MAX_TENSORS. A file beyond a bound is refused, naming the key and the bound.

MAX_METADATA_ITEMS = 1 << 21          # 2,097,152 array items, all keys together
MAX_METADATA_BYTES = 1 << 28          # 256 MiB of strings (a chat template is a few KiB)
MAX_TENSORS = 1 << 16                 # published llama files have at most a few thousand
_SCALAR_DTYPE = {_T.UINT8: "<u1", _T.INT8: "<i1", _T.UINT16: "<u2", _T.INT16: "<i2",
                 _T.UINT32: "<u4", _T.INT32: "<i4", _T.FLOAT32: "<f4", _T.BOOL: "?",
                 _T.UINT64: "<u8", _T.INT64: "<i8", _T.FLOAT64: "<f8"}
_SCALAR_FORMAT = {_T.UINT8: struct.Struct("<B"), _T.INT8: struct.Struct("<b"),
                  _T.UINT16: struct.Struct("<H"), _T.INT16: struct.Struct("<h"),
                  _T.UINT32: struct.Struct("<I"), _T.INT32: struct.Struct("<i"),
                  _T.FLOAT32: struct.Struct("<f"), _T.BOOL: struct.Struct("<?"),
                  _T.UINT64: struct.Struct("<Q"), _T.INT64: struct.Struct("<q"),
                  _T.FLOAT64: struct.Struct("<d")}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of a file: its GGML type, its shape in NumPy order and its bytes (a view of
    the memory-mapped file)."""
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Bounded little-endian reads of a memory-mapped file: every length is checked against
    the bytes that remain, and every array and string against the budgets above, before it
    is read, so a forged count or size ends in a GGUFError, never a huge allocation or a
    long loop."""

    def __init__(self, data: np.ndarray, path):
        self.buf, self.size, self.path, self.pos = memoryview(data), len(data), path, 0
        self.items_left, self.bytes_left = MAX_METADATA_ITEMS, MAX_METADATA_BYTES

    def need(self, n, what):
        if n > self.size - self.pos:
            raise GGUFError(f"{self.path}: truncated or corrupt: reading {what} at offset "
                            f"{self.pos} takes {n} bytes, but the file ends at {self.size}")

    def unpack(self, fmt: struct.Struct, what):
        self.need(fmt.size, what)
        self.pos += fmt.size
        return fmt.unpack_from(self.buf, self.pos - fmt.size)[0]

    def u32(self, what) -> int:
        return self.unpack(_U32, what)

    def u64(self, what) -> int:
        return self.unpack(_U64, what)

    def text(self, what) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        if n > self.bytes_left:
            raise GGUFError(f"{self.path}: {what} is {n} bytes long; ggwgpu reads at most "
                            f"{MAX_METADATA_BYTES} bytes of metadata strings")
        self.bytes_left -= n
        self.pos += n
        try:
            return str(self.buf[self.pos - n:self.pos], "utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} at offset {self.pos - n} is not "
                            f"UTF-8") from None

    def texts(self, count, key) -> list[str]:
        """`count` strings, as `text` reads them but in a loop without per-item formatting
        (a 300k-token vocabulary); an item that fails a check goes through `text`, which
        says what is wrong with it."""
        buf, size, unpack = self.buf, self.size, _U64.unpack_from
        pos, bytes_left, items = self.pos, self.bytes_left, []
        for i in range(count):
            n = unpack(buf, pos)[0] if pos + 8 <= size else size
            end = pos + 8 + n
            try:
                if n > bytes_left or end > size:
                    raise ValueError
                items.append(str(buf[pos + 8:end], "utf-8"))
            except ValueError:          # UnicodeDecodeError too
                self.pos, self.bytes_left = pos, bytes_left
                return items + [self.text(f"item {i} of key {key}")] + self.texts(
                    count - i - 1, key)
            pos, bytes_left = end, bytes_left - n
        self.pos, self.bytes_left = pos, bytes_left
        return items

    def take_items(self, count, min_size, key):
        """Account for `count` array items of at least `min_size` bytes each."""
        self.need(count * min_size, f"{count} array items of key {key}")
        if count > self.items_left:
            raise GGUFError(f"{self.path}: key {key} has an array of {count} items; ggwgpu reads "
                            f"at most {MAX_METADATA_ITEMS} array items of metadata in all")
        self.items_left -= count


def _value_type(cur: _Cursor, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFError(f"{cur.path}: {what} has unknown value type {raw}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str):
    """The value of `key` as a Python value, an array as a list. Arrays of arrays are
    refused, as ggml's reader refuses them."""
    what = f"value of key {key}"
    if vtype in _SCALAR_FORMAT:
        return cur.unpack(_SCALAR_FORMAT[vtype], what)
    if vtype == _T.STRING:
        return cur.text(what)
    if vtype != _T.ARRAY:
        raise GGUFError(f"{cur.path}: key {key} has unsupported value type {vtype.name}")
    itype = _value_type(cur, cur.u32(f"array type of key {key}"), f"array of key {key}")
    count = cur.u64(f"array length of key {key}")
    if itype in _SCALAR_DTYPE:
        size = _SCALAR_FORMAT[itype].size
        cur.take_items(count, size, key)
        values = np.frombuffer(cur.buf, _SCALAR_DTYPE[itype], count, cur.pos)
        cur.pos += count * size
        return values.tolist()
    if itype != _T.STRING:
        raise GGUFError(f"{cur.path}: key {key} is an array of {itype.name}s; GGUF readers "
                        f"(ggml's too) read arrays of numbers, bools and strings only")
    cur.take_items(count, 8, key)                  # each string has its 8-byte length
    return cur.texts(count, key)


def _read_layout(path: Path):
    """(meta, value types, tensors) of the GGUF file at `path`, read with the bounds above;
    every tensor's type is known and its data lies inside the file. Raises GGUFError naming
    what is wrong."""
    size = path.stat().st_size
    if size < 4:
        raise GGUFError(f"{path}: not a GGUF file ({size} bytes: too short for the magic)")
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    cur = _Cursor(data, path)
    if cur.u32("magic") != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (wrong magic; expected 'GGUF')")
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    cur.need(n_kv * 13, f"{n_kv} metadata entries")       # >= 8 + 4 + 1 bytes each
    meta, kinds = {}, {}
    for i in range(n_kv):
        key = cur.text(f"name of metadata entry {i}")
        if key in meta:
            raise GGUFError(f"{path}: key {key} occurs twice")
        kinds[key] = _value_type(cur, cur.u32(f"type of key {key}"), f"key {key}")
        meta[key] = _read_value(cur, kinds[key], key)
    alignment = meta.get(K_ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if K_ALIGNMENT in meta:
        if kinds[K_ALIGNMENT] != _T.UINT32:
            raise GGUFError(f"{path}: key {K_ALIGNMENT} must be a uint32")
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: key {K_ALIGNMENT} = {alignment} is not a power of two")

    cur.need(n_tensors * 24, f"{n_tensors} tensor infos")   # >= 8 + 4 + 4 + 8 bytes each
    if n_tensors > MAX_TENSORS:
        raise GGUFError(f"{path}: the header counts {n_tensors} tensors; ggwgpu reads at most "
                        f"{MAX_TENSORS}")
    infos = []
    for i in range(n_tensors):
        name = cur.text(f"name of tensor {i}")
        if len(name.encode("utf-8")) > MAX_TENSOR_NAME:     # as ggml refuses them too
            raise GGUFError(f"{path}: the name of tensor {i} ({name[:20]!r}...) is longer "
                            f"than ggml's {MAX_TENSOR_NAME} bytes")
        n_dims = cur.u32(f"dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions (1 to "
                            f"{MAX_DIMS} allowed)")
        dims = [cur.u64(f"dimensions of tensor {name}") for _ in range(n_dims)]
        raw_type = cur.u32(f"type of tensor {name}")
        offset = cur.u64(f"data offset of tensor {name}")
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown type {raw_type}") from None
        if ttype not in GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name} has type {ttype.name}, which has no "
                            f"known block size")
        infos.append((name, dims, ttype, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, ttype, offset in infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name} occurs twice")
        block, type_size = GGML_QUANT_SIZES[ttype]
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} of type {ttype.name} has a first "
                            f"dimension {dims[0]} that is not a multiple of {block}")
        if offset % alignment:
            raise GGUFError(f"{path}: tensor {name} has data offset {offset}, not a "
                            f"multiple of the alignment {alignment}")
        start = data_start + offset
        end = start + math.prod(dims) // block * type_size
        if end > size:
            raise GGUFError(f"{path}: truncated or corrupt: the data of tensor {name} ends "
                            f"at byte {end}, but the file ends at {size}")
        tensors[name] = _Tensor(ttype, tuple(reversed(dims)), data[start:end])
    return meta, kinds, tensors
