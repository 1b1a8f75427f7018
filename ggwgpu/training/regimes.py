"""A Trainer's step regimes: how one optimizer step is made from the planned graph's loss and
gradients. `PlannedUpdate` (AdamW or SGD, each an update `Rule`) makes the whole step one
planned graph; `LbfgsRegime` runs L-BFGS's stages (lbfgs.py). Each regime plans the graph,
steps, evaluates the loss with the weights as they are, and gives its optimizer state.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops as O
from ..tensor import constant, input_tensor
from .lbfgs import Lbfgs
from .options import MIN_SCALE, TrainOptions, schedule


def clip_scale(grads, max_norm: float, inv_scale=None):
    """Graph tensors (sum of squared gradients, factor min(1, max_norm / norm)) — all on the
    device, no readback: min(1, r) = (1 + r - |1 - r|) / 2. `grads`: {parameter: gradient},
    summed block by block (sum_of_squares: a LoRA's small pairs three at a time). With
    `inv_scale` (a 1-element tensor, 1/S for gradients scaled by the loss scale S) both are
    of the true gradients: the sum of squares times 1/S twice, the factor (then never None)
    times 1/S; exact, as S is a power of two, and an inf or NaN stays one."""
    blocks = {}
    for param, grad in grads.items():     # blk.N.* together, the rest after
        name = param.name or ""
        blocks.setdefault(name.split(".", 2)[1] if name.startswith("blk.") else "",
                          []).append(grad)
    sumsq = O.sum_of_squares(blocks.values())
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


class AdamW:
    """AdamW's in-place update, with its two moments per parameter."""
    HPARAMS = O.ADAMW_HPARAMS

    def __init__(self, options: TrainOptions):
        self.options, self.moments = options, {}

    def update(self, p, grad, flagged, decay: bool):
        m, v = (constant(np.zeros(p.shape, np.float32), name=f"{p.name}.{k}")
                for k in ("m", "v"))
        self.moments[p.name] = (m, v)
        return O.opt_step_adamw(p, grad, m, v, flagged, decay)

    def hparams(self, lr: float, t: int) -> np.ndarray:
        o = self.options
        return O.adamw_hparams(lr, o.beta1, o.beta2, o.eps, o.weight_decay, t)

    def noop_hparams(self) -> np.ndarray:
        """lr 0, and betas 1 so the moments stay as they are."""
        return np.array([0, 1, 1, self.options.eps, 0, 1, 1], np.float32)

    def state(self, plan) -> dict:
        return {name: (plan.read(m), plan.read(v)) for name, (m, v) in self.moments.items()}

    def load_state(self, plan, state: dict):
        for name, (m, v) in state.items():
            plan.write(self.moments[name][0], m)
            plan.write(self.moments[name][1], v)


class Sgd:
    """Plain SGD with decoupled weight decay: no state."""
    HPARAMS = O.SGD_HPARAMS

    def __init__(self, options: TrainOptions):
        self.options, self.moments = options, {}

    def update(self, p, grad, flagged, decay: bool):
        return O.opt_step_sgd(p, grad, flagged, decay)

    def hparams(self, lr: float, t: int) -> np.ndarray:
        return np.array([lr, self.options.weight_decay], np.float32)

    def noop_hparams(self) -> np.ndarray:
        return np.zeros(2, np.float32)

    def state(self, plan) -> dict:
        return {}

    def load_state(self, plan, state: dict):
        if state:
            raise ValueError("SGD keeps no optimizer state, but one was given")


RULES = {"adamw": AdamW, "sgd": Sgd}


class PlannedUpdate:
    """The whole step as one planned graph: the forward of a batch, its backward, gradient
    clipping by global norm and an in-place update of every parameter (the clipping factor
    reaches every update as its last hyper-parameter, computed on the device: no pass over
    the gradients to scale them). Per step the host writes the batch and the update's
    hyper-parameters (the schedule lives on the host, as in ggml) and reads back the loss and
    the gradient norm.

    A step whose loss or gradients are not finite changes nothing: append_finite_flag tests
    the loss and the gradients' sum of squares on the device (exponent bits, no NaN
    arithmetic) and the update kernels do nothing where that flag is 0. The step still counts
    (its batch is used up, the schedule moves on); its record says "skipped"."""

    def __init__(self, trainer, grads: dict, backend, opt_state: dict):
        t, g, options = trainer, trainer.graph, trainer.options
        self.trainer, self.rule = t, RULES[options.optimizer](options)
        accumulated = []
        # the sum of the step's micro-batch losses: the host reads it, the finite flag tests it
        self.loss_sum = g.loss
        if options.grad_accum > 1:
            grads, self.loss_sum, accumulated = self.accumulate(grads, g.loss,
                                                                options.grad_accum)
        self.exchange, loss, sent = None, self.loss_sum, []
        if t.world is not None:   # the update reads the gradients summed over the ranks
            from ..distributed import GradientExchange
            self.exchange = GradientExchange(grads)
            grads, loss, sent = self.exchange.grads, self.exchange.loss, self.exchange.copies
        self.gradients = grads          # param -> the gradient the update is made from
        self.sumsq, factor = clip_scale(grads, options.grad_clip, t.inv_scale)
        # the host writes the hyper-parameters but the finite flag and the gradient factor,
        # which the device appends; the updates multiply each gradient by that factor
        n_hparams = len(self.rule.HPARAMS) - len(O.DEVICE_HPARAMS)
        self.hparams = input_tensor((n_hparams,), name=f"{options.optimizer} hparams")
        if factor is None:
            factor = constant(np.ones(1, np.float32), name="no gradient factor")
        flagged = O.append_finite_flag(self.hparams, self.sumsq, loss, factor)
        updates = [self.rule.update(p, grad, flagged, p.ndim >= 2) for p, grad in grads.items()]
        # topo_order runs each in-place update after every reader of the old parameter
        self.plan = backend.plan([g.loss, self.sumsq, *g.reported, *accumulated, *sent, *updates])
        # with a world: the backward and the update run apart, the allreduce between
        self.stages = ((self.plan.stage([g.loss, *accumulated, *sent]),
                        self.plan.stage([self.sumsq, *updates])) if t.world else (None, None))
        self.rule.load_state(self.plan, opt_state)
        self.moments = self.rule.moments

    def accumulate(self, grads: dict, loss, n: int):
        """Gradient accumulation inside the one planned graph: each micro-batch adds its
        gradient into a persistent sum (restarted by keep = 0 on the first micro-batch), and
        the update sees sum / n. The loss adds up the same way, so that the finite flag sees
        every micro-batch's loss, as the host does (it reads the sum once, after the last).
        The micro-batches before the last run the update with hyper-parameters that make it
        an exact no-op (see step). keep = 0 cannot clear a NaN (NaN * 0 is NaN): step zeroes
        the sums after a non-finite step. Returns (the averaged gradients, the loss sum, the
        nodes that write the sums)."""
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

    def step_hparams(self) -> tuple[np.ndarray, float]:
        """The update's hyper-parameter tensor for this step, and the learning rate. AdamW's
        step t counts the steps before this one, less those the loss scaler skipped."""
        trainer = self.trainer
        t = trainer.step + 1
        if trainer.scaler is not None:
            t -= trainer.scaler.skipped_steps
        lr = trainer.options.lr * schedule(trainer.step, trainer.options)
        return self.rule.hparams(lr, t), lr

    def step(self, stop: int) -> dict:
        trainer, plan = self.trainer, self.plan
        hp, lr = self.step_hparams()
        n = trainer.options.grad_accum
        backward, optimize = self.stages
        for i in range(n):
            feeds = {**trainer.feeds(*trainer.batches.next_batch()), **trainer.draws_feed(i),
                     self.hparams: hp if i == n - 1 else self.rule.noop_hparams()}
            if n > 1:
                feeds[self.keep] = np.array([float(i > 0)], np.float32)
            plan.run(feeds, stage=backward)
        # skipped below is the finite flag's decision: the loss sum and the sum of squares
        # that it tested, read back
        record, reported = {}, trainer.graph.reported
        if self.exchange is not None:   # one readback, one allreduce, one upload
            sent, loss_sum = plan.read_many([self.exchange.sent, self.loss_sum])
            loss, record["stop"] = self.exchange.exchange(
                trainer.world, plan, sent, float(loss_sum[0]) / n, stop)
            plan.run({self.hparams: hp}, stage=optimize)
            sumsq, *reported = plan.read_many([self.sumsq, *reported])
        else:
            # the loss, the gradient norm (and what the graph reports, of the last micro-
            # batch) come back together: one wait for the device
            loss_sum, sumsq, *reported = plan.read_many([self.loss_sum, self.sumsq, *reported])
            loss = float(loss_sum[0]) / n
        record.update(trainer.graph.report(reported) if reported else {})
        grad_norm = math.sqrt(float(sumsq[0]))
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped and n > 1:  # the NaN in the sums must not reach later steps
            self.clear_sums()
        scaler = trainer.scaler
        if scaler is not None:     # the scale this step ran with; then the next one's
            record["loss_scale"] = scaler.scale
            # gradients that overflowed while the loss is finite: the scaler's ordinary skip
            record["overflow"] = skipped and math.isfinite(loss) and scaler.scale > MIN_SCALE
            scaler.update(not skipped)
            if scaler.scale != record["loss_scale"]:
                trainer.write_scale()
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped": skipped, **record}

    def forward(self, feeds: dict):
        """Run the step under no-op hyper-parameters (lr 0, betas 1): the loss of the weights
        as they are, with no second plan (and no copy of the weights). The accumulated sums
        are restarted by the next step's first micro-batch."""
        feeds[self.hparams] = self.rule.noop_hparams()
        feeds.update(self.trainer.draws_feed(None))
        if self.trainer.options.grad_accum > 1:
            feeds[self.keep] = np.zeros(1, np.float32)
        self.plan.run(feeds, stage=self.stages[0])

    def after_evaluation(self, finite: bool):
        if not finite and self.trainer.options.grad_accum > 1:
            self.clear_sums()       # keep = 0 cannot clear a NaN

    def state(self) -> dict:
        """AdamW's (m, v) by parameter name; SGD's nothing."""
        return self.rule.state(self.plan)


class LbfgsRegime:
    """L-BFGS (lbfgs.py): its stages replace the one planned step; one step is one L-BFGS
    iteration (a line search) on one batch. A step's record has the iteration's `status` (an
    lbfgs.Status), "lr" the step its line search took and "evaluations" its loss
    evaluations."""

    def __init__(self, trainer, grads: dict, backend, opt_state: dict):
        options, g = trainer.options, trainer.graph
        if trainer.world is not None or options.grad_accum > 1:
            raise ValueError("lbfgs takes one whole batch per iteration on one process: "
                             "grad_accum must be 1 and there is no data-parallel lbfgs")
        self.trainer, self.moments, self.exchange = trainer, {}, None
        self.gradients = grads
        self.lbfgs = Lbfgs(list(g.params.values()), grads, g.loss, options.lbfgs_options())
        self.plan = backend.plan([g.loss, *self.lbfgs.outputs])
        self.lbfgs.attach(self.plan)
        if opt_state.get("lbfgs"):
            self.lbfgs.load_state(opt_state["lbfgs"])

    def step(self, stop: int) -> dict:
        t = self.trainer
        r = self.lbfgs.iterate(t.feeds(*t.batches.next_batch()))
        return {"loss": r["loss"], "lr": r["step"], "grad_norm": r["grad_norm"],
                "skipped": not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])),
                "evaluations": r["evaluations"], "status": r["status"]}

    def forward(self, feeds: dict):
        self.lbfgs.last = None      # the eval stage overwrites its gradient
        self.plan.run(feeds, stage=self.lbfgs.stages["eval"])

    def after_evaluation(self, finite: bool):
        pass

    def state(self) -> dict:
        return {"lbfgs": self.lbfgs.state()}


def regime_for(optimizer: str):
    """The regime class of TrainOptions.optimizer."""
    return LbfgsRegime if optimizer == "lbfgs" else PlannedUpdate
