"""Frozen weights in every block type of ggwgpu.quant: the type table against gguf-py and the
shaders, the kernels that dequantize inside mul_mat and get_rows against NumPy
dequantize-then-f32 (gguf.quants' values), a llama whose base is quantized constants against
the same llama in f32, GGUF files mixing every type, and `ggwgpu quantize`."""
import re

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants

import ggwgpu as gg
from ggwgpu import gguf_file, gguf_llama, testing
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.gguf_file import GGUFError
from ggwgpu.gguf_llama import load_model, save_model
from ggwgpu.models import ROPE_FREQS, ModelConfig, attention, init_parameters
from ggwgpu.models.blocks import Sequence, output, rms_norm
from ggwgpu.wgsl import shader_source
from ggwgpu.quant import (QUANT_TYPES, QUANTIZABLE, TYPES, Quantized, dequantize, quantize,
                          quantize_model, random_blocks)
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu_cli import main as cli_main

NMSE = 1e-7     # kernel against NumPy: both products see the same dequantized values
# n_embd and n_ff multiples of 32: every matrix is quantized; byte vocabulary as `train`
TINY = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=64, n_head=2, n_layer=2, n_ff=96,
                   n_ctx=8)


def awkward_rows(rng):
    """Random rows plus the cases a quantizer gets wrong: zeros, a negative extreme, ties
    (q8_0 rounds x / d = k + 0.5 away from zero), tiny and large magnitudes."""
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[0] = 0
    x[1, 7] = -9.0
    x[2, :32] = np.arange(32) - 15.5
    x[2, 0] = 127.0                                  # d = 1: ties at -15.5 .. 15.5
    x[3] *= 1e-6
    x[4] *= 1e3
    return x


# 5 rows of 64 values: bytes, and the largest error |x - dequantize(quantize(x))| as a share
# of each block's largest |x|: half a step of the type's grid (a whole one at the far end of
# the symmetric 4- and 5-bit grids), plus the f16 scales' rounding
ROUND_TRIP = {"f16": (640, 2 ** -11), "bf16": (640, 2 ** -8), "q4_0": (180, 1 / 8 + 2e-3),
              "q4_1": (200, 1 / 15 + 2e-3), "q5_0": (220, 1 / 16 + 2e-3),
              "q5_1": (240, 1 / 31 + 2e-3), "q8_0": (340, 1 / 254 + 2e-3),
              # the largest value is 8 to 16 steps of the scale and the codes are 0, 1, 2, 3,
              # 4, 6, 8, 12 steps: up to 2 steps from one (between 8 and 12), or clipped to 12
              "mxfp4": (170, 1 / 4 + 1e-6)}


@pytest.mark.parametrize("dtype", QUANTIZABLE)
def test_quantize_round_trips_within_half_a_step(dtype):
    x = np.delete(awkward_rows(np.random.default_rng(0)), 3, axis=0)   # no f16 subnormals
    q = quantize(x, dtype)
    nbytes, share = ROUND_TRIP[dtype]
    assert q.nbytes == nbytes
    err = np.abs(dequantize(q) - x).reshape(-1, 32)
    largest = np.abs(x).reshape(-1, 32).max(axis=1, keepdims=True)
    assert (err <= share * largest).all()
    np.testing.assert_array_equal(dequantize(q)[0], 0)


def test_the_type_table_matches_gguf_py_and_the_shaders():
    """Sizes are gguf-py's; the kernels' type codes are the table's order; k-quants come
    from files only, and `random_blocks` makes valid ones (finite, about [-1, 1])."""
    # the constants the kernels see, common.wgsl's WG left out
    source = shader_source("quant_blocks").replace(shader_source("common"), "")
    codes = {name.lower(): int(code)
             for name, code in re.findall(r"const (\w+): u32 = (\d+)u;", source)}
    assert codes == {name: code for code, name in enumerate(TYPES)}
    assert gg.ops.quant.TYPE_CODE == codes
    for name, t in TYPES.items():
        assert gguf_quants.GGML_QUANT_SIZES[t.ggml] == (t.block, t.size)
        assert (name in QUANTIZABLE) == (t.block < 256)
    rng = np.random.default_rng(3)
    for name in QUANT_TYPES:
        q = random_blocks(name, (3, 512), rng)
        values = dequantize(q)
        np.testing.assert_array_equal(values, gguf_quants.dequantize(
            q.data.reshape(3, -1), TYPES[name].ggml))
        assert np.isfinite(values).all() and 0.2 < np.abs(values).max() <= 2.5, name


def test_quantized_values_check_their_rows_and_bytes():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48)), "q4_0")
    with pytest.raises(ValueError, match="bytes of blocks"):
        Quantized("q8_0", (2, 32), np.zeros(34, np.uint8))
    with pytest.raises(ValueError, match="cannot quantize to 'q4_k'"):
        quantize(np.zeros(256), "q4_k")
    with pytest.raises(ValueError, match="unknown block type 'iq4_nl'"):
        Quantized("iq4_nl", (1, 32), np.zeros(18, np.uint8))


def test_frozen_weights_route_mul_mat_and_get_rows_and_stay_frozen():
    w = gg.constant(quantize(np.ones((4, 32)), "q4_0"), name="w")
    assert (w.dtype, w.shape) == ("q4_0", (4, 32))
    x = gg.input_tensor((3, 32))
    assert gg.mul_mat(w, x).op == "mul_mat_q"
    assert gg.get_rows(w, gg.input_tensor((5,), "i32")).op == "get_rows_q"
    assert gg.mul_mat(gg.reshape(w, (1, 4, 32)), x).op == "mul_mat_q"
    assert gg.constant(np.ones((2, 8)), "f16").dtype == "f16"
    with pytest.raises(gg.ShapeError, match="frozen"):
        gg.param(quantize(np.ones((4, 32)), "q8_0"))
    with pytest.raises(gg.ShapeError, match="needs f32"):
        gg.add(w, w)
    with pytest.raises(gg.ShapeError, match="whole and contiguous"):
        gg.mul_mat(gg.transpose(w), gg.input_tensor((3, 4)))
    with pytest.raises(gg.ShapeError, match="only constants"):
        gg.input_tensor((4, 32), "q8_0")
    # the frozen kernels have no epilogue: mul_mat's alpha must keep its default there
    assert gg.mul_mat(w, x, 1.0).op == gg.mul_mat(w, x, alpha=1.0).op == "mul_mat_q"
    with pytest.raises(gg.ShapeError, match="mul_mat: a frozen q4_0 weight .* no alpha"):
        gg.mul_mat(w, x, alpha=0.5)
    with pytest.raises(gg.ShapeError, match="mul_mat_acc.*needs f32 or f16"):
        gg.mul_mat_acc(w, x, gg.input_tensor((3, 4)))


def product_case(dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = random_blocks(dtype, (70, 256), rng)
    x = rng.uniform(-1, 1, (2, 33, 256)).astype(np.float32)
    r = rng.uniform(-1, 1, (2, 33, 70)).astype(np.float32)
    return w, x, r


@pytest.mark.parametrize("dtype", QUANT_TYPES)
@pytest.mark.parametrize("on", ["numpy", "wgpu"])
def test_quantized_matmul_and_its_gradient_match_dequantize_then_matmul(request, dtype, on):
    backend = request.getfixturevalue("wgpu") if on == "wgpu" else NumpyBackend()
    w, x, r = product_case(dtype)
    xt = gg.input_tensor(x.shape, name="x")
    y = gg.mul_mat(gg.constant(w), xt)
    dx = gg.build_backward(gg.sum(gg.mul(y, gg.constant(r))), [xt])[xt]
    plan = backend.plan([y, dx], sentinel=testing.SENTINEL)
    plan.run({xt: x})
    dense = dequantize(w).astype(np.float64)
    assert testing.nmse(plan.read(y), x @ dense.T) < NMSE
    assert testing.nmse(plan.read(dx), r @ dense) < NMSE
    assert plan.stray_writes() == []


QUANT_PRODUCTS = [(name, case) for name in ("mul_mat_q", "mul_mat_q_back")
                  for case in testing.cases_of(name)]


@pytest.mark.parametrize("variant", gg.ops.OPS["mul_mat_q"].variants)
@pytest.mark.parametrize("name,case", QUANT_PRODUCTS,
                         ids=[f"{n}[{testing.describe(c)}]" for n, c in QUANT_PRODUCTS])
def test_every_quantized_kernel_variant_matches_reference(wgpu, monkeypatch, variant, name,
                                                          case):
    """Each adapter runs one variant of the quantized products; lavapipe tests them all."""
    monkeypatch.setitem(wgpu.kernel_variants, "quant", variant)
    result = testing.forward(gg.ops.OPS[name], case, wgpu)
    assert result.ok, result.detail


def test_quantized_products_follow_the_matmul_variant(wgpu):
    expected = "subgroup" if wgpu.kernel_variants["matmul"] == "subgroup" else "portable"
    assert wgpu.kernel_variants["quant"] == expected
    w, x = gg.constant(quantize(np.ones((4, 32)), "q4_0")), gg.input_tensor((3, 32))
    node = gg.mul_mat(w, x)
    entries = {v: [d.entry for d in gg.ops.OPS["mul_mat_q"].dispatches_on(node, {"quant": v})]
               for v in ("portable", "subgroup")}
    assert entries == {"portable": ["mul_mat_q"], "subgroup": ["mul_mat_q_subgroup_q4_0"]}


@pytest.mark.parametrize("on", ["numpy", "wgpu"])
def test_embeddings_from_a_quantized_table(request, on):
    backend = request.getfixturevalue("wgpu") if on == "wgpu" else NumpyBackend()
    rng = np.random.default_rng(1)
    table = quantize(rng.standard_normal((259, 64)), "q4_0")
    ids = rng.integers(0, 259, (3, 11)).astype(np.int32)
    ids_t = gg.input_tensor(ids.shape, "i32")
    (rows,) = backend.compute([gg.get_rows(gg.constant(table), ids_t)], {ids_t: ids})
    np.testing.assert_array_equal(rows, dequantize(table)[ids])


def llama_forward(cfg, leaves: dict, batch: int):
    """The training forward of models/transformer.py over given leaves (params or
    constants): the family's blocks over one unpacked batch."""
    tokens = gg.input_tensor((batch, cfg.n_ctx), "i32", name="tokens")
    positions = gg.input_tensor((cfg.n_ctx,), "i32", name="positions")
    targets = gg.input_tensor((batch * cfg.n_ctx,), "i32", name="targets")

    def attend(i, q, k, v, scale, window):
        out = attention(cfg, q, k, v, False, scale=scale)
        return gg.reshape(gg.cont(out), (batch, cfg.n_ctx, cfg.q_dim))
    seq = Sequence((batch, cfg.n_ctx), positions, attend)
    x = gg.get_rows(leaves["token_embd.weight"], tokens)
    for i in range(cfg.n_layer):
        x = cfg.family.block(cfg, leaves, i, x, seq)
    logits = output(cfg, leaves, rms_norm(cfg, x, leaves["output_norm.weight"]))
    weights = gg.constant(np.full(batch * cfg.n_ctx, 1 / (batch * cfg.n_ctx), np.float32))
    loss = gg.cross_entropy_ids(gg.reshape(logits, (batch * cfg.n_ctx, cfg.n_vocab)), targets,
                                weights)
    return (tokens, positions, targets), logits, loss


def frozen_base(cfg, values):
    """Matrices as frozen constants, norms as params (the smallest finetune that needs the
    gradient through every frozen product)."""
    return {n: gg.param(v, name=n) if v.ndim == 1 and n != ROPE_FREQS
            else gg.constant(v, name=n) for n, v in values.items()}


def llama_outputs(backend, cfg, values, batch=2):
    leaves = frozen_base(cfg, values)
    inputs, logits, loss = llama_forward(cfg, leaves, batch)
    norms = [t for t in leaves.values() if t.is_param]
    grads = gg.build_backward(loss, norms)
    plan = backend.plan([logits, loss, *grads.values()])
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, cfg.n_vocab, (batch, cfg.n_ctx + 1))
    plan.run(dict(zip(inputs, (tokens[:, :-1].astype(np.int32),
                               np.arange(cfg.n_ctx, dtype=np.int32),
                               tokens[:, 1:].reshape(-1).astype(np.int32)))))
    return tokens[:, :-1], plan.read(logits), {p.name: plan.read(g) for p, g in grads.items()}


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q8_0"])
def test_a_llama_on_a_quantized_base_matches_its_dequantized_f32_twin(wgpu, dtype):
    values = quantize_model(init_parameters(TINY, seed=2), dtype)
    assert sum(isinstance(v, Quantized) for v in values.values()) == 2 + 7 * TINY.n_layer
    dense = {n: dequantize(v) if isinstance(v, Quantized) else v for n, v in values.items()}
    _, logits, grads = llama_outputs(wgpu, TINY, values)
    _, ref_logits, ref_grads = llama_outputs(wgpu, TINY, dense)
    assert testing.nmse(logits, ref_logits) < NMSE
    for name, g in grads.items():     # the gradient went back through every frozen product
        assert testing.nmse(g, ref_grads[name]) < 1e-6, name


def test_a_quantized_model_file_round_trips_its_bytes(tmp_path):
    values = init_parameters(TINY, seed=4)
    mixed = quantize_model(values, "q4_0")
    mixed["output.weight"] = quantize(values["output.weight"], "q8_0")
    mixed["token_embd.weight"] = quantize(values["token_embd.weight"], "f16")
    path = tmp_path / "q.gguf"
    save_model(path, TINY, mixed, ByteTokenizer())

    cfg, kept, _ = load_model(path, keep_quantized=True)
    assert cfg == TINY
    for name, value in mixed.items():
        if isinstance(value, Quantized):
            assert (kept[name].dtype, kept[name].shape) == (value.dtype, value.shape)
            np.testing.assert_array_equal(kept[name].data, value.data)
        else:
            np.testing.assert_array_equal(kept[name], value)
    _, f32, _ = load_model(path)                     # the default: everything float32
    for name, value in mixed.items():
        want = dequantize(value) if isinstance(value, Quantized) else value
        np.testing.assert_array_equal(f32[name], want)

    reader = GGUFReader(path)                        # what gguf-py (and llama.cpp) see
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_0
    assert types["output.weight"] == GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    q = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    np.testing.assert_array_equal(gguf_quants.dequantize(q.data, q.tensor_type),
                                  dequantize(mixed["blk.1.ffn_down.weight"]))
    assert gguf_file.field_value(reader.fields["general.file_type"]) == 2    # MOSTLY_Q4_0


def write_llama(path, cfg, tensors: dict):
    """A llama GGUF written by gguf-py itself: float arrays, `Quantized` values, or raw
    (uint8 rows, GGML type) pairs."""
    writer = GGUFWriter(path, "llama")
    for key, (value, vtype) in gguf_llama.model_metadata(path, cfg, ByteTokenizer(), None).items():
        if key != "general.architecture":
            writer.add_key_value(key, value, vtype)
    for name, value in tensors.items():
        if isinstance(value, Quantized):
            writer.add_tensor(name, value.data.reshape(value.shape[:-1] + (-1,)),
                              raw_dtype=TYPES[value.dtype].ggml)
        elif isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# a published model's shape (grouped-query attention, tied embeddings, Llama 3 rope factors)
# with rows of 256 values: every matrix can take every type
WIDE = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=256, n_head=4, n_head_kv=2,
                   n_layer=2, n_ff=256, n_ctx=8, tied_embeddings=True, rope_freqs=True,
                   rope_freq_base=500000.0)


def test_a_gguf_file_mixing_every_type_loads_each_in_its_type(wgpu, tmp_path):
    """15 matrices of a GQA model with tied embeddings and rope factors, in F32 and the 12
    block types (gguf.quants' quantizers, random valid k-quant blocks): keep_quantized gives
    each in its type with its bytes, dequantized as gguf.quants does, and a llama on that base
    runs on the device as on its f32 twin, both backends giving the logits of the float64
    reference llama."""
    rng = np.random.default_rng(7)
    values = init_parameters(WIDE, seed=7)
    values[ROPE_FREQS] = rng.uniform(1, 8, values[ROPE_FREQS].shape).astype(np.float32)
    matrices = [n for n, v in values.items() if v.ndim == 2]
    kinds = (["f32"] + list(QUANT_TYPES)) * 2
    written = dict(values)
    for name, kind in zip(matrices, kinds):
        if kind != "f32":
            written[name] = random_blocks(kind, values[name].shape, rng, scale=0.1)
    path = tmp_path / "mixed.gguf"
    write_llama(path, WIDE, written)

    reader = {t.name: t for t in GGUFReader(path).tensors}
    _, kept, _ = load_model(path, keep_quantized=True)
    _, dense, _ = load_model(path)
    assert {kept[n].dtype if isinstance(kept[n], Quantized) else "f32" for n in matrices} \
        == {"f32", *QUANT_TYPES}
    for name, value in written.items():
        theirs = gguf_quants.dequantize(reader[name].data, reader[name].tensor_type)
        if isinstance(value, Quantized):
            assert (kept[name].dtype, kept[name].shape) == (value.dtype, value.shape), name
            np.testing.assert_array_equal(kept[name].data, value.data)
            np.testing.assert_array_equal(dequantize(kept[name]), theirs.reshape(value.shape))
        else:
            np.testing.assert_array_equal(kept[name], value)
        np.testing.assert_array_equal(dense[name], theirs.reshape(values[name].shape))

    tokens, logits, grads = llama_outputs(wgpu, WIDE, kept)
    _, ref_logits, ref_grads = llama_outputs(wgpu, WIDE, dense)
    assert testing.nmse(logits, ref_logits) < NMSE
    for name, g in grads.items():
        assert testing.nmse(g, ref_grads[name]) < 1e-6, name
    # and both backends against the llama written out in float64 (gguf.quants' values)
    numpy_tokens, numpy_logits, _ = llama_outputs(NumpyBackend(), WIDE, kept)
    for got in (logits, numpy_logits):
        for row, ids in zip(got.reshape(len(tokens), WIDE.n_ctx, -1), tokens):
            want = testing.reference_logits(WIDE, dense, ids)
            assert testing.nmse(row, want) < 1e-9


def test_unsupported_tensor_types_are_named(tmp_path):
    cfg = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=32, n_head=2, n_layer=1, n_ff=32,
                      n_ctx=4)
    path = tmp_path / "iq4.gguf"
    tensors = dict(init_parameters(cfg))
    # IQ4_NL: 32 values in 18 bytes, a type ggwgpu does not read
    tensors["blk.0.ffn_up.weight"] = (np.zeros((32, 18), np.uint8), GGMLQuantizationType.IQ4_NL)
    write_llama(path, cfg, tensors)
    for keep in (False, True):
        with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight has type IQ4_NL"):
            load_model(path, keep_quantized=keep)


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "bf16", "mxfp4"])
def test_quantize_command_makes_a_frozen_base(tmp_path, dtype):
    values = init_parameters(TINY, seed=6)
    save_model(tmp_path / "f32.gguf", TINY, values, ByteTokenizer())
    result = CliRunner().invoke(cli_main.cli, ["quantize", str(tmp_path / "f32.gguf"),
                                               str(tmp_path / "q.gguf"), "--type", dtype])
    assert result.exit_code == 0, result.output
    assert f"16 of 21 tensors in {dtype}" in result.output
    _, kept, _ = load_model(tmp_path / "q.gguf", keep_quantized=True)
    for name, value in values.items():
        if value.ndim == 2:
            assert kept[name].dtype == dtype
            np.testing.assert_array_equal(kept[name].data, quantize(value, dtype).data)
        else:
            np.testing.assert_array_equal(kept[name], value)
    assert gguf_file.field_value(GGUFReader(tmp_path / "q.gguf").fields["general.file_type"]) \
        == TYPES[dtype].file_type
    result = CliRunner().invoke(cli_main.cli, ["quantize", str(tmp_path / "q.gguf"),
                                               str(tmp_path / "k.gguf"), "--type", "q4_k"])
    assert result.exit_code != 0 and "q4_k" in result.output
    result = CliRunner().invoke(cli_main.cli, ["quantize", str(tmp_path / "none.gguf"),
                                               str(tmp_path / "x.gguf")])
    assert result.exit_code != 0 and "no such file" in result.output


def test_a_quantized_base_plans_less_memory():
    """The planned storage of the frozen-base step above: q4_0 matrices take 18 bytes per
    32 values where f32 takes 128."""
    values = init_parameters(TINY, seed=0)
    sizes = {}
    for dtype in ("f32", "q4_0"):
        leaves = frozen_base(TINY, quantize_model(values, dtype) if dtype != "f32" else values)
        _, _, loss = llama_forward(TINY, leaves, 2)
        grads = gg.build_backward(loss, [t for t in leaves.values() if t.is_param])
        plan = NumpyBackend().plan([loss, *grads.values()])
        constants = sum(plan.nbytes(t) for t in leaves.values() if not t.is_param)
        sizes[dtype] = constants, plan.memory()["planned"]
    f32_weights = sum(v.nbytes for v in values.values() if v.ndim == 2)
    assert sizes["f32"][0] == f32_weights
    assert sizes["q4_0"][0] == f32_weights * 18 // 128
    assert sizes["f32"][1] - sizes["q4_0"][1] == sizes["f32"][0] - sizes["q4_0"][0]


# -- weights larger than one storage binding --------------------------------------------------

BINDING_LIMIT = "max-storage-buffer-binding-size"


def split_limit(nbytes):
    """A binding limit under which a block of `nbytes` is bound as 4 ranges."""
    return nbytes // 7 * 2


def frozen_products(backend, w, x, r, ids):
    """mul_mat_q, its gradient (mul_mat_q_back) and get_rows_q over the frozen `w`."""
    wt, xt, idt = gg.constant(w), gg.input_tensor(x.shape), gg.input_tensor(ids.shape, "i32")
    y = gg.mul_mat(wt, xt)
    dx = gg.build_backward(gg.sum(gg.mul(y, gg.constant(r))), [xt])[xt]
    rows = gg.get_rows(wt, idt)
    plan = backend.plan([y, dx, rows], sentinel=testing.SENTINEL)
    assert set(plan.dispatch_ops) >= {"mul_mat_q", "mul_mat_q_back", "get_rows_q"}
    plan.run({xt: x, idt: ids})
    assert plan.stray_writes() == []
    return plan, [plan.read(t) for t in (y, dx, rows)]


@pytest.mark.parametrize("variant", gg.ops.OPS["mul_mat_q"].variants)
@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_k", "q6_k"])
def test_a_frozen_weight_over_the_binding_limit_is_read_from_4_bindings(
        wgpu, monkeypatch, dtype, variant):
    """The products and rows of a weight bound as 4 ranges are those of the weight bound
    whole, bit for bit: the same kernels, reading each word from the range that holds it."""
    monkeypatch.setitem(wgpu.kernel_variants, "quant", variant)
    rng = np.random.default_rng(3)
    w = random_blocks(dtype, (300, 256), rng)
    x = rng.uniform(-1, 1, (3, 256)).astype(np.float32)
    r = rng.uniform(-1, 1, (3, 300)).astype(np.float32)
    ids = np.array([0, 299, 150, 77, 298, 1, 223], np.int32)
    whole_plan, whole = frozen_products(wgpu, w, x, r, ids)
    (table,) = [t for t in whole_plan.roots if t.dtype == dtype]
    limit = split_limit(whole_plan.nbytes(table))
    monkeypatch.setitem(wgpu.storage_limits, BINDING_LIMIT, limit)
    plan, split = frozen_products(wgpu, w, x, r, ids)
    (big,) = [t for t in plan.roots if plan.nbytes(t) > limit]
    assert big.dtype == dtype and -(-plan.nbytes(big) // plan.part_bytes) == 4
    for a, b in zip(split, whole):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(split[2], dequantize(w)[ids])


def test_a_weight_that_cannot_be_split_over_the_binding_limit_is_refused_by_name(
        wgpu, monkeypatch):
    """Only a frozen block-type weight, read as mul_mat's or get_rows' first operand, is
    split, into at most 4 ranges; anything else over the limit is still a named error."""
    w = quantize(np.ones((64, 256)), "q8_0")                    # 17 408 bytes
    ids = gg.input_tensor((3,), "i32")
    monkeypatch.setitem(wgpu.storage_limits, BINDING_LIMIT, 17408 // 4)
    wgpu.plan([gg.get_rows(gg.constant(w, name="embd"), ids)])  # 4 parts of 4352 bytes
    monkeypatch.setitem(wgpu.storage_limits, BINDING_LIMIT, 17408 // 4 - 32)   # 5 parts
    with pytest.raises(gg.ShapeError, match=r"tensor embd \(64, 256\) needs 17408 bytes.*"
                                            r"split across bindings, into at most 4"):
        wgpu.plan([gg.get_rows(gg.constant(w, name="embd"), ids)])
    dense = gg.constant(np.ones((64, 32), np.float32), name="dense")   # 8 KiB of f32
    with pytest.raises(gg.ShapeError, match=r"tensor dense \(64, 32\) needs 8192 bytes"):
        wgpu.plan([gg.get_rows(dense, ids)])
    monkeypatch.setitem(wgpu.storage_limits, BINDING_LIMIT, 17408 // 4)
    monkeypatch.setitem(wgpu.storage_limits, "max-buffer-size", 16384)   # no buffer holds it
    with pytest.raises(gg.ShapeError, match=r"tensor embd .* max buffer size"):
        wgpu.plan([gg.get_rows(gg.constant(w, name="embd"), ids)])


@pytest.mark.parametrize("dtype", ["q8_0", "f16"])
def test_a_tied_llama_whose_embedding_is_over_the_binding_limit_gives_the_same_numbers(
        wgpu, monkeypatch, dtype):
    """The tied embedding (259 x 256) is read by get_rows_q, by the output projection
    (mul_mat_q) and, for the gradients, by mul_mat_q_back; under a binding limit of a
    quarter of it plus a little, it and every other matrix are bound in ranges."""
    cfg = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=256, n_head=2, n_layer=1,
                      n_ff=256, n_ctx=8, tied_embeddings=True)
    values = quantize_model(init_parameters(cfg, seed=4), dtype)
    embd = values["token_embd.weight"]
    assert isinstance(embd, Quantized) and "output.weight" not in values
    _, whole_logits, whole_grads = llama_outputs(wgpu, cfg, values)
    limit = -(-embd.data.nbytes // 4 // 32) * 32 + 32
    monkeypatch.setitem(wgpu.storage_limits, BINDING_LIMIT, limit)
    assert 3 * limit < embd.data.nbytes
    _, logits, grads = llama_outputs(wgpu, cfg, values)
    np.testing.assert_array_equal(logits, whole_logits)
    assert grads.keys() == whole_grads.keys()
    for name, g in grads.items():
        np.testing.assert_array_equal(g, whole_grads[name], err_msg=name)
