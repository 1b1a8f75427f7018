"""GGUF models and checkpoints: what gguf-py reads back is bit-exact, checkpoints round-trip
with their optimizer and training state, writes are atomic, and every malformed file is a
GGUFError naming the file and the key or tensor."""
import dataclasses
import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from ggwgpu import gguf_file, gguf_llama
from ggwgpu.training.checkpoint import load_checkpoint, save_checkpoint
from ggwgpu.gguf_file import GGUFError
from ggwgpu.gguf_llama import load_model, save_model
from ggwgpu.models import ModelConfig, init_parameters, parameter_shapes
from ggwgpu.tensor import ShapeError
from ggwgpu.tokenizer import ByteTokenizer
from conftest import train_state

TINY = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=5)
T = GGUFValueType


class TinyVocab:
    """A stand-in tokenizer: 11 SentencePiece-style tokens, with every key type the
    tokenizer interface uses."""

    def gguf_metadata(self):
        tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "\u2581a", "ab", "<0x0A>",
                  "<0x41>"]
        return {"tokenizer.ggml.model": "llama",
                "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -2.5, -3.0, -0.5, -0.25,
                                          0.0, 0.0],
                "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1, 1, 6, 6],
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.unknown_token_id": 0,
                "tokenizer.ggml.add_space_prefix": True, "tokenizer.ggml.add_bos_token": True,
                "tokenizer.ggml.add_eos_token": False}


def model(seed=0, cfg=TINY):
    params = init_parameters(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    for name, value in params.items():       # norm weights generic too, not all ones
        if value.ndim == 1:
            params[name] = rng.uniform(0.5, 1.5, value.shape).astype(np.float32)
    return params


def moments(seed=0, cfg=TINY):
    rng = np.random.default_rng(seed + 7)
    return {name: (rng.standard_normal(shape).astype(np.float32),
                   rng.uniform(0, 1e-3, shape).astype(np.float32))
            for name, shape in parameter_shapes(cfg).items()}


def fields(path):
    reader = GGUFReader(path)
    out = {name: (gguf_file.field_value(f), f.types[-1] if f.types else None)
           for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return out, reader


def forge(path, cfg=TINY, tok=None, drop=(), set_keys=None, tensors=None):
    """Write a model file with keys dropped or replaced and tensors replaced (None removes)."""
    meta = gguf_llama.model_metadata(path, cfg, tok or TinyVocab(), None)
    for key in drop:
        del meta[key]
    meta.update(set_keys or {})
    arrays = dict(model(cfg=cfg))
    for name, value in (tensors or {}).items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    gguf_file.write_gguf(path, meta, arrays)
    return path


def only_file(directory):
    return sorted(p.name for p in directory.iterdir())


# -- what gguf-py and llama.cpp see ------------------------------------------------------------

def test_saved_model_reads_back_bit_exact_with_gguf_reader(tmp_path):
    path, params, tok = tmp_path / "m.gguf", model(), TinyVocab()
    save_model(path, TINY, params, tok)
    meta, reader = fields(path)

    assert [t.name for t in reader.tensors] == list(parameter_shapes(TINY))
    for t in reader.tensors:
        want = params[t.name]
        assert t.tensor_type == GGMLQuantizationType.F32
        assert tuple(t.shape.tolist()) == tuple(reversed(want.shape))    # ggml's ne order
        assert t.data.shape == want.shape
        assert t.data.tobytes() == want.tobytes()

    expected = {
        "general.architecture": ("llama", T.STRING), "general.file_type": (0, T.UINT32),
        "llama.context_length": (5, T.UINT32), "llama.embedding_length": (8, T.UINT32),
        "llama.block_count": (1, T.UINT32), "llama.feed_forward_length": (12, T.UINT32),
        "llama.attention.head_count": (2, T.UINT32),
        "llama.attention.head_count_kv": (2, T.UINT32),
        "llama.rope.dimension_count": (4, T.UINT32), "llama.vocab_size": (11, T.UINT32),
        "llama.rope.freq_base": (10000.0, T.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (float(np.float32(1e-5)), T.FLOAT32),
    }
    for key, value in expected.items():
        assert meta[key] == value, key
    assert meta["general.name"][1] == T.STRING
    assert "llama.rope.scaling.type" not in meta        # freq_scale 1: no scaling keys
    assert not any(k.startswith(("optimizer.", "training.", "ggwgpu.checkpoint")) for k in meta)

    kinds = {str: T.STRING, bool: T.BOOL, int: T.UINT32, float: T.FLOAT32}
    for key, value in tok.gguf_metadata().items():
        got, kind = meta[key]
        if isinstance(value, list):             # the scores chosen are exact in float32
            assert got == value, key
            assert kind == {str: T.STRING, int: T.INT32, float: T.FLOAT32}[type(value[0])], key
        else:
            assert (got, kind) == (value, kinds[type(value)]), key


def test_rope_freq_scale_is_written_as_llama_cpp_linear_scaling_factor(tmp_path):
    cfg = ModelConfig(**{**TINY.__dict__, "rope_freq_scale": 0.25})
    save_model(tmp_path / "m.gguf", cfg, model(cfg=cfg), TinyVocab())
    meta, _ = fields(tmp_path / "m.gguf")
    assert meta["llama.rope.scaling.type"] == ("linear", T.STRING)
    assert meta["llama.rope.scaling.factor"] == (4.0, T.FLOAT32)     # llama.cpp: scale = 1/factor


def test_yarn_and_attn_factor_are_read_as_llama_cpp_reads_them_and_written_back(tmp_path):
    """A converter's YaRN file (type, factor, original context; its rope.scaling.yarn_* keys
    read by llama.cpp for no family here) and the attn_factor any family may have; without
    an original context, YaRN's is the trained one (llama.cpp's n_ctx_orig_yarn)."""
    no_json = [gguf_llama.K_CONFIG_JSON]
    yarn = {"llama.rope.scaling.type": ("yarn", T.STRING),
            "llama.rope.scaling.factor": (8.0, T.FLOAT32),
            "llama.rope.scaling.yarn_beta_fast": (32.0, T.FLOAT32),
            "llama.rope.scaling.attn_factor": (0.75, T.FLOAT32)}
    cfg, _ = load_model(forge(tmp_path / "a.gguf", drop=no_json, set_keys=yarn))[:2]
    assert (cfg.rope_scaling, cfg.rope_freq_scale, cfg.rope_orig_ctx, cfg.rope_attn_factor) \
        == ("yarn", 0.125, TINY.n_ctx, 0.75)
    yarn["llama.rope.scaling.original_context_length"] = (4, T.UINT32)
    cfg, values = load_model(forge(tmp_path / "b.gguf", drop=no_json, set_keys=yarn))[:2]
    assert cfg.rope_orig_ctx == 4
    save_model(tmp_path / "c.gguf", cfg, values, TinyVocab())
    meta, _ = fields(tmp_path / "c.gguf")
    assert meta["llama.rope.scaling.type"] == ("yarn", T.STRING)
    assert meta["llama.rope.scaling.original_context_length"] == (4, T.UINT32)
    assert meta["llama.rope.scaling.attn_factor"] == (0.75, T.FLOAT32)
    assert load_model(tmp_path / "c.gguf")[0] == cfg
    # a JSON config without rope scaling does not hide the file's YaRN (at factor 1 too)
    linear = gguf_llama.model_metadata(tmp_path / "c.gguf", TINY, TinyVocab(), None)
    yarn[gguf_llama.K_CONFIG_JSON] = linear[gguf_llama.K_CONFIG_JSON]
    yarn["llama.rope.scaling.factor"] = (1.0, T.FLOAT32)
    assert load_model(forge(tmp_path / "d.gguf", set_keys=yarn))[0].rope_scaling == "yarn"
    with pytest.raises(ShapeError, match="'yarn' and attn_temp_scale need rope_orig_ctx"):
        dataclasses.replace(TINY, rope_scaling="yarn")


def test_extra_keys_are_written_and_cannot_replace_model_keys(tmp_path):
    path = tmp_path / "m.gguf"
    save_model(path, TINY, model(), TinyVocab(),
               extra={"general.name": "shakespeare", "general.description": "tiny"})
    meta, _ = fields(path)
    assert meta["general.name"][0] == "shakespeare"
    assert meta["general.description"][0] == "tiny"
    with pytest.raises(GGUFError, match="llama.block_count"):
        save_model(path, TINY, model(), TinyVocab(), extra={"llama.block_count": 3})


# -- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, tok", [
    (TINY, TinyVocab()),
    (ModelConfig(n_vocab=259, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=5, norm_eps=1e-6,
                 rope_freq_base=5000.5, rope_freq_scale=0.3), ByteTokenizer()),
])
def test_load_model_round_trip_is_exact(tmp_path, cfg, tok):
    path, params = tmp_path / "m.gguf", model(cfg=cfg)
    save_model(path, cfg, params, tok)
    cfg2, params2, tok2 = load_model(path)
    assert cfg2 == cfg              # float hyper-parameters exact, not rounded to float32
    assert list(params2) == list(params)
    for name, value in params.items():
        assert params2[name].dtype == np.float32 and params2[name].flags.writeable
        assert params2[name].tobytes() == value.tobytes()
    if isinstance(tok, ByteTokenizer):
        assert isinstance(tok2, ByteTokenizer)
    got, want = tok2.gguf_metadata(), tok.gguf_metadata()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == (pytest.approx(want[key]) if key.endswith("scores") else want[key])


def test_loaded_arrays_own_their_memory(tmp_path):
    path = tmp_path / "m.gguf"
    save_model(path, TINY, model(0), TinyVocab())
    _, params, _ = load_model(path)
    before = {k: v.copy() for k, v in params.items()}
    save_model(path, TINY, model(5), TinyVocab())     # the file is replaced
    for name, value in params.items():
        assert not isinstance(value, np.memmap)
        np.testing.assert_array_equal(value, before[name])


def test_f16_tensors_are_converted_and_a_missing_output_is_tied(tmp_path):
    params = model()
    half = params["blk.0.attn_q.weight"].astype(np.float16)
    path = forge(tmp_path / "m.gguf", tensors={"blk.0.attn_q.weight": half,
                                               "output.weight": None})
    cfg, loaded, _ = load_model(path)
    np.testing.assert_array_equal(loaded["blk.0.attn_q.weight"], half.astype(np.float32))
    assert loaded["blk.0.attn_q.weight"].dtype == np.float32
    assert cfg.tied_embeddings and "output.weight" not in loaded


def test_published_model_shapes_round_trip(tmp_path):
    """Grouped-query attention, a head size other than n_embd / n_head, tied embeddings and
    Llama 3's rope factors: written with llama.cpp's keys, read back to the same config."""
    cfg = ModelConfig(n_vocab=11, n_embd=8, n_head=4, n_head_kv=2, n_embd_head=6, n_layer=1,
                      n_ff=12, n_ctx=5, tied_embeddings=True, rope_freqs=True)
    params = model(cfg=cfg)
    params["rope_freqs.weight"] = np.array([1.0, 2.5, 8.0], np.float32)
    path = tmp_path / "m.gguf"
    save_model(path, cfg, params, TinyVocab())
    reader = GGUFReader(path)
    assert "output.weight" not in [t.name for t in reader.tensors]
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    assert reader.fields["llama.attention.key_length"].contents() == 6
    for exact in (True, False):       # from ggwgpu.config_json, and from the llama.* keys
        if not exact:
            path = forge(tmp_path / "plain.gguf", cfg=cfg, tok=TinyVocab(), tensors=params,
                         drop=["ggwgpu.config_json"])
        back, loaded, _ = load_model(path)
        # from the keys, eps comes back as float32 and n_rot spelt out
        assert back.rot == cfg.rot and np.float32(back.norm_eps) == np.float32(cfg.norm_eps)
        assert dataclasses.replace(back, n_rot=None, norm_eps=cfg.norm_eps) == cfg
        assert set(loaded) == set(params)
        for name, value in params.items():
            np.testing.assert_array_equal(loaded[name], value)


def test_checkpoint_round_trip(tmp_path):
    path, params, opt = tmp_path / "c.gguf", model(), moments()
    state = train_state(17, samples=34, tokens=170, epoch=0, lr_schedule=[17, 0.5],
                        sampler={"order_seed": 3, "next": 5},
                        rng={"bit_generator": "PCG64", "state": {"state": 2 ** 127 + 12345}})
    save_checkpoint(path, TINY, params, TinyVocab(), opt, state)

    cfg2, params2, tok2, opt2, state2 = load_checkpoint(path)
    assert cfg2 == TINY and state2.to_json() == state
    for name in params:
        assert params2[name].tobytes() == params[name].tobytes()
        assert opt2[name][0].tobytes() == opt[name][0].tobytes()
        assert opt2[name][1].tobytes() == opt[name][1].tobytes()
    assert list(opt2) == list(parameter_shapes(TINY))

    meta, reader = fields(path)
    assert meta["ggwgpu.checkpoint.version"] == (1, T.UINT32)
    assert meta["optimizer.type"] == ("adamw", T.STRING)
    assert meta["optimizer.iteration_count"] == (17, T.UINT64)
    assert meta["optimizer.just_initialized"] == (False, T.BOOL)
    assert meta["training.iteration_count"] == (17, T.UINT64)
    assert meta["training.sample_count"] == (34, T.UINT64)
    assert meta["training.token_count"] == (170, T.UINT64)
    assert meta["training.epoch_count"] == (0, T.UINT64)
    names = [t.name for t in reader.tensors]
    assert "optimizer.adamw.m.blk.0.attn_q.weight" in names
    assert "optimizer.adamw.v.output.weight" in names

    # a checkpoint is also a model
    cfg3, params3, _ = load_model(path)
    assert cfg3 == TINY and params3.keys() == params.keys()


def test_checkpoint_without_moments(tmp_path):
    save_checkpoint(tmp_path / "c.gguf", TINY, model(), TinyVocab(), {}, train_state(0))
    *_, opt, state = load_checkpoint(tmp_path / "c.gguf")
    assert opt == {} and state.to_json() == train_state(0)
    assert fields(tmp_path / "c.gguf")[0]["optimizer.type"][0] == "none"


def test_a_model_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "m.gguf"
    save_model(path, TINY, model(), TinyVocab())
    with pytest.raises(GGUFError, match="is a model, not a training checkpoint") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


# -- atomic writes ----------------------------------------------------------------------------

def test_failed_rename_leaves_previous_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "c.gguf"
    save_checkpoint(path, TINY, model(0), TinyVocab(), moments(), train_state(1))
    before = path.read_bytes()

    def refuse(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf_file.os, "replace", refuse)
    with pytest.raises(GGUFError, match="previous file is unchanged"):
        save_checkpoint(path, TINY, model(1), TinyVocab(), moments(1), train_state(2))
    assert path.read_bytes() == before
    assert only_file(tmp_path) == ["c.gguf"]


@pytest.mark.parametrize("error", [RuntimeError("disk gone"), KeyboardInterrupt()])
def test_write_failing_midway_leaves_previous_file_and_no_temp(tmp_path, monkeypatch, error):
    path = tmp_path / "c.gguf"
    save_checkpoint(path, TINY, model(0), TinyVocab(), moments(), train_state(1))
    before = path.read_bytes()
    real = GGUFWriter.write_tensors_to_file

    def half_then_fail(self, *args, **kwargs):
        self.fout[0].write(b"\0" * 100)            # some of the new file is on disk already
        self.fout[0].flush()
        raise error
    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", half_then_fail)
    with pytest.raises(type(error)):
        save_checkpoint(path, TINY, model(1), TinyVocab(), moments(1), train_state(2))
    assert path.read_bytes() == before
    assert only_file(tmp_path) == ["c.gguf"]
    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", real)
    save_checkpoint(path, TINY, model(1), TinyVocab(), moments(1), train_state(2))
    assert load_checkpoint(path)[4].to_json() == train_state(2)


@pytest.mark.parametrize("change, match", [
    (lambda p, o, s: p.pop("blk.0.ffn_up.weight"), "blk.0.ffn_up.weight is missing"),
    (lambda p, o, s: p.__setitem__("blk.0.attn_k.weight", np.zeros((8, 7), np.float32)),
     "blk.0.attn_k.weight has shape"),
    (lambda p, o, s: p.__setitem__("blk.1.attn_k.weight", np.zeros((8, 8), np.float32)),
     "'blk.1.attn_k.weight' is not a parameter"),
    (lambda p, o, s: p["output_norm.weight"].__setitem__(3, np.nan),
     "output_norm.weight holds non-finite"),
    (lambda p, o, s: o.__setitem__("output.weight", (o["output.weight"][0], np.zeros(3))),
     "optimizer.adamw.v.output.weight has shape"),
    (lambda p, o, s: o["token_embd.weight"][0].__setitem__((0, 0), np.inf),
     "optimizer.adamw.m.token_embd.weight holds non-finite"),
    (lambda p, o, s: s.__setitem__("when", object()), "not JSON-serialisable"),
    (lambda p, o, s: s.__setitem__("loss", float("nan")), "not JSON-serialisable"),
])
def test_bad_state_is_refused_before_writing(tmp_path, change, match):
    path = tmp_path / "c.gguf"
    save_checkpoint(path, TINY, model(0), TinyVocab(), moments(), train_state(1))
    before = path.read_bytes()
    params, opt, state = model(1), moments(1), train_state(2)
    change(params, opt, state)
    with pytest.raises(GGUFError, match=match) as e:
        save_checkpoint(path, TINY, params, TinyVocab(), opt, state)
    assert str(path) in str(e.value)
    assert path.read_bytes() == before
    assert only_file(tmp_path) == ["c.gguf"]


# -- malformed files --------------------------------------------------------------------------

def raises_naming(path, *words, loader=load_model):
    with pytest.raises(GGUFError) as e:
        loader(path)
    message = str(e.value)
    assert str(path) in message
    for word in words:
        assert word in message, message
    return message


def test_truncated_files(tmp_path):
    path = tmp_path / "m.gguf"
    save_checkpoint(path, TINY, model(), TinyVocab(), moments(), train_state(1))
    data = path.read_bytes()
    cut_path = tmp_path / "cut.gguf"
    for cut in [0, 3, 7, 20, 40, 300, 1000, len(data) // 2, len(data) - 1]:
        cut_path.write_bytes(data[:cut])
        raises_naming(cut_path, loader=load_checkpoint)
        raises_naming(cut_path)


def test_wrong_magic_and_version(tmp_path):
    path = tmp_path / "m.gguf"
    save_model(path, TINY, model(), TinyVocab())
    data = path.read_bytes()
    path.write_bytes(b"GGML" + data[4:])
    raises_naming(path, "magic")
    path.write_bytes(data[:4] + (99).to_bytes(4, "little") + data[8:])
    raises_naming(path, "version 99")
    raises_naming(tmp_path / "absent.gguf", "no such file")
    raises_naming(tmp_path, "directory")


def test_forged_counts_and_sizes_are_errors_not_hangs(tmp_path):
    path = tmp_path / "m.gguf"
    save_model(path, TINY, model(), TinyVocab())
    data = path.read_bytes()
    huge = (2 ** 62).to_bytes(8, "little")
    path.write_bytes(data[:8] + huge + data[16:])              # tensor count
    raises_naming(path, "tensor infos")
    path.write_bytes(data[:16] + huge + data[24:])             # metadata count
    raises_naming(path, "metadata entries")
    path.write_bytes(data[:24] + huge + data[32:])             # length of the first key name
    raises_naming(path, "metadata entry 0")
    tokens_at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8
    path.write_bytes(data[:tokens_at] + huge + data[tokens_at + 8:])   # string array length
    raises_naming(path, "tokenizer.ggml.tokens")


@pytest.mark.parametrize("key", ["general.architecture", "llama.embedding_length",
                                 "llama.block_count", "llama.attention.head_count",
                                 "llama.context_length", "llama.feed_forward_length",
                                 "llama.attention.layer_norm_rms_epsilon",
                                 "tokenizer.ggml.tokens"])
def test_missing_required_key(tmp_path, key):
    if key == "general.architecture":       # gguf-py always writes it: rename it in place
        path = tmp_path / "m.gguf"
        save_model(path, TINY, model(), TinyVocab())
        path.write_bytes(path.read_bytes().replace(key.encode(), b"general.architecturX"))
    else:
        path = forge(tmp_path / "m.gguf", drop=[key])
    raises_naming(path, key, "missing")


def test_wrong_architecture_and_bad_key_values(tmp_path):
    path = forge(tmp_path / "a.gguf", set_keys={"general.architecture": ("jais", T.STRING)})
    raises_naming(path, "general.architecture", "jais")
    path = forge(tmp_path / "b.gguf", set_keys={"llama.embedding_length": ("8", T.STRING)})
    raises_naming(path, "llama.embedding_length")
    path = forge(tmp_path / "c.gguf", set_keys={"llama.attention.head_count_kv": (3, T.UINT32)})
    raises_naming(path, "llama.attention.head_count_kv", "not a multiple")
    # one K/V head is grouped-query attention: the file's K and V are then too wide
    path = forge(tmp_path / "c1.gguf", set_keys={"llama.attention.head_count_kv": (1, T.UINT32)})
    raises_naming(path, "blk.0.attn_k.weight", "(4, 8)")
    path = forge(tmp_path / "d.gguf", set_keys={"llama.block_count": (2 ** 30, T.UINT32)})
    raises_naming(path, "llama.block_count")
    path = forge(tmp_path / "e.gguf", set_keys={"llama.rope.scaling.type": ("xdrope", T.STRING)})
    raises_naming(path, "llama.rope.scaling.type", "xdrope")
    path = forge(tmp_path / "f.gguf", set_keys={"llama.rope.scaling.factor": (1e-45, T.FLOAT32)})
    raises_naming(path, "llama.rope.scaling.factor", "plausible")


def test_tensor_with_wrong_shape_missing_or_unexpected(tmp_path):
    path = forge(tmp_path / "a.gguf", tensors={"blk.0.ffn_down.weight": np.zeros((12, 8),
                                                                                np.float32)})
    raises_naming(path, "blk.0.ffn_down.weight", "(12, 8)", "(8, 12)")
    path = forge(tmp_path / "b.gguf", tensors={"blk.0.attn_v.weight": None})
    raises_naming(path, "blk.0.attn_v.weight", "missing")
    path = forge(tmp_path / "c.gguf", tensors={"rope_freqs.weight": np.ones(3, np.float32)})
    raises_naming(path, "rope_freqs.weight", "(3,)", "(2,)")
    path = forge(tmp_path / "d.gguf", tensors={"rope_freqs.weight": np.array([1, 0], np.float32)})
    raises_naming(path, "rope_freqs.weight", "positive")
    path = forge(tmp_path / "e.gguf", tensors={"blk.0.attn_bias.weight": np.ones(2, np.float32)})
    raises_naming(path, "blk.0.attn_bias.weight", "unexpected")


def test_unsupported_tensor_type(tmp_path):
    path = forge(tmp_path / "a.gguf", tensors={"blk.0.attn_q.weight": np.zeros((8, 8), np.int32)})
    raises_naming(path, "blk.0.attn_q.weight", "I32")
    # a quantized type ggwgpu does not read: IQ4_NL, blocks of 32 values in 18 bytes (n_embd
    # 32 for whole blocks)
    cfg = ModelConfig(n_vocab=11, n_embd=32, n_head=2, n_layer=1, n_ff=12, n_ctx=5)
    path = tmp_path / "q.gguf"
    writer = GGUFWriter(path, "llama")
    for key, (value, vtype) in gguf_llama.model_metadata(path, cfg, TinyVocab(), None).items():
        if key != "general.architecture":
            writer.add_key_value(key, value, vtype)
    for name, shape in parameter_shapes(cfg).items():
        if name == "blk.0.attn_q.weight":
            writer.add_tensor(name, np.zeros((32, 18), np.uint8),
                              raw_dtype=GGMLQuantizationType.IQ4_NL)
        else:
            writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raises_naming(path, "blk.0.attn_q.weight", "IQ4_NL")


def test_vocabulary_size_mismatch(tmp_path):
    path = forge(tmp_path / "a.gguf", set_keys={"llama.vocab_size": (12, T.UINT32)})
    raises_naming(path, "vocabulary size mismatch", "llama.vocab_size", "11")
    path = forge(tmp_path / "b.gguf",
                 tensors={"token_embd.weight": np.zeros((12, 8), np.float32)})
    raises_naming(path, "vocabulary size mismatch", "token_embd.weight", "12")


def test_checkpoint_specific_errors(tmp_path):
    path = tmp_path / "c.gguf"
    save_checkpoint(path, TINY, model(), TinyVocab(), moments(), train_state(1))
    meta = gguf_llama.model_metadata(path, TINY, TinyVocab(), None)
    meta["ggwgpu.checkpoint.version"] = (2, T.UINT32)
    meta["training.state_json"] = ("{}", T.STRING)
    gguf_file.write_gguf(path, meta, model())
    raises_naming(path, "ggwgpu.checkpoint.version", loader=load_checkpoint)

    meta["ggwgpu.checkpoint.version"] = (1, T.UINT32)
    opt = {"optimizer.adamw.m.blk.0.attn_q.weight": np.zeros((8, 4), np.float32),
           "optimizer.adamw.v.blk.0.attn_q.weight": np.zeros((8, 8), np.float32)}
    gguf_file.write_gguf(path, meta, {**model(), **opt})
    raises_naming(path, "optimizer.adamw.m.blk.0.attn_q.weight", "shape",
                  loader=load_checkpoint)

    del opt["optimizer.adamw.m.blk.0.attn_q.weight"]
    gguf_file.write_gguf(path, meta, {**model(), **opt})
    raises_naming(path, "optimizer.adamw.m.blk.0.attn_q.weight", "missing",
                  loader=load_checkpoint)

    del meta["training.state_json"]
    gguf_file.write_gguf(path, meta, model())
    raises_naming(path, "training.state_json", "missing", loader=load_checkpoint)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def checkpoint_with_state(path, state_json: str, opt=None):
    """A checkpoint whose training.state_json is `state_json`, as written (forged)."""
    meta = gguf_llama.model_metadata(path, TINY, TinyVocab(), None)
    meta["ggwgpu.checkpoint.version"] = (1, T.UINT32)
    meta["training.state_json"] = (state_json, T.STRING)
    gguf_file.write_gguf(path, meta, {**model(), **(opt or {})})
    return path


def forged(change) -> str:
    state = train_state(5, tokens_digest="ab")
    change(state)
    return json.dumps(state)


@pytest.mark.parametrize("state_json, words", [
    (forged(lambda s: s["options"].update(restarts=True, cos_decay_steps=0)),
     ["options.cos_decay_steps must be in [1, 1e+09]", "got 0"]),
    (forged(lambda s: s["options"].update(grad_accum=10 ** 9)), ["options.grad_accum", "65536"]),
    (forged(lambda s: s["options"].pop("lr")), ["options.lr is missing"]),
    (forged(lambda s: s["options"].update(batch="8")), ["options.batch must be an integer"]),
    (forged(lambda s: s["options"].update(optimizer="adam")),
     ["options.optimizer must be one of adamw, sgd", "'adam'"]),
    (forged(lambda s: s["options"].update(lion=True)), ["options.lion is not a training option"]),
    (forged(lambda s: s["options"].update(restarts=1)), ["options.restarts must be true or false"]),
    (forged(lambda s: s.update(step=-1)), ["step must be in [0, ", "got -1"]),
    (forged(lambda s: s.pop("step")), ["step is missing"]),
    (forged(lambda s: s.update(step=2.5)), ["step must be an integer"]),
    (forged(lambda s: s.pop("data")), ["data is missing"]),
    (forged(lambda s: s["data"].update(position=None)), ["data.position must be an integer"]),
    (forged(lambda s: s.update(options=[])), ["options must be a JSON object"]),
    (forged(lambda s: s.update(tokens_digest=7)), ["tokens_digest must be a string"]),
    (forged(lambda s: s.update(mode="lora", base="cd")), ["samples_after_nl is missing"]),
    (forged(lambda s: s.update(n_ctx=1, mode="full", base="cd", samples_after_nl=False)),
     ["n_ctx must be in [2, "]),
    (forged(lambda s: s["options"].update(lr="NaN")).replace('"NaN"', "NaN"),
     ["options.lr must be a finite number"]),
    (forged(lambda s: s["options"].update(eps=1)).replace('"eps": 1', '"eps": 1e999'),
     ["options.eps must be a finite number"]),
    ("[1, 2]", ["must be a JSON object"]),
])
def test_a_checkpoint_state_is_checked_against_the_schema(tmp_path, state_json, words):
    """Each defect a tester forged into training.state_json (an endless schedule, a step of
    10^9 micro-batches, missing or mistyped keys, an unknown optimizer, a negative step) is
    a GGUFError naming the file, the key and the problem, not a hang or a traceback."""
    path = checkpoint_with_state(tmp_path / "c.gguf", state_json)
    raises_naming(path, "training.state_json", *words, loader=load_checkpoint)


@pytest.mark.parametrize("kind, value, words", [
    ("m", np.inf, ["optimizer.adamw.m.output_norm.weight", "non-finite"]),
    ("v", np.nan, ["optimizer.adamw.v.output_norm.weight", "non-finite"]),
    ("v", -1.0, ["optimizer.adamw.v.output_norm.weight", "negative"]),
])
def test_a_checkpoint_moment_must_be_finite_and_v_not_negative(tmp_path, kind, value, words):
    opt = {f"optimizer.adamw.{k}.{name}": np.zeros(shape, np.float32)
           for name, shape in parameter_shapes(TINY).items() for k in "mv"}
    opt[f"optimizer.adamw.{kind}.output_norm.weight"][3] = value
    path = checkpoint_with_state(tmp_path / "c.gguf", json.dumps(train_state(1)), opt)
    raises_naming(path, *words, loader=load_checkpoint)


# -- hostile layouts, byte by byte ------------------------------------------------------------

def after_string(data, text):
    """Offset just past the GGUF string `text` (u64 length, then UTF-8 bytes) in `data`."""
    raw = text.encode()
    return data.index(len(raw).to_bytes(8, "little") + raw) + 8 + len(raw)


def patched(data, at, value, size):
    return data[:at] + value.to_bytes(size, "little") + data[at + size:]


@pytest.fixture
def model_bytes(tmp_path):
    save_model(tmp_path / "m.gguf", TINY, model(), TinyVocab())
    return (tmp_path / "m.gguf").read_bytes()


@pytest.mark.parametrize("where, value, size, words", [
    # (offset of the field in the bytes, value (or value of the bytes), field size, words
    # the message must have)
    (lambda d: 4, 0x03000000, 4, ["big-endian"]),
    (lambda d: 4, 1, 4, ["version 1"]),
    (lambda d: after_string(d, "general.name") + 4, 2 ** 62, 8, ["value of key general.name"]),
    (lambda d: after_string(d, "llama.context_length"), 99, 4,
     ["key llama.context_length", "unknown value type 99"]),
    (lambda d: after_string(d, "tokenizer.ggml.scores") + 4, 99, 4,
     ["key tokenizer.ggml.scores", "unknown value type 99"]),
    (lambda d: after_string(d, "tokenizer.ggml.scores") + 8, 2 ** 62, 8,
     ["array items of key tokenizer.ggml.scores"]),
    (lambda d: after_string(d, "blk.0.attn_q.weight"), 5, 4,
     ["tensor blk.0.attn_q.weight", "5 dimensions"]),
    (lambda d: after_string(d, "blk.0.attn_q.weight") + 4, 2 ** 64 - 1, 8,
     ["data of tensor blk.0.attn_q.weight"]),
    (lambda d: after_string(d, "blk.0.attn_q.weight") + 20, 99, 4,
     ["tensor blk.0.attn_q.weight", "unknown type 99"]),
    (lambda d: after_string(d, "blk.0.attn_q.weight") + 24, 2 ** 64 - 1, 8,
     ["tensor blk.0.attn_q.weight", "not a multiple of the alignment"]),
    (lambda d: after_string(d, "blk.0.attn_q.weight") + 24, 2 ** 63, 8,
     ["data of tensor blk.0.attn_q.weight", "the file ends at"]),
    (lambda d: after_string(d, "output.weight") + 24, len, 8,          # the file's size
     ["data of tensor output.weight", "the file ends at"]),
])
def test_forged_header_fields(tmp_path, model_bytes, where, value, size, words):
    path = tmp_path / "forged.gguf"
    value = value(model_bytes) if callable(value) else value
    path.write_bytes(patched(model_bytes, where(model_bytes), value, size))
    raises_naming(path, *words)


def test_tensor_dimensions_whose_product_overflows_64_bits(tmp_path, model_bytes):
    # 2^32 x 2^32 elements: 0 in uint64 arithmetic, so only exact arithmetic catches it
    at = after_string(model_bytes, "blk.0.attn_q.weight") + 4
    data = patched(patched(model_bytes, at, 2 ** 32, 8), at + 8, 2 ** 32, 8)
    (tmp_path / "f.gguf").write_bytes(data)
    raises_naming(tmp_path / "f.gguf", "blk.0.attn_q.weight", "ends at byte")


def test_duplicates_and_non_utf8_names(tmp_path, model_bytes):
    path = tmp_path / "f.gguf"
    for old, new, words in [
            (b"tokenizer.ggml.model", b"llama.context_length", ["key llama.context_length occurs twice"]),
            (b"blk.0.attn_k.weight", b"blk.0.attn_q.weight", ["tensor blk.0.attn_q.weight occurs twice"]),
            (b"llama.block_count", b"llama.block_coun\xff", ["not UTF-8"])]:
        path.write_bytes(model_bytes.replace(old, new, 1))
        raises_naming(path, *words)
    value = after_string(model_bytes, "general.name") + 4 + 8      # past its type and length
    path.write_bytes(model_bytes[:value] + b"\xff" + model_bytes[value + 1:])
    raises_naming(path, "general.name", "not UTF-8")


def test_tensor_names_longer_than_ggml_allows(tmp_path):
    path = forge(tmp_path / "m.gguf", tensors={"blk.0." + "9" * 70: np.ones(2, np.float32)})
    raises_naming(path, "longer than ggml's 63 bytes")


def test_alignment_key_must_be_a_power_of_two_uint32(tmp_path):
    path = forge(tmp_path / "a.gguf", set_keys={"general.alignment": (24, T.UINT32)})
    raises_naming(path, "general.alignment", "power of two")
    path = forge(tmp_path / "b.gguf", set_keys={"general.alignment": ("32", T.STRING)})
    raises_naming(path, "general.alignment", "uint32")


@pytest.mark.parametrize("keys, tensors, words", [
    ({"llama.attention.head_count": (3, T.UINT32),
      "llama.attention.head_count_kv": (3, T.UINT32)}, {},
     ["llama.embedding_length = 8 is not divisible by llama.attention.head_count = 3"]),
    ({"llama.rope.dimension_count": (3, T.UINT32)}, {}, ["llama.rope.dimension_count = 3"]),
    ({"llama.rope.dimension_count": (6, T.UINT32)}, {},
     ["llama.rope.dimension_count = 6", "head size"]),
    ({"llama.block_count": (2, T.UINT32)}, {}, ["tensor blk.1.attn_norm.weight is missing"]),
    ({"llama.block_count": (3, T.UINT32)}, {}, ["llama.block_count = 3", "tensors"]),
    ({}, {"blk.1.attn_norm.weight": np.ones(8, np.float32)},
     ["unexpected tensor blk.1.attn_norm.weight", "llama.block_count = 1 has no block 1"]),
    ({}, {"blk.0.attn_q.weight": np.zeros((4, 8), np.float32)},
     ["blk.0.attn_q.weight", "(4, 8)", "(8, 8)"]),
    ({"llama.embedding_length": (6, T.UINT32), "llama.rope.dimension_count": (2, T.UINT32)}, {},
     ["token_embd.weight", "(11, 8)", "(11, 6)"]),
    ({}, {"output.weight": np.zeros((12, 8), np.float32)},
     ["vocabulary size mismatch", "output.weight has 12 rows", "11 tokens"]),
])
def test_shapes_that_contradict_the_hyper_parameters(tmp_path, keys, tensors, words):
    raises_naming(forge(tmp_path / "m.gguf", set_keys=keys, tensors=tensors), *words)


def test_vocabulary_errors_are_gguf_errors(tmp_path, model_bytes):
    from ggwgpu.tokenizer import VocabError, load_vocab
    assert issubclass(VocabError, GGUFError)
    path = tmp_path / "m.gguf"
    path.write_bytes(model_bytes[:len(model_bytes) // 3])
    raises_naming(path, "truncated", loader=load_vocab)
    tokens = forge(tmp_path / "t.gguf",
                   set_keys={"tokenizer.ggml.bos_token_id": ("1", T.STRING)})
    raises_naming(tokens, "bad vocabulary", "tokenizer.ggml.bos_token_id")
    raises_naming(tokens, "tokenizer.ggml.bos_token_id", loader=load_vocab)


def test_writes_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """fsync of the temporary file, its rename onto the target, fsync of the directory: files
    told apart by inode, which the rename keeps."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, os.path.basename(dst)))
        real_replace(src, dst)
    monkeypatch.setattr(gguf_file.os, "fsync", fsync)
    monkeypatch.setattr(gguf_file.os, "replace", replace)
    save_model(tmp_path / "m.gguf", TINY, model(), TinyVocab())
    written, folder = os.stat(tmp_path / "m.gguf").st_ino, os.stat(tmp_path).st_ino
    assert events == [("fsync", written), ("replace", written, "m.gguf"), ("fsync", folder)]
    assert only_file(tmp_path) == ["m.gguf"]


@pytest.mark.parametrize("hint", ['{"n_head": 0}', '{"n_vocab": 11, "n_embd": 8, "n_head": 2, '
                                  '"rope_freq_scale": 0}', '[1]', '{"n_embd": "8"}'])
def test_a_forged_config_json_hint_is_ignored(tmp_path, hint):
    path = forge(tmp_path / "m.gguf", set_keys={"ggwgpu.config_json": (hint, T.STRING)})
    cfg, _, _ = load_model(path)             # the llama.* keys rule
    assert (cfg.n_embd, cfg.n_head, cfg.rope_freq_scale) == (8, 2, 1.0)


def test_deeply_nested_train_state_is_an_error(tmp_path):
    meta = gguf_llama.model_metadata(tmp_path / "c.gguf", TINY, TinyVocab(), None)
    meta["ggwgpu.checkpoint.version"] = (1, T.UINT32)
    meta["training.state_json"] = ("[" * 100_000, T.STRING)
    gguf_file.write_gguf(tmp_path / "c.gguf", meta, model())
    raises_naming(tmp_path / "c.gguf", "training.state_json", "JSON", loader=load_checkpoint)


@pytest.mark.parametrize("dtype", [None, "f16", "bf16", "q4_1", "q8_0", "q4_k", "mxfp4"])
def test_non_finite_weights_are_refused_at_load_naming_the_tensor(tmp_path, dtype):
    """A NaN or infinity in a weight (an f32 value, an f16/bf16 scale of a block type, or
    an mxfp4 scale that overflows its block's codes) would only show later as a NaN loss:
    loading refuses it."""
    from ggwgpu.quant import TYPES, Quantized, quantize, random_blocks
    cfg = ModelConfig(n_vocab=11, n_embd=256, n_head=2, n_layer=1, n_ff=12, n_ctx=5)
    name = "blk.0.attn_q.weight"
    bad = model(cfg=cfg)[name]
    if dtype is None:
        bad[3, 5] = np.inf
    else:
        q = (random_blocks(dtype, bad.shape, np.random.default_rng(0)) if dtype == "q4_k"
             else quantize(bad, dtype))
        data = q.data.copy()
        at = TYPES[dtype].halves[-1] if TYPES[dtype].halves else 0
        nan = 0x7FC0 if dtype == "bf16" else 0x7E00
        if dtype == "mxfp4":
            data[0] = 255       # 2^127 times the block's codes, the largest of them 8 or 12
        else:
            data[at:at + 2] = np.array([nan], np.uint16).view(np.uint8)
        bad = Quantized(dtype, q.shape, data)
    path = forge(tmp_path / "m.gguf", cfg=cfg, tensors={name: bad})
    for keep in (False, True):
        with pytest.raises(GGUFError, match=f"tensor {name} holds non-finite values"):
            load_model(path, keep_quantized=keep)


# -- bounded work on hostile metadata ---------------------------------------------------------

def with_raw_key(data, key, vtype, payload, alignment=32):
    """`data` (a GGUF) with one more key, raw `payload` bytes after its type, put first; the
    key name is padded so that the tensor data stays aligned."""
    def entry(name):
        return len(name).to_bytes(8, "little") + name + int(vtype).to_bytes(4, "little") + payload
    name = key.encode()
    name += b"_" * (-len(entry(name)) % alignment)
    n_kv = int.from_bytes(data[16:24], "little")
    return data[:16] + (n_kv + 1).to_bytes(8, "little") + entry(name) + data[24:]


def array(itype, count, items=b""):
    return int(itype).to_bytes(4, "little") + count.to_bytes(8, "little") + items


def test_a_huge_unknown_array_is_refused_before_it_is_read(tmp_path, model_bytes):
    """A 4 MB file with 4 million bools: refused from its count, before its items are read
    (gguf-py's reader took minutes and gigabytes), in a few MB of memory."""
    import tracemalloc
    path = tmp_path / "m.gguf"
    n = 4_000_000
    path.write_bytes(with_raw_key(model_bytes, "evil.bools", T.ARRAY, array(T.BOOL, n, b"\1" * n)))
    tracemalloc.start()
    try:
        raises_naming(path, "evil.bools", f"{n} items", str(gguf_file.MAX_METADATA_ITEMS))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2 ** 20, peak


def test_arrays_of_arrays_are_refused_as_ggml_does(tmp_path, model_bytes):
    path = tmp_path / "m.gguf"
    nested = array(T.ARRAY, 300_000, array(T.UINT8, 0) * 300_000)
    path.write_bytes(with_raw_key(model_bytes, "evil.nested", T.ARRAY, nested))
    raises_naming(path, "evil.nested", "array of ARRAYs")


def test_metadata_bounds_on_items_and_string_bytes(tmp_path, model_bytes, monkeypatch):
    """The bounds are counted over all keys: the tiny model's 11 tokens, scores and types
    are 33 array items; its strings some 500 bytes."""
    path = tmp_path / "m.gguf"
    path.write_bytes(model_bytes)
    monkeypatch.setattr(gguf_file, "MAX_METADATA_ITEMS", 32)
    raises_naming(path, "tokenizer.ggml.token_type", "at most 32 array items")
    monkeypatch.setattr(gguf_file, "MAX_METADATA_ITEMS", 33)
    load_model(path)
    monkeypatch.setattr(gguf_file, "MAX_METADATA_BYTES", 100)
    raises_naming(path, "at most 100 bytes of metadata strings")


def test_string_arrays_are_read_in_one_loop_not_item_by_item(tmp_path, model_bytes):
    """Work, counted as Python function calls: reading 100k strings makes no call per
    string (the layout check and gguf-py's reader made several each), and reads back
    equal."""
    import sys
    path = tmp_path / "m.gguf"
    words = [f"w{i}".encode() for i in range(100_000)]
    items = b"".join(len(w).to_bytes(8, "little") + w for w in words)
    path.write_bytes(with_raw_key(model_bytes, "x.words", T.ARRAY, array(T.STRING, len(words),
                                                                          items)))
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"
    sys.setprofile(count)
    try:
        meta = gguf_file.read_metadata(path)
    finally:
        sys.setprofile(None)
    assert calls < 2000, calls
    key = next(k for k in meta if k.startswith("x.words"))
    assert meta[key] == [w.decode() for w in words]
    # a lying item (its length runs past the end) is still named
    bad = array(T.STRING, 2, (3).to_bytes(8, "little") + b"abc" + (2 ** 40).to_bytes(8, "little"))
    path.write_bytes(with_raw_key(model_bytes, "x.lying", T.ARRAY, bad))
    raises_naming(path, "item 1 of key x.lying", "truncated")


def test_fifos_and_devices_are_refused_without_reading(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)              # opening it would block until a writer came
    raises_naming(fifo, "not a regular file")
    if os.path.exists("/dev/zero"):
        with pytest.raises(GGUFError, match="not a regular file"):
            load_model("/dev/zero")
    raises_naming(tmp_path, "is a directory")


def test_a_float_beyond_float32_is_a_gguf_error_and_nothing_is_written(tmp_path):
    cfg = dataclasses.replace(TINY, rope_freq_base=1e308)
    with pytest.raises(GGUFError, match="does not fit its GGUF type") as e:
        save_model(tmp_path / "m.gguf", cfg, model(), TinyVocab())
    assert str(tmp_path / "m.gguf") in str(e.value)
    assert only_file(tmp_path) == []


def test_a_run_state_writes_back_the_json_it_was_read_from_in_the_same_order():
    from ggwgpu.training import RunState
    state = train_state(4, samples=32, tokens=512, model={"n_embd": 8}, tokens_digest="ab",
                        base="cd", mode="lora", samples_after_nl=False, n_ctx=16,
                        loss_scaler=None, later_key=[1, 2])
    del state["loss_scaler"]
    order = ["step", "samples", "tokens", "options", "model", "data", "tokens_digest", "base",
             "mode", "samples_after_nl", "n_ctx", "later_key"]
    back = RunState.from_json({key: state[key] for key in reversed(order)}).to_json()
    assert list(back) == order and back == state


# The options every checkpoint has held since the first; any added later must be one of
# state.later_option's (absent from an older checkpoint: its default), or resuming an older
# run's checkpoint would fail with "options.x is missing".
FIRST_OPTIONS = {"optimizer", "batch", "grad_accum", "lr", "beta1", "beta2", "eps",
                 "weight_decay", "grad_clip", "warmup", "cos_decay_steps", "cos_decay_min",
                 "cos_decay_restart", "restarts", "flash_attn", "checkpointing", "precision",
                 "seed"}


def test_a_checkpoint_from_before_the_later_options_resumes_with_their_defaults():
    from ggwgpu.training.options import TrainOptions
    from ggwgpu.training.state import check_state, later_option
    later = {name for name in TrainOptions.bounds() if later_option(name)}
    assert set(TrainOptions.bounds()) - later == FIRST_OPTIONS
    state = train_state(5, tokens_digest="ab")
    for name in later:
        del state["options"][name]
    assert check_state(state) is state
