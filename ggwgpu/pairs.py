"""Preference data: JSONL lines of a prompt and two answers, the chosen and the rejected one,
in the forms TRL documents:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                   standard
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}    conversational
    {"chosen": [messages], "rejected": [messages]}       implicit prompt: their common start

A conversational pair may have "tools" (chat.py's tool calling: the schemas the messages'
tool calls call).

KTO's data is unpaired, one answer a line labelled good (true) or bad (false), as TRL's
KTOTrainer takes it:

    {"prompt": "...", "completion": "...", "label": true}
    {"prompt": [messages], "completion": [messages], "label": false}

and a file of pairs is unpaired (TRL's unpair_preference_dataset): each pair gives its chosen
answer labelled true and its rejected one labelled false. `kto_pairs` makes each example a
pair too, of its own answer and a mismatched one (another example's answer after its prompt:
KTO's KL sample), so that the pair machinery below batches both.

A file or a directory of splits, as chat data (chat.load_dataset). Each answer is encoded as
a chat example of the prompt and that answer (chat.encode_example: through the chat
template, a string prompt a user turn and a string answer the assistant's), and only the
answer's tokens are trained. `PairBatches` makes batches of pairs for the preference losses
(training/preference.py): padded, row 2i of a batch the chosen sequence of its pair i and
row 2i + 1 the rejected one; packed, several pairs in each such pair of rows.
"""
from __future__ import annotations

import numpy as np

from .chat import (IGNORE, STATE_VERSION, Example, RowBatches, _need_unicode,
                   check_messages, check_tools, encode_example, pack_rows, place)
from .data import DataError, EpochOrder


def check_pair(example) -> None:
    """Raise DataError unless `example` is a preference pair of one of the three forms."""
    if not isinstance(example, dict):
        raise DataError(f"a preference pair must be a JSON object, got "
                        f"{type(example).__name__}")
    extra = sorted(set(example) - {"prompt", "chosen", "rejected", "tools"})
    if extra or "chosen" not in example or "rejected" not in example:
        unpaired = " (a KTO example: --objective kto)" if "label" in example else ""
        raise DataError(f"a preference pair has 'chosen' and 'rejected' (and 'prompt', "
                        f"'tools'); this one has keys {sorted(example)}{unpaired}")
    if all(isinstance(example.get(k), str) for k in ("prompt", "chosen", "rejected")):
        if "tools" in example:
            raise DataError("'tools' goes with a conversational pair (lists of messages)")
        for key in ("prompt", "chosen", "rejected"):
            _need_unicode(example[key], f"'{key}'")
        return
    if isinstance(example.get("prompt"), str) or not all(
            isinstance(example[k], list) for k in ("chosen", "rejected")):
        raise DataError("a pair's prompt, chosen and rejected are all strings, or all lists "
                        "of messages ('prompt' may be left out: the answers' common start)")
    for key in ("prompt", "chosen", "rejected"):
        check_messages(example.get(key, []), f"'{key}' ")
    if "tools" in example:
        check_tools(example["tools"])
    prompt, chosen, rejected = conversation(example)
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in answer):
            raise DataError(f"the '{key}' answer has no assistant message after the prompt")


def conversation(example: dict) -> tuple[list, list, list]:
    """(prompt messages, chosen answer messages, rejected answer messages) of a
    conversational pair; without a prompt, the messages both answers start with."""
    chosen, rejected = example["chosen"], example["rejected"]
    if "prompt" in example:
        return example["prompt"], chosen, rejected
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def encode_pair(example: dict, tokenizer, template) -> tuple[Example, Example]:
    """The chosen and the rejected sequence, each its prompt and answer, only the answer
    trained."""
    if isinstance(example["chosen"], str):
        return tuple(encode_example({"prompt": example["prompt"], "completion": example[k]},
                                    tokenizer, template, mask_prompt=True)
                     for k in ("chosen", "rejected"))
    prompt, chosen, rejected = conversation(example)
    tools = {"tools": example["tools"]} if "tools" in example else {}
    return tuple(encode_example({"messages": prompt + answer, **tools}, tokenizer, template,
                                mask_prompt=True, answers_from=len(prompt))
                 for answer in (chosen, rejected))


def check_unpaired(example) -> None:
    """Raise DataError unless `example` is a KTO example (prompt, completion, label) or a
    preference pair (check_pair)."""
    if not isinstance(example, dict):
        raise DataError(f"a KTO example must be a JSON object, got {type(example).__name__}")
    if "label" not in example and "completion" not in example:
        return check_pair(example)
    extra = sorted(set(example) - {"prompt", "completion", "label", "tools"})
    if extra or not {"prompt", "completion", "label"} <= set(example):
        raise DataError(f"a KTO example has 'prompt', 'completion' and 'label' (and 'tools'), "
                        f"or is a preference pair; this one has keys {sorted(example)}")
    if not isinstance(example["label"], bool):
        raise DataError(f"a KTO example's 'label' is true (a good answer) or false, got "
                        f"{example['label']!r}")
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if "tools" in example:
            raise DataError("'tools' goes with a conversational KTO example (lists of "
                            "messages)")
        _need_unicode(prompt, "'prompt'")
        _need_unicode(completion, "'completion'")
    elif isinstance(prompt, list) and isinstance(completion, list):
        check_messages(prompt, "'prompt' ")
        check_messages(completion, "'completion' ")
        if "tools" in example:
            check_tools(example["tools"])
        if not any(m["role"] == "assistant" for m in completion):
            raise DataError("the 'completion' has no assistant message")
    else:
        raise DataError("a KTO example's prompt and completion are both strings or both "
                        "lists of messages")
    if not prompt:
        raise DataError("a KTO example's prompt must not be empty")


def unpaired(examples: list[dict]) -> list[dict]:
    """KTO examples of checked lines (check_unpaired): a pair's chosen answer labelled true
    and its rejected one false, in that order; KTO examples as they are."""
    out = []
    for e in examples:
        if "label" in e:
            out.append(e)
            continue
        tools = {"tools": e["tools"]} if "tools" in e else {}
        prompt, chosen, rejected = conversation(e) if isinstance(e["chosen"], list) else (
            e["prompt"], e["chosen"], e["rejected"])
        out += [{"prompt": prompt, "completion": chosen, "label": True, **tools},
                {"prompt": prompt, "completion": rejected, "label": False, **tools}]
    return out


def kto_pairs(examples: list[dict], group: int) -> tuple[list[dict], list[bool]]:
    """Each KTO example as a pair (chosen: its completion, rejected: the KL sample's, the
    completion of the example before it in its group of `group` in file order, the first
    taking the last's: TRL's mismatched pairs, made per batch of the data as it is read) and
    its label."""
    forms = {isinstance(e["prompt"], str) for e in examples}
    if len(forms) > 1:
        raise DataError("KTO examples are all strings or all conversations: a KL sample puts "
                        "one example's completion after another's prompt")
    out = []
    for start in range(0, len(examples), group):
        members = examples[start:start + group]
        for k, e in enumerate(members):
            out.append({"prompt": e["prompt"], "chosen": e["completion"],
                        "rejected": members[k - 1]["completion"],
                        **({"tools": e["tools"]} if "tools" in e else {})})
    return out, [e["label"] for e in examples]


def pack_pairs(spans, n_ctx: int) -> list[list[int]]:
    """Pairs whose chosen and rejected sequences fill these positions ((chosen, rejected)
    each <= n_ctx) in units of two rows of n_ctx, the chosen sequences one after another in
    the first row and the rejected ones in the second: chat.pack_rows's first-fit
    decreasing over both rows (the longest pair first, each into the first unit with room in
    both), so the same spans always give the same units. Returns each unit's pair indices in
    the order placed."""
    return pack_rows(np.asarray(spans, np.int64).reshape(-1, 2), n_ctx)


class PairBatches(RowBatches):
    """Shuffled batches of pairs in units of two rows of n_ctx: padded (pack False) a unit is
    one pair, its chosen sequence in the first row and its rejected one in the second; packed
    (pack True, `pack_pairs`) a unit holds several pairs, the chosen sequences one after
    another in its first row and the rejected ones in its second, each seeing only itself
    (chat.ExampleBatches' packing, in pairs of rows). pack "auto" packs when that makes
    fewer units than pairs. A batch is `batch` units (2 batch rows, each unit's two rows
    together) and the tuple

        (inputs, targets) (2 batch, n_ctx) as chat.ExampleBatches makes them,
        pairs (P,) the indices of the batch's pairs (P = batch when padded),
        reference (2 P,) their reference log-probabilities, chosen and rejected
            alternating, from `reference` (n_pairs, 2), None until it is set
            (training/preference.sequence_logps),
        sequences (2 batch, n_ctx) which sequence of the batch each position belongs to
            (2 i the chosen one of the batch's pair i, 2 i + 1 its rejected one; -1 for
            padding),
        labels (P,) the pairs' `labels` (KTO's: whether the chosen answer is good), None
            without them.

    A sequence longer than n_ctx + 1 tokens is cut (`truncated` counts the pairs), or with
    `drop_long` its pair left out; a pair with an answer of no trained token in its window
    is left out too (`dropped` counts both). `state()`/`load_state()` resume exactly."""

    def __init__(self, pairs: list[tuple[Example, Example]], n_ctx: int, batch: int,
                 seed: int, pad_id: int = 0, drop_long: bool = False, pack: bool | str = False,
                 labels=None):
        def fits(e):
            return len(e) <= n_ctx + 1
        keep = [i for i, p in enumerate(pairs) if (not drop_long or all(map(fits, p)))
                and all(e.trained[1:n_ctx + 1].any() for e in p)]
        kept = [pairs[i] for i in keep]
        self.labels = None if labels is None else np.asarray(labels, bool)[keep]
        self.dropped = len(pairs) - len(kept)
        self.truncated = sum(not all(map(fits, p)) for p in kept)
        if not kept:
            raise DataError(f"no preference pair has trained tokens in both answers within "
                            f"n_ctx {n_ctx} (of {len(pairs)} pairs)")
        if pack not in (True, False, "auto"):
            raise ValueError(f"pack must be True, False or 'auto', got {pack!r}")
        self.n_ctx, self.batch, self.n_pairs = int(n_ctx), int(batch), len(kept)
        spans = [[min(len(e), n_ctx + 1) - 1 for e in p] for p in kept]
        units = pack_pairs(spans, n_ctx) if pack else [[i] for i in range(len(kept))]
        if pack == "auto" and len(units) == len(kept):
            units = [[i] for i in range(len(kept))]
        self.packed = len(units) < len(kept) or pack is True
        self.units = units
        self.unit_pairs = max(map(len, units))   # the most pairs a unit holds (pair_slots)
        self.inputs = np.full((2 * len(units), n_ctx), pad_id, np.int32)
        self.targets = np.full((2 * len(units), n_ctx), IGNORE, np.int32)
        self.sequences = np.full((2 * len(units), n_ctx), -1, np.int32)
        for u, members in enumerate(units):
            for side in (0, 1):
                row, at = 2 * u + side, 0
                for j, i in enumerate(members):
                    end = place(kept[i][side], self.inputs[row], self.targets[row], at)
                    self.sequences[row, at:end] = 2 * j + side
                    at = end
        self._used = sum(map(sum, spans))
        self.order = EpochOrder(len(units), seed)
        self.reference = None

    @property
    def n_samples(self) -> int:
        """Units (a step of `batch` of them is an epoch's batch / n_samples): pairs when
        padded."""
        return len(self.units)

    @property
    def fill(self) -> float:
        """The share of the rows' positions that hold a sequence rather than padding."""
        return self._used / self.inputs.size

    def pair_slots(self, units: int) -> int:
        """The most pairs a batch of `units` units holds: the pair slots of its graph (a
        packed batch of fewer pairs fills the rest with its first pair, weighted 0)."""
        return units * self.unit_pairs

    def lengths(self) -> np.ndarray:
        """Each sequence's trained tokens (2 n_pairs,), chosen and rejected alternating."""
        out = np.zeros(2 * self.n_pairs, np.int64)
        for u, members in enumerate(self.units):
            for side in (0, 1):
                row = 2 * u + side
                counted = np.bincount(self.sequences[row][self.targets[row] != IGNORE],
                                      minlength=2 * len(members))
                out[2 * np.asarray(members) + side] = counted[side::2]
        return out

    def _rows(self, units):
        units = np.asarray(units, np.int64)
        rows = np.stack([2 * units, 2 * units + 1], axis=1).reshape(-1)
        counts = np.array([len(self.units[u]) for u in units])
        sequences = self.sequences[rows].copy()
        offsets = np.repeat(2 * (np.cumsum(counts) - counts), 2)     # each unit's first
        sequences += np.where(sequences >= 0, offsets[:, None], 0)
        pairs = np.concatenate([self.units[u] for u in units]).astype(np.int64)
        reference = None if self.reference is None else self.reference[pairs].reshape(-1)
        labels = None if self.labels is None else self.labels[pairs]
        return self.inputs[rows], self.targets[rows], pairs, reference, sequences, labels

    def in_order(self, limit: int | None = None):
        """Batches of the units in order, the same every time (for evaluation and the
        reference log-probabilities): at most `limit` batches; the last one filled up by
        repeating units, whose pairs its third element (the pairs) marks with -1."""
        n = self.n_samples if limit is None else min(self.n_samples, limit * self.batch)
        for start in range(0, n, self.batch):
            units = np.arange(start, start + self.batch)
            inputs, targets, pairs, reference, sequences, labels = self._rows(units % n)
            repeated = np.concatenate([[u >= n] * len(self.units[u % n]) for u in units])
            yield (inputs, targets, np.where(repeated, -1, pairs), reference, sequences,
                   labels)

    def next_batch(self):
        return self._rows(self.order.take(self.batch))

    def state(self) -> dict:
        return {"version": STATE_VERSION, **self.order.state(), "n_samples": self.n_samples,
                "n_pairs": self.n_pairs, "n_ctx": self.n_ctx, "packed": self.packed}

    def load_state(self, state: dict) -> None:
        try:
            same = (int(state["version"]), int(state["n_samples"]),
                    int(state.get("n_pairs", state["n_samples"])), int(state["n_ctx"]),
                    state["packed"]) == (STATE_VERSION, self.n_samples, self.n_pairs,
                                         self.n_ctx, self.packed)
        except (KeyError, TypeError, ValueError):
            same = False
        if not same:
            raise DataError(f"the saved pair order does not fit these pairs: resume with the "
                            f"same data, vocabulary, n_ctx and packing ({state!r})")
        self.order.load_state(state)
