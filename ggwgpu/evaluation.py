"""A model's loss over fixed windows of a text or over example batches, as `ggwgpu eval` and
`ggwgpu.evaluate` measure it: one frozen forward graph, planned once, run batch by batch, the
mean over every counted target."""
from __future__ import annotations

import math

import numpy as np

from .backends import precision_for
from .models import build_train_graph
from .training import logits_bound


def window_starts(samples, spread: int | None = None, first: int | None = None) -> np.ndarray:
    """Start positions of the windows of `samples` (data.Samples) to evaluate: the text once,
    in consecutive windows that do not overlap (as llama.cpp's perplexity; at most the
    `first` ones), or `spread` windows at evenly spaced positions (overlapping when the text
    holds fewer)."""
    if spread is None:
        return samples.starts[::samples.n_ctx][:first]
    n = min(spread, samples.n_samples)
    return samples.starts[np.linspace(0, samples.n_samples - 1, n).round().astype(np.int64)]


def padded(rows, batch: int):
    """(inputs, targets) of fewer windows than `batch`, filled up with rows that count no
    target (the plan runs `batch` rows)."""
    inputs, targets = rows
    missing = batch - len(inputs)
    if missing == 0:
        return rows
    return (np.concatenate([inputs, np.repeat(inputs[:1], missing, axis=0)]),
            np.concatenate([targets, np.full((missing, targets.shape[1]), -1, targets.dtype)]))


def window_batches(samples, starts, batch: int):
    """Batches of `batch` windows at `starts`, the last one filled up (`padded`)."""
    return (padded(samples.windows(starts[i:i + batch]), batch)
            for i in range(0, len(starts), batch))


def mean_loss(backend, cfg, values, batches, batch: int, adapters=(), precision: str = "f32",
              packed: bool = False, after_batch=None) -> tuple[float, int]:
    """(the mean loss per counted target, the targets counted) of the model `values` (with
    `adapters`, frozen) over `batches` of `batch` rows; `after_batch(loss so far)` is called
    after each one."""
    g = build_train_graph(cfg, values, batch, adapters=adapters, frozen=True,
                          max_logits_bytes=logits_bound(backend), packed=packed,
                          precision=precision_for(backend, precision))
    plan = backend.plan([g.loss])
    if not packed:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
    total, counted = 0.0, 0
    for rows in batches:
        plan.run(g.feeds(*rows))
        n = int((np.asarray(rows[1]) >= 0).sum())
        total += float(plan.read(g.loss)[0]) * n
        counted += n
        if after_batch is not None:
            after_batch(total / max(counted, 1))
    return total / max(counted, 1), counted


def perplexity_of(loss: float) -> float:
    return math.inf if loss > 700 else math.exp(loss)     # exp overflows past ~709
