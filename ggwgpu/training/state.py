"""The training state a checkpoint carries (RunState): one dataclass that writes itself as
the checkpoint's JSON and checks a checkpoint's JSON against one schema."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from .options import MAX_INT, SCALE, Bound, TrainOptions


COUNT = Bound(int, 0, MAX_INT)
# The sample order of data.Samples and chat.ExampleBatches (EpochOrder plus the data's size);
# whether it fits the data at hand is their load_state's to say.
DATA_STATE = {"version": Bound(int, 1, MAX_INT), "seed": COUNT, "epoch": COUNT,
              "position": COUNT, "n_samples": Bound(int, 1, MAX_INT),
              "n_ctx": Bound(int, 1, MAX_INT)}
# Keys beside step, options and data: those of a run's RunState. Other keys are kept as they
# are (RunState.extras: nothing reads them).
STATE_EXTRAS = {"samples": COUNT, "tokens": COUNT, "epoch": COUNT,
                "samples_after_nl": Bound(bool), "n_ctx": Bound(int, 2, MAX_INT),
                "mode": Bound(str, choices=("lora", "full"))}
STATE_STRINGS = ("tokens_digest", "base")
FINETUNE_KEYS = ("base", "mode", "samples_after_nl")   # a finetune's state has all or none


# options older checkpoints lack (these names, and those of L-BFGS's prefixes): their
# defaults apply
LATER_OPTIONS = ("loss_scale", "loss_scale_init", "loss_scale_growth_interval", "objective",
                 "beta", "label_smoothing", "orpo_lambda", "lora_dropout", "neftune_alpha",
                 "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight",
                 "lr_schedule")
LATER_PREFIXES = ("lbfgs_", "opt_")


def later_option(name: str) -> bool:
    """Whether an older checkpoint may lack option `name`."""
    return name in LATER_OPTIONS or name.startswith(LATER_PREFIXES)
# The loss scaler's state (LossScaler.state()), present when options.loss_scale is dynamic
# (a checkpoint written before it existed has none: the scaler starts at its defaults)
SCALER_STATE = {"scale": SCALE, "growth_tracker": COUNT, "skipped_steps": COUNT}


def check_state(state) -> dict:
    """A checkpoint's training state (RunState.to_json()), checked
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
        if key in options or not later_option(key):
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
    if "reference" in state:    # packed pairs: n_samples counts units, n_pairs the pairs
        check_reference(state["reference"], data.get("n_pairs", data["n_samples"]))
    if "valid_reference" in state:
        check_reference(state["valid_reference"], None, "valid_reference")
    if "loss_scaler" in state:
        check_scaler_state(state["loss_scaler"], options, state["step"], check)
    present = [key for key in FINETUNE_KEYS if key in state]
    if present and len(present) < len(FINETUNE_KEYS):
        missing = next(key for key in FINETUNE_KEYS if key not in state)
        raise ValueError(f"{missing} is missing (a finetune's state has "
                         f"{', '.join(FINETUNE_KEYS)})")
    return state


def check_reference(reference, n_pairs: int | None, key: str = "reference"):
    """A preference run's reference log-probabilities: [chosen, rejected] per pair (of the
    data, n_pairs, when given), each a finite number <= 0."""
    if not isinstance(reference, list) or not reference or (
            n_pairs is not None and len(reference) != n_pairs):
        raise ValueError(f"{key} must be a list of " +
                         ("pairs" if n_pairs is None else f"{n_pairs} pairs (data.n_pairs)"))
    for i, pair in enumerate(reference):
        if not (isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) and v <= 0 for v in pair)):
            raise ValueError(f"{key}[{i}] must be two finite log-probabilities (<= 0), "
                             f"got {pair!r}")


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


@dataclass(frozen=True)
class RunState:
    """What resuming a run needs besides tensors, as a checkpoint's training.state_json holds
    it: the step, the options, the sample order (`data`, the batch source's state), and what
    ties the run to its inputs (`tokens_digest`; a finetune's `base` digest, `mode`,
    `samples_after_nl` and `n_ctx`). `to_json` writes it (keys in this order, unset ones left
    out), `from_json` checks a file's JSON against the one schema (`check_state`)."""
    step: int
    options: TrainOptions
    data: dict
    samples: int | None = None
    tokens: int | None = None
    model: dict | None = None           # the model's shape, for people and other tools
    loss_scaler: dict | None = None     # LossScaler.state() under dynamic loss scaling
    tokens_digest: str | None = None
    base: str | None = None
    mode: str | None = None             # "lora" or "full"
    samples_after_nl: bool | None = None
    n_ctx: int | None = None
    epoch: int | None = None
    reference: list | None = None       # a preference run's [chosen, rejected] logp per pair
    valid_reference: list | None = None   # the same of its validation pairs
    extras: dict = field(default_factory=dict)   # keys of no field, kept as they were
    # the keys' order in a checkpoint's JSON
    JSON_ORDER = ("step", "samples", "tokens", "options", "model", "data", "loss_scaler",
                  "tokens_digest", "base", "mode", "samples_after_nl", "n_ctx", "epoch",
                  "reference", "valid_reference")

    @property
    def is_finetune(self) -> bool:
        return self.base is not None

    def to_json(self) -> dict:
        state = {}
        for name in self.JSON_ORDER:
            value = getattr(self, name)
            if value is not None:
                state[name] = asdict(value) if name == "options" else value
        return {**state, **self.extras}

    @classmethod
    def from_json(cls, state) -> "RunState":
        """A checkpoint's JSON state as a RunState; a ValueError names the key that is wrong."""
        check_state(state)
        known = {f.name for f in fields(cls)} - {"extras"}
        return cls(**{k: v for k, v in state.items() if k in known and k != "options"},
                   options=TrainOptions(**state["options"]),
                   extras={k: v for k, v in state.items() if k not in known})
