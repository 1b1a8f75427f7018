"""The memory a command will need, estimated from its configuration before anything is
allocated, so that `--n-ff 1000000000` is refused with the numbers rather than after the
host has handed out gigabytes (or killed the process).

The estimate is a floor, not the plan (`Plan.memory()` reports that, after planning): f32
weights, what training keeps per trained value (gradients and AdamW's two moments), the
activations of one window batch (each layer's input, one layer's feed-forward and, without
flash attention, its attention scores), and the KV cache of a decoder. It is compared with
the host's available memory (/proc/meminfo's MemAvailable, or $GGWGPU_MAX_HOST_BYTES when
set) — on the NumPy backend everything lives there; on a GPU the weights are still
initialised or loaded on the host first. WebGPU does not say how much memory a device has:
the device's own limits are checked by the planner per buffer.
"""
from __future__ import annotations

import dataclasses
import math
import os

from .files import positive_env
from .models import ModelConfig, parameter_shapes
from .models.blocks import fuses

HOST_LIMIT_VAR = "GGWGPU_MAX_HOST_BYTES"
F32, F16 = 4, 2    # bytes per value
PREFILL_CHUNK = 512     # the most tokens a decoder's run takes (generate.PREFILL_SIZES)


class MemoryLimitError(ValueError):
    """A configuration that needs more memory than there is; the message has the numbers."""


def parameter_count(cfg: ModelConfig) -> int:
    """Values of the model's parameters, without listing every layer (n_layer may be a
    forged or mistyped billion): the shapes of a 0- and a 1-layer model."""
    def count(n_layer):
        shapes = parameter_shapes(dataclasses.replace(cfg, n_layer=n_layer))
        return sum(math.prod(s) for s in shapes.values())
    if not cfg.family.layers_alike(cfg):    # blocks that differ, as the file lists them
        return count(cfg.n_layer)
    base = count(0)
    return base + cfg.n_layer * (count(1) - base)


def host_available() -> int | None:
    """Bytes the host can still hand out: $GGWGPU_MAX_HOST_BYTES, else MemAvailable, else
    None (unknown: no check)."""
    value = positive_env(HOST_LIMIT_VAR, "bytes", MemoryLimitError)
    if value is not None:
        return value
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pass
    return None


def estimate(cfg: ModelConfig, *, batch: int = 0, trained: int = 0, weight_bytes=None,
             dequantized: int = 0, flash_attn: bool = False, decoder: bool = False,
             value_bytes: int = F32) -> dict[str, int]:
    """Bytes by role. `batch`: windows of cfg.n_ctx tokens per step (0: no training or
    evaluation graph); `trained`: values the optimizer updates (gradients and two moments each,
    f32 whatever the precision); `weight_bytes`: the loaded weights' bytes (default: f32
    parameters); `dequantized`: values of block-type weights that the NumPy backend also holds
    as f32 (its products read them so, once dequantized); `decoder`: a KV cache of cfg.n_ctx
    positions and the attention scores of a prefill chunk over all of them; `value_bytes`:
    bytes of an activation or KV-cache value (F16 = 2 where they are f16 tensors, which both
    backends store as halves)."""
    need = {"weights": F32 * parameter_count(cfg) if weight_bytes is None else weight_bytes}
    if dequantized:
        need["dequantized weights"] = F32 * dequantized
    if trained:
        need["gradients and optimizer moments"] = 3 * F32 * trained
    if batch:
        tokens = batch * cfg.n_ctx
        acts = tokens * (cfg.n_embd * (cfg.n_layer + 4) + 3 * cfg.n_ff)
        # capped scores, heads too wide for the kernels run unfused
        if not flash_attn or not fuses(cfg, cfg.head_dim + cfg.family.attention_sinks):
            acts += batch * cfg.n_head * cfg.n_ctx * cfg.n_ctx * score_copies(cfg)
        need["activations"] = value_bytes * acts
    if decoder:
        family = cfg.family
        if family.layers_alike(cfg):
            width = cfg.n_layer * cfg.kv_dim
        else:   # each attention layer with K/V of its own, at its width
            width = sum(family.layer(cfg, i).kv_dim for i in range(cfg.n_layer)
                        if family.kv_layer(cfg, i) == i and family.attends(cfg, i))
        convolved = sum(family.conv_widths(cfg).values())   # inputs cached by position
        need["KV cache"] = value_bytes * cfg.n_ctx * (2 * width + convolved)
        # one layer's scores of the decoder's largest prefill chunk (generate.PREFILL_SIZES)
        need["prefill attention scores"] = value_bytes * cfg.n_head * min(
            PREFILL_CHUNK, cfg.n_ctx) * cfg.n_ctx * score_copies(cfg)
        if cfg.recurrent_layers:    # delta-net and Mamba2 states, f32
            need["recurrent states"] = F32 * len(cfg.recurrent_layers) * \
                family.state_size(cfg)
    return need


def score_copies(cfg: ModelConfig) -> int:
    """Score-sized tensors a layer's attention holds: 1, with gemma2's soft cap 3 (the
    product, its tanh and the capped scores), with gpt-oss's sinks 2 (the product and the
    scores with their column of sinks)."""
    return 3 if cfg.attn_logit_softcap else 2 if cfg.family.attention_sinks else 1


HOST_ROLES = ("weights", "gradients and optimizer moments")   # on the host with any device


def check(need: dict[str, int], what: str, device_is_host: bool = True) -> None:
    """Raise MemoryLimitError with the numbers when the host part of `need` (all of it when
    the device is the host, as NumPy's is; else the weights and what checkpoints read back)
    is more than `host_available()`."""
    available = host_available()
    host = {r: n for r, n in need.items() if n and (device_is_host or r in HOST_ROLES)}
    total = sum(host.values())
    if available is None or total <= available:
        return
    parts = ", ".join(f"{role} {_gib(n)}" for role, n in host.items())
    limit = (f"the limit is {_gib(available)} (${HOST_LIMIT_VAR})"
             if os.environ.get(HOST_LIMIT_VAR) is not None else
             f"{_gib(available)} is available (${HOST_LIMIT_VAR} sets another limit)")
    raise MemoryLimitError(f"{what} needs at least {_gib(total)} of host memory ({parts}), "
                           f"but {limit}")


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.3g} GiB" if n >= 2 ** 26 else f"{n / 2 ** 20:.3g} MiB"
