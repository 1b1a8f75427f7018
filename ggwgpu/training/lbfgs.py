"""L-BFGS with a backtracking line search, as ggml's optimizer had it, run on the device.

The optimizer sees all parameters as one flat vector x of N elements. Its state lives in
the plan's storage as flat f32 leaves: the gradient G, the direction D, the line search's
start XP and its gradient GP, and the history: m pairs S_j = x_{k+1} - x_k,
Y_j = g_{k+1} - g_k, slot m-1 the newest (a new pair shifts the others down one slot, so
the two-loop recursion is one static graph). The host keeps only scalars: rho_j = 1/(y_j.s_j)
(0 for an empty slot, which makes that slot a no-op in the recursion), the scale
gamma = y.s/y.y of the newest pair, and the line search's step and Wolfe tests.

Stages of one planned graph (Plan.stage), each run alone:
    eval       forward + backward at x; G := gradient; scalars f, g.d, g.g, x.x and, for
               the pair a line search ends with, (x - XP).(G - GP) and |G - GP|^2
    direction  D := -H G by the two-loop recursion (dots and axpys as graph ops); D.G, D.D
    begin      XP := x, GP := G (the line search's start)
    move       x := XP + step * D (step written by the host)
    shift      move the history down a slot (the oldest pair drops out)
    push       S_{m-1} := x - XP, Y_{m-1} := G - GP
Per line-search trial the host writes one scalar and reads back five.

One `iterate(feeds)` is one L-BFGS iteration on one batch: evaluate at x, choose the
direction, search along it. The batch stays the same within the iteration, so the pair it
adds compares gradients of one function (multi-batch L-BFGS); with a fixed batch it is
ggml's L-BFGS. A failed line search puts x back where the search began and says why; with
on_fail "reset" it first drops the history and retries once along -G.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import ops as O
from ..tensor import constant, contiguous_strides, input_tensor

LINESEARCHES = ("armijo", "wolfe", "strong-wolfe")   # ggml's backtracking variants
ON_FAIL = ("stop", "reset")


@dataclass
class LbfgsOptions:
    """ggml's L-BFGS parameters (its defaults)."""
    m: int = 6                       # history pairs
    max_linesearch: int = 20         # evaluations per line search
    linesearch: str = "strong-wolfe"
    ftol: float = 1e-4               # sufficient decrease (Armijo)
    wolfe: float = 0.9               # curvature condition
    min_step: float = 1e-20
    max_step: float = 1e20
    dec: float = 0.5                 # backtracking factors
    inc: float = 2.1
    eps: float = 1e-5                # converged when |g| / max(1, |x|) <= eps
    past: int = 0                    # converged when f fell by less than delta (relative)
    delta: float = 1e-5              #   over the last `past` iterations (0: off)
    max_no_improvement: int = 0      # converged after this many iterations without a new
    on_fail: str = "stop"            #   best f (0: off); on a failed line search: stop/reset

    def check(self):
        if self.m < 1 or self.max_linesearch < 1:
            raise ValueError(f"lbfgs: m ({self.m}) and max_linesearch "
                             f"({self.max_linesearch}) must be >= 1")
        if self.linesearch not in LINESEARCHES:
            raise ValueError(f"unknown line search {self.linesearch!r}: "
                             f"{', '.join(LINESEARCHES)}")
        if self.on_fail not in ON_FAIL:
            raise ValueError(f"unknown on_fail {self.on_fail!r}: {', '.join(ON_FAIL)}")
        if not 0 < self.ftol < self.wolfe < 1:
            raise ValueError(f"lbfgs needs 0 < ftol ({self.ftol}) < wolfe ({self.wolfe}) < 1")


@dataclass(frozen=True)
class Status:
    """How an L-BFGS iteration ended: kind "ok", "converged" (the run may stop) or "failed"
    (x is where the iteration began), and why; str() is "kind: why" (the log's text)."""
    kind: str = "ok"
    why: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.why}" if self.why else self.kind


OK = Status()


def dot(a, b):
    return O.sum(O.mul(a, b))


def total(terms):
    out = terms[0]
    for t in terms[1:]:
        out = O.add(out, t)
    return out


class Lbfgs:
    """The L-BFGS graph pieces for `params` (graph leaves) with gradients `grads` of `loss`.

    Use: build it, plan `[loss, *lbfgs.outputs]` (plus anything else), call attach(plan),
    then iterate(feeds) per iteration."""

    def __init__(self, params, grads, loss, options: LbfgsOptions):
        options.check()
        self.options, self.loss, self.params = options, loss, list(params)
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += p.nelements
        self.n = n
        flat = lambda name: constant(np.zeros(n, np.float32), name=f"lbfgs.{name}")
        self.G, self.GP, self.XP, self.D = (flat(k) for k in ("g", "g_prev", "x_prev", "d"))
        self.S = [flat(f"s{j}") for j in range(options.m)]
        self.Y = [flat(f"y{j}") for j in range(options.m)]
        self.step_in = input_tensor((1,), name="lbfgs step")
        self.coef = input_tensor((options.m + 1,), name="lbfgs rho, gamma")
        parts = lambda flat_t: [O.view(flat_t, p.shape, contiguous_strides(p.shape), off)
                                for p, off in zip(self.params, self.offsets)]
        xp, gp, d = parts(self.XP), parts(self.GP), parts(self.D)
        g = [grads[p] for p in self.params]

        # eval: the gradient into G, and the scalars the line search tests
        self.eval_copies = [O.cpy(gi, v) for gi, v in zip(g, parts(self.G))]
        dx = [O.sub(p, x0) for p, x0 in zip(self.params, xp)]
        dg = [O.sub(gi, g0) for gi, g0 in zip(g, gp)]
        self.scalars = {"gd": total([dot(gi, di) for gi, di in zip(g, d)]),
                        "gg": O.sum_of_squares(g),
                        "xx": O.sum_of_squares(self.params),
                        "ys": total([dot(a, b) for a, b in zip(dx, dg)]),
                        "yy": O.sum_of_squares(dg)}

        # direction: the two-loop recursion over the history, newest pair first
        rho = [O.view(self.coef, (1,), (1,), j) for j in range(options.m)]
        gamma = O.view(self.coef, (1,), (1,), options.m)
        q, alpha = O.neg(self.G), [None] * options.m
        for j in reversed(range(options.m)):
            alpha[j] = O.mul(dot(self.S[j], q), rho[j])
            q = O.sub(q, O.mul(self.Y[j], alpha[j]))
        q = O.mul(q, gamma)
        for j in range(options.m):
            beta = O.mul(dot(self.Y[j], q), rho[j])
            q = O.add(q, O.mul(self.S[j], O.sub(alpha[j], beta)))
        self.direction = [O.cpy(q, self.D)]
        self.d_scalars = {"dg": dot(q, self.G), "dd": O.sum_sqr(q)}

        # begin, move, push
        self.begin = [O.cpy(p, v) for p, v in zip(self.params, xp)] + [O.cpy(self.G, self.GP)]
        self.move = [O.cpy(O.add(x0, O.mul(di, self.step_in)), p)
                     for x0, di, p in zip(xp, d, self.params)]

        # a stage of its own: the graph orders a write into a view of S_{m-1} after the
        # readers of its views only, not after the shift that reads all of S_{m-1}
        self.shift = [O.cpy(h[j + 1], h[j]) for h in (self.S, self.Y)
                      for j in range(options.m - 1)]
        self.push = [O.cpy(O.sub(p, x0), v)
                     for p, x0, v in zip(self.params, xp, parts(self.S[-1]))]
        self.push.append(O.cpy(O.sub(self.G, self.GP), self.Y[-1]))

        self.rho = np.zeros(options.m)     # host copies of the history's scalars
        self.gamma = 1.0
        self.k = 0                         # iterations done
        self.past_f: list[float] = []      # the last `past` losses
        self.best, self.no_improvement = math.inf, 0
        self.evaluations = 0
        self.last = None                   # (feeds, scalars) where the last search ended
        self.plan = None

    @property
    def outputs(self) -> list:
        """The tensors to plan (with the loss)."""
        return [*self.eval_copies, *self.scalars.values(), *self.direction,
                *self.d_scalars.values(), *self.begin, *self.move, *self.shift, *self.push]

    def attach(self, plan):
        """Split `plan` (which holds `outputs`) into the optimizer's stages."""
        self.plan = plan
        self.stages = {
            "eval": plan.stage([self.loss, *self.eval_copies, *self.scalars.values()]),
            "direction": plan.stage([*self.direction, *self.d_scalars.values()]),
            "begin": plan.stage(self.begin),
            "move": plan.stage(self.move),
            "shift": plan.stage(self.shift),
            "push": plan.stage(self.push)}

    def evaluate(self, feeds) -> dict:
        """f and the eval scalars at the current x (one readback)."""
        self.plan.run(feeds, stage=self.stages["eval"])
        names = ["f", *self.scalars]
        values = self.plan.read_many([self.loss, *self.scalars.values()])
        self.evaluations += 1
        return {k: float(v[0]) for k, v in zip(names, values)}

    def coefficients(self) -> np.ndarray:
        return np.array([*self.rho, self.gamma], np.float32)

    def iterate(self, feeds=None) -> dict:
        """One L-BFGS iteration on the batch `feeds`. Returns a record: loss (at the start),
        new_loss, grad_norm, evaluations (this iteration's), step, status (a Status)."""
        o, feeds = self.options, dict(feeds or {})
        evals0 = self.evaluations
        if self.last is not None and same_feeds(self.last[0], feeds):
            start = self.last[1]      # the last line search ended here, on this batch
        else:
            start = self.evaluate(feeds)
        self.last = None
        record = {"loss": start["f"], "grad_norm": math.sqrt(max(start["gg"], 0.0)),
                  "new_loss": start["f"]}
        if not math.isfinite(start["f"]) or not math.isfinite(start["gg"]):
            return {**record, "evaluations": self.evaluations - evals0, "step": 0.0,
                    "status": Status("failed", "the loss or the gradient is not finite")}
        if record["grad_norm"] / max(1.0, math.sqrt(start["xx"])) <= o.eps:
            return {**record, "evaluations": self.evaluations - evals0, "step": 0.0,
                    "status": Status("converged", "gradient norm below eps")}
        ok, why, step, end = self.linesearch(start["f"], feeds)
        if not ok and o.on_fail == "reset" and self.rho.any():
            self.rho[:], self.gamma = 0.0, 1.0       # steepest descent, then try once more
            self.restore()
            self.evaluate(feeds)                     # G := the gradient at the start again
            ok, why2, step, end = self.linesearch(start["f"], feeds)
            why = f"{why}; after dropping the history: {why2}" if not ok else why
        record.update(evaluations=self.evaluations - evals0, step=step)
        if not ok:
            self.restore()
            return {**record, "status": Status("failed", why)}
        record["new_loss"] = end["f"]
        if end["ys"] > 0:   # a pair with no positive curvature would break H's definiteness
            self.plan.run(stage=self.stages["shift"])
            self.plan.run(stage=self.stages["push"])
            self.rho = np.append(self.rho[1:], 1.0 / end["ys"])
            self.gamma = end["ys"] / end["yy"]
        self.k += 1
        self.last = ({k: np.array(v, copy=True) for k, v in feeds.items()}, end)
        record["status"] = self.converged(end)
        return record

    def linesearch(self, finit: float, feeds):
        """Backtracking along the direction from the current x (ggml's
        linesearch_backtracking). Returns (ok, why, step, scalars at the end)."""
        o = self.options
        self.plan.run({self.coef: self.coefficients()}, stage=self.stages["direction"])
        dginit, dd = (float(v[0]) for v in self.plan.read_many(list(self.d_scalars.values())))
        self.plan.run(stage=self.stages["begin"])
        if not (math.isfinite(dginit) and dginit < 0):
            return False, f"not a descent direction (g.d = {dginit:.4g})", 0.0, None
        # the first iteration (no history) starts at a step of unit length, as ggml
        step = 1.0 if self.rho.any() else 1.0 / math.sqrt(dd)
        dgtest = o.ftol * dginit
        for _ in range(o.max_linesearch):
            self.plan.run({self.step_in: np.array([step], np.float32)},
                          stage=self.stages["move"])
            s = self.evaluate(feeds)
            f, dg = s["f"], s["gd"]
            if not (math.isfinite(f) and math.isfinite(dg)) or f > finit + step * dgtest:
                width = o.dec
            elif o.linesearch == "armijo":
                return True, "", step, s
            elif dg < o.wolfe * dginit:
                width = o.inc
            elif o.linesearch == "wolfe" or dg <= -o.wolfe * dginit:
                return True, "", step, s
            else:
                width = o.dec
            if step < o.min_step:
                return False, f"the step fell below min_step {o.min_step:g}", step, s
            if step > o.max_step:
                return False, f"the step grew past max_step {o.max_step:g}", step, s
            step *= width
        return False, (f"no step met the {o.linesearch} conditions in {o.max_linesearch} "
                       f"evaluations"), step, None

    def restore(self):
        """x := the line search's start, copied back through the host: a move of step 0
        would be NaN where the direction is not finite (a second writer of the weights in
        the graph would make it cyclic). A failed search is rare; its copy is one read and
        one write of the weights."""
        start = self.plan.read(self.XP)
        for p, offset in zip(self.params, self.offsets):
            self.plan.write(p, start[offset:offset + p.nelements].reshape(p.shape))

    def converged(self, s: dict) -> Status:
        """ggml's tests after an iteration: the gradient, the relative decrease over `past`
        iterations, iterations without a new best."""
        o, f = self.options, s["f"]
        if math.sqrt(max(s["gg"], 0.0)) / max(1.0, math.sqrt(s["xx"])) <= o.eps:
            return Status("converged", "gradient norm below eps")
        if o.past:
            if len(self.past_f) == o.past and abs(self.past_f[0] - f) <= o.delta * abs(f):
                return Status("converged", f"the loss fell by less than {o.delta:g} "
                                           f"(relative) in {o.past} iterations")
            self.past_f = (self.past_f + [f])[-o.past:]
        if o.max_no_improvement:
            if f < self.best:
                self.best, self.no_improvement = f, 0
            else:
                self.no_improvement += 1
                if self.no_improvement >= o.max_no_improvement:
                    return Status("converged", f"{self.no_improvement} iterations without a "
                                               f"lower loss")
        return OK

    # -- checkpoints: the history and the host's scalars --------------------------------------

    def state(self) -> dict:
        """What resuming needs: the history (memory_s, memory_y: m x N, llama.cpp's names)
        and the host's scalars ("scalars": JSON-serialisable). G, D, XP and GP are
        recomputed by the next iteration."""
        return {"memory_s": np.stack(self.plan.read_many(self.S)),
                "memory_y": np.stack(self.plan.read_many(self.Y)),
                "scalars": {"rho": [float(r) for r in self.rho], "gamma": self.gamma,
                            "k": self.k, "past_f": self.past_f,
                            "best": None if math.isinf(self.best) else self.best,
                            "no_improvement": self.no_improvement,
                            "evaluations": self.evaluations}}

    def load_state(self, state: dict):
        """Take back `state()` (after attach); ValueError naming what does not fit."""
        m, n = self.options.m, self.n
        for key in ("memory_s", "memory_y"):
            shape = np.shape(state[key])
            if shape != (m, n):
                raise ValueError(f"lbfgs history {key}: shape {shape}, expected ({m}, {n}) "
                                 f"(history size m and parameter count must match)")
        for j in range(m):
            self.plan.write(self.S[j], state["memory_s"][j])
            self.plan.write(self.Y[j], state["memory_y"][j])
        sc = check_scalars(state["scalars"], m)
        self.rho = np.array(sc["rho"], np.float64)
        self.gamma, self.k = float(sc["gamma"]), int(sc["k"])
        self.past_f = [float(f) for f in sc["past_f"]]
        self.best = math.inf if sc["best"] is None else float(sc["best"])
        self.no_improvement = int(sc["no_improvement"])
        self.evaluations = int(sc["evaluations"])
        self.last = None


def check_scalars(sc, m: int) -> dict:
    """`sc` if it is an Lbfgs.state()'s "scalars" for history size m, else ValueError."""
    kinds = {"rho": list, "gamma": (int, float), "k": int, "past_f": list,
             "best": (int, float, type(None)), "no_improvement": int, "evaluations": int}
    if not isinstance(sc, dict) or set(sc) != set(kinds):
        raise ValueError(f"lbfgs scalars must be an object with keys {', '.join(kinds)}")
    for key, kind in kinds.items():
        if not isinstance(sc[key], kind) or isinstance(sc[key], bool):
            raise ValueError(f"lbfgs scalar {key} has the wrong type")
    if len(sc["rho"]) != m or not all(isinstance(r, (int, float)) for r in sc["rho"]):
        raise ValueError(f"lbfgs rho must be {m} numbers")
    if not all(isinstance(f, (int, float)) for f in sc["past_f"]):
        raise ValueError("lbfgs past_f must be numbers")
    finite = [*sc["rho"], sc["gamma"], *sc["past_f"], *([sc["best"]] if sc["best"] is not None
                                                         else [])]
    if not all(math.isfinite(v) for v in finite):
        raise ValueError("lbfgs rho, gamma, past_f and best must be finite")
    if any(r < 0 for r in sc["rho"]) or sc["gamma"] <= 0 or \
            min(sc["k"], sc["no_improvement"], sc["evaluations"]) < 0:
        raise ValueError("lbfgs rho must be >= 0, gamma > 0, and the counts >= 0")
    return sc


def same_feeds(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def two_loop_reference(g, S, Y, rho, gamma) -> np.ndarray:
    """The direction -H g by the two-loop recursion in float64 NumPy (slots in the device's
    order: the last the newest; rho 0 marks an empty slot)."""
    q, alpha = -np.asarray(g, np.float64), {}
    for j in reversed(range(len(S))):
        alpha[j] = rho[j] * (S[j] @ q)
        q = q - alpha[j] * Y[j]
    q = q * gamma
    for j in range(len(S)):
        beta = rho[j] * (Y[j] @ q)
        q = q + (alpha[j] - beta) * S[j]
    return q
