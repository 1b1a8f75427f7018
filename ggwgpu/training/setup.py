"""A finetune set up from what it is given — the base, the weights it trains (an adapter or
every one), the options, a checkpoint's state when it resumes, and its data — as the
finetune command and the Python API both start one: the data made ready (text, chat
examples or preference pairs, at a resumed run's position), the reference log-probabilities
of a preference run, the Trainer planned, and the files it writes (RunFiles)."""
from __future__ import annotations

from dataclasses import dataclass

from ..tensor import ShapeError
from . import inputs
from .checkpoint import RunFiles
from .run import TrainingError, device_errors
from .state import RunState
from .trainer import Trainer


@dataclass
class FinetuneData:
    """What a finetune reads: text files (default: the bundled `corpus`), or `data` (chat
    examples, or pairs for a preference objective) rendered through `template`, with its
    options (chat.ExampleBatches, pairs.PairBatches)."""
    texts: tuple = ()
    corpus: str = "shakespeare"
    data: str | None = None
    template: object = None
    mask_prompt: bool = False
    drop_long: bool = False
    pack: bool = True
    val_split: float | None = None
    need_validation: bool = False
    samples_after_nl: bool = False
    every_answer: bool = False      # chat.encode_examples


@dataclass
class Finetune:
    """A finetune ready to run: its Trainer, files, validation set (or None) and a line on
    each split of its data."""
    trainer: Trainer
    files: RunFiles
    valid: object
    lines: list


def stage_quietly(message: str):
    pass


def prepare_finetune(base_cfg, cfg, tokenizer, base_digest: str, values: dict, adapter,
                     options, data: FinetuneData, backend, checkpoint_path, *, step: int = 0,
                     opt_state=None, state: RunState | None = None, checkpoint_in=None,
                     world=None, stage=stage_quietly) -> Finetune:
    """The finetune of `base_cfg` (its own context length, kept in what is written) trained
    at `cfg` (the run's n_ctx): `values` are its weights (frozen under `adapter`, else
    trained), resumed at `step` from `state`/`opt_state` when given. `stage(message)` is
    told of the stages that take a while. A problem with what was given is a ValueError;
    a step that cannot be planned (a tensor over the device's limits, a failing device) a
    TrainingError."""
    preference = options.objective != "sft"
    if preference and not data.data:
        raise ValueError(f"--objective {options.objective} trains on preference pairs: give "
                         f"--data (JSONL lines {{\"prompt\", \"chosen\", \"rejected\"}}, a "
                         f"directory of splits, or prefs-demo)")
    if data.data and data.texts:
        raise ValueError("give TEXTS or --data, not both")
    resumed = dict(state=state, checkpoint=checkpoint_in)
    if data.data:
        inputs.data_stage(data.data, stage)
        common = dict(drop_long=data.drop_long, val_split=data.val_split,
                      need_validation=data.need_validation, **resumed)
        if preference:
            split = inputs.preference_data(data.data, tokenizer, data.template, cfg.n_ctx,
                                           options, pack=data.pack, **common)
            describe = inputs.describe_pairs
        else:
            split = inputs.finetune_examples(data.data, tokenizer, data.template, cfg.n_ctx,
                                             options, mask_prompt=data.mask_prompt,
                                             every_answer=data.every_answer,
                                             pack=data.pack, **common)
            describe = inputs.describe_examples
        samples, valid, digest = split.train, split.valid, split.digest
        lines = [f"data: {data.data}: " + describe("train", samples)]
        if valid is not None:
            lines.append("      " + describe("validation", valid))
        if data.mask_prompt and data.template is not None and data.template.last_answer_only:
            lines.append(f"      {data.template.last_answer_only} conversations train their "
                         f"last answer only: the chat template renders earlier answers "
                         f"otherwise in a longer conversation (as Qwen3's does; "
                         f"--every-answer trains each as the model writes it)")
        if data.template is not None and data.template.split_conversations:
            lines.append(f"      {data.template.split_conversations} conversations made one "
                         f"example per answer (--every-answer): the chat template renders "
                         f"earlier answers otherwise in a longer conversation")
    else:
        text, source = inputs.training_text(data.texts, data.corpus)
        if len(text) >= inputs.LARGE_TEXT:
            stage(f"tokenizing {len(text) / 1e6:.1f} M characters")
        tokens, digest, samples = inputs.text_samples(text, tokenizer, cfg.n_ctx, options,
                                                      data.samples_after_nl, **resumed)
        valid, lines = None, [f"data: {source}: {len(tokens)} tokens, {samples.n_samples} "
                              f"samples of {cfg.n_ctx}"]
    if preference and options.preference_loss().needs_reference and state is None:
        unit = "examples" if options.objective == "kto" else "pairs"
        stage(f"the reference log-probabilities of {samples.n_pairs} {unit} (the model as it "
              f"starts)")
    inputs.attach_references(samples, valid, cfg, values, backend, options, state, world)
    inputs.planning_stage(values, stage)
    try:
        trainer = Trainer(cfg, values, backend, options, samples, opt_state, step, lora=adapter,
                          world=world, loss_scaler=state and state.loss_scaler)
    except (ShapeError, *device_errors()) as e:   # over the device's limits, among others
        raise TrainingError(f"cannot plan the finetune step: {type(e).__name__}: "
                            f"{e}") from None
    valid_reference = valid.reference if preference and valid is not None else None
    files = RunFiles(trainer, tokenizer, checkpoint_path,
                     dict(tokens_digest=digest, base=base_digest,
                          mode="full" if adapter is None else "lora",
                          samples_after_nl=data.samples_after_nl, n_ctx=cfg.n_ctx,
                          valid_reference=None if valid_reference is None
                          else valid_reference.tolist()),
                     base_cfg, None if adapter is None else adapter.alpha, base_digest)
    return Finetune(trainer, files, valid, lines)
