"""baby-llama: a llama of a few thousand parameters learns to continue a sine wave.

ggml's first training example. The wave's values are binned into a small vocabulary
(token = bin of the value), each training sequence is the wave from its own phase, and the
model learns to predict the next bin: it has to find the period from the context. The same
model and full batch train once with Adam and once with L-BFGS for the same wall time;
then each continues a wave from a phase it never saw, drawn in the terminal.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from .generate import Decoder
from .models import ModelConfig, init_parameters
from .training import Trainer, TrainOptions

CFG = ModelConfig(n_vocab=16, n_embd=16, n_head=2, n_layer=1, n_ff=32, n_ctx=24)
PERIOD = 11.0       # tokens per wave period (not a whole number: every phase differs)
BATCH = 24          # sequences, phases spread over one period


def wave_tokens(phase: float, n: int, vocab: int = CFG.n_vocab) -> np.ndarray:
    """n bins of sin(2 pi t / PERIOD + phase), t = 0 .. n - 1: values in [-1, 1] to ids."""
    value = np.sin(2 * np.pi * np.arange(n) / PERIOD + phase)
    return np.clip(np.round((value + 1) / 2 * (vocab - 1)), 0, vocab - 1).astype(np.int32)


class FullBatch:
    """The batch source of the demo: the same batch every step (L-BFGS's setting)."""

    def __init__(self, tokens: np.ndarray):
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]

    def next_batch(self):
        return self.inputs, self.targets

    def state(self) -> dict:
        return {}


def training_set(n_ctx: int = CFG.n_ctx, batch: int = BATCH) -> np.ndarray:
    phases = 2 * np.pi * np.arange(batch) / batch
    return np.stack([wave_tokens(p, n_ctx + 1) for p in phases])


@dataclass
class Run:
    optimizer: str
    times: list      # seconds since the start, after each step
    losses: list     # the loss before each step
    evaluations: int
    trainer: Trainer


def train_for(backend, optimizer: str, seconds: float, seed: int = 0, lr: float = 0.01) -> Run:
    """Train the baby llama with `optimizer` until `seconds` have passed (at least one
    step; planning is not counted)."""
    options = TrainOptions(optimizer=optimizer, batch=BATCH, lr=lr, warmup=1,
                           weight_decay=0.0, grad_clip=0.0, cos_decay_steps=10 ** 9,
                           cos_decay_min=1.0, seed=seed)
    trainer = Trainer(CFG, init_parameters(CFG, seed), backend, options,
                      FullBatch(training_set()))
    times, losses, evaluations = [], [], 0
    start = time.perf_counter()
    while not times or times[-1] < seconds:
        record = trainer.train_step()
        losses.append(record["loss"])
        evaluations += record.get("evaluations", 1)
        times.append(time.perf_counter() - start)
        if "status" in record and record["status"].kind != "ok":   # an L-BFGS that stopped
            break
    return Run(optimizer, times, losses, evaluations, trainer)


def continuation(backend, trainer: Trainer, phase: float, prompt: int, n: int) -> np.ndarray:
    """Greedy continuation of `n` tokens after `prompt` tokens of the wave at `phase`."""
    decoder = Decoder(backend, CFG, trainer.parameters())
    tokens = list(wave_tokens(phase, prompt))
    logits = decoder.prefill(tokens)
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        if len(tokens) < CFG.n_ctx:
            logits = decoder.step(tokens[-1])
    return np.array(tokens[prompt:], np.int32)


def draw(truth: np.ndarray, guess: np.ndarray, prompt: int, vocab: int = CFG.n_vocab) -> str:
    """The wave in the terminal: one column per token, one row per bin (high bins on top);
    'o' the prompt, '*' the model's continuation, '.' the true wave where they differ."""
    rows = [[" "] * len(truth) for _ in range(vocab)]
    for t, v in enumerate(truth):
        rows[vocab - 1 - v][t] = "o" if t < prompt else "."
    for t, v in enumerate(guess):
        rows[vocab - 1 - v][prompt + t] = "*"
    return "\n".join("|" + "".join(r) for r in rows)


def loss_at(run: Run, t: float) -> float:
    """The last loss measured by time t (the first one before any)."""
    i = int(np.searchsorted(run.times, t, side="right"))
    return run.losses[min(i, len(run.losses) - 1)]


def plot_png(path, runs, truth, guesses, prompt):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        a.plot(run.times, run.losses, label=f"{run.optimizer} ({len(run.losses)} steps)")
    a.set(xlabel="seconds", ylabel="loss (nats/token)", yscale="log", title="baby-llama")
    a.legend()
    b.plot(range(len(truth)), truth, "k.-", label="wave")
    for run, guess in zip(runs, guesses):
        b.plot(range(prompt, prompt + len(guess)), guess, "o--", label=run.optimizer)
    b.axvline(prompt - 0.5, color="grey", lw=0.5)
    b.set(xlabel="position", ylabel="token (bin)", title="continuation after the prompt")
    b.legend()
    fig.tight_layout()
    tmp = f"{path}.tmp"       # a whole file or none: written apart, renamed into place
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
