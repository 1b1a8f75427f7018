"""The Trainer: a model and its optimizer state planned on a backend, stepping through
batches. Its step regime (regimes.py: AdamW or SGD as one planned graph, or L-BFGS) makes each
step; a step whose loss or gradients are not finite changes nothing, still counts (its batch
is used up, the schedule moves on), and its record says "skipped": what to do next (stop or
go on) is the caller's choice.

With dynamic loss scaling (LossScaler: options.loss_scale "dynamic", or "auto", the default,
on an f16 graph: options.precision) the backward starts from the scale S instead of 1, so
every gradient in the graph is S times the true one; the factor that clipping multiplies the
gradients by takes 1/S too, so clipping, the gradient norm and the optimizer see the true
gradients. S is a power of two: both multiplications are exact.
A step whose (scaled) gradients are not finite is skipped and halves S, as PyTorch's
GradScaler does; such a skip does not count as an optimizer step (AdamW's bias correction).
"""
from __future__ import annotations

import math

import numpy as np

from ..backends import precision_for
from ..graph import build_backward
from ..models import MAX_LOGITS_BYTES, ModelConfig, build_train_graph, frozen
from ..tensor import input_tensor
from .options import MAX_SCALE, MIN_SCALE, TrainOptions
from .regimes import regime_for
from .state import RunState


class LossScaler:
    """Dynamic loss scaling with the rules of PyTorch's torch.amp.GradScaler: the scale S
    starts at `init`; a step whose gradients are not finite is skipped and multiplies S by
    0.5 (backoff) and restarts the count of finite steps (growth_tracker); `interval` finite
    steps in a row multiply it by 2 (growth) and restart the count. S stays within
    [MIN_SCALE, MAX_SCALE] (PyTorch's only limit is that it stays finite).
    `skipped_steps` counts the skipped steps, which are no optimizer steps (PyTorch does not
    call optimizer.step() for them, so Adam's step count stays)."""
    GROWTH, BACKOFF = 2.0, 0.5

    def __init__(self, init: float, interval: int, state: dict | None = None):
        state = state or {}
        self.interval = interval
        self.scale = float(state.get("scale", init))
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def update(self, finite: bool):
        """After a step: its gradients were all finite, or it was skipped."""
        if not finite:
            self.scale = max(self.scale * self.BACKOFF, MIN_SCALE)
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.interval:
            self.scale = min(self.scale * self.GROWTH, MAX_SCALE)
            self.growth_tracker = 0

    def state(self) -> dict:
        """For a checkpoint (PyTorch's GradScaler.state_dict names scale and growth
        tracker); check_state validates it."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps}


def logits_bound(backend, checkpointing: bool = False, full: bool = False) -> int:
    """The most bytes of logits a training graph on `backend` holds at once
    (build_train_graph's max_logits_bytes): 128 MiB, or the device's largest storage
    binding where that is less. A 49k-128k vocabulary makes a batch's logits and their
    gradient the largest tensors of a step (Llama 3.2's 128k, 4 x 512 tokens: 1 GiB each in
    f32), and chunks cost one more output product a step. With checkpointing a LoRA step
    (not `full` training) gets a quarter of that: once the layers recompute, the logits
    would be most of what stays (SmolLM2-135M, 4 x 128 tokens: 285 MiB planned in one
    chunk, 197 in three). Full training keeps the larger chunks: the output weight's
    gradient is summed chunk by chunk, and chunks of fewer than n_embd rows keep more of it
    alive than they free (SmolLM2-135M: 2359 MiB in one chunk, 2468 in three)."""
    limits = backend.storage_limits
    bound = min(MAX_LOGITS_BYTES, *limits.values()) if limits else MAX_LOGITS_BYTES
    return bound // 4 if checkpointing and not full else bound


class Trainer:
    """A model and its optimizer state, planned on a backend, stepping through batches."""

    def __init__(self, cfg: ModelConfig, values: dict, backend, options: TrainOptions,
                 batch_source, opt_state: dict | None = None, step: int = 0, graph=None,
                 lora=None, world=None, loss_scaler: dict | None = None):
        """`lora` (a ggwgpu.lora.Adapter) makes it a LoRA finetune: the adapter's tensors are
        trained, `values` (f32 or block types) stay frozen. `graph` (a TrainGraph) replaces
        the one built from `values` (and `lora`). With `world` (a distributed.World) this is
        one rank of a data-parallel run: options.batch is the global batch, the graph takes
        world.local_batch(options.batch) rows of it, and the gradients are summed over the
        ranks before the update (distributed.py). `loss_scaler` is a checkpoint's
        RunState.loss_scaler (LossScaler.state()); without one a dynamic loss scale starts at
        options.loss_scale_init. With a preference objective (options.objective other than
        sft) the batches are pairs.PairBatches' (options.batch units of two rows, a pair
        each when padded), with their reference log-probabilities set
        (preference.sequence_logps; DPO, IPO, KTO)."""
        self.cfg, self.options, self.batches, self.step = cfg, options, batch_source, step
        self.world = world
        self.precision = precision_for(backend, options.precision)
        batch = world.local_batch(options.batch) if world else options.batch
        preference = options.objective != "sft"
        if options.lora_dropout and lora is None and graph is None:
            raise ValueError("option lora_dropout drops the inputs of LoRA pairs, and this run "
                             "trains every weight: finetune with LoRA, or leave it 0")
        rows = 2 * batch if preference else batch     # a unit of pairs is two rows
        g = graph or build_train_graph(cfg, values, rows, flash=options.flash_attn,
                                       lora=lora,
                                       max_logits_bytes=logits_bound(
                                           backend, options.checkpointing, lora is None),
                                       packed=getattr(batch_source, "packed", False),
                                       precision=self.precision,
                                       lora_dropout=options.lora_dropout,
                                       neftune_alpha=options.neftune_alpha,
                                       sequences=2 * batch_source.pair_slots(batch)
                                       if preference else 0)
        if preference:
            from .preference import PreferenceGraph
            g = PreferenceGraph(g, options.preference_loss(), world)
        self.graph = g
        # the frozen values of a full model (rope factors, models.FROZEN): `parameters` gives
        # them back
        self.tables = {} if lora else {n: v for n, v in values.items() if frozen(n)}
        scaled = options.loss_scale == "dynamic" or (
            options.loss_scale == "auto" and self.precision == "f16"
            and options.optimizer != "lbfgs")
        self.scaler = (LossScaler(options.loss_scale_init, options.loss_scale_growth_interval,
                                  loss_scaler) if scaled else None)
        # the backward's seed S and the update's 1/S: inputs the host writes when S changes
        self.scale_seed = input_tensor(g.loss.shape, name="loss scale") if self.scaler else None
        self.inv_scale = input_tensor((1,), name="1 / loss scale") if self.scaler else None
        grads = build_backward(g.loss, list(g.params.values()),
                               checkpoints=g.checkpoints if options.checkpointing else None,
                               recompute=g.recompute, seed=self.scale_seed)
        self.regime = regime_for(options.optimizer)(self, grads, backend, opt_state or {})
        self.plan = self.regime.plan
        if not g.packed:    # else positions come with each batch
            self.plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
        self.write_scale()

    def write_scale(self):
        """Put the loss scale S (the backward's seed) and 1/S on the device."""
        if self.scaler is not None:
            s = self.scaler.scale
            self.plan.write(self.scale_seed, np.full(self.scale_seed.shape, s, np.float32))
            self.plan.write(self.inv_scale, np.array([1 / s], np.float32))

    @property
    def moments(self) -> dict:
        """AdamW's (m, v) tensors by parameter name (empty for SGD and L-BFGS)."""
        return self.regime.moments

    @property
    def exchange(self):
        """The gradient exchange of a data-parallel run (distributed.py), else None."""
        return self.regime.exchange

    @property
    def gradients(self) -> dict:
        """Parameter -> the gradient tensor its update is made from."""
        return self.regime.gradients

    @property
    def step_tokens(self) -> int:
        rows = 2 if self.options.objective != "sft" else 1        # a unit of pairs: two
        return rows * self.options.batch * self.options.grad_accum * self.cfg.n_ctx

    def feeds(self, inputs, targets, *rest) -> dict:
        """The graph's inputs for one batch from the batch source (with the segments when
        its rows are packed; a preference graph's pairs, reference and sequences): with a
        world, this rank's rows of it, weighted by the whole batch's count of targets (a
        preference graph takes the whole batch and keeps its rank's part itself)."""
        if self.world is None or self.options.objective != "sft":
            return self.graph.feeds(inputs, targets, *rest)
        segments = rest[0] if rest else None
        inputs_, targets_, counted = self.world.rows(inputs, targets)
        if segments is not None:    # the same rows of the segments
            segments = self.world.rows(segments, targets)[0]
        return self.graph.feeds(inputs_, targets_, segments, counted)

    def draws_feed(self, micro: int | None) -> dict:
        """The control of the graph's random draws (graph.draws: LoRA dropout, NEFTune) for
        micro-batch `micro` of this step: on, its seed drawn from the run's seed, the step,
        the micro-batch and the rank (a resumed run draws as the run before it would have);
        `micro` None: off, to evaluate. Empty without draws."""
        control = self.graph.draws
        if control is None:
            return {}
        if micro is None:
            return {control: np.zeros(2, np.int32)}
        rank = self.world.rank if self.world else 0
        (seed,) = np.random.SeedSequence([self.options.seed, self.step, micro, rank]
                                         ).generate_state(1)
        return {control: np.array([seed, 1], np.uint32).view(np.int32)}

    def train_step(self, stop: int = 0) -> dict:
        """One optimizer step on the next batch (grad_accum micro-batches); returns what a
        log line needs: step, loss, lr, grad_norm, tokens, skipped, and what the regime adds.
        With a world, `stop` (a signal number, 0: none) is this rank's wish to stop after
        this step, and the record's "stop" is the ranks' agreed one."""
        record = self.regime.step(stop)
        self.step += 1
        return {"step": self.step, "loss": record.pop("loss"), "lr": record.pop("lr"),
                "grad_norm": record.pop("grad_norm"), "tokens": self.step * self.step_tokens,
                "skipped": record.pop("skipped"), **record}

    def evaluation(self, batches) -> dict:
        """The mean loss per counted target over `batches` (TrainGraph.feeds's arguments:
        (inputs, targets), or for a packed graph (inputs, targets, segments)), with the
        parameters left as they are, and what else the graph measures (a preference graph:
        the accuracy and the mean margin of its pairs), each a mean over `batches`."""
        sums = {}
        for batch in batches:
            self.regime.forward(self.feeds(*batch))
            for key, value in self.graph.weighed(self.plan, batch).items():
                sums[key] = sums.get(key, 0) + value
        if self.world is not None and self.options.objective == "sft":
            # each rank's loss is its share of each batch's mean (a preference graph's
            # are the whole batch's already)
            sums["loss"] = float(self.world.allreduce(np.array([sums.get("loss", 0.0)]))[0])
        total = sums.pop("loss", 0.0)
        count = max(sums.pop("count", 0), 1)
        self.regime.after_evaluation(math.isfinite(total))
        return {"loss": total / count, **{k: v / count for k, v in sums.items()}}

    def parameters(self) -> dict[str, np.ndarray]:
        """The trained values by name, and a full model's frozen values (rope factors)."""
        return {**self.tables, **{name: self.plan.read(p) for name, p in self.graph.params.items()}}

    def optimizer_state(self) -> dict:
        """AdamW's (m, v) by parameter name; for lbfgs {"lbfgs": its history and scalars}."""
        return self.regime.state()

    def state(self, **run) -> RunState:
        """Everything besides tensors that resuming needs; `run` adds what ties the run to
        its inputs (RunState's tokens_digest, base, mode, samples_after_nl, n_ctx)."""
        samples = self.step * self.options.batch * self.options.grad_accum
        reference = self.batches.reference if self.options.objective != "sft" else None
        return RunState(step=self.step, samples=samples, tokens=self.step * self.step_tokens,
                        options=self.options, model=self.cfg.described(),
                        data=self.batches.state(),
                        loss_scaler=self.scaler.state() if self.scaler else None,
                        reference=None if reference is None else np.asarray(reference).tolist(),
                        **run)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that knows only them."""
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


def token_digest(tokens: np.ndarray) -> str:
    """Identifies the training tokens, so a resumed run can check it sees the same data."""
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:16]
