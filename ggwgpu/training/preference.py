"""Preference finetuning: DPO (Rafailov et al. 2023) with the sigmoid loss and label
smoothing, its IPO variant, ORPO (Hong et al. 2024), CPO (Xu et al. 2024), SimPO (Meng et
al. 2024) and KTO (Ethayarajh et al. 2024), with TRL's formulas.

A batch holds pairs (pairs.PairBatches): padded, row 2i the chosen answer of pair i and row
2i + 1 the rejected one; packed, several pairs to each two rows. Each answer comes with its
prompt, and only the answer's tokens are counted (target weight 1). The training graph sums
each sequence's token terms (build_train_graph's `sequences`: cross_entropy_ids_rows and a
0/1 product with the sequence rows, a constant when padded, an input of each packed batch),
so a sequence's log-probability is

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
    CPO   z = beta * (logp_c - logp_r), no reference
          loss = (1 - eps) * softplus(-z) + eps * softplus(z) + alpha * NLL of the chosen
    SimPO z = beta * (avg_c - avg_r) - gamma, no reference
          loss = as CPO's (alpha 0 by default: SimPO's paper; above 0, TRL's CPO-SimPO)
    KTO   a "pair" is one example's answer (its label s: +1 good, -1 bad) and a mismatched
          answer after its prompt (pairs.kto_pairs), whose log-ratios estimate the KL:
          KL = max(0, mean over the batch of (logp_m - r_m)), a constant (detach)
          loss = w_s * (1 - sigmoid(beta * s * (logp - r - KL))), w_s TRL's desirable and
          undesirable weights

each averaged over the batch's pairs (a packed batch's pairs vary in number: each pair's
weight is then an input, 1 / the batch's pairs); softplus(x) = log(1 + exp(x)) =
-logsigmoid(-x).
`reference_loss` computes the same from log-probabilities in float64, apart from the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops as O
from ..tensor import constant, input_tensor

LOSSES = ("dpo", "ipo", "orpo", "cpo", "simpo", "kto")


@dataclass(frozen=True)
class PreferenceLoss:
    """Which loss and its constants: beta (all but ORPO; TRL's default 0.1), label
    smoothing (DPO's, CPO's and SimPO's eps, in [0, 0.5)), lambda (ORPO's weight of the
    odds-ratio term, TRL's beta), gamma (SimPO's target margin, TRL's simpo_gamma) and alpha
    (CPO's and SimPO's weight of the chosen answers' NLL, TRL's cpo_alpha; None: 1 for CPO,
    0 for SimPO), and KTO's weights of the good and the bad examples' terms (TRL's
    desirable_weight, undesirable_weight)."""
    kind: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1
    simpo_gamma: float = 0.5
    cpo_alpha: float | None = None
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

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
        if not self.simpo_gamma >= 0:
            raise ValueError(f"SimPO's gamma must be >= 0, got {self.simpo_gamma}")
        if self.cpo_alpha is not None and not self.cpo_alpha >= 0:
            raise ValueError(f"CPO's alpha must be >= 0, got {self.cpo_alpha}")
        if not (self.desirable_weight > 0 and self.undesirable_weight > 0):
            raise ValueError(f"KTO's weights must be > 0, got {self.desirable_weight} and "
                             f"{self.undesirable_weight}")

    @property
    def needs_reference(self) -> bool:
        return self.kind in ("dpo", "ipo", "kto")

    @property
    def per_token(self) -> bool:
        """Whether the loss reads per-token means of the log-probabilities (IPO, ORPO,
        SimPO)."""
        return self.kind in ("ipo", "orpo", "simpo")

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen answers' mean token NLL in the loss."""
        if self.kind == "orpo":
            return 1.0
        if self.kind in ("cpo", "simpo") and self.cpo_alpha is not None:
            return self.cpo_alpha
        return 1.0 if self.kind == "cpo" else 0.0


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
    (1, 2 n_pairs) (DPO; IPO's per answer token, as its policy's), for IPO, ORPO and SimPO
    each sequence's 1 / answer length (1, 2 n_pairs), for a loss with the chosen answers'
    NLL (ORPO; CPO, SimPO with alpha) the chosen sequences' weights of its mean
    (1, 2 n_pairs): 1 / (the chosen answers' tokens) at chosen sequences, 0 at
    rejected ones, and when `weighted` each pair's weight in the mean (1, n_pairs); KTO's
    signs of the labels (1, n_pairs) and weights of the KL estimate's mean (1, 2 n_pairs):
    1 / the batch's examples at their mismatched sequences, 0 elsewhere (and its pair
    weights always: the label weights over the batch's examples)."""
    loss: object
    reference: object
    inv_lengths: object
    chosen_weights: object
    pair_weights: object = None
    signs: object = None
    kl_weights: object = None


def preference_terms(sequence_nll, n_pairs: int, loss: PreferenceLoss,
                     weighted: bool = False) -> PreferenceTerms:
    """The loss of the module docstring over a graph's sequence_nll (1, 2 n_pairs): the
    pairs' terms averaged (1 / n_pairs each), or with `weighted` summed times the input
    pair_weights (a packed batch holds a varying number of pairs, a rank's part of a batch
    is a share of its mean)."""
    n_seq = 2 * n_pairs
    pairs = constant(pair_matrix(n_pairs), name="pairs")
    reference = input_tensor((1, n_seq), name="reference logp") if loss.needs_reference else None
    inv_lengths = input_tensor((1, n_seq), name="1 / answer length") if loss.per_token else None
    chosen_weights = input_tensor((1, n_seq), name="chosen weights") \
        if loss.nll_weight else None
    kto = loss.kind == "kto"
    pair_weights = input_tensor((1, n_pairs), name="pair weights") \
        if weighted or kto else None
    signs = input_tensor((1, n_pairs), name="label signs") if kto else None
    kl_weights = input_tensor((1, n_seq), name="KL weights") if kto else None
    logp = O.neg(sequence_nll)
    if loss.per_token:
        logp = O.mul(logp, inv_lengths)

    def chosen_minus_rejected(x):               # (1, n_seq) -> (1, n_pairs)
        return O.mul_mat(pairs, x)

    def mean(terms):                            # (1, n_pairs) -> (1,)
        if pair_weights is None:
            return O.scale(O.sum(terms), 1.0 / n_pairs)
        return O.sum(O.mul(terms, pair_weights))

    if loss.kind == "orpo":
        one = constant(np.ones(1, np.float32), name="one")
        log1m = O.log(O.add1(O.neg(O.exp(logp)), one))                # log(1 - exp(avg))
        log_odds = chosen_minus_rejected(O.sub(logp, log1m))
        total = O.scale(mean(softplus(O.neg(log_odds))), loss.orpo_lambda)
    elif kto:
        ratios = O.sub(logp, O.reshape(reference, (1, n_seq)))
        kl = O.relu(O.detach(O.sum(O.mul(ratios, kl_weights))))
        answers = constant(np.maximum(pair_matrix(n_pairs), 0), name="answers")
        z = O.mul(O.scale(O.add1(O.mul_mat(answers, ratios), O.neg(kl)), loss.beta), signs)
        total = mean(O.exp(O.neg(softplus(z))))                  # 1 - sigmoid(z)
    else:
        if reference is not None:
            logp = O.sub(logp, O.reshape(reference, (1, n_seq)))
        d = chosen_minus_rejected(logp)
        if loss.kind == "ipo":
            shift = constant(np.array([-1.0 / (2 * loss.beta)], np.float32), name="-1/(2 beta)")
            terms = O.sqr(O.add1(d, shift))
        else:
            z = O.scale(d, loss.beta)
            if loss.kind == "simpo":
                gamma = constant(np.array([-loss.simpo_gamma], np.float32), name="-gamma")
                z = O.add1(z, gamma)
            eps = loss.label_smoothing
            terms = softplus(O.neg(z))
            if eps:
                terms = O.add(O.scale(terms, 1 - eps), O.scale(softplus(z), eps))
        total = mean(terms)
    if chosen_weights is not None:              # the chosen answers' mean token NLL
        nll = O.sum(O.mul(sequence_nll, chosen_weights))
        total = O.add(total, nll if loss.nll_weight == 1 else O.scale(nll, loss.nll_weight))
    return PreferenceTerms(total, reference, inv_lengths, chosen_weights, pair_weights, signs,
                           kl_weights)


def sequence_matrix(sequences, n_pairs: int, n_slots: int) -> np.ndarray:
    """A packed graph's sequence rows (TrainGraph.sequence_rows): (2 n_slots, positions) 0/1,
    1 where `sequences` (rows, n_ctx) puts a position in that sequence; the slots past the
    batch's n_pairs pairs repeat its first pair (a finite loss that a weight 0 leaves out:
    ORPO's log(1 - exp(avg)) of an empty sequence is -inf)."""
    flat = np.asarray(sequences).reshape(-1)
    m = np.zeros((2 * n_slots, flat.size), np.float32)
    at = np.flatnonzero(flat >= 0)
    m[flat[at], at] = 1
    m[2 * n_pairs:] = m[np.arange(2 * n_pairs, 2 * n_slots) % 2]
    return m


def sequence_feeds(graph, inputs, targets, sequences, n_pairs: int) -> dict:
    """The inputs of a training graph with sequences (build_train_graph's `sequences`) for a
    batch of pairs.PairBatches (`sequences` as its batches give them, `n_pairs` pairs):
    tokens and targets, every counted target of weight 1 (a sequence's terms then sum to
    minus its log-probability), and for a packed graph the segments and sequence rows."""
    targets = np.asarray(targets, np.int32)
    feeds = graph.feeds(inputs, targets, sequences if graph.packed else None)
    feeds[graph.weights] = (targets >= 0).astype(np.float32)
    if graph.packed:
        slots = graph.sequence_rows.shape[0] // 2
        if n_pairs > slots:
            raise ValueError(f"a batch of {n_pairs} pairs, the graph has {slots} pair slots")
        feeds[graph.sequence_rows] = sequence_matrix(sequences, n_pairs, slots)
    return feeds


def reference_loss(logp, lengths, reference, loss: PreferenceLoss, labels=None) -> dict:
    """TRL's formulas in float64, from each sequence's log-probability `logp` (2 n_pairs,
    chosen and rejected alternating), its answer length, and the reference model's
    log-probabilities (read where the loss has a reference): the loss, and per pair the
    rewards of chosen and rejected, margins, and whether the chosen one is ahead (TRL's
    rewards/accuracies). KTO's (`labels` its pairs' labels): the rewards of the good and
    the bad examples, each example's margin beta * s * (logp - r - KL), the share of
    examples on their label's side of the KL, and the KL."""
    if loss.kind == "kto":
        return kto_loss(logp, reference, labels, loss)
    logp, lengths = np.asarray(logp, np.float64), np.asarray(lengths, np.float64)
    reference = np.asarray(reference if loss.needs_reference else np.zeros_like(logp),
                           np.float64)
    if loss.per_token:
        logp, reference = logp / lengths, reference / lengths

    def softplus_(x):
        return np.logaddexp(0.0, x)

    c, r = logp[0::2], logp[1::2]
    chosen_sums = c * lengths[0::2] if loss.per_token else c
    nll = -chosen_sums.sum() / lengths[0::2].sum()
    if loss.kind == "orpo":
        log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
        value = loss.orpo_lambda * softplus_(-log_odds).mean()
        chosen, rejected = loss.orpo_lambda * c, loss.orpo_lambda * r
    else:
        d = (c - reference[0::2]) - (r - reference[1::2])
        if loss.kind == "ipo":
            value = ((d - 1 / (2 * loss.beta)) ** 2).mean()
        else:
            z = loss.beta * d - (loss.simpo_gamma if loss.kind == "simpo" else 0.0)
            eps = loss.label_smoothing
            value = ((1 - eps) * softplus_(-z) + eps * softplus_(z)).mean()
        chosen = loss.beta * (c - reference[0::2])
        rejected = loss.beta * (r - reference[1::2])
    value += loss.nll_weight * nll
    return {"loss": float(value), "chosen": chosen, "rejected": rejected,
            "margin": chosen - rejected, "accuracy": float((chosen > rejected).mean())}


def kto_loss(logp, reference, labels, loss: PreferenceLoss, kl=None) -> dict:
    """reference_loss of KTO (TRL's kto_loss, mean over the examples); `kl` the KL
    estimate, else the mismatched answers' (max(0, their mean log-ratio))."""
    ratios = np.asarray(logp, np.float64) - np.asarray(reference, np.float64)
    labels = np.asarray(labels, bool)
    answers = ratios[0::2]
    kl = max(ratios[1::2].mean(), 0.0) if kl is None else kl
    sign = np.where(labels, 1.0, -1.0)
    z = loss.beta * sign * (answers - kl)
    weights = np.where(labels, loss.desirable_weight, loss.undesirable_weight)
    rewards = loss.beta * answers
    return {"loss": float((weights * np.exp(-np.logaddexp(0.0, z))).mean()),
            "chosen": rewards[labels], "rejected": rewards[~labels], "margin": z,
            "accuracy": float((z > 0).mean()), "kl": kl}


class PreferenceGraph:
    """A training graph (models.TrainGraph, built with `sequences` = 2 pair slots) whose loss
    is a preference loss: what a Trainer needs of a graph (loss, params, checkpoints,
    recompute, positions, packed, draws), `feeds(*batch)` of a pairs.PairBatches batch, and
    the batch's rewards, margins and accuracy (`report`) from its sequences'
    log-probabilities (`reported`, read back after a step).

    With `world` (distributed.World) the graph is one rank's: `feeds` takes the whole batch
    and keeps this rank's units of it (2 rows each, the batch cut into world.size parts as
    for text), each pair weighted by 1 / the whole batch's pairs (ORPO's NLL by the whole
    batch's chosen tokens), so that the ranks' losses and gradients sum to one process's;
    the metrics gather every rank's log-probabilities and are the whole batch's. KTO's
    KL estimate is a mean over the whole batch inside the graph, so KTO runs in one
    process."""

    def __init__(self, graph, loss: PreferenceLoss, world=None):
        if graph.sequence_nll is None:
            raise ValueError("a preference graph needs a training graph with sequences")
        if world is not None and loss.kind == "kto":
            raise ValueError("KTO's KL estimate is a mean over each step's whole batch, which "
                             "is not shared out over processes: run KTO in one process")
        self.graph, self.kind, self.world = graph, loss, world
        self.n_pairs = graph.sequence_nll.shape[1] // 2            # pair slots
        self.terms = preference_terms(graph.sequence_nll, self.n_pairs, loss,
                                      weighted=graph.packed or world is not None)
        self.loss, self.params = self.terms.loss, graph.params
        self.checkpoints, self.recompute = graph.checkpoints, graph.recompute
        self.positions, self.packed, self.tokens = graph.positions, graph.packed, graph.tokens
        self.draws = graph.draws
        self.reported = (graph.sequence_nll,)
        self.last = None

    def feeds(self, inputs, targets, pairs, reference, sequences, labels=None) -> dict:
        """The graph's inputs of a batch (pairs.PairBatches'): `pairs` (-1 for a filler
        pair, which no loss or metric counts), `reference` (2 pairs,) their reference
        log-probabilities and (KTO) their `labels`, with a world the whole batch's."""
        terms, world = self.terms, self.world
        targets, sequences = np.asarray(targets, np.int32), np.asarray(sequences)
        pairs = np.asarray(pairs)
        n = len(pairs)
        lengths = np.maximum(np.bincount(sequences[targets >= 0], minlength=2 * n), 1
                             ).astype(np.float64)
        real = pairs >= 0
        if terms.reference is not None and reference is None:
            raise ValueError(f"{self.kind.kind} needs the reference model's log-probabilities "
                             f"of the pairs")
        reference = None if terms.reference is None else np.asarray(reference, np.float64)
        if terms.signs is not None and labels is None:
            raise ValueError("KTO needs its examples' labels")
        labels = None if terms.signs is None else np.asarray(labels, bool)
        rows, first, mine = slice(None), 0, n
        if world is not None:       # this rank's units, their pairs a run of the batch's
            k = len(inputs) // world.size
            rows = slice(world.rank * k, (world.rank + 1) * k)
            seen = sequences[rows][sequences[rows] >= 0] // 2
            first, mine = seen.min(), seen.max() + 1 - seen.min()
        local = sequences[rows] - np.where(sequences[rows] >= 0, 2 * first, 0)
        feeds = sequence_feeds(self.graph, np.asarray(inputs)[rows], targets[rows], local, mine)

        def slots(x, repeat=True):
            """Per sequence of the whole batch (2 n,) -> this graph's sequence slots: this
            rank's, then the filler slots (as the sequence rows: the first pair again, or
            0 where a weight leaves them out)."""
            x = x[2 * first:2 * (first + mine)]
            rest = np.tile(x[:2], self.n_pairs - mine) if repeat \
                else np.zeros(2 * (self.n_pairs - mine))
            return np.concatenate([x, rest])[None].astype(np.float32)
        if reference is not None:
            feeds[terms.reference] = slots(reference / lengths if self.kind.per_token
                                           else reference)
        if terms.inv_lengths is not None:
            feeds[terms.inv_lengths] = slots(1.0 / lengths)
        if terms.chosen_weights is not None:     # of the whole batch's chosen answers
            w = np.zeros(2 * n)
            w[0::2] = real / lengths[0::2][real].sum()
            feeds[terms.chosen_weights] = slots(w, repeat=False)
        weights = real / real.sum()
        if labels is not None:                   # KTO's
            feeds[terms.signs] = slots(np.repeat(np.where(labels, 1.0, -1.0), 2))[:, 0::2]
            feeds[terms.kl_weights] = slots(np.stack([np.zeros(n), weights], 1).reshape(-1),
                                            repeat=False)
            weights = weights * np.where(labels, self.kind.desirable_weight,
                                         self.kind.undesirable_weight)
        if terms.pair_weights is not None:       # 1 / the whole batch's pairs
            feeds[terms.pair_weights] = slots(np.repeat(weights, 2), repeat=False)[:, 0::2]
        self.last = (lengths, reference, real, first, mine, labels)
        return feeds

    def _metrics(self, sequence_nll) -> tuple[dict, int]:
        """reference_loss of the last batch's real pairs (an evaluation's last batch is
        filled up with repeated ones), and how many there are; with a world, of the whole
        batch (every rank's log-probabilities summed into one buffer)."""
        lengths, reference, real, first, mine, labels = self.last
        nll = np.zeros(2 * len(real))
        nll[2 * first:2 * (first + mine)] = np.asarray(sequence_nll, np.float64).reshape(-1)[
            :2 * mine]
        if self.world is not None:
            self.world.allreduce(nll)
        rows = np.repeat(real, 2)
        return reference_loss(-nll[rows], lengths[rows],
                              None if reference is None else reference[rows],
                              self.kind, None if labels is None else labels[real]
                              ), int(real.sum())

    def weighed(self, plan, batch) -> dict:
        """The batch's loss, accuracy and mean margin times its pairs, and its pairs
        ("count"), of the real pairs only (with a world, of the whole batch)."""
        r, n = self._metrics(plan.read(self.graph.sequence_nll))
        return {"loss": r["loss"] * n, "accuracy": r["accuracy"] * n,
                "margin": float(r["margin"].mean()) * n, "count": n}

    def report(self, reported) -> dict:
        """The last batch's TRL metrics: mean rewards of chosen and rejected, margin, and
        the share of pairs whose chosen reward is higher (KTO's: of its good and bad
        examples, the mean margin, the share on their label's side, and the KL)."""
        r, _ = self._metrics(reported[0])

        def mean(x):                # a KTO batch may hold no good or no bad example
            return float(x.mean()) if len(x) else float("nan")
        return {"rewards_chosen": mean(r["chosen"]), "rewards_rejected": mean(r["rejected"]),
                "margin": float(r["margin"].mean()), "accuracy": r["accuracy"],
                **({"kl": r["kl"]} if "kl" in r else {})}


def sequence_logps(cfg, values, batches, backend, precision: str = "f32", lora=None,
                   max_logits_bytes: int | None = None, world=None) -> np.ndarray:
    """Each pair's log-probabilities of its chosen and rejected answer, (n_pairs, 2), under
    the model `values` (with `lora`'s pairs added, if given), frozen: the reference model of
    DPO and IPO, computed once before training (a LoRA finetune's reference is its base;
    a full finetune's, its starting weights). The batches are `batches`' (pairs.PairBatches,
    padded or packed as they are); with `world` each rank computes every world.size-th
    batch and the ranks sum their parts, so every rank has them all."""
    from ..models import MAX_LOGITS_BYTES, build_train_graph
    n = 2 * batches.pair_slots(batches.batch)
    g = build_train_graph(cfg, values, 2 * batches.batch, adapters=(lora,) if lora else (),
                          frozen=True, sequences=n, precision=precision,
                          packed=batches.packed,
                          max_logits_bytes=max_logits_bytes or MAX_LOGITS_BYTES)
    plan = backend.plan([g.sequence_nll])
    if not g.packed:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
    out = np.zeros((batches.n_pairs, 2))
    for k, (inputs, targets, pairs, _, sequences, _) in enumerate(batches.in_order()):
        if world is not None and k % world.size != world.rank:
            continue
        plan.run(sequence_feeds(g, inputs, targets, sequences, len(pairs)))
        logp = -plan.read(g.sequence_nll).reshape(-1, 2)[:len(pairs)].astype(np.float64)
        out[pairs[pairs >= 0]] = logp[pairs >= 0]
    return out if world is None else world.allreduce(out)
