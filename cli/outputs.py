"""What every command that writes files checks before it starts, so that nothing the user
has is destroyed: no output is one of the command's inputs (the same file, by device and
inode, whatever the names) or another of its outputs, a --log that exists is a log, and each
output's directory can be written. And the lock that keeps two runs from writing the same
checkpoint.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

import click

from ggwgpu.files import replace_problem
from ggwgpu.gguf_file import temp_path

try:
    import fcntl
except ImportError:       # not POSIX: runs are not locked
    fcntl = None

LOG_HEAD = 1 << 16        # a log's first line is a JSON record, far shorter than this


def same_file(a, b) -> bool:
    """Whether paths a and b are one file: by device and inode when both exist (hard links,
    symlinks, ./x and x alike), else by their resolved paths."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_outputs(inputs, outputs, may_be=()):
    """Refuse (click.UsageError) an output that is one of the inputs or another output.
    `inputs` and `outputs` are (what, path) pairs, what being the option or argument that
    named it (None paths are left out); `may_be` holds (output what, input what) pairs that
    may be one file (a run that resumes from its own checkpoint and writes it again)."""
    outputs = [(what, path) for what, path in outputs if path is not None]
    for i, (what, path) in enumerate(outputs):
        for other, input_path in inputs:
            if input_path is not None and (what, other) not in may_be and \
                    same_file(path, input_path):
                raise click.UsageError(f"{what} {path} is the input {other} {input_path}: "
                                       f"writing it would destroy the input; choose another "
                                       f"path")
        for other, other_path in outputs[:i]:
            if same_file(path, other_path):
                raise click.UsageError(f"{what} {path} and {other} {other_path} are one file: "
                                       f"give them different paths")
        check_writable(what, path)


def check_writable(what, path):
    """The output's directory takes a new file (write permission, not a read-only file
    system, a name within the file system's limit): checked before any work by creating
    and removing the temporary file the write will make (gguf_file.temp_path), the longest
    name it writes."""
    problem = replace_problem(path)
    if problem:
        raise click.UsageError(f"{what} {path} {problem}")
    probe = temp_path(Path(os.path.abspath(path)))
    try:
        create_and_remove(probe)
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise click.UsageError(
                f"{what} {path}: the name is too long for the file system once ggwgpu "
                f"writes it as {probe.name[:12]}...{probe.name[-24:]} before renaming it "
                f"(it adds {len(probe.name) - len(Path(path).name)} bytes): choose a "
                f"shorter name") from None
        raise click.UsageError(f"{what} {path}: cannot write in {probe.parent} "
                               f"({e.strerror or e})") from None


def create_and_remove(path: Path):
    """Make the new file `path` and take it away again: the probe of check_writable."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(path)


def check_log(path):
    """A --log that exists must be a JSONL log (it is appended to): empty, or its first line
    a JSON object. A model, a text or a binary file is refused, naming it."""
    if path is None or not os.path.exists(path):
        return
    try:
        with open(path, "rb") as f:
            head = f.read(LOG_HEAD)
    except OSError as e:
        raise click.UsageError(f"--log {path} cannot be read ({e.strerror or e})") from None
    if not head:
        return
    if head.startswith(b"GGUF"):
        raise click.UsageError(f"--log {path} is a GGUF file, not a JSONL log: appending to "
                               f"it would spoil it; choose another path")
    try:
        record = json.loads(head.split(b"\n", 1)[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        record = None
    if not isinstance(record, dict):
        raise click.UsageError(f"--log {path} exists and is not a JSONL log (its first line "
                               f"is not a JSON record): appending to it would spoil it; "
                               f"choose another path")


class RunLock:
    """An exclusive lock on PATH.lock (fcntl.flock), held while a run may write PATH: a
    second run that would write the same file is refused, naming it. The lock file holds the
    owner's process id and is removed on release. Where fcntl is missing nothing is locked."""

    def __init__(self, path, what: str):
        self.path, self.what = path, what
        self.lock_path, self.fd = f"{path}.lock", None

    def __enter__(self):
        if fcntl is None:
            return self
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise click.UsageError(
                    f"another run (process {owner}) is writing {self.what} {self.path}: "
                    f"wait for it to end or choose another path (its lock: "
                    f"{self.lock_path})") from None
            # the file may have been removed by its previous owner since we opened it
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino:
                    break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.lock_path)
            os.close(self.fd)          # closing releases the lock
            self.fd = None
