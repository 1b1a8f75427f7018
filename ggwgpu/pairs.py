"""Preference data: JSONL lines of a prompt and two answers, the chosen and the rejected one,
in the forms TRL documents:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                   standard
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}    conversational
    {"chosen": [messages], "rejected": [messages]}       implicit prompt: their common start

A file or a directory of splits, as chat data (chat.load_dataset). Each answer is encoded as
a chat example of the prompt and that answer (chat.encode_example: through the chat
template, a string prompt a user turn and a string answer the assistant's), and only the
answer's tokens are trained. `PairBatches` makes batches of pairs for the preference losses
(training/preference.py): row 2i of a batch the chosen sequence of its pair i, row 2i + 1
the rejected one.
"""
from __future__ import annotations

import json

import numpy as np

from .chat import (IGNORE, ROLES, STATE_VERSION, Example, RowBatches, _need_unicode,
                   encode_example, place)
from .data import DataError, EpochOrder


def check_pair(example) -> None:
    """Raise DataError unless `example` is a preference pair of one of the three forms."""
    if not isinstance(example, dict):
        raise DataError(f"a preference pair must be a JSON object, got "
                        f"{type(example).__name__}")
    extra = sorted(set(example) - {"prompt", "chosen", "rejected"})
    if extra or "chosen" not in example or "rejected" not in example:
        raise DataError(f"a preference pair has 'chosen' and 'rejected' (and 'prompt'); this "
                        f"one has keys {sorted(example)}")
    if all(isinstance(example.get(k), str) for k in ("prompt", "chosen", "rejected")):
        for key in ("prompt", "chosen", "rejected"):
            _need_unicode(example[key], f"'{key}'")
        return
    if isinstance(example.get("prompt"), str) or not all(
            isinstance(example[k], list) for k in ("chosen", "rejected")):
        raise DataError("a pair's prompt, chosen and rejected are all strings, or all lists "
                        "of messages ('prompt' may be left out: the answers' common start)")
    for key in ("prompt", "chosen", "rejected"):
        for i, m in enumerate(example.get(key, [])):
            if not isinstance(m, dict) or m.get("role") not in ROLES \
                    or not isinstance(m.get("content"), str):
                raise DataError(f"'{key}' message {i} must be {{\"role\": one of "
                                f"{', '.join(ROLES)}, \"content\": a string}}, got "
                                f"{json.dumps(m)[:80]}")
            _need_unicode(m["content"], f"'{key}' message {i}'s content")
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
    return tuple(encode_example({"messages": prompt + answer}, tokenizer, template,
                                mask_prompt=True, answers_from=len(prompt))
                 for answer in (chosen, rejected))


class PairBatches(RowBatches):
    """Shuffled batches of `batch` pairs, one sequence a row (padded): (inputs, targets)
    (2 batch, n_ctx) as chat.ExampleBatches makes them, row 2i chosen and 2i + 1 rejected,
    the pairs' indices (batch,), and their reference log-probabilities (2 batch,) from
    `reference` (n_pairs, 2), None until it is set (training/preference.sequence_logps). A
    sequence longer than n_ctx + 1 tokens is cut (`truncated` counts the pairs), or with
    `drop_long` its pair left out; a pair with an answer of no trained token in its window
    is left out too (`dropped` counts both). `state()`/`load_state()` resume exactly."""

    packed = False

    def __init__(self, pairs: list[tuple[Example, Example]], n_ctx: int, batch: int,
                 seed: int, pad_id: int = 0, drop_long: bool = False):
        def fits(e):
            return len(e) <= n_ctx + 1
        kept = [p for p in pairs if (not drop_long or all(map(fits, p)))
                and all(e.trained[1:n_ctx + 1].any() for e in p)]
        self.dropped = len(pairs) - len(kept)
        self.truncated = sum(not all(map(fits, p)) for p in kept)
        if not kept:
            raise DataError(f"no preference pair has trained tokens in both answers within "
                            f"n_ctx {n_ctx} (of {len(pairs)} pairs)")
        self.n_ctx, self.batch, self.n_pairs = int(n_ctx), int(batch), len(kept)
        self.inputs = np.full((2 * len(kept), n_ctx), pad_id, np.int32)
        self.targets = np.full((2 * len(kept), n_ctx), IGNORE, np.int32)
        for row, e in enumerate(e for p in kept for e in p):
            place(e, self.inputs[row], self.targets[row])
        self.order = EpochOrder(len(kept), seed)
        self.reference = None

    @property
    def n_samples(self) -> int:
        """Pairs (a step of `batch` of them is an epoch's batch / n_samples)."""
        return self.n_pairs

    def lengths(self) -> np.ndarray:
        """Each sequence's trained tokens (2 n_pairs,), chosen and rejected alternating."""
        return (self.targets != IGNORE).sum(axis=1)

    def _rows(self, pairs):
        pairs = np.asarray(pairs, np.int64)
        rows = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
        reference = None if self.reference is None else self.reference[pairs].reshape(-1)
        return self.inputs[rows], self.targets[rows], pairs, reference

    def in_order(self, limit: int | None = None):
        """Batches of the pairs in order, the same every time (for evaluation and the
        reference log-probabilities): at most `limit` batches; the last one filled up by
        repeating pairs, which its third element (the pairs) marks with -1."""
        n = self.n_pairs if limit is None else min(self.n_pairs, limit * self.batch)
        for start in range(0, n, self.batch):
            pairs = np.arange(start, start + self.batch)
            inputs, targets, _, reference = self._rows(pairs % n)
            yield inputs, targets, np.where(pairs < n, pairs, -1), reference

    def next_batch(self):
        return self._rows(self.order.take(self.batch))

    def state(self) -> dict:
        return {"version": STATE_VERSION, **self.order.state(), "n_samples": self.n_pairs,
                "n_ctx": self.n_ctx, "packed": False}

    def load_state(self, state: dict) -> None:
        try:
            same = (int(state["version"]), int(state["n_samples"]), int(state["n_ctx"]),
                    state["packed"]) == (STATE_VERSION, self.n_pairs, self.n_ctx, False)
        except (KeyError, TypeError, ValueError):
            same = False
        if not same:
            raise DataError(f"the saved pair order does not fit these pairs: resume with the "
                            f"same data, vocabulary and n_ctx ({state!r})")
        self.order.load_state(state)
