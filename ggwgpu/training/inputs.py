"""What a training run reads, made ready for a Trainer: text as shuffled samples, chat or
instruction examples as batches (packed or padded), a validation set, each at a resumed
run's position, and the options a resumed run goes on with. Every problem is a ValueError
whose message names it (the CLI shows it as a usage error)."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np

from .. import chat, data
from ..backends import precision_for
from ..tokenizer import Tokenizer
from .options import TrainOptions
from .state import RunState
from .trainer import token_digest


# Inputs from which on a stage that may take a while (seconds on 2 cores) says so first
LARGE_TEXT = 1_000_000          # characters to tokenize
LARGE_DATA = 1 << 20            # bytes of JSONL to render through a chat template
LARGE_MODEL = 20_000_000        # parameters to plan a train step for


def planning_stage(values: dict, stage):
    """Tell `stage` before planning the train step of a large model."""
    n = sum(math.prod(v.shape) for v in values.values())
    if n >= LARGE_MODEL:
        stage(f"planning the train step of {n / 1e6:.0f} M parameters")


def data_files(data_path) -> list[str]:
    """The files a --data path reads: the file, or a directory's split files (a bundled
    set's name is no file)."""
    if not data_path:
        return []
    if os.path.isdir(data_path):
        return [os.path.join(data_path, f"{split}.jsonl") for split in chat.SPLITS]
    return [data_path] if os.path.exists(data_path) else []


def data_stage(data_path, stage):
    """Tell `stage` before rendering and tokenizing a large --data set."""
    size = sum(os.path.getsize(p) for p in data_files(data_path) if os.path.isfile(p))
    if size >= LARGE_DATA:
        stage(f"reading {data_path} ({size / 2**20:.0f} MiB): rendering, tokenizing and "
              f"packing its examples")


def training_text(texts=(), corpus: str = "shakespeare") -> tuple[str, str]:
    """The training text (the files, else the bundled corpus) and where it came from."""
    if texts:
        return data.read_texts(texts), ", ".join(str(t) for t in texts)
    return data.bundled_corpus(corpus), f"the bundled corpus ({corpus})"


def text_samples(text: str, tokenizer: Tokenizer, n_ctx: int, options: TrainOptions,
                 samples_after_nl: bool = False, state: RunState | None = None,
                 checkpoint: str | None = None):
    """(tokens, their digest, data.Samples) of `text`, at a resumed run's position when
    `state` (of the `checkpoint` file) is given, which must be of the same tokens."""
    try:
        tokens = tokenizer.encode(text)
    except ValueError as e:         # VocabError: no token, not even a byte token, for a piece
        raise ValueError(f"the model's vocabulary cannot tokenize the text: {e}") from None
    digest = token_digest(tokens)
    if state is not None and state.tokens_digest != digest:
        raise ValueError(f"{checkpoint} was trained on other text (tokens "
                         f"{state.tokens_digest}, these are {digest}): pass the same text "
                         f"files to resume")
    samples = data.Samples(tokens, n_ctx, options.batch, options.seed, tokenizer.bos_id,
                           after_newline=samples_after_nl, newline_ids=tokenizer.newline_ids)
    if state is not None:
        resume_data(samples, state, checkpoint)
    return tokens, digest, samples


def resume_data(samples, state: RunState, checkpoint: str | None):
    """Put `samples` (data.Samples, chat.ExampleBatches) at the state's position."""
    try:
        samples.load_state(state.data)
    except data.DataError as e:
        raise ValueError(f"{checkpoint}: {e}") from None


def example_sets(path, tokenizer, template, mask_prompt: bool,
                 splits=("train", "valid"), every_answer: bool = False) -> dict:
    """{split: encoded chat.Examples} of a JSONL file, a directory of splits or a bundled
    set (only the splits asked for and present), rendered through `template`
    (chat.encode_examples: `every_answer`)."""
    try:
        sets = chat.load_dataset(path)
        return {split: [x for e in sets[split] for x in chat.encode_examples(
            e, tokenizer, template, mask_prompt, every_answer)]
            for split in splits if split in sets}
    except OSError as e:
        raise ValueError(str(e)) from None


def example_batches(examples, n_ctx: int, batch: int, seed: int, drop_long: bool = False,
                    pack="auto"):
    """chat.ExampleBatches of encoded examples: packed when that makes fewer rows ("auto"),
    always (True) or never (False: one per row, padded)."""
    return chat.ExampleBatches(examples, n_ctx, batch, seed, drop_long=drop_long, pack=pack)


@dataclass
class ExampleData:
    """A finetune's examples: the training batches, the validation batches (or None) and
    the digest that ties a checkpoint to the training examples."""
    train: chat.ExampleBatches
    valid: chat.ExampleBatches | None
    digest: str


def finetune_examples(path, tokenizer, template, n_ctx: int, options: TrainOptions, *,
                      mask_prompt: bool = False, every_answer: bool = False,
                      drop_long: bool = False, pack: bool = True,
                      val_split: float | None = None, need_validation: bool = False,
                      state: RunState | None = None, checkpoint: str | None = None
                      ) -> ExampleData:
    """The examples of `path`: the validation set is its valid split, else `val_split` of
    the training examples (`need_validation`: there must be one); packed where that makes
    fewer rows (unless `pack` is False); at a resumed run's position when `state` is given."""
    sets = example_sets(path, tokenizer, template, mask_prompt, every_answer=every_answer)
    train, valid = sets["train"], sets.get("valid")
    if valid is None and val_split:
        train, valid = chat.split_off(train, val_split, options.seed)
    if valid is None and need_validation:
        raise ValueError("--val-every and --early-stop need a validation set: valid.jsonl in "
                         "the --data directory, or --val-split")
    digest = chat.examples_digest(train)
    if state is not None and state.tokens_digest != digest:
        raise ValueError(f"{checkpoint} was trained on other examples: pass the same --data "
                         f"(and template options) to resume")
    batches = example_batches(train, n_ctx, options.batch, options.seed, drop_long,
                              "auto" if pack else False)
    if state is not None:
        resume_data(batches, state, checkpoint)
    held = None
    if valid is not None:
        held = example_batches(valid, n_ctx, options.batch, options.seed, drop_long,
                               batches.packed)
    return ExampleData(batches, held, digest)


def preference_data(path, tokenizer, template, n_ctx: int, options: TrainOptions, *,
                    drop_long: bool = False, pack: bool = True, val_split: float | None = None,
                    need_validation: bool = False, state: RunState | None = None,
                    checkpoint: str | None = None) -> ExampleData:
    """The preference pairs of `path` (pairs.py) as pairs.PairBatches of options.batch
    units of two rows, packed where that makes fewer units than pairs (unless `pack` is
    False): the validation set is its valid split, else `val_split` of the training pairs,
    packed as the training pairs are and given as many pair slots (both run through one
    graph); at a resumed run's position when `state` is given. KTO's examples (pairs
    unpaired) become pairs of their answer and a mismatched one (pairs.kto_pairs, in
    groups of options.batch), with their labels."""
    from .. import pairs
    kto = options.objective == "kto"
    try:
        sets = chat.load_dataset(path, check=pairs.check_unpaired if kto else pairs.check_pair)
    except OSError as e:
        raise ValueError(str(e)) from None
    if kto:
        sets = {split: pairs.unpaired(examples) for split, examples in sets.items()}
    if "valid" not in sets and val_split:
        sets["train"], sets["valid"] = chat.split_off(sets["train"], val_split, options.seed)
    if "valid" not in sets and need_validation:
        raise ValueError("--val-every and --early-stop need a validation set: valid.jsonl in "
                         "the --data directory, or --val-split")

    def encoded(examples):      # (encoded pairs, labels or None)
        found, labels = pairs.kto_pairs(examples, options.batch) if kto else (examples, None)
        return [pairs.encode_pair(e, tokenizer, template) for e in found], labels
    (train, labels), (valid, valid_labels) = (
        encoded(sets[split]) if split in sets else (None, None) for split in ("train", "valid"))
    digest = chat.examples_digest([e for pair in train for e in pair], labels)
    if state is not None and state.tokens_digest != digest:
        raise ValueError(f"{checkpoint} was trained on other pairs: pass the same --data (and "
                         f"template options) to resume")
    batches = pairs.PairBatches(train, n_ctx, options.batch, options.seed,
                                drop_long=drop_long, pack="auto" if pack else False,
                                labels=labels)
    if state is not None:
        resume_data(batches, state, checkpoint)
    held = None
    if valid is not None:
        held = pairs.PairBatches(valid, n_ctx, options.batch, options.seed,
                                 drop_long=drop_long, pack=batches.packed, labels=valid_labels)
        batches.unit_pairs = held.unit_pairs = max(batches.unit_pairs, held.unit_pairs)
    return ExampleData(batches, held, digest)


def attach_references(train, valid, cfg, values, backend, options: TrainOptions,
                      state: RunState | None = None, world=None):
    """Give the pairs (pairs.PairBatches) of `train` and `valid` (or None) their reference
    log-probabilities (where the objective needs them: DPO, IPO, KTO): a resumed run's, else
    those of the model `values` as they are now (the base of a LoRA finetune; the starting
    weights of a full one), computed once (with `world`, a distributed.World, shared out over
    the ranks)."""
    from .preference import sequence_logps
    loss = options.preference_loss()
    if loss is None or not loss.needs_reference:
        return
    for batches, saved in ((train, state and state.reference),
                           (valid, state and state.valid_reference)):
        if batches is None:
            continue
        if saved is not None and len(saved) == batches.n_pairs:
            batches.reference = np.asarray(saved, np.float64)
        else:
            batches.reference = sequence_logps(cfg, values, batches, backend,
                                               precision_for(backend, options.precision),
                                               world=world)


def describe_pairs(name: str, batches) -> str:
    """One line on a split's preference pairs (KTO's examples): counts, what was cut or
    left out."""
    if batches.labels is None:
        line = f"{name}: {batches.n_pairs} pairs, {batches.trained_tokens} answer tokens; "
    else:
        good = int(batches.labels.sum())
        line = (f"{name}: {batches.n_pairs} examples ({good} good, {batches.n_pairs - good} "
                f"bad), each with a mismatched answer for the KL, {batches.trained_tokens} "
                f"answer tokens; ")
    if batches.packed:
        unit = "pairs" if batches.labels is None else "examples"
        line += (f"packed into {batches.n_samples} pairs of rows of {batches.n_ctx} "
                 f"({batches.n_pairs / batches.n_samples:.1f} {unit} each), {batches.fill:.0%} "
                 f"of positions used")
    else:
        line += (f"one sequence per row of {batches.n_ctx}, padded, {batches.fill:.0%} of "
                 f"positions used")
    return line + cut_and_left_out(batches, "pairs ")


def cut_and_left_out(batches, unit: str = "") -> str:
    """What of a split did not fit n_ctx: cut (`truncated`), left out (`dropped`)."""
    line = f", {batches.truncated} {unit}cut to n_ctx" if batches.truncated else ""
    if batches.dropped:
        line += f", {batches.dropped} left out (longer than n_ctx with --drop-long, or " \
                f"nothing to train within it)"
    return line


def describe_examples(name: str, batches) -> str:
    """One line on a split's examples: counts, rows, what was cut or left out."""
    line = f"{name}: {batches.n_examples} examples, {batches.trained_tokens} trained tokens; "
    if batches.packed:
        line += (f"packed into {batches.n_samples} rows of {batches.n_ctx} "
                 f"({batches.n_examples / batches.n_samples:.1f} examples each), "
                 f"{batches.fill:.0%} of positions used (padding would use "
                 f"{batches.padded_fill:.0%})")
    else:
        line += f"one per row of {batches.n_ctx}, padded, {batches.fill:.0%} of positions used"
    return line + cut_and_left_out(batches)


def resume_overrides(saved: TrainOptions, overrides: dict
                     ) -> tuple[TrainOptions, dict, list[str]]:
    """The options a resumed run goes on with: the checkpoint's (`saved`), with those of
    `overrides` (field -> value) that TrainOptions declares may_change. Returns (the options,
    {field: new value} of those that changed, the fields given another value that the
    checkpoint fixes: the caller refuses the run if there are any)."""
    declared = TrainOptions.declared()
    unknown = [name for name in overrides if name not in declared]
    if unknown:
        raise ValueError(f"not training options: {', '.join(unknown)}")
    differ = {name: value for name, value in overrides.items() if value != getattr(saved, name)}
    changes = {name: value for name, value in differ.items() if declared[name]["may_change"]}
    return dataclasses.replace(saved, **changes), changes, [n for n in differ if n not in changes]


def resumed_options(saved: TrainOptions, overrides: dict, checkpoint: str) -> TrainOptions:
    """`resume_overrides`' options; an override the checkpoint fixes is a ValueError naming
    it."""
    options, _, clashes = resume_overrides(saved, overrides)
    if clashes:
        declared = TrainOptions.declared()
        may = [name for name in declared if declared[name]["may_change"]]
        raise ValueError(f"{checkpoint} fixes the training options (only {', '.join(may)} may "
                         f"change when resuming); these contradict it: " +
                         ", ".join(f"{name} {getattr(saved, name)} (given: {overrides[name]})"
                                   for name in clashes))
    return options


def best_path(out: str) -> str:
    """Where the weights of the lowest validation loss go: x.gguf -> x.best.gguf."""
    root, ext = os.path.splitext(out)
    return f"{root}.best{ext or '.gguf'}"


def default_checkpoint_path(out: str) -> str:
    """Where a run saves when no checkpoint path was given: next to the output,
    model.gguf -> model.checkpoint.gguf."""
    root, ext = os.path.splitext(out)
    return f"{root}.checkpoint{ext or '.gguf'}"
