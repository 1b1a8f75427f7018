"""LoRA on the llama graph: an untrained adapter changes nothing, its gradients against finite
differences, adapter files as llama.cpp reads them, merging."""
import numpy as np
import pytest
from gguf import GGUFReader

import ggwgpu as gg
from ggwgpu import gguf_file, gguf_llama, testing
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.generate import Decoder
from ggwgpu.graph import topo_order
from ggwgpu.gguf_file import GGUFError
from ggwgpu.lora import (Adapter, init_adapter, load_adapter, load_adapter_checkpoint,
                         lora_ranks, merge, save_adapter, save_adapter_checkpoint)
from ggwgpu.models import ModelConfig, build_train_graph, init_parameters
from ggwgpu.quant import quantize_model
from ggwgpu.tokenizer import ByteTokenizer
from conftest import train_state

TINY = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=5, n_rot=4)
BATCH = 2
# every kind of target, two ranks, one block only: pairs on some weights, not on others
RANKS = lora_ranks(TINY, r=2, ranks={"tok_embd": 3, "wk": 0, "ffn_down": 1}, layers=[1])


def trained_adapter(cfg=TINY, ranks=RANKS, alpha=3.0, seed=1) -> Adapter:
    """An adapter whose B is not zero, as after some training: every pair matters."""
    adapter = init_adapter(cfg, ranks, alpha, seed)
    rng = np.random.default_rng(seed + 1)
    for name, value in adapter.tensors.items():
        if name.endswith(".lora_b"):
            adapter.tensors[name] = rng.uniform(-0.5, 0.5, value.shape).astype(np.float32)
    return adapter


def batch_feeds(g, cfg=TINY, seed=3):
    tokens = np.random.default_rng(seed).integers(0, cfg.n_vocab, (BATCH, cfg.n_ctx + 1))
    return {**g.feeds(tokens[:, :-1], tokens[:, 1:]),
            g.positions: np.arange(cfg.n_ctx, dtype=np.int32)}


def logits_of(backend, values, lora=None, cfg=TINY):
    g = build_train_graph(cfg, values, BATCH, lora=lora)
    plan = backend.plan(g.logits)
    plan.run({t: v for t, v in batch_feeds(g, cfg).items() if t in (g.tokens, g.positions)})
    return g.read_logits(plan)


def test_ranks_follow_the_options():
    assert RANKS["token_embd.weight"] == 3 and RANKS["output.weight"] == 2
    assert RANKS["blk.1.attn_q.weight"] == 2 and RANKS["blk.1.ffn_down.weight"] == 1
    assert "blk.1.attn_k.weight" not in RANKS and not any(n.startswith("blk.0.") for n in RANKS)
    with pytest.raises(ValueError, match="layer 2 does not exist"):
        lora_ranks(TINY, layers=[2])
    with pytest.raises(ValueError, match="no weight gets a LoRA pair"):
        lora_ranks(TINY, r=0)


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_an_untrained_adapter_gives_exactly_the_base_logits(backend_name, request):
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    values = init_parameters(TINY, seed=2)
    adapter = init_adapter(TINY, RANKS, alpha=4.0, seed=5)
    assert all(np.any(v) for n, v in adapter.tensors.items() if n.endswith(".lora_a"))
    np.testing.assert_array_equal(logits_of(backend, values, adapter), logits_of(backend, values))


def test_lora_params_are_the_adapter_and_the_base_is_frozen():
    values = init_parameters(TINY)
    adapter = init_adapter(TINY, RANKS, 4.0)
    g = build_train_graph(TINY, values, BATCH, lora=adapter)
    assert set(g.params) == set(adapter.tensors)
    leaves = [t for t in topo_order([g.loss]) if t.op is None and t.value is not None]
    frozen = {t.name for t in leaves if not t.is_param}
    assert set(values) <= frozen


def test_a_lora_pair_scales_and_adds_in_its_second_product():
    """y = W x + scale B (A x) is two products and one with an epilogue: no scale or add
    node for any pair, forward or backward (alpha goes into the gradient products)."""
    adapter = trained_adapter()
    g = build_train_graph(TINY, init_parameters(TINY), BATCH, lora=adapter)
    grads = gg.build_backward(g.loss, list(g.params.values()))
    nodes = [n for n in topo_order([g.loss, *grads.values()]) if n.op is not None]
    pairs = sum(1 for name in adapter.tensors if name.endswith(".lora_a"))
    forward = [n for n in topo_order([g.loss])
               if n.op == "mul_mat_acc" and n.srcs[0].name.endswith(".lora_b")]
    assert len(forward) == pairs
    assert {n.params["alpha"] for n in forward} == {adapter.scale(n) for n in RANKS}
    assert not [n for n in nodes if n.op == "scale"]


def test_lora_gradients_match_finite_differences():
    backend = NumpyBackend(np.float64)
    rng = np.random.default_rng(0)
    values = init_parameters(TINY, seed=1)
    values = {k: v if v.ndim > 1 else rng.uniform(0.5, 1.5, v.shape).astype(np.float32)
              for k, v in values.items()}
    g = build_train_graph(TINY, values, BATCH, lora=trained_adapter())
    grads = gg.build_backward(g.loss, list(g.params.values()))
    feeds = batch_feeds(g)
    plan = backend.plan([g.loss, *grads.values()])
    plan.run(feeds)
    analytic = {p: plan.read(grad) for p, grad in grads.items()}
    for p, grad in analytic.items():
        assert np.any(grad), p.name
    testing.spot_check_gradients(g.loss, analytic, feeds, samples=4)


def test_lora_gradients_on_the_device_match_numpy(wgpu):
    values = init_parameters(TINY, seed=1)
    g = build_train_graph(TINY, values, BATCH, lora=trained_adapter())
    grads = gg.build_backward(g.loss, list(g.params.values()))
    feeds = batch_feeds(g)
    results = []
    for backend in (NumpyBackend(np.float64), wgpu):
        plan = backend.plan([g.loss, *grads.values()])
        plan.run(feeds)
        results.append({p.name: plan.read(d) for p, d in grads.items()})
    ref, dev = results
    for name in ref:
        assert testing.nmse(dev[name], ref[name]) < 1e-8, name


def test_an_adapter_file_round_trips_with_llama_cpp_shapes_and_keys(tmp_path):
    adapter = trained_adapter()
    path = tmp_path / "adapter.gguf"
    save_adapter(path, adapter, TINY, base_digest="0123")
    back = load_adapter(path, TINY)
    assert back.alpha == adapter.alpha and back.tensors.keys() == adapter.tensors.keys()
    for name, value in adapter.tensors.items():
        np.testing.assert_array_equal(back.tensors[name], value)

    reader = GGUFReader(path)
    meta = {k: gguf_file.field_value(f) for k, f in reader.fields.items()}
    assert (meta["general.architecture"], meta["general.type"], meta["adapter.type"]) == \
        ("llama", "adapter", "lora")
    assert meta["adapter.lora.alpha"] == 3.0
    ne = {t.name: t.shape.tolist() for t in reader.tensors}     # ggml order: ne0 first
    e, f, v = TINY.n_embd, TINY.n_ff, TINY.n_vocab
    assert ne["blk.1.ffn_up.weight.lora_a"] == [e, 2]            # [n_in, r]
    assert ne["blk.1.ffn_up.weight.lora_b"] == [2, f]            # [r, n_out]
    assert ne["blk.1.ffn_down.weight.lora_a"] == [f, 1]
    assert ne["token_embd.weight.lora_a"] == [3, v]              # flipped: get_rows on A
    assert ne["token_embd.weight.lora_b"] == [3, e]
    assert ne["output.weight.lora_a"] == [e, 2] and ne["output.weight.lora_b"] == [2, v]


def test_adapter_files_are_validated_against_the_base(tmp_path):
    path = tmp_path / "adapter.gguf"
    save_adapter(path, trained_adapter(), TINY)
    wider = ModelConfig(n_vocab=11, n_embd=12, n_head=2, n_layer=2, n_ff=12, n_ctx=5)
    with pytest.raises(GGUFError, match=r"adapter\.gguf: LoRA pair of token_embd\.weight has "
                                        r"shapes"):
        load_adapter(path, wider)
    shallow = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=5)
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_q\.weight\.lora_a adapts "
                                        r"blk\.1\.attn_q\.weight, which is not a matrix"):
        load_adapter(path, shallow)
    half = trained_adapter()
    del half.tensors["output.weight.lora_b"]
    with pytest.raises(GGUFError, match=r"output\.weight\.lora_a has no output\.weight\.lora_b"):
        save_adapter(tmp_path / "half.gguf", half, TINY)
    model = tmp_path / "model.gguf"
    byte_cfg = ModelConfig(n_vocab=ByteTokenizer().n_vocab, n_embd=8, n_head=2, n_layer=1,
                           n_ff=8, n_ctx=4)
    gguf_llama.save_model(model, byte_cfg, init_parameters(byte_cfg), ByteTokenizer())
    with pytest.raises(GGUFError, match=r"model\.gguf: general\.type is 'model'"):
        load_adapter(model, TINY)


def test_a_checkpoint_holds_adapter_moments_and_state(tmp_path):
    adapter = trained_adapter()
    moments = {n: (v + 1, v * v + 2) for n, v in adapter.tensors.items()}
    path = tmp_path / "ckpt.gguf"
    saved = train_state(3, base="ab", mode="lora", samples_after_nl=False)
    save_adapter_checkpoint(path, adapter, TINY, moments, saved)
    back, opt_state, state = load_adapter_checkpoint(path, TINY)
    assert state.to_json() == saved and back.alpha == adapter.alpha
    for name, (m, v) in moments.items():
        np.testing.assert_array_equal(back.tensors[name], adapter.tensors[name])
        np.testing.assert_array_equal(opt_state[name][0], m)
        np.testing.assert_array_equal(opt_state[name][1], v)
    with pytest.raises(GGUFError, match="is a finetune checkpoint, not an adapter"):
        load_adapter(path, TINY)


@pytest.mark.parametrize("change, words", [
    (lambda s: s["options"].update(cos_decay_steps=0, restarts=True),
     ["options.cos_decay_steps"]),
    (lambda s: s.pop("samples_after_nl"), ["samples_after_nl is missing"]),
    (lambda s: s.update(mode="half"), ["mode must be one of lora, full"]),
])
def test_an_adapter_checkpoint_state_is_checked_as_a_model_checkpoint_state(tmp_path, change,
                                                                             words):
    adapter = trained_adapter()
    state = train_state(3, base="ab", mode="lora", samples_after_nl=False)
    change(state)
    path = tmp_path / "ckpt.gguf"
    save_adapter_checkpoint(path, adapter, TINY, {}, state)
    with pytest.raises(GGUFError) as e:
        load_adapter_checkpoint(path, TINY)
    for word in [str(path), "training.state_json", *words]:
        assert word in str(e.value)


def test_merging_gives_the_logits_of_base_plus_adapter():
    backend = NumpyBackend(np.float64)
    values = init_parameters(TINY, seed=4)
    adapter = trained_adapter()
    with_adapter = logits_of(backend, values, adapter)
    merged = logits_of(backend, merge(TINY, values, [adapter])[1])
    assert not np.allclose(with_adapter, logits_of(backend, values), atol=1e-3)
    np.testing.assert_allclose(merged, with_adapter, rtol=1e-5, atol=1e-6)


def test_the_decoder_applies_adapters_as_merging_them_does():
    backend = NumpyBackend(np.float64)
    values = init_parameters(TINY, seed=4)
    adapters = [trained_adapter(seed=1),
                trained_adapter(ranks=lora_ranks(TINY, r=1), alpha=0.0, seed=7)]
    tokens = [1, 4, 7, 2]
    with_adapters = Decoder(backend, TINY, values, adapters=adapters).prefill(tokens)
    merged = Decoder(backend, TINY, merge(TINY, values, adapters)[1]).prefill(tokens)
    np.testing.assert_allclose(with_adapters, merged, rtol=1e-5, atol=1e-6)


def test_an_untrained_adapter_on_a_q4_0_base_decodes_as_the_base(wgpu):
    cfg = ModelConfig(n_vocab=32, n_embd=32, n_head=2, n_layer=1, n_ff=64, n_ctx=6)
    base = quantize_model(init_parameters(cfg, seed=3), "q4_0")
    adapter = init_adapter(cfg, lora_ranks(cfg), 4.0)
    tokens = [1, 5, 9]
    np.testing.assert_array_equal(Decoder(wgpu, cfg, base, adapters=[adapter]).prefill(tokens),
                                  Decoder(wgpu, cfg, base).prefill(tokens))


# grouped-query attention with tied embeddings: K and V pairs are narrower than Q's, and a
# pair on the output adapts token_embd read as the output matrix
GQA_TIED = ModelConfig(n_vocab=11, n_embd=8, n_head=4, n_head_kv=2, n_layer=1, n_ff=12,
                       n_ctx=5, tied_embeddings=True)


def test_a_tied_model_gets_no_pair_on_its_embeddings_unless_asked():
    ranks = lora_ranks(GQA_TIED, r=2)
    assert "token_embd.weight" not in ranks and "output.weight" not in ranks
    assert ranks["blk.0.attn_k.weight"] == 2
    adapter = init_adapter(GQA_TIED, ranks, 2.0)
    assert adapter.tensors["blk.0.attn_k.weight.lora_b"].shape == (4, 2)     # kv_dim 2 x 2
    asked = lora_ranks(GQA_TIED, r=2, ranks={"out": 3, "tok_embd": 1})
    assert asked["output.weight"] == 3 and asked["token_embd.weight"] == 1


def test_lora_on_a_tied_gqa_model_starts_at_the_base_and_merges_untied(tmp_path):
    backend = NumpyBackend(np.float64)
    values = init_parameters(GQA_TIED, seed=4)
    assert "output.weight" not in values
    ranks = lora_ranks(GQA_TIED, r=2, ranks={"out": 3, "tok_embd": 2})
    fresh = init_adapter(GQA_TIED, ranks, 4.0)
    np.testing.assert_array_equal(logits_of(backend, values, fresh, GQA_TIED),
                                  logits_of(backend, values, cfg=GQA_TIED))
    adapter = trained_adapter(GQA_TIED, ranks)
    with_adapter = logits_of(backend, values, adapter, GQA_TIED)
    cfg, merged = merge(GQA_TIED, values, [adapter])
    assert not cfg.tied_embeddings and "output.weight" in merged
    np.testing.assert_allclose(logits_of(backend, merged, cfg=cfg), with_adapter,
                               rtol=1e-5, atol=1e-6)


Q_CFG = ModelConfig(n_vocab=32, n_embd=32, n_head=2, n_layer=2, n_ff=64, n_ctx=6)


def test_a_merge_stores_its_weights_as_asked():
    """auto (llama.cpp's llama-export-lora): the weights a pair changes in f16 over a
    quantized base, f32 over an f32 one, the rest as stored; f32: all f32; a block type:
    as quantize_model writes the merged f32 model, unchanged weights of that type kept."""
    from ggwgpu.quant import Quantized, dequantize, quantize
    f32 = init_parameters(Q_CFG, seed=3)
    base = quantize_model(f32, "q8_0")
    ranks = lora_ranks(Q_CFG, r=2, layers=[1])
    adapter = trained_adapter(Q_CFG, ranks)
    changed = set(adapter.weights())
    want = merge(Q_CFG, {n: dequantize(v) if isinstance(v, Quantized) else v
                         for n, v in base.items()}, [adapter], "f32")[1]
    auto = merge(Q_CFG, base, [adapter])[1]
    for name, value in auto.items():
        if name in changed:
            assert value.dtype == "f16"
            np.testing.assert_array_equal(dequantize(value), want[name].astype(np.float16))
        else:
            assert value is base[name]
    assert all(merge(Q_CFG, f32, [adapter])[1][n].dtype == np.float32 for n in changed)
    assert {type(v) for v in merge(Q_CFG, base, [adapter], "f32")[1].values()} == {np.ndarray}
    for dtype in ("q8_0", "q4_0"):
        stored = merge(Q_CFG, base, [adapter], dtype)[1]
        quantized = quantize_model(want, dtype)
        for name, value in stored.items():
            if dtype == "q8_0" and name not in changed and isinstance(base[name], Quantized):
                assert value is base[name]
            elif isinstance(value, Quantized):
                assert value.dtype == dtype
                np.testing.assert_array_equal(value.data, quantized[name].data)
            else:
                assert value.ndim == 1, name        # norms stay f32
    np.testing.assert_array_equal(
        merge(Q_CFG, base, [adapter], "q4_0")[1]["blk.1.attn_q.weight"].data,
        quantize(want["blk.1.attn_q.weight"], "q4_0").data)
    with pytest.raises(ValueError, match="cannot store a merged model as 'q4_k'"):
        merge(Q_CFG, base, [adapter], "q4_k")


def test_a_bases_digest_is_the_one_earlier_checkpoints_hold():
    """Config fields added later leave the digest of a model that does not use them as it
    was (the values here were written by a ggwgpu before those fields), so that finetune
    checkpoints written then still resume."""
    from ggwgpu.lora import model_digest
    from ggwgpu.models import init_parameters
    for arch, want in (("llama", "be72450dbf2b0654"), ("qwen3", "1a6000f60ae7f235")):
        cfg = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=5,
                          arch=arch)
        assert model_digest(cfg, init_parameters(cfg, 0)) == want, arch
