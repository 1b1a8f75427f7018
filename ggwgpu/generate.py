"""Text generation: a llama with a KV cache on any backend, sampled on the host.

    decoder = Decoder(backend, cfg, values)          # plans its graphs as runs need them
    text = generate(backend, cfg, values, tokenizer, "ROMEO:", 100, seed=1)

`Decoder` runs the model: `prefill(tokens)` puts a window of tokens into the cache in runs
of a graph that takes several tokens at once (the smallest of PREFILL_SIZES that holds them,
else chunks of the largest) and `step(token)` appends one token with a one-token graph (see
`build_decode_graph` for how the cache works with static views); each gives the logits of
its last token, the only thing read back.

Sampling follows llama.cpp's sampler chain and its defaults on those logits, in NumPy: repeat
penalty over the last `repeat_last_n` tokens of the context (default 1.0: off), then top-k
(40), then top-p (0.95: nucleus, on the softmax of what top-k kept), then min-p (0.05: keep
the tokens at least that fraction as likely as the most likely one), then a softmax at the
temperature (0.8) and one draw from numpy.random.default_rng(seed). Temperature <= 0 is
greedy: the most likely token after the repeat penalty (the lowest id on ties), whatever
the seed.

Context limit: the model saw windows of n_ctx tokens that start with BOS at position 0 (see
data.Samples). When the window is full, generation slides: the window becomes BOS plus the
last max_ctx // 2 tokens and is recomputed in one prefill, at positions from 0 again
(llama.cpp's context shift with n_keep = BOS, but recomputed rather than re-roped, so every
logit is exactly the model's on a window it could have been trained on). A prompt longer
than the window is cut the same way. Generation stops at any end-of-generation token
(`tokenizer.eog_ids`: eos, eot, <|im_end|>, <|eot_id|>, ... as llama.cpp) or after n tokens.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .backends import precision_for
from .backends.base import DeviceLimitError, planned_bytes, same_storage
from .memory import PREFILL_CHUNK
from .models import ModelConfig, build_decode_graph, half_values
from .tensor import ShapeError
from .tokenizer import Tokenizer, VocabError


# The sizes (tokens a run takes) of the decoder's graphs for several tokens, each capped at
# max_ctx. A run costs its graph's whole size, padding included: a chat turn of a few dozen
# tokens takes the small one rather than a whole window, and more tokens go in chunks of
# the large one (llama.cpp's default micro-batch), never one graph of max_ctx tokens (a
# 2048-token context cost 3.7x the time per chat turn that way).
PREFILL_SIZES = (64, PREFILL_CHUNK)
# The cache rows a graph reads (its span): a run takes the graph of the smallest span that
# holds its positions, so that it costs what the filled part of the cache asks for rather
# than the whole window (--n-ctx 8192 decoded at half the speed of 512 that way). Spans
# FIRST_SPAN, 4 times that, ..., then the window.
FIRST_SPAN = 512


def attention_spans(max_ctx: int) -> list[int]:
    spans, span = [], FIRST_SPAN
    while span < max_ctx:
        spans.append(span)
        span *= 4
    return spans + [max_ctx]


# -- sampling ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """llama.cpp's sampling parameters (its defaults). top_k <= 0, top_p >= 1 and min_p <= 0
    turn those filters off; repeat_penalty 1 or repeat_last_n 0 turn the penalty off."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    min_p: float = 0.05


def apply_repeat_penalty(logits: np.ndarray, recent, penalty: float) -> np.ndarray:
    """llama.cpp's repetition penalty: each distinct token of `recent` has its logit divided
    by `penalty` if positive, multiplied by it otherwise (so it always becomes less likely
    for penalty > 1). Returns a new array."""
    out = np.array(logits, np.float64)
    ids = np.unique(np.asarray(recent, np.int64))
    if penalty != 1.0 and len(ids):
        hit = out[ids]
        out[ids] = np.where(hit > 0, hit / penalty, hit * penalty)
    return out


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """The logits with -inf everywhere but the k largest (ties: the lower ids are kept);
    k <= 0 or k >= len(logits) keeps all."""
    logits = np.asarray(logits, np.float64)
    if k <= 0 or k >= len(logits):
        return logits.copy()
    keep = np.argsort(-logits, kind="stable")[:k]
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    e = np.exp(logits - np.max(logits))
    return e / e.sum()


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filtering as llama.cpp: the most likely tokens (by the softmax of `logits`)
    whose probabilities first reach a sum >= p are kept, at least one; the others get -inf.
    p >= 1 keeps all."""
    logits = np.asarray(logits, np.float64)
    if p >= 1.0:
        return logits.copy()
    order = np.argsort(-logits, kind="stable")
    cum = np.cumsum(softmax(logits)[order])
    n_keep = min(int(np.searchsorted(cum, p)) + 1, len(order))   # first index with cum >= p
    out = np.full_like(logits, -np.inf)
    out[order[:n_keep]] = logits[order[:n_keep]]
    return out


def min_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """llama.cpp's min-p: the tokens whose probability is below p times the largest get -inf
    (on logits: below max + log p). p <= 0 keeps all."""
    logits = np.asarray(logits, np.float64)
    if p <= 0.0:
        return logits.copy()
    return np.where(logits >= np.max(logits) + np.log(p), logits, -np.inf)


class NonFiniteLogits(ValueError):
    """The model's logits hold inf or NaN: finite weights (the readers refuse others) whose
    activations overflow the type they are computed in. No token can be sampled from them."""


def sample_token(logits: np.ndarray, recent, s: Sampling, rng: np.random.Generator,
                 precision: str = "f32") -> int:
    """One token id from `logits` (n_vocab,) after the sampler chain (module docstring);
    `recent` are the context's token ids, the last s.repeat_last_n of which are penalised.
    `precision` is the activations' type, named when the logits are not finite."""
    if not np.isfinite(logits).all():
        kind = "halves (--precision f16)" if precision == "f16" else "float32"
        raise NonFiniteLogits(f"{int((~np.isfinite(logits)).sum())} of the {len(logits)} "
                              f"logits are not finite: the model's values overflow {kind}")
    recent = list(recent)[-s.repeat_last_n:] if s.repeat_last_n > 0 else []
    logits = apply_repeat_penalty(logits, recent, s.repeat_penalty)
    if s.temperature <= 0:
        return int(np.argmax(logits))
    logits = min_p_filter(top_p_filter(top_k_filter(logits, s.top_k), s.top_p), s.min_p)
    probs = softmax(logits / s.temperature)
    return int(rng.choice(len(probs), p=probs))


# -- the model ----------------------------------------------------------------------------------

class Decoder:
    """A llama as a next-token function: a KV cache of max_ctx positions (default n_ctx) and
    plans on `backend`, each made on its first run: for each span of attention_spans (the
    cache rows a graph reads), a one-token graph for steps (`steps`) and a graph of each of
    PREFILL_SIZES (capped at max_ctx) for runs of several tokens (`prefills`); a short
    conversation in a large window plans only the first span's. The graphs' weights are
    constants made from the same `values` arrays, and their caches and recurrent states are
    built on one `state` dict, so the backend holds each once for all plans
    (base.SharedConstants): a run of any plan writes the cache the others read.
    `tokens` are the ids the cache holds (positions 0 .. past - 1); they change only when a
    prefill or step is complete, so an interrupted one leaves a usable cache (a recurrent
    model's states cannot tell: it then starts over).
    A recurrent model's states cannot go back either: `sync` to tokens that share less than
    the cache holds starts over, or from the snapshot of the states that `keep_states_at`
    asked for where the tokens begin with the snapshot's (a chat turn's: ChatSession).
    `adapters` (ggwgpu.lora.Adapter) add their LoRA pairs, as llama.cpp's --lora does.
    `precision` (backends.precision_for: auto, f32, f16): f16 keeps float weights,
    activations and the cache in halves."""

    def __init__(self, backend, cfg: ModelConfig, values: dict, max_ctx: int | None = None,
                 adapters=(), precision: str = "f32"):
        self.cfg = cfg
        self.max_ctx = int(max_ctx or cfg.n_ctx)
        if self.max_ctx < 2:
            raise ValueError(f"generation needs a context of at least 2 tokens, got "
                             f"{self.max_ctx}")
        self.precision = precision_for(backend, precision)
        if self.precision == "f16":
            values = half_values(values)
        self.sizes = sorted({min(size, self.max_ctx) for size in PREFILL_SIZES})
        self.spans = attention_spans(self.max_ctx)
        self._build = functools.partial(build_decode_graph, cfg, values,
                                        max_ctx=self.max_ctx, adapters=adapters,
                                        precision=self.precision, scratch=self.sizes[-1],
                                        state={})
        self._backend = backend
        self.steps = {}         # span -> (graph, plan), planned when first run
        self.prefills = {}      # (tokens a run takes, span) -> (graph, plan), as steps
        self._too_big = set()   # (tokens, span) that the device's limits refused
        self._holder = self._step(self.spans[0])    # the graph and plan that ran last
        self.tokens: list[int] = []     # in the cache
        self._snapshot_at = None    # the position after which the next run keeps a snapshot
        self._snapshot = None       # (tokens, the recurrent states' values after them)

    def _planned(self, n_tokens: int, span: int):
        graph = self._build(n_tokens, span=span)
        return graph, self._backend.plan(graph.outputs, shared=graph.kept)

    def _step(self, span: int):
        """(graph, plan) of a step reading `span` rows, planned the first time."""
        if span not in self.steps:
            self.steps[span] = self._planned(1, span)
        return self.steps[span]

    def _prefill(self, size: int, span: int):
        """(tokens, graph, plan) of a prefill of `size` tokens reading `span` rows, planned
        the first time; fewer tokens (halved) where a run's tensors (its attention scores:
        heads x tokens x span) would pass the device's limits (a storage binding of 128
        MiB)."""
        while (size, span) not in self.prefills:
            if (size, span) in self._too_big:
                size //= 2
                continue
            try:
                self.prefills[size, span] = self._planned(size, span)
            except DeviceLimitError:
                if size == 1:
                    raise
                self._too_big.add((size, span))
        return (size, *self.prefills[size, span])

    @property
    def plans(self) -> list:
        """The plans made so far (each on its first run)."""
        return [plan for _, plan in (*self.steps.values(), *self.prefills.values())]

    def memory(self) -> int:
        """The bytes of storage the plans take, what they share counted once."""
        return planned_bytes(self.plans)

    @property
    def past(self) -> int:
        return len(self.tokens)

    def prefill(self, tokens) -> np.ndarray:
        """Start over with `tokens` (1 .. max_ctx ids) at positions 0 ..; the logits of the
        last one, (n_vocab,)."""
        self.tokens = []
        return self._run_prefill(tokens)

    def step(self, token: int) -> np.ndarray:
        """Append one token at position `past`; its logits, (n_vocab,)."""
        if self.past >= self.max_ctx:
            raise ValueError(f"the cache is full ({self.max_ctx} positions): prefill a window")
        graph, plan = self._step(self._span(self.past + 1))
        with self._states_kept():
            self._run(graph, plan, [token], self.past)
        self.tokens = self.tokens + [int(token)]
        self._keep_snapshot(self.tokens)
        return plan.read(graph.logits)[0]

    def append(self, tokens) -> np.ndarray:
        """Append `tokens` at positions past, past + 1, ... (at most max_ctx in all); the
        logits of the last one. One token is a step, more are a prefill at that offset."""
        tokens = [int(t) for t in np.atleast_1d(tokens)]
        if len(tokens) == 1:
            return self.step(tokens[0])
        return self._run_prefill(tokens)

    def sync(self, tokens) -> np.ndarray:
        """Make the cache hold `tokens` (1 .. max_ctx ids) and return the logits of the last:
        the cached positions that already hold the same ids are kept (all but the last token
        at most, whose logits are wanted), the rest is appended. What a chat turn or a slid
        window costs is thus only what changed."""
        tokens = [int(t) for t in tokens]
        keep = len(os.path.commonprefix([self.tokens, tokens[:-1]]))
        if self.has_states:     # a recurrent state cannot go back, but to a snapshot
            start = self._snapshot_start(tokens)
            if keep < self.past or start > keep:
                self.tokens = []
                if start:
                    self._restore_snapshot()
                keep = start
        self.tokens = self.tokens[:keep]    # rows past `keep` are masked and overwritten
        return self.append(tokens[keep:])

    def keep_states_at(self, position: int):
        """Have the run that brings the cache to `position` tokens keep a snapshot of the
        recurrent states there (nothing for a model without them): a later `sync` to
        tokens that begin with the same `position` ones goes back to it rather than
        starting over. A chat turn's prompt up to its generation prompt, which the next
        turn's shares where a thinking model's answer does not (its reasoning is dropped).
        One snapshot at a time; a run that rewrites positions before it drops it."""
        if self.has_states:
            self._snapshot_at = int(position)

    @property
    def has_states(self) -> bool:
        """Whether the model has recurrent states (which cannot go back but to a snapshot)."""
        return bool(self._holder[0].states)

    def _keep_snapshot(self, tokens):
        """After a run that brought the cache to `tokens`: the snapshot asked for there."""
        if self._snapshot_at == len(tokens):
            graph, plan = self._holder
            self._snapshot = (list(tokens), plan.read_many(graph.states))
            self._snapshot_at = None

    def _snapshot_start(self, tokens) -> int:
        """The snapshot's length where `tokens` begin with its tokens and go on past them,
        else 0."""
        if self._snapshot is None:
            return 0
        kept = self._snapshot[0]
        return len(kept) if len(kept) < len(tokens) and tokens[:len(kept)] == kept else 0

    def _restore_snapshot(self):
        """The recurrent states of the snapshot, in the storage every plan shares."""
        graph, plan = self._holder
        for leaf, value in zip(graph.states, self._snapshot[1]):
            plan.write(leaf, value, everywhere=True)
        self.tokens = list(self._snapshot[0])

    def _run_prefill(self, tokens) -> np.ndarray:
        """Append `tokens` (1 or more) in runs of the smallest prefill size that holds them
        all, else in chunks of the largest, each of the smallest span that holds its
        positions; the logits of the last."""
        tokens = [int(t) for t in np.atleast_1d(tokens)]
        if self.past + len(tokens) > self.max_ctx:      # before any run changes a cache
            raise ShapeError(f"positions {self.past} .. {self.past + len(tokens) - 1} do not "
                             f"fit a cache of {self.max_ctx}")
        with self._states_kept():
            at = 0
            while at < len(tokens):
                left = len(tokens) - at
                if 0 < (self._snapshot_at or 0) - self.past - at < left:
                    left = self._snapshot_at - self.past - at   # a run ends at the snapshot
                size = next((n for n in self.sizes if n >= left), self.sizes[-1])
                span = self._span(max(self.past + at + min(left, size), size))
                size, graph, plan = self._prefill(size, span)
                count = min(size, left)
                self._run(graph, plan, tokens[at:at + count], self.past + at)
                at += count
                self._keep_snapshot(self.tokens + tokens[:at])
        self.tokens = self.tokens + tokens
        return plan.read(graph.logits)[0]

    def _span(self, end: int) -> int:
        """The smallest span that holds positions 0 .. end - 1."""
        return next(span for span in self.spans if span >= end)

    def _run(self, graph, plan, tokens, past: int):
        """One run of `plan`, after the leaves kept from run to run reach it from the plan
        that ran last (nothing to copy where they share them, as a Decoder's plans do)."""
        held_graph, held_plan = self._holder
        if held_plan is not plan:
            move_kept(held_plan, held_graph, plan, graph)
            self._holder = graph, plan
        if self._snapshot is not None and past < len(self._snapshot[0]):
            self._snapshot = None   # the cache rows it relies on are rewritten
        plan.run(graph.feeds(tokens, past))

    @contextlib.contextmanager
    def _states_kept(self):
        """Runs that change the recurrent states in place: when they stop part way, the
        states hold no prefix of `tokens` any more, so the next run starts over."""
        try:
            yield
        except BaseException:
            if self.has_states:
                self.tokens = []
            raise


def move_kept(plan, graph, to_plan, to_graph):
    """Hand the leaves `graph` keeps from run to run in `plan` (DecodeGraph.kept: caches,
    recurrent states) to `to_graph`'s in `to_plan`, where the two plans do not hold them in
    common (a Decoder's plans do, but on a backend that shares nothing)."""
    for leaf, to_leaf in zip(graph.kept, to_graph.kept):
        if not same_storage(plan, leaf, to_plan, to_leaf):
            to_plan.write(to_leaf, plan.read(leaf))


def window(context: list[int], bos_id, max_ctx: int) -> list[int]:
    """The tokens the model sees for `context` (BOS first when the tokenizer has one): all
    of them if they fit in max_ctx, else BOS plus the last max_ctx // 2."""
    head = [bos_id] if bos_id is not None else []
    body = context[1:] if head and context[:1] == head else context
    if len(head) + len(body) <= max_ctx:
        return head + body
    return head + body[len(body) - max_ctx // 2:]


def generate_tokens(decoder: Decoder, prompt_ids, n: int, sampling: Sampling = Sampling(),
                    seed: int = 0, bos_id: int | None = None,
                    eog_ids=(), fit=None) -> Iterator[int]:
    """Sampled token ids, one at a time, after `prompt_ids` (BOS included if wanted): at
    most n (< 0: no limit), ending early at any of `eog_ids` (an int or a collection; not
    yielded). Deterministic for a given seed (an int, or a numpy Generator to go on drawing from).
    `fit(context)` gives the window the model sees of the context (prompt and tokens so far)
    at the start and whenever the cache is full (default: `window`); the cache keeps what
    it shares with the previous one (`Decoder.sync`)."""
    stop = {eog_ids} if isinstance(eog_ids, (int, np.integer)) else set(eog_ids or ())
    rng = np.random.default_rng(seed)
    context = [int(t) for t in prompt_ids]
    if not context:
        raise ValueError("the prompt has no tokens (and the tokenizer no BOS to start with)")
    if n == 0:
        return
    fit = fit or (lambda ids: window(ids, bos_id, decoder.max_ctx))
    logits = decoder.sync(fit(context))
    for i in range(n) if n > 0 else itertools.count():
        if i:   # the logits after the last token, computed only when another is wanted
            if decoder.past < decoder.max_ctx:
                logits = decoder.step(context[-1])
            else:
                logits = decoder.sync(fit(context))
        token = sample_token(logits, context, sampling, rng, decoder.precision)
        if token in stop:
            return
        context.append(token)
        yield token


def prompt_tokens(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's ids as llama.cpp's CLI makes them: BOS first if the vocabulary adds one
    (add_bos), special tokens ("<|im_start|>", ...) recognised in the text."""
    return [int(t) for t in tokenizer.encode(prompt, parse_special=True, add_special=True)]


def context_bos(tokenizer: Tokenizer) -> int | None:
    """The BOS that starts every window (`window`): the vocabulary's, if it adds one."""
    return tokenizer.bos_id if tokenizer.add_bos else None


class TextStream:
    """Decodes a growing token sequence into text pieces safe to print as they come: text
    that ends in an incomplete UTF-8 character (byte tokens) waits for the next token."""

    def __init__(self, tokenizer: Tokenizer, ids=()):
        self.tokenizer, self.ids, self.shown = tokenizer, list(ids), ""

    def push(self, *ids: int) -> str:
        """The new printable text after adding `ids` (none: the text of the ids so far)."""
        self.ids.extend(int(i) for i in ids)
        return self._advance(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> str:
        """Whatever is left, replacement characters included."""
        return self._advance(self.tokenizer.decode(self.ids))

    def _advance(self, text: str) -> str:
        # decoding more tokens only appends to the text (pieces decode one by one); should a
        # vocabulary ever change earlier text, what was printed stays and the rest follows
        same = len(os.path.commonprefix([self.shown, text]))
        new, self.shown = text[same:], text
        return new


def generate(backend, cfg: ModelConfig, values: dict, tokenizer: Tokenizer, prompt: str, n: int,
             temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
             repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0,
             decoder: Decoder | None = None, min_p: float = 0.05) -> str:
    """The text the model writes after `prompt` (the prompt itself not included): up to n
    tokens, sampled as the module docstring says. Pass a `decoder` made for the same
    cfg/values to reuse its plans across calls."""
    decoder = decoder or Decoder(backend, cfg, values)
    ids = prompt_tokens(tokenizer, prompt)
    stream = TextStream(tokenizer, ids)
    stream.push()
    sampling = Sampling(temperature, top_k, top_p, repeat_penalty, repeat_last_n, min_p)
    pieces = [stream.push(t) for t in generate_tokens(decoder, ids, n, sampling, seed,
                                                      context_bos(tokenizer),
                                                      tokenizer.eog_ids)]
    return "".join(pieces) + stream.finish()


# -- chat -------------------------------------------------------------------------------------

class ChatSession:
    """A conversation with a model through its chat template (ggwgpu.chat.ChatTemplate),
    the KV cache kept across turns.

    Each reply renders the whole conversation with the generation prompt, tokenizes it and
    hands it to `Decoder.sync`, which computes only what the cache does not hold yet: the
    end of the last answer as the template writes it and the new user turn. So the logits
    are those of the whole conversation computed from scratch, at the cost of the new
    tokens (as llama.cpp's server reuses its cache). When the conversation no longer fits
    the context, the model sees the system messages and the latest turns that fit in half
    of it (`window`); a reply that fills the context slides the same way."""

    def __init__(self, decoder: Decoder, tokenizer: Tokenizer, template, system: str | None = None,
                 sampling: Sampling = Sampling(), seed: int = 0, tools=None):
        """`tools`: function schemas the model may call (chat.check_tools), rendered by the
        template at every turn; a call's result comes back with reply(..., role="tool")."""
        self.decoder, self.tokenizer, self.template = decoder, tokenizer, template
        self.tools = tools
        self.sampling, self.rng = sampling, np.random.default_rng(seed)
        self.messages = [{"role": "system", "content": system}] if system else []
        self.start = 0      # the first turn the window kept: no earlier one fits again

    def ids(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """The tokens of `messages` rendered with the generation prompt (or without)."""
        from .chat import rendered_ids
        return rendered_ids(self.tokenizer, self.template.render(messages,
                                                                 add_generation_prompt,
                                                                 self.tools))

    def generation_prompt_length(self) -> int:
        """How many tokens the generation prompt adds at the end of the conversation's
        rendering (0 where the rendering without it is no beginning of the one with it, or
        the template refuses to render without it)."""
        from .data import DataError
        try:
            without = self.ids(self.messages, False)
        except (DataError, VocabError):
            return 0
        with_it = self.ids(self.messages)
        return len(with_it) - len(without) if with_it[:len(without)] == without else 0

    def window(self, answer=()) -> list[int]:
        """What the model sees of the conversation, then `answer` (the reply so far): all of
        it if it fits the context; else the system messages and the latest turns (from a
        user message on) that fit in half of it; else (the last turn alone is too long) BOS
        and the last half of the tokens, as `generate_tokens` slides."""
        max_ctx, answer = self.decoder.max_ctx, list(answer)
        if not self.start:      # the whole conversation has fitted so far
            ids = self.ids(self.messages) + answer
            if len(ids) <= max_ctx:
                return ids
        n_system = next((i for i, m in enumerate(self.messages) if m["role"] != "system"),
                        len(self.messages))
        system, turns = self.messages[:n_system], self.messages[n_system:]
        # from the last window's first turn on: a conversation only grows, so an earlier
        # turn cannot fit again, and a turn renders a bounded number of suffixes, not all
        for start in range(max(1, self.start), len(turns)):
            if turns[start]["role"] == "user":
                ids = self.ids(system + turns[start:]) + answer
                if len(ids) <= max_ctx // 2:
                    self.start = start
                    return ids
        return window(self.ids(self.messages) + answer, context_bos(self.tokenizer), max_ctx)

    def reply(self, text: str, n: int = -1, role: str = "user") -> Iterator[int]:
        """Add the message `text` (a user's, or with role "tool" a tool call's result) and
        yield the answer's tokens as they are sampled: at most n (< 0: no limit), ending at
        an end-of-generation token. The answer joins the conversation when the generator
        ends, also when it is closed early or interrupted (Ctrl-C), as far as it went (a
        tool call as the text the model wrote, which the template renders as it was). A
        message that cannot be tokenized (a VocabError) does not join it."""
        self.messages.append({"role": role, "content": text})
        try:
            prompt = self.window()
        except VocabError:
            self.messages.pop()
            raise
        # a recurrent model's states before the generation prompt: the next turn begins
        # with them where it drops this answer's reasoning (Qwen3.5)
        if self.decoder.has_states:
            self.decoder.keep_states_at(len(prompt) - self.generation_prompt_length())
        answer = []
        try:
            tokens = generate_tokens(self.decoder, prompt, n, self.sampling, self.rng,
                                     eog_ids=self.tokenizer.eog_ids,
                                     fit=lambda context: self.window(context[len(prompt):]))
            for token in tokens:
                answer.append(token)
                yield token
        finally:
            self.messages.append({"role": "assistant",
                                  "content": self.tokenizer.decode(answer)})
