"""Preference finetuning: DPO (Rafailov et al. 2023) with the sigmoid loss and label
smoothing, its IPO variant, and ORPO (Hong et al. 2024), with TRL's formulas.

A batch holds pairs: row 2i the chosen answer of pair i, row 2i + 1 the rejected one, each
with its prompt, and only the answer's tokens counted (target weight 1). The training graph
sums each sequence's token terms (build_train_graph's `sequences`: cross_entropy_ids_rows
and a 0/1 product), so a sequence's log-probability is

    logp(seq) = -sequence_nll(seq) = sum over its answer tokens of log p(token | before)

and, per token, avg(seq) = logp(seq) / its answer's length. With the reference model's
log-probabilities r (the frozen base: a LoRA finetune's policy with its adapter off), per
pair (c chosen, r rejected):

    DPO   d = (logp_c - r_c) - (logp_r - r_r)
          loss = (1 - eps) * softplus(-beta * d) + eps * softplus(beta * d)
    IPO   d as DPO's but of avg (TRL divides IPO's log-probabilities by the answer length)
          loss = (d - 1 / (2 beta))^2
    ORPO  log_odds = (avg_c - log(1 - exp(avg_c))) - (avg_r - log(1 - exp(avg_r)))
          loss = NLL of the chosen answers (mean per token) + lambda * softplus(-log_odds)

each averaged over the batch's pairs; softplus(x) = log(1 + exp(x)) = -logsigmoid(-x).
`reference_loss` computes the same from log-probabilities in float64, apart from the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops as O
from ..tensor import constant, input_tensor

LOSSES = ("dpo", "ipo", "orpo")


@dataclass(frozen=True)
class PreferenceLoss:
    """Which loss and its constants: beta (DPO, IPO; TRL's default 0.1), label smoothing
    (DPO's eps, in [0, 0.5)), lambda (ORPO's weight of the odds-ratio term, TRL's beta)."""
    kind: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1

    def __post_init__(self):
        if self.kind not in LOSSES:
            raise ValueError(f"preference loss must be one of {', '.join(LOSSES)}, got "
                             f"{self.kind!r}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if not self.orpo_lambda >= 0:
            raise ValueError(f"ORPO's lambda must be >= 0, got {self.orpo_lambda}")

    @property
    def needs_reference(self) -> bool:
        return self.kind != "orpo"

    @property
    def per_token(self) -> bool:
        """Whether the loss reads per-token means of the log-probabilities (IPO, ORPO)."""
        return self.kind != "dpo"


def softplus(x):
    """log(1 + exp(x)) as graph ops, exact for large |x|: (x + |x|) / 2 + log(1 + exp(-|x|)).
    Not relu(x) for the first term: at x = 0, where a DPO step starts (the policy is the
    reference), relu's and abs's derivatives are 0 and the gradient would be 0 instead of
    1/2; (x + |x|) / 2 has 1/2 there."""
    one = constant(np.ones(1, np.float32), name="one")
    positive = O.scale(O.add(x, O.abs(x)), 0.5)
    return O.add(positive, O.log(O.add1(O.exp(O.neg(O.abs(x))), one)))


def pair_matrix(n_pairs: int) -> np.ndarray:
    """(n_pairs, 2 n_pairs): +1 at pair i's chosen sequence 2i, -1 at its rejected 2i + 1, so
    a product with per-sequence values gives chosen - rejected per pair."""
    m = np.zeros((n_pairs, 2 * n_pairs), np.float32)
    m[np.arange(n_pairs), 2 * np.arange(n_pairs)] = 1
    m[np.arange(n_pairs), 2 * np.arange(n_pairs) + 1] = -1
    return m


@dataclass
class PreferenceTerms:
    """The graph's preference loss and the inputs it adds: the reference log-probabilities
    (1, 2 n_pairs) (DPO; IPO's per answer token, as its policy's), for IPO and ORPO each sequence's 1 / answer length (1, 2 n_pairs) and, for
    ORPO, the chosen sequences' weights of the mean NLL (1, 2 n_pairs): 1 / (the chosen
    answers' tokens) at chosen sequences, 0 at rejected ones."""
    loss: object
    reference: object
    inv_lengths: object
    chosen_weights: object


def preference_terms(sequence_nll, n_pairs: int, loss: PreferenceLoss) -> PreferenceTerms:
    """The loss of the module docstring over a graph's sequence_nll (1, 2 n_pairs)."""
    n_seq = 2 * n_pairs
    pairs = constant(pair_matrix(n_pairs), name="pairs")
    reference = input_tensor((1, n_seq), name="reference logp") if loss.needs_reference else None
    inv_lengths = input_tensor((1, n_seq), name="1 / answer length") if loss.per_token else None
    chosen_weights = input_tensor((1, n_seq), name="chosen weights") \
        if loss.kind == "orpo" else None
    logp = O.neg(sequence_nll)
    if loss.per_token:
        logp = O.mul(logp, inv_lengths)

    def chosen_minus_rejected(x):               # (1, n_seq) -> (1, n_pairs)
        return O.mul_mat(pairs, x)

    if loss.kind == "orpo":
        one = constant(np.ones(1, np.float32), name="one")
        log1m = O.log(O.add1(O.neg(O.exp(logp)), one))                # log(1 - exp(avg))
        log_odds = chosen_minus_rejected(O.sub(logp, log1m))
        nll = O.sum(O.mul(sequence_nll, chosen_weights))
        total = O.add(nll, O.scale(O.sum(softplus(O.neg(log_odds))),
                                   loss.orpo_lambda / n_pairs))
    else:
        d = chosen_minus_rejected(O.sub(logp, O.reshape(reference, (1, n_seq))))
        if loss.kind == "ipo":
            shift = constant(np.array([-1.0 / (2 * loss.beta)], np.float32), name="-1/(2 beta)")
            terms = O.sqr(O.add1(d, shift))
        else:
            z = O.scale(d, loss.beta)
            eps = loss.label_smoothing
            terms = softplus(O.neg(z))
            if eps:
                terms = O.add(O.scale(terms, 1 - eps), O.scale(softplus(z), eps))
        total = O.scale(O.sum(terms), 1.0 / n_pairs)
    return PreferenceTerms(total, reference, inv_lengths, chosen_weights)


def reference_loss(logp, lengths, reference, loss: PreferenceLoss) -> dict:
    """TRL's formulas in float64, from each sequence's log-probability `logp` (2 n_pairs,
    chosen and rejected alternating), its answer length, and the reference model's
    log-probabilities: the loss, and per pair the rewards of chosen and rejected, margins,
    and whether the chosen one is ahead (TRL's rewards/accuracies)."""
    logp, lengths = np.asarray(logp, np.float64), np.asarray(lengths, np.float64)
    reference = np.asarray(reference if reference is not None else np.zeros_like(logp),
                           np.float64)
    if loss.per_token:
        logp, reference = logp / lengths, reference / lengths

    def softplus_(x):
        return np.logaddexp(0.0, x)

    c, r = logp[0::2], logp[1::2]
    if loss.kind == "orpo":
        log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
        nll = -(c * lengths[0::2]).sum() / lengths[0::2].sum()
        value = nll + loss.orpo_lambda * softplus_(-log_odds).mean()
        chosen, rejected = loss.orpo_lambda * c, loss.orpo_lambda * r
    else:
        d = (c - reference[0::2]) - (r - reference[1::2])
        if loss.kind == "ipo":
            value = ((d - 1 / (2 * loss.beta)) ** 2).mean()
        else:
            eps = loss.label_smoothing
            value = ((1 - eps) * softplus_(-loss.beta * d) +
                     eps * softplus_(loss.beta * d)).mean()
        chosen = loss.beta * (c - reference[0::2])
        rejected = loss.beta * (r - reference[1::2])
    return {"loss": float(value), "chosen": chosen, "rejected": rejected,
            "margin": chosen - rejected, "accuracy": float((chosen > rejected).mean())}


class PreferenceGraph:
    """A training graph (models.TrainGraph, built with `sequences` = 2 pairs) whose loss is a
    preference loss: what a Trainer needs of a graph (loss, params, checkpoints, recompute,
    positions, packed), `feeds(inputs, targets, pairs, reference)` of a pairs.PairBatches
    batch, and the batch's rewards, margins and accuracy (`report`) from its sequences'
    log-probabilities (`reported`, read back after a step)."""

    def __init__(self, graph, loss: PreferenceLoss):
        if graph.sequence_nll is None or graph.packed:
            raise ValueError("a preference graph needs a padded training graph with sequences")
        self.graph, self.kind = graph, loss
        self.n_pairs = graph.sequence_nll.shape[1] // 2
        self.terms = preference_terms(graph.sequence_nll, self.n_pairs, loss)
        self.loss, self.params = self.terms.loss, graph.params
        self.checkpoints, self.recompute = graph.checkpoints, graph.recompute
        self.positions, self.packed, self.tokens = graph.positions, False, graph.tokens
        self.reported = (graph.sequence_nll,)
        self.last = None

    def feeds(self, inputs, targets, pairs, reference=None) -> dict:
        """The graph's inputs of a batch: `pairs` (-1 for a filler pair, which no loss or
        metric counts) and `reference` (2 pairs,) their reference log-probabilities."""
        g, terms = self.graph, self.terms
        targets = np.asarray(targets, np.int32)
        feeds = g.feeds(inputs, targets)
        feeds[g.weights] = (targets >= 0).astype(np.float32)
        lengths = np.maximum((targets >= 0).sum(axis=1), 1).astype(np.float64)
        if terms.reference is None:
            reference = None
        elif reference is None:
            raise ValueError(f"{self.kind.kind} needs the reference model's log-probabilities "
                             f"of the pairs")
        else:
            reference = np.asarray(reference, np.float64)
            feeds[terms.reference] = (reference / lengths if self.kind.per_token
                                      else reference)[None].astype(np.float32)
        if terms.inv_lengths is not None:
            feeds[terms.inv_lengths] = (1.0 / lengths)[None].astype(np.float32)
        if terms.chosen_weights is not None:
            w = np.zeros(len(lengths))
            w[0::2] = 1.0 / lengths[0::2].sum()
            feeds[terms.chosen_weights] = w[None].astype(np.float32)
        self.last = (lengths, reference, np.asarray(pairs) >= 0)
        return feeds

    def _metrics(self, sequence_nll) -> tuple[dict, int]:
        """reference_loss of the last batch's real pairs (an evaluation's last batch is
        filled up with repeated ones), and how many there are."""
        lengths, reference, real = self.last
        rows = np.repeat(real, 2)
        logp = -np.asarray(sequence_nll, np.float64).reshape(-1)[rows]
        return reference_loss(logp, lengths[rows],
                              None if reference is None else reference[rows],
                              self.kind), int(real.sum())

    def weighed(self, plan, batch) -> dict:
        """The batch's loss, accuracy and mean margin times its pairs, and its pairs
        ("count"), of the real pairs only."""
        r, n = self._metrics(plan.read(self.graph.sequence_nll))
        return {"loss": r["loss"] * n, "accuracy": r["accuracy"] * n,
                "margin": float(r["margin"].mean()) * n, "count": n}

    def report(self, reported) -> dict:
        """The last batch's TRL metrics: mean rewards of chosen and rejected, margin, and
        the share of pairs whose chosen reward is higher."""
        r, _ = self._metrics(reported[0])
        return {"rewards_chosen": float(r["chosen"].mean()),
                "rewards_rejected": float(r["rejected"].mean()),
                "margin": float(r["margin"].mean()), "accuracy": r["accuracy"]}


def sequence_logps(cfg, values, batches, backend, precision: str = "f32", lora=None,
                   max_logits_bytes: int | None = None) -> np.ndarray:
    """Each pair's log-probabilities of its chosen and rejected answer, (n_pairs, 2), under
    the model `values` (with `lora`'s pairs added, if given), frozen: the reference model of
    DPO and IPO, computed once before training (a LoRA finetune's reference is its base;
    a full finetune's, its starting weights)."""
    from ..models import MAX_LOGITS_BYTES, build_train_graph
    n = 2 * batches.batch
    g = build_train_graph(cfg, values, n, adapters=(lora,) if lora else (), frozen=True,
                          sequences=n, precision=precision,
                          max_logits_bytes=max_logits_bytes or MAX_LOGITS_BYTES)
    plan = backend.plan([g.sequence_nll])
    plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
    out = np.zeros((batches.n_pairs, 2))
    for inputs, targets, pairs, _ in batches.in_order():
        feeds = g.feeds(inputs, targets)
        feeds[g.weights] = (np.asarray(targets) >= 0).astype(np.float32)
        plan.run(feeds)
        logp = -plan.read(g.sequence_nll).reshape(-1, 2).astype(np.float64)
        out[pairs[pairs >= 0]] = logp[pairs >= 0]
    return out
