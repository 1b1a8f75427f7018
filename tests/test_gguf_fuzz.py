"""Hostile GGUF files: hypothesis mutates small valid files (an f32 model, a checkpoint, a
vocabulary, a Q8_0/Q4_0/F16 model, a LoRA adapter, a qwen35 hybrid) by byte flips, truncation, integer fields
of the header, metadata and tensor infos overwritten with boundary values, bytes inserted or
deleted and tensor infos swapped, and each file's loader must either return a well-formed
result or raise GGUFError naming the file. Any other exception fails, and so does an example
slower than the deadline (a hang, a huge allocation).

Derandomized: CI tries the same files on every run. The count of files tried and how they
ended is printed in pytest's closing summary."""
import collections
import dataclasses
import os
from datetime import timedelta

import numpy as np
import pytest
from gguf import GGUFValueType
from hypothesis import given, settings
from hypothesis import strategies as st

from ggwgpu import gguf_file
from ggwgpu.training import RunState
from ggwgpu.training.checkpoint import load_checkpoint, save_checkpoint
from ggwgpu.gguf_file import GGUFError
from ggwgpu.gguf_llama import load_model, save_model
from ggwgpu.lora import Adapter, init_adapter, load_adapter, lora_ranks, save_adapter
from ggwgpu.models import LORA_A, LORA_B, ModelConfig, init_parameters, parameter_shapes
from ggwgpu.quant import dequantize, quantize, quantize_model
from ggwgpu.tokenizer import (BYTE, CONTROL, NORMAL, UNKNOWN, SentencePieceVocab, VocabError,
                              load_vocab)
from conftest import train_state

# Files per base; GGWGPU_FUZZ_EXAMPLES=20000 runs a longer search.
EXAMPLES = int(os.environ.get("GGWGPU_FUZZ_EXAMPLES", 500))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None,
                deadline=timedelta(seconds=2))

CFG = ModelConfig(n_vocab=9, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=4)
# a hybrid: a gated delta-net and a gated attention layer, and the keys they bring (ssm.*,
# rope sections, recurrent layers as an array)
HYBRID = ModelConfig(n_vocab=9, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=4, n_rot=2,
                     n_layer=2, n_ff=12, n_ctx=4, recurrent_layers=(1,), conv_kernel=3,
                     ssm_state=2, ssm_heads=2, ssm_groups=1, rope_sections=(1, 0, 0, 0),
                     arch="qwen35")
QCFG = ModelConfig(n_vocab=9, n_embd=32, n_head=2, n_layer=1, n_ff=32, n_ctx=4)
VOCAB = SentencePieceVocab(["<unk>", "<s>", "</s>", "\u2581", "a", "b", "ab", "<0x0A>", "<0x41>"],
                           [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -0.5, 0.0, 0.0],
                           [UNKNOWN, CONTROL, CONTROL, NORMAL, NORMAL, NORMAL, NORMAL, BYTE, BYTE])

# Values a forged count, length, offset or type likes to take.
BOUNDARY = [0, 1, 2, 3, 4, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 63,
            2 ** 64 - 1]
_T = GGUFValueType
_SCALAR_SIZE = {_T.UINT8: 1, _T.INT8: 1, _T.UINT16: 2, _T.INT16: 2, _T.UINT32: 4, _T.INT32: 4,
                _T.FLOAT32: 4, _T.BOOL: 1, _T.UINT64: 8, _T.INT64: 8, _T.FLOAT64: 8}


@dataclasses.dataclass
class Base:
    """A valid file and where its structure lies: every integer or float field of the
    header, metadata and tensor infos as (offset, size), each tensor info's byte span, and
    each metadata entry as (start, offset of its value type, end)."""
    data: bytes
    fields: list
    infos: list
    header_end: int
    kvs: list


def layout(data: bytes) -> Base:
    pos, fields, kvs = 4, [], []

    def field(size):
        nonlocal pos
        fields.append((pos, size))
        pos += size
        return int.from_bytes(data[pos - size:pos], "little")

    def string():
        nonlocal pos
        length = field(8)
        pos += length

    def value(vtype):
        if vtype == _T.STRING:
            string()
        elif vtype == _T.ARRAY:
            item_type, count = field(4), field(8)
            for _ in range(count):
                value(item_type)
        else:
            field(_SCALAR_SIZE[vtype])

    field(4)                                    # version
    n_tensors, n_kv = field(8), field(8)
    for _ in range(n_kv):
        start = pos
        string()                                # the key
        type_at = pos
        value(field(4))
        kvs.append((start, type_at, pos))
    infos = []
    for _ in range(n_tensors):
        start = pos
        string()                                # the name
        for _ in range(field(4)):
            field(8)                            # dimensions
        field(4), field(8)                      # type, data offset
        infos.append((start, pos))
    return Base(data, fields, infos, pos, kvs)


def vocab_file(path):
    """A vocabulary-only GGUF, as a tokenizer would be shipped: no tensors."""
    meta = {gguf_file.K_ARCH: ("llama", _T.STRING)}
    meta.update({key: gguf_file.typed_value(path, key, value)
                 for key, value in VOCAB.gguf_metadata().items()})
    gguf_file.write_gguf(path, meta, {})


def quantized_model_file(path):
    """Q8_0 matrices, one Q4_0 and one F16 (rows of 32 values: n_embd = n_ff = 32)."""
    params = quantize_model(init_parameters(QCFG, 0), "q8_0")
    for name, dtype in (("blk.0.attn_k.weight", "q4_0"), ("blk.0.ffn_up.weight", "f16")):
        params[name] = quantize(dequantize(params[name]), dtype)
    save_model(path, QCFG, params, VOCAB)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bases")
    params = init_parameters(CFG, 0)
    moments = {n: (np.full(s, 0.5, np.float32), np.full(s, 0.25, np.float32))
               for n, s in parameter_shapes(CFG).items()}
    save_model(folder / "model", CFG, params, VOCAB)
    save_checkpoint(folder / "checkpoint", CFG, params, VOCAB, moments, train_state(3))
    vocab_file(folder / "vocab")
    quantized_model_file(folder / "quantized")
    save_adapter(folder / "adapter", init_adapter(CFG, lora_ranks(CFG, r=2), alpha=4.0), CFG)
    save_model(folder / "hybrid", HYBRID, init_parameters(HYBRID, 0), VOCAB)
    return {kind: layout((folder / kind).read_bytes()) for kind in LOADERS}


# -- mutations ----------------------------------------------------------------------------

def mutations(base: Base):
    """Tagged tuples, applied by `mutate`; offsets are taken modulo the current length."""
    n = len(base.data)
    offset = st.integers(0, base.header_end) | st.integers(0, n - 1)   # mostly the header
    value = st.sampled_from(BOUNDARY) | st.integers(0, 64) | st.integers(n - 64, n + 64)
    kinds = [st.tuples(st.just("flip"), offset, st.integers(1, 255)),
             st.tuples(st.just("truncate"), st.integers(0, n - 1)),
             st.tuples(st.just("overwrite"), st.sampled_from(base.fields), value),
             st.tuples(st.just("insert"), offset, st.binary(min_size=1, max_size=16)),
             st.tuples(st.just("delete"), offset, st.integers(1, 16))]
    if len(base.infos) > 1:
        pairs = st.lists(st.sampled_from(base.infos), min_size=2, max_size=2, unique=True)
        kinds.append(st.tuples(st.just("swap"), pairs.map(sorted)))
    return st.lists(st.one_of(kinds), min_size=1, max_size=3)


def mutate(data: bytes, steps) -> bytes:
    for kind, *args in steps:
        if not data:
            break
        if kind == "flip":
            at, mask = args[0] % len(data), args[1]
            data = data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]
        elif kind == "truncate":
            data = data[:args[0]]
        elif kind == "overwrite":
            (at, size), value = args
            data = data[:at] + (value % 2 ** (8 * size)).to_bytes(size, "little") + \
                data[at + size:]
        elif kind == "insert":
            at = args[0] % (len(data) + 1)
            data = data[:at] + args[1] + data[at:]
        elif kind == "delete":
            at = args[0] % len(data)
            data = data[:at] + data[at + args[1]:]
        elif kind == "swap":
            (a0, a1), (b0, b1) = args[0]
            data = data[:a0] + data[b0:b1] + data[a1:b0] + data[a0:a1] + data[b1:]
    return data


# -- what a load may give ----------------------------------------------------------------

def check_vocab(tok):
    """The vocabulary tokenizes, or says why it cannot (a mutated one may lack a byte token:
    a VocabError at encode time, which names no file)."""
    assert tok.n_vocab >= 1
    try:
        ids = tok.encode("ab a\n")
    except VocabError:
        return
    assert ((0 <= ids) & (ids < tok.n_vocab)).all()
    assert isinstance(tok.decode(ids), str)


def check_model(result):
    cfg, params, tok = result
    assert isinstance(cfg, ModelConfig)
    shapes = parameter_shapes(cfg)
    assert list(params) == list(shapes)
    for name, shape in shapes.items():
        assert params[name].shape == shape and params[name].dtype == np.float32
    assert tok.n_vocab == cfg.n_vocab
    check_vocab(tok)


def check_checkpoint(result):
    check_model(result[:3])
    params, opt_state, train_state = result[1], result[3], result[4]
    for name, (m, v) in opt_state.items():
        assert m.shape == v.shape == params[name].shape
    assert isinstance(train_state, RunState)


def check_adapter(adapter):
    assert isinstance(adapter, Adapter) and adapter.weights()
    for weight in adapter.weights():          # shapes: load_adapter checked them against CFG
        assert adapter.tensors[weight + LORA_A].dtype == np.float32
        assert adapter.tensors[weight + LORA_B].dtype == np.float32
        assert np.isfinite(adapter.scale(weight))


# base file -> (loader, check of its result)
LOADERS = {"model": (load_model, check_model), "checkpoint": (load_checkpoint, check_checkpoint),
           "vocab": (load_vocab, check_vocab), "quantized": (load_model, check_model),
           "adapter": (lambda path: load_adapter(path, CFG), check_adapter),
           "hybrid": (load_model, check_model)}

TALLY = collections.Counter()


class _Summary:
    """Prints the tally in pytest's closing summary, for the record."""

    def pytest_terminal_summary(self, terminalreporter):
        for what, tally in (("mutated files", TALLY),
                            ("files with hostile metadata values", STRUCTURE_TALLY)):
            if tally["files"]:
                terminalreporter.write_line(
                    f"gguf fuzz: {tally['files']} {what}: {tally['loaded']} loaded, "
                    f"{tally['refused']} refused with GGUFError, {tally['crashed']} crashed")


@pytest.fixture(scope="module")
def summary(request):
    if not request.config.pluginmanager.has_plugin("gguf-fuzz-summary"):
        request.config.pluginmanager.register(_Summary(), "gguf-fuzz-summary")


def load_or_refuse(kind, path, data, tally):
    """The loader of `kind` on `data`: a well-formed result or a GGUFError naming the file;
    anything else is counted as a crash and fails."""
    load, check = LOADERS[kind]
    path.write_bytes(data)
    tally["files"] += 1
    try:
        result = load(path)
    except GGUFError as e:
        assert str(path) in str(e), str(e)
        tally["refused"] += 1
    except BaseException:
        tally["crashed"] += 1
        raise
    else:
        check(result)
        tally["loaded"] += 1


@pytest.mark.parametrize("kind", LOADERS)
# a forged f16 scale of inf times a 0 quant: NumPy warns, the weight is NaN, as in the file
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_mutated_files_load_or_raise_gguf_error(kind, bases, summary, tmp_path):
    base, path = bases[kind], tmp_path / f"mutated-{kind}"

    @FUZZ
    @given(mutations(base))
    def run(steps):
        load_or_refuse(kind, path, mutate(base.data, steps), TALLY)

    run()


# -- structure-aware mutations ------------------------------------------------------------
# Whole metadata values rewritten, framed as GGUF frames them but hostile inside: a key of
# another type than its meaning (llama.context_length as a string, the token list as
# floats), array counts and string lengths that lie, huge counts, arrays of arrays, unknown
# value types, duplicated and added keys. The header is rebuilt and the tensor data put at
# the aligned offset after it, so only the metadata is wrong.

ALIGNMENT = 32          # what save_model writes (no general.alignment key)
STRUCTURE_EXAMPLES = max(EXAMPLES // 10, 20)      # 50 a loader: a few seconds
STRUCTURE_FUZZ = settings(FUZZ, max_examples=STRUCTURE_EXAMPLES)
STRUCTURE_TALLY = collections.Counter()


def u32(n):
    return (n % 2 ** 32).to_bytes(4, "little")


def u64(n):
    return (n % 2 ** 64).to_bytes(8, "little")


def array(itype, items, count=None):
    return int(_T.ARRAY), u32(itype) + u64(len(items) if count is None else count) + \
        b"".join(items)


def raw_values():
    """(value type code, value bytes) of one metadata value."""
    text = st.binary(max_size=12) | st.text(max_size=12).map(str.encode)
    lie = st.integers(-3, 3).filter(bool) | st.sampled_from(BOUNDARY)
    scalar_type = st.sampled_from(sorted(_SCALAR_SIZE))
    scalar = scalar_type.flatmap(lambda t: st.binary(min_size=_SCALAR_SIZE[t],
                                                     max_size=_SCALAR_SIZE[t]).map(
        lambda b: (int(t), b)))
    string = text.map(lambda b: (int(_T.STRING), u64(len(b)) + b))
    lying_string = st.tuples(text, lie).map(
        lambda a: (int(_T.STRING), u64(len(a[0]) + a[1]) + a[0]))
    scalar_items = scalar_type.flatmap(lambda t: st.tuples(st.just(int(t)), st.lists(
        st.binary(min_size=_SCALAR_SIZE[t], max_size=_SCALAR_SIZE[t]), max_size=6)))
    string_items = st.tuples(st.just(int(_T.STRING)), st.lists(
        text.map(lambda b: u64(len(b)) + b), max_size=6))
    items = scalar_items | string_items
    plain_array = items.map(lambda a: array(*a))
    lying_array = st.tuples(items, lie).map(lambda a: array(*a[0], count=len(a[0][1]) + a[1]))
    huge_count = st.sampled_from([gguf_file.MAX_METADATA_ITEMS + 1, 2 ** 32, 2 ** 63]).map(
        lambda n: array(int(_T.BOOL), [b"\1"] * 16, count=n))
    nested = st.lists(plain_array.map(lambda v: v[1]), max_size=4).map(
        lambda xs: array(int(_T.ARRAY), xs))
    # 1.2 MB of 100k empty arrays: gguf-py's reader took seconds over them (the deadline)
    many_nested = st.just(array(int(_T.ARRAY), [u32(int(_T.UINT8)) + u64(0)] * 100_000))
    unknown_type = st.sampled_from([13, 255, 2 ** 32 - 1]).map(lambda t: (t, b"\0" * 8))
    return st.one_of(scalar, string, lying_string, plain_array, lying_array, huge_count,
                     nested, many_nested, unknown_type)


def structure_mutations(base: Base):
    entry = st.integers(0, len(base.kvs) - 1)
    name = st.sampled_from(["dup", "new"])
    return st.lists(st.one_of(st.tuples(st.just("retype"), entry, raw_values()),
                              st.tuples(st.just("insert"), entry, name, raw_values())),
                    min_size=1, max_size=2)


def restructure(base: Base, steps) -> bytes:
    """`base` with its metadata entries edited by `steps`, its tensor infos and data
    unchanged (the data at the aligned offset after the new header)."""
    data = base.data
    entries = [[data[start:type_at], data[type_at:end]] for start, type_at, end in base.kvs]
    for kind, at, *args in steps:
        if kind == "retype":
            vtype, payload = args[0]
            entries[at][1] = u32(vtype) + payload
        else:
            how, (vtype, payload) = args
            key = entries[at][0] if how == "dup" else u64(9) + b"evil.key0"
            entries.insert(at, [key, u32(vtype) + payload])
    kv_end = base.kvs[-1][2]
    header = data[:16] + u64(len(entries)) + b"".join(k + v for k, v in entries) + \
        data[kv_end:base.header_end]
    data_start = -(-base.header_end // ALIGNMENT) * ALIGNMENT
    return header + bytes(-len(header) % ALIGNMENT) + data[data_start:]


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_hostile_metadata_values_load_or_raise_gguf_error(kind, bases, summary, tmp_path):
    base, path = bases[kind], tmp_path / f"restructured-{kind}"
    assert restructure(base, []) == base.data       # the rebuild itself changes nothing

    @STRUCTURE_FUZZ
    @given(structure_mutations(base))
    def run(steps):
        load_or_refuse(kind, path, restructure(base, steps), STRUCTURE_TALLY)

    run()


@pytest.mark.parametrize("kind", [k for k in LOADERS if k != "vocab"])   # (it reads no arch)
def test_an_architecture_stored_as_an_array_is_refused_by_name(kind, bases, tmp_path):
    """The one crash the fuzzers found: general.architecture as an array of strings."""
    base = bases[kind]
    at = next(i for i, (start, type_at, _) in enumerate(base.kvs)
              if base.data[start:type_at].endswith(b"general.architecture"))
    value = array(int(_T.STRING), [u64(5) + b"llama"] * 2)
    path = tmp_path / "array-arch.gguf"
    path.write_bytes(restructure(base, [("retype", at, value)]))
    with pytest.raises(GGUFError, match="general.architecture must be a string"):
        LOADERS[kind][0](path)


@pytest.mark.parametrize("kind", LOADERS)
def test_unmutated_bases_load(kind, bases, tmp_path):
    """The fuzzer starts from files that load: the mutations, not the bases, are refused."""
    path = tmp_path / kind
    path.write_bytes(bases[kind].data)
    load, check = LOADERS[kind]
    check(load(path))
