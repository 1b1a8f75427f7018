"""The step loop of a training run, which loses nothing when the run is stopped: `run_steps`
with a Reporter (a progress bar in the CLI, a line every few steps in Python), the JSON log
(RunLog), validation with early stopping (Validation), SIGINT/SIGTERM (StopSignals) and, under
MPI, the ranks' agreement on a stop.

A run that cannot go on raises TrainingError (its message says what was kept and how to go
on); a run stopped by a signal raises RunStopped after saving. The CLI turns both into its
messages and exit codes; a Python caller catches them.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass

from ..distributed import on_every_rank
from ..gguf_file import GGUFError, os_problem


class TrainingError(Exception):
    """A run that ends with a message, having kept what it could (`usage`: the caller's
    input is at fault, as a log path that cannot be opened)."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


class RunStopped(Exception):
    """A run stopped by a signal (after saving, where it could): a process should end with
    `exit_code`, 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


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


class Reporter:
    """What a run shows as it goes: `start(steps)`, `step(record, line)` after each step (the
    record as logged, the line a progress display shows), `note(message)` for what a person
    should read (a skipped step, an early stop, what was saved), `end()`. This one shows
    nothing."""

    def start(self, steps: int):
        pass

    def step(self, record: dict, line: str):
        pass

    def note(self, message: str):
        pass

    def end(self):
        pass


class PrintReporter(Reporter):
    """A line every `every` steps (and after the last) and every note, on standard error."""

    def __init__(self, every: int = 10, file=None):
        self.every, self.file, self.steps = every, file, 0

    def start(self, steps: int):
        self.steps = steps

    def step(self, record: dict, line: str):
        if record["step"] % self.every == 0 or record["step"] == self.steps:
            print(line, file=self.file or sys.stderr, flush=True)

    def note(self, message: str):
        print(message, file=self.file or sys.stderr, flush=True)


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


class RunLog:
    """The run's log: one JSON record per step, appended and flushed. A path that cannot be
    opened for appending (a directory, a read-only disk) is an error before the first step; a
    write that fails later (a full disk) is noted once and the run goes on without its log:
    the model and its checkpoints matter more."""

    def __init__(self, path, reporter: Reporter):
        self.path, self.file, self.reporter = path, None, reporter
        if path:
            try:
                self.file = open(path, "a", encoding="utf-8")
            except OSError as e:
                raise TrainingError(f"--log {path}: cannot be opened for appending "
                                    f"({e.strerror or e})", usage=True) from None

    def write(self, record: dict):
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as e:
            self.reporter.note(f"--log {self.path}: writing failed "
                               f"({os_problem(e, self.path)}); the run goes on without its log")
            self.close()

    def close(self):
        if self.file is not None:
            with contextlib.suppress(OSError):      # what a full disk kept from the log
                self.file.close()
            self.file = None


class Validation:
    """The validation loss every `every` steps (and after the last): `check(step)` evaluates
    (`evaluate()`: Trainer.evaluation's {"loss", and what else it measures}), calls
    `save_best()` when the loss is the lowest so far, and says when `patience` evaluations
    in a row brought no improvement (0: never stop early)."""

    def __init__(self, evaluate, every: int, patience: int, save_best):
        self.evaluate, self.every, self.patience, self.save_best = (evaluate, every, patience,
                                                                    save_best)
        self.best, self.since_best = float("inf"), 0

    def check(self, step: int, last: bool) -> dict | None:
        if step % self.every and not last:
            return None
        measured = self.evaluate()
        loss = measured["loss"]
        if loss < self.best:
            self.best, self.since_best = loss, 0
            self.save_best()
        else:
            self.since_best += 1
        return {**{f"val_{key}": value for key, value in measured.items()},
                "stop": bool(self.patience) and self.since_best >= self.patience}


@dataclass
class RunResult:
    """What `run_steps` did: the first and last loss (None without steps), seconds taken."""
    first: float | None
    last: float | None
    seconds: float


def run_steps(trainer, steps: int, *, log_path=None, save_every: int = 0, save_checkpoint=None,
              checkpoint_path=None, resume_command=None, on_nan: str = "stop",
              validation: Validation | None = None, write_result=None, result_path=None,
              reporter: Reporter | None = None) -> RunResult:
    """Run `steps` optimizer steps of `trainer`: a JSON line per step to `log_path`,
    `save_checkpoint()` every `save_every` steps (0: never) and once at the end, and with a
    `Validation` its loss in the log and the progress line, stopping early when it says so;
    then `write_result()` writes the run's product (`result_path`).

    Nothing is lost when a run stops early. `save_checkpoint()` writes `checkpoint_path`
    (atomically: the previous file stays whole until the new one is complete) and
    `resume_command(steps_left)` is the command line that continues from it.
    - SIGINT, SIGTERM: the step under way finishes, a checkpoint is saved, what continues is
      noted and RunStopped is raised.
    - A step whose loss or gradients are not finite changes nothing (Trainer skips its
      update); with on_nan "stop" the run then saves and ends (TrainingError), with "skip"
      it goes on. With dynamic loss scaling a step whose loss is finite but whose scaled
      gradients overflowed ("overflow" in its record) is the scaler's ordinary skip: the
      scale halves and the run goes on.
    - The device failing (lost, out of memory) ends the run; nothing of the failed step is
      saved and the last checkpoint stays.
    - A checkpoint that cannot be written (a non-finite value, a full disk) ends the run; the
      previous one stays.
    - The signal handlers stay until the result is written: a signal then waits for it. A
      result that cannot be written (a full disk) leaves the trained weights in the
      checkpoint, with the command that writes the result from it.
    - A log that cannot be written (a full disk) is given up with one note; the run goes on.
    """
    reporter = reporter or Reporter()
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
                raise TrainingError(f"step {trainer.step}: the checkpoint was not written "
                                    f"({e}); {kept()}") from None
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
        except TrainingError as e:
            return str(e)

    def write():
        if write_result is None:
            return
        try:
            write_result()
        except (GGUFError, *device_errors()) as e:
            raise TrainingError(f"{result_path} was not written ({e}); {rescue()}") from None

    def validate(record, last_step) -> dict | None:
        try:        # the best weights' write fails as the result's does: the run is kept
            return validation and validation.check(record["step"], last_step)
        except (GGUFError, *device_errors()) as e:
            raise TrainingError(f"step {record['step']}: the best weights were not written "
                                f"({e}); {rescue()}") from None

    log = RunLog(log_path, reporter)
    try:
        with signals:
            reporter.start(steps)
            try:
                for _ in range(steps):
                    try:
                        # under MPI the ranks agree on a stop through the step's allreduce
                        record = (trainer.train_step(stop=signals.signum or 0)
                                  if trainer.world else trainer.train_step())
                    except device_errors() as e:
                        raise TrainingError(
                            f"the device failed in step {trainer.step + 1} "
                            f"({type(e).__name__}: {e}); nothing of that step was saved; "
                            f"{kept()}") from None
                    agreed = record.pop("stop", None)
                    status = record.pop("status", None)       # L-BFGS's
                    if status is not None:
                        record["status"] = str(status)
                    elapsed = time.perf_counter() - t0
                    record["tokens_per_s"] = (trainer.step_tokens * (record["step"] - start)
                                              / elapsed)
                    first = record["loss"] if first is None else first
                    last = record["loss"]
                    shown["text"] = (f"step {record['step']} loss {last:.3f} "
                                     f"{record['tokens_per_s']:.0f} tok/s lr {record['lr']:.2e}")
                    if "loss_scale" in record:
                        shown["text"] += f" scale 2^{math.log2(record['loss_scale']):.0f}"
                    if "accuracy" in record:        # a preference objective's
                        shown["text"] += (f" acc {record['accuracy']:.2f} margin "
                                          f"{record['margin']:.2f}")
                    val = validate(record, record["step"] - start == steps)
                    if val:
                        record.update({k: v for k, v in val.items() if k != "stop"})
                        shown["val"] = f" val {val['val_loss']:.3f}" + (
                            f" val acc {val['val_accuracy']:.2f}" if "val_accuracy" in val
                            else "")
                    shown["text"] += shown.get("val", "")
                    log.write(record)
                    if record["skipped"] and not record.get("overflow"):
                        what = (f"step {record['step']}: loss {record['loss']:.4g}, gradient "
                                f"norm {record['grad_norm']:.4g}: not finite, so its update "
                                f"was skipped")
                        if on_nan == "stop":
                            raise on_every_rank(TrainingError(
                                f"{what} and training stops (--on-nan stop; --on-nan skip "
                                f"goes on without such steps). A learning rate that is too "
                                f"high is the usual cause. {rescue()}"))
                        reporter.note(f"{what} (--on-nan skip)")
                    if status is not None and status.kind == "failed" and not record["skipped"]:
                        raise TrainingError(
                            f"step {record['step']}: the L-BFGS line search failed "
                            f"({status.why}); the weights are as before that step. "
                            f"--lbfgs-on-fail reset retries along the gradient. {rescue()}")
                    if save_every and record["step"] % save_every == 0:
                        save()
                    reporter.step(record, shown["text"])
                    if val and val["stop"]:
                        reporter.note(f"early stop after step {record['step']}: "
                                      f"{validation.patience} evaluations without a lower "
                                      f"validation loss (best {validation.best:.4f})")
                        break
                    if status is not None and status.kind == "converged":
                        reporter.note(f"L-BFGS stops after step {record['step']}: "
                                      f"{status.why}")
                        break
                    stop = signals.signum if agreed is None else agreed
                    if stop:
                        break
                if stop and trainer.step - start < steps:
                    reporter.note(f"{signal.Signals(stop).name}: stopped after step "
                                  f"{trainer.step}; {save_and_resume_hint()}")
                    raise on_every_rank(RunStopped(stop))
                with signals.saving():     # from here on a signal waits for the files
                    if save_every:
                        save()
                    write()
            finally:
                reporter.end()
    except KeyboardInterrupt:
        reporter.note(f"stopped at once by a second signal in step {trainer.step + 1}, which "
                      f"was not saved; {kept()}")
        raise RunStopped(signals.signum or signal.SIGINT) from None
    finally:
        log.close()
    return RunResult(first, last, time.perf_counter() - t0)
