"""Training a llama: the schedule, the planned train step, checkpoints.

One training step is one planned graph, built and planned once: the forward of a batch, its
backward, gradient clipping by global norm and an in-place AdamW (or SGD) update of every parameter
(the clipping factor reaches every update as its last hyper-parameter, computed on the device:
no pass over the gradients to scale them). Per step
the host writes the batch and the optimizer's hyper-parameters (the schedule lives on the
host, as in ggml) and reads back the loss and the gradient norm.

A step whose loss or gradients are not finite changes nothing: append_finite_flag tests the
loss and the gradients' sum of squares on the device (exponent bits, no NaN arithmetic) and
the optimizer kernels do nothing where that flag is 0. The step still counts (its batch is used up, the schedule moves on); its record
says "skipped", and what to do next (stop or go on) is the caller's choice.

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
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from . import ops as O
from .backends import precision_for
from .graph import build_backward
from .lbfgs import LINESEARCHES, ON_FAIL, Lbfgs, LbfgsOptions
from .models import MAX_LOGITS_BYTES, PRECISIONS, ModelConfig, build_train_graph, frozen
from .tensor import constant, input_tensor


MAX_INT = 2 ** 63 - 1           # what a checkpoint's counts (uint64 keys) hold
MAX_STEPS = 10 ** 9             # warmup and decay lengths: more steps than any run takes
MAX_SEED = 2 ** 32 - 1
MAX_BATCH = 1 << 16             # samples per micro-batch: more than any device's memory holds
MAX_GRAD_ACCUM = 1 << 16        # micro-batches per step: each one is a full forward/backward
MAX_RESTART_GROWTH = 1000.0     # the period after a restart, as a multiple of the one before
# The loss scale's range: powers of two whose reciprocal is a normal float32, so that
# unscaling is exact and no device flushes 1/S to zero
MIN_SCALE, MAX_SCALE = 2.0 ** -126, 2.0 ** 126


@dataclass(frozen=True)
class Bound:
    """The values a training option (or a training state's number) may take: the CLI makes
    its click type from it, TrainOptions and `check_state` check values against it. `kind`
    is int, float (finite; ints accepted), bool or str (one of `choices`); `low`/`high` are
    inclusive unless `low_open`/`high_open`; `power_of_two` asks for 2^k (a loss scale)."""
    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()
    power_of_two: bool = False

    def problem(self, value) -> str | None:
        """Why `value` is not one of the bound's values, or None."""
        if self.kind is bool:
            return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
        if self.kind is str:
            return None if isinstance(value, str) and value in self.choices else \
                f"must be one of {', '.join(self.choices)}, got {value!r}"
        number = isinstance(value, (int, np.integer)) or (
            self.kind is float and isinstance(value, (float, np.floating)))
        if isinstance(value, (bool, np.bool_)) or not number:
            return f"must be {'an integer' if self.kind is int else 'a number'}, got {value!r}"
        if self.kind is float and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if (self.low is not None and (value <= self.low if self.low_open else value < self.low)
                or self.high is not None
                and (value >= self.high if self.high_open else value > self.high)):
            return f"must be in {self.describe()}, got {value!r}"
        if self.power_of_two and math.frexp(value)[0] != 0.5:
            return f"must be a power of two, got {value!r}"
        return None

    def describe(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return (f"{'(' if self.low_open or self.low is None else '['}{low}, {high}"
                f"{')' if self.high_open or self.high is None else ']'}")


def _option(default, bound: Bound, help: str | None = None, *, flag: str | None = None,
            may_change: bool = False, cli: bool = True):
    """A TrainOptions field, declared once with all that is derived from it (see TrainOptions).
    - bound: the values it may take, checked on construction and by `check_state`; the type
      (range, choices) of its command-line option.
    - help: its command-line help (None: the option shows its default and range only).
    - flag: its command-line flag where that is not --field-name; "--x/--no-x" for a bool
      that has both.
    - may_change: a run resumed from a checkpoint may set another value, which replaces the
      checkpoint's; any other option the checkpoint fixes, and a different value is refused.
    - cli: False for a field that the train and finetune commands do not take (Python only).
    """
    return field(default=default, metadata={"bound": bound, "help": help, "flag": flag,
                                            "may_change": may_change, "cli": cli})


POSITIVE = Bound(float, 0, low_open=True)
NON_NEGATIVE = Bound(float, 0)
BETA = Bound(float, 0, 1, high_open=True)
SCALE = Bound(float, MIN_SCALE, MAX_SCALE, power_of_two=True)


@dataclass
class TrainOptions:
    """Optimizer and schedule (llama.cpp train-text-from-scratch defaults). Each field's
    Bound (`bounds()`) is checked on construction: a ValueError names the option.

    This is the one declaration of the training options: the `ggwgpu train` and `finetune`
    commands make one command-line option of each field (its flag, type, default and help
    from `_option`, listed in this order) and a TrainOptions of their values, and a resumed
    run checks the options given against the checkpoint's by the same fields. Adding an
    option is adding a field here (`cli=False` keeps it off the command line)."""
    optimizer: str = _option(
        "adamw", Bound(str, choices=("adamw", "sgd", "lbfgs")),
        "lbfgs: one L-BFGS iteration (a line search) per step and batch; it takes no --lr, "
        "schedule, decay or clipping.")     # sgd: no moments; lbfgs: lbfgs.py
    batch: int = _option(8, Bound(int, 1, MAX_BATCH),
                         "Samples per micro-batch (of each process under mpirun).")
    grad_accum: int = _option(1, Bound(int, 1, MAX_GRAD_ACCUM),
                              "Micro-batches whose gradients add up to one optimizer step.")
    # the learning rate may change on resume; flash_attn and checkpointing change memory and
    # speed, not results
    lr: float = _option(1e-3, POSITIVE, may_change=True)
    beta1: float = _option(0.9, BETA)
    beta2: float = _option(0.999, BETA)
    eps: float = _option(1e-8, POSITIVE, flag="--adam-eps")
    weight_decay: float = _option(0.1, NON_NEGATIVE,
                                  "AdamW decay, relative to the learning rate, on tensors with "
                                  ">= 2 dims.")
    grad_clip: float = _option(1.0, NON_NEGATIVE,
                               "Clip gradients to this global norm (0: off).")
    warmup: int = _option(100, Bound(int, 0, MAX_STEPS), "Steps of linear warmup (0: none).")
    cos_decay_steps: int = _option(1000, Bound(int, 1, MAX_STEPS))
    cos_decay_min: float = _option(0.1, Bound(float, 0, 1))
    cos_decay_restart: float = _option(1.1, Bound(float, 1, MAX_RESTART_GROWTH))
    restarts: bool = _option(False, Bound(bool), flag="--restarts/--no-restarts")
    flash_attn: bool = _option(False, Bound(bool),
                               "Fused attention (same results, less memory).", may_change=True)
    checkpointing: bool = _option(False, Bound(bool),
                                  "Gradient checkpointing: recompute activations, keep block "
                                  "outputs only.", may_change=True)
    precision: str = _option(
        "f32", Bound(str, choices=("auto",) + PRECISIONS),
        "Element type of activations and frozen float weights on the device: f16 (trained "
        "weights, moments and the loss stay f32; dynamic loss scaling), f32, or auto: f16 "
        "where the adapter has shader-f16, f32 elsewhere and on numpy.", may_change=True)
    seed: int = _option(0, Bound(int, 0, MAX_SEED), "Init and sample-order seed.")
    # L-BFGS (ggml's defaults; lbfgs.LbfgsOptions)
    lbfgs_m: int = _option(6, Bound(int, 1, 1024), "L-BFGS: history pairs.")
    lbfgs_linesearch: str = _option(
        "strong-wolfe", Bound(str, choices=LINESEARCHES),
        "L-BFGS: the conditions the backtracking line search ends on.")
    lbfgs_max_linesearch: int = _option(20, Bound(int, 1, MAX_STEPS),
                                        "L-BFGS: loss evaluations per line search.")
    lbfgs_ftol: float = _option(1e-4, Bound(float, 0, 1, low_open=True, high_open=True),
                                "L-BFGS: sufficient decrease (Armijo).")
    lbfgs_wolfe: float = _option(0.9, Bound(float, 0, 1, low_open=True, high_open=True),
                                 "L-BFGS: curvature condition (> --lbfgs-ftol).")
    lbfgs_min_step: float = _option(1e-20, POSITIVE)
    lbfgs_max_step: float = _option(1e20, POSITIVE)
    lbfgs_on_fail: str = _option(
        "stop", Bound(str, choices=ON_FAIL),
        "L-BFGS: when a line search fails (the weights go back to where it began), stop with "
        "a checkpoint, or first drop the history and retry along the gradient once.")
    opt_past: int = _option(0, Bound(int, 0, MAX_STEPS),
                            "L-BFGS: stop when the loss fell by less than --opt-delta "
                            "(relative) over this many steps (0: off).")
    opt_delta: float = _option(1e-5, POSITIVE)
    opt_max_no_improvement: int = _option(
        0, Bound(int, 0, MAX_STEPS),
        "L-BFGS: stop after this many steps without a lower loss (0: off).")
    # dynamic loss scaling (LossScaler: torch.amp.GradScaler's rules); "auto": on when the
    # graph is f16 (not with lbfgs, whose line search compares unscaled losses), as PyTorch
    # pairs GradScaler with f16 autocast; f32 needs none
    loss_scale: str = _option("auto", Bound(str, choices=("auto", "none", "dynamic")),
                              cli=False)
    loss_scale_init: float = _option(2.0 ** 16, SCALE, cli=False)
    loss_scale_growth_interval: int = _option(2000, Bound(int, 1, MAX_STEPS), cli=False)

    def __post_init__(self):
        for name, bound in self.bounds().items():
            why = bound.problem(getattr(self, name))
            if why:
                raise ValueError(f"option {name} {why}")
        if self.optimizer == "lbfgs" and self.loss_scale == "dynamic":
            raise ValueError("option loss_scale dynamic does not work with optimizer lbfgs: "
                             "its line search compares losses and gradients that a skipped, "
                             "rescaled step would not give")

    @classmethod
    def bounds(cls) -> dict[str, Bound]:
        return {f.name: f.metadata["bound"] for f in fields(cls)}

    @classmethod
    def declared(cls) -> dict[str, dict]:
        """{field: its declaration (`_option`'s bound, help, flag, may_change, cli) and its
        default}, in the fields' order."""
        return {f.name: {**f.metadata, "default": f.default} for f in fields(cls)}

    def lbfgs_options(self) -> LbfgsOptions:
        return LbfgsOptions(
            m=self.lbfgs_m, max_linesearch=self.lbfgs_max_linesearch,
            linesearch=self.lbfgs_linesearch, ftol=self.lbfgs_ftol, wolfe=self.lbfgs_wolfe,
            min_step=self.lbfgs_min_step, max_step=self.lbfgs_max_step, past=self.opt_past,
            delta=self.opt_delta, max_no_improvement=self.opt_max_no_improvement,
            on_fail=self.lbfgs_on_fail)


def schedule(step: int, o: TrainOptions) -> float:
    """Learning-rate multiplier of `step` (0-based): linear warmup, then cosine decay to
    cos_decay_min, optionally restarting with periods growing by cos_decay_restart (as a
    float: the reference truncates it to an int). Closed form, no loop over restarts: any
    step of any options takes the same few operations."""
    if step < o.warmup:
        return (step + 1) / o.warmup
    t, period = float(step - o.warmup), float(o.cos_decay_steps)
    if not (period >= 1 and math.isfinite(t)):
        raise ValueError(f"no schedule for step {step} with cos_decay_steps {period}")
    if t >= period and not o.restarts:
        return o.cos_decay_min
    if t >= period:
        t, period = _within_restart(t, period, float(o.cos_decay_restart))
    return o.cos_decay_min + (1 - o.cos_decay_min) * 0.5 * (1 + math.cos(math.pi * t / period))


def _within_restart(t: float, period: float, growth: float) -> tuple[float, float]:
    """(position in its period, that period) of step t after the warmup, the periods being
    period, period * growth, period * growth^2, ..."""
    if not 1 <= growth <= MAX_RESTART_GROWTH:
        raise ValueError(f"cos_decay_restart {growth} is not in [1, {MAX_RESTART_GROWTH:g}]")
    if growth == 1:
        return math.fmod(t, period), period
    # k restarts lie before t when the first k periods, period * (g^k - 1) / (g - 1), end
    # at or before it; rounding can put k one off, which the two checks below correct
    k = math.floor(math.log1p(t * (growth - 1) / period) / math.log(growth))
    for _ in range(2):
        start = period * math.expm1(k * math.log(growth)) / (growth - 1)
        if t < start:
            k -= 1
        elif t >= start + period * growth ** k:
            k += 1
        else:
            break
    start = period * math.expm1(k * math.log(growth)) / (growth - 1)
    length = period * growth ** k
    return min(max(t - start, 0.0), length), length


def clip_scale(grads, max_norm: float, inv_scale=None):
    """Graph tensors (sum of squared gradients, factor min(1, max_norm / norm)) — all on the
    device, no readback: min(1, r) = (1 + r - |1 - r|) / 2. With `inv_scale` (a 1-element
    tensor, 1/S for gradients scaled by the loss scale S) both are of the true gradients:
    the sum of squares times 1/S twice, the factor (then never None) times 1/S; exact, as S
    is a power of two, and an inf or NaN stays one."""
    sumsq = O.sum_of_squares(grads)
    if inv_scale is not None:
        sumsq = O.mul(O.mul(sumsq, inv_scale), inv_scale)
    if not max_norm:
        return sumsq, inv_scale
    tiny = constant(np.array([1e-12], np.float32), name="tiny")
    r = O.div(constant(np.array([max_norm], np.float32), name="max_norm"),
              O.sqrt(O.add(sumsq, tiny)))
    one = constant(np.ones(1, np.float32), name="one")
    factor = O.scale(O.sub(O.add(one, r), O.abs(O.sub(one, r))), 0.5)
    return sumsq, factor if inv_scale is None else O.mul(factor, inv_scale)


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
    limits = getattr(backend, "storage_limits", None)
    bound = min(MAX_LOGITS_BYTES, *limits.values()) if limits else MAX_LOGITS_BYTES
    return bound // 4 if checkpointing and not full else bound


class Trainer:
    """A llama and its optimizer state, planned on a backend, stepping through batches."""

    def __init__(self, cfg: ModelConfig, values: dict, backend, options: TrainOptions,
                 batch_source, opt_state: dict | None = None, step: int = 0, graph=None,
                 lora=None, world=None, loss_scaler: dict | None = None):
        """`lora` (a ggwgpu.lora.Adapter) makes it a LoRA finetune: the adapter's tensors are
        trained, `values` (f32 or block types) stay frozen. `graph` (a TrainGraph) replaces
        the one built from `values` (and `lora`). With `world` (a distributed.World) this is
        one rank of a data-parallel run: options.batch is the global batch, the graph takes
        world.local_batch(options.batch) rows of it, and the gradients are summed over the
        ranks before the optimizer (distributed.py). `loss_scaler` is a checkpoint's
        state["loss_scaler"] (LossScaler.state()); without one a dynamic loss scale starts at
        options.loss_scale_init."""
        self.cfg, self.options, self.batches, self.step = cfg, options, batch_source, step
        self.world = world
        self.precision = precision_for(backend, options.precision)
        batch = world.local_batch(options.batch) if world else options.batch
        g = graph or build_train_graph(cfg, values, batch, flash=options.flash_attn,
                                       lora=lora,
                                       max_logits_bytes=logits_bound(
                                           backend, options.checkpointing, lora is None),
                                       packed=getattr(batch_source, "packed", False),
                                       precision=self.precision)
        self.graph = g
        # the frozen values of a full model (rope factors, models.FROZEN): `parameters` gives
        # them back
        self.tables = {} if lora else {n: v for n, v in values.items() if frozen(n)}
        scaled = options.loss_scale == "dynamic" or (
            options.loss_scale == "auto" and self.precision == "f16"
            and options.optimizer != "lbfgs")
        self.scaler = (LossScaler(options.loss_scale_init, options.loss_scale_growth_interval,
                                  loss_scaler) if scaled else None)
        # the backward's seed S and the optimizer's 1/S: inputs the host writes when S changes
        self.scale_seed = input_tensor(g.loss.shape, name="loss scale") if self.scaler else None
        self.inv_scale = input_tensor((1,), name="1 / loss scale") if self.scaler else None
        grads = build_backward(g.loss, list(g.params.values()),
                               checkpoints=g.checkpoints if options.checkpointing else None,
                               recompute=g.recompute, seed=self.scale_seed)
        accumulated = []
        self.lbfgs = None
        if options.optimizer == "lbfgs":
            self.setup_lbfgs(g, grads, backend, (opt_state or {}).get("lbfgs"))
            return
        # the sum of the step's micro-batch losses: the host reads it, the finite flag tests it
        self.loss_sum = g.loss
        if options.grad_accum > 1:
            grads, self.loss_sum, accumulated = self.accumulate(grads, g.loss,
                                                                options.grad_accum)
        self.exchange, loss, sent = None, self.loss_sum, []
        if world is not None:   # the optimizer reads the gradients summed over the ranks
            from .distributed import GradientExchange
            self.exchange = GradientExchange(grads)
            grads, loss, sent = self.exchange.grads, self.exchange.loss, self.exchange.copies
        self.gradients = grads          # param -> the gradient the update is made from
        self.sumsq, factor = clip_scale(grads.values(), options.grad_clip, self.inv_scale)
        if options.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"unknown optimizer {options.optimizer!r}: adamw, sgd or lbfgs")
        adamw = options.optimizer == "adamw"
        # the host writes the hyper-parameters but the finite flag and the gradient factor,
        # which the device appends; the updates multiply each gradient by that factor
        n_hparams = len(O.ADAMW_HPARAMS if adamw else O.SGD_HPARAMS) - len(O.DEVICE_HPARAMS)
        self.hparams = input_tensor((n_hparams,), name=f"{options.optimizer} hparams")
        if factor is None:
            factor = constant(np.ones(1, np.float32), name="no gradient factor")
        flagged = O.append_finite_flag(self.hparams, self.sumsq, loss, factor)
        self.moments, updates = {}, []
        for p, grad in grads.items():
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
        self.write_scale()

    def write_scale(self):
        """Put the loss scale S (the backward's seed) and 1/S on the device."""
        if self.scaler is not None:
            s = self.scaler.scale
            self.plan.write(self.scale_seed, np.full(self.scale_seed.shape, s, np.float32))
            self.plan.write(self.inv_scale, np.array([1 / s], np.float32))

    def setup_lbfgs(self, g, grads: dict, backend, state: dict | None):
        """L-BFGS (lbfgs.py): its stages replace the one planned step; one train_step is one
        L-BFGS iteration (a line search) on one batch."""
        if self.world is not None or self.options.grad_accum > 1:
            raise ValueError("lbfgs takes one whole batch per iteration on one process: "
                             "grad_accum must be 1 and there is no data-parallel lbfgs")
        self.lbfgs = Lbfgs(list(g.params.values()), grads, g.loss, self.options.lbfgs_options())
        self.moments, self.exchange, self.stages = {}, None, (None, None)
        self.plan = backend.plan([g.loss, *self.lbfgs.outputs])
        self.lbfgs.attach(self.plan)
        if not g.packed:    # else positions come with each batch
            self.plan.write(g.positions, np.arange(self.cfg.n_ctx, dtype=np.int32))
        if state:
            self.lbfgs.load_state(state)

    def lbfgs_step(self) -> dict:
        r = self.lbfgs.iterate(self.feeds(*self.batches.next_batch()))
        self.step += 1
        return {"step": self.step, "loss": r["loss"], "lr": r["step"],
                "grad_norm": r["grad_norm"], "tokens": self.step * self.step_tokens,
                "skipped": not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])),
                "evaluations": r["evaluations"], "status": r["status"]}

    def accumulate(self, grads: dict, loss, n: int):
        """Gradient accumulation inside the one planned graph: each micro-batch adds its
        gradient into a persistent sum (restarted by keep = 0 on the first micro-batch), and
        the update sees sum / n. The loss adds up the same way, so that the finite flag sees
        every micro-batch's loss, as the host does (it reads the sum once, after the last).
        The micro-batches before the last run the update with hyper-parameters that make it
        an exact no-op (see train_step). keep = 0 cannot clear a NaN (NaN * 0 is NaN):
        train_step zeroes the sums after a non-finite step. Returns (the averaged gradients,
        the loss sum, the nodes that write the sums)."""
        self.keep = input_tensor((1,), name="keep accumulated")
        persist, self.sums = [], []

        def add_up(value, name):
            total = constant(np.zeros(value.shape, np.float32), name=name)
            self.sums.append(total)
            new_total = O.add(O.mul(total, self.keep), value)
            persist.append(O.cpy(new_total, total))
            return new_total
        averaged = {p: O.scale(add_up(grad, f"{p.name}.grad_sum"), 1.0 / n)
                    for p, grad in grads.items()}
        add_up(loss, "loss sum")
        return averaged, persist[-1], persist     # the loss sum as its copy writes it

    def clear_sums(self):
        """Zero the accumulated sums (a NaN in them would survive the next keep = 0)."""
        for total in self.sums:
            self.plan.write(total, np.zeros(total.shape, np.float32))

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
        """The optimizer's hyper-parameter tensor for this step, and the learning rate. AdamW's
        step t counts the steps before this one, less those the loss scaler skipped."""
        o, t = self.options, self.step + 1
        if self.scaler is not None:
            t -= self.scaler.skipped_steps
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
        to stop after this step, and the record's "stop" is the ranks' agreed one. With
        lbfgs the record's "status" says whether the iteration failed or converged, and "lr"
        is the step its line search took."""
        if self.lbfgs is not None:
            return self.lbfgs_step()
        hp, lr = self.step_hparams()
        n = self.options.grad_accum
        backward, optimize = self.stages
        for i in range(n):
            feeds = {**self.feeds(*self.batches.next_batch()),
                     self.hparams: hp if i == n - 1 else self.noop_hparams()}
            if n > 1:
                feeds[self.keep] = np.array([float(i > 0)], np.float32)
            self.plan.run(feeds, stage=backward)
        # skipped below is the finite flag's decision: the loss sum and the sum of squares
        # that it tested, read back
        record = {}
        if self.exchange is not None:   # one readback, one allreduce, one upload
            sent, loss_sum = self.plan.read_many([self.exchange.sent, self.loss_sum])
            loss, record["stop"] = self.exchange.exchange(
                self.world, self.plan, sent, float(loss_sum[0]) / n, stop)
            self.plan.run({self.hparams: hp}, stage=optimize)
            sumsq = self.plan.read(self.sumsq)
        else:
            # the loss and the gradient norm come back together: one wait for the device
            loss_sum, sumsq = self.plan.read_many([self.loss_sum, self.sumsq])
            loss = float(loss_sum[0]) / n
        grad_norm = math.sqrt(float(sumsq[0]))
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped and n > 1:  # the NaN in the sums must not reach later steps
            self.clear_sums()
        if self.scaler is not None:     # the scale this step ran with; then the next one's
            record["loss_scale"] = self.scaler.scale
            # gradients that overflowed while the loss is finite: the scaler's ordinary skip
            record["overflow"] = skipped and math.isfinite(loss) and \
                self.scaler.scale > MIN_SCALE
            self.scaler.update(not skipped)
            if self.scaler.scale != record["loss_scale"]:
                self.write_scale()
        self.step += 1
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": self.step * self.step_tokens, "skipped": skipped, **record}

    def evaluate(self, batches) -> float:
        """The mean loss per counted target over `batches` (TrainGraph.feeds's arguments:
        (inputs, targets), or for a packed graph (inputs, targets, segments)), with
        the parameters left as they are: each batch runs the planned step under no-op
        hyper-parameters (lr 0, betas 1), so no second plan (and no copy of the weights) is
        needed. The accumulated sums are restarted by the next step's first micro-batch
        (zeroed here where a loss was not finite: keep = 0 cannot clear a NaN)."""
        g, total, count = self.graph, 0.0, 0
        if self.lbfgs is not None:   # the eval stage overwrites its gradient
            self.lbfgs.last = None
        for batch in batches:
            feeds = self.feeds(*batch)
            if self.lbfgs is not None:
                self.plan.run(feeds, stage=self.lbfgs.stages["eval"])
            else:
                feeds[self.hparams] = self.noop_hparams()
                if self.options.grad_accum > 1:
                    feeds[self.keep] = np.zeros(1, np.float32)
                self.plan.run(feeds, stage=self.stages[0])
            n = int((np.asarray(batch[1]) >= 0).sum())
            total += float(self.plan.read(g.loss)[0]) * n
            count += n
        if self.world is not None:   # each rank's loss is its share of each batch's mean
            total = float(self.world.allreduce(np.array([total]))[0])
        if self.lbfgs is None and self.options.grad_accum > 1 and not math.isfinite(total):
            self.clear_sums()
        return total / max(count, 1)

    def parameters(self) -> dict[str, np.ndarray]:
        """The trained values by name, and a full model's frozen values (rope factors)."""
        return {**self.tables, **{name: self.plan.read(p) for name, p in self.graph.params.items()}}

    def optimizer_state(self) -> dict:
        """AdamW's (m, v) by parameter name; for lbfgs {"lbfgs": its history and scalars}."""
        if self.lbfgs is not None:
            return {"lbfgs": self.lbfgs.state()}
        return {name: (self.plan.read(m), self.plan.read(v))
                for name, (m, v) in self.moments.items()}

    def state(self) -> dict:
        """Everything besides tensors that resuming needs (JSON-serialisable)."""
        state = {"step": self.step,
                 "samples": self.step * self.options.batch * self.options.grad_accum,
                 "tokens": self.step * self.step_tokens, "options": asdict(self.options),
                 "model": asdict(self.cfg), "data": self.batches.state()}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state()
        return state


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that knows only them."""
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


def token_digest(tokens: np.ndarray) -> str:
    """Identifies the training tokens, so a resumed run can check it sees the same data."""
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:16]


# -- the training state a checkpoint carries --------------------------------------------------

COUNT = Bound(int, 0, MAX_INT)
# The sample order of data.Samples and chat.ExampleBatches (EpochOrder plus the data's size);
# whether it fits the data at hand is their load_state's to say.
DATA_STATE = {"version": Bound(int, 1, MAX_INT), "seed": COUNT, "epoch": COUNT,
              "position": COUNT, "n_samples": Bound(int, 1, MAX_INT),
              "n_ctx": Bound(int, 1, MAX_INT)}
# Keys beside step, options and data: those Trainer.state() and the commands add. Other keys
# are kept as they are (nothing reads them).
STATE_EXTRAS = {"samples": COUNT, "tokens": COUNT, "epoch": COUNT,
                "samples_after_nl": Bound(bool), "n_ctx": Bound(int, 2, MAX_INT),
                "mode": Bound(str, choices=("lora", "full"))}
STATE_STRINGS = ("tokens_digest", "base")
FINETUNE_KEYS = ("base", "mode", "samples_after_nl")   # a finetune's state has all or none


# options older checkpoints lack: their defaults apply
LATER_OPTIONS = ("lbfgs_", "opt_", "loss_scale")
# The loss scaler's state (LossScaler.state()), present when options.loss_scale is dynamic
# (a checkpoint written before it existed has none: the scaler starts at its defaults)
SCALER_STATE = {"scale": SCALE, "growth_tracker": COUNT, "skipped_steps": COUNT}


def check_state(state) -> dict:
    """A checkpoint's training state (Trainer.state() and what the commands add), checked
    against one schema: every key's type and range, the options as TrainOptions bounds them.
    Returns it unchanged; a ValueError names the key (e.g. "options.lr") and the problem."""
    def require(mapping, key, where):
        if key not in mapping:
            raise ValueError(f"{where}{key} is missing")
        return mapping[key]

    def check(value, bound, name):
        why = bound.problem(value)
        if why:
            raise ValueError(f"{name} {why}")

    if not isinstance(state, dict):
        raise ValueError("the training state must be a JSON object")
    check(require(state, "step", ""), COUNT, "step")
    options = require(state, "options", "")
    if not isinstance(options, dict):
        raise ValueError("options must be a JSON object")
    bounds = TrainOptions.bounds()
    for key in options:
        if key not in bounds:
            raise ValueError(f"options.{key} is not a training option")
    for key, bound in bounds.items():
        if key in options or not key.startswith(LATER_OPTIONS):
            check(require(options, key, "options."), bound, f"options.{key}")
    ftol, wolfe = (options.get(k, TrainOptions.declared()[k]["default"])
                   for k in ("lbfgs_ftol", "lbfgs_wolfe"))
    if ftol >= wolfe:       # the line search's conditions contradict each other
        raise ValueError(f"options.lbfgs_ftol {ftol} must be below options.lbfgs_wolfe {wolfe}")
    data = require(state, "data", "")
    if not isinstance(data, dict):
        raise ValueError("data must be a JSON object")
    for key, bound in DATA_STATE.items():
        check(require(data, key, "data."), bound, f"data.{key}")
    for key, bound in STATE_EXTRAS.items():
        if key in state:
            check(state[key], bound, key)
    for key in STATE_STRINGS:
        if key in state and not isinstance(state[key], str):
            raise ValueError(f"{key} must be a string, got {state[key]!r}")
    if "loss_scaler" in state:
        check_scaler_state(state["loss_scaler"], options, state["step"], check)
    present = [key for key in FINETUNE_KEYS if key in state]
    if present and len(present) < len(FINETUNE_KEYS):
        missing = next(key for key in FINETUNE_KEYS if key not in state)
        raise ValueError(f"{missing} is missing (a finetune's state has "
                         f"{', '.join(FINETUNE_KEYS)})")
    return state


def check_scaler_state(scaler, options: dict, step: int, check):
    """A checkpoint's loss_scaler (LossScaler.state()) against its options and step."""
    if options.get("loss_scale", "none") == "none":
        raise ValueError("loss_scaler is present, but options.loss_scale is none")
    if not isinstance(scaler, dict):
        raise ValueError("loss_scaler must be a JSON object")
    for key in scaler:
        if key not in SCALER_STATE:
            raise ValueError(f"loss_scaler.{key} is not part of the loss scaler's state")
    for key, bound in SCALER_STATE.items():
        if key not in scaler:
            raise ValueError(f"loss_scaler.{key} is missing")
        check(scaler[key], bound, f"loss_scaler.{key}")
    interval = options.get("loss_scale_growth_interval",
                           TrainOptions.loss_scale_growth_interval)
    if scaler["growth_tracker"] >= interval:
        raise ValueError(f"loss_scaler.growth_tracker must be below "
                         f"options.loss_scale_growth_interval {interval}, got "
                         f"{scaler['growth_tracker']}")
    if scaler["skipped_steps"] > step:
        raise ValueError(f"loss_scaler.skipped_steps must be at most step {step}, got "
                         f"{scaler['skipped_steps']}")
