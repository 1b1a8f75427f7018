"""Training text and training samples, as llama.cpp's train-text-from-scratch makes them.

The whole text is tokenized once (no BOS). A sample is the n_ctx tokens starting at some
position s; its input is [BOS, t_s, ..., t_{s+n_ctx-2}] and its targets t_s ... t_{s+n_ctx-1}
(each position predicts the token it has not yet seen). `Samples` shuffles the start
positions with the seed, reshuffles every epoch, and hands out batches; its `state()`
resumes it exactly.

The bundled corpus is two plays of William Shakespeare, ggwgpu/data/macbeth.txt and
tempest.txt (public domain; the Project Gutenberg plain-text editions without the Gutenberg
header and license): "shakespeare" is Macbeth followed by The Tempest, each play alone is
there too (a base model trained on one, finetuned on the other).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from .files import read_limited

BUNDLED = {"shakespeare": ("macbeth", "tempest"), "macbeth": ("macbeth",),
           "tempest": ("tempest",)}      # name -> files data/<file>.txt in the package
STATE_VERSION = 1


class DataError(ValueError):
    """Training text or samples that cannot be used; the message names the file or the
    numbers at fault, ready to show a user (e.g. as a click.UsageError)."""


# -- text ------------------------------------------------------------------------------------

def read_text(path) -> str:
    """One UTF-8 text file, exactly as stored (no newline translation, a BOM is kept). Only
    a regular file of at most ggwgpu.files' bound ($GGWGPU_MAX_TEXT_BYTES, 256 MiB unless
    set) is read: a FIFO, a device or a bigger file is a DataError saying so."""
    path = Path(path)
    data = read_limited(path, DataError)
    if not data:
        raise DataError(f"{path}: is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: not valid UTF-8 at byte offset {e.start} (line {line}): "
                        f"{e.reason}, byte 0x{data[e.start]:02X}") from None


def read_texts(paths) -> str:
    """The given UTF-8 text files concatenated in the given order, with nothing put between
    them (end a file with a newline to keep its last line apart from the next file's first).
    A single path may be passed as well. Raises DataError naming the file that is missing,
    a directory, empty or not valid UTF-8 (with the byte offset)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise DataError("no text files given")
    return "".join(read_text(p) for p in paths)


def bundled_corpus(name: str = "shakespeare") -> str:
    """A public-domain text shipped inside the package: "shakespeare" (~200 KB of ASCII),
    "macbeth" or "tempest" (its two halves)."""
    if name not in BUNDLED:
        raise DataError(f"no bundled text {name!r}: {', '.join(BUNDLED)}")
    data = resources.files("ggwgpu").joinpath("data")
    return "".join(data.joinpath(f"{f}.txt").read_text(encoding="utf-8") for f in BUNDLED[name])


# -- samples ---------------------------------------------------------------------------------

class EpochOrder:
    """The order in which n items are drawn: epoch e is a permutation seeded with (seed, e),
    and a draw that runs past the end of an epoch goes on with the next epoch's order, so
    (seed, epoch, position) is the whole state."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.position = int(n), int(seed), 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    @property
    def progress(self) -> float:
        """Epochs done, with the fraction of the current one."""
        return self.epoch + self.position / self.n

    def take(self, count: int) -> np.ndarray:
        """The indices of the next `count` items (advances the state)."""
        out = []
        while count > 0:
            step = min(count, self.n - self.position)
            out.append(self._order[self.position:self.position + step])
            self.position += step
            count -= step
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return np.concatenate(out)

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        """Continue from `state()`; a DataError when it is malformed or out of range."""
        try:
            seed, epoch, pos = int(state["seed"]), int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"not a sample-order state: {state!r} ({e})") from None
        if seed < 0 or epoch < 0 or not 0 <= pos < self.n:
            raise DataError(f"sample-order state out of range: {state!r}")
        self.seed, self.epoch, self.position = seed, epoch, pos
        self._order = self._permutation(epoch)


class Samples:
    """Shuffled n_ctx-token training windows of a token stream, in batches.

    Every start position s with s + n_ctx <= len(tokens) is a sample; with `after_newline`
    only the line starts are: s = 0 and every s right after a token in `newline_ids` (the
    ids of the tokens that end with "\\n", e.g. `tokenizer.newline_ids`).

    The order of epoch e is a permutation drawn by numpy's Generator seeded with (seed, e),
    so (seed, epoch, position) is the whole state: `state()` / `load_state()` resume
    exactly. A batch that runs past the end of an epoch continues with the next epoch's
    order.
    """

    def __init__(self, tokens, n_ctx: int, batch: int, seed: int, bos_id: int,
                 after_newline: bool = False, newline_ids=None):
        tokens = np.ascontiguousarray(np.asarray(tokens).reshape(-1), dtype=np.int32)
        n_ctx, batch, seed, bos_id = int(n_ctx), int(batch), int(seed), int(bos_id)
        if n_ctx < 1:
            raise DataError(f"n_ctx must be at least 1, got {n_ctx}")
        if batch < 1:
            raise DataError(f"batch must be at least 1, got {batch}")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        if len(tokens) < n_ctx:
            raise DataError(f"the text has {len(tokens)} tokens, but n_ctx {n_ctx} needs at "
                            f"least {n_ctx} for one sample: give more text or a smaller n_ctx")
        last = len(tokens) - n_ctx                  # the last possible start
        if after_newline:
            if newline_ids is None:
                raise DataError("after_newline needs newline_ids, the token ids of \"\\n\"")
            nl = np.atleast_1d(np.asarray(newline_ids, dtype=np.int64))
            after = np.flatnonzero(np.isin(tokens[:last], nl)) + 1
            if len(after) == 0:
                raise DataError(
                    f"no sample starts after a newline: none of the newline tokens "
                    f"{nl.tolist()} occurs in the first {last} of the text's {len(tokens)} "
                    f"tokens (n_ctx {n_ctx}); give text with more lines or drop "
                    f"the newline option")
            starts = np.concatenate([[0], after])
        else:
            starts = np.arange(last + 1)
        self.tokens = tokens
        self.starts = starts.astype(np.int64)
        self.n_ctx, self.batch, self.bos_id = n_ctx, batch, bos_id
        self.after_newline = bool(after_newline)
        self.order = EpochOrder(len(self.starts), seed)

    @property
    def n_samples(self) -> int:
        return len(self.starts)

    @property
    def epoch(self) -> float:
        """Epochs done, with the fraction of the current one (1.5: half-way through the
        second)."""
        return self.order.progress

    def next_starts(self, count: int) -> np.ndarray:
        """The start positions of the next `count` samples (advances the state)."""
        return self.starts[self.order.take(count)]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets): int32 arrays (batch, n_ctx); inputs = [BOS, t_s .. t_{s+n_ctx-2}],
        targets = t_s .. t_{s+n_ctx-1}."""
        return self.windows(self.next_starts(self.batch))

    def windows(self, starts) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of the samples at these start positions."""
        targets = self.tokens[np.asarray(starts)[:, None] + np.arange(self.n_ctx)]
        inputs = np.empty_like(targets)
        inputs[:, 0] = self.bos_id
        inputs[:, 1:] = targets[:, :-1]
        return inputs, targets

    def state(self) -> dict:
        """JSON-serialisable position in the sample order; `load_state` resumes from it."""
        return {"version": STATE_VERSION, **self.order.state(), "n_samples": self.n_samples,
                "n_ctx": self.n_ctx}

    def load_state(self, state: dict) -> None:
        """Continue from `state()`: the following batches are exactly those a run that never
        stopped would have got. The state's seed replaces the constructor's. The samples must
        be the same (same text, tokenizer, n_ctx and newline option); the batch size may
        differ."""
        try:
            version = int(state["version"])
            n_samples, n_ctx = int(state["n_samples"]), int(state["n_ctx"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"not a sample-order state: {state!r} ({e})") from None
        if version != STATE_VERSION:
            raise DataError(f"sample-order state version {version} is not supported "
                            f"(this ggwgpu writes version {STATE_VERSION})")
        if (n_samples, n_ctx) != (self.n_samples, self.n_ctx):
            raise DataError(
                f"the saved sample order is for {n_samples} samples of n_ctx {n_ctx}, but "
                f"this data has {self.n_samples} samples of n_ctx {self.n_ctx}: resume with "
                f"the same text, vocabulary, n_ctx and newline option")
        self.order.load_state(state)
