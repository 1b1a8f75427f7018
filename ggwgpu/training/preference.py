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
    """log(1 + exp(x)) as graph ops, exact for large |x|: relu(x) + log(1 + exp(-|x|))."""
    one = constant(np.ones(1, np.float32), name="one")
    return O.add(O.relu(x), O.log(O.add1(O.exp(O.neg(O.abs(x))), one)))


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


def sequence_rows(n_seq: int, n_ctx: int) -> np.ndarray:
    """(n_seq, n_seq * n_ctx): row i sums the positions of batch row i (one sequence a row)."""
    return np.kron(np.eye(n_seq, dtype=np.float32), np.ones((1, n_ctx), np.float32))


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
