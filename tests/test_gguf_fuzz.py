"""Hostile GGUF files: hypothesis mutates small valid files (an f32 model, a checkpoint, a
vocabulary, a Q8_0/Q4_0/F16 model, a LoRA adapter) by byte flips, truncation, integer fields
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

from ggwgpu import gguf_io
from ggwgpu.gguf_io import GGUFError, load_checkpoint, load_model, save_checkpoint, save_model
from ggwgpu.lora import Adapter, init_adapter, load_adapter, lora_ranks, save_adapter
from ggwgpu.models.llama import LORA_A, LORA_B, LlamaConfig, init_parameters, parameter_shapes
from ggwgpu.quant import dequantize, quantize, quantize_model
from ggwgpu.tokenizer import (BYTE, CONTROL, NORMAL, UNKNOWN, SentencePieceVocab, VocabError,
                              load_vocab)
from conftest import train_state

# Files per base; GGWGPU_FUZZ_EXAMPLES=20000 runs a longer search.
EXAMPLES = int(os.environ.get("GGWGPU_FUZZ_EXAMPLES", 500))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None,
                deadline=timedelta(seconds=2))

CFG = LlamaConfig(n_vocab=9, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=4)
QCFG = LlamaConfig(n_vocab=9, n_embd=32, n_head=2, n_layer=1, n_ff=32, n_ctx=4)
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
    header, metadata and tensor infos as (offset, size), and each tensor info's byte span."""
    data: bytes
    fields: list
    infos: list
    header_end: int


def layout(data: bytes) -> Base:
    pos, fields = 4, []

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
        string()                                # the key
        value(field(4))
    infos = []
    for _ in range(n_tensors):
        start = pos
        string()                                # the name
        for _ in range(field(4)):
            field(8)                            # dimensions
        field(4), field(8)                      # type, data offset
        infos.append((start, pos))
    return Base(data, fields, infos, pos)


def vocab_file(path):
    """A vocabulary-only GGUF, as a tokenizer would be shipped: no tensors."""
    meta = {gguf_io.K_ARCH: ("llama", _T.STRING)}
    meta.update({key: gguf_io._typed(path, key, value)
                 for key, value in VOCAB.gguf_metadata().items()})
    gguf_io._write_gguf(path, meta, {})


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
    assert isinstance(cfg, LlamaConfig)
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
    assert isinstance(train_state, dict)


def check_adapter(adapter):
    assert isinstance(adapter, Adapter) and adapter.weights()
    for weight in adapter.weights():          # shapes: load_adapter checked them against CFG
        assert adapter.tensors[weight + LORA_A].dtype == np.float32
        assert adapter.tensors[weight + LORA_B].dtype == np.float32
        assert np.isfinite(adapter.scale(weight))


# base file -> (loader, check of its result)
LOADERS = {"model": (load_model, check_model), "checkpoint": (load_checkpoint, check_checkpoint),
           "vocab": (load_vocab, check_vocab), "quantized": (load_model, check_model),
           "adapter": (lambda path: load_adapter(path, CFG), check_adapter)}

TALLY = collections.Counter()


class _Summary:
    """Prints the tally in pytest's closing summary, for the record."""

    def pytest_terminal_summary(self, terminalreporter):
        if TALLY["files"]:
            terminalreporter.write_line(
                f"gguf fuzz: {TALLY['files']} mutated files: {TALLY['loaded']} loaded, "
                f"{TALLY['refused']} refused with GGUFError, {TALLY['crashed']} crashed")


@pytest.fixture(scope="module")
def summary(request):
    if not request.config.pluginmanager.has_plugin("gguf-fuzz-summary"):
        request.config.pluginmanager.register(_Summary(), "gguf-fuzz-summary")


@pytest.mark.parametrize("kind", LOADERS)
# a forged f16 scale of inf times a 0 quant: NumPy warns, the weight is NaN, as in the file
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_mutated_files_load_or_raise_gguf_error(kind, bases, summary, tmp_path):
    base, path = bases[kind], tmp_path / f"mutated-{kind}"
    load, check = LOADERS[kind]

    @FUZZ
    @given(mutations(base))
    def run(steps):
        path.write_bytes(mutate(base.data, steps))
        TALLY["files"] += 1
        try:
            result = load(path)
        except GGUFError as e:
            assert str(path) in str(e), str(e)
            TALLY["refused"] += 1
        except BaseException:
            TALLY["crashed"] += 1
            raise
        else:
            check(result)
            TALLY["loaded"] += 1

    run()


@pytest.mark.parametrize("kind", LOADERS)
def test_unmutated_bases_load(kind, bases, tmp_path):
    """The fuzzer starts from files that load: the mutations, not the bases, are refused."""
    path = tmp_path / kind
    path.write_bytes(bases[kind].data)
    load, check = LOADERS[kind]
    check(load(path))
