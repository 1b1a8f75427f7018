"""Ops that draw random numbers while training: dropout (a LoRA pair's input,
models.blocks.lora_input) and uniform noise (NEFTune's, on the token embeddings). Shader:
shaders/draws.wgsl.

The draws come from a hash of each element's row-major index, a seed and a stream, so that
the forward, its backward, a recomputing checkpoint and every backend draw the same ones,
with no state to keep. Element i's draw is the top 24 bits of mix(mix(i ^ key) + key), key =
mix(seed + mix(stream)), mix being lowbias32 (a 32-bit integer hash). The seed comes from the
control, an i32 input [seed, on] the trainer writes each step (on 0: the op passes x as it
is, for evaluation); the stream, a parameter, keeps two ops of one step apart.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops as O
from ..tensor import ShapeError
from .elementwise import LARGE
from .registry import Case, Input, need_float, register

DRAW_BITS = 24           # a draw is the hash's top 24 bits: an integer below 2^24


def mix(x: np.ndarray) -> np.ndarray:
    """lowbias32 on a uint32 array (draws.wgsl's mix)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def draws(shape, seed: int, stream: int) -> np.ndarray:
    """Each element's draw, an integer in [0, 2^24) (uint32, `shape`)."""
    key = mix(np.array([seed & 0xFFFFFFFF], np.uint32) + mix(np.array([stream], np.uint32)))
    i = np.arange(math.prod(shape), dtype=np.uint32)
    return (mix(mix(i ^ key) + key) >> (32 - DRAW_BITS)).reshape(shape)


def control(ctl) -> tuple[int, bool]:
    """(seed, on) of a control tensor's value."""
    seed, on = (int(v) for v in np.asarray(ctl).reshape(-1)[:2])
    return seed, bool(on)


def draws_shape(srcs, magnitude, stream, what="magnitude", high=math.inf):
    x, ctl = srcs
    need_float(x)
    if ctl.dtype != "i32" or ctl.shape != (2,):
        raise ShapeError(f"the control must be i32 (2,), [seed, on], got {ctl.dtype} "
                         f"{ctl.shape}")
    if not 0 <= magnitude < high:
        raise ShapeError(f"the {what} must be in [0, {high:g}), got {magnitude}")
    if not 0 <= stream < 2 ** 32:
        raise ShapeError(f"the stream must be a 32-bit unsigned integer, got {stream}")
    return x.shape, x.dtype, {}


def draws_cases(param: str, values: tuple):
    """Cases of a draws op over layouts, seeds (any i32), on and off, and `param`'s values."""
    on = Input((2,), -2 ** 31, 2 ** 31 - 1, dtype="i32")     # any seed; on (0 at 2^-32)
    off = Input((2,), 0, 1, dtype="i32")
    small, half, large = values
    return [Case((Input((1,)), on), {param: half, "stream": 0}),
            Case((Input((5, 7)), on), {param: small, "stream": 3}),
            Case((Input((5, 7)), on), {param: 0.0, "stream": 3}),
            Case((Input((3, 4, 5), layout="permuted"), on), {param: half, "stream": 2 ** 32 - 1}),
            Case((Input((4, 9), layout="strided"), Input((2,), 1, 9, "strided", "i32")),
                 {param: large, "stream": 7}),
            Case((Input((5, 7)), off), {param: half, "stream": 1}),
            Case((Input((LARGE,)), on), {param: small, "stream": 11}, grad=False)]


# -- dropout ----------------------------------------------------------------------------------

def dropout_threshold(rate: float) -> int:
    """The smallest draw kept: an element is dropped with probability `rate` (to 2^-24)."""
    return math.ceil(rate * 2 ** DRAW_BITS)


def dropout_scale(rate: float) -> float:
    """1 / (1 - rate) as the kernel multiplies by it: a float32."""
    return float(np.float32(1) / (np.float32(1) - np.float32(rate)))


def dropout_keep(shape, seed: int, rate: float, stream: int) -> np.ndarray:
    """The elements dropout keeps (bool, `shape`): those whose draw is at least the
    threshold."""
    return draws(shape, seed, stream) >= dropout_threshold(rate)


def dropout_ref(x, ctl, rate, stream):
    seed, on = control(ctl)
    if not on:
        return x.copy()
    keep = dropout_keep(x.shape, seed, rate, stream)
    return np.where(keep, x * x.dtype.type(dropout_scale(rate)), 0).astype(x.dtype)


# linear in x, with the same mask: the backward is the op on the gradient
dropout = register(
    "dropout", n_srcs=2, params=("rate", "stream"), shader="draws",
    shape=lambda srcs, rate, stream: draws_shape(srcs, rate, stream, "rate", 1),
    reference=dropout_ref, no_grad=(1,),
    backward=lambda n, g: (O.dropout(g, n.srcs[1], n.params["rate"], n.params["stream"]),
                           None),
    uniforms=lambda n: {"f": (dropout_scale(n.params["rate"]),),
                        "u": (n.params["stream"], dropout_threshold(n.params["rate"]))},
    cases=lambda: draws_cases("rate", (0.1, 0.5, 0.9)),
    doc="Inverted dropout: x times 1 / (1 - rate) where an element is kept, else 0, each "
        "dropped with probability `rate`; ctl, i32 [seed, on], gives the draws (with the "
        "stream, an integer) and turns it off (on 0: x as it is). The draws are a hash of "
        "each element's row-major index: the same on every backend, again in the backward.")


# -- noise ------------------------------------------------------------------------------------

def noise_unit(shape, seed: int, stream: int) -> np.ndarray:
    """Each element's noise before its magnitude: draw / 2^23 - 1, uniform in [-1, 1) (exact
    in float32)."""
    return draws(shape, seed, stream).astype(np.float32) * np.float32(2.0 ** (1 - DRAW_BITS)) \
        - np.float32(1)


def noise_ref(x, ctl, magnitude, stream):
    seed, on = control(ctl)
    if not on:
        return x.copy()
    unit = noise_unit(x.shape, seed, stream).astype(x.dtype)
    return (x + x.dtype.type(np.float32(magnitude)) * unit).astype(x.dtype)


noise = register(
    "noise", n_srcs=2, params=("magnitude", "stream"), shader="draws",
    shape=draws_shape, reference=noise_ref, no_grad=(1,),
    backward=lambda n, g: (g, None),
    uniforms=lambda n: {"f": (float(n.params["magnitude"]),), "u": (n.params["stream"],)},
    cases=lambda: draws_cases("magnitude", (0.01, 0.5, 3.0)),
    doc="x plus noise uniform in [-magnitude, magnitude), NEFTune's on the token "
        "embeddings; ctl, i32 [seed, on], gives the draws (with the stream, an integer) and "
        "turns it off (on 0: x as it is), as dropout's.")

__all__ = ["dropout", "noise"]
