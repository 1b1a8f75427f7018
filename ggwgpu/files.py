"""What every reader of an input file checks first: that it is a regular file (a FIFO never
ends or blocks, /dev/zero grows without bound, a directory is no file), and, for texts read
whole, that it is not larger than a bound.

Texts (training text, JSONL datasets) are read whole and decoded, which takes about twice
their size in memory and, for tokenizing, time in proportion: a file over MAX_TEXT_BYTES is
refused before it is read, naming the bound and how to raise it ($GGWGPU_MAX_TEXT_BYTES).
GGUF files are memory-mapped instead and bounded by gguf_file's own limits.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

TEXT_LIMIT_VAR = "GGWGPU_MAX_TEXT_BYTES"
MAX_TEXT_BYTES = 256 * 2 ** 20          # default: 256 MiB, tokenized in minutes, not hours


def file_kind(path) -> str:
    """'missing', 'directory', 'special' (a FIFO, a device or a socket), 'regular', or
    the reason it cannot be looked at."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(mode):
        return "directory"
    return "regular" if stat.S_ISREG(mode) else "special"


def regular_file_problem(path) -> str | None:
    """Why `path` cannot be read as an input file (missing, a directory, a FIFO, a device,
    a socket, not accessible), or None for a regular file."""
    kind = file_kind(path)
    return {"regular": None, "missing": "no such file",
            "directory": "is a directory, not a file",
            "special": "is not a regular file (a FIFO, a device or a socket); ggwgpu reads "
                       "inputs from regular files only"}.get(kind, kind)


def replace_problem(path) -> str | None:
    """Why an output cannot be written to `path` by renaming a new file onto it (as every
    writer here does): it exists and is a directory, a device, a FIFO or a socket (renaming
    onto /dev/null as root would replace the device), or None; a path that is missing or
    cannot be looked at is left to the write itself to report."""
    return {"directory": "is a directory",
            "special": "exists and is not a regular file (a device, a FIFO or a socket); "
                       "ggwgpu writes outputs as new files renamed into place"}.get(file_kind(path))


def positive_env(var: str, unit: str, error=ValueError) -> int | None:
    """The positive integer environment variable `var` holds (a limit, a thread count), None
    where it is unset; anything else raises `error` naming it and the `unit` it counts."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise error(f"${var} must be a positive number of {unit}, got {raw!r}")
    return value


def max_text_bytes() -> int:
    """The size bound of texts: $GGWGPU_MAX_TEXT_BYTES if set (a positive integer), else
    MAX_TEXT_BYTES."""
    value = positive_env(TEXT_LIMIT_VAR, "bytes")
    return MAX_TEXT_BYTES if value is None else value


def read_limited(path, error=ValueError) -> bytes:
    """The bytes of the regular file `path`, at most `max_text_bytes()` of them; anything
    else raises `error` with a message naming the file and the problem."""
    path = Path(path)
    problem = regular_file_problem(path)
    if problem:
        raise error(f"{path}: {problem}")
    try:
        limit = max_text_bytes()
    except ValueError as e:
        raise error(str(e)) from None
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # read(n) allocates n bytes up front: ask for the size, not the bound
            data = f.read(size + 1) if size <= limit else b""
            if len(data) > size:                        # it grew since: read on, bounded
                data += f.read(limit + 1 - len(data))
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if size > limit or len(data) > limit:
        raise error(f"{path}: is {max(size, len(data))} bytes or more, over the {limit} bytes "
                    f"ggwgpu reads as text (set ${TEXT_LIMIT_VAR} to raise the bound)")
    return data
