"""The training options, declared once (TrainOptions: each field's bound, help, flag and
whether a resumed run may change it), and the learning-rate schedule they define."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from ..models import PRECISIONS
from .lbfgs import LINESEARCHES, ON_FAIL, LbfgsOptions

SCHEDULES = ("cosine", "linear", "constant")    # `schedule`
OBJECTIVES = ("sft", "dpo", "ipo", "orpo", "cpo", "simpo", "kto")   # but sft: preference.py

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
    inclusive unless `low_open`/`high_open`; `power_of_two` asks for 2^k (a loss scale);
    `optional` lets None stand for a default that depends on other options."""
    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()
    power_of_two: bool = False
    optional: bool = False

    def problem(self, value) -> str | None:
        """Why `value` is not one of the bound's values, or None."""
        if value is None and self.optional:
            return None
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
            may_change: bool = False, cli: bool | str = True):
    """A TrainOptions field, declared once with all that is derived from it (see TrainOptions).
    - bound: the values it may take, checked on construction and by `check_state`; the type
      (range, choices) of its command-line option.
    - help: its command-line help (None: the option shows its default and range only).
    - flag: its command-line flag where that is not --field-name; "--x/--no-x" for a bool
      that has both.
    - may_change: a run resumed from a checkpoint may set another value, which replaces the
      checkpoint's; any other option the checkpoint fixes, and a different value is refused.
    - cli: False for a field that the train and finetune commands do not take (Python only);
      "finetune" for one that only finetune takes.
    """
    return field(default=default, metadata={"bound": bound, "help": help, "flag": flag,
                                            "may_change": may_change, "cli": cli})


POSITIVE = Bound(float, 0, low_open=True)
NON_NEGATIVE = Bound(float, 0)
BETA = Bound(float, 0, 1, high_open=True)
SCALE = Bound(float, MIN_SCALE, MAX_SCALE, power_of_two=True)


@dataclass(frozen=True)
class TrainOptions:
    """Optimizer and schedule (llama.cpp train-text-from-scratch defaults). Each field's
    Bound (`bounds()`) is checked on construction, and the options are frozen from then on
    (`dataclasses.replace` makes changed ones): a ValueError names the option.

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
    lr_schedule: str = _option(
        "cosine", Bound(str, choices=SCHEDULES),
        "After the warmup: cosine (ggml's) to --cos-decay-min over --cos-decay-steps (with "
        "--restarts, again and again), linear (TRL's) to --cos-decay-min over "
        "--cos-decay-steps (--cos-decay-min 0 and --cos-decay-steps --steps minus --warmup "
        "end at 0 with the run, as TRL's does), or constant (MLX-LM's).")
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
    # preference finetuning (training/preference.py), TRL's defaults
    objective: str = _option(
        "sft", Bound(str, choices=OBJECTIVES),
        "sft: next-token loss on text or --data examples; dpo, ipo, orpo, cpo, simpo: "
        "preference finetuning on --data pairs ({prompt, chosen, rejected}), --batch pairs "
        "a step (packed: --batch pairs of rows, several pairs in each); kto: on examples "
        "labelled good or bad ({prompt, completion, label}, or pairs unpaired).",
        cli="finetune")
    beta: float = _option(0.1, POSITIVE, "DPO, IPO, KTO: how far the model may move from "
                          "the reference, the base; CPO, SimPO: the scale of the reward "
                          "difference (TRL's beta).", cli="finetune")
    label_smoothing: float = _option(0.0, Bound(float, 0, 0.5, high_open=True),
                                     "DPO, CPO, SimPO: the share of pairs taken to be "
                                     "mislabelled.", cli="finetune")
    orpo_lambda: float = _option(0.1, NON_NEGATIVE, "ORPO: the weight of the odds-ratio "
                                 "term beside the chosen answers' loss.", cli="finetune")
    simpo_gamma: float = _option(0.5, NON_NEGATIVE, "SimPO: the target margin of the "
                                 "scaled rewards (TRL's simpo_gamma).", cli="finetune")
    cpo_alpha: float | None = _option(
        None, Bound(float, 0, optional=True),
        "CPO, SimPO: the weight of the chosen answers' NLL beside the preference term "
        "(TRL's cpo_alpha; default 1 for cpo, 0 for simpo: SimPO's loss; above 0 with simpo: "
        "CPO-SimPO).", cli="finetune")
    desirable_weight: float = _option(1.0, POSITIVE, "KTO: the weight of the good examples' "
                                      "terms (TRL's desirable_weight).", cli="finetune")
    undesirable_weight: float = _option(1.0, POSITIVE, "KTO: the weight of the bad examples' "
                                        "terms (TRL's undesirable_weight).", cli="finetune")
    # LoRA dropout (PEFT's lora_dropout, MLX-LM's dropout): models.blocks.linear
    lora_dropout: float = _option(
        0.0, Bound(float, 0, 1, high_open=True),
        "While training, each LoRA pair reads its input with this share of the elements "
        "dropped, the rest scaled by 1 / (1 - share); validation and the adapter see no "
        "dropout (0: off).", cli="finetune")
    # NEFTune (TRL's neftune_noise_alpha): models.blocks.embed
    neftune_alpha: float = _option(
        0.0, NON_NEGATIVE,
        "NEFTune: while training, noise uniform within alpha / sqrt(n_ctx * n_embd) is added "
        "to the token embeddings (TRL's neftune_noise_alpha; 5 is common; 0: off).",
        cli="finetune")

    def __post_init__(self):
        for name, bound in self.bounds().items():
            why = bound.problem(getattr(self, name))
            if why:
                raise ValueError(f"option {name} {why}")
        if self.optimizer == "lbfgs" and self.objective != "sft":
            raise ValueError(f"option objective {self.objective} does not work with optimizer "
                             f"lbfgs: use adamw or sgd")
        for name in ("lora_dropout", "neftune_alpha"):
            if self.optimizer == "lbfgs" and getattr(self, name):
                raise ValueError(f"option {name} does not work with optimizer lbfgs: its line "
                                 f"search and curvature history assume a loss without noise")
        if self.restarts and self.lr_schedule != "cosine":
            raise ValueError(f"option restarts restarts a cosine schedule, not a "
                             f"{self.lr_schedule} one")
        if self.cpo_alpha is not None and self.objective not in ("cpo", "simpo"):
            raise ValueError(f"option cpo_alpha weighs the chosen answers' NLL of objectives "
                             f"cpo and simpo, not of {self.objective}")
        if self.neftune_alpha and self.objective in ("dpo", "ipo", "kto"):
            raise ValueError(f"option neftune_alpha does not work with objective "
                             f"{self.objective}: its reference log-probabilities have no noise")
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

    def preference_loss(self):
        """The preference.PreferenceLoss of a preference objective, None for sft."""
        if self.objective == "sft":
            return None
        from .preference import PreferenceLoss
        return PreferenceLoss(self.objective, self.beta, self.label_smoothing,
                              self.orpo_lambda, self.simpo_gamma, self.cpo_alpha,
                              self.desirable_weight, self.undesirable_weight)

    def lbfgs_options(self) -> LbfgsOptions:
        return LbfgsOptions(
            m=self.lbfgs_m, max_linesearch=self.lbfgs_max_linesearch,
            linesearch=self.lbfgs_linesearch, ftol=self.lbfgs_ftol, wolfe=self.lbfgs_wolfe,
            min_step=self.lbfgs_min_step, max_step=self.lbfgs_max_step, past=self.opt_past,
            delta=self.opt_delta, max_no_improvement=self.opt_max_no_improvement,
            on_fail=self.lbfgs_on_fail)


def schedule(step: int, o: TrainOptions) -> float:
    """Learning-rate multiplier of `step` (0-based): linear warmup, then o.lr_schedule's:
    cosine decay to cos_decay_min, optionally restarting with periods growing by
    cos_decay_restart (as a float: the reference truncates it to an int); a straight line
    to cos_decay_min over cos_decay_steps; or 1. Closed form, no loop over restarts: any
    step of any options takes the same few operations."""
    if step < o.warmup:
        return (step + 1) / o.warmup
    if o.lr_schedule == "constant":
        return 1.0
    t, period = float(step - o.warmup), float(o.cos_decay_steps)
    if not (period >= 1 and math.isfinite(t)):
        raise ValueError(f"no schedule for step {step} with cos_decay_steps {period}")
    if t >= period and not o.restarts:
        return o.cos_decay_min
    if o.lr_schedule == "linear":
        return 1.0 - (1.0 - o.cos_decay_min) * t / period
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
