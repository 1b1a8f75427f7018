"""The graphs of a model of any family (models.family): the training forward with its loss,
and inference with a KV cache (ggwgpu.generate runs and samples it). Token embedding,
n_layer blocks of the family, a final rms_norm and the output matrix.

build_train_graph is the training forward with its loss; build_decode_graph is the same
model for inference with a KV cache. Both take adapters (ggwgpu.lora.Adapter); with
train="lora" only the adapter's pairs are params and the base is frozen (constants, which may
be in a block type: ggwgpu.quant).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import ops as O
from ..graph import topo_order
from ..quant import Quantized
from ..tensor import DTYPES, ShapeError, constant, input_tensor, param
from .blocks import (EMBEDDING_NOISE, LORA, LORA_A, LORA_B, LORA_DROPOUT, OUTPUT, Sequence,
                     attention, attention_scores, attention_temperature, embed, output,
                     sink_probs)
from .config import ModelConfig
from .delta_net import chunking, delta_rule, segment_masks

# the rope frequency-factor tables (positive; f32 in an f16 graph: the rope reads f32 factors)
ROPE_TABLES = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# name suffixes of the values never trained, even in a full finetune: the rope tables, and
# gemma4's layer output scales (buffers of the model in its own code, not parameters)
# (exp_probs_b.bias: the experts' balancing bias, set by counting how often each is taken, as
# DeepSeek V3 and LFM2 train it: it ranks experts and takes no gradient)
FROZEN = ROPE_TABLES + ("layer_output_scale.weight", "exp_probs_b.bias")


def frozen(name: str) -> bool:
    """Whether the value `name` is never trained (FROZEN)."""
    return name.endswith(FROZEN)
PRECISIONS = ("f32", "f16")  # the element type of activations (model_weights)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, GGUF name -> shape (NumPy order), in file order."""
    return cfg.family.shapes(cfg)


def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The matrices a LoRA pair can adapt, name -> (n_out, n_in), or (n_expert, n_out, n_in)
    for a stack of experts' matrices (a pair per expert), in file order: every 2-D weight
    and every stack (not a stack's biases, gpt-oss's (n_expert, n_out)), and output.weight
    also when the embeddings are tied (token_embd read as the output matrix: a pair on it
    adapts the output projection alone)."""
    shapes = {n: s for n, s in parameter_shapes(cfg).items()
              if len(s) in (2, 3) and not n.endswith(".bias")}
    shapes.setdefault(OUTPUT, (cfg.n_vocab, cfg.n_embd))
    return shapes


def vector_like(name: str, shape: tuple) -> bool:
    """Whether parameter `name` holds a vector's values rather than a matrix's: 1-D, stored
    as a column (Mamba2's ssm_a and ssm_d, (heads, 1)), or a norm's weights in groups
    (Mamba2's ssm_norm)."""
    return len(shape) == 1 or shape[-1] == 1 or name.endswith("_norm.weight")


def init_parameters(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """train-text-from-scratch's initialisation for matrices: normal(0, 1) clamped to
    [-1, 1], scaled by 1/sqrt(ne0 + ne1); norm weights start at 1, biases at 0, other
    vectors at what their family says (Family.initial: qwen35's ssm_a at -1, a decay)."""
    rng = np.random.default_rng(seed)
    values = {}
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith(".bias"):
            values[name] = np.zeros(shape, np.float32)
        elif vector_like(name, shape):
            values[name] = np.full(shape, cfg.family.initial(name), np.float32)
        else:
            # a stack of matrices (experts): each scaled as one matrix
            w = np.clip(rng.standard_normal(shape), -1.0, 1.0) / np.sqrt(sum(shape[-2:]))
            values[name] = w.astype(np.float32)
    return values



def model_weights(values: dict, adapters=(), train: str | None = "base",
                  precision: str = "f32"):
    """The leaves of a model's weights, as the graph builders read them, and its params.

    `values` (GGUF name -> float array, or a frozen `Quantized`) become params when
    train == "base", else constants. Each adapter (`tensors`: <name>.lora_a/.lora_b -> array,
    `scale(name)`) puts its pair for weight `name` in p[name + LORA]: params named as the
    adapter's tensors when train == "lora" (one adapter), else constants. train=None freezes
    everything. Returns (p, {name: param}).

    precision "f16": the builders read every float weight as halves, so the whole graph
    computes on f16 activations (the dtype rule of ops/registry.py): a param stays an f32
    master that a cast feeds to the graph (its gradient comes back as f32 through the
    cast), a frozen float array becomes an f16 constant; block-type weights stay as they
    are (their kernels take f16 activations), and so do the rope frequency factors."""
    if train not in ("base", "lora", None):
        raise ValueError(f"train must be 'base', 'lora' or None, got {train!r}")
    if train == "lora" and len(adapters) != 1:
        raise ValueError(f"a LoRA finetune trains one adapter, got {len(adapters)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    params = {}

    def leaf(value, name, trained):
        half = precision == "f16" and name not in ROPE_TABLES
        if not trained:
            if half and not isinstance(value, Quantized):
                return constant(value, "f16", name=name)
            return constant(value, name=name)
        params[name] = param(value, name=name)
        return O.cast(params[name], "f16") if half else params[name]

    p = {name: leaf(v, name, train == "base" and not frozen(name))
         for name, v in values.items()}
    for adapter in adapters:
        for name in adapter.tensors:
            if name.endswith(LORA_A):
                base = name[:-len(LORA_A)]
                pair = (leaf(adapter.tensors[name], name, train == "lora"),
                        leaf(adapter.tensors[base + LORA_B], base + LORA_B, train == "lora"),
                        adapter.scale(base))
                p.setdefault(base + LORA, []).append(pair)
    return p, params


def half_values(values: dict) -> dict:
    """`values` with each float array that an f16 graph reads as halves (model_weights)
    converted to float16 once: graphs built from the result share those arrays, and so
    their constants' storage on a backend (base.SharedConstants)."""
    return {name: v if isinstance(v, Quantized) or name in ROPE_TABLES
            else np.asarray(v, np.float16) for name, v in values.items()}


MAX_LOGITS_BYTES = 128 << 20   # WebGPU's default (and lavapipe's) max storage binding


@dataclass
class TrainGraph:
    tokens: object            # i32 input (batch, n_ctx)
    positions: object         # i32 input (n_ctx,), or packed (batch, n_ctx)
    targets: object           # i32 input (batch, n_ctx): target ids, negative ones ignored
    weights: object           # f32 input (batch, n_ctx): 1 / counted targets, 0 on ignored
    logits: list              # row chunks of the (batch * n_ctx, n_vocab) logits, in order
    loss: object              # (1,): mean cross-entropy per counted target, in nats
    params: dict              # name -> param tensor (the adapter's tensors in a LoRA finetune)
    checkpoints: list         # each block's output, for gradient checkpointing
    recompute: list           # what the backward recomputes (build_backward's recompute): the
                              # logits chunks' nodes, when there is more than one chunk
    mask: object = None       # packed: f32 input (batch, 1, n_ctx, n_ctx), 0 where a query
                              # sees a key, -inf elsewhere
    window: int = 0           # the sliding window of the layers that have one (0: none)
    window_mask: object = None  # packed with a window: the mask of those layers, as `mask`
    # with sequences (build_train_graph): the 0/1 (sequences, batch * n_ctx) that sums each
    # sequence's rows (a constant, sequence i the positions of row i; packed, an input), and
    # its token terms summed: (1, sequences), minus the log-probability of each sequence's
    # counted targets when the target weights are 1
    sequence_rows: object = None
    sequence_nll: object = None
    # packed, with recurrent layers: the delta rule's (same, carry) inputs
    # (models.delta_net.segment_masks), each None where unused
    segments: tuple | None = None
    # with lora_dropout or neftune_alpha: the i32 input [seed, on] of their draws (the
    # trainer turns it on for a step, off to evaluate)
    draws: object = None
    reported = ()   # tensors a training step reads back for its record (report): none

    def report(self, values) -> dict:
        return {}

    def weighed(self, plan, batch) -> dict:
        """{"loss": the loss times its count, "count"} of the batch just run: the loss per
        counted target, so that batches of different counts average right."""
        n = int((np.asarray(batch[1]) >= 0).sum())
        return {"loss": float(plan.read(self.loss)[0]) * n, "count": n}

    @property
    def packed(self) -> bool:
        """Whether a row holds several sequences (positions and masks are per batch)."""
        return self.positions.ndim == 2

    def feeds(self, tokens, targets, segments=None, counted: int | None = None) -> dict:
        """The inputs of one batch: tokens and target ids, int arrays (batch, n_ctx); a
        negative target id leaves its position out of the loss and of the mean. `counted`
        is the number of targets the mean divides by, when the batch is a rank's part of a
        larger one (default: the counted targets of this batch). A packed
        graph also takes `segments` (batch, n_ctx): which sequence of its row each position
        belongs to (`packed_inputs`), from which the positions and the mask are made; an
        unpacked one takes none (its positions are 0 .. n_ctx - 1, written once)."""
        if (segments is None) == self.packed:
            raise ValueError("a packed training graph needs the segments of its rows"
                             if self.packed else "segments need a packed training graph "
                             "(build_train_graph(..., packed=True))")
        targets = np.asarray(targets, np.int32).reshape(self.targets.shape)
        n_vocab = self.logits[0].shape[-1]
        if (targets >= n_vocab).any():
            raise ValueError(f"target id {int(targets.max())} out of range for a vocabulary "
                             f"of {n_vocab}")
        mask = targets >= 0
        counted = int(mask.sum()) if counted is None else counted
        weights = np.where(mask, np.float32(1.0 / max(1, counted)), 0)
        feeds = {self.tokens: np.asarray(tokens, np.int32), self.targets: targets,
                 self.weights: weights.astype(np.float32)}
        if segments is not None:
            segments = np.reshape(segments, self.targets.shape)
            positions, mask = packed_inputs(segments)
            feeds[self.positions] = positions
            if self.mask is not None:
                feeds[self.mask] = mask
            if self.window_mask is not None:
                feeds[self.window_mask] = packed_inputs(segments, self.window)[1]
            if self.segments is not None:   # (carry is unused with one chunk)
                feeds.update((t, v) for t, v in zip(self.segments, segment_masks(segments))
                             if t is not None)
        return feeds

    def read_logits(self, plan) -> np.ndarray:
        """The logits (batch, n_ctx, n_vocab), from a plan with every chunk among its
        outputs (plan(graph.logits))."""
        rows = np.concatenate([plan.read(t) for t in self.logits])
        return rows.reshape(self.tokens.shape + rows.shape[-1:])


def packed_inputs(segments, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The positions (batch, n_ctx) i32 and the additive attention mask (batch, 1, n_ctx,
    n_ctx) f32 of rows that hold several sequences, one after another: `segments` (batch,
    n_ctx) gives each position's sequence, a run of equal values. Each run's positions start
    at 0, and query i sees key j (mask 0, else -inf) when both are in one run and j <= i,
    so no sequence attends to another (llama.cpp's batch of several sequences); with a
    sliding `window`, also only when i - j < window."""
    segments = np.asarray(segments)
    n = segments.shape[-1]
    starts = np.ones(segments.shape, bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    run = np.cumsum(starts, axis=1)                       # the run of each position
    at = np.arange(n)
    first = np.maximum.accumulate(np.where(starts, at, 0), axis=1)
    seen = (run[:, :, None] == run[:, None, :]) & causal(n, window)
    return (at - first).astype(np.int32), additive(seen)[:, None]


def layers_window(cfg: ModelConfig) -> int:
    """The sliding window of the layers that have one (0: no layer has); the graphs make
    one mask for them, so every such layer must have the same."""
    windows = {cfg.family.window(cfg, i) for i in range(cfg.n_layer)} - {0}
    if len(windows) > 1:
        raise ShapeError(f"layers of {len(windows)} different sliding windows")
    return windows.pop() if windows else 0


def causal(n: int, window: int = 0) -> np.ndarray:
    """(n, n) bool: whether query i sees key j: j <= i, and with a sliding window
    i - j < window (llama.cpp's is_masked_swa)."""
    ahead = np.arange(n)[:, None] - np.arange(n)[None, :]
    return (ahead >= 0) & ((ahead < window) if window else True)


def build_train_graph(cfg: ModelConfig, values: dict, batch: int, flash: bool = False,
                      lora=None, adapters=(), frozen: bool = False,
                      max_logits_bytes: int = MAX_LOGITS_BYTES, packed: bool = False,
                      precision: str = "f32", sequences: int = 0, lora_dropout: float = 0.0,
                      neftune_alpha: float = 0.0):
    """The forward graph of one training batch with its cross-entropy loss. With `lora`
    (an adapter, ggwgpu.lora.Adapter) the base `values` are frozen and the adapter's
    tensors are the params: a LoRA finetune. Else `values` are the params, or with `frozen`
    (a loss to evaluate, not to train) constants, with `adapters`' pairs added.

    The output projection and the loss run in row chunks of at most `max_logits_bytes` of
    f32 logits each (f16 chunks take as many rows, so halves halve them too; a vocabulary
    of 49k-128k makes batch * n_ctx rows of logits larger than a device binds, and than the
    rest of a small model's step). With more than one chunk the
    backward recomputes each chunk's logits (TrainGraph.recompute: one more output product
    per step) instead of keeping them all, so one chunk's logits and their gradient live at
    a time. The planner frees a chunk's logits gradient and its share of the output weight's
    gradient at once only when the chunk has at least n_embd rows (the share then costs
    less than the gradient it frees): so when the bound is at least twice the output weight
    (chunks have at least half the rows the bound allows). Feed a batch with
    TrainGraph.feeds.

    `packed`: a row holds several sequences (examples packed one after another), each at
    positions from 0 and attending to itself only: positions become an input per row
    (batch, n_ctx), roped as one run of batch * n_ctx tokens (as llama.cpp ropes a batch of
    several sequences), and an additive mask input (TrainGraph.mask) replaces the causal
    one (soft_max_ext, or with flash flash_attn_ext).

    `precision` "f16": activations, logits and the attention mask are halves, the loss f32
    (model_weights says how the weights get there); the backward's gradients then have
    their tensors' types, so the params' come back f32.

    `sequences` > 0 adds each sequence's sum of weighted token terms
    (TrainGraph.sequence_nll, from the rows' cross_entropy_ids_rows and the 0/1 input
    TrainGraph.sequence_rows that says which positions a sequence has: row i's for sequence
    i, planned once; an input of each batch when packed): what a preference loss is made of
    (ggwgpu.training.preference).

    `lora_dropout` > 0 (a LoRA finetune's) drops that share of each pair's input while
    training (blocks.lora_input); `neftune_alpha` > 0 adds NEFTune's noise to the token
    embeddings, uniform within alpha / sqrt(n_ctx * n_embd) (TRL's neftune_noise_alpha).
    Both draw as the input TrainGraph.draws says: [seed, 1] on, each step its own seed;
    [0, 0] off."""
    if lora is not None:
        p, params = model_weights(values, (lora,), "lora", precision)
    else:
        p, params = model_weights(values, adapters, None if frozen else "base", precision)
    if lora_dropout and lora is None:
        raise ValueError("LoRA dropout drops the inputs of a LoRA finetune's pairs: give the "
                         "adapter to train (lora=...)")
    draws = input_tensor((2,), "i32", name="draws") if lora_dropout or neftune_alpha else None
    if lora_dropout:
        p[LORA_DROPOUT] = (draws, lora_dropout)
    if neftune_alpha:
        p[EMBEDDING_NOISE] = (draws, neftune_alpha / math.sqrt(cfg.n_ctx * cfg.n_embd))
    tokens = input_tensor((batch, cfg.n_ctx), "i32", name="tokens")
    targets = input_tensor((batch, cfg.n_ctx), "i32", name="targets")
    weights = input_tensor((batch, cfg.n_ctx), name="target weights")
    family, n, window = cfg.family, cfg.n_ctx, layers_window(cfg)
    mask = window_mask = None
    if packed:
        positions = input_tensor((batch, n), "i32", name="positions")
        mask = input_tensor((batch, 1, n, n), precision, name="attention mask")
        if window:
            window_mask = input_tensor((batch, 1, n, n), precision, name="window mask")
        seq_positions, lead = O.reshape(positions, (batch * n,)), (batch * n,)
    else:
        positions = input_tensor((n,), "i32", name="positions")
        if window:
            window_mask = constant(additive(causal(n, window)), precision, name="window mask")
        seq_positions, lead = positions, (batch, n)

    attended = {}       # layer -> the k and v it attended with (shared KV reads them)

    def attend(i, q, k, v, scale, layer_window, sinks=None):
        if packed:  # roped as one run of tokens, each at its own position; back to rows
            q, k, v = (t if t is None else
                       O.reshape(t if t.is_contiguous() else O.cont(t), (batch, n) + t.shape[1:])
                       for t in (q, k, v))     # (phi3's v is a view of its fused product)
        if k is None:
            k, v = attended[i]
        else:
            attended[i] = k, v
        out = attention(cfg, q, k, v, flash, window_mask if layer_window else mask, scale,
                        sinks)
        return O.reshape(O.cont(out), (batch, n, q.shape[-2] * q.shape[-1]))

    def convolve(i, x, weight):     # each token at its position in its sequence
        return O.ssm_conv(x, weight, positions)

    segments = None     # packed: the delta rule's masks that keep a row's sequences apart
    if packed and cfg.recurrent_layers:
        c, chunks = chunking(n)
        segments = (input_tensor((batch, chunks, c, c), name="recurrent same sequence"),
                    input_tensor((batch, chunks, c, 1), name="recurrent carry"))

    def recur(i, q, k, v, g, beta, **rule):     # each sequence from a zero state
        return delta_rule(q, k, v, g, beta, segments=segments, **rule)

    seq = Sequence(lead, seq_positions, attend, convolve, recur,
                   temperature=attention_temperature(cfg, seq_positions, n, precision))
    x = embed(p, tokens, precision, family.input_scale(cfg))     # (batch, ctx, embd)
    seq = family.prepare(cfg, p, tokens, x, seq)
    checkpoints = []
    for i in range(cfg.n_layer):
        x = family.block(cfg, p, i, x, seq)
        checkpoints.append(x)
    rows = batch * n
    h = O.reshape(family.final_norm(cfg, p, x), (rows, cfg.n_embd))
    ids, w = O.reshape(targets, (rows,)), O.reshape(weights, (rows,))
    logits, loss, recompute = [], None, []
    seq_rows = None
    if sequences and packed:
        seq_rows = input_tensor((sequences, rows), name="sequence rows")
    elif sequences:
        seq_rows = constant(np.kron(np.eye(sequences, batch, dtype=np.float32),
                                    np.ones((1, n), np.float32)), name="sequence rows")
    seq_nll = None
    for start, count in row_chunks(rows, max(1, max_logits_bytes // (4 * cfg.n_vocab))):
        if count < rows:
            part = (O.view(h, (count, cfg.n_embd), (cfg.n_embd, 1), start * cfg.n_embd),
                    O.view(ids, (count,), (1,), start), O.view(w, (count,), (1,), start))
            logits.append(output(cfg, p, part[0]))
            # kept for the backward, every chunk's logits would be alive at once
            recompute += nodes_between(part[0], logits[-1])
        else:
            part = (h, ids, w)
            logits.append(output(cfg, p, h))
        term = O.cross_entropy_ids(logits[-1], *part[1:])
        if sequences:       # this chunk's rows' terms, summed into their sequences
            terms = O.reshape(O.cross_entropy_ids_rows(logits[-1], *part[1:]), (1, count))
            chunk_rows = seq_rows if count == rows else O.view(
                seq_rows, (sequences, count), (rows, 1), start)
            summed = O.mul_mat(chunk_rows, terms)                          # (1, sequences)
            seq_nll = summed if seq_nll is None else O.add(summed, seq_nll)
        # (term, loss), not (loss, term): the backward then adds the output weight's
        # gradient chunk by chunk in the order the planner computes the chunks, so each
        # chunk's part dies at once (measured: plan.memory() of tests/test_llama.py)
        loss = term if loss is None else O.add(term, loss)
    mask, window_mask, draws, *used = used_of([loss, *logits], mask, window_mask, draws,
                                              *(segments or ()))
    segments = tuple(used) if segments else None
    return TrainGraph(tokens, positions, targets, weights, logits, loss, params, checkpoints,
                      recompute, mask, window, window_mask, seq_rows, seq_nll, segments,
                      draws)


def used_of(outputs, *inputs) -> list:
    """`inputs`, each None where `outputs` do not read it (a mask no layer takes: every
    attention layer windowed, or none attending; positions no layer ropes with), so that no
    feed names a tensor the plan lacks."""
    used = {id(t) for t in topo_order(outputs)}
    return [t if t is not None and id(t) in used else None for t in inputs]


def additive(seen: np.ndarray) -> np.ndarray:
    """The attention mask of `seen` (where a query sees a key): 0 there, -inf elsewhere."""
    return np.where(seen, np.float32(0), np.float32(-np.inf))


def nodes_between(x, y) -> list:
    """The nodes that compute y from x: y's sources back to x, stopping at leaves (the
    weights; LoRA pairs on the output add their products)."""
    found, todo = {}, [y]
    while todo:
        t = todo.pop()
        if t is not x and t.op is not None and id(t) not in found:
            found[id(t)] = t
            todo += t.srcs
    return list(found.values())


def row_chunks(rows: int, most: int) -> list[tuple[int, int]]:
    """(start, length) of the fewest chunks of at most `most` rows, lengths within one."""
    n = -(-rows // most)
    return [(i * rows // n, (i + 1) * rows // n - i * rows // n) for i in range(n)]


@dataclass
class DecodeGraph:
    """The graph of `build_decode_graph`; `feeds(tokens, past)` gives its per-run inputs."""
    n_tokens: int             # tokens per run (a run may use fewer: the rest is padding)
    max_ctx: int              # cache rows: positions 0 .. max_ctx - 1
    tokens: object            # i32 input (n_tokens,)
    positions: object         # i32 input (n_tokens,); None where no layer ropes
    writes: object            # i32 input (n_tokens,): the row of [cache | scratch] each token's
                              # K/V goes to (its position's, padding a scratch row)
    mask: object              # f32 input (n_tokens, span): 0 where a query sees a key, -inf
    last: object              # i32 input (1,): the token whose logits are computed
    logits: object            # (1, n_vocab): the logits of token `last`
    caches: tuple             # leaves of (max_ctx + scratch rows, width), by position: K and V
                              # of each layer with its own, the convolution inputs of each
                              # convolution layer, in layer order
    params: dict              # name -> weight leaf (frozen constants)
    window: int = 0           # the sliding window of the layers that have one (0: none)
    window_mask: object = None  # with a window: those layers' mask input, as `mask`
    conv_rows: object = None  # i32 input (conv_kernel - 1 + n_tokens,): the cache rows that the
                              # run's convolutions read, from conv_kernel - 1 positions back
    conv_positions: object = None  # i32 input, as conv_rows: their positions (< 0: before 0)
    states: tuple = ()        # recurrent layers' states (qwen35's delta-nets), leaves kept
                              # from run to run: the state after the last token run
    state_writes: tuple = ()  # the writes of the new states: outputs to plan with the logits
    valid: object = None      # with states: input (n_tokens, 1), 1 on the run's tokens,
                              # 0 on its padding (which then leaves the states as they are)
    carry: object = None      # with states: f32 input (1, 1, 1), 0 when a run starts at 0
    span: int = 0             # the cache rows a run reads: positions 0 .. span - 1

    @property
    def outputs(self) -> list:
        """What a plan of the graph computes: the logits, and the states' writes."""
        return [self.logits, *self.state_writes]

    @property
    def kept(self) -> list:
        """The leaves that keep their values from run to run: the caches and the recurrent
        states. Graphs built on one `state` dict hold the same values: planned with these as
        `shared`, their plans hold them in common."""
        return [*self.caches, *self.states]

    def feeds(self, tokens, past: int) -> dict:
        """Inputs of a run that appends `tokens` (1 .. n_tokens ids) at positions past,
        past + 1, ... to a cache holding positions 0 .. past - 1; returns the logits of the
        last of them."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n, past = len(tokens), int(past)
        if not 1 <= n <= self.n_tokens:
            raise ShapeError(f"a run takes 1 to {self.n_tokens} tokens, got {n}")
        if past < 0 or past + n > self.span:
            raise ShapeError(f"positions {past} .. {past + n - 1} do not fit a cache of "
                             f"{self.span}" + (f" (a graph that reads {self.span} of its "
                                               f"{self.max_ctx} rows)"
                                               if self.span < self.max_ctx else ""))
        ids = np.zeros(self.n_tokens, np.int32)
        ids[:n] = tokens
        rows = np.arange(self.n_tokens)
        writes = np.where(rows < n, past + rows, self.max_ctx + rows - 1).astype(np.int32)
        ahead = (past + rows)[:, None] - np.arange(self.span)[None, :]
        feeds = {self.tokens: ids, self.writes: writes, self.last: np.array([n - 1], np.int32)}
        if self.positions is not None:
            feeds[self.positions] = (past + rows).astype(np.int32)
        if self.mask is not None:
            feeds[self.mask] = additive(ahead >= 0)
        if self.window_mask is not None:
            feeds[self.window_mask] = additive((ahead >= 0) & (ahead < self.window))
        if self.conv_rows is not None:  # the run's positions and the kernel's reach before them
            at = past - (self.conv_rows.shape[0] - self.n_tokens) + np.arange(
                self.conv_rows.shape[0], dtype=np.int32)
            feeds[self.conv_rows] = np.clip(at, 0, self.span - 1)
            feeds[self.conv_positions] = at
        if self.states:     # the states hold position past - 1's, or start over at 0
            feeds[self.valid] = (rows < n).astype(np.float32)[:, None]
            feeds[self.carry] = np.full((1, 1, 1), float(past > 0), np.float32)
        return feeds


def build_decode_graph(cfg: ModelConfig, values: dict, n_tokens: int, max_ctx: int | None = None,
                       adapters=(), precision: str = "f32", scratch: int | None = None,
                       state: dict | None = None, span: int | None = None) -> DecodeGraph:
    """Inference with a KV cache: one run appends up to n_tokens tokens to the cache and
    gives the logits of one of them. Plan it once (a graph of several tokens for prompts,
    one of n_tokens = 1 for each sampled token) and run it per step.

    The cache is leaves, which keep their values from run to run: per layer, K (after rope)
    and V of positions 0 .. max_ctx - 1, one row of the layer's kv_dim (n_head_kv *
    head_dim) each, then `scratch` rows (default n_tokens; at least n_tokens - 1), a leaf
    each (so that a storage binding holds one layer's, not all):
        K or V of a layer = [max_ctx cache rows | scratch rows]
    A layer that shares K/V (gemma4's last shared_kv_layers) has none of its own: it attends
    to the cache rows its source layer updated earlier in the same run. The values of the
    leaves kept from run to run (DecodeGraph.kept: caches, recurrent states) come from
    `state` (made there when missing): graphs of one max_ctx and scratch built on one dict
    hold the same arrays, which their plans can share (Plan's `shared`).

    Writing the new rows at position `past`, which changes every run while a view's offset is
    fixed when the graph is built: set_rows writes each token's K/V row at the row the i32
    input `writes` names, its position's cache row (padding token i >= 1 of a short run:
    scratch row i - 1, so it never touches the cache). A run attends to the first `span`
    rows (default max_ctx; positions past + n_tokens must fit), with a mask input (-inf on
    rows past a query's position) through soft_max_ext instead of the static
    diag_mask_inf: one pass over those rows per run, so a graph of a small span costs what
    the filled part of the cache asks for.

    Attention, rope, norms and feed-forward are those of build_train_graph, so the logits of
    a token equal the training graph's logits at its position (tests/test_generate.py).
    The weights are frozen constants (f32 or block types), with `adapters`' LoRA pairs added.
    `precision` "f16": float weights, activations, the mask and the cache in halves
    (model_weights); the logits too.
    """
    max_ctx = int(max_ctx or cfg.n_ctx)
    n_tokens = int(n_tokens)
    span = max_ctx if span is None else int(span)
    if not 1 <= n_tokens <= span <= max_ctx:
        raise ShapeError(f"n_tokens {n_tokens} and span {span} must be 1 <= n_tokens <= span "
                         f"<= max_ctx {max_ctx}")
    scratch = n_tokens if scratch is None else int(scratch)
    if scratch < n_tokens - 1:
        raise ShapeError(f"{scratch} scratch rows cannot take the padding of {n_tokens} tokens")
    rows, family = max_ctx + scratch, cfg.family
    state = {} if state is None else state

    def kept(key, shape, dtype, name):
        """A leaf kept from run to run, its value state[key] (zeros when new)."""
        value = state.setdefault(key, np.zeros(shape, DTYPES[dtype]))
        return constant(value, dtype, name=name)
    p, _ = model_weights(values, adapters, train=None, precision=precision)
    tokens = input_tensor((n_tokens,), "i32", name="tokens")
    positions = input_tensor((n_tokens,), "i32", name="positions")
    writes = input_tensor((n_tokens,), "i32", name="cache rows written")
    mask = input_tensor((n_tokens, span), precision, name="attention mask")
    last = input_tensor((1,), "i32", name="last token")
    caches = []

    def cached(key, new, width, name):
        """Write `new` (n_tokens rows of `width`) at the rows `writes` names of the cache
        leaf state[key] ([cache | scratch]); the cache rows the run reads, (span, width)."""
        leaf = kept(key, (rows, width), precision, name)
        caches.append(leaf)
        written = O.set_rows(O.reshape_any(new, (n_tokens, width)), writes, leaf)
        return O.view(written, (span, width), (width, 1), 0)

    window = layers_window(cfg)
    window_mask = (input_tensor((n_tokens, span), precision, name="window mask") if window
                   else None)
    attended = {}       # layer -> its updated K and V cache rows (shared KV reads them)

    def attend(i, q, k, v, scale, layer_window, sinks=None):
        if k is None:
            k, v = attended[i]
        else:
            heads, width = k.shape[-2:]
            k, v = (O.reshape(cached(f"{part} {i}", t, heads * width,
                                     f"layer {i}'s {part.upper()} cache"),
                              (1, span, heads, width)) for part, t in zip("kv", (k, v)))
            attended[i] = k, v
        q, k, v = (O.permute(t, (0, 2, 1, 3)) for t in (q, k, v))
        kq, scale = attention_scores(cfg, k, q, scale)           # (1, head, n_tokens, span)
        seen = window_mask if layer_window else mask
        probs = (O.soft_max_ext(kq, seen, scale) if sinks is None
                 else sink_probs(kq, scale, seen, sinks))
        att = O.permute(O.mul_mat(O.transpose(v), probs), (0, 2, 1, 3))
        return O.reshape(O.cont(att), (n_tokens, q.shape[1] * q.shape[3]))

    conv_rows = conv_positions = None    # the convolutions' inputs, cached by position
    conv_widths = family.conv_widths(cfg)
    if conv_widths:
        reach = cfg.conv_kernel - 1
        conv_rows = input_tensor((reach + n_tokens,), "i32", name="convolution rows")
        conv_positions = input_tensor((reach + n_tokens,), "i32", name="convolution positions")

    def convolve(i, x, weight):     # x's rows cached by position; ssm_conv over the run's
        # rows and the kernel's reach before them
        width = conv_widths[i]
        cache = cached(f"conv {i}", x, width, f"layer {i}'s convolution inputs")
        y = O.ssm_conv(O.get_rows(cache, conv_rows), weight, conv_positions)
        return O.view(y, (n_tokens, width), (width, 1), reach * width)

    states, state_writes = [], []
    valid = (input_tensor((n_tokens, 1), precision, name="valid tokens") if cfg.recurrent_layers
             else None)
    carry = input_tensor((1, 1, 1), name="state carried") if cfg.recurrent_layers else None

    def recur(i, q, k, v, g, beta, **rule):     # from the state the last run left, or zeros
        heads, size = v.shape[-2:]
        leaf = kept(f"state {i}", (heads, size, k.shape[-1]), "f32", f"state of layer {i}")
        one = lambda t: O.reshape(O.cont(t), (1,) + t.shape)     # noqa: E731 (a batch of 1)
        o, end = delta_rule(one(q), one(k), one(v), one(O.mul(g, valid)),
                            one(O.mul(beta, valid)), O.mul(leaf, carry), final_state=True,
                            **rule)
        states.append(leaf)
        state_writes.append(O.cpy(end, leaf))
        return O.reshape(O.cont(o), v.shape)

    seq = Sequence((1, n_tokens), positions, attend, convolve, recur,
                   temperature=attention_temperature(cfg, positions, max_ctx, precision))
    x = embed(p, tokens, precision, family.input_scale(cfg))  # (n_tokens, embd)
    seq = family.prepare(cfg, p, tokens, x, seq)
    for i in range(cfg.n_layer):
        x = family.block(cfg, p, i, x, seq)
    x = family.final_norm(cfg, p, O.get_rows(x, last))
    logits = output(cfg, p, x)                                    # (1, n_vocab)
    weights = {k: p[k] for k in values}
    # positions: none where no layer ropes (granitehybrid's attention)
    mask, window_mask, positions = used_of([logits], mask, window_mask, positions)
    return DecodeGraph(n_tokens, max_ctx, tokens, positions, writes, mask, last, logits,
                       tuple(caches), weights, window, window_mask, conv_rows, conv_positions,
                       tuple(states), tuple(state_writes), valid, carry, span)
