"""Training checkpoints that resume exactly: a file of ggwgpu.gguf_llama's model schema (or,
for a LoRA finetune, ggwgpu.lora's adapter file) plus the optimizer's state and the training
state. This module owns those keys and tensors and how they are checked, for both kinds.

Checkpoint (`save_checkpoint` / `load_checkpoint`): the model file plus
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
    With L-BFGS instead (optimizer.type "lbfgs"): tensors optimizer.lbfgs.memory_s and
    optimizer.lbfgs.memory_y (llama.cpp's names), the history, f32 [m, parameter_count], and
    optimizer.lbfgs.state_json, a string: the optimizer's scalars (ggwgpu.lbfgs).

A LoRA finetune's checkpoint holds the same moments or history per adapter tensor, and
ggwgpu.checkpoint.version and training.state_json (`optimizer_tensors`,
`read_optimizer_state`, `train_state_json` and `read_train_state` serve both). Writing is
atomic, as every write of ggwgpu.gguf_file.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ..gguf_file import INT_TYPES, K_ARCH, GGUFError, GGUFFile, checked_tensor, write_gguf
from ..gguf_llama import (K_CKPT_VERSION, OPTIMIZER_TENSOR_PREFIX, checked_params,
                         model_metadata, read_model, read_params)
from ..models import FAMILIES, ModelConfig, parameter_shapes
from ..tokenizer import Tokenizer
from .lbfgs import check_scalars
from .state import RunState

CHECKPOINT_VERSION = 1
K_OPT_TYPE = "optimizer.type"
K_OPT_PARAM_COUNT = "optimizer.parameter_count"
K_OPT_ITERATION = "optimizer.iteration_count"
K_OPT_JUST_INIT = "optimizer.just_initialized"
K_TRAIN_TYPE = "training.type"
K_TRAIN_STATE = "training.state_json"
TRAIN_COUNTS = {"step": "training.iteration_count", "samples": "training.sample_count",
                "tokens": "training.token_count", "epoch": "training.epoch_count"}
MOMENT_PREFIX = {"m": "optimizer.adamw.m.", "v": "optimizer.adamw.v."}
LBFGS_TENSORS = ("memory_s", "memory_y")
LBFGS_PREFIX = "optimizer.lbfgs."
K_LBFGS_STATE = "optimizer.lbfgs.state_json"
_T = GGUFValueType


# -- writing ----------------------------------------------------------------------------------

def save_checkpoint(path, cfg: ModelConfig, params: dict, tokenizer: Tokenizer,
                    opt_state: dict, train_state: RunState | dict):
    """Write a training checkpoint: the model (as `save_model`), AdamW's moments and the
    training state (module docstring). `opt_state` maps parameter names to (m, v) arrays of
    the parameter's shape (empty for an optimizer without moments); `train_state` is a
    RunState (or, to forge a file, any JSON-serialisable dict) and comes back from
    `load_checkpoint` equal. Atomic: the previous checkpoint at `path` stays whole until the
    new one is complete.
    """
    path = Path(path)
    tensors = checked_params(path, cfg, params)
    shapes = parameter_shapes(cfg)
    optimizer, lbfgs_json = optimizer_tensors(path, opt_state, shapes,
                                              "a parameter of this llama")
    train_state = as_json(train_state)
    state_json = train_state_json(path, train_state)

    metadata = model_metadata(path, cfg, tokenizer, None)
    metadata[K_CKPT_VERSION] = (CHECKPOINT_VERSION, _T.UINT32)
    kind = "lbfgs" if lbfgs_json is not None else "adamw" if optimizer else "none"
    metadata[K_OPT_TYPE] = (kind, _T.STRING)
    if lbfgs_json is not None:
        n = optimizer[LBFGS_PREFIX + LBFGS_TENSORS[0]].shape[1]
    else:           # parameter elements that have moments
        n = sum(math.prod(shapes[name]) for name in opt_state if name != "lbfgs")
    metadata[K_OPT_PARAM_COUNT] = (n, _T.UINT64)
    if lbfgs_json is not None:
        metadata[K_LBFGS_STATE] = (lbfgs_json, _T.STRING)
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
    write_gguf(path, metadata, {**tensors, **optimizer})


def optimizer_tensors(path, opt_state: dict, shapes: dict, what: str) -> tuple[dict, str | None]:
    """The tensors of `opt_state` to write after those of `shapes` (name -> shape, the
    parameters or adapter tensors that `opt_state` belongs to), checked, and the L-BFGS
    scalars as JSON (None without L-BFGS). AdamW's (m, v) of each name come in `shapes`' order,
    m then v: a stable layout that does not depend on dict order; then L-BFGS's history
    (`opt_state["lbfgs"]`), whose rows are as long as all of `shapes` together. A name that is
    not in `shapes` is refused as not `what`."""
    lbfgs = opt_state.get("lbfgs")
    moments = {k: v for k, v in opt_state.items() if k != "lbfgs"}
    for name, pair in moments.items():
        if name not in shapes:
            raise GGUFError(f"{path}: cannot write checkpoint: optimizer state for {name!r}, "
                            f"which is not {what}")
        try:
            m, v = pair
        except (TypeError, ValueError):
            raise GGUFError(f"{path}: cannot write checkpoint: optimizer state of {name} must "
                            f"be a pair (m, v)") from None
        moments[name] = {"m": m, "v": v}
    tensors = {MOMENT_PREFIX[kind] + name: checked_tensor(
                   path, MOMENT_PREFIX[kind] + name, moments[name][kind], shape, "checkpoint")
               for name, shape in shapes.items() if name in moments for kind in ("m", "v")}
    if lbfgs is None:
        return tensors, None
    m = np.shape(lbfgs["memory_s"])[0] if np.ndim(lbfgs["memory_s"]) == 2 else 0
    try:
        check_scalars(lbfgs.get("scalars"), m)
    except ValueError as e:
        raise GGUFError(f"{path}: cannot write checkpoint: {e}") from None
    n = sum(math.prod(shape) for shape in shapes.values())
    for k in LBFGS_TENSORS:
        tensors[LBFGS_PREFIX + k] = checked_tensor(path, LBFGS_PREFIX + k, lbfgs[k], (m, n),
                                                   "checkpoint")
    return tensors, json.dumps(lbfgs["scalars"], allow_nan=False)


def as_json(train_state: RunState | dict):
    """A RunState as its JSON dict; a dict (or anything else) as it is."""
    return train_state.to_json() if isinstance(train_state, RunState) else train_state


def train_state_json(path, train_state: RunState | dict) -> str:
    """training.state_json's value: `train_state` as JSON (finite numbers only)."""
    train_state = as_json(train_state)
    if not isinstance(train_state, dict):
        raise GGUFError(f"{path}: cannot write checkpoint: train_state must be a dict, got "
                        f"{type(train_state).__name__}")
    try:
        return json.dumps(train_state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{path}: cannot write checkpoint: train_state is not "
                        f"JSON-serialisable ({e})") from None


def _count(value):
    """A non-negative int that fits uint64, else None (not written as a plain key)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = int(value)
        if 0 <= value < 2 ** 64:
            return value
    return None


# -- reading ----------------------------------------------------------------------------------

def load_checkpoint(path):
    """Read a checkpoint written by `save_checkpoint`: (cfg, params, tokenizer, opt_state,
    train_state), validated as `load_model` does plus the moments' names and shapes. A model
    file is refused with a GGUFError saying so."""
    f = GGUFFile(path)
    version = f.meta.get(K_CKPT_VERSION)
    if version is None:
        if f.str_key(K_ARCH, None) in FAMILIES:
            raise GGUFError(f"{f.path}: is a model, not a training checkpoint (it has no "
                            f"{K_CKPT_VERSION} key); load it as a model instead")
        raise GGUFError(f"{f.path}: is not a ggwgpu training checkpoint (it has no "
                        f"{K_CKPT_VERSION} key)")
    if f.kind(K_CKPT_VERSION) not in INT_TYPES or version != CHECKPOINT_VERSION:
        raise GGUFError(f"{f.path}: {K_CKPT_VERSION} is {version!r}; this ggwgpu reads "
                        f"checkpoint version {CHECKPOINT_VERSION}")
    cfg, tokenizer = read_model(f)
    params = read_params(f, cfg, checkpoint=True)
    opt_state, state = read_run(f, parameter_shapes(cfg))
    return cfg, params, tokenizer, opt_state, state


def read_run(f: GGUFFile, shapes: dict) -> tuple[dict, RunState]:
    """(optimizer state, training state) of a checkpoint whose trained tensors have
    `shapes`, checked against each other: the file holds the state of the optimizer its
    options name (AdamW's moments, SGD's nothing, L-BFGS's history; after step 0), so that a
    relabelled checkpoint is refused rather than resumed without its state."""
    opt_state, state = read_optimizer_state(f, shapes), read_train_state(f)
    optimizer = state.options.optimizer
    holds = ("L-BFGS history" if "lbfgs" in opt_state else
             "AdamW moments" if opt_state else None)
    needs = {"adamw": "AdamW moments", "lbfgs": "L-BFGS history", "sgd": None}[optimizer]
    if holds != needs and (holds is not None or state.step > 0):
        raise GGUFError(f"{f.path}: the training state's optimizer is {optimizer} but the file "
                        f"holds {holds or 'no optimizer state'} (step {state.step}): not "
                        f"a checkpoint a run can go on from")
    return opt_state, state


def read_optimizer_state(f: GGUFFile, shapes: dict) -> dict:
    """The optimizer state of a checkpoint whose trained tensors have `shapes` (name ->
    shape): AdamW's (m, v) by name, in `shapes`' order, and L-BFGS's history as "lbfgs" when
    the file has one; every optimizer.* tensor checked (`optimizer_tensors` writes them)."""
    found: dict[str, dict[str, np.ndarray]] = {}
    for name in f.tensors:
        if not name.startswith(OPTIMIZER_TENSOR_PREFIX) or name.startswith(LBFGS_PREFIX):
            continue
        kind = next((k for k, p in MOMENT_PREFIX.items() if name.startswith(p)), None)
        owner = name[len(MOMENT_PREFIX[kind]):] if kind else None
        if owner not in shapes:
            raise GGUFError(f"{f.path}: unknown optimizer tensor {name}: expected "
                            f"{MOMENT_PREFIX['m']}<tensor> or {MOMENT_PREFIX['v']}<tensor> of "
                            f"a trained tensor")
        found.setdefault(owner, {})[kind] = f.tensor_f32(name, shapes[owner])
    opt_state = {name: _moment_pair(f, name, found[name]) for name in shapes if name in found}
    lbfgs = _read_lbfgs(f, sum(math.prod(s) for s in shapes.values()))
    if lbfgs is not None:
        opt_state["lbfgs"] = lbfgs
    return opt_state


def _moment_pair(f: GGUFFile, name: str, pair: dict) -> tuple[np.ndarray, np.ndarray]:
    """(m, v) of tensor `name` from a checkpoint's {"m": .., "v": ..}: both present, and v
    (a mean of squared gradients, under a square root in the update) not negative."""
    for kind in ("m", "v"):
        if kind not in pair:
            raise GGUFError(f"{f.path}: tensor {MOMENT_PREFIX[kind] + name} is missing "
                            f"(the checkpoint has the other moment of {name})")
    if (pair["v"] < 0).any():
        raise GGUFError(f"{f.path}: tensor {MOMENT_PREFIX['v'] + name} holds negative values "
                        f"(a second moment is a mean of squares)")
    return pair["m"], pair["v"]


def _read_lbfgs(f: GGUFFile, n: int) -> dict | None:
    """The L-BFGS state of a checkpoint (None without one), checked against the n
    elements of its trained tensors."""
    names = [LBFGS_PREFIX + k for k in LBFGS_TENSORS]
    present = [name for name in names if name in f.tensors]
    if not present and K_LBFGS_STATE not in f.meta:
        return None
    for name in names:
        if name not in f.tensors:
            raise GGUFError(f"{f.path}: tensor {name} is missing (the checkpoint has other "
                            f"L-BFGS state)")
    shape = f.numpy_shape(names[0])
    if len(shape) != 2 or shape[0] < 1 or shape[1] != n:
        raise GGUFError(f"{f.path}: tensor {names[0]} has shape {shape}; an L-BFGS history "
                        f"of this llama is [m, {n}]")
    state = {k: f.tensor_f32(name, shape) for k, name in zip(LBFGS_TENSORS, names)}
    raw = f.meta.get(K_LBFGS_STATE)
    try:
        state["scalars"] = check_scalars(json.loads(raw), shape[0])
    except (TypeError, ValueError, RecursionError) as e:
        raise GGUFError(f"{f.path}: key {K_LBFGS_STATE} is missing or invalid ({e})") from None
    return state


def read_train_state(f: GGUFFile) -> RunState:
    """The checkpoint's training.state_json, parsed and checked against the training state's
    one schema (RunState.from_json): every defect a GGUFError naming the key."""
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
        return RunState.from_json(state)
    except ValueError as e:
        raise GGUFError(f"{f.path}: key {K_TRAIN_STATE}: {e}") from None


# -- what a run writes ------------------------------------------------------------------------

class RunFiles:
    """The files of a training run: its checkpoint (a model checkpoint, or for a LoRA
    finetune an adapter checkpoint) and its product (the model, or the adapter). `model_cfg`
    is the config a model is written with (a finetune keeps its base's context length);
    `alpha` makes it a LoRA run, whose adapter records the base's digest; `run` is what the
    run's state holds beside the Trainer's (RunState's tokens_digest, base, mode, ...)."""

    def __init__(self, trainer, tokenizer, checkpoint_path, run: dict,
                 model_cfg: ModelConfig | None = None, alpha: float | None = None,
                 base_digest: str | None = None):
        self.trainer, self.tokenizer, self.checkpoint_path, self.run = (
            trainer, tokenizer, checkpoint_path, run)
        self.model_cfg = model_cfg or trainer.cfg
        self.alpha, self.base_digest = alpha, base_digest

    def adapter(self):
        from ..lora import Adapter
        return Adapter(self.alpha, self.trainer.parameters())

    def save_checkpoint(self):
        t = self.trainer
        if self.alpha is None:
            save_checkpoint(self.checkpoint_path, self.model_cfg, t.parameters(),
                            self.tokenizer, t.optimizer_state(), t.state(**self.run))
        else:
            from ..lora import save_adapter_checkpoint
            save_adapter_checkpoint(self.checkpoint_path, self.adapter(), t.cfg,
                                    t.optimizer_state(), t.state(**self.run))

    def write(self, path):
        """The run's product: the model, or the adapter."""
        if self.alpha is None:
            from ..gguf_llama import save_model
            save_model(path, self.model_cfg, self.trainer.parameters(), self.tokenizer)
        else:
            from ..lora import save_adapter
            save_adapter(path, self.adapter(), self.trainer.cfg, self.base_digest)


def check_finetune_state(state: RunState, base_digest: str, mode: str, checkpoint,
                         base_name) -> None:
    """A finetune checkpoint's state is of this base (its digest) and mode, else a
    ValueError saying so."""
    if state.base != base_digest or state.mode != mode:
        raise ValueError(f"{checkpoint} finetunes another base model (digest {state.base}; "
                         f"{base_name} is {base_digest}): resume with the base it started "
                         f"from")
