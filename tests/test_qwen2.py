"""Qwen2 / Qwen2.5 (llama.cpp's arch "qwen2"): the llama block with Q/K/V biases and neox rope,
its keys under "qwen2.". Files and checkpoints keep the arch; finetune (LoRA and --full),
adapters, merge and quantize are test_families.py's, as every family's. The logits against
the float64 reference and the gradients (biases included) are in test_llama.py's matrix
(CONFIGS["qwen2"]); the KV cache against the full forward in test_generate.py."""
import dataclasses
import json

import numpy as np
import pytest
from gguf import GGUFReader

from ggwgpu import gguf_file, gguf_llama
from ggwgpu.training.checkpoint import load_checkpoint, save_checkpoint
from ggwgpu.gguf_file import GGUFError
from ggwgpu.gguf_llama import load_model, save_model
from ggwgpu.models import ModelConfig, init_parameters, parameter_shapes
from ggwgpu.tokenizer import ByteTokenizer
from conftest import train_state

# as Qwen2.5-0.5B: grouped-query attention, tied embeddings, n_rot = head_dim (8)
QWEN2 = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=16, n_head=2, n_head_kv=1, n_layer=2,
                    n_ff=32, n_ctx=16, tied_embeddings=True, rope_freq_base=1e6, norm_eps=1e-6,
                    arch="qwen2")
BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def qwen2_values(cfg=QWEN2, seed=1):
    """init_parameters with random, non-zero biases (init makes them 0)."""
    rng = np.random.default_rng(seed)
    values = init_parameters(cfg, seed)
    return {k: rng.uniform(-0.5, 0.5, v.shape).astype(np.float32) if k.endswith(".bias") else v
            for k, v in values.items()}


def qwen2_file(path, cfg=QWEN2, values=None):
    save_model(path, cfg, qwen2_values(cfg) if values is None else values, ByteTokenizer())
    return path


def biases(values):
    return {k: v for k, v in values.items() if k.endswith(".bias")}


def test_a_qwen2_has_q_k_v_biases_shaped_as_its_projections_and_ropes_neox():
    shapes = parameter_shapes(QWEN2)
    assert {n: shapes[f"blk.1.{n}"] for n in BIASES} == \
        {"attn_q.bias": (16,), "attn_k.bias": (8,), "attn_v.bias": (8,)}
    assert len(biases(shapes)) == 3 * QWEN2.n_layer and "output.weight" not in shapes
    assert QWEN2.rope_mode == "neox" and ModelConfig().rope_mode == "normal"
    assert not biases(parameter_shapes(dataclasses.replace(QWEN2, arch="llama")))
    initial = biases(init_parameters(QWEN2))
    assert len(initial) == 6 and not any(v.any() for v in initial.values())
    with pytest.raises(ValueError, match="arch 'jais' is not one of llama, qwen2"):
        ModelConfig(arch="jais")


def test_a_qwen2_file_has_its_keys_under_qwen2_and_reads_back_exactly(tmp_path):
    values = qwen2_values()
    path = qwen2_file(tmp_path / "q.gguf", values=values)
    reader = GGUFReader(path)
    keys = set(reader.fields)
    assert reader.fields["general.architecture"].contents() == "qwen2"
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length",
                "attention.head_count", "attention.head_count_kv", "rope.dimension_count",
                "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size"):
        assert f"qwen2.{key}" in keys and f"llama.{key}" not in keys
    assert reader.fields["qwen2.attention.head_count_kv"].contents() == 1
    assert reader.fields["qwen2.rope.dimension_count"].contents() == 8
    names = {t.name for t in reader.tensors}
    assert {f"blk.{i}.{n}" for i in range(2) for n in BIASES} <= names
    assert "output.weight" not in names

    cfg, got, _ = load_model(path)
    assert cfg == QWEN2
    assert got.keys() == values.keys()
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # without ggwgpu.config_json (a file of llama.cpp's converter) the qwen2.* keys say it all
    meta = gguf_llama.model_metadata(path, QWEN2, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]
    gguf_file.write_gguf(tmp_path / "plain.gguf", meta, values)
    cfg, _, _ = load_model(tmp_path / "plain.gguf")
    assert cfg.arch == "qwen2" and cfg.tied_embeddings and cfg.kv_heads == 1
    assert cfg.norm_eps == pytest.approx(1e-6) and cfg.rope_freq_base == 1e6


def test_a_qwen2_file_without_a_bias_or_with_llama_keys_is_refused_naming_it(tmp_path):
    values = qwen2_values()
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", QWEN2, ByteTokenizer(), None)
    for name in ("blk.1.attn_k.bias", "blk.0.attn_v.bias"):
        path = tmp_path / "missing.gguf"
        gguf_file.write_gguf(path, meta, {k: v for k, v in values.items() if k != name})
        with pytest.raises(GGUFError, match=f"tensor {name} is missing"):
            load_model(path)
    # a llama's keys under a qwen2 architecture: the qwen2.* keys are what is missing
    llama = dataclasses.replace(QWEN2, arch="llama")
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", llama, ByteTokenizer(), None)
    meta[gguf_file.K_ARCH] = ("qwen2", meta[gguf_file.K_ARCH][1])
    gguf_file.write_gguf(tmp_path / "mixed.gguf", meta, values)
    with pytest.raises(GGUFError, match="qwen2.embedding_length"):
        load_model(tmp_path / "mixed.gguf")
    # a llama file with biases: a llama has no such parameter
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", llama, ByteTokenizer(), None)
    gguf_file.write_gguf(tmp_path / "llama.gguf", meta, values)
    with pytest.raises(GGUFError, match="unexpected tensor blk.0.attn_q.bias: a llama with"):
        load_model(tmp_path / "llama.gguf")
    meta[gguf_file.K_ARCH] = ("jais", meta[gguf_file.K_ARCH][1])
    gguf_file.write_gguf(tmp_path / "jais.gguf", meta, values)
    with pytest.raises(GGUFError, match=r"'jais' \(ggwgpu does not compute its LayerNorm blocks "
                                        r"yet\); ggwgpu reads 'llama', 'qwen2'.* models only"):
        load_model(tmp_path / "jais.gguf")
    meta[gguf_file.K_ARCH] = ("t5", meta[gguf_file.K_ARCH][1])    # an arch of no known lack
    gguf_file.write_gguf(tmp_path / "t5.gguf", meta, values)
    with pytest.raises(GGUFError, match="'t5'; ggwgpu reads 'llama', 'qwen2'.* models only"):
        load_model(tmp_path / "t5.gguf")


def test_a_config_json_from_before_the_arch_field_loads_as_a_llama(tmp_path):
    """Files written before ModelConfig.arch hold a config JSON without it: still exact."""
    cfg = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=16, n_head=2, n_layer=1, n_ff=32,
                      n_ctx=8, norm_eps=1e-6 / 3)          # not a float32: only the JSON has it
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "arch"}
    meta[gguf_llama.K_CONFIG_JSON] = (json.dumps(old), meta[gguf_llama.K_CONFIG_JSON][1])
    gguf_file.write_gguf(tmp_path / "old.gguf", meta, init_parameters(cfg))
    assert load_model(tmp_path / "old.gguf")[0] == cfg


def test_a_qwen2_checkpoint_round_trips_with_its_arch_and_bias_moments(tmp_path):
    values = qwen2_values()
    moments = {name: (np.full_like(v, 0.5), np.full_like(v, 0.25)) for name, v in values.items()}
    save_checkpoint(tmp_path / "c.gguf", QWEN2, values, ByteTokenizer(), moments, train_state(3))
    cfg, got, _, opt_state, state = load_checkpoint(tmp_path / "c.gguf")
    assert cfg == QWEN2 and state.step == 3
    np.testing.assert_array_equal(got["blk.1.attn_q.bias"], values["blk.1.attn_q.bias"])
    np.testing.assert_array_equal(opt_state["blk.0.attn_v.bias"][0], moments["blk.0.attn_v.bias"][0])
    # a qwen2 model is a model, not a checkpoint, as a llama is
    with pytest.raises(GGUFError, match="is a model, not a training checkpoint"):
        load_checkpoint(qwen2_file(tmp_path / "m.gguf"))
