"""Training a llama: the schedule, the planned train step, checkpoints.

One training step is one planned graph, built and planned once: the forward of a batch, its
backward, gradient clipping by global norm and an in-place AdamW (or SGD) update of every parameter. Per step
the host writes the batch and the optimizer's hyper-parameters (the schedule lives on the
host, as in ggml) and reads back the loss and the gradient norm.

A step whose loss or gradients are not finite changes nothing: append_finite_flag tests the
loss and the gradients' sum of squares on the device (exponent bits, no NaN arithmetic) and
the optimizer kernels do nothing where that flag is 0. The step still counts (its batch is used up, the schedule moves on); its record
says "skipped", and what to do next (stop or go on) is the caller's choice.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from . import ops as O
from .graph import build_backward
from .models.llama import MAX_LOGITS_BYTES, LlamaConfig, build_train_graph
from .tensor import constant, input_tensor


@dataclass
class TrainOptions:
    """Optimizer and schedule (llama.cpp train-text-from-scratch defaults)."""
    optimizer: str = "adamw"           # or "sgd" (no moments, decoupled weight decay)
    batch: int = 8
    grad_accum: int = 1                # micro-batches of `batch` samples per optimizer step
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1          # only tensors with >= 2 dims (decay_min_ndim 2)
    grad_clip: float = 1.0             # global gradient norm; 0 turns clipping off
    warmup: int = 100
    cos_decay_steps: int = 1000
    cos_decay_min: float = 0.1
    cos_decay_restart: float = 1.1     # growth of each restart's length
    restarts: bool = False
    flash_attn: bool = False
    checkpointing: bool = False        # gradient checkpointing: keep only block outputs
    seed: int = 0


def schedule(step: int, o: TrainOptions) -> float:
    """Learning-rate multiplier of `step` (0-based): linear warmup, then cosine decay to
    cos_decay_min, optionally restarting with periods growing by cos_decay_restart (as a
    float: the reference truncates it to an int)."""
    if step < o.warmup:
        return (step + 1) / o.warmup
    t, period = step - o.warmup, float(o.cos_decay_steps)
    if o.restarts:
        while t >= period:
            t -= period
            period *= o.cos_decay_restart
    elif t >= period:
        return o.cos_decay_min
    return o.cos_decay_min + (1 - o.cos_decay_min) * 0.5 * (1 + math.cos(math.pi * t / period))


def clip_scale(grads, max_norm: float):
    """Graph tensors (sum of squared gradients, factor min(1, max_norm / norm)) — all on the
    device, no readback: min(1, r) = (1 + r - |1 - r|) / 2."""
    sumsq = None
    for g in grads:
        s = O.sum(O.sqr(g))
        sumsq = s if sumsq is None else O.add(sumsq, s)
    if not max_norm:
        return sumsq, None
    tiny = constant(np.array([1e-12], np.float32), name="tiny")
    r = O.div(constant(np.array([max_norm], np.float32), name="max_norm"),
              O.sqrt(O.add(sumsq, tiny)))
    one = constant(np.ones(1, np.float32), name="one")
    return sumsq, O.scale(O.sub(O.add(one, r), O.abs(O.sub(one, r))), 0.5)


def logits_bound(backend) -> int:
    """The most bytes of logits a training graph on `backend` holds at once
    (build_train_graph's max_logits_bytes): the device's largest storage binding, else
    128 MiB."""
    limits = getattr(backend, "storage_limits", None)
    return min(limits.values()) if limits else MAX_LOGITS_BYTES


class Trainer:
    """A llama and its optimizer state, planned on a backend, stepping through batches."""

    def __init__(self, cfg: LlamaConfig, values: dict, backend, options: TrainOptions,
                 batch_source, opt_state: dict | None = None, step: int = 0, graph=None,
                 world=None):
        """`graph` (a TrainGraph) replaces the default one built from `values`: finetuning
        passes one whose params are the trainable tensors only. With `world` (a
        distributed.World) this is one rank of a data-parallel run: options.batch is the
        global batch, the graph takes world.local_batch(options.batch) rows of it, and the
        gradients are summed over the ranks before the optimizer (distributed.py)."""
        self.cfg, self.options, self.batches, self.step = cfg, options, batch_source, step
        self.world = world
        batch = world.local_batch(options.batch) if world else options.batch
        g = graph or build_train_graph(cfg, values, batch, flash=options.flash_attn,
                                       max_logits_bytes=logits_bound(backend))
        self.graph = g
        grads = build_backward(g.loss, list(g.params.values()),
                               checkpoints=g.checkpoints if options.checkpointing else None,
                               recompute=g.recompute)
        accumulated = []
        if options.grad_accum > 1:
            grads, accumulated = self.accumulate(grads, options.grad_accum)
        self.exchange, loss, sent = None, g.loss, []
        if world is not None:   # the optimizer reads the gradients summed over the ranks
            from .distributed import GradientExchange
            self.exchange = GradientExchange(grads)
            grads, loss, sent = self.exchange.grads, self.exchange.loss, self.exchange.copies
        self.sumsq, factor = clip_scale(grads.values(), options.grad_clip)
        if options.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"unknown optimizer {options.optimizer!r}: adamw or sgd")
        adamw = options.optimizer == "adamw"
        # the host writes every hyper-parameter but the last, the finite flag
        n_hparams = len(O.ADAMW_HPARAMS if adamw else O.SGD_HPARAMS) - 1
        self.hparams = input_tensor((n_hparams,), name=f"{options.optimizer} hparams")
        flagged = O.append_finite_flag(self.hparams, self.sumsq, loss)
        self.moments, updates = {}, []
        for p, grad in grads.items():
            if factor is not None:
                grad = O.mul(grad, factor)
            decay = p.ndim >= 2
            if not adamw:
                updates.append(O.opt_step_sgd(p, grad, flagged, decay))
                continue
            m, v = (constant(np.zeros(p.shape, np.float32), name=f"{p.name}.{k}")
                    for k in ("m", "v"))
            self.moments[p.name] = (m, v)
            updates.append(O.opt_step_adamw(p, grad, m, v, flagged, decay))
        # topo_order runs each in-place update after every reader of the old parameter
        self.plan = backend.plan([g.loss, self.sumsq, *accumulated, *sent, *updates])
        # with a world: the backward and the optimizer run apart, the allreduce between
        self.stages = ((self.plan.stage([g.loss, *accumulated, *sent]),
                        self.plan.stage([self.sumsq, *updates])) if world else (None, None))
        if not g.packed:    # else positions come with each batch
            self.plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
        for name, (m, v) in (opt_state or {}).items():
            self.plan.write(self.moments[name][0], m)
            self.plan.write(self.moments[name][1], v)

    def accumulate(self, grads: dict, n: int):
        """Gradient accumulation inside the one planned graph: each micro-batch adds its
        gradient into a persistent sum (restarted by keep = 0 on the first micro-batch), and
        the update sees sum / n. The micro-batches before the last run the update with
        hyper-parameters that make it an exact no-op (see train_step). keep = 0 cannot clear
        a NaN (NaN * 0 is NaN): train_step zeroes the sums after a non-finite step."""
        self.keep = input_tensor((1,), name="keep accumulated")
        averaged, persist, self.grad_sums = {}, [], []
        for p, grad in grads.items():
            total = constant(np.zeros(p.shape, np.float32), name=f"{p.name}.grad_sum")
            self.grad_sums.append(total)
            new_total = O.add(O.mul(total, self.keep), grad)
            persist.append(O.cpy(new_total, total))
            averaged[p] = O.scale(new_total, 1.0 / n)
        return averaged, persist

    @property
    def step_tokens(self) -> int:
        return self.options.batch * self.options.grad_accum * self.cfg.n_ctx

    def noop_hparams(self) -> np.ndarray:
        """Hyper-parameters under which the update changes nothing: lr 0, and AdamW's betas
        1 so the moments stay as they are."""
        if self.options.optimizer == "sgd":
            return np.zeros(2, np.float32)
        return np.array([0, 1, 1, self.options.eps, 0, 1, 1], np.float32)

    def step_hparams(self) -> tuple[np.ndarray, float]:
        """The optimizer's hyper-parameter tensor for this step, and the learning rate."""
        o, t = self.options, self.step + 1
        lr = o.lr * schedule(self.step, o)
        if o.optimizer == "sgd":
            return np.array([lr, o.weight_decay], np.float32), lr
        return O.adamw_hparams(lr, o.beta1, o.beta2, o.eps, o.weight_decay, t), lr

    def feeds(self, inputs, targets, segments=None) -> dict:
        """The graph's inputs for one batch from the batch source (with `segments` when its
        rows are packed): with a world, this rank's rows of it, weighted by the whole
        batch's count of targets."""
        if self.world is None:
            return self.graph.feeds(inputs, targets, segments)
        inputs_, targets_, counted = self.world.rows(inputs, targets)
        if segments is not None:    # the same rows of the segments
            segments = self.world.rows(segments, targets)[0]
        return self.graph.feeds(inputs_, targets_, segments, counted)

    def train_step(self, stop: int = 0) -> dict:
        """One optimizer step on the next batch (grad_accum micro-batches); returns what a
        log line needs. With a world, `stop` (a signal number, 0: none) is this rank's wish
        to stop after this step, and the record's "stop" is the ranks' agreed one."""
        hp, lr = self.step_hparams()
        g, n, loss = self.graph, self.options.grad_accum, 0.0
        backward, optimize = self.stages
        for i in range(n):
            feeds = {**self.feeds(*self.batches.next_batch()),
                     self.hparams: hp if i == n - 1 else self.noop_hparams()}
            if n > 1:
                feeds[self.keep] = np.array([float(i > 0)], np.float32)
            self.plan.run(feeds, stage=backward)
            if i < n - 1:
                loss += float(self.plan.read(g.loss)[0]) / n
        record = {}
        if self.exchange is not None:   # one readback, one allreduce, one upload
            sent, last = self.plan.read_many([self.exchange.sent, g.loss])
            loss, record["stop"] = self.exchange.exchange(
                self.world, self.plan, sent, loss + float(last[0]) / n, stop)
            self.plan.run({self.hparams: hp}, stage=optimize)
            sumsq = self.plan.read(self.sumsq)
        else:
            # the last loss and the gradient norm come back together: one wait for the device
            last, sumsq = self.plan.read_many([g.loss, self.sumsq])
            loss += float(last[0]) / n
        grad_norm = math.sqrt(float(sumsq[0]))
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped and n > 1:  # the NaN in the gradient sums must not reach later steps
            for total in self.grad_sums:
                self.plan.write(total, np.zeros(total.shape, np.float32))
        self.step += 1
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": self.step * self.step_tokens, "skipped": skipped, **record}

    def evaluate(self, batches) -> float:
        """The mean loss per counted target over `batches` (TrainGraph.feeds's arguments:
        (inputs, targets), or for a packed graph (inputs, targets, segments)), with
        the parameters left as they are: each batch runs the planned step under no-op
        hyper-parameters (lr 0, betas 1), so no second plan (and no copy of the weights) is
        needed. Gradient sums are restarted by the next step's first micro-batch anyway."""
        g, total, count = self.graph, 0.0, 0
        for batch in batches:
            feeds = {**self.feeds(*batch), self.hparams: self.noop_hparams()}
            if self.options.grad_accum > 1:
                feeds[self.keep] = np.zeros(1, np.float32)
            self.plan.run(feeds, stage=self.stages[0])
            n = int((np.asarray(batch[1]) >= 0).sum())
            total += float(self.plan.read(g.loss)[0]) * n
            count += n
        if self.world is not None:   # each rank's loss is its share of each batch's mean
            total = float(self.world.allreduce(np.array([total]))[0])
        return total / max(count, 1)

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: self.plan.read(p) for name, p in self.graph.params.items()}

    def optimizer_state(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {name: (self.plan.read(m), self.plan.read(v))
                for name, (m, v) in self.moments.items()}

    def state(self) -> dict:
        """Everything besides tensors that resuming needs (JSON-serialisable)."""
        return {"step": self.step,
                "samples": self.step * self.options.batch * self.options.grad_accum,
                "tokens": self.step * self.step_tokens, "options": asdict(self.options),
                "model": asdict(self.cfg), "data": self.batches.state()}


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that knows only them."""
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


def token_digest(tokens: np.ndarray) -> str:
    """Identifies the training tokens, so a resumed run can check it sees the same data."""
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:16]
