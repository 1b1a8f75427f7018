"""What the train and finetune commands share: their optimizer, schedule, data and
checkpoint options, reading the text into samples, and the step loop that loses nothing when
a run is stopped.

The optimizer and schedule options are not declared here: each is a TrainOptions field of
ggwgpu/train.py, whose declaration (`_option`: bound, help, flag, may_change, cli) gives its
click option (`training_options`), its value in the commands' TrainOptions (`train_options`)
and what a resumed run does with it (`resumed_options`). The run's own options (data,
length, saving) are declared here once; those marked `Repeated` are what the command line
that continues a stopped run repeats (`resume_args`).

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
import threading
import time

import click

from ggwgpu.chat import BUNDLED as BUNDLED_SETS
from ggwgpu.data import BUNDLED
from ggwgpu.gguf_file import os_problem

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


def default_checkpoint_path(out: str) -> str:
    """Where a stopped run saves when no --checkpoint-out was given: next to the output,
    model.gguf -> model.checkpoint.gguf."""
    root, ext = os.path.splitext(out)
    return f"{root}.checkpoint{ext or '.gguf'}"


def existing_directory(ctx, param, value):
    """Option callback for output files: their directory must exist before training starts,
    not only when the result is written."""
    if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
        raise click.BadParameter(f"the directory of {value} does not exist")
    return value


def device_errors() -> tuple:
    """What a failing device raises: wgpu's errors (lost device, out of memory, validation,
    internal) and MemoryError (the host's, and wgpu's out-of-memory error is one too)."""
    try:
        import wgpu
    except ImportError:
        return (MemoryError,)
    return (wgpu.GPUError, MemoryError)


def strict_json(value):
    """`value` with every float that is not finite replaced by None (JSON null), as strict
    JSON readers need (json.dumps writes NaN and Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class StopSignals:
    """SIGINT and SIGTERM during training. The first asks for a stop at the next step
    boundary; a second one during a step stops at once (KeyboardInterrupt) without saving;
    any that arrive while a checkpoint is written (`saving()`) wait until it is complete.
    Python lets only the main thread install handlers; elsewhere nothing changes."""

    def __init__(self):
        self.signum, self._saving, self._previous = None, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum, frame):
        if self.signum is not None and not self._saving:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def saving(self):
        before, self._saving = self._saving, True
        try:
            yield
        finally:
            self._saving = before


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
            return command(*args, **kw)
    return run


def training_loop(trainer, steps: int, log_path, save_every: int, save_checkpoint,
                  checkpoint_path=None, resume_command=None, on_nan: str = "stop",
                  validation=None, write_result=None, result_path=None):
    """Run `steps` optimizer steps under a progress bar: a JSON line per step to `log_path`,
    `save_checkpoint()` every `save_every` steps (0: never) and once at the end, and with a
    `Validation` its loss in the log and the progress line, stopping early when it says so;
    then `write_result()` writes the run's product (`result_path`). Returns the first and
    last loss (None without steps) and the seconds taken. The train and finetune commands
    share it.

    Nothing is lost when a run stops early. `save_checkpoint()` writes `checkpoint_path`
    (atomically: the previous file stays whole until the new one is complete) and
    `resume_command(steps_left)` is the command line that continues from it.
    - SIGINT, SIGTERM: the step under way finishes, a checkpoint is saved, the command that
      continues is printed and the process exits with 128 + the signal number.
    - A step whose loss or gradients are not finite changes nothing (Trainer skips its
      update); with on_nan "stop" the run then saves and ends with an error, with "skip" it
      goes on. With dynamic loss scaling a step whose loss is finite but whose scaled
      gradients overflowed ("overflow" in its record) is the scaler's ordinary skip: the
      scale halves and the run goes on.
    - The device failing (lost, out of memory) ends the run with an error; nothing of the
      failed step is saved and the last checkpoint stays.
    - A checkpoint that cannot be written (a non-finite value, a full disk) ends the run; the
      previous one stays.
    - The signal handlers stay until the result is written: a signal then waits for it. A
      result that cannot be written (a full disk) leaves the trained weights in the
      checkpoint, with the command that writes the result from it.
    - A log that cannot be written (a full disk) is given up with one message (RunLog); the
      run goes on.
    """
    from ggwgpu.distributed import on_every_rank
    from ggwgpu.gguf_file import GGUFError
    start, stop = trainer.step, None
    first = last = saved = None         # saved: the step of this run's last checkpoint
    t0, shown, signals = time.perf_counter(), {}, StopSignals()

    def kept() -> str:
        if saved is not None:
            return f"{checkpoint_path} holds the checkpoint of step {saved}"
        return "this run wrote no checkpoint"

    def save():
        nonlocal saved
        if saved == trainer.step:
            return
        with signals.saving():
            try:
                save_checkpoint()
            except (GGUFError, *device_errors()) as e:
                raise click.ClickException(f"step {trainer.step}: the checkpoint was not "
                                           f"written ({e}); {kept()}") from None
        saved = trainer.step

    def save_and_resume_hint() -> str:
        if checkpoint_path is None:
            return "no checkpoint path was given: nothing was saved"
        save()
        hint = f"checkpoint of step {trainer.step} saved to {checkpoint_path}"
        left = steps - (trainer.step - start)
        if resume_command is not None:
            hint += (f"; continue with:\n  {resume_command(left)}" if left else
                     f"; write {result_path or 'the result'} from it with:\n  "
                     f"{resume_command(0)}")
        return hint

    def rescue() -> str:
        """The checkpoint saved where it can be (the trained weights must not go with a
        run that stops), and what to do next; else why it was not."""
        try:
            return save_and_resume_hint()
        except click.ClickException as e:
            return e.message

    def write():
        if write_result is None:
            return
        try:
            write_result()
        except (GGUFError, *device_errors()) as e:
            raise click.ClickException(f"{result_path} was not written ({e}); "
                                       f"{rescue()}") from None

    def validate(record, last_step) -> dict | None:
        try:        # the best weights' write fails as --out's does: the run is kept
            return validation and validation.check(record["step"], last_step)
        except (GGUFError, *device_errors()) as e:
            raise click.ClickException(f"step {record['step']}: the best weights were not "
                                       f"written ({e}); {rescue()}") from None

    log = RunLog(log_path if is_root() else None)     # one log, by rank 0
    try:
        with signals, click.progressbar(length=steps, label="training", show_eta=True,
                                        item_show_func=lambda _: shown.get("text")) as bar:
            for _ in range(steps):
                try:
                    # under MPI the ranks agree on a stop through the step's allreduce
                    record = (trainer.train_step(stop=signals.signum or 0)
                              if getattr(trainer, "world", None) else trainer.train_step())
                except device_errors() as e:
                    raise click.ClickException(
                        f"the device failed in step {trainer.step + 1} ({type(e).__name__}: "
                        f"{e}); nothing of that step was saved; {kept()}") from None
                agreed = record.pop("stop", None)
                elapsed = time.perf_counter() - t0
                record["tokens_per_s"] = trainer.step_tokens * (record["step"] - start) / elapsed
                first = record["loss"] if first is None else first
                last = record["loss"]
                shown["text"] = (f"step {record['step']} loss {last:.3f} "
                                 f"{record['tokens_per_s']:.0f} tok/s lr {record['lr']:.2e}")
                if "loss_scale" in record:
                    shown["text"] += f" scale 2^{math.log2(record['loss_scale']):.0f}"
                val = validate(record, record["step"] - start == steps)
                if val:
                    record["val_loss"] = val["val_loss"]
                    shown["val"] = f" val {val['val_loss']:.3f}"
                shown["text"] += shown.get("val", "")
                log.write(record)
                if record["skipped"] and not record.get("overflow"):
                    what = (f"step {record['step']}: loss {record['loss']:.4g}, gradient "
                            f"norm {record['grad_norm']:.4g}: not finite, so its update was "
                            f"skipped")
                    if on_nan == "stop":
                        raise on_every_rank(click.ClickException(
                            f"{what} and training stops (--on-nan stop; --on-nan skip goes "
                            f"on without such steps). A learning rate that is too high is "
                            f"the usual cause. {rescue()}"))
                    click.echo(f"\n{what} (--on-nan skip)", err=True)
                status = record.get("status", "ok")      # L-BFGS's
                if status.startswith("failed") and not record["skipped"]:
                    raise click.ClickException(
                        f"step {record['step']}: the L-BFGS line search failed "
                        f"({status[8:]}); the "
                        f"weights are as before that step. --lbfgs-on-fail reset retries "
                        f"along the gradient. {rescue()}")
                if save_every and record["step"] % save_every == 0:
                    save()
                bar.update(1)
                if val and val["stop"]:
                    click.echo(f"\nearly stop after step {record['step']}: {validation.patience} "
                               f"evaluations without a lower validation loss (best "
                               f"{validation.best:.4f})", err=True)
                    break
                if status.startswith("converged"):
                    click.echo(f"\nL-BFGS stops after step {record['step']}: "
                               f"{status[11:]}", err=True)
                    break
                stop = signals.signum if agreed is None else agreed
                if stop:
                    break
            if stop and trainer.step - start < steps:
                name = signal.Signals(stop).name
                click.echo(f"\n{name}: stopped after step {trainer.step}; "
                           f"{save_and_resume_hint()}", err=True)
                raise on_every_rank(SystemExit(128 + stop))
            with signals.saving():     # from here on a signal waits for the files
                if save_every:
                    save()
                write()
    except KeyboardInterrupt:
        click.echo(f"\nstopped at once by a second signal in step {trainer.step + 1}, which "
                   f"was not saved; {kept()}", err=True)
        raise SystemExit(128 + (signals.signum or signal.SIGINT)) from None
    finally:
        log.close()
    return first, last, time.perf_counter() - t0


class RunLog:
    """--log: one JSON record per step, appended and flushed. A path that cannot be opened
    for appending (a directory, a read-only disk) is an error before the first step; a write
    that fails later (a full disk) is reported once and the run goes on without its log: the
    model and its checkpoints matter more."""

    def __init__(self, path):
        self.path, self.file = path, None
        if path:
            try:
                self.file = open(path, "a", encoding="utf-8")
            except OSError as e:
                raise click.UsageError(f"--log {path}: cannot be opened for appending "
                                       f"({e.strerror or e})") from None

    def write(self, record: dict):
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as e:
            click.echo(f"\n--log {self.path}: writing failed ({os_problem(e, self.path)}); "
                       f"the run goes on without its log", err=True)
            self.close()

    def close(self):
        if self.file is not None:
            with contextlib.suppress(OSError):      # what a full disk kept from the log
                self.file.close()
            self.file = None


class Repeated(click.Option):
    """An option of a training run that the command line continuing it (`resume_args`)
    repeats where its value is not the default: what the checkpoint does not hold (the
    text, saving, logging). The options a checkpoint fixes (TrainOptions, the model's shape)
    are not repeated."""


def training_options(steps: int, warmup: int, seed_help: str):
    """The options of a training run (train and finetune differ in defaults only): the
    run's own (data, length, saving) and one per TrainOptions field, made from its
    declaration in ggwgpu.train. The command gets them as keyword arguments and
    `train_options(kwargs)` makes them a TrainOptions."""
    from ggwgpu.train import TrainOptions
    defaults = {"warmup": {"default": warmup}, "seed": {"help": seed_help}}
    trained = [train_option(name, {**declared, **defaults.get(name, {})})
               for name, declared in TrainOptions.declared().items() if declared["cli"]]
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
    from ggwgpu.train import TrainOptions
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
    from ggwgpu.train import TrainOptions
    world = mpi_world()
    values = {name: kw[param_of(name)] for name, declared in TrainOptions.declared().items()
              if declared["cli"]}
    values["batch"] *= world.size if world else 1
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


def resumed_options(ctx, state: dict, checkpoint_in: str, fixed: dict):
    """The TrainOptions a resumed run uses: the checkpoint's, with those declared
    `may_change` (--lr, --flash-attn, --checkpointing) applied when given (and said). Any
    other option given on the command line that contradicts the checkpoint is refused,
    naming it: `fixed` maps the command's own such parameters (the model's shape, say) to
    the checkpoint's value, or to ... when the checkpoint fixes it whatever its value."""
    import dataclasses
    from ggwgpu.train import TrainOptions
    saved, kw, declared = TrainOptions(**state["options"]), ctx.params, TrainOptions.declared()
    may_change = [flag_of(name) for name in declared if declared[name]["may_change"]]
    may_change = (f"{', '.join(may_change[:-1])} and {may_change[-1]}" if len(may_change) > 1
                  else may_change[0])
    changes, clashes = {}, []
    for name, value in dataclasses.asdict(saved).items():
        param = param_of(name)
        if declared[name]["cli"] and given(ctx, param) and kw[param] != value:
            if declared[name]["may_change"]:
                changes[name] = kw[param]
            else:
                clashes.append(f"{flag_of(name)} {value} (given: {kw[param]})")
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
    return dataclasses.replace(saved, **changes)


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


def read_text(texts, corpus: str) -> tuple[str, str]:
    """The training text (the files, else the bundled corpus) and where it came from."""
    from ggwgpu import data
    try:
        if texts:
            return data.read_texts(texts), ", ".join(texts)
        return data.bundled_corpus(corpus), f"the bundled corpus ({corpus})"
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def training_samples(text: str, tokenizer, cfg, options, samples_after_nl: bool, state,
                     checkpoint_in):
    """The text's tokens, their digest and its shuffled samples, at the resumed position
    when `state` (a checkpoint's) is given — which must be of the same tokens."""
    from ggwgpu import data
    from ggwgpu.train import token_digest
    try:
        tokens = tokenizer.encode(text)
    except ValueError as e:         # VocabError: no token, not even a byte token, for a piece
        raise click.UsageError(f"the model's vocabulary cannot tokenize the text: {e}") from None
    digest = token_digest(tokens)
    if state is not None and state.get("tokens_digest") != digest:
        raise click.UsageError(f"{checkpoint_in} was trained on other text (tokens "
                               f"{state.get('tokens_digest')}, these are {digest}): pass "
                               "the same text files to resume")
    try:
        samples = data.Samples(tokens, cfg.n_ctx, options.batch, options.seed, tokenizer.bos_id,
                               after_newline=samples_after_nl,
                               newline_ids=tokenizer.newline_ids)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if state is not None:
        resume_data(samples, state, checkpoint_in)
    return tokens, digest, samples


def resume_data(samples, state: dict, checkpoint_in: str):
    """Put `samples` (data.Samples, chat.ExampleBatches) at the checkpoint's position."""
    from ggwgpu.data import DataError
    try:
        samples.load_state(state["data"])
    except DataError as e:
        raise click.UsageError(f"{checkpoint_in}: {e}") from None


def steps_of(kw: dict, samples, options) -> int:
    """--steps, or --epochs as steps over these samples."""
    if kw["steps"] == 0 and not kw["checkpoint_in"]:
        raise click.UsageError("--steps 0 writes OUT from a checkpoint: it needs "
                               "--checkpoint-in")
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
        click.option("--drop-long", cls=Repeated, is_flag=True,
                     help="Leave out examples longer than --n-ctx (default: cut them)."),
        click.option("--no-pack", cls=Repeated, is_flag=True,
                     help="One example per row, padded (default: several whole examples "
                          "packed into a row, each seeing only itself, when that makes "
                          "fewer rows)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def example_sets(kw: dict, tokenizer, splits=("train", "valid")) -> dict:
    """{split: encoded examples} of --data (only the splits asked for and present); the
    template is --chat-template's, else the model's, else ChatML."""
    from ggwgpu import chat
    try:
        sets = chat.load_dataset(kw["data_path"])
        template = chat_template(tokenizer, kw.get("chat_template"))
        return {split: [chat.encode_example(e, tokenizer, template, kw["mask_prompt"])
                        for e in sets[split]] for split in splits if split in sets}
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None


def example_batches(examples, cfg, batch: int, kw: dict, seed: int, pack=None):
    """ExampleBatches of --data's encoded examples, as --drop-long says: packed when that
    makes fewer rows, unless --no-pack; `pack` (True or False) decides instead (a validation
    set follows its training set, whose graph it runs on)."""
    from ggwgpu import chat
    if pack is None:
        pack = not kw["no_pack"] and "auto"
    try:
        return chat.ExampleBatches(examples, cfg.n_ctx, batch, seed,
                                   drop_long=kw["drop_long"], pack=pack)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


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
    if batches.truncated:
        line += f", {batches.truncated} cut to n_ctx"
    if batches.dropped:
        line += f", {batches.dropped} left out (longer than n_ctx with --drop-long, or " \
                f"nothing to train within it)"
    return line


class Validation:
    """The validation loss every `every` steps (and after the last): `check(step)` evaluates,
    calls `save_best()` when the loss is the lowest so far, and says when `patience`
    evaluations in a row brought no improvement (0: never stop early)."""

    def __init__(self, evaluate, every: int, patience: int, save_best):
        self.evaluate, self.every, self.patience, self.save_best = (evaluate, every, patience,
                                                                    save_best)
        self.best, self.since_best = float("inf"), 0

    def check(self, step: int, last: bool) -> dict | None:
        if step % self.every and not last:
            return None
        loss = self.evaluate()
        if loss < self.best:
            self.best, self.since_best = loss, 0
            self.save_best()
        else:
            self.since_best += 1
        return {"val_loss": loss,
                "stop": bool(self.patience) and self.since_best >= self.patience}
