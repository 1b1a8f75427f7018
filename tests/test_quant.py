"""Frozen weights in f16, q8_0 and q4_0: the quantizers against gguf-py's, the kernels that
dequantize inside mul_mat and get_rows against NumPy dequantize-then-f32, a llama whose base
is quantized constants against the same llama in f32, GGUF files and `ggwgpu quantize`."""
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants

import ggwgpu as gg
from ggwgpu import gguf_io, testing
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.gguf_io import GGUFError, load_model, save_model
from ggwgpu.models.llama import (LlamaConfig, attention, feed_forward, init_parameters,
                                 project_qkv, weighted_rms_norm)
from ggwgpu.quant import QUANT_TYPES, Quantized, dequantize, quantize, quantize_model
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu_cli import main as cli_main

GGML = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0,
        "q4_0": GGMLQuantizationType.Q4_0}
NMSE = 1e-7     # kernel against NumPy: both products see the same dequantized values
# n_embd and n_ff multiples of 32: every matrix is quantized; byte vocabulary as `train`
TINY = LlamaConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=64, n_head=2, n_layer=2, n_ff=96,
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


@pytest.mark.parametrize("dtype", QUANT_TYPES)
def test_quantize_matches_gguf_py_bit_for_bit(dtype):
    x = awkward_rows(np.random.default_rng(0))
    q = quantize(x, dtype)
    theirs = gguf_quants.quantize(x, GGML[dtype])
    np.testing.assert_array_equal(q.data, theirs.view(np.uint8).reshape(-1))
    np.testing.assert_array_equal(dequantize(q), gguf_quants.dequantize(theirs, GGML[dtype]))
    assert q.nbytes == {"f16": 768, "q8_0": 408, "q4_0": 216}[dtype]


def test_quantized_values_check_their_rows_and_bytes():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48)), "q4_0")
    with pytest.raises(ValueError, match="bytes of blocks"):
        Quantized("q8_0", (2, 32), np.zeros(34, np.uint8))
    with pytest.raises(ValueError, match="q5_0"):
        quantize(np.zeros(32), "q5_0")


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


def product_case(dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = quantize(rng.uniform(-1, 1, (70, 96)), dtype)
    x = rng.uniform(-1, 1, (2, 33, 96)).astype(np.float32)
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
    """The training forward of models/llama.py over given leaves (params or constants)."""
    tokens = gg.input_tensor((batch, cfg.n_ctx), "i32", name="tokens")
    positions = gg.input_tensor((cfg.n_ctx,), "i32", name="positions")
    targets = gg.input_tensor((batch * cfg.n_ctx,), "i32", name="targets")
    heads = (batch, cfg.n_ctx, cfg.n_head, cfg.head_dim)
    x = gg.get_rows(leaves["token_embd.weight"], tokens)
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        q, k, v = project_qkv(cfg, leaves, b, x, heads, positions)
        att = gg.reshape(gg.cont(attention(cfg, q, k, v, False)), (batch, cfg.n_ctx, cfg.n_embd))
        x = feed_forward(cfg, leaves, b, gg.add(x, gg.mul_mat(leaves[b + "attn_output.weight"],
                                                               att)))
    logits = gg.mul_mat(leaves["output.weight"],
                        weighted_rms_norm(cfg, x, leaves["output_norm.weight"]))
    weights = gg.constant(np.full(batch * cfg.n_ctx, 1 / (batch * cfg.n_ctx), np.float32))
    loss = gg.cross_entropy_ids(gg.reshape(logits, (batch * cfg.n_ctx, cfg.n_vocab)), targets,
                                weights)
    return (tokens, positions, targets), logits, loss


def frozen_base(cfg, values):
    """Matrices as frozen constants, norms as params (the smallest finetune that needs the
    gradient through every frozen product)."""
    return {n: gg.param(v, name=n) if v.ndim == 1 else gg.constant(v, name=n)
            for n, v in values.items()}


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
    return plan.read(logits), {p.name: plan.read(g) for p, g in grads.items()}


@pytest.mark.parametrize("dtype", ["q4_0", "q8_0"])
def test_a_llama_on_a_quantized_base_matches_its_dequantized_f32_twin(wgpu, dtype):
    values = quantize_model(init_parameters(TINY, seed=2), dtype)
    assert sum(isinstance(v, Quantized) for v in values.values()) == 2 + 7 * TINY.n_layer
    dense = {n: dequantize(v) if isinstance(v, Quantized) else v for n, v in values.items()}
    logits, grads = llama_outputs(wgpu, TINY, values)
    ref_logits, ref_grads = llama_outputs(wgpu, TINY, dense)
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
    assert gguf_io.field_value(reader.fields["general.file_type"]) == 2    # MOSTLY_Q4_0


def test_unsupported_tensor_types_are_named(tmp_path):
    cfg = LlamaConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=32, n_head=2, n_layer=1, n_ff=32,
                      n_ctx=4)
    path = tmp_path / "q5.gguf"
    writer = GGUFWriter(path, "llama")
    for key, (value, vtype) in gguf_io._model_metadata(path, cfg, ByteTokenizer(), None).items():
        if key != "general.architecture":
            writer.add_key_value(key, value, vtype)
    for name, value in init_parameters(cfg).items():
        if name == "blk.0.ffn_up.weight":   # Q5_0: 32 values in 22 bytes
            writer.add_tensor(name, np.zeros((32, 22), np.uint8),
                              raw_dtype=GGMLQuantizationType.Q5_0)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for keep in (False, True):
        with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight has type Q5_0"):
            load_model(path, keep_quantized=keep)


def test_quantize_command_makes_a_q4_0_base(tmp_path):
    values = init_parameters(TINY, seed=6)
    save_model(tmp_path / "f32.gguf", TINY, values, ByteTokenizer())
    result = CliRunner().invoke(cli_main.cli, ["quantize", str(tmp_path / "f32.gguf"),
                                               str(tmp_path / "q4.gguf"), "--type", "q4_0"])
    assert result.exit_code == 0, result.output
    assert "16 of 21 tensors in q4_0" in result.output
    _, kept, _ = load_model(tmp_path / "q4.gguf", keep_quantized=True)
    for name, value in values.items():
        if value.ndim == 2:
            np.testing.assert_array_equal(kept[name].data, quantize(value, "q4_0").data)
        else:
            np.testing.assert_array_equal(kept[name], value)
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
        sizes[dtype] = constants, plan.storage_layout().total_bytes
    f32_weights = sum(v.nbytes for v in values.values() if v.ndim == 2)
    assert sizes["f32"][0] == f32_weights
    assert sizes["q4_0"][0] == f32_weights * 18 // 128
    assert sizes["f32"][1] - sizes["q4_0"][1] == sizes["f32"][0] - sizes["q4_0"][0]
