"""What the train and finetune commands share: their optimizer, schedule, data and
checkpoint options, reading the text into samples, and the progress bar of the step loop
(ggwgpu.training.run).

The optimizer and schedule options are not declared here: each is a TrainOptions field of
ggwgpu/training/options.py, whose declaration (`_option`: bound, help, flag, may_change, cli) gives its
click option (`training_options`), its value in the commands' TrainOptions (`train_options`)
and what a resumed run does with it (`resumed_options`). The run's own options (data,
length, saving) are declared here once; those marked `Repeated` are what the command line
that continues a stopped run repeats (`resume_args`).

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import click

from ggwgpu.chat import BUNDLED as BUNDLED_SETS
from ggwgpu.data import BUNDLED
from ggwgpu.tokenizer import Tokenizer
from ggwgpu.training import inputs
from ggwgpu.training.run import Reporter, RunStopped, TrainingError

from .common import FiniteFloat, InputPath, chat_template, template_option


def positive(kind=int):
    return click.IntRange(min=1) if kind is int else FiniteFloat(min=0, min_open=True)


def click_type(bound):
    """The click type of a Bound (ggwgpu.train): the values a TrainOptions field, and so its
    command-line option and a checkpoint's value of it, may take."""
    if bound.kind is str:
        return click.Choice(bound.choices)
    limits = dict(min=bound.low, max=bound.high, min_open=bound.low_open,
                  max_open=bound.high_open)
    return click.IntRange(**limits) if bound.kind is int else FiniteFloat(**limits)


def existing_directory(ctx, param, value):
    """Option callback for output files: their directory must exist before training starts,
    not only when the result is written."""
    if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
        raise click.BadParameter(f"the directory of {value} does not exist")
    return value


def mpi_world():
    """The MPI world when this command runs under mpirun with several processes (None
    else); a clear error when mpi4py is missing."""
    from ggwgpu import distributed
    try:
        return distributed.world()
    except distributed.DistributedError as e:
        raise click.ClickException(str(e)) from None


def is_root() -> bool:
    """Whether this process writes logs, checkpoints and models: always, but under mpirun
    only rank 0."""
    world = mpi_world()
    return world is None or world.is_root


def local_batch(options) -> int:
    """The rows of each global batch this process trains on: all of them, but under mpirun
    its share (a resumed checkpoint's batch must split evenly over the processes)."""
    from ggwgpu.distributed import DistributedError
    world = mpi_world()
    try:
        return world.local_batch(options.batch) if world else options.batch
    except DistributedError as e:
        raise click.UsageError(str(e)) from None


def across_ranks(command):
    """Run a training command as one rank of an MPI job when started by mpirun: ranks other
    than 0 print nothing, and an error on one rank ends the job (MPI_Abort) with its message,
    unless every rank meets it at the same point (an agreed stop, a non-finite step)."""
    from ggwgpu.distributed import RankGuard

    def describe(e):
        return e.format_message() if isinstance(e, click.ClickException) else \
            f"{type(e).__name__}: {e}"

    @functools.wraps(command)
    def run(*args, **kw):
        world = mpi_world()
        if world is not None and not world.is_root:
            sys.stdout = sys.stderr = open(os.devnull, "w")
        with RankGuard(world, describe):
            try:
                return command(*args, **kw)
            except TrainingError as e:
                error = click.UsageError(str(e)) if e.usage else click.ClickException(str(e))
                raise same_ranks(error, e) from None
            except RunStopped as e:
                raise same_ranks(SystemExit(e.exit_code), e) from None
    return run


def same_ranks(error: BaseException, cause: BaseException) -> BaseException:
    """`error` marked as `cause` is (distributed.on_every_rank): met by every rank or not."""
    if getattr(cause, "on_every_rank", False):
        error.on_every_rank = True
    return error


class ProgressBar(Reporter):
    """A training run's progress bar (click's): the step's line beside it, notes on standard
    error on a line of their own."""

    def start(self, steps: int):
        self.line = None
        self.bar = click.progressbar(length=steps, label="training", show_eta=True,
                                     item_show_func=lambda _: self.line)
        self.bar.__enter__()

    def step(self, record: dict, line: str):
        self.line = line
        self.bar.update(1)

    def note(self, message: str):
        click.echo(f"\n{message}", err=True)

    def end(self):
        self.bar.__exit__(None, None, None)


class Repeated(click.Option):
    """An option of a training run that the command line continuing it (`resume_args`)
    repeats where its value is not the default: what the checkpoint does not hold (the
    text, saving, logging). The options a checkpoint fixes (TrainOptions, the model's shape)
    are not repeated."""


def training_options(steps: int, warmup: int, seed_help: str, command: str):
    """The options of a training run (train and finetune differ in defaults only): the
    run's own (data, length, saving) and one per TrainOptions field, made from its
    declaration in ggwgpu.train. The command gets them as keyword arguments and
    `train_options(kwargs)` makes them a TrainOptions."""
    from ggwgpu.training import TrainOptions
    defaults = {"warmup": {"default": warmup}, "seed": {"help": seed_help}}
    trained = [train_option(name, {**declared, **defaults.get(name, {})})
               for name, declared in TrainOptions.declared().items()
               if declared["cli"] in (True, command)]
    options = [
        click.option("--corpus", cls=Repeated, type=click.Choice(list(BUNDLED)),
                     default="shakespeare", show_default=True,
                     help="The bundled text to train on when no TEXTS are given: both plays, "
                          "or one of them."),
        click.option("--samples-after-nl", cls=Repeated, is_flag=True,
                     help="Start samples only after newlines."),
        click.option("--steps", default=steps, show_default=True, type=click.IntRange(min=0),
                     help="Optimizer steps (0, with --checkpoint-in: write OUT from the "
                          "checkpoint)."),
        click.option("--epochs", type=positive(float),
                     help="Train this many epochs instead of --steps."),
        *trained,
        click.option("--checkpoint-in", type=InputPath(exists=True, dir_okay=False),
                     help="Resume from this checkpoint (weights, optimizer, data order, "
                          "options)."),
        click.option("--checkpoint-out", cls=Repeated, type=click.Path(dir_okay=False),
                     callback=existing_directory,
                     help="Write a checkpoint here (atomically) every --save-every steps and "
                          "at the end. A run stopped by SIGINT/SIGTERM or a non-finite step "
                          "saves here too (default: next to --out, x.gguf -> "
                          "x.checkpoint.gguf)."),
        click.option("--save-every", cls=Repeated, default=100, show_default=True,
                     type=positive()),
        click.option("--log", "log_path", cls=Repeated, type=click.Path(dir_okay=False),
                     callback=existing_directory,
                     help="Append a JSON line per step here (a number that is not finite, "
                          "as a NaN loss, is written null: strict JSON)."),
        click.option("--on-nan", cls=Repeated, default="stop", show_default=True,
                     type=click.Choice(["stop", "skip"]),
                     help="A step with a non-finite loss or gradient never updates the "
                          "weights; then stop (saving a checkpoint) or skip the step and go "
                          "on."),
    ]

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


def train_option(name: str, declared: dict):
    """The click option of TrainOptions field `name`: flag, default, help and type (from its
    Bound: a range, choices or a flag) as ggwgpu.train declares them."""
    bound = declared["bound"]
    kind = {"is_flag": True} if bound.kind is bool else {"type": click_type(bound)}
    return click.option(declared["flag"] or flag_of(name), default=declared["default"],
                        show_default=True, help=declared["help"], **kind)


def flag_of(name: str) -> str:
    """The command-line flag of TrainOptions field `name` (the first of an on/off pair)."""
    from ggwgpu.training import TrainOptions
    flag = TrainOptions.declared()[name]["flag"] or f"--{name.replace('_', '-')}"
    return flag.split("/")[0]


def param_of(name: str) -> str:
    """The click parameter, the key of the command's keyword arguments, of TrainOptions field
    `name` (click names it after its flag: eps is --adam-eps, adam_eps)."""
    return flag_of(name)[2:].replace("-", "_")


def train_options(kw: dict):
    """The TrainOptions of `training_options`' values (TrainOptions' defaults for fields
    that are not on the command line); under mpirun --batch is each process's, and the
    options hold the global batch."""
    from ggwgpu.training import TrainOptions
    world = mpi_world()
    values = {name: kw[param_of(name)] for name, declared in TrainOptions.declared().items()
              if declared["cli"] and param_of(name) in kw}
    values["batch"] *= world.size if world else 1
    with usage_errors():        # options that contradict each other
        options = TrainOptions(**values)
    if options.optimizer == "lbfgs":
        if world or options.grad_accum > 1:
            raise click.UsageError("--optimizer lbfgs takes one whole batch per step in one "
                                   "process: no --grad-accum, no mpirun")
        try:
            options.lbfgs_options().check()
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    return options


GIVEN = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def given(ctx, param: str) -> bool:
    """Whether the user gave option `param` (not its default)."""
    source = ctx.get_parameter_source(param)
    return source is not None and source.name in GIVEN


def resumed_options(ctx, state, checkpoint_in: str, fixed: dict):
    """The TrainOptions a resumed run uses: the checkpoint's, with those declared
    `may_change` (--lr, --flash-attn, --checkpointing) applied when given (and said). Any
    other option given on the command line that contradicts the checkpoint is refused,
    naming it: `fixed` maps the command's own such parameters (the model's shape, say) to
    the checkpoint's value, or to ... when the checkpoint fixes it whatever its value."""
    import dataclasses
    from ggwgpu.training import TrainOptions
    saved, kw, declared = state.options, ctx.params, TrainOptions.declared()
    may_change = [flag_of(name) for name in declared if declared[name]["may_change"]]
    may_change = (f"{', '.join(may_change[:-1])} and {may_change[-1]}" if len(may_change) > 1
                  else may_change[0])
    options, changes, fixed_options = inputs.resume_overrides(
        saved, {name: kw[param_of(name)] for name in declared
                if declared[name]["cli"] and given(ctx, param_of(name))})
    clashes = [f"{flag_of(name)} {getattr(saved, name)} (given: {kw[param_of(name)]})"
               for name in fixed_options]
    for param, value in fixed.items():
        if given(ctx, param) and (value is ... or kw[param] != value):
            clashes.append(f"--{param.replace('_', '-')}" +
                           ("" if value is ... else f" {value} (given: {kw[param]})"))
    if clashes:
        raise click.UsageError(
            f"{checkpoint_in} fixes the model, the data order and the training options "
            f"(only {may_change} may change when resuming); these given options contradict "
            f"it: {', '.join(clashes)}. Resume without them, or start a new run")
    click.echo(f"{checkpoint_in} fixes the model, the data order and the options: " +
               ", ".join(f"{flag_of(name)[2:]} {value}"
                         for name, value in dataclasses.asdict(saved).items()), err=True)
    for name, value in changes.items():
        click.echo(f"resuming with {flag_of(name)} {value} instead of the checkpoint's "
                   f"{getattr(saved, name)}", err=True)
    return options


def guard_outputs(ctx, inputs, out: str, checkpoint_path: str, kw: dict, more=()):
    """Before a training run starts: its outputs (OUT, the checkpoint, the log, `more`) are
    none of its `inputs` nor one another (the checkpoint may be --checkpoint-in: a run goes
    on from its own), their directories can be written, an existing --log is a log; then
    OUT and the checkpoint are locked until the command ends."""
    from .outputs import RunLock, check_log, check_outputs, same_file
    if not is_root():       # under mpirun rank 0 writes every file
        return
    checkpoint = "--checkpoint-out" if kw["checkpoint_out"] else "--checkpoint-out (default)"
    resumed = any(same_file(path, checkpoint_path) for _, path in inputs if path is not None)
    if not kw["checkpoint_out"] and not resumed and os.path.exists(checkpoint_path):
        click.echo(f"warning: {checkpoint_path} exists (an earlier run's checkpoint?); if this "
                   f"run stops before its end it replaces it: resume that run with "
                   f"--checkpoint-in {checkpoint_path}, or give --checkpoint-out", err=True)
    check_outputs(inputs, [("--out", out), (checkpoint, checkpoint_path),
                           ("--log", kw["log_path"]), *more],
                  may_be={(checkpoint, "--checkpoint-in")})
    check_log(kw["log_path"])
    ctx.with_resource(RunLock(checkpoint_path, checkpoint))
    ctx.with_resource(RunLock(out, "--out"))


@contextlib.contextmanager
def usage_errors():
    """The library's ValueErrors (a problem with what the user gave) as click usage errors."""
    try:
        yield
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def stage(message: str):
    """A line on stderr before a stage that takes a while (inputs.LARGE_*), so that no run
    sits silent."""
    click.echo(f"{message} ...", err=True)


def planning(values: dict):
    """Say so before planning the train step of a large model."""
    inputs.planning_stage(values, stage)


def read_text(texts, corpus: str) -> tuple[str, str]:
    """The training text (the files, else the bundled corpus) and where it came from."""
    with usage_errors():
        return inputs.training_text(texts, corpus)


def training_samples(text: str, tokenizer: Tokenizer, cfg, options, samples_after_nl: bool,
                     state, checkpoint_in):
    """The text's tokens, their digest and its shuffled samples, at the resumed position
    when `state` (a checkpoint's) is given — which must be of the same tokens."""
    if len(text) >= inputs.LARGE_TEXT:
        stage(f"tokenizing {len(text) / 1e6:.1f} M characters")
    with usage_errors():
        return inputs.text_samples(text, tokenizer, cfg.n_ctx, options, samples_after_nl,
                                   state, checkpoint_in)


def check_steps(kw: dict):
    """--steps 0 only writes OUT from a checkpoint."""
    if kw["steps"] == 0 and not kw["checkpoint_in"]:
        raise click.UsageError("--steps 0 writes OUT from a checkpoint: it needs "
                               "--checkpoint-in")


def steps_of(kw: dict, samples, options) -> int:
    """--steps, or --epochs as steps over these samples."""
    check_steps(kw)
    if kw["epochs"]:
        return max(1, round(kw["epochs"] * samples.n_samples /
                            (options.batch * options.grad_accum)))
    return kw["steps"]


def resume_args(ctx, command: list[str], checkpoint_path: str, steps_left: int) -> list[str]:
    """The command line (`command`: its name and leading arguments) that continues a run
    from `checkpoint_path`: the backend, the TEXTS and the Repeated options that are not at
    their defaults; the command adds its own (--out)."""
    world = mpi_world()
    args = ["mpirun", "-n", str(world.size)] if world else []
    args += ["ggwgpu"] + (["--backend", ctx.obj["backend"]] if ctx.obj["backend"] else [])
    args += [*command, *ctx.params["texts"], "--checkpoint-in", checkpoint_path,
             "--steps", str(steps_left)]
    for param in ctx.command.params:
        if not isinstance(param, Repeated):
            continue
        value = ctx.params[param.name]
        if value not in (None, param.get_default(ctx)):
            args += [param.opts[0]] if param.is_flag else [param.opts[0], str(value)]
    return args


# -- instruction and chat data (--data) -------------------------------------------------------

def data_options(command):
    """--data and what shapes it: the chat template, masking, long examples."""
    options = [
        click.option("--data", "data_path", cls=Repeated, type=click.Path(),
                     help="Examples instead of text: a JSONL file, a directory with "
                          "train.jsonl (and valid.jsonl, test.jsonl), or a bundled set "
                          f"({', '.join(BUNDLED_SETS)}); lines {{\"text\"}}, "
                          "{\"prompt\", \"completion\"} or {\"messages\": [...]}."),
        template_option(cls=Repeated),
        click.option("--mask-prompt", cls=Repeated, is_flag=True,
                     help="Train on the answers only (assistant turns, completions)."),
        click.option("--every-answer", cls=Repeated, is_flag=True,
                     help="With --mask-prompt, where the chat template renders earlier "
                          "answers otherwise in a longer conversation (Qwen3's reasoning, "
                          "whose conversations then train their last answer only): one "
                          "example per answer, the conversation up to it."),
        click.option("--drop-long", cls=Repeated, is_flag=True,
                     help="Leave out examples longer than --n-ctx (default: cut them)."),
        click.option("--no-pack", cls=Repeated, is_flag=True,
                     help="One example per row, padded (default: several whole examples "
                          "packed into a row, each seeing only itself, when that makes "
                          "fewer rows; preference pairs: several pairs to each two rows, "
                          "the chosen answers in one, the rejected in the other)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def example_sets(kw: dict, tokenizer: Tokenizer, splits=("train", "valid")) -> dict:
    """{split: encoded examples} of --data (only the splits asked for and present); the
    template is --chat-template's, else the model's, else ChatML."""
    template = chat_template(tokenizer, kw.get("chat_template"), kw.get("chat_template_kwargs"))
    with usage_errors():
        return inputs.example_sets(kw["data_path"], tokenizer, template, kw["mask_prompt"],
                                   splits, kw["every_answer"])


def example_batches(examples, cfg, batch: int, kw: dict, seed: int):
    """ExampleBatches of --data's encoded examples, as --drop-long says: packed when that
    makes fewer rows, unless --no-pack."""
    with usage_errors():
        return inputs.example_batches(examples, cfg.n_ctx, batch, seed, kw["drop_long"],
                                      not kw["no_pack"] and "auto")
