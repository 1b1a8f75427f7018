"""The GGUF container: typed metadata and tensors written atomically, and read back through a
validated, bounded reader. It knows GGUF and ggml's limits, not what a file holds: the llama
schema is ggwgpu.gguf_llama, checkpoints are ggwgpu.training.checkpoint, adapters ggwgpu.lora and
vocabularies ggwgpu.tokenizer, each built on the functions here.

Writing (`write_gguf`, `write_metadata`) is atomic: a temporary file in the target's directory
(.NAME.ggwgpu-PID-HEX.tmp), flushed and fsynced, then renamed over the target, so the previous
file stays whole until the new one is complete, and a failure leaves it untouched and removes
the temporary file; those that a killed process left are removed by the next write of the same
target (`remove_stale_temps`). A full disk is said as such (`os_problem`). Nothing non-finite
is written (`checked_tensor`); Python values get their GGUF types in one place (`typed_value`).

Reading (`GGUFFile`, `read_metadata`; ggwgpu's own reader: gguf-py's does per-item work that a
hostile file turns into minutes) walks the memory-mapped file once, checking every count,
length and offset against the file size and the metadata against bounds on array items and
string bytes before reading it. Only regular files are read (not FIFOs or devices). Every
problem is a `GGUFError` naming the file and the key or tensor, never another exception, a
hang or an allocation sized by a forged count: tests/test_gguf_fuzz.py holds the readers to
that on mutated files and hostile metadata.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import re
import secrets
import struct
from pathlib import Path

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType,
                  GGUFValueType, GGUFWriter, Keys)

from .files import regular_file_problem, replace_problem
from .quant import TYPES, Quantized, dequantize, is_finite, type_of_ggml

# general.* keys, which every GGUF file has whatever its architecture.
K_ARCH = Keys.General.ARCHITECTURE
K_NAME = Keys.General.NAME
K_TYPE = Keys.General.TYPE
K_FILE_TYPE = Keys.General.FILE_TYPE
K_ALIGNMENT = Keys.General.ALIGNMENT

MAX_TENSOR_NAME = 63          # ggml's GGML_MAX_NAME (64) less the terminating NUL
MAX_DIMS = 4                  # ggml's GGML_MAX_DIMS
_T = GGUFValueType
INT_TYPES = {_T.UINT8, _T.INT8, _T.UINT16, _T.INT16, _T.UINT32, _T.INT32, _T.UINT64, _T.INT64}
FLOAT_TYPES = {_T.FLOAT32, _T.FLOAT64}


class GGUFError(ValueError):
    """A GGUF file cannot be written or read: the message names the file, the key or tensor,
    and the problem."""


# -- writing ----------------------------------------------------------------------------------


def checked_tensor(path, name, value, shape, what) -> np.ndarray:
    """Tensor `name` as it is written: a `Quantized` value unchanged, else a contiguous float32
    array; refused with a GGUFError ("cannot write `what`") unless it has `shape`, a float
    type, only finite values and a name ggml takes."""
    if isinstance(value, Quantized):
        if value.shape != tuple(shape):
            raise GGUFError(f"{path}: cannot write {what}: tensor {name} has shape "
                            f"{value.shape}, the config needs {tuple(shape)}")
        if not np.isfinite(dequantize(value)).all():
            raise GGUFError(f"{path}: cannot write {what}: tensor {name} holds non-finite "
                            f"values (NaN or infinity)")
        return value
    array = np.asarray(value)
    if array.shape != tuple(shape):
        raise GGUFError(f"{path}: cannot write {what}: tensor {name} has shape {array.shape}, "
                        f"the config needs {tuple(shape)}")
    if array.dtype.kind != "f":
        raise GGUFError(f"{path}: cannot write {what}: tensor {name} has dtype {array.dtype}, "
                        f"expected a float type")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        raise GGUFError(f"{path}: cannot write {what}: tensor {name} holds non-finite values "
                        f"(NaN or infinity)")
    if len(name.encode("utf-8")) > MAX_TENSOR_NAME:
        raise GGUFError(f"{path}: cannot write {what}: tensor name {name!r} is longer than "
                        f"ggml's {MAX_TENSOR_NAME} bytes")
    return array


def typed_value(path, key, value):
    """(value, GGUF type) of a Python value: str -> string, bool -> bool, int -> uint32
    (int64 outside its range), float -> float32, list of str/bool/int/float -> array of
    string/bool/int32/float32. An empty list gives None: GGUF cannot hold empty arrays."""
    def bad(why):
        return GGUFError(f"{path}: cannot write key {key!r}: {why}")

    if isinstance(value, (bool, np.bool_)):
        return bool(value), _T.BOOL
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if 0 <= value < 2 ** 32:
            return value, _T.UINT32
        if -2 ** 63 <= value < 2 ** 63:
            return value, _T.INT64
        raise bad(f"{value} does not fit 64 bits")
    if isinstance(value, (float, np.floating)):
        return float(value), _T.FLOAT32
    if isinstance(value, str):
        return value, _T.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        items = value.tolist() if isinstance(value, np.ndarray) else list(value)
        if not items:
            return None
        # gguf-py picks the array's element type from the Python type of its items.
        if all(isinstance(v, str) for v in items):
            return items, _T.ARRAY
        if all(isinstance(v, (bool, np.bool_)) for v in items):
            return [bool(v) for v in items], _T.ARRAY
        numbers = all(isinstance(v, (int, float, np.integer, np.floating))
                      and not isinstance(v, (bool, np.bool_)) for v in items)
        if numbers and all(isinstance(v, (int, np.integer)) for v in items):
            ints = [int(v) for v in items]
            if not all(-2 ** 31 <= v < 2 ** 31 for v in ints):
                raise bad("an integer array value does not fit int32")
            return ints, _T.ARRAY
        if numbers:
            return [float(v) for v in items], _T.ARRAY
        raise bad("array items must be all str, all bool, or all numbers")
    raise bad(f"values of type {type(value).__name__} cannot be stored")


def typed_metadata(path, meta: dict) -> dict:
    """`meta`'s Python values as key -> (value, GGUF type), as `typed_value` types them; keys
    of empty lists are left out."""
    typed = ((key, typed_value(path, key, value)) for key, value in meta.items())
    return {key: kind for key, kind in typed if kind is not None}


def write_metadata(path, meta: dict, arch: str = "llama"):
    """A GGUF file holding only metadata (a vocabulary, say): `meta`'s Python values typed as
    `typed_value` says (general.architecture from `meta`, else `arch`); written atomically."""
    typed = {K_ARCH: (meta.get(K_ARCH, arch), _T.STRING)}
    typed.update(typed_metadata(path, {k: v for k, v in meta.items() if k != K_ARCH}))
    write_gguf(path, typed, {})


def write_gguf(path, metadata: dict, tensors: dict[str, np.ndarray]):
    """Write `metadata` (key -> (value, GGUF type); general.architecture first) and
    `tensors` (name -> array, written with its dtype) to `path` atomically: a temporary file
    in the same directory, flushed and fsynced, then os.replace onto `path`. On any failure
    (or interrupt) the temporary file is removed and the old `path` is untouched."""
    path = Path(path)
    directory = path.parent
    problem = replace_problem(path)
    if problem:
        raise GGUFError(f"{path}: cannot write: {problem}")
    if not directory.is_dir():
        raise GGUFError(f"{path}: cannot write: directory {directory} does not exist")
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        # O_EXCL: never clobber another file; mode 0o666 less the umask, like open().
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise GGUFError(f"{path}: cannot create a temporary file in {directory}: "
                        f"{os_problem(e, directory)}") from None
    try:
        arch, _ = metadata[K_ARCH]
        writer = GGUFWriter(tmp, arch)      # adds general.architecture itself
        try:
            for key, (value, vtype) in metadata.items():
                if key != K_ARCH:
                    writer.add_key_value(key, value, vtype)
            for name, array in tensors.items():
                if isinstance(array, Quantized):     # raw blocks, one row of bytes per row
                    rows = array.data.reshape(array.shape[:-1] + (-1,))
                    writer.add_tensor(name, rows, raw_dtype=TYPES[array.dtype].ggml)
                else:
                    writer.add_tensor(name, array)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        with open(tmp, "rb+") as f:          # the data reaches the disk before the rename
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, (OverflowError, struct.error)):     # a float beyond float32, say
            raise GGUFError(f"{path}: cannot write: a value does not fit its GGUF type "
                            f"({e})") from None
        if isinstance(e, OSError):
            raise GGUFError(f"{path}: writing failed, the previous file is unchanged: "
                            f"{os_problem(e, directory)}") from e
        raise
    _fsync_directory(directory)


TEMP_MARK = "ggwgpu"      # in every temporary file's name: .NAME.ggwgpu-PID-HEX.tmp


def temp_path(path: Path) -> Path:
    """A new temporary name beside `path`, what write_gguf writes before renaming it:
    .NAME.ggwgpu-PID-HEX.tmp (27 bytes and more past NAME)."""
    return path.parent / f".{path.name}.{TEMP_MARK}-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def remove_stale_temps(path):
    """Remove the temporary files that writes of `path` left when their process was killed
    (SIGKILL, a crash): only names of the pattern above for this very target, and only those
    of processes that no longer run (a live one may be writing right now). POSIX only:
    elsewhere nothing is removed."""
    path = Path(path)
    if os.name != "posix" or not path.parent.is_dir():
        return
    pattern = re.compile(re.escape(f".{path.name}.{TEMP_MARK}-") + r"(\d+)-[0-9a-f]{8}\.tmp")
    for entry in os.scandir(path.parent):
        m = pattern.fullmatch(entry.name)
        if m and entry.is_file(follow_symlinks=False) and not _running(int(m[1])):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)          # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True              # someone else's process (or a forged number): leave it
    return True


def os_problem(e: OSError, where) -> str:
    """What an OSError of writing in `where` means, in words: a full disk is said as such."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk holding {where} is full (no space left on device)"
    return e.strerror or str(e)


def _fsync_directory(directory: Path):
    """Make the rename itself durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- reading ----------------------------------------------------------------------------------

def read_metadata(path) -> dict[str, object]:
    """Every metadata key of a GGUF file (key -> Python value), after the layout check.
    Raises GGUFError."""
    return GGUFFile(path).meta


class GGUFFile:
    """A GGUF file, layout-checked and parsed by `_read_layout`: `meta` (key -> Python value),
    `tensors` (name -> `StoredTensor`, memory-mapped; `tensor_value` copies one out)."""

    def __init__(self, path):
        self.path = path = Path(path)
        problem = regular_file_problem(path)
        if problem:
            raise GGUFError(f"{path}: {problem}")
        self.meta, self._kinds, self.tensors = _read_layout(path)

    def kind(self, key):
        return self._kinds.get(key)

    def _missing(self, key, default):
        """`default` for a key the file lacks; a GGUFError when there is none (...)."""
        if default is ...:
            raise GGUFError(f"{self.path}: required key {key} is missing")
        return default

    def str_key(self, key, default=...) -> str:
        """String key `key`, or `default` when the file lacks it."""
        if key not in self.meta:
            return self._missing(key, default)
        if self.kind(key) != _T.STRING:
            raise GGUFError(f"{self.path}: key {key} must be a string, got a value of GGUF "
                            f"type {self.kind(key).name}")
        return self.meta[key]

    def int_key(self, key, default=..., minimum=1) -> int:
        """Integer key `key` in [minimum, 2^31), or `default` when the file lacks it."""
        if key not in self.meta:
            return self._missing(key, default)
        value = self.meta[key]
        if self.kind(key) not in INT_TYPES or not minimum <= value < 2 ** 31:
            raise GGUFError(f"{self.path}: key {key} must be an integer in [{minimum}, 2^31), "
                            f"got {value!r}")
        return int(value)

    def float_key(self, key, default=..., allow_zero=False):
        """Positive finite number `key` (0 too with allow_zero), or `default` when the file
        lacks it."""
        if key not in self.meta:
            return self._missing(key, default)
        value = self.meta[key]
        if (self.kind(key) not in FLOAT_TYPES | INT_TYPES or not math.isfinite(value)
                or value < 0 or (value == 0 and not allow_zero)):
            raise GGUFError(f"{self.path}: key {key} must be a positive finite number, "
                            f"got {value!r}")
        return float(value)

    def numpy_shape(self, name) -> tuple[int, ...]:
        return self.tensors[name].shape

    def tensor_f32(self, name, shape) -> np.ndarray:
        """Tensor `name` as a float32 array of `shape` that owns its memory."""
        return self.tensor_value(name, shape)

    def tensor_value(self, name, shape, keep_quantized=False):
        """Tensor `name` of `shape`, owning its memory: a float32 array, or with
        keep_quantized a `Quantized` value when it is stored in a block type of
        ggwgpu.quant's TYPES (F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K)."""
        t = self.tensors[name]
        dtype = type_of_ggml(t.tensor_type)
        if t.tensor_type != GGMLQuantizationType.F32 and dtype is None:
            raise GGUFError(f"{self.path}: tensor {name} has type {t.tensor_type.name}; ggwgpu "
                            f"reads F32, {', '.join(v.ggml.name for v in TYPES.values())} "
                            f"tensors only")
        got = self.numpy_shape(name)
        if got != tuple(shape):
            raise GGUFError(f"{self.path}: tensor {name} has shape {got} (NumPy order) but the "
                            f"hyper-parameters need {tuple(shape)}")
        if dtype is None:
            value = np.array(t.data).view(np.float32).reshape(shape)
            finite = np.isfinite(value).all()
        else:
            value = Quantized(dtype, shape, np.array(t.data))
            finite = is_finite(value)
        if not finite:    # it would only surface later, as a NaN loss or sampling error
            raise GGUFError(f"{self.path}: tensor {name} holds non-finite values (NaN or "
                            f"infinity)")
        return value if keep_quantized or dtype is None else dequantize(value)


def field_value(field):
    """A gguf-py ReaderField as a Python value (the tests compare what gguf-py reads with
    what ggwgpu writes): `parts` holds the field's raw pieces and `data` the indices of the
    parts that are its value (one per array element)."""
    kind = field.types[0] if field.types else None
    if kind == _T.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == _T.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        if sub == _T.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if sub == _T.ARRAY:
            return None                       # nested arrays: no key ggwgpu reads has them
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if kind is None:
        return None
    return field.parts[field.data[0]].tolist()[0]

# -- reading the layout -----------------------------------------------------------------------
#
# ggwgpu reads a GGUF's header itself rather than through gguf-py's GGUFReader: that one makes
# NumPy views for every array item and tensor info, so a 4 MB file holding a nested array of
# 300k items took 26 s and 760 MB, and a 300k-token vocabulary seconds. Here every key is read
# once, scalar arrays in one go, and the work and memory are bounded before a value is read:
# array items of all keys together at most MAX_METADATA_ITEMS (a 300k-token vocabulary with
# scores, types and merges holds about 1.2 million), string bytes at most MAX_METADATA_BYTES,
# tensors at most MAX_TENSORS. A file beyond a bound is refused, naming the key and the bound.

MAX_METADATA_ITEMS = 1 << 21          # 2,097,152 array items, all keys together
MAX_METADATA_BYTES = 1 << 28          # 256 MiB of strings (a chat template is a few KiB)
MAX_TENSORS = 1 << 16                 # published llama files have at most a few thousand
_SCALAR_DTYPE = {_T.UINT8: "<u1", _T.INT8: "<i1", _T.UINT16: "<u2", _T.INT16: "<i2",
                 _T.UINT32: "<u4", _T.INT32: "<i4", _T.FLOAT32: "<f4", _T.BOOL: "?",
                 _T.UINT64: "<u8", _T.INT64: "<i8", _T.FLOAT64: "<f8"}
_SCALAR_FORMAT = {_T.UINT8: struct.Struct("<B"), _T.INT8: struct.Struct("<b"),
                  _T.UINT16: struct.Struct("<H"), _T.INT16: struct.Struct("<h"),
                  _T.UINT32: struct.Struct("<I"), _T.INT32: struct.Struct("<i"),
                  _T.FLOAT32: struct.Struct("<f"), _T.BOOL: struct.Struct("<?"),
                  _T.UINT64: struct.Struct("<Q"), _T.INT64: struct.Struct("<q"),
                  _T.FLOAT64: struct.Struct("<d")}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a file: its GGML type, its shape in NumPy order and its bytes (a view of
    the memory-mapped file)."""
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Bounded little-endian reads of a memory-mapped file: every length is checked against
    the bytes that remain, and every array and string against the budgets above, before it
    is read, so a forged count or size ends in a GGUFError, never a huge allocation or a
    long loop."""

    def __init__(self, data: np.ndarray, path):
        self.buf, self.size, self.path, self.pos = memoryview(data), len(data), path, 0
        self.items_left, self.bytes_left = MAX_METADATA_ITEMS, MAX_METADATA_BYTES

    def need(self, n, what):
        if n > self.size - self.pos:
            raise GGUFError(f"{self.path}: truncated or corrupt: reading {what} at offset "
                            f"{self.pos} takes {n} bytes, but the file ends at {self.size}")

    def unpack(self, fmt: struct.Struct, what):
        self.need(fmt.size, what)
        self.pos += fmt.size
        return fmt.unpack_from(self.buf, self.pos - fmt.size)[0]

    def u32(self, what) -> int:
        return self.unpack(_U32, what)

    def u64(self, what) -> int:
        return self.unpack(_U64, what)

    def text(self, what) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        if n > self.bytes_left:
            raise GGUFError(f"{self.path}: {what} is {n} bytes long; ggwgpu reads at most "
                            f"{MAX_METADATA_BYTES} bytes of metadata strings")
        self.bytes_left -= n
        self.pos += n
        try:
            return str(self.buf[self.pos - n:self.pos], "utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} at offset {self.pos - n} is not "
                            f"UTF-8") from None

    def texts(self, count, key) -> list[str]:
        """`count` strings, as `text` reads them but in a loop without per-item formatting
        (a 300k-token vocabulary); an item that fails a check goes through `text`, which
        says what is wrong with it."""
        buf, size, unpack = self.buf, self.size, _U64.unpack_from
        pos, bytes_left, items = self.pos, self.bytes_left, []
        for i in range(count):
            n = unpack(buf, pos)[0] if pos + 8 <= size else size
            end = pos + 8 + n
            try:
                if n > bytes_left or end > size:
                    raise ValueError
                items.append(str(buf[pos + 8:end], "utf-8"))
            except ValueError:          # UnicodeDecodeError too
                self.pos, self.bytes_left = pos, bytes_left
                return items + [self.text(f"item {i} of key {key}")] + self.texts(
                    count - i - 1, key)
            pos, bytes_left = end, bytes_left - n
        self.pos, self.bytes_left = pos, bytes_left
        return items

    def take_items(self, count, min_size, key):
        """Account for `count` array items of at least `min_size` bytes each."""
        self.need(count * min_size, f"{count} array items of key {key}")
        if count > self.items_left:
            raise GGUFError(f"{self.path}: key {key} has an array of {count} items; ggwgpu reads "
                            f"at most {MAX_METADATA_ITEMS} array items of metadata in all")
        self.items_left -= count


def _value_type(cur: _Cursor, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFError(f"{cur.path}: {what} has unknown value type {raw}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str):
    """The value of `key` as a Python value, an array as a list. Arrays of arrays are
    refused, as ggml's reader refuses them."""
    what = f"value of key {key}"
    if vtype in _SCALAR_FORMAT:
        return cur.unpack(_SCALAR_FORMAT[vtype], what)
    if vtype == _T.STRING:
        return cur.text(what)
    if vtype != _T.ARRAY:
        raise GGUFError(f"{cur.path}: key {key} has unsupported value type {vtype.name}")
    itype = _value_type(cur, cur.u32(f"array type of key {key}"), f"array of key {key}")
    count = cur.u64(f"array length of key {key}")
    if itype in _SCALAR_DTYPE:
        size = _SCALAR_FORMAT[itype].size
        cur.take_items(count, size, key)
        values = np.frombuffer(cur.buf, _SCALAR_DTYPE[itype], count, cur.pos)
        cur.pos += count * size
        return values.tolist()
    if itype != _T.STRING:
        raise GGUFError(f"{cur.path}: key {key} is an array of {itype.name}s; GGUF readers "
                        f"(ggml's too) read arrays of numbers, bools and strings only")
    cur.take_items(count, 8, key)                  # each string has its 8-byte length
    return cur.texts(count, key)


def _read_layout(path: Path):
    """(meta, value types, tensors) of the GGUF file at `path`, read with the bounds above;
    every tensor's type is known and its data lies inside the file. Raises GGUFError naming
    what is wrong."""
    size = path.stat().st_size
    if size < 4:
        raise GGUFError(f"{path}: not a GGUF file ({size} bytes: too short for the magic)")
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    cur = _Cursor(data, path)
    if cur.u32("magic") != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (wrong magic; expected 'GGUF')")
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    cur.need(n_kv * 13, f"{n_kv} metadata entries")       # >= 8 + 4 + 1 bytes each
    meta, kinds = {}, {}
    for i in range(n_kv):
        key = cur.text(f"name of metadata entry {i}")
        if key in meta:
            raise GGUFError(f"{path}: key {key} occurs twice")
        kinds[key] = _value_type(cur, cur.u32(f"type of key {key}"), f"key {key}")
        meta[key] = _read_value(cur, kinds[key], key)
    alignment = meta.get(K_ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if K_ALIGNMENT in meta:
        if kinds[K_ALIGNMENT] != _T.UINT32:
            raise GGUFError(f"{path}: key {K_ALIGNMENT} must be a uint32")
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: key {K_ALIGNMENT} = {alignment} is not a power of two")

    cur.need(n_tensors * 24, f"{n_tensors} tensor infos")   # >= 8 + 4 + 4 + 8 bytes each
    if n_tensors > MAX_TENSORS:
        raise GGUFError(f"{path}: the header counts {n_tensors} tensors; ggwgpu reads at most "
                        f"{MAX_TENSORS}")
    infos = []
    for i in range(n_tensors):
        name = cur.text(f"name of tensor {i}")
        if len(name.encode("utf-8")) > MAX_TENSOR_NAME:     # as ggml refuses them too
            raise GGUFError(f"{path}: the name of tensor {i} ({name[:20]!r}...) is longer "
                            f"than ggml's {MAX_TENSOR_NAME} bytes")
        n_dims = cur.u32(f"dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions (1 to "
                            f"{MAX_DIMS} allowed)")
        dims = [cur.u64(f"dimensions of tensor {name}") for _ in range(n_dims)]
        raw_type = cur.u32(f"type of tensor {name}")
        offset = cur.u64(f"data offset of tensor {name}")
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown type {raw_type}") from None
        if ttype not in GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name} has type {ttype.name}, which has no "
                            f"known block size")
        infos.append((name, dims, ttype, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, ttype, offset in infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name} occurs twice")
        block, type_size = GGML_QUANT_SIZES[ttype]
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} of type {ttype.name} has a first "
                            f"dimension {dims[0]} that is not a multiple of {block}")
        if offset % alignment:
            raise GGUFError(f"{path}: tensor {name} has data offset {offset}, not a "
                            f"multiple of the alignment {alignment}")
        start = data_start + offset
        end = start + math.prod(dims) // block * type_size
        if end > size:
            raise GGUFError(f"{path}: truncated or corrupt: the data of tensor {name} ends "
                            f"at byte {end}, but the file ends at {size}")
        tensors[name] = StoredTensor(ttype, tuple(reversed(dims)), data[start:end])
    return meta, kinds, tensors

